"""Policy-Filtration PPO (PF-PPO, Zhang et al. 2024): resample a batch by its rewards; verl
`compute_pf_ppo_reweight_data` (algorithm.use_pf_ppo, algorithm.pf_ppo.{reweight_method, weight_pow}).

verl applies it after GAE only: the batch (with its advantages and returns) is replaced by B rows drawn
with replacement, row i with probability proportional to its weight, so the update learns more from
responses whose reward is reliable (very high or very low).
"""

from __future__ import annotations

import torch

PF_PPO_METHODS = ("pow", "max_min", "max_random")


def pf_ppo_weights(
    scores: torch.Tensor, reweight_method: str = "pow", weight_pow: float = 2.0
) -> torch.Tensor:
    """Sampling weights (B,) from the rows' scores (B,) (sum of token_level_scores):

        pow:        |s|^weight_pow
        max_min:    1 where s is the batch max or min, else 0
        max_random: 0.4 where s is the batch max, else 0.1
    then clamp(w + 1e-8, min=1e-8), so every row keeps a (tiny) chance.
    """
    with torch.no_grad():
        if reweight_method == "pow":
            weights = torch.pow(torch.abs(scores), weight_pow)
        elif reweight_method == "max_min":
            extreme = (scores == scores.max()) | (scores == scores.min())
            weights = extreme.to(scores.dtype)
        elif reweight_method == "max_random":
            weights = torch.where(scores == scores.max(), 0.4, 0.1).to(scores.dtype)
        else:
            raise ValueError(
                f"algorithm.pf_ppo.reweight_method={reweight_method!r} is not one of {PF_PPO_METHODS}"
            )
        return torch.clamp(weights + 1e-8, min=1e-8)


def pf_ppo_resample_indices(
    scores: torch.Tensor,
    reweight_method: str = "pow",
    weight_pow: float = 2.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """B row indices (long, (B,)) drawn with replacement with probabilities ∝ pf_ppo_weights(scores).

    With the same generator state (torch's global one when None) the draw equals verl's.
    """
    weights = pf_ppo_weights(scores, reweight_method, weight_pow)
    return torch.multinomial(weights, scores.shape[0], replacement=True, generator=generator)
