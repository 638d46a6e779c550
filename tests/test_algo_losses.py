"""Policy/value losses and aggregation: hand values, references, gradients."""

import math

import pytest
import torch
from helpers import seed_command
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.algo.losses import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_value_loss,
)
from fulcrum.algo.policy_losses import (
    POLICY_LOSSES,
    LossConfig,
    get_policy_loss_fn,
    import_policy_losses,
    policy_loss_names,
    register_policy_loss,
)
from fulcrum.algo.rollout_correction import RolloutCorrection
from fulcrum.config import ConfigError, load_config
from fulcrum.config.schema import PolicyLossConfig
from fulcrum.trainer.checks import check


def policy_loss(
    old: torch.Tensor,
    new: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    loss_mode: str = "vanilla",
    loss_agg_mode: str = "token-mean",
    weights: torch.Tensor | None = None,
    **actor_keys: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The registered loss `loss_mode` with the actor config's defaults, overridden by `actor_keys`."""
    fn = get_policy_loss_fn(loss_mode)
    return fn(old, new, adv, mask, loss_agg_mode, LossConfig(**actor_keys), weights)


def test_agg_loss_modes_hand_computed() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0], [7.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    # Valid: row 0 -> 1, 2, 3 (sum 6, mean 2); row 1 -> 10; row 2 fully masked (left out of seq means).
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(16 / 4)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 10) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 10) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx((6 + 10) / 2 / 4)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=8).item() == pytest.approx(1.0)
    # An all-masked batch gives 0, not NaN.
    for mode in LOSS_AGG_MODES:
        assert agg_loss(loss, torch.zeros_like(mask), mode).item() == 0.0
    with pytest.raises(ValueError, match="loss_agg_mode='token_mean'"):
        agg_loss(loss, mask, "token_mean")


def test_nan_in_padding_does_not_leak() -> None:
    loss = torch.tensor([[1.0, float("nan")], [3.0, float("inf")]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    for mode in LOSS_AGG_MODES:
        assert torch.isfinite(agg_loss(loss, mask, mode)), mode


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), split=st.integers(1, 5), mode=st.sampled_from(LOSS_AGG_MODES))
def test_micro_batches_with_global_counts_add_up_to_the_mini_batch_loss(
    seed: int, split: int, mode: str
) -> None:
    """Gradient accumulation: per-micro-batch losses normalised by mini-batch totals sum to the whole loss."""
    gen = torch.Generator().manual_seed(seed)
    loss = torch.randn(6, 5, generator=gen)
    mask = (torch.rand(6, 5, generator=gen) > 0.3).float()
    mask[0] = 0.0  # a fully masked row
    whole = agg_loss(loss, mask, mode)
    totals = dict(batch_num_tokens=mask.sum(), global_batch_size=(mask.sum(-1) > 0).sum())
    parts = sum(
        agg_loss(loss[s : s + split], mask[s : s + split], mode, **totals) for s in range(0, 6, split)
    )
    assert float(parts) == pytest.approx(float(whole), abs=1e-5)


def token_losses(log_ratio: list[float], advantages: list[float], **actor_keys: object) -> tuple:
    old = torch.zeros(1, len(log_ratio))
    new = torch.tensor([log_ratio]).requires_grad_(True)
    adv = torch.tensor([advantages])
    loss, metrics = policy_loss(old, new, adv, torch.ones_like(adv), **actor_keys)
    loss.backward()
    return loss, metrics, new.grad


def test_vanilla_ppo_hand_computed() -> None:
    # Tokens: (A=1, r=1.5) clipped to 1.2 -> -1.2; (A=-1, r=0.5) clipped to 0.8 -> 0.8;
    # (A=-1, r=5) unclipped 5 capped by the dual clip at c = 3 -> 3; (A=1, r=1.1) -> -1.1.
    ratios = [1.5, 0.5, 5.0, 1.1]
    loss, m, grad = token_losses([math.log(r) for r in ratios], [1.0, -1.0, -1.0, 1.0], clip_ratio=0.2)
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 3.0 - 1.1) / 4, abs=1e-6)
    assert m["actor/pg_clipfrac"].item() == pytest.approx(2 / 4)  # tokens 0 and 1
    assert m["actor/pg_clipfrac_lower"].item() == pytest.approx(1 / 4)  # token 2
    assert m["actor/ppo_kl"].item() == pytest.approx(-sum(math.log(r) for r in ratios) / 4, abs=1e-6)
    # Only the unclipped token carries gradient: d(-A r)/d log r / 4 = -1.1 / 4.
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 0.0, -1.1 / 4]]))


