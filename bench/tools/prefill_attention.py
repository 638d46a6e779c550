"""Benchmark: one prefill step's causal attention under each kernel this torch offers on CUDA.

    python bench/tools/prefill_attention.py --json prefill_attention.json   # one GPU; bench/long_context.py's shapes

A prefill step of the native engine packs fresh prompts up to `max_num_batched_tokens` (16,384 in
bench/long_context.py: two prompts of 8k, one of 16k) and runs one causal attention per layer over them.
That call, alone, at each shape's heads and head dim, under:

- `flash`: aten's FlashAttention-2 varlen forward, the engine's call (`varlen_causal_attention`); the
  kernel reads grouped K/V heads itself.
- `cudnn`: the engine's call with `engine_kwargs.native.prefill_attention=cudnn` (`cudnn_causal_attention`):
  SDPA's cuDNN backend on the (prompts, heads, context, head dim) batch, K/V heads repeated to the query
  heads first (the repeat timed with it).
- `cudnn_gqa`: the same call handing cuDNN the grouped K/V heads (`native_gqa=True`), no repeat.
- `fa4`: FlashAttention-4's varlen forward (`varlen_causal_attention(kernel="fa4")`, the fa4 extra; Hopper or
  Blackwell), the engine's call with `engine_kwargs.native.prefill_attention=fa4`; its first call compiles
  the kernel (CUTLASS's DSL, at run time).
- `fa4_unpacked`: the same kernel with `pack_gqa=False` (each query head its own rows; FA4 packs the query
  heads of a K/V head into one tile's rows by default, 7 a K/V head at Qwen2.5-0.5B's shape, 2 at Qwen3-0.6B's).

Each: CUDA events, the median of `--repeats` after warm-up, µs, TFLOP/s (causal: QKᵀ and PV are
2 · c² · q FLOPs each per prompt, q = heads · head dim, half of them under the mask), the largest
|difference| from `flash`'s output, and the first call's wall time (`first_us`: cuDNN builds its plan for a
shape then, which is what the engine's few padded lengths bound). A kernel this torch or card refuses is
reported with its error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_sweep import time_call
from shapes import shape_of

from fulcrum.models import packed_attention
from fulcrum.models.packed_attention import (
    cudnn_causal_attention,
    has_flash_varlen,
    varlen_causal_attention,
)

SHAPES = ("qwen3-0.6b", "qwen2.5-0.5b")
CONTEXTS = (8192, 16384, 2048)
STEP_TOKENS = 16384  # bench/long_context.py's max_num_batched_tokens

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


def attention_flops(prompts: int, context: int, heads: int, head_dim: int) -> float:
    """One layer's causal attention over `prompts` prompts of `context` tokens:
    prompts · 4 · c² · heads · head_dim / 2 (QKᵀ and PV, 2 · c² · q each, half under the mask)."""
    return prompts * 4 * context * context * heads * head_dim / 2


def prompts_a_step(context: int, step_tokens: int = STEP_TOKENS) -> int:
    """Fresh prompts of `context` tokens one prefill step of `step_tokens` holds (at least one)."""
    return max(1, step_tokens // context)


def fa4(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, c: int, scale: float
) -> torch.Tensor:
    """The engine's call with `prefill_attention=fa4`, in the flash call's signature."""
    return varlen_causal_attention(q, k, v, cu, c, scale, kernel="fa4")


def fa4_unpacked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, c: int, scale: float
) -> torch.Tensor:
    """The engine's FlashAttention-4 call with `pack_gqa=False` (`packed_attention.FA4_PACK_GQA`)."""
    own, packed_attention.FA4_PACK_GQA = packed_attention.FA4_PACK_GQA, False
    try:
        return varlen_causal_attention(q, k, v, cu, c, scale, kernel="fa4")
    finally:
        packed_attention.FA4_PACK_GQA = own


