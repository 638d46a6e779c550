"""bench/tools/partial_schedule.py: partial rollouts replayed through the engine's scheduler over a cache
they oversubscribe, at 1/64 of bench/long_tail.py's Qwen3-0.6B lengths."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "tools"))

from partial_schedule import simulate, summary


def test_the_headroom_keeps_the_scheduler_from_recomputing_what_it_samples() -> None:
    """Admitting whatever fits, the scheduler prefills again about as many tokens as it samples (the GPU
    run: 1.02 M for 0.92 M); with the default headroom it recomputes under half as many, preempts under
    half as often, and the calls train as many tokens."""
    greedy, kept = simulate(64, 3, headroom=0), simulate(64, 3)
    greedy_figures, kept_figures = summary(greedy), summary(kept)
    assert greedy_figures["prefilled_over_sampled"] > 0.8
    assert kept_figures["prefilled_over_sampled"] < 0.5 * greedy_figures["prefilled_over_sampled"]
    assert kept_figures["preemptions"] < 0.5 * greedy_figures["preemptions"]
    for a, b in zip(greedy[1:], kept[1:], strict=True):
        assert abs(a["trained_tokens"] - b["trained_tokens"]) < 0.15 * a["trained_tokens"]
