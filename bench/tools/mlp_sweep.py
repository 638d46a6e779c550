"""Benchmark: the dense SwiGLU MLP's gate / up product and SiLU·mul, cuBLAS's path against the fused kernel.

    python bench/tools/mlp_sweep.py [--json out.json]
    python bench/tools/mlp_sweep.py --small     # the script's path under TRITON_INTERPRET=1 (no GPU)

The engine's MLP computes act = silu(x · W_gateᵀ) · (x · W_upᵀ) from one (2I, H) weight: by default
`F.linear` (cuBLAS) writes the (N, 2I) product and `kernels.silu_and_mul` reads it back; with
`engine_kwargs.native.prefill_mlp=fused`, `mlp_kernels.gate_up_silu` does both in one Triton kernel. For
Qwen2.5-0.5B's (H 896, I 4,864) and Qwen3-0.6B's (H 1,024, I 3,072) shapes and N = 16, 64 (a decode
tail), 512 (a full decode batch), 4,096 and 16,384 tokens (prefill steps), in bf16, this times the product
alone, SiLU·mul alone, the two together (the engine's path) and the fused kernel under each launch of the
grid below (CUDA events, median of 50 calls after 5), each launch's output checked against the path's
first (the two differ only by the products' summation order). It prints one line per launch, per case the path's split, the best launch
with its speed over the path and its TFLOP/s (2 · N · H · 2I over its time), and `best_common`: the launch
whose worst speed over the default launch (`mlp_kernels.MLP_LAUNCH`) is largest across the prefill cases.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_sweep import best_common, checked_us, report_common, sweep_args, time_call

from fulcrum.rollout.native import kernels, mlp_kernels

# (name, hidden, intermediate) and the token counts of a case
SHAPES = [("qwen2.5-0.5b", 896, 4864), ("qwen3-0.6b", 1024, 3072)]
TOKENS = (16, 64, 512, 4096, 16384)
PREFILL_TOKENS = 4096  # cases from here on choose best_common: the key applies to prefill steps
SMALL_SHAPES = [("small", 40, 48)]
SMALL_TOKENS = (37,)
# The launches swept: 16, 64 or 128 rows (16 for decode batches alone, 128 for batches past 64) and 64 or
# 128 columns of act a program, 64 or 128 of the hidden size a step, 4 or 8 warps, 3 or 4 stages; GROUP_M 8
# (the tile order only moves L2 hits).
BLOCKS_M = (16, 64, 128)
BLOCKS_N = (64, 128)
BLOCKS_K = (64, 128)
WARPS = (4, 8)
STAGES = (3, 4)
LAUNCH_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


def sweep_case(name: str, hidden: int, inter: int, tokens: int, device: torch.device, small: bool) -> dict:
    """Every launch on one (shape, tokens) case: its rows, the path's split and the best launch."""
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float32 if small else torch.bfloat16
    x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(2 * inter, hidden, generator=gen) / hidden**0.5).to(device=device, dtype=dtype)
    silu_and_mul = kernels.silu_and_mul if kernels.HAVE_TRITON else None
    assert silu_and_mul is not None, "needs triton"
    timer = (lambda fn: 0.0) if small else time_call
    product = F.linear(x, weight)
    expected = silu_and_mul(product)
    path = {
        "product_us": timer(lambda: F.linear(x, weight)),
        "silu_and_mul_us": timer(lambda: silu_and_mul(product)),
        "path_us": timer(lambda: silu_and_mul(F.linear(x, weight))),
    }

    def check(got: torch.Tensor) -> None:  # the products' summation order apart, the path's output
        torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=3e-2)

    # the default launch (MLP_LAUNCH) may not build on a card with fewer registers or less shared memory
    default = checked_us(
        f"{name} {tokens} default launch", lambda: mlp_kernels.gate_up_silu(x, weight), check, timer
    )
    default_us = None if default is None else default[0]
    flops = 2 * tokens * hidden * 2 * inter
    grid = itertools.product(BLOCKS_M, BLOCKS_N, BLOCKS_K, WARPS, STAGES)
    if small:  # the path only: two launches on the interpreter
        grid = [(16, 16, 16, 4, 1), (32, 16, 32, 4, 1)]
    rows = []
    for block_m, block_n, block_k, warps, stages in grid:
        if not small and (block_m > max(64, tokens) or (block_m == 16 and tokens > 512)):
            continue
        launch = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8}
        launch |= {"num_warps": warps, "num_stages": stages}
        timed = checked_us(
            f"{name} {tokens} {launch}",
            lambda launch=launch: mlp_kernels.gate_up_silu(x, weight, launch),
            check,
            timer,
        )
        if timed is None:
            continue
        us = timed[0]
        row = {"shape": name, "tokens": tokens, **launch, "us": round(us, 2)}
        row["tflop_per_s"] = round(flops / us / 1e6, 1) if us else None
        rows.append(row)
        print(json.dumps(row), flush=True)
    best = min(rows, key=lambda r: r["us"])
    summary = {
        "shape": name,
        "tokens": tokens,
        **{k: round(v, 2) for k, v in path.items()},
        "path_tflop_per_s": round(flops / path["path_us"] / 1e6, 1) if path["path_us"] else None,
        "default": mlp_kernels.MLP_LAUNCH,
        "default_us": None if default_us is None else round(default_us, 2),
        "best": best,
        "best_over_path": round(path["path_us"] / best["us"], 3) if best["us"] else None,
        "default_over_path": round(path["path_us"] / default_us, 3) if default_us else None,
    }
    print(json.dumps(summary), flush=True)
    return {"summary": summary, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    args = sweep_args(__doc__, argv)
    device = torch.device("cpu" if args.small else "cuda")
    shapes, token_counts = (SMALL_SHAPES, SMALL_TOKENS) if args.small else (SHAPES, TOKENS)
    results = [
        sweep_case(name, hidden, inter, tokens, device, args.small)
        for name, hidden, inter in shapes
        for tokens in token_counts
    ]
    prefill = [r for r in results if r["summary"]["tokens"] >= PREFILL_TOKENS and r["summary"]["default_us"]]
    common = None if args.small else best_common(prefill, LAUNCH_KEYS)
    report_common(results, common, "cases", args.json)


if __name__ == "__main__":
    main()
