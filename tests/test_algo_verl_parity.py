"""fulcrum.algo against verl's own functions on the same inputs (float32, within 1e-5; the Clip-Cov, KL-Cov,
DPPO and DRO losses within 1e-6).

The expected values in tests/fixtures/verl_algo.pt were produced by verl (version stored in the file)
with tests/fixtures/make_verl_algo_fixture.py; fulcrum does not import verl. Where fulcrum zeroes
outputs on masked tokens (verl leaves values there), valid tokens are compared and masked ones must be 0.
"""

import ast
from pathlib import Path

import pytest
import torch
from helpers import verl_fixture_policy_loss
from packaging.version import Version

from fulcrum.algo.advantages import compute_advantage
from fulcrum.algo.kl import AdaptiveKLController, kl_penalty
from fulcrum.algo.losses import agg_loss, compute_value_loss
from fulcrum.algo.masked import masked_mean, masked_var, masked_whiten
from fulcrum.config.schema import PolicyLossConfig
from fulcrum.models.logprob import logprob_and_entropy

FIXTURE = torch.load(Path(__file__).parent / "fixtures" / "verl_algo.pt", weights_only=True)
TOL = dict(rtol=1e-5, atol=1e-5)
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def close(actual: torch.Tensor, expected: torch.Tensor | float) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), **TOL)


def close_on_mask(actual: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor) -> None:
    valid = mask.bool()
    torch.testing.assert_close(actual[valid], expected[valid], **TOL)
    assert torch.all(actual[~valid] == 0), "outputs on masked tokens must be 0"


def test_fixture_is_what_its_generator_script_writes() -> None:
    """The fixture holds exactly the sections tests/fixtures/make_verl_algo_fixture.py writes (so it was not
    hand-edited or left behind by an older script) and the verl release that produced them."""
    script = ast.parse((Path(__file__).parent / "fixtures" / "make_verl_algo_fixture.py").read_text())
    written = {
        target.slice.value
        for node in ast.walk(script)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Subscript)
        and isinstance(target.value, ast.Name)
        and target.value.id == "fixture"
        and isinstance(target.slice, ast.Constant)
    }
    assert written, "the generator script no longer writes fixture[...] sections"
    assert set(FIXTURE) == written | {"verl_version"}
    assert Version(FIXTURE["verl_version"]).release  # a release version string, as importlib.metadata gives


def test_masked_statistics_match_verl() -> None:
    m = FIXTURE["masked"]
    values, mask = m["values"], m["mask"]
    close(masked_mean(values, mask), m["mean"])
    close(masked_mean(values, mask, axis=1), m["mean_axis1"])
    close(masked_var(values, mask), m["var"])
    close(masked_var(values, mask, unbiased=False), m["var_biased"])
    close(masked_whiten(values, mask), m["whiten"])
    close(masked_whiten(values, mask, shift_mean=False), m["whiten_noshift"])


@pytest.mark.parametrize("rewards_kind", ["dense", "outcome"])
@pytest.mark.parametrize("estimator", ["gae", "reinforce_plus_plus", "remax"])
def test_token_level_estimators_match_verl(estimator: str, rewards_kind: str) -> None:
    a = FIXTURE["advantages"]
    adv, ret = compute_advantage(
        estimator,
        token_level_rewards=a[f"{rewards_kind}_rewards"],
        response_mask=a["mask"],
        values=a["values"],
        reward_baselines=a["reward_baselines"],
        gamma=a["gamma"],
        lam=a["lam"],
    )
    expected_adv, expected_ret = a[f"{estimator}_{rewards_kind}"]
    close_on_mask(adv, expected_adv, a["mask"])
    close_on_mask(ret, expected_ret, a["mask"])


