"""The native engine's host work per step, on the CPU, for one tree or several back to back.

On a GPU the decode forward replays a CUDA graph and the sampler is one kernel, so what a decode step
costs the host is the engine's own Python: the window's setup, its reads of the sampled tokens, the
scheduler's bookkeeping. Between two windows the device waits for all of it. Here the captured forward
is stubbed by a static logits tensor and the sampler by static tokens, so only that host work is timed,
whatever the model; the prefill's forward is timed and subtracted. Many sequences (512 by default), as
the per-sequence loops are what grows.

    python bench/host_step.py                        # this tree
    python bench/host_step.py /tmp/old . --rounds 5  # trees alternating, medians, ratios to the first

Each tree runs in its own process with its own `fulcrum` first on PYTHONPATH (only APIs that older
trees have are used). Figures depend on the host: compare trees in one call, never across calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(prompts: int, new_tokens: int, repeats: int) -> dict[str, float]:
    """Host ms per decode step and per prefill step, medians of `repeats` generate calls."""
    import torch

    from fulcrum.rollout import SamplingParams
    from fulcrum.rollout.native import EngineConfig, NativeEngine, sampler
    from fulcrum.rollout.native.block_manager import blocks_for
    from fulcrum.rollout.testing import random_causal_lm

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(60, 150, (prompts,), generator=generator).tolist()
    batch = [torch.randint(3, 200, (n,), generator=generator).tolist() for n in lengths]
    config = EngineConfig(
        max_num_seqs=prompts,
        max_num_batched_tokens=16384,
        max_model_len=150 + new_tokens + 64,
        decode_steps=16,
        num_kv_blocks=prompts * blocks_for(150 + new_tokens + 16, 16) + 64,
    )
    model = random_causal_lm("qwen2", seed=0)  # the tiny default: its decode compute is stubbed below
    engine = NativeEngine(model, [1], 0, config, torch.device("cpu"))
    vocab = model.config.vocab_size
    logits = torch.randn(prompts, vocab, generator=generator)
    tokens = torch.randint(3, vocab, (16384,), generator=generator)
    logprobs = torch.randn(16384, generator=generator)
    engine.runner.use_graphs = True  # decode through _graph_logits: a replay is one host call
    engine.runner._graph_logits = lambda padded: logits[:padded]
    sampler.DeviceSampler.__call__ = lambda self, rows: (tokens[: len(rows)], logprobs[: len(rows)])
    forward_s = [0.0]
    decoder = type(engine.model)
    for name in ("forward", "logits"):
        setattr(decoder, name, timed(getattr(decoder, name), forward_s))
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=0)
    engine.generate(batch, params)
    rows = []
    for _ in range(repeats):
        forward_s[0] = 0.0
        start = time.perf_counter()
        engine.generate(batch, params)
        total = time.perf_counter() - start
        stats = engine.stats
        rows.append(
            {
                "decode_ms_per_step": stats["decode_s"] * 1e3 / stats["decode_steps"],
                "prefill_ms_per_step": (stats["prefill_s"] - forward_s[0]) * 1e3 / stats["prefill_steps"],
                "generate_ms": (total - forward_s[0]) * 1e3,
            }
        )
    return {key: round(statistics.median(row[key] for row in rows), 4) for key in rows[0]}


def timed(fn, total: list[float]):
    """`fn`, adding its seconds to total[0]."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - start

    return wrapper


def run_tree(tree: str, args: argparse.Namespace) -> dict[str, float]:
    """`measure` in a fresh process with `tree`'s fulcrum first on the path."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    command = [sys.executable, __file__, "--measure", "--prompts", str(args.prompts)]
    command += ["--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("trees", nargs="*", default=[here], help="fulcrum trees, the first is the reference")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7, help="generate calls per process")
    parser.add_argument("--rounds", type=int, default=3, help="processes per tree, alternating")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.prompts, args.new_tokens, args.repeats)))
        return
    runs: dict[str, list[dict[str, float]]] = {tree: [] for tree in args.trees}
    for _ in range(args.rounds):
        for tree in args.trees:
            runs[tree].append(run_tree(tree, args))
    first = None
    for tree, results in runs.items():
        summary = {key: round(statistics.median(r[key] for r in results), 4) for key in results[0]}
        first = first or summary
        ratios = {key: round(summary[key] / first[key], 3) for key in summary}
        print(json.dumps({"tree": tree, **summary, "ratio_to_first": ratios}))


if __name__ == "__main__":
    main()
