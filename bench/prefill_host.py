"""Benchmark: the host's share of the native engine's prefill steps, with the decoder's forward stubbed.

    python bench/prefill_host.py [--prompts 512] [--json out.json]      # on the CPU, any machine

A prefill step runs the scheduler, builds the packed inputs, launches the forward, samples and reads the
first tokens, then hands them to the scheduler. Read in turn, the GPU idles during the host's part between
two steps (on an H200, 4 prefill steps of the 0.5B shape's 512 prompts held the host 0.116 s against
0.084 s of GPU work: BENCHMARKS.md, "Where a decode step's time goes"); with `overlap_windows` the next
step is launched before this one's first tokens are read, and that host part runs while the GPU works.
This times the host part alone: the engine on the CPU with the small random model, its forward replaced
by a stub that returns zeros (so no layer runs and no attention), a warm-up generate of one new token, then
a profiled one. It prints the wall time of the generate and the cumulative seconds of each host function
of the step (scheduling, the runner's input building, the sampler, the scheduler's `commit_prefill` and
`take_first_tokens`): what a GPU step must outlast for the overlap to hide it.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout import SMALL_SHAPE, prompt_lengths, random_prompts

from fulcrum.rollout import SamplingParams
from fulcrum.rollout.native import EngineConfig, NativeEngine
from fulcrum.rollout.testing import random_causal_lm

# The host functions of a prefill step (file:function of fulcrum/rollout/native), in the order they run.
STEP_PARTS = (
    ("scheduler.py", "_schedule_prefill"),
    ("model_runner.py", "prefill"),
    ("sampler.py", "__call__"),
    ("scheduler.py", "commit_prefill"),
    ("scheduler.py", "take_first_tokens"),
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = random_causal_lm("qwen2", seed=0, dtype=torch.float32, **SMALL_SHAPE)
    model.generation_config.eos_token_id = None
    prompts = random_prompts(prompt_lengths(args.prompts, None), model.config.vocab_size)
    config = EngineConfig(
        max_num_seqs=args.prompts,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max(len(p) for p in prompts) + 8,
        enforce_eager=True,
        num_kv_blocks=sum(len(p) // 16 + 2 for p in prompts) + 64,
    )
    engine = NativeEngine(model, [1], 0, config, torch.device("cpu"))
    hidden = SMALL_SHAPE["hidden_size"]
    engine.runner.model.forward = lambda ids, positions, cache, meta: torch.zeros(ids.shape[0], hidden)
    params = SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True, seed=0)
    engine.generate(prompts, params)  # warm-up
    profile = cProfile.Profile()
    tick = time.perf_counter()
    profile.enable()
    engine.generate(prompts, params)
    profile.disable()
    wall = time.perf_counter() - tick
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    parts = {}
    for (file, _, function), (_, calls, _, cumulative, _) in stats.items():
        for part_file, part_function in STEP_PARTS:
            if file.endswith(f"fulcrum/rollout/native/{part_file}") and function == part_function:
                parts[f"{part_file}:{function}"] = {"calls": calls, "s": round(cumulative, 4)}
    steps = engine.stepper.counters["prefill_steps"] // 2  # the warm-up's and the profiled generate's
    summary = {"prompts": args.prompts, "prefill_steps": steps, "generate_s": round(wall, 4), "parts": parts}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
