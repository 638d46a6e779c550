"""Benchmark: each training pass in its steady state, alone and beside CPU-burning neighbours.

    python bench/passes_under_load.py --model .bench/qwen05 [--burn 16] [--repeat 3] [--syncs] \
        [--profile values] [--json out.json] [KEY=VALUE ...]
    python bench/passes_under_load.py --model TINY --device cpu --rows 16 --prompt-width 320 \
        --response 16 --burn 2 --repeat 1   # the script's path on the CPU

An actor and a critic built as `bench/passes.py` builds them (the seed command's sizes: update
micro-batches of 8, log-prob micro-batches of 16, mini-batches of 128) run old log-probs, values, the
critic's update and the actor's update on one synthetic batch: twice each to warm up (compilation, and on
CUDA each bucket's graph captured: the same batch meets the same buckets again), then `--repeat` times
alone and `--repeat` times beside `--burn` processes spinning a Python loop. Unlike a whole step
(`bench/train_step.py run --burn`), no pass here captures or compiles while timed, so what moves is the
host work each micro-batch still has around its replay.

Per pass and load: the wall seconds (median), and the host seconds spent inside the passes' micro-batch
calls (`micro_step`, `forward_micro`: packing, padding, the pinned copies, the replay's launch). A pass
whose host seconds reach its wall seconds waits for the host. `--syncs` lists, per pass, the operations
that made the host wait for the GPU (`torch.cuda.set_sync_debug_mode`) and where they were called;
`--profile PASS` prints cProfile's costliest functions of one run of that pass beside the burners.
The CUDA run keeps torch's CPU threads where `fulcrum.config.device.cap_host_threads` puts a training run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_speed import cpu_burners
from passes import _section, add_seed_batch_args, seed_sizes_config, synthetic_batch


class HostInside:
    """Seconds the host spends inside wrapped calls, and how many calls, since `reset`."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def wrap(self, fn: Callable) -> Callable:
        def wrapped(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return wrapped


def sync_sites(passes: dict[str, Callable[[], object]], sync: Callable[[], None]) -> dict[str, Counter]:
    """Per pass, each synchronising operation's message and the last frames of where it was called."""
    sites: dict[str, Counter] = {}
    current = [""]

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        frames = [f for f in traceback.format_stack(limit=14)[:-2] if "warnings.py" not in f]
        sites.setdefault(current[0], Counter())[str(message)[:80] + "\n" + "".join(frames[-6:])] += 1

    shown = warnings.showwarning
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            for name, fn in passes.items():
                current[0] = name
                fn()
                sync()
            torch.cuda.set_sync_debug_mode(0)
    finally:
        warnings.showwarning = shown
    return sites


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_seed_batch_args(parser)
    parser.add_argument("--burn", type=int, default=16, help="CPU-burning neighbour processes")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--syncs", action="store_true", help="list each pass's host waits (CUDA only)")
    parser.add_argument("--profile", default=None, help="a pass to profile beside the burners")
    parser.add_argument("--json", type=Path, default=None)
    args, overrides = parser.parse_known_args(argv)
    from fulcrum.config.device import cap_host_threads
    from fulcrum.workers import forwards
    from fulcrum.workers.actor import ActorWorker
    from fulcrum.workers.critic import CriticWorker

    device = torch.device(args.device)
    cap_host_threads(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cfg = seed_sizes_config(args.model, args.prompt_width, args.response, args.mini, overrides, args.micro)
    actor = ActorWorker(_section(cfg, "actor"), device, total_training_steps=100)
    critic = CriticWorker(_section(cfg, "critic"), device, total_training_steps=100)
    batch = synthetic_batch(args.rows, args.prompt_width, args.response, actor.model.config.vocab_size)
    batch["old_log_probs"], _ = actor.compute_log_prob(batch)
    inside = HostInside()
    forward_micro = forwards.forward_micro
    forwards.forward_micro = inside.wrap(forward_micro)  # the no-grad passes' micro-batch calls
    try:
        return measure(args, actor, critic, batch, inside, sync)
    finally:
        forwards.forward_micro = forward_micro


def measure(
    args: argparse.Namespace,
    actor: Any,
    critic: Any,
    batch: Any,
    inside: HostInside,
    sync: Callable[[], None],
) -> int:
    """Warm-up, host waits, then each pass alone and loaded; prints and writes the table."""
    device = actor.device
    actor.micro_step = inside.wrap(actor.micro_step)
    critic.micro_step = inside.wrap(critic.micro_step)
    passes: dict[str, Callable[[], object]] = {
        "old_log_prob": lambda: actor.compute_log_prob(batch),
        "values": lambda: critic.compute_values(batch),
        "update_critic": lambda: critic.update_critic(batch),
        "update_actor": lambda: actor.update_policy(batch),
    }

    def timed(fn: Callable[[], object]) -> tuple[float, float]:
        sync()
        inside.reset()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start, inside.seconds

    for name, fn in passes.items():
        warm = [timed(fn)[0] for _ in range(2)]
        print(f"warm-up {name}: {', '.join(f'{x:.3f}' for x in warm)} s", flush=True)
    result: dict[str, object] = {"device": str(device), "threads": torch.get_num_threads(), "passes": {}}
    if args.syncs and device.type == "cuda":
        sites = sync_sites(passes, sync)
        result["syncs"] = {name: sum(c.values()) for name, c in sites.items()}
        for name, counter in sites.items():
            print(f"== host waits in {name}: {sum(counter.values())}")
            for site, n in counter.most_common(4):
                print(f"-- {n}x {site}")
    for burn in (0, args.burn):
        with cpu_burners(burn):
            time.sleep(0.5)  # the burners running
            for name, fn in passes.items():
                runs = [timed(fn) for _ in range(args.repeat)]
                entry = {"wall_s": [w for w, _ in runs], "host_inside_s": [h for _, h in runs]}
                result["passes"].setdefault(name, {})[f"burn{burn}"] = entry  # type: ignore[union-attr]
            if burn and args.profile:
                profile = cProfile.Profile()
                profile.enable()
                passes[args.profile]()
                sync()
                profile.disable()
                text = io.StringIO()
                pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
                print(f"== cProfile of {args.profile} beside {burn} burners\n{text.getvalue()}")
    print(
        f"{'pass':14s} {'alone s':>8s} {'loaded s':>9s} {'ratio':>6s} {'host alone':>11s} {'host loaded':>12s}"
    )
    for name, loads in result["passes"].items():  # type: ignore[union-attr]
        alone, loaded = loads["burn0"], loads[f"burn{args.burn}"]
        a, b = statistics.median(alone["wall_s"]), statistics.median(loaded["wall_s"])
        ha, hb = statistics.median(alone["host_inside_s"]), statistics.median(loaded["host_inside_s"])
        print(f"{name:14s} {a:8.3f} {b:9.3f} {b / a:6.2f} {ha:11.3f} {hb:12.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
