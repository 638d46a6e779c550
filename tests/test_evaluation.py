"""Validation metrics under verl's names: mean@N, best@n, maj@n, pass@k, GSM8K's strict and flexible."""

from __future__ import annotations

import pytest

from fulcrum.trainer.evaluation import pass_at_k, sample_sizes, validation_infos, validation_metrics


def test_one_response_per_prompt_gives_mean_at_1_per_source() -> None:
    m = validation_metrics(
        ["openai/gsm8k", "openai/gsm8k", "synthetic/arithmetic"], ["a", "b", "c"], {"reward": [1.0, 0.0, 0.5]}
    )
    assert m["val-core/openai/gsm8k/reward/mean@1"] == 0.5
    assert m["val-core/synthetic/arithmetic/reward/mean@1"] == 0.5
    assert m["val-aux/openai/gsm8k/reward/pass@1"] == 0.5
    assert not any("best@" in k or "std@" in k for k in m)


def test_n_responses_give_verls_metrics_and_pass_at_k() -> None:
    # prompt a: 1 of 4 right; prompt b: 4 of 4 right
    m = validation_metrics(["s"] * 8, ["a"] * 4 + ["b"] * 4, {"reward": [1.0, 0, 0, 0, 1, 1, 1, 1]})
    assert m["val-core/s/reward/mean@4"] == pytest.approx((0.25 + 1.0) / 2)
    assert m["val-aux/s/reward/std@4"] == pytest.approx((0.4330127 + 0.0) / 2)
    # best of 4 drawn with replacement from [1,0,0,0]: 1 - 0.75**4 = 0.684 in expectation
    assert m["val-core/s/reward/best@4/mean"] == pytest.approx((1 - 0.75**4 + 1.0) / 2, abs=0.03)
    assert m["val-aux/s/reward/best@2/mean"] == pytest.approx((1 - 0.75**2 + 1.0) / 2, abs=0.03)
    assert m["val-aux/s/reward/worst@4/mean"] == pytest.approx((0.25**4 + 1.0) / 2, abs=0.03)
    assert m["val-aux/s/reward/pass@1"] == pytest.approx((0.25 + 1.0) / 2)
    assert m["val-aux/s/reward/pass@2"] == pytest.approx((0.5 + 1.0) / 2)  # 1 - C(3,2)/C(4,2)
    assert m["val-aux/s/reward/pass@4"] == pytest.approx(1.0)


def test_majority_vote_takes_the_most_common_prediction() -> None:
    infos = {
        "reward": [1.0, -1.0, -1.0, -1.0],
        "acc": [True, False, False, False],
        "pred": ["7", "8", "8", "9"],
    }
    m = validation_metrics(["aime2024"] * 4, ["a"] * 4, infos)
    # "acc" is the core variable, as in verl; most draws of 4 vote "8", which is wrong
    assert "val-core/aime2024/acc/mean@4" in m and "val-aux/aime2024/reward/mean@4" in m
    assert m["val-core/aime2024/acc/maj@4/mean"] < 0.3
    assert m["val-core/aime2024/acc/mean@4"] == 0.25


def test_sample_sizes_are_verls() -> None:
    assert sample_sizes(1) == [] and sample_sizes(2) == [2] and sample_sizes(5) == [2, 4, 5]
    assert sample_sizes(20) == [2, 4, 8, 16, 20]
    assert pass_at_k(20, 0, 10) == 0.0 and pass_at_k(20, 11, 10) == 1.0


def test_gsm8k_gets_strict_and_flexible() -> None:
    texts = ["so #### 72", "the answer is 72", "nothing"]
    infos = validation_infos([1.0, 0.0, 0.0], {}, texts, ["72", "72", "72"], ["openai/gsm8k"] * 3)
    assert infos["flexible"] == [1.0, 1.0, 0.0]
    m = validation_metrics(["openai/gsm8k"] * 3, ["a", "b", "c"], infos)
    assert m["val-core/openai/gsm8k/reward/mean@1"] == pytest.approx(1 / 3)
    assert m["val-aux/openai/gsm8k/flexible/mean@1"] == pytest.approx(2 / 3)
