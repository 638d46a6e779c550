"""Score tests/verl_ref/cases.py with verl's own `default_compute_score` into tests/fixtures/verl_reward_scores.json.

    python tests/verl_ref/make_verl_scores.py --verl /path/to/verl   # a verl source checkout (Apache-2.0)

Only verl's `verl/utils/reward_score/` and `verl/utils/{py_functional,import_utils}.py` are imported
(verl's package __init__, which needs ray and torch, is bypassed). Needs sympy and pylatexenc. The
fixture records the verl commit it was made with; the parity test reads only the fixture.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "fixtures" / "verl_reward_scores.json"


def import_verl_scorers(verl: Path) -> types.ModuleType:
    """verl.utils.reward_score from the checkout at `verl`, with verl's heavy package imports stubbed."""
    for name, path in (("verl", verl / "verl"), ("verl.utils", verl / "verl" / "utils")):
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules[name] = module
    metric = types.ModuleType("verl.utils.metric")
    metric.Metric = object  # type: ignore[attr-defined]  # py_functional imports it, the scorers never use it
    sys.modules["verl.utils.metric"] = metric
    import importlib

    return importlib.import_module("verl.utils.reward_score")


def plain(value: object) -> object:
    """A verl result as JSON: numbers as floats, a dict's values likewise (bools kept)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    return float(value)  # type: ignore[arg-type]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verl", required=True, type=Path, help="a verl source checkout")
    parser.add_argument(
        "--commit", default=None, help="the checkout's commit, when it is not a git work tree"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from cases import all_cases, expand

    scorers = import_verl_scorers(args.verl.resolve())
    commit = (
        args.commit
        or subprocess.run(
            ["git", "-C", str(args.verl), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    )
    rows = []
    for data_source, response, truth in all_cases():
        score = scorers.default_compute_score(data_source, expand(response), truth)
        rows.append(
            {"data_source": data_source, "response": response, "ground_truth": truth, "verl": plain(score)}
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps({"verl_commit": commit or "unknown", "cases": rows}, ensure_ascii=False, indent=0) + "\n"
    )
    print(f"{len(rows)} cases -> {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
