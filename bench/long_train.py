"""Benchmark: the training passes at 16k tokens a sequence on one GPU, Qwen3-0.6B's shape (random weights):
the old-log-prob pass, the reference pass and the actor update, each at the largest micro-batch the card
holds; peak memory per phase beside `fulcrum doctor`'s estimate for the same configuration, and MFU.

    python bench/long_train.py --out /tmp/long_train --json long_train.json   # one H100 / H200, < 8 minutes
    python bench/long_train.py --smoke --out /tmp/long_train_smoke             # the CPU, tiny shapes, seconds

Batch: bench/passes.py's `synthetic_batch`, `--rows` sequences: prompts of GSM8K-like lengths (70-239
tokens) left-padded to `--prompt-width` 300, responses of `--response` 16,084 real tokens, so 16,154 to
16,323 tokens a sequence (at most 16,384 = prompt width + response), random advantages.

Configuration: bench/passes.py's `seed_sizes_config` with GRPO (no critic), the KL loss (so a reference
model, as GRPO recipes run), gradient checkpointing on, the packed path and the micro-batches' CUDA graphs
as by default, and every pass micro-batched by a token budget (`use_dynamic_bsz`): k_u × 16,384 tokens for
the update (`actor.ppo_max_token_len_per_gpu`), k_f × 16,384 for the old-log-prob and reference passes
(`rollout.log_prob_max_token_len_per_gpu`, `ref.log_prob_max_token_len_per_gpu`). k_u and k_f are the largest
sequence counts up to `--max-seqs` (8) whose phase in doctor's estimate fits `--fill` (0.8) of the device;
mini-batches of k_u sequences, `--rows` = 2·k_u at least (two optimiser steps an update, so the
old-log-prob pass runs, as in a run with several mini-batches).

Phases, in a step's order, after one call of each (the warm step: compilation, the graphs' captures): the
old log-probs (`ActorWorker.compute_log_prob`, with the entropy), the reference's log-probs
(`ReferenceWorker.compute_ref_log_prob`) and the update (`ActorWorker.update_policy`, one epoch). Each phase
empties the allocator's cache, resets the peak statistics, then runs bench/passes.py's `warm_up` (at most
`--warmup-calls`, 2: the warm step ran each pass once) and `--repeat` timed calls (`timed_call`): the median
seconds, tokens/s, and the phase's peaks, `torch.cuda.max_memory_allocated` and `max_memory_reserved`.
Replayed micro-batches run inside the graphs' memory pool, which is reserved, not allocated, outside a
capture: the reserved peak is a warm phase's footprint. A capture first runs its micro-batch eagerly (its
blocks stay cached beside the pool), so the warm step's reserved peak is the run's; doctor's estimate counts
both the pool and a phase's own activations, i.e. that step: the warm step is compared with the estimate's
largest phase, each warm phase with its own (allocated beside reserved).

MFU: the trainer's `estimate_train_flops` (6·N·T + 12·Σℓ²·d·H·L, verl's) over the update's seconds and the
card's dense bf16 peak (`fulcrum.device_facts.device_peak_flops`: H100 and H200 989 TFLOP/s); a forward
pass is a third of it (2·N·T + 4·Σℓ²·d·H·L).

Doctor's estimate: `fulcrum.tools.memory_estimate.estimate` for this configuration on this device, each
phase less the native engine's bf16 weights (the bench runs no engine); its ratio to the measured peak.
After the warm step and each phase, `pools_after`: the GiB reserved in all and in the graphs' shared pool,
beside doctor's pool item (`estimate_pool_gib`).
`--deadline-s` (390, from the plan on; the model is made before): no phase starts after it, and a phase's timed
calls stop there.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from passes import GiB, seed_sizes_config, synthetic_batch, timed_call, warm_up
from train_step import make_model

from fulcrum.config import sections, uses_critic, uses_reference
from fulcrum.device_facts import device_peak_flops
from fulcrum.models.arch import model_shape
from fulcrum.tools.memory_estimate import Estimate, estimate, read_model_shape
from fulcrum.trainer.metrics import estimate_train_flops
from fulcrum.workers.cuda_graphs import pool_reserved_bytes

# The estimate's phase for each measured one.
PHASES = {
    "old_log_prob": "old log-prob forward",
    "ref_log_prob": "reference log-prob forward",
    "update_actor": "actor update",
}
ENGINE_ITEM = "engine weights (bf16)"  # in every training phase of a native-rollout estimate; not held here
POOL_ITEM = "CUDA graphs' memory pool"


def batch_rows(args: argparse.Namespace, k_update: int, k_forward: int) -> int:
    """Sequences in the batch: --rows, at least two update micro-batches and one forward micro-batch."""
    return max(args.rows, 2 * k_update, k_forward)


def config_keys(args: argparse.Namespace, k_update: int, k_forward: int) -> list[str]:
    """The keys over bench/passes.py's seed sizes: GRPO with the KL loss, checkpointing, token budgets of
    k × (prompt width + response) for the update and for the two forwards, mini-batches of k_update."""
    seq = args.prompt_width + args.response
    keys = [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.model.use_remove_padding=True",
        "trainer.n_gpus_per_node=1",  # one process: the estimate counts the micro-batches' CUDA graphs
        f"data.train_batch_size={batch_rows(args, k_update, k_forward)}",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={k_update * seq}",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={k_forward * seq}",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
        f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={k_forward * seq}",
    ]
    if args.smoke:
        keys.append("trainer.device=cpu")
    return [*keys, *args.overrides]


def load(args: argparse.Namespace, k_update: int, k_forward: int) -> Any:
    """The resolved configuration of the passes."""
    keys = config_keys(args, k_update, k_forward)
    return seed_sizes_config(args.model, args.prompt_width, args.response, k_update, keys)


def doctor_estimate(cfg: Any, device_bytes: float, rows: int) -> Estimate:
    """doctor's estimate of this configuration on a device of `device_bytes` (known), `rows` responses."""
    shape = read_model_shape(cfg.actor_rollout_ref.model.path)
    assert shape is not None, f"no readable config.json in {cfg.actor_rollout_ref.model.path}"
    return estimate(cfg, shape, device_bytes, True, uses_critic(cfg), uses_reference(cfg), rows)