def cudnn_batches(native_gqa: bool) -> Attend:
    """The engine's cuDNN prefill in the flash call's signature (the lengths read from `cu`)."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, c: int, scale: float):
        return cudnn_causal_attention(q, k, v, torch.diff(cu).tolist(), scale, native_gqa=native_gqa)

    return attend


BACKENDS: dict[str, Attend] = {
    "flash": varlen_causal_attention,
    "cudnn": cudnn_batches(native_gqa=False),
    "cudnn_gqa": cudnn_batches(native_gqa=True),
    "fa4": fa4,
    "fa4_unpacked": fa4_unpacked,
}


def step_inputs(
    prompts: int, context: int, heads: int, kv_heads: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random bf16 q (N, heads, D), k and v (N, kv_heads, D) of N = prompts · context tokens, and the
    prompts' cumulative lengths (int32)."""
    generator = torch.Generator(device=device).manual_seed(0)
    tokens = prompts * context

    def randn(h: int) -> torch.Tensor:
        return torch.randn(tokens, h, head_dim, device=device, generator=generator).to(torch.bfloat16)

    cu = torch.arange(0, tokens + 1, context, device=device, dtype=torch.int32)
    return randn(heads), randn(kv_heads), randn(kv_heads), cu


def sweep(
    context: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    device: torch.device,
    step_tokens: int = STEP_TOKENS,
    repeats: int = 10,
) -> dict[str, Any]:
    """One prefill step's attention at this shape under every backend: µs, TFLOP/s, the largest
    |difference| from `flash`, and each refusal."""
    prompts = prompts_a_step(context, step_tokens)
    q, k, v, cu = step_inputs(prompts, context, heads, kv_heads, head_dim, device)
    scale = head_dim**-0.5
    flops = attention_flops(prompts, context, heads, head_dim)
    out: dict[str, Any] = {
        "prompts": prompts,
        "context": context,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "tflop": round(flops / 1e12, 4),
        "us": {},
        "tflop_per_s": {},
        "max_abs_diff": {},
        "first_us": {},
        "failed": {},
    }
    reference: torch.Tensor | None = None
    for name, attend in BACKENDS.items():  # flash first: the others are compared with its output
        try:
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            result = attend(q, k, v, cu, context, scale).float()
            torch.cuda.synchronize(device)
            out["first_us"][name] = round((time.perf_counter() - start) * 1e6, 1)
            reference = result if name == "flash" else reference
            if reference is not None:
                out["max_abs_diff"][name] = round(float((result - reference).abs().max()), 5)
            us = time_call(lambda attend=attend: attend(q, k, v, cu, context, scale), repeats, warmup=2)
        except Exception as exc:  # a kernel this torch or card refuses: said, the others timed
            out["failed"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            continue
        out["us"][name] = round(us, 1)
        out["tflop_per_s"][name] = round(flops / us / 1e6, 1)
    timed = out["us"]
    if "flash" in timed:
        out["over_flash"] = {name: round(timed["flash"] / us, 3) for name, us in timed.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="bench/shapes.py names, comma-separated")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--step-tokens", type=int, default=STEP_TOKENS, help="tokens a prefill step")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    probe = torch.empty(1, 1, 1, device=device, dtype=torch.bfloat16)
    if not has_flash_varlen(probe):
        print("prefill_attention: needs a CUDA device with aten's flash kernel", file=sys.stderr)
        return 2
    from transformers import AutoConfig

    from fulcrum.models.arch import model_shape

    rows = []
    for name in args.shapes.split(","):
        model_type, fields = shape_of(name)
        shape = model_shape(AutoConfig.for_model(model_type, **fields))
        for context in (int(c) for c in args.contexts.split(",")):
            row = {"shape": name, **sweep(context, shape.heads, shape.kv_heads, shape.head_dim, device,
                                          args.step_tokens, args.repeats)}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        summary = {
            "date": time.strftime("%Y-%m-%d"),
            "device": torch.cuda.get_device_name(device),
            "rows": rows,
        }
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
