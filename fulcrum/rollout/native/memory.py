"""How much of the device the native engine's KV cache may take: one rule for the engine and the estimate.

The engine holds its bf16 weights, a workspace for the activations of one step (one prefill step's widest
tensors, the logits of a full decode batch and the sampler's copies of them) and the KV cache. The cache
gets what `gpu_memory_utilization` of the device leaves after the weights and the workspace, and never
more than is free when it is allocated, less the workspace (which is allocated after it, step by step)
and 1 GiB of slack: otherwise a cache sized from the fraction alone, on a device the training state
already fills, leaves the first prefill or sampler step no room and fails mid-rollout.
"""

from __future__ import annotations

GiB = 1 << 30
SLACK_BYTES = GiB  # left free beside the cache, the workspace and the weights
BASE_WORKSPACE_BYTES = 512 << 20  # CUDA graphs' pool, the sampler's small tensors, allocator rounding


def engine_workspace_bytes(
    hidden: int,
    intermediate: int,
    vocab: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    lm_head_fp32: bool = False,
) -> int:
    """Activation room of one engine step, bf16: a prefill step of `max_num_batched_tokens` tokens
    (8·hidden + 6·intermediate values a token at the widest point) plus a full decode batch's logits and
    the sampler's copies (10 B a logit; 12 with the float32 LM head) plus `BASE_WORKSPACE_BYTES`."""
    prefill = max_num_batched_tokens * (8 * hidden + 6 * intermediate) * 2
    logits = max_num_seqs * vocab * (12 if lm_head_fp32 else 10)
    return prefill + logits + BASE_WORKSPACE_BYTES


def kv_cache_budget(
    device_bytes: float, utilization: float, weight_bytes: float, workspace_bytes: float, free_bytes: float
) -> float:
    """Bytes for the KV cache: min(utilization · device − weights − workspace, free − workspace − 1 GiB),
    `free_bytes` what the device has free when the cache is allocated (the weights already loaded)."""
    by_fraction = device_bytes * utilization - weight_bytes - workspace_bytes
    return min(by_fraction, free_bytes - workspace_bytes - SLACK_BYTES)


def prefill_context_tokens(
    hidden: int, intermediate: int, kv_heads: int, head_dim: int, max_num_batched_tokens: int
) -> int:
    """Most tokens a prefill step may read back from the KV cache, summed over its sequences, when any
    of them continues a cached context (a held turn, a chunked prompt, a continued partial rollout):
    attention then copies each layer's keys and values of every sequence's whole context, 4·kv_heads·
    head_dim bytes a token in bf16, which `engine_workspace_bytes` does not count. The copy lives inside
    attention, where the MLP's widest tensors do not, so it gets half of the prefill part of the workspace:
    tokens = B·(8·hidden + 6·intermediate) / (4·kv_heads·head_dim), B = max_num_batched_tokens, at least B."""
    tokens = max_num_batched_tokens * (8 * hidden + 6 * intermediate) // (4 * kv_heads * head_dim)
    return max(tokens, max_num_batched_tokens)