def phase_totals(est: Estimate) -> dict[str, float]:
    """Each measured phase's estimated bytes, less the engine's weights (no engine in this bench)."""
    by_name = {p.name: p for p in est.phases}
    return {
        ours: by_name[theirs].total - by_name[theirs].items.get(ENGINE_ITEM, 0.0)
        for ours, theirs in PHASES.items()
        if theirs in by_name
    }


def largest_fitting(args: argparse.Namespace, device_bytes: float) -> tuple[int, int]:
    """(k_update, k_forward): the most sequences a micro-batch, up to --max-seqs, whose estimated update /
    forward phases fit --fill of the device."""
    k_update = k_forward = 1
    for k in range(1, args.max_seqs + 1):
        totals = phase_totals(doctor_estimate(load(args, k, k), device_bytes, 2 * k))
        if totals["update_actor"] <= args.fill * device_bytes:
            k_update = k
        if max(totals["old_log_prob"], totals["ref_log_prob"]) <= args.fill * device_bytes:
            k_forward = k
    return k_update, k_forward


def peaks(gpu: bool) -> dict[str, float | None]:
    """The peak allocated and reserved GiB since the last reset (None off CUDA)."""
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / GiB if gpu else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GiB if gpu else None,
    }


def pools_now(gpu: bool) -> dict[str, float]:
    """GiB reserved now in all, and in the graphs' shared pool (`cuda_graphs.pool_reserved_bytes`): what
    doctor's pool item is checked against, and what of the pool live tensors hold (empty off CUDA)."""
    if not gpu:
        return {}
    return {
        "reserved_gib": torch.cuda.memory_reserved() / GiB,
        "graphs_pool_gib": pool_reserved_bytes() / GiB,
        "graphs_pool_allocated_gib": pool_reserved_bytes("allocated_size") / GiB,
    }


