"""The table of `bench/tools/compare_trees.sh`: each figure of the old and the new tree and their ratio.

    python bench/tools/compare_table.py WORK      # WORK holds rollout_{old,new}.json, seed_*.json, grpo_*.json

A step part run in several rounds (`ROUNDS=2 bash bench/tools/compare_trees.sh`) leaves one JSON a round,
`grpo_old_r1.json`, `grpo_old_r2.json`, ...: its figure is the median over the warm steps of every round,
so that one run's host drift weighs no more than one round. A figure moves when new / old leaves [1 - TOLERANCE, 1 + TOLERANCE] (the 3 % that a refactor may not
exceed); a part that left no JSON is named as missing, not counted as a change.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

TOLERANCE = 0.03


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except json.JSONDecodeError:
        return None


def rollout_figures(summary: dict[str, Any]) -> dict[str, float]:
    """The engine's generated tok/s at 512 x 256, and at the GRPO shape with the prefix shared."""
    out = {"rollout: native engine, generated tok/s": float(summary["native_tok_per_s"])}
    shared = (summary.get("grpo") or {}).get("shared")
    if shared:
        out["rollout: GRPO shape, prefix shared, tok/s"] = float(shared["tok_per_s"])
    return out


def warm_steps(summary: dict[str, Any]) -> list[dict[str, float]]:
    """A train_step.py run's steps after the first (which loads and compiles); the first when alone."""
    steps = summary.get("steps") or []
    return steps[1:] or steps


def step_figures(runs: list[dict[str, Any]], label: str) -> dict[str, float]:
    """tok/s/GPU and seconds of one or more train_step.py runs: the median over their warm steps."""
    warm = [step for run in runs for step in warm_steps(run)]
    if not warm:
        return {}
    return {
        f"{label}: tok/s/GPU": statistics.median(s.get("perf/throughput", 0.0) for s in warm),
        f"{label}: step s (lower is better)": statistics.median(s.get("timing_s/step", 0.0) for s in warm),
    }


def figures(work: Path, tree: str) -> dict[str, float]:
    """Every figure one tree left in `work`."""
    out: dict[str, float] = {}
    if (r := _load(work / f"rollout_{tree}.json")) and "native_tok_per_s" in r:
        out.update(rollout_figures(r))
    for part, label in (("seed", "seed PPO step"), ("grpo", "GRPO step 64 x 8")):
        paths = [work / f"{part}_{tree}.json", *sorted(work.glob(f"{part}_{tree}_r*.json"))]
        runs = [s for s in map(_load, paths) if s]
        if runs:
            out.update(step_figures(runs, label))
    return out


def verdict(old: float, new: float, lower_is_better: bool) -> str:
    """`same` within the tolerance, else `faster` / `SLOWER` by the ratio."""
    if old <= 0:
        return "—"
    ratio = new / old
    if abs(ratio - 1) <= TOLERANCE:
        return "same"
    better = ratio < 1 if lower_is_better else ratio > 1
    return "faster" if better else "SLOWER"


def table(old: dict[str, float], new: dict[str, float]) -> str:
    lines = ["| figure | old | new | new / old | within 3 % |", "| --- | --- | --- | --- | --- |"]
    for name in list(dict.fromkeys([*old, *new])):
        if name not in old or name not in new:
            lines.append(f"| {name} | {old.get(name, 'missing')} | {new.get(name, 'missing')} | — | — |")
            continue
        o, n = old[name], new[name]
        ratio = f"{n / o:.3f}" if o else "—"
        lines.append(
            f"| {name} | {o:,.2f} | {n:,.2f} | {ratio} | {verdict(o, n, 'lower is better' in name)} |"
        )
    return "\n".join(lines)


def main() -> None:
    work = Path(sys.argv[1])
    print(table(figures(work, "old"), figures(work, "new")))


if __name__ == "__main__":
    main()
