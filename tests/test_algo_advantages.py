"""Advantage estimators: hand-computed values, float64 loop references, padding and group invariants."""

from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fulcrum.algo.advantages import ADVANTAGE_ESTIMATORS, compute_advantage

HYPOTHESIS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def whiten_ref(values: list[float]) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    return (x - x.mean()) / np.sqrt(x.var(ddof=1) + 1e-8)


def gae_ref(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """GAE over each row's valid tokens only (masked tokens removed), explicit reverse loop in float64.

    Returns raw advantages and returns on valid positions, as {(row, t): value} dicts.
    """
    adv, ret = {}, {}
    for i in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[i, t] > 0]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(steps):
            r, v = float(rewards[i, t]), float(values[i, t])
            delta = r + gamma * next_value - v
            next_adv = delta + gamma * lam * next_adv
            next_value = v
            adv[(i, t)] = next_adv
            ret[(i, t)] = next_adv + v
    return adv, ret


def random_batch(seed: int, batch: int = 5, length: int = 7, gaps: bool = True):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length) < lengths.unsqueeze(1)).float()
    if gaps:  # masked observation tokens inside responses
        mask = mask * (torch.rand(batch, length, generator=gen) > 0.2).float()
        mask[:, 0] = 1.0
    rewards = torch.randn(batch, length, generator=gen)
    values = torch.randn(batch, length, generator=gen)
    return rewards, values, mask


def test_gae_hand_computed() -> None:
    # gamma = lam = 1: A = [0.5, 0.4, 0.3] (deltas 0.1, 0.1, 0.3), returns = A + V = 1; whitened [1, 0, -1].
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = compute_advantage("gae", token_level_rewards=rewards, response_mask=mask, values=values)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[1.0, 0.0, -1.0, 0.0]]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_matches_float64_loop_with_masked_gaps(seed: int, gamma: float, lam: float) -> None:
    rewards, values, mask = random_batch(seed)
    adv, ret = compute_advantage(
        "gae", token_level_rewards=rewards, response_mask=mask, values=values, gamma=gamma, lam=lam
    )
    raw, returns = gae_ref(rewards, values, mask, gamma, lam)
    keys = sorted(raw)
    whitened = whiten_ref([raw[k] for k in keys])
    for k, w in zip(keys, whitened, strict=True):
        assert float(ret[k]) == pytest.approx(returns[k], abs=1e-5)
        assert float(adv[k]) == pytest.approx(w, abs=1e-4)
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)


