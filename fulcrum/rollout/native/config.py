"""Settings of the native engine, taken from `cfg.actor_rollout_ref.rollout` (verl's keys) plus a few of ours.

Ours live under `rollout.engine_kwargs.native` (e.g. `+actor_rollout_ref.rollout.engine_kwargs.native.block_size=32`):
`block_size`, `num_kv_blocks` (the cache size on the CPU, or a fixed size anywhere), `decode_steps`
(decode steps run on the device between two looks from the scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class EngineConfig:
    """The native engine's knobs (defaults follow vLLM where vLLM has the knob)."""

    max_num_seqs: int = 256  # sequences decoding at once (the decode batch)
    max_num_batched_tokens: int = 8192  # prompt tokens per prefill step (longer prompts are chunked)
    max_model_len: int = 4096  # prompt + response, per sequence
    block_size: int = 16  # tokens per KV-cache block; small blocks share more of a GRPO prompt
    gpu_memory_utilization: float = (
        0.5  # fraction of the device's total memory: weights + activations + cache
    )
    num_kv_blocks: int | None = None  # fixed cache size in blocks; the CPU default is enough for max_num_seqs
    enforce_eager: bool = False  # no CUDA graphs
    cudagraph_capture_sizes: list[int] | None = None  # decode batch sizes to capture; None: 1,2,4,8,16,32..
    decode_steps: int = 16  # decode steps per scheduler round (tokens past a stop are dropped)
    # Decode kernels read the cache address from the device, so graphs survive sleep/wake_up without a
    # recapture; costs ~20% decode speed on an H200 (0.5B), so off unless sleeps are frequent and
    # the decode batch takes many sizes.
    indirect_kv_cache: bool = False
    # rollout.free_cache_engine: `generate` releases the KV cache before it returns, so training has the
    # memory; off by default for direct users (benchmarks) that call `generate` back to back.
    free_cache_engine: bool = False
    dtype: torch.dtype = torch.bfloat16  # weights and KV cache on CUDA; the CPU uses the model's dtype

    def __post_init__(self) -> None:
        assert self.max_num_seqs >= 1, f"rollout.max_num_seqs must be >= 1, got {self.max_num_seqs}"
        assert self.max_num_batched_tokens >= 1, "rollout.max_num_batched_tokens must be >= 1"
        assert self.block_size >= 1, f"engine_kwargs.native.block_size must be >= 1, got {self.block_size}"
        assert 0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization must be in (0, 1]"
        assert self.decode_steps >= 1, (
            f"engine_kwargs.native.decode_steps must be >= 1, got {self.decode_steps}"
        )
        if self.num_kv_blocks is not None:
            assert self.num_kv_blocks >= 2, "engine_kwargs.native.num_kv_blocks must be >= 2 (one is scratch)"

    def capture_sizes(self) -> list[int]:
        """Decode batch sizes that get a CUDA graph (a batch runs in the smallest one that holds it)."""
        if self.cudagraph_capture_sizes:
            sizes = sorted({int(s) for s in self.cudagraph_capture_sizes if 0 < int(s) <= self.max_num_seqs})
        else:
            # Coarse buckets: a decode step costs about the same for 300 or 384 rows (weight-bound), and
            # each bucket is one more graph to capture after a wake-up.
            ladder = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512)
            sizes = [s for s in ladder if s <= self.max_num_seqs]
            sizes += list(range(640, self.max_num_seqs + 1, 128))
        if not sizes or sizes[-1] < self.max_num_seqs:
            sizes.append(self.max_num_seqs)
        return sizes


_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_DTYPES |= {"float32": torch.float32, "fp32": torch.float32}


def engine_config_from(rollout_cfg: Any, model_max_len: int) -> EngineConfig:
    """EngineConfig from `cfg.actor_rollout_ref.rollout` (any object with verl's attribute names)."""
    native: dict[str, Any] = dict((getattr(rollout_cfg, "engine_kwargs", None) or {}).get("native", {}) or {})
    dtype_name = str(getattr(rollout_cfg, "dtype", "bfloat16"))
    if dtype_name not in _DTYPES:
        raise ValueError(f"actor_rollout_ref.rollout.dtype={dtype_name!r}: expected one of {sorted(_DTYPES)}")
    max_model_len = getattr(rollout_cfg, "max_model_len", None)
    if max_model_len is None:
        prompt = getattr(rollout_cfg, "prompt_length", None)
        response = getattr(rollout_cfg, "response_length", None)
        max_model_len = prompt + response if prompt and response else model_max_len
    known = {"block_size", "num_kv_blocks", "decode_steps", "indirect_kv_cache"}
    unknown = set(native) - known
    if unknown:
        raise ValueError(
            f"actor_rollout_ref.rollout.engine_kwargs.native: unknown keys {sorted(unknown)}; known: {sorted(known)}"
        )
    return EngineConfig(
        max_num_seqs=int(getattr(rollout_cfg, "max_num_seqs", 256)),
        max_num_batched_tokens=int(getattr(rollout_cfg, "max_num_batched_tokens", 8192)),
        max_model_len=int(max_model_len),
        gpu_memory_utilization=float(getattr(rollout_cfg, "gpu_memory_utilization", 0.5)),
        enforce_eager=bool(getattr(rollout_cfg, "enforce_eager", False)),
        cudagraph_capture_sizes=getattr(rollout_cfg, "cudagraph_capture_sizes", None),
        dtype=_DTYPES[dtype_name],
        block_size=int(native.get("block_size", 16)),
        num_kv_blocks=native.get("num_kv_blocks"),
        decode_steps=int(native.get("decode_steps", 16)),
        indirect_kv_cache=bool(native.get("indirect_kv_cache", False)),
        free_cache_engine=bool(getattr(rollout_cfg, "free_cache_engine", False)),
    )
