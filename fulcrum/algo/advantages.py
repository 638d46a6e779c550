"""Advantage estimators: token-level rewards (B, T) -> (advantages (B, T), returns (B, T)).

Each estimator has verl's semantics (verl/trainer/ppo/core_algos.py, the function named in its
docstring). `response_mask` (B, T) is 1 on tokens that count. Two deliberate differences, both
invisible when rewards sit on valid tokens (as the reward manager writes them): outputs are 0 wherever
the mask is 0 (verl leaves whitened or carried values there in gae and remax; no loss reads them), and
the outcome score of a row is the sum of its rewards over valid tokens only (verl sums all T).

An estimator is one function registered by name (verl's `register_adv_est`):

    @register_adv_est("my_estimator")
    def my_estimator(*, token_level_rewards, response_mask, index=None, **_other_inputs): ...

It takes keyword inputs (those in ADVANTAGE_INPUTS: the trainer passes them all), declares the ones
it uses, ignores the rest, raises ValueError naming one it lacks, and returns (advantages, returns).
`compute_advantage(name, token_level_rewards=..., response_mask=..., **inputs)` runs one by name.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from fulcrum.algo.masked import masked_sum, masked_whiten
from fulcrum.algo.registry import registrar

# Added to the group std in GRPO so a group of equal scores does not divide by zero (as verl).
GRPO_EPS = 1e-6

GroupIndex = Sequence[Hashable] | torch.Tensor  # one prompt uid per row (str, int, numpy array, tensor)


AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# algorithm.adv_estimator -> estimator (verl's names).
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}
register_adv_est = registrar(ADVANTAGE_ESTIMATORS, "advantage estimator")
# What an estimator may take besides token_level_rewards and response_mask (the trainer gives them all).
ADVANTAGE_INPUTS = frozenset(
    "values index reward_baselines gamma lam norm_adv_by_std_in_grpo old_log_probs sum_pi_squared "
    "rollout_is_weights".split()
)


def adv_estimator_names() -> tuple[str, ...]:
    return tuple(ADVANTAGE_ESTIMATORS)


def _need(value: Any, what: str, estimator: str) -> Any:
    if value is None:
        raise ValueError(f"algorithm.adv_estimator={estimator} needs `{what}`, which was not given")
    return value


def group_ids(index: GroupIndex, batch_size: int) -> tuple[torch.Tensor, int]:
    """Map prompt uids to dense group numbers 0..G-1 in order of first appearance: ((B,) long, G)."""
    uids = index.tolist() if isinstance(index, torch.Tensor) else list(index)
    if len(uids) != batch_size:
        raise ValueError(f"index has {len(uids)} uids but the batch has {batch_size} rows")
    numbers: dict[Hashable, int] = {}
    ids = [numbers.setdefault(uid, len(numbers)) for uid in uids]
    return torch.tensor(ids, dtype=torch.long), len(numbers)


def group_mean_std(
    scores: torch.Tensor, index: GroupIndex
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row mean, unbiased std and size of the row's group: three (B,) tensors.

    scores: (B,). A group of one has mean 0 and std 1 (verl's convention, so that row keeps its score).
    """
    gid, n_groups = group_ids(index, scores.shape[0])
    gid = gid.to(scores.device)
    size = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, gid, torch.ones_like(scores)
    )
    total = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, scores)
    mean = total / size
    sq_dev = torch.zeros_like(total).index_add_(0, gid, (scores - mean[gid]) ** 2)
    std = torch.sqrt(sq_dev / (size - 1).clamp(min=1))
    single = size == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[gid], std[gid], size[gid]


