"""Scoring in worker processes under a per-sample time limit; the built-in scorer's options from config."""

from __future__ import annotations

import time

import pytest
from pool_calls import SlowScorer, exit_now, sleep_then

from fulcrum.config import load_config
from fulcrum.reward.managers import NaiveRewardManager, manager_from_config
from fulcrum.reward.pool import ScoringPool
from fulcrum.reward.sources import BuiltinScorer


def test_a_call_past_the_limit_times_out_and_the_others_score() -> None:
    pool = ScoringPool(workers=2, sample_timeout_s=1.0)
    try:
        pool.map(sleep_then, [(0.0, 0.0), (0.0, 0.0)])  # both workers have imported the function
        start = time.monotonic()
        outcomes = pool.map(sleep_then, [(0.0, 1.0), (60.0, 2.0), (0.1, 3.0), (0.0, 4.0)])
        took = time.monotonic() - start
        assert [o.value for o in outcomes] == [1.0, None, 3.0, 4.0], outcomes
        assert [o.timed_out for o in outcomes] == [False, True, False, False]
        assert took < 10  # the stuck call was ended near its 1 s limit
        # the replaced worker serves the next batch
        assert [o.value for o in pool.map(sleep_then, [(0.0, 5.0), (0.0, 6.0)])] == [5.0, 6.0]
    finally:
        pool.close()


def test_sys_exit_in_a_scorer_is_an_error_not_a_dead_pool() -> None:
    pool = ScoringPool(workers=1, sample_timeout_s=10.0)
    try:
        (outcome,) = pool.map(exit_now, [()])
        assert outcome.error is not None and "SystemExit" in outcome.error and not outcome.timed_out
        assert pool.map(sleep_then, [(0.0, 7.0)])[0].value == 7.0
    finally:
        pool.close()


def test_numina_samples_score_in_the_pool_and_a_timeout_is_counted() -> None:
    pytest.importorskip("sympy")
    pool = ScoringPool(workers=2, sample_timeout_s=20.0)
    manager = NaiveRewardManager(compute_score=BuiltinScorer({}), pool=pool)
    try:
        result = manager.score(
            ["\\boxed{0.5}", "\\boxed{3}", "#### 4"],
            ["\\frac{1}{2}", "4", "4"],
            ["numina_olympiads", "numina_cn_k12", "openai/gsm8k"],
        )
        assert result.scores == [1.0, 0.0, 1.0] and result.num_timeouts == 0
    finally:
        pool.close()


def test_a_sample_past_its_limit_scores_0_and_is_counted_not_raised() -> None:
    pool = ScoringPool(workers=2, sample_timeout_s=1.0)
    manager = NaiveRewardManager(compute_score=SlowScorer(60.0), pool=pool, on_error="raise")
    try:
        result = manager.score(["a", "b", "c"], ["a", "b", "x"], ["slow/x", "fast/y", "fast/z"])
        assert result.scores == [0.0, 1.0, 0.0]
        assert result.num_timeouts == 1 and result.num_errors == 0
    finally:
        pool.close()


def test_config_chooses_math_verify_and_gsm8k_method() -> None:
    cfg = load_config(
        ["reward.compute_score_kwargs.method=flexible", "+reward_model.reward_kwargs.math_verify=true"]
    )
    manager = manager_from_config(cfg)
    assert isinstance(manager.compute_score, BuiltinScorer)
    assert manager.compute_score.options == {"method": "flexible", "math_verify": True}
    assert manager.compute_score("openai/gsm8k", "it is 72", "72") == 1.0
    assert manager.compute_score.isolated("lighteval/MATH") and not manager.compute_score.isolated(
        "openai/gsm8k"
    )