def test_asymmetric_clip_and_dual_clip_constant() -> None:
    # clip-higher: eps_high 0.28 lets r = 1.25 through unclipped for A > 0; eps_low 0.2 still clips r = 0.7.
    loss, m, _ = token_losses([math.log(1.25), math.log(0.7)], [1.0, -1.0], clip_ratio_high=0.28)
    assert loss.item() == pytest.approx((-1.25 + 0.8) / 2, abs=1e-6)
    assert m["actor/pg_clipfrac"].item() == pytest.approx(0.5)
    loss, _, _ = token_losses([math.log(5.0)], [-2.0], clip_ratio_c=4.0)
    assert loss.item() == pytest.approx(8.0, abs=1e-5)  # min(-A r, -A c) = min(10, 8)
    with pytest.raises(ValueError, match=r"clip_ratio_c must be greater than 1\.0"):
        token_losses([0.0], [1.0], clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="clip_ratio"):
        token_losses([0.0], [1.0], clip_ratio=None, clip_ratio_low=None, clip_ratio_high=None)


def test_null_clip_bounds_follow_clip_ratio() -> None:
    # r = 1.5 with A = 1: clipped at 1 + 0.3 when clip_ratio_high is null and clip_ratio is 0.3.
    loss, _, _ = token_losses([math.log(1.5)], [1.0], clip_ratio=0.3, clip_ratio_high=None)
    assert loss.item() == pytest.approx(-1.3, abs=1e-6)


def test_log_ratio_is_clamped_before_exp() -> None:
    loss, m, grad = token_losses([200.0, -200.0], [-1.0, 1.0])
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert m["actor/ppo_kl"].item() == pytest.approx(0.0)  # clamped to +20 and -20
    # Token 0: dual clip caps at c = 3; token 1: r = e^-20, max(-r, -0.8) = -e^-20.
    assert loss.item() == pytest.approx((3.0 - math.exp(-20)) / 2, abs=1e-6)


def test_padding_positions_do_not_change_the_policy_loss() -> None:
    gen = torch.Generator().manual_seed(0)
    old, new, adv = (torch.randn(3, 5, generator=gen) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    junk = torch.where(mask.bool(), torch.zeros(()), torch.full((), 1e4))
    keys = PolicyLossConfig(dro_beta=0.5)  # dro has no default
    bypass = RolloutCorrection(rollout_is="token", bypass_mode=True)  # bypass_mode's settings
    for loss_mode in POLICY_LOSSES:
        for mode in LOSS_AGG_MODES:
            torch.manual_seed(0)  # clip_cov draws its tokens from torch's generator
            a = policy_loss(old, new, adv, mask, loss_mode, mode, policy_loss=keys, rollout_correction=bypass)
            torch.manual_seed(0)
            b = policy_loss(
                old + junk,
                new - junk,
                adv + junk,
                mask,
                loss_mode,
                mode,
                policy_loss=keys,
                rollout_correction=bypass,
            )
            torch.testing.assert_close(a, b, msg=f"{loss_mode} {mode}")


def test_dro_without_its_beta_is_refused_naming_the_key() -> None:
    """verl fails in the first training step; the configuration check stops the run before any model loads."""
    dro = "actor_rollout_ref.actor.policy_loss"
    with pytest.raises(ConfigError, match=rf"{dro}\.dro_beta.*needs policy_loss\.dro_beta > 0") as err:
        check(load_config([*seed_command(), f"{dro}.loss_mode=dro"]))
    assert err.value.key == f"{dro}.dro_beta"
    with pytest.raises(ConfigError, match=rf"{dro}\.dro_beta: -1\.0 is outside its domain: > 0"):
        check(load_config([*seed_command(), f"{dro}.loss_mode=dro", f"{dro}.dro_beta=-1"]))
    check(load_config([*seed_command(), f"{dro}.loss_mode=dro", f"{dro}.dro_beta=0.1"]))
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=rf"{dro}\.dro_beta must be a positive number"):
        policy_loss(x, x, x, torch.ones(1, 2), "dro")


def test_rollout_importance_weights_scale_token_losses() -> None:
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, 1.0]])
    weights = torch.tensor([[0.5, 2.0]])
    loss, _ = policy_loss(old, old, adv, torch.ones(1, 2), weights=weights)
    assert loss.item() == pytest.approx((-0.5 - 2.0) / 2)


