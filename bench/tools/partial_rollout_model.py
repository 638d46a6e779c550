"""What partial rollouts can gain on one GPU, before spending the GPU on it: a model of the engine's decode
for a step of GRPO groups with long-tailed response budgets, synchronous against partial rollouts that keep
their K/V (`bench/long_tail.py --modes partial-kept`).

    python bench/tools/partial_rollout_model.py --shape qwen3-0.6b --kv-capacity-gib 44
    python bench/tools/partial_rollout_model.py --shape qwen2.5-0.5b --median 512 --sigma 1.0

The model: a decode step costs max(step floor, (W + kv · Σ contexts) / (share · bandwidth)), the larger of a
per-step cost that no batch lowers (launches, small kernels: ~2.3 ms at Qwen2.5-0.5B's shape on an H100) and
the weights and every sequence's K/V read at the share of the memory roofline the decode kernels reach at
long contexts (0.72, BENCHMARKS.md "Long contexts"). Groups are admitted in order while their full
reservations, samples · (prompt + budget) tokens, fit the K/V capacity; every sample of a group has the
group's budget (`ignore_eos`, as the bench runs). A synchronous step decodes its groups until all are done; a
partial step holds `1 + warm-up` batches of groups in flight, trains the first `groups` to complete and
carries the rest with their K/V (no prefill again, no old-log-prob pass). Training costs
`--train-us-per-token` a trained response token (the update, its passes included). It prints each mode's
generation and step time and the trained tokens a second over the steps after the warm-up.

Admission by whole reservations is the model's, not the engine's: the scheduler admits a prompt where the
running sequences keep `engine_kwargs.native.headroom_tokens` each, so with more sequences in flight than its
cache holds it preempts and prefills them again, which this model leaves out (at Qwen3-0.6B's shape it gave
1.02x where the engine, then admitting whatever fit, measured 0.88x with 1.02 M tokens recomputed a step);
bench/tools/partial_schedule.py replays the scheduler itself.

What it says (H100 constants): at Qwen3-0.6B's shape (112 KiB of K/V a token, ~44 GiB of cache beside the
training passes) the decode is bound by the K/V reads of the bulk and the cache's capacity, and partial
rollouts gain at most 1.13x the trained tokens a second for medians of 256-1,536 tokens and sigma 0.8-1.5
(1.23x on an H200 with an 80 GiB cache); at Qwen2.5-0.5B's (12 KiB a token) the tail runs at the step floor
with a few sequences and they gain 1.4x for the bench's budgets.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import AutoConfig

from fulcrum.models.arch import model_shape
from fulcrum.models.arch.spec import kv_bytes_per_token, matmul_param_count

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: long_tail and shapes by name

from long_tail import lognormal_budgets
from shapes import shape_of

GIB = 2**30


@dataclass(frozen=True)
class DecodeCost:
    """A decode step's cost: max(`step_floor_s`, (`weight_bytes` + `kv_bytes` · contexts) / (`share` ·
    `bandwidth`))."""

    weight_bytes: float
    kv_bytes: float
    bandwidth: float
    share: float
    step_floor_s: float

    def steps_s(self, context: int, growth: int, steps: int) -> float:
        """Seconds of `steps` decode steps whose summed context starts at `context` tokens and grows by
        `growth` a step (every sequence in flight adds one token)."""
        contexts = context + growth * np.arange(steps, dtype=np.float64)
        read_s = (self.weight_bytes + self.kv_bytes * contexts) / (self.share * self.bandwidth)
        return float(np.maximum(read_s, self.step_floor_s).sum())


@dataclass
class Group:
    budget: int
    done: int = 0


def generate_until(
    pool: list[Group], needed: int, samples: int, prompt: int, capacity_tokens: float, cost: DecodeCost
) -> tuple[float, int, list[Group]]:
    """Decode the groups of `pool` until `needed` of them are complete: (seconds, decode steps, the first
    `needed` complete groups, removed from `pool`). Groups are admitted in order while their reservations,
    samples · (prompt + budget) tokens each, fit `capacity_tokens` (the first always); between two
    completions the set in flight is fixed, so each stretch is costed at once (`DecodeCost.steps_s`)."""
    seconds, steps, complete = 0.0, 0, [g for g in pool if g.done >= g.budget]
    while len(complete) < needed:
        active, reserved = [], 0.0
        for group in pool:
            if group.done >= group.budget:
                continue
            size = samples * (prompt + group.budget)
            if active and reserved + size > capacity_tokens:
                break
            active.append(group)
            reserved += size
        stretch = min(g.budget - g.done for g in active)
        context = sum(samples * (prompt + g.done) for g in active)
        seconds += cost.steps_s(context, samples * len(active), stretch)
        steps += stretch
        for group in active:
            group.done += stretch
            if group.done >= group.budget:
                complete.append(group)
    trained = complete[:needed]
    for group in trained:
        pool.remove(group)
    return seconds, steps, trained


def simulate(
    mode: str,
    budgets: list[int],
    groups: int,
    samples: int,
    prompt: int,
    warmup_batches: int,
    capacity_tokens: float,
    cost: DecodeCost,
    train_s_per_token: float,
) -> list[dict[str, float]]:
    """Each step of `mode` (sync or partial) over the budget stream `budgets` (one a group, in order; a
    partial run's first step takes `1 + warmup_batches` batches, every other step one): generation seconds,
    decode steps, trained response tokens and the step's seconds."""
    first = groups * (1 + warmup_batches) if mode == "partial" else groups
    steps: list[dict[str, float]] = []
    pool = [Group(b) for b in budgets[:first]]
    for start in range(first, len(budgets) + 1, groups):
        gen_s, decode_steps, trained = generate_until(pool, groups, samples, prompt, capacity_tokens, cost)
        tokens = samples * sum(g.budget for g in trained)
        steps.append(
            {"gen_s": gen_s, "decode_steps": decode_steps, "tokens": tokens,
             "step_s": gen_s + tokens * train_s_per_token}
        )  # fmt: skip
        pool += [Group(b) for b in budgets[start : start + groups]]
    return steps


def summary(steps: list[dict[str, float]], skip: int) -> dict[str, float]:
    """Medians of generation and step seconds and decode steps, and trained tokens a second (their sum over
    the time's), over the steps after the first `skip`."""
    warm = steps[skip:]
    return {
        "gen_s": statistics.median(s["gen_s"] for s in warm),
        "step_s": statistics.median(s["step_s"] for s in warm),
        "decode_steps": statistics.median(s["decode_steps"] for s in warm),
        "tok_per_s": sum(s["tokens"] for s in warm) / sum(s["step_s"] for s in warm),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-0.6b", help="bench/shapes.py name")
    parser.add_argument("--median", type=float, default=1536)
    parser.add_argument("--sigma", type=float, default=0.8)
    parser.add_argument("--cap", type=int, default=8192)
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=52, help="prompt tokens (the bench's arithmetic rows)")
    parser.add_argument("--warmup-batches", type=int, default=1, help="num_warmup_batches")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s (H100 SXM)")
    parser.add_argument("--share", type=float, default=0.72, help="the decode's share of the memory roofline")
    parser.add_argument("--step-floor-ms", type=float, default=2.3)
    parser.add_argument("--kv-capacity-gib", type=float, default=44.0)
    parser.add_argument("--train-us-per-token", type=float, default=12.0)
    args = parser.parse_args(argv)
    model_type, fields = shape_of(args.shape)
    shape = model_shape(AutoConfig.for_model(model_type, **fields))
    kv_bytes = kv_bytes_per_token(shape)
    weight_bytes = 2.0 * matmul_param_count(shape, lm_head=False)  # bf16; a tied head read once a step
    cost = DecodeCost(weight_bytes, kv_bytes, args.bandwidth, args.share, args.step_floor_ms / 1e3)
    budgets = lognormal_budgets(args.groups * (args.steps + 2), args.median, args.sigma, args.cap, args.seed)
    capacity = args.kv_capacity_gib * GIB / kv_bytes
    common = (budgets, args.groups, args.samples, args.prompt, args.warmup_batches, capacity, cost,
              args.train_us_per_token / 1e6)  # fmt: skip
    sync = summary(simulate("sync", *common), skip=1)
    partial = summary(simulate("partial", *common), skip=1 + args.warmup_batches)
    print(f"{args.shape}: K/V {kv_bytes:,} B a token, capacity {capacity:,.0f} tokens; budgets log-normal "
          f"median {args.median:g}, sigma {args.sigma:g}, cut at {args.cap}")  # fmt: skip
    for name, figures in (("sync", sync), ("partial-kept", partial)):
        print(f"  {name:13s} " + "  ".join(f"{k} {v:,.1f}" for k, v in figures.items()))
    print(f"  partial-kept / sync: trained tok/s {partial['tok_per_s'] / sync['tok_per_s']:.2f}x, "
          f"step rate {sync['step_s'] / partial['step_s']:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
