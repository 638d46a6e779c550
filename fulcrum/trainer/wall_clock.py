"""`trainer.wall_clock_budget_s`: a run that ends, last validation and checkpoint included, within a given
number of seconds of its start, so that runs of different settings can be compared at equal wall-clock.

The step that becomes the last one is chosen before it starts: the last step validates and saves (as
every run's last step does), so it must still fit, and a step after it must not. With `elapsed` the
seconds since the trainer started (model loading included), `step_s` the longest of the recent steps
without their validation and save, `val_s` the last validation and `save_s` the last save's stall,

    the coming step is the last  ⇔  elapsed + step_s + (step_s + val_s + save_s) > budget_s

(the coming step itself, then one more that would end the run). A run whose first step (compilation,
graph captures) already overruns stops after it: a budget shorter than a step is not met, only
approached. Every rank takes rank 0's decision, so that no rank waits in a step the others skipped.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

RECENT_STEPS = 3  # a step's estimate is the longest of these: lengths vary with the responses


@dataclass
class WallClockBudget:
    budget_s: float | None
    started: float = field(default_factory=time.monotonic)
    val_s: float = 0.0
    save_s: float = 0.0
    recent_steps: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))

    @property
    def step_s(self) -> float:
        return max(self.recent_steps, default=0.0)

    def observe_validation(self, seconds: float) -> None:
        self.val_s = seconds

    def observe_step(self, metrics: dict[str, float]) -> None:
        """A finished step's `timing_s/*`: its own work apart from validation and saving."""
        testing = metrics.get("timing_s/testing", 0.0)
        saving = metrics.get("timing_s/save_checkpoint", 0.0)
        if testing:
            self.val_s = testing
        if saving:
            self.save_s = saving
        self.recent_steps.append(max(0.0, metrics.get("timing_s/step", 0.0) - testing - saving))

    def elapsed(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.started

    def next_step_is_last(self, now: float | None = None) -> bool:
        """Whether the coming step must be the run's last (formula in the module docstring)."""
        if self.budget_s is None:
            return False
        needed = 2 * self.step_s + self.val_s + self.save_s
        return self.elapsed(now) + needed > self.budget_s

    def last_step_line(self, step: int) -> str:
        """What the run prints when the budget makes `step` its last."""
        return (
            f"step {step} is the last: trainer.wall_clock_budget_s={self.budget_s:g} leaves no room for "
            f"another ({self.elapsed():.0f} s so far)"
        )