def test_gspo_uses_the_sequence_ratio() -> None:
    # Row 0 log-ratios 0.3 and -0.1 over 2 valid tokens (the third is padding): s = exp(0.1).
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.3, -0.1, 5.0], [0.5, 0.5, 0.5]]).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, m = policy_loss(old, new, adv, mask, "gspo", "seq-mean-token-mean")
    loss.backward()
    s0 = math.exp(0.1)  # inside [0.8, 1.2]: loss -s0, gradient -s0 per token / (2 tokens * 2 rows)
    # Row 1: s = e^0.5 = 1.65 with A = -1: max(1.65, 1.2) = 1.65 (no dual clip in GSPO), gradient s / (3 * 2).
    s1 = math.exp(0.5)
    assert loss.item() == pytest.approx((-s0 + s1) / 2, abs=1e-6)
    torch.testing.assert_close(new.grad, torch.tensor([[-s0 / 4, -s0 / 4, 0.0], [s1 / 6, s1 / 6, s1 / 6]]))
    assert m["actor/pg_clipfrac"].item() == 0.0 and m["actor/pg_clipfrac_lower"].item() == 0.0
    assert m["actor/ppo_kl"].item() == pytest.approx(-(0.3 - 0.1 + 1.5) / 5, abs=1e-6)


@settings(max_examples=25, deadline=None)
@given(delta=st.floats(-0.6, 0.6), adv=st.floats(0.1, 3.0), length=st.integers(1, 5))
def test_gspo_equals_ppo_when_every_token_has_the_same_ratio(delta: float, adv: float, length: int) -> None:
    old = torch.zeros(1, length)
    new = torch.full((1, length), delta)
    a = torch.full((1, length), adv)
    mask = torch.ones(1, length)
    ppo_loss, ppo = policy_loss(old, new, a, mask)
    gspo_loss, gspo = policy_loss(old, new, a, mask, "gspo")
    torch.testing.assert_close(gspo_loss, ppo_loss)
    torch.testing.assert_close(gspo["actor/pg_clipfrac"], ppo["actor/pg_clipfrac"])


def test_unknown_policy_loss_is_named() -> None:
    with pytest.raises(ValueError, match=r"loss_mode='gpsO'.*gspo"):
        get_policy_loss_fn("gpsO")


def test_the_built_in_losses_are_verl_s_names() -> None:
    assert set(policy_loss_names()) >= {"vanilla", "gspo", "geo_mean", "gpg", "cispo", "sapo"}


def test_a_registered_loss_is_found_by_name_and_a_taken_name_is_refused() -> None:
    @register_policy_loss("test_half_reinforce")
    def half_reinforce(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, weights=None
    ):
        loss_mat = -0.5 * advantages * log_prob
        return agg_loss(loss_mat, response_mask, loss_agg_mode, **config.global_batch_info), {}

    try:
        new = torch.tensor([[-1.0, -2.0]])
        loss, metrics = policy_loss(new, new, torch.ones(1, 2), torch.ones(1, 2), "test_half_reinforce")
        assert loss.item() == pytest.approx(0.75) and metrics == {}
        with pytest.raises(ValueError, match="'vanilla' is already registered"):
            register_policy_loss("vanilla")(half_reinforce)
    finally:
        POLICY_LOSSES.pop("test_half_reinforce")


def test_a_user_file_registers_its_loss_once(tmp_path) -> None:
    file = tmp_path / "my_losses.py"
    file.write_text(
        "from fulcrum.algo import register_policy_loss\n"
        "@register_policy_loss('test_from_file')\n"
        "def loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, w=None):\n"
        "    return (log_prob * response_mask).sum(), {}\n"
    )
    try:
        assert "test_from_file" in policy_loss_names(str(file))
        import_policy_losses(str(file))  # validation and the actor both import it: no second registration
    finally:
        POLICY_LOSSES.pop("test_from_file")
    with pytest.raises(ImportError, match=r"policy_loss\.path=.*missing\.py"):
        import_policy_losses(str(tmp_path / "missing.py"))
    with pytest.raises(ImportError, match=r"policy_loss\.path=no_such_module"):
        import_policy_losses("no_such_module")


def test_value_loss_hand_computed() -> None:
    # Token 0: vpred 1.0 vs old 0 with clip 0.5 -> 0.5; returns 2: max((1-2)^2, (0.5-2)^2) = 2.25 (clipped).
    # Token 1: vpred 0.2, old 0, inside the clip: (0.2-1)^2 = 0.64 both ways. Token 2 is padding.
    vpreds = torch.tensor([[1.0, 0.2, 100.0]])
    values = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0, -100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    assert vf_loss.item() == pytest.approx(0.5 * (2.25 + 0.64) / 2)
    assert vf_clipfrac.item() == pytest.approx(0.5)
    # The clipped max can also pick the clipped side when vpred overshoots towards the return.
    vf_loss, vf_clipfrac = compute_value_loss(
        torch.tensor([[3.0]]),
        torch.tensor([[2.0]]),
        torch.tensor([[0.0]]),
        torch.ones(1, 1),
        cliprange_value=0.5,
    )
    assert vf_loss.item() == pytest.approx(0.5 * 1.5**2) and vf_clipfrac.item() == 1.0