@register_adv_est("gae")
def gae_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    **_other_inputs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016); verl `compute_gae_advantage_return`.

    Reverse over t, skipping masked tokens (their value and TD error do not enter the recursion):
        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next
    where V_next and A_next are those of the next *unmasked* token (0 past the end).
    returns = A + V (before whitening); advantages = masked_whiten(A). Inputs and outputs (B, T).
    """
    values = _need(values, "values (a critic)", "gae")
    with torch.no_grad():
        mask = response_mask.to(values.dtype)
        next_value = torch.zeros_like(values[:, 0])  # (B,)
        next_adv = torch.zeros_like(values[:, 0])  # (B,)
        reversed_adv = []
        for t in reversed(range(token_level_rewards.shape[-1])):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            adv_t = delta + gamma * lam * next_adv
            # A masked token passes the next token's value and advantage through unchanged.
            next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
            next_adv = adv_t * mask[:, t] + (1 - mask[:, t]) * next_adv
            reversed_adv.append(next_adv)
        advantages = torch.stack(reversed_adv[::-1], dim=1)  # (B, T)
        returns = (advantages + values) * mask
        advantages = masked_whiten(advantages, mask) * mask
    return advantages, returns


@register_adv_est("grpo")
def grpo_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex | None = None,
    norm_adv_by_std_in_grpo: bool = True,
    **_other_inputs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024); verl `compute_grpo_outcome_advantage`.

    s_i = sum_t r_i,t m_i,t; within the group g of prompt uid index[i] (mean, unbiased std over its rows):
        A_i = (s_i - mean_g) / (std_g + 1e-6)      if norm_adv_by_std_in_grpo
        A_i =  s_i - mean_g                        otherwise (Dr. GRPO)
    A group of one row uses mean 0, std 1. Broadcast over the row's valid tokens; returns = advantages.
    """
    index = _need(index, "index (the prompt uid of each row)", "grpo")
    with torch.no_grad():
        scores = masked_sum(token_level_rewards, response_mask, axis=-1)  # (B,)
        mean, std, _ = group_mean_std(scores, index)
        centred = scores - mean
        adv = centred / (std + GRPO_EPS) if norm_adv_by_std_in_grpo else centred
        adv = adv.unsqueeze(-1) * response_mask  # (B, T)
    return adv, adv


@register_adv_est("rloo")
def rloo_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex | None = None,
    **_other_inputs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024); verl `compute_rloo_outcome_advantage`.

    For a group of n > 1 rows: A_i = s_i - mean_{j != i} s_j = n / (n - 1) * (s_i - mean_g).
    A group of one row keeps A_i = s_i. Broadcast over valid tokens; returns = advantages.
    """
    index = _need(index, "index (the prompt uid of each row)", "rloo")
    with torch.no_grad():
        scores = masked_sum(token_level_rewards, response_mask, axis=-1)  # (B,)
        mean, _, size = group_mean_std(scores, index)
        scale = size / (size - 1).clamp(min=1)
        adv = torch.where(size > 1, scale * (scores - mean), scores)
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_est("reinforce_plus_plus")
def reinforce_plus_plus_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    **_other_inputs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025); verl `compute_reinforce_plus_plus_outcome_advantage`.

    Discounted return over unmasked tokens, G_t = r_t + gamma * G_next (a masked token passes G_next
    through and gets return 0); advantages = masked_whiten(G) over the batch's valid tokens.
    """
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])  # (B,)
        for t in reversed(range(token_level_rewards.shape[-1])):
            candidate = token_level_rewards[:, t] + gamma * running
            returns[:, t] = candidate * mask[:, t]
            running = candidate * mask[:, t] + running * (1 - mask[:, t])
        advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


@register_adv_est("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex | None = None,
    **_other_inputs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline; verl `compute_reinforce_plus_plus_baseline_outcome_advantage`.

    a_i = s_i - mean_g (mean 0 for a group of one), broadcast over the row's valid tokens, then
    whitened over all valid tokens of the batch: A = masked_whiten(a * mask) * mask; returns = A.
    """
    index = _need(index, "index (the prompt uid of each row)", "reinforce_plus_plus_baseline")
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        scores = masked_sum(token_level_rewards, response_mask, axis=-1)
        mean, _, _ = group_mean_std(scores, index)
        adv = (scores - mean).unsqueeze(-1) * mask  # (B, T)
        adv = masked_whiten(adv, mask) * mask
    return adv, adv


@register_adv_est("remax")
def remax_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    reward_baselines: torch.Tensor | None = None,
    **_other_inputs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023); verl `compute_remax_outcome_advantage`.

    returns_t = sum_{t' >= t} r_t' * mask_t' (undiscounted reward-to-go); A_t = returns_t - b,
    b = reward_baselines (B,): the score of the greedy response to the same prompt.
    """
    reward_baselines = _need(reward_baselines, "reward_baselines (greedy-response scores)", "remax")
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1]) * mask
        advantages = (returns - reward_baselines.unsqueeze(-1)) * mask
    return advantages, returns


