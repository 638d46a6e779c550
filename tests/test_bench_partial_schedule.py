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


def test_a_launch_of_uneven_programs_ends_later_in_the_batch_order_than_longest_first() -> None:
    """264 slots (132 SMs, 2 programs each), 8 KV heads: 40 sequences of 64 positions then one of 8,192.
    In the batch's order the long one's 8 programs start last, after the 320 short ones, and end at
    1.5 + 128.5 tiles; longest first they start at once and the short ones fill the other slots beside them."""
    from partial_schedule import launch_balance, launch_end

    assert launch_end([1, 1, 1, 5], 2) == 6 and launch_end([5, 1, 1, 1], 2) == 5
    batch_order, longest_first, balanced = launch_balance([64] * 40 + [8192])  # one program a pair
    assert batch_order == 1.5 + 128.5
    assert longest_first == 128.5
    assert balanced == (40 * 1.5 + 128.5) * 8 / 264
    even = launch_balance([1600 + i for i in range(300)])  # even contexts: the order changes nothing
    assert abs(even[0] - even[1]) <= 1.0


def test_synchronous_steps_replay_and_cost_their_launches() -> None:
    """--batches-in-flight 1: every call trains the one batch it was given, run to its end (nothing
    carried or preempted beside it), and its launches are costed as the partial calls' are."""
    sync = simulate(64, 2, batches_in_flight=1)
    assert all(row["trained_tokens"] == row["sampled_tokens"] for row in sync[1:])
    figures = summary(sync)
    assert figures["launch_batch_order_over_balanced"] >= figures["launch_longest_first_over_balanced"] >= 1.0


def test_a_split_launch_shares_each_context_out_over_its_programs() -> None:
    """Two splits: a 8,192-position context's 128 tiles are two programs of 64 (+ half a tile), a 70-position
    context's 2 tiles one of 1 each; 16 programs a sequence of 8 KV heads, every one on its own slot."""
    from partial_schedule import launch_balance

    batch_order, longest_first, balanced = launch_balance([8192, 70], splits=2)
    assert batch_order == longest_first == 64.5
    assert balanced == (2 * 64.5 + 2 * 1.5) * 8 / 264
