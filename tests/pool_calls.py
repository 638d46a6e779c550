"""Functions the scoring-pool tests run in worker processes (stdlib only, so a worker imports them at once)."""

from __future__ import annotations

import time


def sleep_then(seconds: float, value: float) -> float:
    time.sleep(seconds)
    return value


def exit_now() -> float:
    raise SystemExit(0)


class SlowScorer:
    """A reward function whose "slow/..." samples take `seconds`; those are the ones run in the pool."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: str, extra_info: object = None
    ) -> float:
        if data_source.startswith("slow/"):
            time.sleep(self.seconds)
        return float(solution_str == ground_truth)

    def isolated(self, data_source: str) -> bool:
        return data_source.startswith("slow/")
