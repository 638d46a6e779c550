"""Benchmark: the native engine's paged decode attention kernel under each launch configuration.

    python bench/tools/attention_sweep.py [--json out.json]

The decode step of the 0.5B shape spends 627 µs of its 2,464 in this kernel (24 layers, 512 sequences),
reading K/V at about 2.4 TB/s, half the H200's bandwidth; on SmolLM2-135M's shape (1,024 sequences, 30
layers) it is 55 % of the step. This times one layer's call for every combination of TILE (positions a
loop iteration: 32, 64, 128), SPLITS (programs a sequence and KV head, 1, 2: flash-decoding, their
partial outputs merged by a second kernel; 4 splits lost on both 64-wide shapes, 2026-12-02), num_warps (1,
2, 4) and num_stages (2, 3, 4) — a first sweep of TILE 16-128 × 1-8 warps × 1-4 stages found one warp and 4
stages best on the 64-wide heads — on each shape's decode batch, Qwen3-0.6B's 128-wide heads (16 query
heads over 8 KV heads) included, since the default launch was chosen on 64-wide ones:
contexts drawn between the prompt's length and prompt + 256 (the rollout's 512 × 256), blocks of 16
scattered over the cache as the block manager hands them out. Each configuration's output is checked
against the current default (`decode_grid.DECODE_LAUNCH`) before it is timed (CUDA events, median of 50
calls after 5). It prints one line per configuration and the best per shape with its speed-up and its
effective K/V bandwidth (bytes of K and V read / time).

    python bench/tools/attention_sweep.py --tail [--json out.json]

times the tail of a generation instead: 16 sequences (`TAIL_CASES`), SPLITS 1, 2, 4 and 8, each launch
inside a CUDA graph of 24 calls (`time_graph`: a call of a few microseconds timed alone is the host's
launch), block tables as wide as an engine's for 1,536 positions, so the default launch splits as the
engine's would (`default_splits`).

    python bench/tools/attention_sweep.py --mixed [--json out.json]

times wide batches of long, uneven contexts instead (`MIXED_CASES`): partial rollouts keep sequences
thousands of tokens long beside ones just begun, where a synchronous step's sequences grow together. Each
shape at contexts drawn log-uniformly over 64-8,192 and, as the control, evenly over 1,536-1,792, the
block tables 8,448 positions wide (an engine for 8k responses); SPLITS 1-8, each with the rows in the
batch's order and longest context first (`order` 0 and 1: `decode_grid.decode_order`, given to the kernel
as the engine gives it once a step; `order_us`: the ordering's own time), one layer's call timed alone. Where one
program a (sequence, KV head) pair is the default (`decode_grid.wide_splits` at these widths), the longest
pair's program may outlast the rest of the launch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fulcrum.rollout.native import decode_grid, kernels

# (name, sequences, query heads, KV heads, head dim)
SHAPES = [("qwen2.5-0.5b", 512, 14, 2, 64), ("smollm2-135m", 1024, 9, 3, 64), ("qwen3-0.6b", 512, 16, 8, 128)]
BLOCK = 16
PROMPT, RESPONSE = (60, 150), 256
# `--tail`: the last sequences of a generation or a validation, 16 at a time, at the contexts of GSM8K's
# prompts plus a short and a long answer, in block tables 1,536 positions wide (verl's GSM8K GRPO example:
# 512-token prompts, 1,024-token responses). (name, sequences, query heads, KV heads, head dim, contexts)
TAIL_CASES = [
    ("qwen2.5-0.5b ctx 60-600", 16, 14, 2, 64, (60, 600)),
    ("qwen2.5-0.5b ctx 600-1500", 16, 14, 2, 64, (600, 1500)),
    ("qwen3-0.6b ctx 60-600", 16, 16, 8, 128, (60, 600)),
    ("qwen3-0.6b ctx 600-1500", 16, 16, 8, 128, (600, 1500)),
]
TAIL_TABLE_POSITIONS = 1536
# `--mixed`: wide batches at long, uneven contexts (log-uniform) against even ones, in tables sized for 8k
# responses. (name, sequences, query heads, KV heads, head dim, contexts, log-uniform)
MIXED_CASES = [
    ("qwen3-0.6b 192 seqs ctx 64-8192 log-uniform", 192, 16, 8, 128, (64, 8192), True),
    ("qwen3-0.6b 192 seqs ctx 1536-1792", 192, 16, 8, 128, (1536, 1792), False),
    ("qwen2.5-0.5b 512 seqs ctx 64-8192 log-uniform", 512, 14, 2, 64, (64, 8192), True),
    ("qwen2.5-0.5b 512 seqs ctx 1536-1792", 512, 14, 2, 64, (1536, 1792), False),
]
MIXED_TABLE_POSITIONS = 8448


def decode_batch(
    sequences: int,
    heads: int,
    kv_heads: int,
    dim: int,
    device: torch.device,
    seed: int = 0,
    context: tuple[int, int] = (PROMPT[0], PROMPT[1] + RESPONSE),
    table_positions: int = 0,
    log_uniform: bool = False,
) -> dict:
    """One decode step's inputs: q, the paged caches, block tables and context lengths (drawn uniformly
    from `context`'s [low, high), the rollout's by default; with `log_uniform`, exp(U(ln low, ln high)),
    as many short contexts as long ones a decade). `table_positions`: the block tables' width in
    positions, as an engine sizes them for its longest sequence (the default launch's split count reads
    it); 0: the longest context's."""
    gen = torch.Generator().manual_seed(seed)
    if log_uniform:
        low, high = math.log(context[0]), math.log(context[1])
        draw = torch.rand(sequences, generator=gen, dtype=torch.float64)
        lens = (low + (high - low) * draw).exp().long().clamp(context[0], context[1] - 1)
    else:
        lens = torch.randint(context[0], context[1], (sequences,), generator=gen)
    blocks_per_seq = (lens + BLOCK - 1) // BLOCK
    width = max(int(blocks_per_seq.max()), -(-table_positions // BLOCK))
    total = int(blocks_per_seq.sum()) + 1
    order = torch.randperm(total - 1, generator=gen) + 1  # block 0 is the scratch block
    tables = torch.zeros(sequences, width, dtype=torch.int32)
    start = 0
    for row, count in enumerate(blocks_per_seq.tolist()):
        tables[row, :count] = order[start : start + count]
        start += count
    shape = (total * BLOCK, kv_heads, dim)
    return {
        "q": torch.randn(sequences, heads, dim, device=device, dtype=torch.bfloat16),
        "k_cache": torch.randn(shape, device=device, dtype=torch.bfloat16),
        "v_cache": torch.randn(shape, device=device, dtype=torch.bfloat16),
        "block_tables": tables.to(device),
        "context_lens": lens.to(device=device, dtype=torch.int32),
        "kv_bytes": int(lens.sum()) * kv_heads * dim * 2 * 2,
    }


def context_summary(context_lens: torch.Tensor) -> dict[str, int]:
    """The batch's shortest, median and longest context and its mean (positions)."""
    lens = sorted(int(x) for x in context_lens.tolist())
    return {
        "min": lens[0],
        "median": lens[len(lens) // 2],
        "max": lens[-1],
        "mean": round(sum(lens) / len(lens)),
    }


def time_call(fn, repeats: int = 50, warmup: int = 5) -> float:
    """Median µs of `fn()` by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def time_graph(fn: Callable[[], Any], calls: int = 24, repeats: int = 50, warmup: int = 5) -> float:
    """Median µs of one `fn()` among `calls` captured back to back in a CUDA graph, as a decode step's
    layers run (the replay timed by CUDA events, divided by `calls`). For kernels of a few
    microseconds, where `time_call` of one call alone measures the host's launch."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiled and warm before the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_call(graph.replay, repeats, warmup) / calls


def checked_us(
    label: str, run: Callable[[], Any], check: Callable[[Any], Any], timer: Callable[..., float] = time_call
) -> tuple[float, Any] | None:
    """(µs of `run()` by `timer`, what `check` returned) once `check(run())` passes; None, the reason
    printed after `label`, for a launch Triton cannot build (shared memory, registers) or whose output
    `check` refuses."""
    try:
        checked = check(run())
        return timer(run), checked
    except Exception as exc:
        print(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}", flush=True)
        return None


def report_common(results: list[dict], common: dict | None, key: str, json_path: Path | None) -> None:
    """Print the common launch; write `{key: results, "best_common": common}` to `json_path` if given."""
    print(json.dumps({"best_common": common}), flush=True)
    if json_path:
        json_path.write_text(json.dumps({key: results, "best_common": common}, indent=1))


def best_common(results: list[dict], keys: tuple[str, ...]) -> dict | None:
    """The launch that every shape ran, chosen by its worst speed-up over the shapes' defaults.

    For a launch L present in every shape's rows: worst(L) = min over shapes of default_us / us(L); the
    one with the largest worst(L), with its speed-up per shape. A default changes only on this figure
    (BENCHMARKS.md: a launch becomes the default when it wins by more than 5 % on every shape).
    """
    per_shape = [
        {
            tuple(row[k] for k in keys): result["summary"]["default_us"] / row["us"]
            for row in result["rows"]
            if row["us"]
        }
        for result in results
    ]
    common = set.intersection(*(set(speedups) for speedups in per_shape)) if per_shape else set()
    if not common:
        return None
    launch = max(common, key=lambda k: (min(s[k] for s in per_shape), k))
    return {
        "launch": dict(zip(keys, launch, strict=True)),
        "speedup": {
            r["summary"]["shape"]: round(s[launch], 3) for r, s in zip(results, per_shape, strict=True)
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--tail",
        action="store_true",
        help="16 sequences a case (TAIL_CASES), SPLITS 1-8, each launch timed inside a CUDA graph",
    )
    parser.add_argument(
        "--mixed",
        action="store_true",
        help="wide batches at uneven long contexts and at even ones (MIXED_CASES), SPLITS 1-8",
    )
    args = parser.parse_args()
    if args.tail:
        cases = [(*case, False) for case in TAIL_CASES]
        grid = itertools.product((32, 64, 128), (1, 2, 4), (2, 4), (1, 2, 4, 8), (0,))  # batch's order
        timer, table_positions = time_graph, TAIL_TABLE_POSITIONS
    elif args.mixed:
        cases = MIXED_CASES
        grid = itertools.product((64,), (1, 2, 4), (4,), (1, 2, 4, 8), (0, 1))
        timer, table_positions = time_call, MIXED_TABLE_POSITIONS
    else:
        cases = [(*shape, (PROMPT[0], PROMPT[1] + RESPONSE), False) for shape in SHAPES]
        grid = itertools.product((32, 64, 128), (1, 2, 4), (2, 3, 4), (1, 2), (0,))
        timer, table_positions = time_call, 0
    launches = [  # a kernel launch, and 1 where its rows go longest first
        ({"TILE": tile, "SPLITS": splits, "num_warps": warps, "num_stages": stages}, order)
        for tile, warps, stages, splits, order in grid
    ]
    results = []
    for name, sequences, heads, kv_heads, dim, context, log_uniform in cases:
        batch = decode_batch(
            sequences,
            heads,
            kv_heads,
            dim,
            torch.device("cuda"),
            context=context,
            table_positions=table_positions,
            log_uniform=log_uniform,
        )
        kv_bytes = batch.pop("kv_bytes")
        scale = dim**-0.5
        # The engine orders the rows once a decode step for all its layers: an ordered launch is timed
        # with the order given, the ordering apart.
        longest_first = decode_grid.decode_order(batch["context_lens"])
        order_us = time_call(lambda lens=batch["context_lens"]: decode_grid.decode_order(lens))

        def run(
            launch: dict[str, int] | None,
            ordered: int = 0,
            batch: dict = batch,
            scale: float = scale,
            longest_first: torch.Tensor = longest_first,
        ) -> torch.Tensor:
            order = longest_first if ordered else None
            return kernels.paged_decode_attention(
                **batch, block_size=BLOCK, scale=scale, launch=launch, order=order
            )

        reference = run(None)
        default_us = timer(lambda: run(None))
        rows = []
        for launch, ordered in launches:
            timed = checked_us(
                f"{name} {launch} order {ordered}",
                lambda launch=launch, ordered=ordered: run(launch, ordered),
                lambda got, ref=reference: torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2),
                timer,
            )
            if timed is None:
                continue
            us = timed[0]
            rows.append(
                {
                    "shape": name,
                    **launch,
                    "order": ordered,
                    "us": round(us, 2),
                    "tb_s": round(kv_bytes / us / 1e6, 3),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        best = min(rows, key=lambda r: r["us"])
        summary = {
            "shape": name,
            "default": decode_grid.DECODE_LAUNCH,
            "default_splits": decode_grid.decode_launch(
                sequences, kv_heads, batch["block_tables"].shape[1] * BLOCK, torch.device("cuda")
            )["SPLITS"],
            "contexts": context_summary(batch["context_lens"]),
            "default_us": round(default_us, 2),
            "order_us": round(order_us, 2),
            "default_tb_s": round(kv_bytes / default_us / 1e6, 3),
            "best": best,
            "speedup": round(default_us / best["us"], 3),
        }
        print(json.dumps(summary), flush=True)
        results.append({"summary": summary, "rows": rows})
    common = best_common(results, ("TILE", "SPLITS", "num_warps", "num_stages", "order"))
    report_common(results, common, "shapes", args.json)


if __name__ == "__main__":
    main()
