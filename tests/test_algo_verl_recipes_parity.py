"""verl's recipe maths against fulcrum's on the same inputs (float32, within 1e-5): the GMPO / GPG / CISPO /
SAPO policy losses, the gpg and optimal_token_baseline estimators, PF-PPO's resampling, and rollout
correction (weights, rejection masks, every `rollout_corr/*` metric, bypass-mode losses).

Expected values: tests/fixtures/verl_recipes.pt, written by verl (version stored in the file) with
tests/fixtures/make_verl_recipes_fixture.py; fulcrum does not import verl.
"""

from pathlib import Path

import pytest
import torch
from helpers import verl_fixture_policy_loss

from fulcrum.algo.advantages import compute_advantage
from fulcrum.algo.pf_ppo import pf_ppo_resample_indices
from fulcrum.algo.policy_losses import LossConfig, get_policy_loss_fn
from fulcrum.algo.rollout_correction import (
    RolloutCorrection,
    compute_rollout_correction,
)

FIXTURE = torch.load(Path(__file__).parent / "fixtures" / "verl_recipes.pt", weights_only=True)
TOL = dict(rtol=1e-5, atol=1e-5)
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def close(actual: torch.Tensor | float, expected: torch.Tensor | float, what: str = "") -> None:
    actual = torch.as_tensor(actual, dtype=torch.float32)
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float32), **TOL, msg=what)


def close_on_mask(actual: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor) -> None:
    valid = mask.bool()
    torch.testing.assert_close(actual[valid], expected[valid], **TOL)
    assert torch.all(actual[~valid] == 0), "outputs on masked tokens must be 0"


def same_metrics(actual: dict[str, float], expected: dict[str, float]) -> None:
    assert sorted(actual) == sorted(expected), set(actual) ^ set(expected)
    for key, value in expected.items():
        assert actual[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key


def test_fixture_comes_from_verl_0_9() -> None:
    assert FIXTURE["verl_version"].startswith("0.9")


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss_mode", ["geo_mean", "gpg", "cispo", "sapo"])
def test_recipe_policy_losses_match_verl_values_metrics_and_gradients(
    loss_mode: str, mode: str, weighted: bool
) -> None:
    p = FIXTURE["policy"]
    weights = p["rollout_is_weights"] if weighted else None
    loss, metrics, log_prob = verl_fixture_policy_loss(
        p, mode, loss_mode, rollout_is_weights=weights, tau_pos=p["tau_pos"], tau_neg=p["tau_neg"]
    )
    expected = p[f"{loss_mode}_{mode}_w{int(weighted)}"]
    close(loss.detach(), expected["loss"], "pg_loss")
    close(log_prob.grad, expected["grad"], "gradient")
    for key, value in expected["metrics"].items():  # gpg: verl reports none
        close(metrics[key], value, key)


def test_the_fixture_exercises_clipping_and_both_sapo_temperatures() -> None:
    p = FIXTURE["policy"]
    assert p["cispo_token-mean_w0"]["metrics"]["actor/pg_clipfrac"] > 0
    geo = p["geo_mean_token-mean_w0"]["metrics"]
    assert geo["actor/pg_clipfrac"] > 0 and geo["actor/pg_clipfrac_lower"] > 0
    assert (p["advantages"] > 0).any() and (p["advantages"] <= 0).any()


def test_gpg_advantage_matches_verl() -> None:
    a = FIXTURE["advantages"]
    adv, ret = compute_advantage(
        "gpg", token_level_rewards=a["outcome_rewards"], response_mask=a["mask"], index=a["uids"]
    )
    close_on_mask(adv, a["gpg"][0], a["mask"])
    close_on_mask(ret, a["gpg"][1], a["mask"])


@pytest.mark.parametrize("weighted", [False, True])
def test_optimal_token_baseline_matches_verl(weighted: bool) -> None:
    a = FIXTURE["advantages"]
    adv, ret = compute_advantage(
        "optimal_token_baseline",
        token_level_rewards=a["otb_rewards"],
        response_mask=a["otb_mask"],
        index=a["uids"],
        old_log_probs=a["otb_old_log_probs"],
        sum_pi_squared=a["sum_pi_squared"],
        rollout_is_weights=a["rollout_is_weights"] if weighted else None,
    )
    expected_adv, expected_ret = a[f"otb_w{int(weighted)}"]
    close_on_mask(adv, expected_adv, a["otb_mask"])
    close_on_mask(ret, expected_ret, a["otb_mask"])


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("method", ["pow", "max_min", "max_random"])
def test_pf_ppo_draws_the_rows_verl_draws(method: str, seed: int) -> None:
    pf = FIXTURE["pf_ppo"]
    torch.manual_seed(seed)
    rows = pf_ppo_resample_indices(pf["scores"], method, 3.0)
    assert rows.tolist() == pf[f"{method}_seed{seed}"].tolist()


CORRECTIONS = [
    k for k in FIXTURE["rollout_correction"] if k not in ("old_log_prob", "rollout_log_prob", "mask")
]


def correction_config(keys: dict[str, str]) -> RolloutCorrection:
    """The fixture stores verl's keys as strings; turn them back into what a config would hold."""
    cfg = RolloutCorrection()
    for key, text in keys.items():
        value: object = text
        if key == "rollout_is_batch_normalize":
            value = text == "True"
        elif key == "rollout_is_threshold" and "_" not in text and not text.endswith(".0"):
            value = float(text)
        setattr(cfg, key, value)
    return cfg


@pytest.mark.parametrize("name", [k for k in CORRECTIONS if not k.startswith("bypass")])
def test_rollout_correction_matches_verl_weights_masks_and_metrics(name: str) -> None:
    c = FIXTURE["rollout_correction"]
    expected = c[name]
    weights, mask, metrics = compute_rollout_correction(
        c["old_log_prob"], c["rollout_log_prob"], c["mask"], correction_config(expected["keys"])
    )
    if expected["weights"].numel() == 0:
        assert weights is None
    else:
        assert weights is not None
        close(weights, expected["weights"], "weights")
    assert torch.equal(mask, expected["mask"])
    same_metrics(metrics, expected["metrics"])


@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
def test_bypass_mode_losses_match_verl(loss_type: str) -> None:
    c, p = FIXTURE["rollout_correction"], FIXTURE["policy"]
    expected = c[f"bypass_{loss_type}"]
    log_prob = p["log_prob"].clone().requires_grad_(True)
    config = LossConfig(
        clip_ratio=0.2,
        clip_ratio_low=p["clip_low"],
        clip_ratio_high=p["clip_high"],
        rollout_correction=correction_config(expected["keys"]),
    )
    bypass = get_policy_loss_fn("bypass_mode")  # registered as verl registers it
    loss, metrics = bypass(c["rollout_log_prob"], log_prob, p["advantages"], c["mask"], "token-mean", config)
    loss.backward()
    close(loss.detach(), expected["loss"], "pg_loss")
    close(log_prob.grad, expected["grad"], "gradient")
    same_metrics({k: float(v) for k, v in metrics.items()}, expected["metrics"])


def test_rejection_actually_removes_tokens_in_the_fixture() -> None:
    c = FIXTURE["rollout_correction"]
    for name in ("token_k1", "seq_sum_k1", "seq_max_k2"):
        assert c[name]["mask"].sum() < c["mask"].sum(), name
