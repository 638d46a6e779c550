"""Benchmark: where an actor update's time goes, unprofiled — CUDA events around its parts.

    python bench/tools/update_timeline.py --model .bench/qwen05 [--rows 512] [--mini 128] [--json out.json] [KEY=VALUE ...]
    python bench/tools/update_timeline.py --model TINY --device cpu --rows 16 --mini 8 --prompt-width 320 \
        --response 32   # the script's path on the CPU (host times only)

The profiler's own host cost made the seed-size update look host-bound (BENCHMARKS.md, "A micro-batch
replayed as a CUDA graph"): unprofiled, its 32 micro-batches' forward and backward take about 1.69 s of
the update's 1.99 s. This finds the rest without a profiler. The actor as `bench/passes.py` builds it
(the seed's sizes by default: micro-batches of 8, mini-batches of 128) runs `update_policy` on the same
synthetic batch; after --warmup updates, one update runs with its parts wrapped — each micro-batch's
`run` (`ModelForwards.run`: a CUDA-graph replay, or the eager `fwd_bwd`), and within an eager one
`fwd_bwd` (forward, loss, backward), its `forward` (`ModelForwards.forward`, to log-probs) and its
`backward`; then `accumulate_grads`, the compute copies' `refresh`, the micro-batches' cutting
(`make_micro_batches`) and `clip_and_step` (gradient norm, optimiser step). A replayed micro-batch
shows only in `run`: its forward and backward are one graph. Each
part records a CUDA event as its call starts and as it returns, and its host time. On the GPU's
timeline a part's span is from the moment the GPU reached its first event to its second: its kernels,
plus any time the GPU idled inside it waiting for the host. The time between one part's end and the next
one's start on the GPU is what the GPU ran or idled outside the wrapped parts ("between"; the parts
inside `run` count in its span and in their own, not in the gaps). Printed and
written: per part, calls, host seconds and GPU-span seconds; the sum of the gaps; the update's wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the suite it builds on
from passes import _section, add_seed_batch_args, seed_sizes_config, synthetic_batch


class Timeline:
    """Wraps callables so that each call records (name, host seconds, start event, end event)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        # (name, host seconds, start event, end event, order of the call's start, calls open around it)
        self.calls: list[tuple[str, float, object, object, int, int]] = []
        self.on = False
        self.started = 0
        self.open = 0

    def event(self) -> object:
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def wrap(self, name: str, fn: Callable) -> Callable:
        def wrapped(*args: object, **kwargs: object) -> object:
            if not self.on:
                return fn(*args, **kwargs)
            order, depth = self.started, self.open
            self.started += 1
            self.open += 1
            start_ev, start = self.event(), time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                self.open -= 1
            self.calls.append((name, time.perf_counter() - start, start_ev, self.event(), order, depth))
            return out

        return wrapped

    def summary(self) -> dict[str, object]:
        parts: dict[str, dict[str, float]] = defaultdict(
            lambda: {"calls": 0, "host_s": 0.0, "gpu_span_s": 0.0}
        )
        between = 0.0
        previous_end = None
        for name, host_s, start_ev, end_ev, _, depth in sorted(self.calls, key=lambda call: call[4]):
            part = parts[name]
            part["calls"] += 1
            part["host_s"] += host_s
            if self.cuda:
                part["gpu_span_s"] += start_ev.elapsed_time(end_ev) / 1e3
                if depth > 0:  # inside another part: its time is in that part's span
                    continue
                if previous_end is not None:
                    between += max(0.0, previous_end.elapsed_time(start_ev) / 1e3)
                previous_end = end_ev
        return {"parts": dict(parts), "gpu_between_parts_s": between}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_seed_batch_args(parser)
    parser.add_argument("--warmup", type=int, default=4, help="updates before the recorded one")
    parser.add_argument("--json", type=Path, default=None)
    args, overrides = parser.parse_known_args(argv)
    from fulcrum.workers import update
    from fulcrum.workers.actor import ActorWorker

    device = torch.device(args.device)
    cfg = seed_sizes_config(args.model, args.prompt_width, args.response, args.mini, overrides, args.micro)
    actor = ActorWorker(_section(cfg, "actor"), device, total_training_steps=100)
    batch = synthetic_batch(args.rows, args.prompt_width, args.response, actor.model.config.vocab_size)
    batch["old_log_probs"], _ = actor.compute_log_prob(batch)
    timeline = Timeline(device)
    forwards = actor.forwards
    forwards.run = timeline.wrap("run", forwards.run)
    actor.fwd_bwd = timeline.wrap("fwd_bwd", actor.fwd_bwd)
    forwards.forward = timeline.wrap("forward", forwards.forward)
    forwards.backward = timeline.wrap("backward", forwards.backward)
    forwards.accumulate_grads = timeline.wrap("accumulate_grads", forwards.accumulate_grads)
    if forwards.compute is not None:
        forwards.compute.refresh = timeline.wrap("refresh", forwards.compute.refresh)
    update.make_micro_batches = timeline.wrap("make_micro_batches", update.make_micro_batches)
    update.clip_and_step = timeline.wrap("clip_and_step", update.clip_and_step)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(args.warmup):
        sync()
        start = time.perf_counter()
        actor.update_policy(batch)
        sync()
        print(f"warm-up update {i + 1}: {time.perf_counter() - start:.3f} s", flush=True)
    timeline.on = True
    first = timeline.event()
    sync()
    start = time.perf_counter()
    actor.update_policy(batch)
    last = timeline.event()
    sync()
    wall = time.perf_counter() - start
    timeline.on = False
    result = {"wall_s": wall, "tokens": int(batch["attention_mask"].sum()), **timeline.summary()}
    if device.type == "cuda":
        result["gpu_first_to_last_s"] = first.elapsed_time(last) / 1e3
        result["device"] = torch.cuda.get_device_name(0)
    print(f"update: {wall:.3f} s wall, {result['tokens']} tokens", flush=True)
    for name, part in result["parts"].items():
        print(
            f"  {name:20s} {part['calls']:4d} calls  host {part['host_s']:.3f} s  GPU span {part['gpu_span_s']:.3f} s",
            flush=True,
        )
    print(f"  GPU between the parts: {result['gpu_between_parts_s']:.3f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
