"""Token sampling shared by every backend: temperature, top-k, top-p, greedy, and the sampled log-prob.

Which log-prob we return: log softmax(logits / temperature) of the sampled token, *before* the top-k /
top-p filter. That is what the trainer's own forward computes for `old_log_prob` (verl divides the
actor's logits by `rollout.temperature` too), so the rollout-vs-actor gap measures the engine's
numerics, not a different distribution. It equals vLLM's `logprobs_mode="processed_logprobs"` when
no filter is set; vLLM V1's default (`raw_logprobs`) is the untempered distribution instead. Greedy
(temperature 0) reports log softmax(logits), i.e. temperature 1.

Sampling without a filter uses the exponential race (Gumbel-max in another guise): with E_v ~ Exp(1)
i.i.d., argmax_v p_v / E_v is distributed as Categorical(p). It needs no cumulative sum or
multinomial over the vocabulary and runs as one fused element-wise pass plus an argmax.
"""

from __future__ import annotations

import torch


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T)[token] per row.

    logits: (B, V) any float dtype (computed in fp32); tokens: (B,) int64 -> (B,) fp32.
    Greedy (T == 0) uses T = 1.
    """
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    picked = scaled.gather(-1, tokens.view(-1, 1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and the top-p nucleus to -inf (top-k first, as vLLM and HF).

    logits: (B, V) fp32 (already divided by T) -> (B, V). The nucleus keeps the smallest set of
    highest-probability tokens whose mass reaches top_p (always at least the top token).
    """
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def exponential_noise(shape: tuple[int, ...], device: torch.device, generator: torch.Generator | None):
    """E ~ Exp(1) of `shape` in fp32, from `generator` when given (seeded sampling)."""
    noise = torch.empty(shape, device=device, dtype=torch.float32)
    return noise.exponential_(generator=generator)


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = -1,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sampling step: (tokens (B,) int64, log-probs (B,) fp32) from logits (B, V).

    Greedy when temperature == 0 (argmax of the raw logits). Otherwise
    token = argmax_v softmax(filter(logits / T))_v / E_v with E ~ Exp(1), and the log-prob is taken
    from the unfiltered tempered distribution (see the module docstring).
    """
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, sampled_logprobs(logits, tokens, 0.0)
    scaled = logits.float() / temperature
    filtered = filter_top_k_top_p(scaled, top_k, top_p)
    probs = filtered.softmax(dim=-1)
    noise = exponential_noise(tuple(probs.shape), probs.device, generator)
    tokens = (probs / noise).argmax(dim=-1)
    picked = scaled.gather(-1, tokens.view(-1, 1)).squeeze(-1)
    return tokens, picked - torch.logsumexp(scaled, dim=-1)
