"""One GPU, two ways to train in bf16 from float32 masters: fulcrum's `ComputeWeights` (bf16 copies made
once a pass, the micro-batches replayed as CUDA graphs) against FSDP2's mixed-precision policy
(`fully_shard` with `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, each layer cast in its
pre-forward hook, the micro-batches compiled inside the hooks and run eagerly between them), on a group of
one rank. If FSDP2's policy kept up on one rank, one precision path could serve every layout.

    python bench/tools/precision_paths.py --model DIR [--rows 512] [--mini 128] [--json OUT.json]
    python bench/tools/precision_paths.py --model DIR --device cpu --rows 8 --mini 4 --micro 2 --response 8 \
        --repeat 1 --warmup-s 0   # the smoke run: both set-ups build and update on the CPU

Set-ups, each in its own process (its own compilations and memory): `compute_weights` (the default of one
process), `compute_weights_eager` (the same, `actor_rollout_ref.actor.cuda_graphs=False`: what the graphs
are worth) and `fsdp2` (the actor placed as on many ranks, `fsdp_config.fsdp_size=2`, over a process group
of one). Per set-up: the old log-prob pass and the actor update at the seed command's sizes
(bench/passes.py's synthetic batch), seconds (median after warm-up), tokens/s and peak memory; then
each one's ratio to `compute_weights`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

SETUPS: dict[str, list[str]] = {
    "compute_weights": [],
    "compute_weights_eager": ["actor_rollout_ref.actor.cuda_graphs=False"],
    "fsdp2": ["actor_rollout_ref.actor.fsdp_config.fsdp_size=2"],
}


def one_rank_group(device: str) -> None:
    """A process group of this process alone, as torchrun would make for `--nproc_per_node 1`."""
    import torch.distributed as dist

    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1
    )


def place_as_distributed() -> list[str]:
    """Make the workers lay models out as they do on many ranks (`place_on_ranks` reads `current()`):
    a world of one that reports itself distributed, so `fsdp_size` chooses the layout. Returns the list
    that each `shard_model` call appends its model's class name to (the proof that FSDP2 placed it)."""
    from fulcrum.parallel import fsdp
    from fulcrum.parallel.group import DistInfo
    from fulcrum.workers import placement

    class OneRankGroup(DistInfo):
        @property
        def distributed(self) -> bool:
            return True

    placement.current = OneRankGroup  # type: ignore[assignment]  # the module's own reference
    sharded: list[str] = []
    shard_model = fsdp.shard_model

    def recording_shard_model(model: object, *args: object, **kwargs: object) -> object:
        sharded.append(type(model).__name__)
        return shard_model(model, *args, **kwargs)

    fsdp.shard_model = recording_shard_model  # place_on_ranks imports it at its call
    return sharded


def run_setup(args: argparse.Namespace, setup: str, overrides: list[str]) -> dict:
    """The passes of one set-up in this process (the child)."""
    import torch
    from passes import bench_actor, seed_sizes_config

    sharded: list[str] = []
    if setup == "fsdp2":
        one_rank_group(args.device)
        sharded = place_as_distributed()
    device = torch.device(args.device)
    cfg = seed_sizes_config(
        args.model,
        args.prompt_width,
        args.response,
        args.mini,
        [*SETUPS[setup], *overrides, f"trainer.device={args.device}"],
        micro=args.micro,
    )
    results: dict[str, dict[str, float]] = {}
    args.label, args.ab, args.profile = setup, None, None
    bench_actor(cfg, device, args, ["log_prob", "update_actor"], results)
    if setup == "fsdp2" and not sharded:
        raise SystemExit(
            "fsdp2: the actor was not placed with FSDP2 (this tree chooses its layout otherwise)"
        )
    return results


def ratios(results: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Each set-up's seconds over `compute_weights`' seconds, pass by pass (above 1: slower)."""
    base = results["compute_weights"]
    return {
        setup: {name: row["seconds"] / base[name]["seconds"] for name, row in passes.items()}
        for setup, passes in results.items()
    }


def main(argv: list[str] | None = None) -> int:
    from passes import add_seed_batch_args

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_seed_batch_args(parser)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warmup-s", type=float, default=15.0)
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args(argv)
    if args.child:
        print("RESULT " + json.dumps(run_setup(args, args.child, overrides)), flush=True)
        return 0
    results: dict[str, dict] = {}
    for setup in args.setups.split(","):
        command = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--child", setup]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            print(done.stdout[-3000:], done.stderr[-6000:], sep="\n", file=sys.stderr)
            raise SystemExit(f"{setup}: exit {done.returncode}")
        results[setup] = json.loads(lines[-1][len("RESULT ") :])
        print(setup, json.dumps(results[setup]), flush=True)
    summary = {"results": results}
    if "compute_weights" in results:
        summary["seconds_over_compute_weights"] = ratios(results)
        print(json.dumps(summary["seconds_over_compute_weights"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