@HYPOTHESIS
@given(seed=st.integers(0, 10_000), insert_at=st.integers(0, 7), width=st.integers(1, 3))
def test_inserted_masked_tokens_do_not_change_valid_results(seed: int, insert_at: int, width: int) -> None:
    """Masked tokens (padding or observations) with garbage rewards/values, anywhere, change nothing."""
    # float64: a group whose scores nearly tie divides float32 summation-order rounding by a tiny std
    # (seed 1254: std 0.0025 turns 1e-7 into 2e-5); the property under test is exact masking, not rounding.
    rewards, values, mask = (x.double() for x in random_batch(seed, gaps=False))
    gen = torch.Generator().manual_seed(seed + 1)
    junk = torch.randn(rewards.shape[0], width, generator=gen, dtype=torch.float64) * 100

    def widen(x: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, :insert_at], fill, x[:, insert_at:]], dim=1)

    wide_mask = widen(mask, torch.zeros_like(junk))
    keep = torch.cat([torch.arange(insert_at), torch.arange(insert_at + width, wide_mask.shape[1])])
    uids = [0, 0, 1, 1, 1]
    for name in ADVANTAGE_ESTIMATORS:
        if name == "optimal_token_baseline":
            continue  # its zero tail starts at a position, as verl's: inserted columns move it (tested below)
        kwargs = dict(index=uids, reward_baselines=torch.ones(5, dtype=torch.float64), gamma=0.9, lam=0.8)
        adv, ret = compute_advantage(
            name, token_level_rewards=rewards, response_mask=mask, values=values, **kwargs
        )
        wide_adv, wide_ret = compute_advantage(
            name,
            token_level_rewards=widen(rewards, junk),
            response_mask=wide_mask,
            values=widen(values, junk),
            **kwargs,
        )
        torch.testing.assert_close(wide_adv[:, keep], adv, atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(wide_ret[:, keep], ret, atol=1e-5, rtol=1e-5, msg=name)
        assert torch.all(wide_adv[wide_mask == 0] == 0), name


def group_ref(scores: list[float], uids: list[int], kind: str, norm: bool = True) -> list[float]:
    """Per-group Python loop in float64: grpo / rloo / baseline advantages per row."""
    groups: dict[int, list[float]] = defaultdict(list)
    for s, u in zip(scores, uids, strict=True):
        groups[u].append(s)
    out = []
    for s, u in zip(scores, uids, strict=True):
        g = np.asarray(groups[u], dtype=np.float64)
        n = len(g)
        if kind == "grpo":
            mean, std = (0.0, 1.0) if n == 1 else (g.mean(), g.std(ddof=1))
            out.append((s - mean) / (std + 1e-6) if norm else s - mean)
        elif kind == "rloo":
            out.append(s if n == 1 else s - (g.sum() - s) / (n - 1))
        else:
            out.append(s - (0.0 if n == 1 else g.mean()))
    return out


def outcome(scores: list[float], lengths: list[int], length: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    mask = (torch.arange(length) < torch.tensor(lengths).unsqueeze(1)).float()
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(scores)), torch.tensor(lengths) - 1] = torch.tensor(scores)
    return rewards, mask


def test_grpo_hand_computed() -> None:
    # Group a: scores 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3): A = ±0.5 * sqrt(3). Group b (single): A = 2.
    rewards, mask = outcome([1.0, 0.0, 0.0, 1.0, 2.0], [3, 6, 1, 2, 4])
    adv, ret = compute_advantage(
        "grpo", token_level_rewards=rewards, response_mask=mask, index=["a"] * 4 + ["b"]
    )
    half_sqrt3 = 0.5 * 3**0.5 / (1 + 1e-6 * 3**0.5)
    assert adv[0, 0] == pytest.approx(half_sqrt3, abs=1e-6)
    assert adv[1, 5] == pytest.approx(-half_sqrt3, abs=1e-6)
    assert adv[4, 3] == pytest.approx(2.0, abs=1e-5)
    torch.testing.assert_close(adv, ret)
    assert torch.all(adv[mask == 0] == 0)
    adv_dr, _ = compute_advantage(
        "grpo",
        token_level_rewards=rewards,
        response_mask=mask,
        index=["a"] * 4 + ["b"],
        norm_adv_by_std_in_grpo=False,
    )
    assert adv_dr[0, 0] == pytest.approx(0.5) and adv_dr[2, 0] == pytest.approx(-0.5) and adv_dr[4, 0] == 2.0


def test_rloo_and_baseline_hand_computed() -> None:
    rewards, mask = outcome([1.0, 0.0, 0.0], [2, 2, 2], length=2)
    adv, _ = compute_advantage("rloo", token_level_rewards=rewards, response_mask=mask, index=[7, 7, 7])
    # Leave-one-out: 1 - 0, 0 - 0.5, 0 - 0.5.
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, -0.5, -0.5]))
    adv_b, _ = compute_advantage(
        "reinforce_plus_plus_baseline", token_level_rewards=rewards, response_mask=mask, index=[7, 7, 7]
    )
    # s - mean = [2/3, -1/3, -1/3] on 2 tokens each; whitened over the 6 tokens (unbiased var = 4/15).
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3]) / (4 / 15) ** 0.5
    torch.testing.assert_close(adv_b[:, 1], expected, atol=1e-5, rtol=1e-5)


