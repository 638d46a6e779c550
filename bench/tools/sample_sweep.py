"""Benchmark: the native engine's sampler under each launch configuration.

    python bench/tools/sample_sweep.py [--json out.json]
    python bench/tools/sample_sweep.py --small      # the script's path under TRITON_INTERPRET=1 (no GPU)

`sample_kernels.sample_tokens` samples 512 rows of 151,936 logits a 0.5B decode step (the SmolLM2 shape:
1,024 of 49,152) in two kernels: a pass over every entry (a tile's max and softmax sum, one exp an entry)
and a search inside one tile a row. This times one call on each shape's decode batch (bf16 logits at
N(0, 3^2), the engine's default dtype, temperature 1) for every combination of BLOCK (entries a tile),
programs per multiprocessor (the first pass's split of each row), num_warps and num_stages. The first pass
reads every entry once whatever its value, so random logits time it as a trained model's do. Each
configuration's tokens are checked against the current default's (the split never changes them; another
BLOCK, GROUP or num_warps may add a tile's entries in another order, so a draw within fp32 rounding,
about 2^-24 of the mass, of one of a row's V boundaries may move: more than V * 2^-22 of the rows moved
fails the configuration, a wrong search would move most of them; `moved` counts them) and the other
rows' log-probs close, before it is timed
(CUDA events, median of 50 calls after 5). It prints one line per configuration, the best per shape with
its speed-up, and `best_common` over the shapes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_sweep import best_common, checked_us, report_common, time_call

from fulcrum.rollout.native import sample_kernels

# (name, rows, vocabulary): the decode batches of the two shapes profiled
SHAPES = [("qwen2.5-0.5b", 512, 151936), ("smollm2-135m", 1024, 49152)]
SMALL_SHAPES = [("small", 8, 1000)]
# The launches swept: tiles of 512 entries, 8 or 16 first-pass programs an SM, 1-8 tiles a loop
# iteration, 1-4 warps; 2 stages (1 and 2 timed within 2 % of each other in a wider sweep, 2026-12-03).
BLOCKS = (512,)
PROGRAMS_PER_SM = (8, 16)
GROUPS = (1, 2, 4, 8)
WARPS = (1, 2, 4)
STAGES = (2,)


# A row's launch, as bench/rollout.py --sample-launch takes it (BLOCK and programs_per_sm: the
# module's SAMPLE_BLOCK and SAMPLE_PROGRAMS_PER_SM; the rest: SAMPLE_LAUNCH).
LAUNCH_KEYS = ("BLOCK", "programs_per_sm", "GROUP", "num_warps", "num_stages")


def sweep_shape(name: str, rows: int, vocab: int, device: torch.device, small: bool) -> dict:
    """Every launch on one shape's logits: its rows and the best against the default."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=gen) * 3.0).to(device=device, dtype=torch.bfloat16)
    seed = torch.tensor([1234], dtype=torch.int64, device=device)

    def run(**launch: object) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_kernels.sample_tokens(logits, 1.0, seed, **launch)

    timer = (lambda fn: 0.0) if small else time_call
    ref_tokens, ref_logprobs = run()
    default_us = timer(run)
    results = []
    grid = itertools.product(BLOCKS, PROGRAMS_PER_SM, GROUPS, WARPS, STAGES)
    if small:  # the path only: a few launches on the interpreter
        grid = [(512, 4, 1, 4, 1), (1024, 2, 4, 2, 2)]

    def check(sampled: tuple[torch.Tensor, torch.Tensor]) -> int:
        """The rows that sampled another token than the default launch (few: a sum's order), the others'
        log-probs equal up to that order."""
        tokens, logprobs = sampled
        same = tokens == ref_tokens
        moved = int((~same).sum())
        assert moved <= rows * vocab * 2**-22, f"{moved} of {rows} rows sampled another token"
        torch.testing.assert_close(logprobs[same], ref_logprobs[same], atol=1e-4, rtol=1e-4)
        return moved

    for block, per_sm, group, warps, stages in grid:
        kernel = {"GROUP": group, "num_warps": warps, "num_stages": stages}
        launch = {"block": block, "programs_per_sm": per_sm, "launch": kernel}
        timed = checked_us(f"{name} {launch}", lambda launch=launch: run(**launch), check, timer)
        if timed is None:
            continue
        us, moved = timed
        row = {"shape": name, "BLOCK": block, "programs_per_sm": per_sm, **kernel, "moved": moved}
        row |= {"us": round(us, 2), "logits_per_ns": round(rows * vocab / us / 1e3, 2) if us else None}
        results.append(row)
        print(json.dumps(row), flush=True)
    best = min(results, key=lambda r: r["us"])
    summary = {
        "shape": name,
        "default": {
            "BLOCK": sample_kernels.SAMPLE_BLOCK,
            "programs_per_sm": sample_kernels.SAMPLE_PROGRAMS_PER_SM,
            **sample_kernels.SAMPLE_LAUNCH,
        },
        "default_us": round(default_us, 2),
        "best": best,
        "speedup": round(default_us / best["us"], 3) if best["us"] else None,
    }
    print(json.dumps(summary), flush=True)
    return {"summary": summary, "rows": results}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--small", action="store_true", help="a tiny shape, untimed (TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.small else "cuda")
    shapes = SMALL_SHAPES if args.small else SHAPES
    results = [sweep_shape(*shape, device, args.small) for shape in shapes]
    common = None if args.small else best_common(results, LAUNCH_KEYS)
    report_common(results, common, "shapes", args.json)


if __name__ == "__main__":
    main()
