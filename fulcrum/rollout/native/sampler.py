"""Sampling on the device for the native engine: the Triton inverse-CDF sampler, else the torch sampler.

The Triton kernels cover temperature and greedy (no top-k / top-p filter), the common RL case, in
one pass over the logits and a search inside one tile a row; with a filter,
`fulcrum.rollout.sampling.sample_next` (sort-based) runs.
Both return log-probs under softmax(logits / T) before any filter (see `fulcrum.rollout.sampling`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fulcrum.rollout.base import SamplingParams
from fulcrum.rollout.sampling import sample_next

if TYPE_CHECKING:
    from fulcrum.rollout.native.sample_kernels import DecodeState


class DeviceSampler:
    """Samples one token per logits row with `params`; seeded when `params.seed` is set."""

    def __init__(self, params: SamplingParams, device: torch.device, use_triton: bool) -> None:
        self.params = params
        self.filtered = params.top_k > 0 or params.top_p < 1.0
        self.use_triton = use_triton and not self.filtered
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**31 - 1, (1,)).item())
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # The Triton kernels read their Philox seed from the device; bumping it after every call gives
        # each step fresh noise without a host round trip.
        self.seed = torch.tensor([seed % (2**31 - 1)], dtype=torch.int64, device=device)

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits (B, V) -> (tokens (B,) int64, log-probs (B,) fp32)."""
        p = self.params
        if self.use_triton:
            return self._triton(logits)
        return sample_next(logits, p.temperature, p.top_p, p.top_k, self.generator)

    def sample_step(
        self, logits: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor, state: DecodeState
    ) -> None:
        """A decode step's sampling: tokens and log-probs (B,) written into `tokens` / `logprobs`, and the
        step's state rows moved on (`DecodeState`): in the Triton sampler's own kernels, else by torch ops."""
        if self.use_triton:
            self._triton(logits, out=(tokens, logprobs), advance=state)
            return
        sampled, sampled_logprobs = self(logits)
        tokens.copy_(sampled)
        logprobs.copy_(sampled_logprobs)
        state.input_ids.copy_(sampled)
        state.positions.add_(1)
        state.context_lens.add_(1)

    def _triton(self, logits: torch.Tensor, **outputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """`sample_kernels.sample_tokens` under this sampler's seed, then the seed bumped for the next call."""
        from fulcrum.rollout.native.sample_kernels import sample_tokens

        sampled = sample_tokens(logits, self.params.temperature, self.seed, **outputs)
        self.seed.add_(1)
        return sampled