@pytest.mark.parametrize(
    ("estimator", "key", "norm"),
    [
        ("grpo", "grpo_norm1", True),
        ("grpo", "grpo_norm0", False),
        ("rloo", "rloo", True),
        ("reinforce_plus_plus_baseline", "reinforce_plus_plus_baseline", True),
    ],
)
def test_group_estimators_match_verl(estimator: str, key: str, norm: bool) -> None:
    a = FIXTURE["advantages"]
    # verl was given string uids; fulcrum accepts any hashable uids, here the integer ones.
    adv, ret = compute_advantage(
        estimator,
        token_level_rewards=a["outcome_rewards"],
        response_mask=a["mask"],
        index=a["uids"],
        norm_adv_by_std_in_grpo=norm,
    )
    expected_adv, expected_ret = a[key]
    close_on_mask(adv, expected_adv, a["mask"])
    close_on_mask(ret, expected_ret, a["mask"])


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_matches_verl(mode: str) -> None:
    p = FIXTURE["policy"]
    close(agg_loss(p["advantages"], p["mask"], mode), p[f"agg_{mode}"])


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo"])
def test_policy_losses_match_verl_values_and_gradients(loss_mode: str, mode: str) -> None:
    p = FIXTURE["policy"]
    loss, metrics, log_prob = verl_fixture_policy_loss(p, mode, loss_mode, clip_ratio_c=p["clip_ratio_c"])
    expected = p[f"{loss_mode}_{mode}"]
    close(loss.detach(), expected[0])
    close(metrics["actor/pg_clipfrac"], expected[1])
    close(metrics["actor/ppo_kl"], expected[2])
    if loss_mode == "vanilla":
        close(metrics["actor/pg_clipfrac_lower"], expected[3])
        assert metrics["actor/pg_clipfrac_lower"] > 0, "the fixture has a dual-clipped token"
    close(log_prob.grad, expected[-1])


EXTRA = FIXTURE["policy_extra"]
# "<loss_mode>_<loss_agg_mode>_w<0|1>": verl's outputs of one loss, one aggregation, with or without IS weights
EXTRA_CASES = sorted(key for key in EXTRA if isinstance(EXTRA[key], dict) and "grad" in EXTRA[key])
EXACT = dict(rtol=0.0, atol=1e-6)  # float32, the same operations in the same order as verl


def extra_loss(case: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Our loss of fixture case `case` on its inputs, after seeding torch's global generator with the seed
    verl's call had (Clip-Cov draws its tokens from it)."""
    rest, weighted = case.rsplit("_w", 1)
    loss_mode, mode = rest.rsplit("_", 1)
    keys = PolicyLossConfig(loss_mode=loss_mode, **EXTRA["keys"])
    torch.manual_seed(EXTRA[case]["seed"])
    return verl_fixture_policy_loss(
        EXTRA,
        mode,
        loss_mode,
        rollout_is_weights=EXTRA["rollout_is_weights"] if weighted == "1" else None,
        clip_ratio_c=EXTRA["clip_ratio_c"],
        policy_loss=keys,
    )


@pytest.mark.parametrize("case", EXTRA_CASES)
def test_clip_cov_kl_cov_dppo_and_dro_match_verl(case: str) -> None:
    """Loss, every metric verl returns (and no other) and the gradient wrt log_prob, within 1e-6."""
    expected = EXTRA[case]
    loss, metrics, log_prob = extra_loss(case)
    torch.testing.assert_close(loss.detach(), torch.tensor(expected["loss"]), **EXACT)
    assert sorted(metrics) == sorted(expected["metrics"])
    for key, value in expected["metrics"].items():
        torch.testing.assert_close(metrics[key], torch.tensor(value), **EXACT, msg=key)
    torch.testing.assert_close(log_prob.grad, expected["grad"], **EXACT)


def test_the_fixture_exercises_clip_cov_kl_cov_and_both_dppo_regions() -> None:
    cases = {key: EXTRA[f"{key}_token-mean_w0"] for key in ("clip_cov", "dppo_tv", "dppo_kl")}
    assert cases["clip_cov"]["metrics"]["actor/pg_clipfrac"] > 0, "Clip-Cov cut no token"
    assert len({EXTRA[case]["seed"] for case in EXTRA_CASES}) > 1, "one draw only"
    assert int(EXTRA["mask"].sum() * EXTRA["keys"]["kl_cov_ratio"]) >= 2, "KL-Cov penalises one token"
    for name in ("dppo_tv", "dppo_kl"):
        m = cases[name]["metrics"]
        assert 0 < m["actor/pg_clipfrac"] < 1 and m["actor/pg_clipfrac_lower"] > 0, name
    assert cases["dppo_tv"]["loss"] != cases["dppo_kl"]["loss"], "the two trust regions agree everywhere"
    assert (EXTRA["advantages"] > 0).any() and (EXTRA["advantages"] < 0).any()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_matches_verl(mode: str) -> None:
    v = FIXTURE["value"]
    vf_loss, vf_clipfrac = compute_value_loss(
        vpreds=v["vpreds"],
        returns=v["returns"],
        values=v["values"],
        response_mask=v["mask"],
        cliprange_value=v["cliprange_value"],
        loss_agg_mode=mode,
    )
    close(vf_loss, v[mode][0])
    close(vf_clipfrac, v[mode][1])


@pytest.mark.parametrize(
    "kind", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "abs+", "low_var_kl+", "k3+", "mse+"]
)
def test_kl_estimators_match_verl_values_and_gradients(kind: str) -> None:
    k = FIXTURE["kl"]
    mask = FIXTURE["policy"]["mask"]
    log_prob = k["log_prob"].clone().requires_grad_(True)
    estimate = kl_penalty(log_prob, k["ref_log_prob"], kind)
    (estimate * mask).sum().backward()
    close(estimate.detach(), k[kind][0])
    close(log_prob.grad, k[kind][1])