@HYPOTHESIS
@given(
    scores=st.lists(st.sampled_from([0.0, 0.5, 1.0, -1.0, 2.5]), min_size=2, max_size=12),
    data=st.data(),
)
def test_group_estimators_match_loop_and_centre_groups(scores: list[float], data: st.DataObject) -> None:
    n = len(scores)
    uids = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    lengths = data.draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    rewards, mask = outcome(scores, lengths)
    for kind, name in (("grpo", "grpo"), ("rloo", "rloo"), ("base", "reinforce_plus_plus_baseline")):
        for norm in (True, False) if kind == "grpo" else (True,):
            adv, ret = compute_advantage(
                name,
                token_level_rewards=rewards,
                response_mask=mask,
                index=uids,
                norm_adv_by_std_in_grpo=norm,
            )
            assert torch.all(adv[mask == 0] == 0), name
            torch.testing.assert_close(adv, ret)
            per_row = adv[torch.arange(n), 0].double()
            if kind != "base":
                expected = torch.tensor(group_ref(scores, uids, kind, norm), dtype=torch.float64)
                torch.testing.assert_close(per_row, expected, atol=1e-4, rtol=1e-5)
                # Every group of two or more has zero mean advantage.
                for u in set(uids):
                    rows = [i for i in range(n) if uids[i] == u]
                    if len(rows) > 1:
                        assert abs(float(per_row[rows].mean())) < 1e-4
            elif mask.sum() > 1 and len(set(group_ref(scores, uids, kind))) > 1:
                # Baseline: token-weighted whitening of the group-centred scores.
                centred = group_ref(scores, uids, kind)
                tokens = [c for c, ln in zip(centred, lengths, strict=True) for _ in range(ln)]
                first = np.cumsum([0, *lengths[:-1]])
                expected = torch.tensor(whiten_ref(tokens)[first])
                torch.testing.assert_close(per_row, expected, atol=1e-4, rtol=1e-4)


def test_reinforce_plus_plus_hand_computed() -> None:
    # gamma 0.5, rewards [1, 0, 2]: returns [1.5, 1.0, 2.0]; mean 1.5, unbiased var 0.25 -> A = [0, -1, 1].
    rewards = torch.tensor([[1.0, 0.0, 2.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = compute_advantage(
        "reinforce_plus_plus", token_level_rewards=rewards, response_mask=mask, gamma=0.5
    )
    torch.testing.assert_close(ret, torch.tensor([[1.5, 1.0, 2.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.0, -1.0, 1.0, 0.0]]), atol=1e-5, rtol=0)


def test_remax_hand_computed() -> None:
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv, ret = compute_advantage(
        "remax", token_level_rewards=rewards, response_mask=mask, reward_baselines=torch.tensor([0.25, 1.0])
    )
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.75, 0.0], [0.0, 0.0, 0.0]]))


def test_every_estimator_accepts_the_common_keywords() -> None:
    rewards, values, mask = random_batch(0, batch=4)
    common = dict(
        token_level_rewards=rewards,
        response_mask=mask,
        values=values,
        index=np.array(["p0", "p0", "p1", "p1"], dtype=object),
        reward_baselines=torch.zeros(4),
        gamma=1.0,
        lam=0.95,
        norm_adv_by_std_in_grpo=True,
        old_log_probs=-torch.rand(4, rewards.shape[1]),
        sum_pi_squared=torch.rand(4, rewards.shape[1]),
    )
    for name, fn in ADVANTAGE_ESTIMATORS.items():
        adv, ret = fn(**common)
        assert adv.shape == ret.shape == rewards.shape, name
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), name


