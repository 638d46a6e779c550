"""Benchmark (CPU): what the native engine's scheduler recomputes when partial rollouts oversubscribe its cache.

    python bench/tools/partial_schedule.py --json schedule.json     # bench/long_tail.py's Qwen3-0.6B run at 1/16
    python bench/tools/partial_schedule.py --scale 64 --steps 3     # smaller, faster

bench/long_tail.py's partial rollouts at Qwen3-0.6B's shape keep 128 groups of 8 in flight (a step's batch
and the carried one, `max_num_seqs` 1,024) over a cache of 434k tokens (27,127 blocks of 16), while a step
samples about 1.0 M tokens: the cache is full for most of a step, and every sequence the scheduler preempts
is prefilled again. This runs the same schedule through the real engine (`NativeEngine` with
`PartialRollout`, as fulcrum.trainer.partial_steps drives them) on the CPU over a tiny random model, every
length divided by `--scale`: response budgets log-normal with median 1,536 / scale and σ 0.8, cut at
8,192 / scale; prompts of 52 / scale tokens; a cache of 434k / scale tokens. Blocks of one token and decode
windows of one step keep the block and window granularity at 1/16 of the run's (16 tokens a block and a
window there) as every length is; at `--scale 16` the two match. The scheduler's decisions depend on the
lengths only, not on the model, so the figures are the schedule's: tokens prefilled a step (prompts, and
sequences preempted then recomputed), tokens sampled, preemptions, evictions of held samples.

    python bench/tools/partial_schedule.py --batches-in-flight 1 ...  # synchronous steps, for comparison

Each call also costs its decode steps' attention launches in a model of the paged decode kernel at
Qwen3-0.6B's shape on an H100 (`launch_balance`: the engine's split count a (sequence, KV head) pair,
each program's cost its share of the context's tiles, the programs started in grid order on a fixed number
of slots), in the batch's order and longest context first (`engine_kwargs.native.decode_order`), against
the balanced bound. The contexts and the block tables' width are the replay's, times `--scale`.
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from long_tail import lognormal_budgets

from fulcrum.rollout import SamplingParams
from fulcrum.rollout.native import EngineConfig, NativeEngine
from fulcrum.rollout.native.config import HEADROOM_TOKENS
from fulcrum.rollout.native.decode_grid import decode_splits
from fulcrum.rollout.partial import PartialRollout
from fulcrum.rollout.testing import random_causal_lm

GROUPS, SAMPLES = 64, 8  # GRPO 64 x 8, bench/long_tail.py's step
CACHE_TOKENS = 27_127 * 16  # the run's cache: 46.4 GiB at 112 KiB a token
MEDIAN, SIGMA, CAP, PROMPT = 1536, 0.8, 8192, 52
# The paged decode kernel's launch at Qwen3-0.6B's shape on an H100, for `launch_balance`: K/V heads, SMs,
# programs an SM runs at once (one warp and four stages of 64-position K and V tiles at head dim 128: 128 KiB
# of its shared memory each), positions a tile, and a program's fixed cost beside its tiles, in tiles.
KV_HEADS, SMS, PROGRAMS_PER_SM, TILE, PROGRAM_TILES = 8, 132, 2, 64, 0.5


def launch_end(costs: Sequence[float], slots: int) -> float:
    """When a launch whose programs cost `costs` (in grid order) ends, `slots` of them running at once and
    each freed slot starting the next in order (greedy list scheduling)."""
    ends = [0.0] * slots
    for cost in costs:
        heapq.heappush(ends, heapq.heappop(ends) + cost)
    return max(ends)


def launch_balance(
    contexts: Sequence[int], splits: int = 1, kv_heads: int = KV_HEADS
) -> tuple[float, float, float]:
    """One decode step's attention launch on SMS · PROGRAMS_PER_SM slots, `splits` programs a (sequence, KV
    head) pair (`decode_grid.decode_splits`), each reading its share of the context's tiles, t = ⌈⌈context
    / TILE⌉ / splits⌉ (the last split the rest), and costing its tiles + PROGRAM_TILES: (the launch's end in
    the batch's order, grid (sequence, KV head, split): every sequence of a KV head before the next head's,
    a split's programs before the next split's; its end longest context first, grid (KV head, rank, split);
    the balanced bound Σ cost / slots). The split outputs' merge is left out: both orders pay it alike."""
    slots = SMS * PROGRAMS_PER_SM
    tiles = [-(-int(c) // TILE) for c in contexts]

    def cost(n: int, split: int) -> float:
        share = -(-n // splits)
        return max(0, min(share, n - split * share)) + PROGRAM_TILES

    batch_order = [cost(n, s) for s in range(splits) for _ in range(kv_heads) for n in tiles]
    longest = sorted(tiles, reverse=True)
    longest_first = [cost(n, s) for s in range(splits) for n in longest for _ in range(kv_heads)]
    return launch_end(batch_order, slots), launch_end(longest_first, slots), sum(batch_order) / slots


def simulate(
    scale: float,
    steps: int,
    headroom: int = HEADROOM_TOKENS,
    seed: int = 0,
    max_num_seqs: int = 2 * GROUPS * SAMPLES,
    batches_in_flight: int = 2,
) -> list[dict[str, Any]]:
    """`steps` partial-rollout calls of GROUPS groups each (the first with `batches_in_flight` batches,
    verl's one warm-up batch beside the step's; 1: synchronous steps, every group run to its end) over the
    engine's scheduler at 1/`scale` of the run's lengths, `headroom` (the run's
    `engine_kwargs.native.headroom_tokens`) scaled alike, `max_num_seqs` sequences decoding at once (the
    run's 1,024 holds both batches); each call's figures, its decode steps' attention launches costed by
    `launch_balance` at the run's lengths (the sums of each of its three figures, in tiles)."""
    cap = max(2, round(CAP / scale))
    prompt = max(1, round(PROMPT / scale))
    model = random_causal_lm(
        "qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=128,
    )  # fmt: skip
    block = max(1, round(16 / scale))  # the run's blocks and windows of 16 tokens, scaled
    config = EngineConfig(
        max_num_seqs=max_num_seqs, max_model_len=cap + prompt, block_size=block,
        num_kv_blocks=round(CACHE_TOKENS / scale / block), decode_steps=block,
        headroom_tokens=round(headroom / scale), dtype=torch.float32, triton_kernels=False,
    )  # fmt: skip
    engine = NativeEngine(model, [0], 0, config, torch.device("cpu"))
    launches = [0.0, 0.0, 0.0]
    decode_logits = engine.runner.decode_logits
    table_positions = round(engine.runner.max_blocks_per_seq * engine.runner.block_size * scale)  # the run's

    def costed_decode_logits(batch: int, max_context: int) -> torch.Tensor:
        contexts = (engine.runner.context_lens[:batch] * scale).tolist()
        splits = decode_splits(batch, KV_HEADS, table_positions, SMS)
        for i, figure in enumerate(launch_balance(contexts, splits)):
            launches[i] += figure
        return decode_logits(batch, max_context)

    engine.runner.decode_logits = costed_decode_logits  # type: ignore[method-assign]
    partial = PartialRollout(engine)
    params = SamplingParams(temperature=1.0, max_tokens=cap, ignore_eos=True, n=SAMPLES, seed=seed)
    rng = np.random.default_rng(seed)

    def batch(index: int) -> tuple[list[list[int]], list[int]]:
        budgets = lognormal_budgets(GROUPS, MEDIAN / scale, SIGMA, cap, seed + index)
        return [rng.integers(3, 128, prompt).tolist() for _ in range(GROUPS)], budgets

    first = [batch(i) for i in range(batches_in_flight)]
    prompts, budgets = [p for b in first for p in b[0]], [n for b in first for n in b[1]]
    rows = []
    for step in range(steps):
        start = time.perf_counter()
        launches[:] = [0.0, 0.0, 0.0]
        groups = partial.generate(
            prompts, list(range(len(prompts))), params, enough=GROUPS, version=step, max_tokens=budgets
        )
        figures = partial.figures
        rows.append(
            {
                "step": step,
                "trained_tokens": sum(len(s.token_ids) for g in groups for s in g.samples),
                "sampled_tokens": int(figures["generated_tokens"]),
                "prefilled_tokens": int(figures["prefill_tokens"]),
                "preemptions": int(figures["preemptions"]),
                "evictions": int(figures["evictions"]),
                "decode_steps": int(figures["decode_steps"]),
                "kv_token_reads": int(figures["kv_token_reads"]),
                "decode_s": round(figures["decode_s"], 2),
                "seconds": round(time.perf_counter() - start, 2),
                "launch_batch_order": round(launches[0]),
                "launch_longest_first": round(launches[1]),
                "launch_balanced": round(launches[2]),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        prompts, budgets = batch(step + batches_in_flight)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Over the calls after the first (the first starts from an empty cache): the medians of tokens
    prefilled over tokens sampled and of preemptions a call, and the decode steps' attention launches
    (`launch_balance`) in the batch's order and longest first, each over the balanced bound (their sums)."""
    warm = rows[1:] or rows
    balanced = sum(r["launch_balanced"] for r in warm) or 1
    return {
        "prefilled_over_sampled": round(statistics.median(r["prefilled_tokens"] / r["sampled_tokens"] for r in warm), 3),
        "preemptions": statistics.median(r["preemptions"] for r in warm),
        "launch_batch_order_over_balanced": round(sum(r["launch_batch_order"] for r in warm) / balanced, 3),
        "launch_longest_first_over_balanced": round(sum(r["launch_longest_first"] for r in warm) / balanced, 3),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=16, help="every length divided by this")
    parser.add_argument("--steps", type=int, default=5, help="partial-rollout calls")
    parser.add_argument(
        "--headroom",
        type=int,
        default=HEADROOM_TOKENS,
        help="engine_kwargs.native.headroom_tokens (the run's)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=2 * GROUPS * SAMPLES, help="rollout.max_num_seqs")
    parser.add_argument(
        "--batches-in-flight", type=int, default=2, help="prompt batches in flight (1: synchronous steps)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = simulate(
        args.scale, args.steps, args.headroom, args.seed, args.max_num_seqs, args.batches_in_flight
    )
    result = {
        "scale": args.scale, "headroom": args.headroom, "max_num_seqs": args.max_num_seqs,
        "batches_in_flight": args.batches_in_flight, "rows": rows, **summary(rows),
    }  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