def test_entropy_and_logprobs_match_verl() -> None:
    """The function training runs (`fulcrum.workers.forwards.LogProbHead` calls it), with and without gradients."""
    lg = FIXTURE["logits"]
    logp, entropy = logprob_and_entropy(lg["logits"], lg["labels"], with_entropy=True)
    close(entropy, lg["entropy"])
    close(logp, lg["logprobs"])
    close(logp, lg["logprobs_naive"])
    with torch.no_grad():  # the chunked path the old/ref log-prob stages take
        logp, entropy = logprob_and_entropy(lg["logits"], lg["labels"], with_entropy=True)
    close(entropy, lg["entropy"])
    close(logp, lg["logprobs"])


def test_adaptive_kl_controller_matches_verl_trajectory() -> None:
    a = FIXTURE["adaptive_kl"]
    ctrl = AdaptiveKLController(a["init"], a["target"], a["horizon"])
    values = []
    for kl in a["kls"]:
        ctrl.update(kl, n_steps=a["n_steps"])
        values.append(ctrl.value)
    assert values == pytest.approx(a["values"], rel=1e-12)


@pytest.mark.gpu
def test_functions_run_on_cuda_and_match_verl() -> None:
    """Same fixture on the GPU: no host-only op hides in the maths (uids stay a host list)."""
    cuda = torch.device("cuda")
    a = FIXTURE["advantages"]
    for estimator, key in (
        ("gae", "gae_dense"),
        ("grpo", "grpo_norm1"),
        ("reinforce_plus_plus", "reinforce_plus_plus_dense"),
    ):
        adv, ret = compute_advantage(
            estimator,
            token_level_rewards=a["dense_rewards" if estimator != "grpo" else "outcome_rewards"].to(cuda),
            response_mask=a["mask"].to(cuda),
            values=a["values"].to(cuda),
            index=a["uids"].tolist(),
            gamma=a["gamma"],
            lam=a["lam"],
        )
        assert adv.device.type == "cuda"
        close_on_mask(adv.cpu(), a[key][0], a["mask"])
        close_on_mask(ret.cpu(), a[key][1], a["mask"])
    p = FIXTURE["policy"]
    on_cuda = {k: v.to(cuda) if isinstance(v, torch.Tensor) else v for k, v in p.items()}
    loss, _, log_prob = verl_fixture_policy_loss(on_cuda, "token-mean", "vanilla")
    expected = p["vanilla_token-mean"]
    close(loss.detach().cpu(), expected[0])
    close(log_prob.grad.cpu(), expected[-1])
    k = FIXTURE["kl"]
    close(
        kl_penalty(k["log_prob"].to(cuda), k["ref_log_prob"].to(cuda), "low_var_kl").cpu(), k["low_var_kl"][0]
    )
    lg = FIXTURE["logits"]
    logp, entropy = logprob_and_entropy(lg["logits"].to(cuda), lg["labels"].to(cuda), with_entropy=True)
    close(entropy.cpu(), lg["entropy"])
    close(logp.cpu(), lg["logprobs"])


@pytest.mark.gpu
@pytest.mark.parametrize("loss_mode", ["clip_cov", "kl_cov", "dppo_tv", "dppo_kl", "dro"])
def test_clip_cov_kl_cov_dppo_and_dro_run_on_cuda_and_match_verl(loss_mode: str) -> None:
    """Clip-Cov and KL-Cov pick tokens across host and device (randperm, topk on the host): on the GPU they
    pick verl's tokens too (GPU reductions round differently: within 1e-5)."""
    cuda = torch.device("cuda")
    case = f"{loss_mode}_token-mean_w0"
    on_cuda = {k: v.to(cuda) if isinstance(v, torch.Tensor) else v for k, v in EXTRA.items()}
    torch.manual_seed(EXTRA[case]["seed"])
    loss, metrics, log_prob = verl_fixture_policy_loss(
        on_cuda,
        "token-mean",
        loss_mode,
        clip_ratio_c=EXTRA["clip_ratio_c"],
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, **EXTRA["keys"]),
    )
    close(loss.detach().cpu(), EXTRA[case]["loss"])
    close(log_prob.grad.cpu(), EXTRA[case]["grad"])
    for key, value in EXTRA[case]["metrics"].items():
        close(metrics[key].cpu(), value)
