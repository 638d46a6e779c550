"""`trainer.wall_clock_budget_s`: a run that ends, last validation and checkpoint included, within a given
number of seconds of its start, so that runs of different settings can be compared at equal wall-clock.

The step that becomes the last one is chosen before it starts: the last step validates and saves (as
every run's last step does), so it must still fit, and a step after it must not. The run's end is the
end of its last checkpoint's write: a background write (`trainer.save_in_background`) runs beside the
steps that follow a periodic save, but the run waits for the last one, and a save first waits for the
write before it. With `e` the seconds since the trainer started (model loading included), `s` the
longest of the recent steps without their validation and save, `v` the last validation, `k` the last
save's stall (without its wait for an earlier write), `w` the last background write and `f` when the write
in flight is expected to end (`run_end_if_another_step`),

    the coming step is the last  ⇔  run_end_if_another_step(e, ...) > budget_s

(the coming step as a periodic one, then one more that would end the run). A write's `w` is known once
it ends; while one is in flight, `w` is at least the time it has taken so far (the first write's only
bound). Saves in the step (`save_in_background=False`) have no write beside it: their stall is all of it.
A run whose first step (compilation, graph captures) already overruns stops after it: a budget shorter
than a step is not met, only approached. Every rank takes rank 0's decision, so that no rank waits in a
step the others skipped.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

RECENT_STEPS = 3  # a step's estimate is the longest of these: lengths vary with the responses


def run_end_if_another_step(
    elapsed: float,
    step_s: float,
    val_s: float,
    stall_s: float,
    write_s: float,
    write_ends: float | None,
    *,
    coming_validates: bool,
    coming_saves: bool,
) -> float:
    """When the run ends if the coming step is not the last and the one after it is (seconds since start):

        e₁ = e + s + (v if the coming step validates)
        e₁ = max(e₁, f) + k,   f = e₁ + w          if it saves (after the write in flight, then its stall)
        end = max(e₁ + s + v, f) + k + w            the last step validates, saves, and the run waits for
                                                    that write

    with `f` (`write_ends`) None, or in the past, where no write is in flight."""
    ready = float("-inf") if write_ends is None else write_ends
    coming_end = elapsed + step_s + (val_s if coming_validates else 0.0)
    if coming_saves:
        coming_end = max(coming_end, ready) + stall_s
        ready = coming_end + write_s
    return max(coming_end + step_s + val_s, ready) + stall_s + write_s


@dataclass
class WallClockBudget:
    budget_s: float | None
    background_writes: bool = True  # trainer.save_in_background
    started: float = field(default_factory=time.monotonic)
    val_s: float = 0.0
    save_s: float = 0.0  # the last save's stall, without its wait for the write before it
    write_s: float = 0.0  # the last background write, once one has ended
    write_started: float | None = None  # seconds since the start when the write in flight began
    recent_steps: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))

    @property
    def step_s(self) -> float:
        return max(self.recent_steps, default=0.0)

    def observe_validation(self, seconds: float) -> None:
        self.val_s = seconds

    def observe_step(self, metrics: dict[str, float], now: float | None = None) -> None:
        """A finished step's `timing_s/*` (its own work apart from validation and saving) and checkpoint
        metrics: `perf/checkpoint_write_s` reports the write that ended before this step's save began."""
        testing = metrics.get("timing_s/testing", 0.0)
        saving = metrics.get("timing_s/save_checkpoint", 0.0)
        if testing:
            self.val_s = testing
        written = metrics.get("perf/checkpoint_write_s")
        if written is not None:
            self.write_s, self.write_started = written, None
        if saving:
            self.save_s = max(0.0, saving - metrics.get("perf/checkpoint_wait_s", 0.0))
            if self.background_writes:
                self.write_started = self.elapsed(now)  # a save is the step's last work
        self.recent_steps.append(max(0.0, metrics.get("timing_s/step", 0.0) - testing - saving))

    def elapsed(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.started

    def next_step_is_last(
        self, now: float | None = None, *, validates: bool = False, saves: bool = False
    ) -> bool:
        """Whether the coming step must be the run's last (module docstring); `validates` and `saves`:
        whether it would validate or save as a periodic step."""
        if self.budget_s is None:
            return False
        elapsed = self.elapsed(now)
        write_s, write_ends = self.write_s, None
        if self.write_started is not None:
            # Unreported at the last step's end, the write in flight has taken at least this long.
            write_s = max(write_s, elapsed - self.write_started)
            if write_s > 0:
                write_ends = self.write_started + write_s
        end = run_end_if_another_step(
            elapsed,
            self.step_s,
            self.val_s,
            self.save_s,
            write_s,
            write_ends,
            coming_validates=validates,
            coming_saves=saves,
        )
        return end > self.budget_s

    def last_step_line(self, step: int) -> str:
        """What the run prints when the budget makes `step` its last."""
        return (
            f"step {step} is the last: trainer.wall_clock_budget_s={self.budget_s:g} leaves no room for "
            f"another ({self.elapsed():.0f} s so far)"
        )
