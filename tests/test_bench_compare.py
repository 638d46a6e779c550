"""bench/tools/compare_table.py: what the before/after table of two trees says about each figure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "tools"))
from compare_table import figures, table, verdict


def test_a_figure_moves_only_beyond_three_percent_and_in_its_own_direction() -> None:
    assert verdict(100.0, 102.9, lower_is_better=False) == "same"
    assert verdict(100.0, 96.0, lower_is_better=False) == "SLOWER"
    assert verdict(100.0, 104.0, lower_is_better=False) == "faster"
    assert verdict(5.0, 5.5, lower_is_better=True) == "SLOWER"  # seconds: more is worse
    assert verdict(5.0, 4.5, lower_is_better=True) == "faster"


def test_the_table_takes_warm_steps_and_names_a_missing_part(tmp_path: Path) -> None:
    def steps(*tok_s: float) -> dict:
        return {"steps": [{"perf/throughput": t, "timing_s/step": 1e5 / t} for t in tok_s]}

    (tmp_path / "seed_old.json").write_text(json.dumps(steps(1.0, 30_000, 32_000, 31_000)))
    (tmp_path / "seed_new.json").write_text(json.dumps(steps(1.0, 25_000, 26_000, 24_000)))
    (tmp_path / "rollout_new.json").write_text(json.dumps({"native_tok_per_s": 140_000}))
    old, new = figures(tmp_path, "old"), figures(tmp_path, "new")
    assert old["seed PPO step: tok/s/GPU"] == 31_000  # the median of the warm steps; the first is left out
    rows = table(old, new).splitlines()
    seed = next(r for r in rows if r.startswith("| seed PPO step: tok/s/GPU"))
    assert seed.endswith("| 0.806 | SLOWER |")
    rollout = next(r for r in rows if r.startswith("| rollout: native engine"))
    assert "missing" in rollout and rollout.endswith("| — | — |")


def test_rounds_of_a_part_are_pooled_over_their_warm_steps(tmp_path: Path) -> None:
    def steps(*tok_s: float) -> dict:
        return {"steps": [{"perf/throughput": t, "timing_s/step": 1e5 / t} for t in tok_s]}

    # one round on a slow host, one on a fast one: the median of all warm steps, not of one round
    (tmp_path / "grpo_old_r1.json").write_text(json.dumps(steps(1.0, 56_000, 57_000, 58_000)))
    (tmp_path / "grpo_old_r2.json").write_text(json.dumps(steps(1.0, 62_000, 63_000, 64_000)))
    (tmp_path / "grpo_new_r1.json").write_text(json.dumps(steps(1.0, 60_000, 61_000, 59_000)))
    old, new = figures(tmp_path, "old"), figures(tmp_path, "new")
    assert old["GRPO step 64 x 8: tok/s/GPU"] == 60_000  # (58,000 + 62,000) / 2 over six warm steps
    assert new["GRPO step 64 x 8: tok/s/GPU"] == 60_000