@pytest.mark.parametrize(
    ("name", "missing", "message"),
    [
        ("gae", "values", "adv_estimator=gae needs `values"),
        ("grpo", "index", "adv_estimator=grpo needs `index"),
        ("rloo", "index", "adv_estimator=rloo needs `index"),
        ("reinforce_plus_plus_baseline", "index", "needs `index"),
        ("remax", "reward_baselines", "adv_estimator=remax needs `reward_baselines"),
        ("gpg", "index", "adv_estimator=gpg needs `index"),
        ("optimal_token_baseline", "sum_pi_squared", "needs `sum_pi_squared"),
    ],
)
def test_missing_inputs_name_what_is_needed(name: str, missing: str, message: str) -> None:
    rewards, values, mask = random_batch(1, batch=4)
    kwargs = dict(
        values=values,
        index=[0, 0, 1, 1],
        reward_baselines=torch.zeros(4),
        old_log_probs=torch.zeros(rewards.shape),
        sum_pi_squared=torch.ones(rewards.shape),
    )
    kwargs.pop(missing)
    with pytest.raises(ValueError, match=message):
        compute_advantage(name, token_level_rewards=rewards, response_mask=mask, **kwargs)


def test_bad_names_and_shapes_are_reported() -> None:
    rewards, _, mask = random_batch(2, batch=4)
    with pytest.raises(ValueError, match=r"adv_estimator='gea'.*'gae'"):
        compute_advantage("gea", token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match="same"):
        compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask[:, :3], index=[0] * 4)
    with pytest.raises(ValueError, match="index has 3 uids but the batch has 4 rows"):
        compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask, index=[0, 0, 1])


def test_integer_and_bool_masks_give_the_same_results_as_float_masks() -> None:
    rewards, values, mask = random_batch(5, batch=4)
    kwargs = dict(
        values=values,
        index=[0, 0, 1, 1],
        reward_baselines=torch.zeros(4),
        gamma=0.9,
        lam=0.9,
        old_log_probs=-torch.rand(rewards.shape),
        sum_pi_squared=torch.rand(rewards.shape),
    )
    for name in ADVANTAGE_ESTIMATORS:
        expected = compute_advantage(name, token_level_rewards=rewards, response_mask=mask, **kwargs)
        for other in (mask.long(), mask.bool()):
            got = compute_advantage(name, token_level_rewards=rewards, response_mask=other, **kwargs)
            for x, y in zip(got, expected, strict=True):
                assert x.dtype == torch.float32, name
                torch.testing.assert_close(x, y, msg=name)


def test_gpg_scales_by_the_share_of_rows_with_a_reward() -> None:
    # Scores 1, 0 (group a) and 0, 0 (group b): one row of four is non-zero, so alpha = 4.
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    mask = torch.ones(4, 2)
    adv, ret = compute_advantage("gpg", token_level_rewards=rewards, response_mask=mask, index=list("aabb"))
    expected = torch.tensor([2.0, -2.0, 0.0, 0.0]).unsqueeze(-1) * mask  # 4 * (s - group mean 0.5)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, adv)


def test_optimal_token_baseline_hand_computed() -> None:
    # One group of two rows; pi = 1/2 and sum pi^2 = 1/2 everywhere, so w = 1 - 1 + 1/2 = 1/2 per token,
    # W = cumulative: row 0 (length 2) [0.5, 1.0], row 1 (length 3) [0.5, 1.0, 1.5].
    # Returns: row 0 reward 1 at t=1 -> G = [1, 1]; row 1 reward 0 -> G = 0.
    # B_t = sum G W / sum W: t=0: 0.5 / 1 = 0.5; t=1: 1 / 2 = 0.5; t=2: only row 1, and row 1 is strictly the
    # longest, so its baseline past the second-longest length (2) is 0.
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    half = torch.full((2, 3), 0.5)
    adv, ret = compute_advantage(
        "optimal_token_baseline",
        token_level_rewards=rewards,
        response_mask=mask,
        index=[7, 7],
        old_log_probs=half.log(),
        sum_pi_squared=half,
    )
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.0], [-0.5, -0.5, 0.0]]), atol=1e-6, rtol=0)
    # Alone in its group a row keeps its return as its advantage.
    alone, _ = compute_advantage(
        "optimal_token_baseline",
        token_level_rewards=rewards[:1],
        response_mask=mask[:1],
        index=[1],
        old_log_probs=half[:1].log(),
        sum_pi_squared=half[:1],
    )
    torch.testing.assert_close(alone, torch.tensor([[1.0, 1.0, 0.0]]))
