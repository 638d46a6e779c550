"""KL estimators, straight-through gradients, in-reward penalty, controllers; masked statistics."""

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.algo.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    full_kl_from_logits,
    kl_penalty,
)
from fulcrum.algo.masked import masked_mean, masked_var, masked_whiten

LOGPROB_ESTIMATORS = [k for k in KL_ESTIMATORS if k != "full"]


def test_estimators_hand_computed() -> None:
    # d = logp - logp_ref = 1: k1 = 1, abs = 1, k2 = 0.5, k3 = e^-1 + 1 - 1.
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    expected = {
        "kl": 1.0,
        "k1": 1.0,
        "abs": 1.0,
        "mse": 0.5,
        "k2": 0.5,
        "low_var_kl": math.exp(-1),
        "k3": math.exp(-1),
    }
    for kind, value in expected.items():
        assert kl_penalty(logp, ref, kind).item() == pytest.approx(value, abs=1e-6), kind
    assert kl_penalty(ref, logp, "abs").item() == pytest.approx(1.0)
    assert kl_penalty(ref, logp, "kl").item() == pytest.approx(-1.0)


def test_k3_is_clamped() -> None:
    logp, ref = torch.tensor([-40.0, -1.0]), torch.tensor([-1.0, -40.0])
    k3 = kl_penalty(logp, ref, "low_var_kl")
    assert k3[0].item() == 10.0  # e^20 - 21 clamped to 10
    assert k3[1].item() == 10.0  # log-ratio -39 clamped to -20: e^-20 + 20 - 1 = 19, clamped to 10


@settings(max_examples=40, deadline=None)
@given(d=st.floats(-15, 15), ref=st.floats(-10, 0))
def test_k3_is_nonnegative_and_matches_formula(d: float, ref: float) -> None:
    logp = torch.tensor([ref + d], dtype=torch.float64)
    k3 = kl_penalty(logp, torch.tensor([ref], dtype=torch.float64), "k3").item()
    assert (
        k3 >= -1e-15
    )  # e^-d + d - 1 >= 0; float64 rounding gives -1.1e-16 at d = -2.6e-11 (hypothesis found it)
    assert k3 == pytest.approx(min(math.exp(-d) + d - 1, 10.0), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("kind", LOGPROB_ESTIMATORS)
def test_plus_suffix_keeps_the_value_and_takes_the_k2_gradient(kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    ref = -torch.rand(3, 4, generator=gen) * 3
    logp = (ref + torch.randn(3, 4, generator=gen)).requires_grad_(True)
    plain = kl_penalty(logp, ref, kind)
    straight = kl_penalty(logp, ref, kind + "+")
    torch.testing.assert_close(straight.detach(), plain.detach())
    straight.sum().backward()
    # d/dlogp of (logp - ref)^2 / 2.
    torch.testing.assert_close(logp.grad, (logp - ref).detach())


def test_plain_k1_and_k3_gradients_differ_from_k2() -> None:
    logp = torch.tensor([-0.5]).requires_grad_(True)
    ref = torch.tensor([-1.5])
    kl_penalty(logp, ref, "k3").sum().backward()
    # d/dlogp (e^(ref-logp) - (ref-logp) - 1) = 1 - e^(ref-logp) = 1 - e^-1, not d = 1.
    assert logp.grad.item() == pytest.approx(1 - math.exp(-1))


def test_full_kl_from_logits() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 9, generator=gen) * 2
    ref_logits = torch.randn(2, 3, 9, generator=gen) * 2
    full = kl_penalty(logits, ref_logits, "full")
    assert full.shape == (2, 3)
    # Independent reference: torch's kl_div (KL(p||q) with log-space target p).
    expected = torch.nn.functional.kl_div(
        torch.log_softmax(ref_logits.double(), -1),
        torch.log_softmax(logits.double(), -1),
        log_target=True,
        reduction="none",
    ).sum(-1)
    torch.testing.assert_close(full.double(), expected, atol=1e-5, rtol=1e-5)
    assert (full >= 0).all()
    assert (
        kl_penalty(logits, logits + 7.0, "full").abs().max().item() < 1e-6
    )  # a shift is the same distribution
    # Full KL is the expectation of k1 under p: sum_v p_v * (log p_v - log q_v).
    logp, logq = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    torch.testing.assert_close(
        full, (logp.exp() * kl_penalty(logp, logq, "k1")).sum(-1), atol=1e-5, rtol=1e-5
    )
    # A -inf logit (probability 0 under the policy) is fine, with finite gradients.
    masked = logits.clone()
    masked[..., 0] = float("-inf")
    masked.requires_grad_(True)
    value = full_kl_from_logits(masked, ref_logits)
    value.sum().backward()
    assert torch.isfinite(value).all() and torch.isfinite(masked.grad).all()
    # '+' leaves the exact KL alone.
    torch.testing.assert_close(kl_penalty(logits, ref_logits, "full+"), full)
    with pytest.raises(ValueError, match=r"'full' needs the \(B, T, V\) logits"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(2, 3), "full")
    with pytest.raises(ValueError, match="equal shape"):
        full_kl_from_logits(logits, ref_logits[..., :5])


def test_unknown_estimator_is_named() -> None:
    x = torch.zeros(2)
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'.*low_var_kl"):
        kl_penalty(x, x, "k4")


def test_apply_kl_penalty_hand_computed() -> None:
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -9.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    out = apply_kl_penalty(scores, logp, ref, mask, kl_coef=0.1, kind="kl")
    # KL = [[0.5, 0, -0.5], [1, 0, (masked)]]: rewards = scores - 0.1 KL; per-row means 0 and 0.5 -> 0.25.
    torch.testing.assert_close(out.token_level_rewards, torch.tensor([[-0.05, 0.0, 1.05], [-0.1, 2.0, 0.0]]))
    assert out.current_kl == pytest.approx(0.25)


def test_fixed_controller_never_moves() -> None:
    ctrl = FixedKLController(0.01)
    for kl in (0.0, 1.0, 100.0):
        ctrl.update(kl, n_steps=256)
    assert ctrl.value == 0.01


def test_adaptive_controller_hand_computed_and_clipped() -> None:
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=10)
    ctrl.update(0.1, n_steps=5)  # error clip(2 - 1, ±0.2) = 0.2: x (1 + 0.2 * 5 / 10)
    assert ctrl.value == pytest.approx(0.11)
    ctrl.update(0.045, n_steps=5)  # error -0.1: x 0.95
    assert ctrl.value == pytest.approx(0.11 * 0.95)
    ctrl.update(0.0, n_steps=10)  # error clip(-1) = -0.2: x 0.8
    assert ctrl.value == pytest.approx(0.11 * 0.95 * 0.8)


