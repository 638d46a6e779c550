"""bench/tools/partial_rollout_model.py: the decode cost it sums, a synchronous step that ends with its longest
group, partial rollouts that gain where the tail runs at the step floor and not where K/V reads bind, and
the measured synchronous figures it reproduces (H100, BENCHMARKS.md "Partial rollouts")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from partial_rollout_model import DecodeCost, Group, generate_until, main, simulate, summary


def test_a_stretch_costs_the_larger_of_the_floor_and_the_reads() -> None:
    cost = DecodeCost(weight_bytes=1e9, kv_bytes=1e4, bandwidth=1e12, share=0.5, step_floor_s=1e-3)
    assert cost.steps_s(0, 0, 10) == pytest.approx(10 * 2e-3)  # reads: 1 GB at 0.5 TB/s
    assert DecodeCost(1e6, 1e4, 1e12, 0.5, 1e-3).steps_s(0, 0, 10) == pytest.approx(10e-3)  # the floor
    # contexts 1e5, 1e5 + 1e4: (1e9 + 1e4 * c) / 5e11 each
    assert cost.steps_s(100_000, 10_000, 2) == pytest.approx((2e9 + 1e4 * 210_000) / 5e11)


def test_the_synchronous_step_waits_for_its_longest_group_and_admits_by_capacity() -> None:
    cost = DecodeCost(weight_bytes=0.0, kv_bytes=0.0, bandwidth=1.0, share=1.0, step_floor_s=1.0)
    pool = [Group(10), Group(100), Group(20)]
    seconds, steps, trained = generate_until(pool, 3, samples=1, prompt=0, capacity_tokens=1e9, cost=cost)
    assert (seconds, steps, [g.budget for g in trained]) == (100.0, 100, [10, 20, 100]) and pool == []
    # room for one group at a time: the groups run one after another
    pool = [Group(10), Group(100), Group(20)]
    assert generate_until(pool, 3, 1, 0, capacity_tokens=100, cost=cost)[:2] == (130.0, 130)


def test_partial_rollouts_carry_the_unfinished_and_train_the_first_to_complete() -> None:
    cost = DecodeCost(weight_bytes=0.0, kv_bytes=0.0, bandwidth=1.0, share=1.0, step_floor_s=1.0)
    budgets = [5, 50, 6, 7, 8, 9]  # two groups a step, one warm-up batch
    steps = simulate("partial", budgets, 2, 1, 0, 1, 1e9, cost, train_s_per_token=0.0)
    assert [s["tokens"] for s in steps] == [11, 15]  # 5 + 6, then 7 + 8; the 50 is carried throughout
    # step 1 decodes the 7 six steps ahead of the new 8 and 9: it completes first, the 8 second
    assert [s["decode_steps"] for s in steps] == [6, 8]
    sync = simulate("sync", budgets, 2, 1, 0, 1, 1e9, cost, train_s_per_token=0.0)
    assert [s["decode_steps"] for s in sync] == [50, 7, 9]


def test_the_model_reproduces_the_measured_synchronous_steps_and_names_where_partial_rollouts_pay(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """H100, GRPO 64 x 8, budgets log-normal around 1,536 cut at 8,192: measured synchronous generation
    19.3 s (Qwen2.5-0.5B's shape) and 86-102 s (Qwen3-0.6B's)."""
    assert main(["--shape", "qwen2.5-0.5b", "--kv-capacity-gib", "20", "--steps", "8"]) == 0
    qwen25 = capsys.readouterr().out
    sync_gen = float(qwen25.split("sync")[1].split("gen_s")[1].split()[0])
    assert 17.0 < sync_gen < 21.5
    ratio = float(qwen25.split("trained tok/s")[1].split("x")[0])
    assert ratio > 1.3  # the tail runs at the step floor with a few sequences
    assert main(["--shape", "qwen3-0.6b", "--step-floor-ms", "2.6", "--steps", "8"]) == 0
    qwen3 = capsys.readouterr().out
    assert 80 < float(qwen3.split("sync")[1].split("gen_s")[1].split()[0]) < 105
    assert float(qwen3.split("trained tok/s")[1].split("x")[0]) < 1.15  # K/V reads bind: no tail to take back


def test_summary_counts_trained_tokens_over_time() -> None:
    steps = [{"gen_s": 9.0, "decode_steps": 9, "tokens": 0, "step_s": 99.0},
             {"gen_s": 1.0, "decode_steps": 1, "tokens": 10, "step_s": 2.0},
             {"gen_s": 3.0, "decode_steps": 3, "tokens": 30, "step_s": 4.0}]  # fmt: skip
    assert summary(steps, skip=1) == {"gen_s": 2.0, "step_s": 3.0, "decode_steps": 2, "tok_per_s": 40 / 6}
