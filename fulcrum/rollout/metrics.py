"""How far the rollout engine's log-probs are from the trainer's: logged as `rollout/logprob_diff_*`.

Both sides score the same sampled tokens under softmax(logits / temperature); any gap is numerics
(bf16 kernels, different reduction orders, paged attention) or stale weights (a missed weight sync).
"""

from __future__ import annotations

import torch


def logprob_diff(
    rollout_logprobs: torch.Tensor, actor_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Mean and max of |rollout - actor| over the response tokens that count.

    rollout_logprobs, actor_logprobs: (B, T) float; mask: (B, T), 1 = token counts.
    Returns {"rollout/logprob_diff_mean", "rollout/logprob_diff_max"} (0.0 for an empty mask).
    """
    if rollout_logprobs.shape != actor_logprobs.shape or rollout_logprobs.shape != mask.shape:
        raise ValueError(
            f"logprob_diff: shapes differ: rollout {tuple(rollout_logprobs.shape)}, "
            f"actor {tuple(actor_logprobs.shape)}, mask {tuple(mask.shape)}"
        )
    keep = mask.bool()
    if not bool(keep.any()):
        return {"rollout/logprob_diff_mean": 0.0, "rollout/logprob_diff_max": 0.0}
    gap = (rollout_logprobs.float() - actor_logprobs.float()).abs()[keep]
    return {"rollout/logprob_diff_mean": gap.mean().item(), "rollout/logprob_diff_max": gap.max().item()}
