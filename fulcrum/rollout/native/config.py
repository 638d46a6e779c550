"""Settings of the native engine, built once from `cfg.actor_rollout_ref.rollout` (verl's keys) plus a few of ours.

Ours live under `rollout.engine_kwargs.native` (e.g. `+actor_rollout_ref.rollout.engine_kwargs.native.block_size=32`):
the `EngineConfig` fields declared with `native(...)`, each documented there; `NATIVE_KWARGS` lists their
names (what `engine_config_from` accepts, what doctor and the docs name).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from fulcrum.config.schema_rollout import RolloutConfig
from fulcrum.rollout.native.block_manager import blocks_for

_DTYPES = dict(bfloat16=torch.bfloat16, bf16=torch.bfloat16, float16=torch.float16, fp16=torch.float16)
_DTYPES |= dict(float32=torch.float32, fp32=torch.float32)
SCHEMA = RolloutConfig()  # the defaults of verl's keys, for benchmarks and tests that build EngineConfig
PREFILL_ATTENTION = ("flash", "cudnn", "fa4")  # engine_kwargs.native.prefill_attention's values
HEADROOM_TOKENS = 256  # engine_kwargs.native.headroom_tokens' default (bench/tools/partial_schedule.py)
DECODE_ORDERS = ("batch", "longest_first")  # engine_kwargs.native.decode_order's values


def native(default: Any) -> Any:
    """A field set by `rollout.engine_kwargs.native.<name>` (ours, not verl's), defaulting to `default`."""
    return field(default=default, metadata={"native": True})


@dataclass
class EngineConfig:
    """The native engine's knobs: verl's keys default as the schema does, ours (engine_kwargs.native) here."""

    max_num_seqs: int = SCHEMA.max_num_seqs  # sequences decoding at once (the decode batch)
    max_num_batched_tokens: int = SCHEMA.max_num_batched_tokens  # prompt tokens per prefill step
    # prompt + response, per sequence; the schema's null means prompt_length + response_length, which a
    # direct user does not have.
    max_model_len: int = 4096
    block_size: int = native(16)  # tokens per KV-cache block; small blocks share more of a GRPO prompt
    gpu_memory_utilization: float = SCHEMA.gpu_memory_utilization  # weights + activations + cache
    # A fixed cache size in blocks; the CPU default is enough for max_num_seqs.
    num_kv_blocks: int | None = native(None)
    enforce_eager: bool = SCHEMA.enforce_eager  # no CUDA graphs
    cudagraph_capture_sizes: list[int] | None = SCHEMA.cudagraph_capture_sizes  # None: 1,2,4,8,16,32..
    decode_steps: int = native(16)  # decode steps per scheduler round (tokens past a stop are dropped)
    # Tokens of growth every running sequence keeps room for (at most the rest of its max_tokens) before
    # a waiting prompt or a preempted sequence is admitted to the cache: over a full cache, admitting into
    # the blocks that one finished sequence gave back preempts the newcomer again as the others grow.
    # 0: admit whatever fits now.
    headroom_tokens: int = native(HEADROOM_TOKENS)
    # Launch the next decode window before reading this one, so the device decodes while the host reads
    # the tokens and schedules instead of idling between windows. The next window runs over the same
    # rows: a row whose sequence stopped in this one decodes for nothing. Prefill steps overlap alike:
    # the next one is launched before the first tokens of this one are read.
    overlap_windows: bool = native(True)
    # Decode kernels read the cache address from the device, so graphs survive sleep/wake_up without a
    # recapture; the kernels then read the address on the device, where Triton cannot assume its
    # alignment, which slows decode: off unless sleeps are frequent and the decode batch takes many sizes.
    indirect_kv_cache: bool = native(False)
    # rollout.free_cache_engine: `generate` releases the KV cache before it returns, so training has the
    # memory; a direct user that calls `generate` back to back (a benchmark) turns it off.
    free_cache_engine: bool = SCHEMA.free_cache_engine
    dtype: torch.dtype = _DTYPES[SCHEMA.dtype]  # weights and KV cache on CUDA; the CPU uses the model's dtype
    # actor_rollout_ref.model.lm_head_fp32: sample from float32 LM-head logits (fulcrum.models.head_logits),
    # as the actor scores them with the key on; a model-section key, so the trainer passes it in.
    lm_head_fp32: bool = False
    # The engine's Triton kernels (attention, rotary and cache writes, sampling) instead of torch ops.
    # None: on CUDA, off on the CPU; True: also on the CPU under Triton's interpreter (TRITON_INTERPRET=1,
    # for tests), refused where Triton cannot run; False: torch ops everywhere (the reference path).
    triton_kernels: bool | None = native(None)
    # The prefill's attention kernel on CUDA: "flash" (aten's FlashAttention-2 varlen forward), "cudnn"
    # (SDPA's cuDNN backend on dense batches of prompts padded to a few lengths, for a step whose prompts
    # start at their first token; a step over a cached context, a sliding-window layer and the CPU keep
    # flash / SDPA) or "fa4" (FlashAttention-4's varlen forward for every prefill step, the `fa4` extra, a
    # Hopper or Blackwell card; the CPU keeps SDPA). bench/long_context.py times each.
    prefill_attention: str = native("flash")
    # The order in which the Triton decode kernel's programs take a step's rows: "batch" (the batch's) or
    # "longest_first" (by context length, sorted once a step on the device: a batch of uneven contexts,
    # as partial rollouts keep, then does not end each launch on a few long programs; `decode_grid.
    # decode_order`). bench/tools/attention_sweep.py --mixed times both.
    decode_order: str = native("batch")

    def __post_init__(self) -> None:
        assert self.max_num_seqs >= 1, f"rollout.max_num_seqs must be >= 1, got {self.max_num_seqs}"
        assert self.max_num_batched_tokens >= 1, "rollout.max_num_batched_tokens must be >= 1"
        assert self.block_size >= 1, f"engine_kwargs.native.block_size must be >= 1, got {self.block_size}"
        assert 0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization must be in (0, 1]"
        assert self.decode_steps >= 1, (
            f"engine_kwargs.native.decode_steps must be >= 1, got {self.decode_steps}"
        )
        assert self.headroom_tokens >= 0, (
            f"engine_kwargs.native.headroom_tokens must be >= 0, got {self.headroom_tokens}"
        )
        if self.num_kv_blocks is not None:
            assert self.num_kv_blocks >= 2, "engine_kwargs.native.num_kv_blocks must be >= 2 (one is scratch)"
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(
                "actor_rollout_ref.rollout.engine_kwargs.native.prefill_attention: expected one of "
                f"{', '.join(PREFILL_ATTENTION)}, got {self.prefill_attention!r}"
            )
        if self.decode_order not in DECODE_ORDERS:
            raise ValueError(
                "actor_rollout_ref.rollout.engine_kwargs.native.decode_order: expected one of "
                f"{', '.join(DECODE_ORDERS)}, got {self.decode_order!r}"
            )
        if self.triton_kernels not in (None, True, False):
            raise ValueError(
                "actor_rollout_ref.rollout.engine_kwargs.native.triton_kernels: expected true, false or null, "
                f"got {self.triton_kernels!r}"
            )

    @property
    def windows_in_flight(self) -> int:
        """Decode windows on the device at once: 2 with overlap_windows (the next one is launched before
        this one is read, `pipeline.Pipeline`), else 1. Each has its own output buffers, and a sequence
        may write up to one window's steps past its end in each (`max_tokens_per_seq`)."""
        return 2 if self.overlap_windows else 1

    def max_tokens_per_seq(self) -> int:
        """KV slots one sequence can take: max_model_len, plus what the windows in flight may write past a
        sequence's last token (decode_steps each)."""
        return self.max_model_len + self.decode_steps * self.windows_in_flight

    def blocks_per_seq(self) -> int:
        """KV blocks one sequence can take (`max_tokens_per_seq` slots)."""
        return blocks_for(self.max_tokens_per_seq(), self.block_size)

    def usable_cache_blocks(self) -> int:
        """The most KV blocks a generate can hold at once: max_num_seqs sequences at full length, one
        prompt part-way through a chunked prefill beside them (it takes blocks before it takes a seat),
        and the scratch block. A cache sized by gpu_memory_utilization is cut to this: a block past it is
        never written, and the cache is allocated at every wake-up and released at every sleep, so a
        larger one only costs time and raises generation's peak. Kept prefixes of multi-turn conversations
        beyond it are evicted (and recomputed) sooner."""
        return (self.max_num_seqs + 1) * self.blocks_per_seq() + 1

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


# Our knobs under rollout.engine_kwargs.native: their defaults are EngineConfig's own.
NATIVE_KWARGS = tuple(f.name for f in fields(EngineConfig) if f.metadata.get("native"))


def engine_config_from(
    rollout: RolloutConfig, model_max_len: int, lm_head_fp32: bool = False
) -> EngineConfig:
    """EngineConfig from the resolved `cfg.actor_rollout_ref.rollout`; `model_max_len` bounds a sequence
    when neither max_model_len nor prompt_length + response_length is known; `lm_head_fp32` is
    `actor_rollout_ref.model.lm_head_fp32`."""
    native: dict[str, Any] = dict((rollout.engine_kwargs or {}).get("native") or {})
    if rollout.dtype not in _DTYPES:
        raise ValueError(
            f"actor_rollout_ref.rollout.dtype={rollout.dtype!r}: expected one of {sorted(_DTYPES)}"
        )
    unknown = set(native) - set(NATIVE_KWARGS)
    if unknown:
        raise ValueError(
            f"actor_rollout_ref.rollout.engine_kwargs.native: unknown keys {sorted(unknown)}; known: {sorted(NATIVE_KWARGS)}"
        )
    max_model_len = rollout.max_model_len
    if max_model_len is None:
        prompt, response = rollout.prompt_length, rollout.response_length
        max_model_len = prompt + response if prompt and response else model_max_len
    return EngineConfig(
        max_num_seqs=rollout.max_num_seqs,
        max_num_batched_tokens=rollout.max_num_batched_tokens,
        max_model_len=max_model_len,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        enforce_eager=rollout.enforce_eager,
        cudagraph_capture_sizes=rollout.cudagraph_capture_sizes,
        free_cache_engine=rollout.free_cache_engine,
        dtype=_DTYPES[rollout.dtype],
        lm_head_fp32=lm_head_fp32,
        **native,
    )
