"""Benchmark: the longest sequence whose actor update fits at one sequence per micro-batch, with Ulysses
sequence parallelism of --sp, and the update's tok/s/GPU at each length tried.

    python bench/train_step.py make-model --out .bench/qwen05      # once (Qwen2.5-0.5B-shaped, random)
    torchrun --nproc_per_node=2 bench/sequence_parallel.py --model .bench/qwen05 --sp 1 --out sp1.json
    torchrun --nproc_per_node=2 bench/sequence_parallel.py --model .bench/qwen05 --sp 2 --out sp2.json

Each rank group (sp ranks) takes one sequence of L tokens (a prompt of 64, the rest response) per
micro-batch: the packed forward, the log-prob loss's backward and an AdamW step of the FSDP2-sharded
actor, with gradient checkpointing and compiled layers as the trainer runs them. L doubles from --first-length
until an update runs out of device memory on any rank; each line records L, the peak memory and the
tok/s/GPU of the warm updates. On the CPU (gloo) it runs too, for a smoke test with a tiny model.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from fulcrum.batch import Batch
from fulcrum.config.schema import FSDPConfig
from fulcrum.models.load import load_causal_lm
from fulcrum.parallel import current, init_distributed, max_over_ranks
from fulcrum.workers.forwards import LogProbHead, ModelForwards
from fulcrum.workers.placement import place_on_ranks

PROMPT = 64
KEY = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"


def one_sequence(length: int, vocab: int, seed: int) -> Batch:
    """One row: a prompt of PROMPT tokens and a response of length - PROMPT, no padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, length), generator=g)
    response = length - PROMPT
    return Batch(
        {
            "prompts": ids[:, :PROMPT],
            "responses": ids[:, PROMPT:],
            "input_ids": ids,
            "attention_mask": torch.ones(1, length, dtype=torch.long),
            "position_ids": torch.arange(length)[None],
            "response_mask": torch.ones(1, response, dtype=torch.long),
        }
    )


def update_seconds(
    forwards: ModelForwards, optimizer: torch.optim.Optimizer, mb: Batch, device: torch.device
) -> float:
    """One micro-batch's forward, backward and optimiser step, timed after the device finishes."""
    start = time.perf_counter()
    with forwards.active():
        (logp,) = forwards.forward(forwards.inputs(mb, []), LogProbHead(1.0))  # (1, R)
        forwards.backward(-logp.sum() / logp.numel())
        forwards.accumulate_grads()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--first-length", type=int, default=4096)
    parser.add_argument("--last-length", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=3, help="warm updates timed per length (after one)")
    parser.add_argument("--out", default=None, help="JSON lines, one per length")
    args = parser.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    init_distributed(device.type)
    info = current()
    model = load_causal_lm(args.model, device, True).train()
    place_on_ranks(model, device, FSDPConfig(), "actor_rollout_ref.actor")
    forwards = ModelForwards(
        model, device, True, "actor", use_torch_compile=True, sp_size=args.sp, sp_key=KEY
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7)
    vocab = int(model.config.vocab_size)
    rows = []
    length = args.first_length
    while length <= args.last_length:
        mb = one_sequence(length, vocab, seed=info.rank // args.sp)  # one sequence per group
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            update_seconds(forwards, optimizer, mb, device)  # warm: compile, allocator
            seconds = min(update_seconds(forwards, optimizer, mb, device) for _ in range(args.repeats))
            failed = 0
        except torch.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            failed = 1
        if max_over_ranks(failed):  # every rank stops together (the next update is collective)
            break
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        groups = info.world_size // args.sp
        row = {
            "sp": args.sp,
            "world": info.world_size,
            "length": length,
            "peak_gib": round(peak, 2),
            "update_s": round(seconds, 4),
            "tok_s_per_gpu": round(groups * length / seconds / info.world_size, 1),
        }
        rows.append(row)
        if info.is_main:
            print(json.dumps(row), flush=True)
        length *= 2
    if info.is_main and args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
