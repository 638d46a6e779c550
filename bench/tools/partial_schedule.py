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
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from long_tail import lognormal_budgets

from fulcrum.rollout import SamplingParams
from fulcrum.rollout.native import EngineConfig, NativeEngine
from fulcrum.rollout.native.config import HEADROOM_TOKENS
from fulcrum.rollout.partial import PartialRollout
from fulcrum.rollout.testing import random_causal_lm

GROUPS, SAMPLES = 64, 8  # GRPO 64 x 8, bench/long_tail.py's step
CACHE_TOKENS = 27_127 * 16  # the run's cache: 46.4 GiB at 112 KiB a token
MEDIAN, SIGMA, CAP, PROMPT = 1536, 0.8, 8192, 52


def simulate(
    scale: float,
    steps: int,
    headroom: int = HEADROOM_TOKENS,
    seed: int = 0,
    max_num_seqs: int = 2 * GROUPS * SAMPLES,
) -> list[dict[str, Any]]:
    """`steps` partial-rollout calls of GROUPS groups each (the first with one more batch in flight, verl's
    one warm-up batch) over the engine's scheduler at 1/`scale` of the run's lengths, `headroom` (the
    run's `engine_kwargs.native.headroom_tokens`) scaled alike, `max_num_seqs` sequences decoding at once
    (the run's 1,024 holds both batches); each call's figures."""
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
    partial = PartialRollout(engine)
    params = SamplingParams(temperature=1.0, max_tokens=cap, ignore_eos=True, n=SAMPLES, seed=seed)
    rng = np.random.default_rng(seed)

    def batch(index: int) -> tuple[list[list[int]], list[int]]:
        budgets = lognormal_budgets(GROUPS, MEDIAN / scale, SIGMA, cap, seed + index)
        return [rng.integers(3, 128, prompt).tolist() for _ in range(GROUPS)], budgets

    (p0, b0), (p1, b1) = batch(0), batch(1)
    prompts, budgets = p0 + p1, b0 + b1
    rows = []
    for step in range(steps):
        start = time.perf_counter()
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
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        prompts, budgets = batch(step + 2)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over the calls after the first (the first starts from an empty cache): tokens prefilled
    over tokens sampled, and preemptions a call."""
    warm = rows[1:] or rows
    return {
        "prefilled_over_sampled": round(statistics.median(r["prefilled_tokens"] / r["sampled_tokens"] for r in warm), 3),
        "preemptions": statistics.median(r["preemptions"] for r in warm),
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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = simulate(args.scale, args.steps, args.headroom, args.seed, args.max_num_seqs)
    result = {
        "scale": args.scale, "headroom": args.headroom, "max_num_seqs": args.max_num_seqs, "rows": rows, **summary(rows)
    }  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
