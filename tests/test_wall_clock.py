"""`trainer.wall_clock_budget_s`: the step chosen as the last one still fits with its validation and save,
and a step after it would not; a run given a budget ends on such a step, validating and saving there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import make_assets, short_run_overrides

from fulcrum.trainer.checkpoint import read_latest_step
from fulcrum.trainer.main_ppo import main as train_main
from fulcrum.trainer.wall_clock import WallClockBudget, run_end_if_another_step


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


def test_the_run_end_counts_the_last_write_and_the_write_before_it() -> None:
    # no checkpoint writes in the background: the formula above (e + s + (s + v + k))
    assert run_end_if_another_step(
        70.0, 10.0, 4.0, 2.0, 0.0, None, coming_validates=False, coming_saves=False
    ) == pytest.approx(96.0)
    # the last write (20 s) is waited for at the end; a write in flight until 120 s holds the last save
    end = run_end_if_another_step(
        100.0, 4.0, 2.0, 1.0, 20.0, 120.0, coming_validates=False, coming_saves=False
    )
    assert end == pytest.approx(120.0 + 1.0 + 20.0)
    # a coming periodic save starts a write the last step's save must wait for
    end = run_end_if_another_step(100.0, 4.0, 2.0, 1.0, 20.0, None, coming_validates=True, coming_saves=True)
    assert end == pytest.approx((100 + 4 + 2 + 1) + 20 + 1 + 20)


def test_a_write_in_flight_counts_at_least_the_time_it_has_taken() -> None:
    """Before any write has ended its time is unknown: the one in flight has taken at least as long as it has
    been running, and the last write is counted that long."""
    clock = WallClockBudget(100.0, started=0.0)
    clock.observe_step({"timing_s/step": 6.0, "timing_s/save_checkpoint": 1.0}, now=50.0)
    assert clock.write_started == 50.0 and clock.write_s == 0.0
    clock.observe_step({"timing_s/step": 5.0}, now=55.0)
    clock.observe_step({"timing_s/step": 5.0}, now=60.0)
    # at 60 s the write has run 10 s: another step (5) and a last one (5, its save 1 after that write) end at
    # 60 + 5 + 5 + 1 + 10 = 81; at 80 s (30 s of writing) they would end at 80 + 5 + 5 + 1 + 30 = 121
    assert not clock.next_step_is_last(now=60.0)
    assert clock.next_step_is_last(now=80.0)
    clock.observe_step({"timing_s/step": 5.0, "perf/checkpoint_write_s": 12.0}, now=85.0)
    assert (clock.write_s, clock.write_started) == (12.0, None)  # reported: known, none in flight


def test_saves_in_the_step_count_their_stall_and_no_write_beside_it() -> None:
    clock = WallClockBudget(100.0, background_writes=False, started=0.0)
    clock.observe_step({"timing_s/step": 30.0, "timing_s/save_checkpoint": 20.0}, now=40.0)
    assert (clock.save_s, clock.write_started) == (20.0, None)
    assert not clock.next_step_is_last(now=55.0)  # 55 + 10 + (10 + 20) = 95: nothing runs on after the step
    assert clock.next_step_is_last(now=61.0)


def simulate_budgeted_run(budget: float, *, first_step: float = 70.0) -> float:
    """A run like the seed's PPO command on one H100 (`bench/seed_real.py run ppo`): steps of 3.9 s, a
    validation of 1.8 s every 10 steps, a save every 10 steps that stalls 1.9 s and writes 21 s beside the
    steps after it; the run waits for its last write. Returns when the run ended."""
    step_s, val_s, stall_s, write_s, freq = 3.9, 1.8, 1.9, 21.0, 10
    clock = WallClockBudget(budget, started=0.0)
    now, write_ends, step = 5.0 + val_s, 0.0, 0  # model loading, then the step-0 validation
    clock.observe_validation(val_s)
    while True:
        step += 1
        periodic = step % freq == 0
        is_last = step > 1 and clock.next_step_is_last(now, validates=periodic, saves=periodic)
        started = now
        now += first_step if step == 1 else step_s
        metrics = {}
        if periodic or is_last:  # validate, then save: wait out the write before, stall, write beside
            now += val_s
            wait = max(0.0, write_ends - now)
            now += wait + stall_s
            if write_ends:  # the write before has ended: reported with this step
                metrics["perf/checkpoint_write_s"] = write_s
            write_ends = now + write_s
            metrics |= {"timing_s/testing": val_s, "timing_s/save_checkpoint": wait + stall_s}
            metrics["perf/checkpoint_wait_s"] = wait
        elif write_ends and now >= write_ends:  # reported on the first step after it ended
            metrics["perf/checkpoint_write_s"] = write_s
            write_ends = 0.0
        metrics["timing_s/step"] = now - started
        clock.observe_step(metrics, now=now)
        if is_last:
            return max(now, write_ends)


@pytest.mark.parametrize("budget", [300.0, 530.0, 540.0, 551.3, 600.0])
def test_a_budgeted_run_ends_within_its_budget_with_its_last_write(budget: float) -> None:
    """The run ends, its last checkpoint written, within the budget, and no later than it must: one more
    step with its validation, its save's stall and write would not have fitted."""
    end = simulate_budgeted_run(budget)
    assert end <= budget
    assert budget - end < 3.9 + 1.8 + 1.9 + 21.0 + 21.0  # at worst a step, and waiting out the write before


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
