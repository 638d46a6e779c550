"""`trainer.wall_clock_budget_s`: the step chosen as the last one still fits with its validation and save,
and a step after it would not; a run given a budget ends on such a step, validating and saving there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import make_assets, short_run_overrides

from fulcrum.trainer.checkpoint import read_latest_step
from fulcrum.trainer.main_ppo import main as train_main
from fulcrum.trainer.wall_clock import WallClockBudget


def test_no_budget_never_ends_a_run() -> None:
    clock = WallClockBudget(None, started=0.0)
    clock.observe_step({"timing_s/step": 1e9})
    assert not clock.next_step_is_last(now=1e12)


def test_the_last_step_is_the_one_after_which_another_would_not_fit() -> None:
    clock = WallClockBudget(100.0, started=0.0)
    # a step of 14 s of which 4 s validated: 10 s of its own work, 4 s a validation
    clock.observe_step({"timing_s/step": 14.0, "timing_s/testing": 4.0})
    assert (clock.step_s, clock.val_s) == (10.0, 4.0)
    assert not clock.next_step_is_last(now=76.0)  # 76 + 10 + (10 + 4) = 100: one more still fits
    assert clock.next_step_is_last(now=77.0)  # 101 > 100
    clock.observe_step({"timing_s/step": 13.0, "timing_s/save_checkpoint": 2.0})
    assert (clock.step_s, clock.save_s) == (11.0, 2.0)  # the longest recent step, the last save
    assert not clock.next_step_is_last(now=72.0)  # 72 + 11 + (11 + 4 + 2) = 100
    assert clock.next_step_is_last(now=72.5)
    clock.observe_step({"timing_s/step": 3.0})
    assert clock.step_s == 11.0  # a short step does not hide a long one just before it


@pytest.mark.parametrize(("budget", "steps"), [(1e-3, 1), (1e6, 3)])
def test_a_run_with_a_budget_validates_and_saves_on_its_last_step(
    tmp_path: Path, budget: float, steps: int
) -> None:
    """A budget already spent when the first step starts (model loading counts) makes that step the last:
    it validates and saves as a last step does; a budget that is not reached leaves the run its steps."""
    assets = make_assets(tmp_path)
    run = tmp_path / "run"
    keys = {
        "trainer.total_training_steps": 3,
        "trainer.test_freq": 10,
        "trainer.save_freq": 10,
        "trainer.wall_clock_budget_s": budget,
    }
    assert train_main(short_run_overrides(assets, run, **keys)) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "timing_s/step" in r]
    assert len(train_rows) == steps and read_latest_step(run) == steps
    assert any(k.startswith("val-core/") for k in train_rows[-1])  # the last step validated
    elapsed = [r["perf/elapsed_s"] for r in train_rows]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