def against(row: dict[str, Any], estimate_bytes: float) -> None:
    """The estimate beside a row's measured peaks, and its ratio to each."""
    row["estimate_gib"] = estimate_bytes / GiB
    for kind in ("reserved", "allocated"):
        measured = row[f"peak_{kind}_gib"]
        row[f"estimate_over_{kind}"] = row["estimate_gib"] / measured if measured else None


def measure_phase(
    name: str, fn: Callable[[], object], args: argparse.Namespace, started: float, gpu: bool
) -> dict[str, Any]:
    """`fn` warmed up (passes.warm_up) then timed --repeat times, the cache emptied and the peaks reset at
    the phase's start."""
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    print(f"{name}:", flush=True)
    warm_up(fn, args.warmup_s, max_warmup=args.warmup_calls)
    times = []
    for _ in range(args.repeat):
        if times and time.perf_counter() - started + times[-1] > args.deadline_s:
            break
        times.append(timed_call(fn))
    print(f"  timed calls {', '.join(f'{t:.3f}' for t in times)} s", flush=True)
    return {
        "seconds": statistics.median(times),
        "calls": [round(t, 4) for t in times],
        **peaks(gpu),
        "pools_after": pools_now(gpu),
    }


def run(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Plan the micro-batches from the estimate, run the warm step and the three phases; `save` gets the
    summary as it grows (a run cut short keeps what it measured)."""
    from fulcrum.workers.actor import ActorWorker, ReferenceWorker

    started = time.perf_counter()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    device_bytes = torch.cuda.get_device_properties(device).total_memory if gpu else args.device_gib * GiB
    k_update, k_forward = largest_fitting(args, device_bytes)
    cfg = load(args, k_update, k_forward)
    args.rows = batch_rows(args, k_update, k_forward)
    est = doctor_estimate(cfg, device_bytes, args.rows)
    totals = phase_totals(est)
    pool_item = est.phases[0].items.get(POOL_ITEM, 0.0)  # resident: the same in every phase
    print(f"micro-batches: update {k_update} sequences, forwards {k_forward}; {args.rows} rows", flush=True)
    summary: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if gpu else "cpu",
        "torch": torch.__version__,
        "rows": args.rows,
        "micro_batch_sequences": {"update": k_update, "forwards": k_forward},
        "keys": config_keys(args, k_update, k_forward),
        "estimate_gib": {name: total / GiB for name, total in totals.items()},
        "estimate_pool_gib": pool_item / GiB,
        "phases": {},
    }
    save(summary)
    actor = ActorWorker(sections.actor_section(cfg), device, total_training_steps=100)
    ref = ReferenceWorker(sections.reference_section(cfg), device)
    batch = synthetic_batch(args.rows, args.prompt_width, args.response, actor.model.config.vocab_size)
    lengths = batch["attention_mask"].sum(-1).tolist()
    tokens = int(sum(lengths))
    summary |= {
        "model_shape": str(model_shape(actor.model.config)),
        "tokens": tokens,
        "sequence_tokens": {"min": min(lengths), "max": max(lengths)},
    }
    calls = {
        "old_log_prob": lambda: actor.compute_log_prob(batch),
        "ref_log_prob": lambda: ref.compute_ref_log_prob(batch),
        "update_actor": lambda: actor.update_policy(batch),
    }
    # The warm step: each pass once, in a step's order; it compiles and captures the graphs: each captured
    # micro-batch runs eagerly, then inside the graphs' pool, so this is the run's peak (the estimate's).
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    tick = time.perf_counter()
    try:
        batch["old_log_probs"], _ = actor.compute_log_prob(batch)
        batch["ref_log_prob"] = ref.compute_ref_log_prob(batch)
        actor.update_policy(batch)
    except torch.OutOfMemoryError as err:
        summary["warm_step"] = {"error": f"out of memory: {str(err).splitlines()[0]}", **peaks(gpu)}
        save(summary)
        return summary
    summary["warm_step"] = {
        "seconds": round(time.perf_counter() - tick, 1),
        **peaks(gpu),
        "pools_after": pools_now(gpu),
    }
    against(summary["warm_step"], max(totals.values()))
    save(summary)
    flops = estimate_train_flops(actor.model.config, lengths)
    peak = device_peak_flops(device)
    for name, fn in calls.items():
        if time.perf_counter() - started > args.deadline_s:
            summary["phases"][name] = {"skipped": "deadline"}
            continue
        try:
            row = measure_phase(name, fn, args, started, gpu)
        except torch.OutOfMemoryError as err:
            summary["phases"][name] = {"error": f"out of memory: {str(err).splitlines()[0]}", **peaks(gpu)}
            continue
        row["tokens_per_s"] = tokens / row["seconds"]
        pass_flops = flops if name == "update_actor" else flops / 3
        row["mfu"] = pass_flops / row["seconds"] / peak if peak else None
        against(row, totals[name])
        summary["phases"][name] = row
        print(f"  {json.dumps(row)}", flush=True)
        save(summary)
    summary["elapsed_s"] = round(time.perf_counter() - started, 1)
    return summary


def table(summary: dict[str, Any]) -> str:
    """A markdown table of the phases."""

    def cell(value: float | None, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    lines = [
        "| phase | s | tok/s | MFU | peak allocated GiB | peak reserved GiB | doctor GiB | doctor / reserved |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    warm = summary.get("warm_step", {})
    if "estimate_gib" in warm:
        lines.append(
            f"| warm step (compiles, captures) | {warm['seconds']:.1f} | | | "
            f"{cell(warm['peak_allocated_gib'], '.2f')} | {cell(warm['peak_reserved_gib'], '.2f')} | "
            f"{warm['estimate_gib']:.2f} (peak phase) | {cell(warm['estimate_over_reserved'], '.3f')} |"
        )
    for name, r in summary["phases"].items():
        if "seconds" not in r:
            lines.append(f"| {name} | {r.get('skipped') or r.get('error')} |||||||")
            continue
        lines.append(
            f"| {name} | {r['seconds']:.3f} | {r['tokens_per_s']:,.0f} | {cell(r['mfu'], '.1%')} | "
            f"{cell(r['peak_allocated_gib'], '.2f')} | {cell(r['peak_reserved_gib'], '.2f')} | "
            f"{r['estimate_gib']:.2f} | {cell(r['estimate_over_reserved'], '.3f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the random model")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=0, help="sequences in the batch (at least 2 x k_update)")
    parser.add_argument("--prompt-width", type=int, default=300)
    parser.add_argument("--response", type=int, default=16084)
    parser.add_argument("--max-seqs", type=int, default=8, help="the most sequences a micro-batch")
    parser.add_argument(
        "--fill", type=float, default=0.8, help="share of the device an estimated phase may take"
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--warmup-s", type=float, default=5.0, help="passes.warm_up's seconds after the first"
    )
    parser.add_argument(
        "--warmup-calls", type=int, default=2, help="passes.warm_up's most calls (after the warm step's one)"
    )
    parser.add_argument("--deadline-s", type=float, default=390.0, help="no phase starts after it")
    parser.add_argument("--device-gib", type=float, default=80.0, help="the device the CPU smoke plans for")
    parser.add_argument("--smoke", action="store_true", help="the CPU, the shape's tiny family, 64 tokens")
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE configuration overrides")
    args = parser.parse_args(argv)
    captures = logging.getLogger("fulcrum.workers.cuda_graphs")  # a line a capture, with the pool after it
    captures.setLevel(logging.INFO)
    if not captures.handlers:
        captures.addHandler(logging.StreamHandler(sys.stdout))
    if args.smoke:
        args.device, args.response, args.max_seqs, args.repeat, args.warmup_s = "cpu", 64, 2, 2, 0.0
        torch.set_num_threads(1)
    args.model = make_model(args.out / "model", shape="qwen3-0.6b", tiny=args.smoke)

    def save(summary: dict[str, Any]) -> None:
        if args.json:
            args.json.write_text(json.dumps(summary, indent=1))

    summary = run(args, save)
    save(summary)
    print(table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