def test_controller_state_round_trips() -> None:
    ctrl = AdaptiveKLController(0.2, 0.1, 100)
    for kl in (0.3, 0.02, 0.15):
        ctrl.update(kl, n_steps=32)
    state = ctrl.state_dict()
    assert all(isinstance(v, float) for v in state.values())
    resumed = AdaptiveKLController(0.2, 0.1, 100)
    resumed.load_state_dict(state)
    for c in (ctrl, resumed):
        c.update(0.5, n_steps=32)
    assert resumed.value == ctrl.value
    fixed = FixedKLController(0.5)
    other = FixedKLController(0.1)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.5


@dataclass
class KLCtrl:
    type: str = "adaptive"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


def test_build_kl_controller_from_config() -> None:
    assert isinstance(build_kl_controller(KLCtrl(type="fixed")), FixedKLController)
    adaptive = build_kl_controller({"type": "adaptive", "kl_coef": 0.2, "horizon": 50, "target_kl": 0.05})
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == 0.2 and adaptive.horizon == 50
    with pytest.raises(ValueError, match=r"algorithm\.kl_ctrl\.type='pid'"):
        build_kl_controller(KLCtrl(type="pid"))
    with pytest.raises(ValueError, match=r"algorithm\.kl_ctrl\.horizon must be positive"):
        build_kl_controller(KLCtrl(horizon=0))
    with pytest.raises(ValueError, match=r"algorithm\.kl_ctrl\.target_kl must be positive"):
        build_kl_controller(KLCtrl(target_kl=0.0))


def test_masked_statistics_hand_computed() -> None:
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, float("nan"), 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    # Valid: 1, 2, 3, 6 -> mean 3, unbiased var (4 + 1 + 0 + 9) / 3.
    assert masked_mean(values, mask).item() == pytest.approx(3.0)
    torch.testing.assert_close(masked_mean(values, mask, axis=1), torch.tensor([1.5, 4.5]))
    assert masked_var(values, mask).item() == pytest.approx(14 / 3)
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(14 / 4)
    white = masked_whiten(values, mask)
    assert white[0, 0].item() == pytest.approx(-2 / math.sqrt(14 / 3), abs=1e-6)
    assert masked_whiten(values, mask, shift_mean=False)[0, 0].item() == pytest.approx(
        3 - 2 / math.sqrt(14 / 3)
    )
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0
    with pytest.raises(ValueError, match="selects no element"):
        masked_var(values, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="single element"):
        masked_var(values, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
