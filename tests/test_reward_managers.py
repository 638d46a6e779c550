"""Reward managers by name: DAPO's overlong penalty, the batched call, PRIME's pool, a user's manager."""

import time
from pathlib import Path

import pytest

from fulcrum.reward import load_custom_reward_fn
from fulcrum.reward.managers import (
    REWARD_MANAGERS,
    DapoRewardManager,
    OverlongBuffer,
    build_reward_manager,
    overlong_penalty,
)
from fulcrum.reward.scoring import as_result


def exact(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    return float(solution_str.strip() == ground_truth)


def test_overlong_penalty_is_zero_then_linear_down_to_minus_the_factor() -> None:
    # max 100 tokens, buffer 20: free up to 80 tokens, -0.5 at 90, -1.0 at 100.
    assert overlong_penalty(50, 100, 20, 1.0) == 0.0
    assert overlong_penalty(80, 100, 20, 1.0) == 0.0
    assert overlong_penalty(90, 100, 20, 1.0) == pytest.approx(-0.5)
    assert overlong_penalty(100, 100, 20, 2.0) == pytest.approx(-2.0)


def test_dapo_manager_adds_the_penalty_and_logs_it() -> None:
    manager = build_reward_manager(
        "dapo",
        exact,
        overlong_buffer_cfg={"enable": True, "len": 4, "penalty_factor": 1.0, "log": True},
        max_resp_len=10,
    )
    result = as_result(
        manager.score(["7", "7", "3"], ["7", "7", "7"], ["d"] * 3, None, response_lengths=[5, 8, 10])
    )
    assert result.scores == pytest.approx([1.0, 0.5, -1.0])  # 8 tokens: 2 into the 4-token buffer
    assert result.extra["acc"] == [1.0, 1.0, 0.0]
    assert result.extra["overlong"] == [False, True, True]
    # Disabled, it is the naive manager (plus acc).
    plain = DapoRewardManager(compute_score=exact, overlong_buffer_cfg=OverlongBuffer(enable=False))
    assert plain.score(["7"], ["7"], ["d"], None, response_lengths=[10]).scores == [1.0]


def test_dapo_manager_rejects_a_buffer_longer_than_the_response() -> None:
    with pytest.raises(ValueError, match=r"overlong_buffer.len=20"):
        DapoRewardManager(
            compute_score=exact, overlong_buffer_cfg={"enable": True, "len": 20}, max_resp_len=10
        )


def test_batch_manager_calls_once_with_verls_keywords() -> None:
    calls = []

    def batched(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
        calls.append(len(solution_strs))
        return [
            {"score": float(s == g) + bonus, "len": len(s)}
            for s, g in zip(solution_strs, ground_truths, strict=True)
        ]

    manager = build_reward_manager("batch", batched, bonus=0.5)
    result = as_result(manager.score(["a", "bb"], ["a", "x"], ["d", "d"], [{}, {}]))
    assert calls == [2]
    assert result.scores == [1.5, 0.5]
    assert result.extra["len"] == [1, 2]


def slow_or_failing(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    if solution_str == "hang":
        time.sleep(30)
    if solution_str == "boom":
        raise RuntimeError("scorer crashed")
    return 1.0


def test_prime_manager_scores_timeouts_and_failures_zero() -> None:
    manager = build_reward_manager("prime", slow_or_failing, num_processes=2, timeout=1.0)
    result = as_result(manager.score(["ok", "hang", "boom", "ok"], ["x"] * 4, ["d"] * 4))
    assert result.scores == [1.0, 0.0, 0.0, 1.0]
    assert result.num_errors == 2


def test_a_users_manager_plugs_in_by_name(tmp_path: Path) -> None:
    source = tmp_path / "my_reward.py"
    source.write_text(
        "from fulcrum.reward.managers import register_reward_manager\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0\n"
        "@register_reward_manager('length_bonus')\n"
        "class LengthBonus:\n"
        "    def __init__(self, compute_score, scale=1.0, **kw):\n"
        "        self.fn, self.scale = compute_score, scale\n"
        "    def score(self, responses, ground_truths, data_sources, extra_infos=None, response_lengths=None):\n"
        "        return [self.fn(d, r, g) + self.scale * n for r, g, d, n in\n"
        "                zip(responses, ground_truths, data_sources, response_lengths)]\n"
    )
    fn = load_custom_reward_fn(source, "compute_score")
    try:
        manager = build_reward_manager("length_bonus", fn, scale=0.1)
        assert as_result(
            manager.score(["a", "b"], ["", ""], ["d", "d"], None, [3, 5])
        ).scores == pytest.approx([1.3, 1.5])
    finally:
        REWARD_MANAGERS.pop("length_bonus", None)
    with pytest.raises(ValueError, match=r"reward_manager='length_bonus' is not registered.*dapo"):
        build_reward_manager("length_bonus", fn)


def test_manager_from_config_reads_both_spellings_of_the_overlong_buffer() -> None:
    from fulcrum.config import load_config
    from fulcrum.reward.managers import manager_from_config

    recipe = load_config(
        [
            "reward_model.reward_manager=dapo",
            "reward_model.overlong_buffer.enable=True",
            "reward_model.overlong_buffer.len=64",
            "data.max_response_length=256",
        ]
    )
    manager = manager_from_config(recipe)
    assert isinstance(manager, DapoRewardManager)
    assert (manager.buffer.enable, manager.buffer.len, manager.max_resp_len) == (True, 64, 256)
    script = load_config(
        [
            "reward_model.reward_manager=dapo",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.len=32",
            "+reward_model.reward_kwargs.max_resp_len=128",
        ]
    )
    manager = manager_from_config(script)
    assert (manager.buffer.enable, manager.buffer.len, manager.max_resp_len) == (True, 32, 128)