@register_adv_est("gpg")
def gpg_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex | None = None,
    **_other_inputs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group Policy Gradient advantage (Chu et al. 2025); verl `compute_gpg_outcome_advantage`.

    s_i = sum_t r_i,t m_i,t; with B rows of which M have s_i != 0, alpha = B / max(M, 1):
        A_i = alpha * (s_i - mean_g)            (mean over the row's group; 0 for a group of one)
    The alpha factor rescales the batch gradient when many groups carry no signal (f_norm = 1, as
    verl's default). Broadcast over valid tokens; returns = advantages. Use with loss_mode=gpg.
    """
    index = _need(index, "index (the prompt uid of each row)", "gpg")
    with torch.no_grad():
        scores = masked_sum(token_level_rewards, response_mask, axis=-1)  # (B,)
        alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
        mean, _, _ = group_mean_std(scores, index)
        adv = (alpha * (scores - mean)).unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_est("optimal_token_baseline")
def optimal_token_baseline_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    **_other_inputs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal Token Baseline (OTB); verl `compute_optimal_token_baseline_advantage`.

    A per-timestep baseline within each prompt group, weighted by a path-variance proxy. All (B, T):
        G_t = sum_{t' >= t} r_t' m_t'                         (reward-to-go)
        w_t = (1 - 2 pi_t + sum_v pi_v^2) * rho_t^2           (pi_t = exp(old_log_probs); rho = rollout IS
                                                               weights, 1 without)
        W_t = sum_{j <= t} w_j m_j                            (cumulative over the response)
        B_t = sum_{i in g} G_i,t W_i,t m_i,t / (sum_{i in g} W_i,t m_i,t + 1e-8)
        A_t = (G_t - B_t) m_t;  returns = G m
    A group of one row has B = 0. When one row of a group is strictly the longest, its baseline is 0
    beyond the second-longest row's length (no other row estimates it there; verl's handle_zero_tail).
    `sum_pi_squared` (B, T) is sum_v softmax(logits)_v^2 at each response token, from the actor's
    old-log-prob forward (actor.calculate_sum_pi_squared).
    """
    name = "optimal_token_baseline"
    index = _need(index, "index (the prompt uid of each row)", name)
    old_log_probs = _need(old_log_probs, "old_log_probs", name)
    sum_pi_squared = _need(sum_pi_squared, "sum_pi_squared (actor.calculate_sum_pi_squared)", name)
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        w = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
        if rollout_is_weights is not None:
            w = w * rollout_is_weights**2
        w_cum = (w * mask).cumsum(dim=-1)
        gid, n_groups = group_ids(index, returns.shape[0])
        gid = gid.to(returns.device)
        shape = (n_groups, returns.shape[1])
        numerator = torch.zeros(shape, dtype=returns.dtype, device=returns.device)
        numerator.index_add_(0, gid, returns * w_cum * mask)
        denominator = torch.zeros_like(numerator).index_add_(0, gid, w_cum * mask) + 1e-8
        baselines = (numerator / denominator)[gid]  # (B, T)
        lengths = mask.sum(dim=-1)
        for g in range(n_groups):
            rows = (gid == g).nonzero(as_tuple=True)[0]
            if len(rows) == 1:
                baselines[rows] = 0.0
                continue
            ordered = torch.sort(lengths[rows]).values
            longest, second = int(ordered[-1]), int(ordered[-2])
            at_longest = rows[lengths[rows] == longest]
            if len(at_longest) == 1 and longest > second:
                baselines[at_longest[0], second:] = 0.0
        advantages = (returns - baselines) * mask
    return advantages, returns * mask


def compute_advantage(
    adv_estimator: str, *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, **inputs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator named `adv_estimator` on (B, T) rewards: (advantages, returns), (B, T).

    `inputs` are keywords of ADVANTAGE_INPUTS; a misspelt one is an error rather than silently unused.
    """
    if adv_estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"algorithm.adv_estimator={adv_estimator!r} is not supported; choose one of {sorted(ADVANTAGE_ESTIMATORS)}"
        )
    unknown = sorted(set(inputs) - ADVANTAGE_INPUTS)
    if unknown:
        raise TypeError(f"compute_advantage: unknown inputs {unknown}; known: {sorted(ADVANTAGE_INPUTS)}")
    if token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must have the same (B, T) shape"
        )
    return ADVANTAGE_ESTIMATORS[adv_estimator](
        token_level_rewards=token_level_rewards, response_mask=response_mask, **inputs
    )
