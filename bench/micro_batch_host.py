"""Benchmark: the host's time to cut one update's micro-batches (`Batch.select`), on the CPU.

    python bench/micro_batch_host.py [--rows 512] [--mini 128] [--micro 8] [--repeats 7] [--json out.json]

An update (`fulcrum.workers.update.ppo_update`) shuffles the batch, splits it into mini-batches, and cuts
each into packed micro-batches before it runs them: every cut copies the rows of every tensor of the
batch. This builds a seed-sized batch (512 rows, prompts of 70–239 tokens left-padded to 512, 256 response
tokens; the twelve tensors an update's batch carries) and times that cutting for one epoch three ways,
alternating, in one process (the median of --repeats each): rows taken by advanced indexing
(`tensor[index]`) or by `index_select` (what `Batch.select` does now), through four copies (the shuffled
batch, its mini-batches, the rank's share, the micro-batches: how `ppo_update` cut) or two (the share
taken from the batch at once, `mini_batch_shares`, then the micro-batches: how it cuts now). Host work
only: while it runs the GPU waits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fulcrum.batch import Batch
from fulcrum.workers.micro_batch import make_micro_batches
from fulcrum.workers.update import mini_batch_shares

PROMPT, RESPONSE = 512, 256


def seed_batch(rows: int, generator: torch.Generator) -> Batch:
    """`rows` samples laid out as the trainer's batch at the update: ids, masks, positions, and the
    per-token float tensors the stages add."""
    lengths = torch.randint(70, 240, (rows,), generator=generator)
    mask = (torch.arange(PROMPT + RESPONSE) >= PROMPT - lengths[:, None]).long()
    tensors = {
        "input_ids": torch.randint(0, 150_000, (rows, PROMPT + RESPONSE), generator=generator),
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "prompts": torch.randint(0, 150_000, (rows, PROMPT), generator=generator),
        "responses": torch.randint(0, 150_000, (rows, RESPONSE), generator=generator),
        "response_mask": torch.ones(rows, RESPONSE),
    }
    for key in ("old_log_probs", "ref_log_prob", "advantages", "returns", "values", "token_level_rewards"):
        tensors[key] = torch.randn(rows, RESPONSE, generator=generator)
    return Batch(tensors, {"uid": [str(i) for i in range(rows)]})


def cut_update(batch: Batch, mini: int, micro: int, generator: torch.Generator, composed: bool) -> int:
    """One epoch's cutting, as `ppo_update` does it (`composed`: each mini-batch's share taken from the
    batch in one copy, `mini_batch_shares`) or as it did (the shuffled batch, its mini-batches and the
    share copied one after the other); the number of micro-batches."""
    order = torch.randperm(len(batch), generator=generator)
    if composed:
        shares = [share for _, share in mini_batch_shares(batch, order, mini)]
    else:
        shares = [part.select(list(range(len(part)))) for part in batch.select(order).split(mini)]
    return sum(
        len(make_micro_batches(share, micro, False, None, "micro", packed=True)[0]) for share in shares
    )


def advanced_indexing_select(self: Batch, index: torch.Tensor | list[int]) -> Batch:
    idx = torch.as_tensor(index, dtype=torch.long)
    idx_list = idx.tolist()
    return Batch(
        {k: v[idx.to(v.device)] for k, v in self.tensors.items()},
        {k: [v[i] for i in idx_list] for k, v in self.non_tensors.items()},
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--mini", type=int, default=128)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    batch = seed_batch(args.rows, generator)
    variants = {  # (how a row is taken, whether the copies are composed)
        "advanced_indexing, copied four times": (advanced_indexing_select, False),
        "index_select, copied four times": (Batch.select, False),
        "index_select, copied twice (ppo_update)": (Batch.select, True),
    }
    kept = Batch.select
    times: dict[str, list[float]] = {name: [] for name in variants}
    count = 0
    try:
        for _ in range(args.repeats + 1):  # the first round warms up
            for name, (select, composed) in variants.items():
                Batch.select = select  # type: ignore[method-assign]
                start = time.perf_counter()
                count = cut_update(batch, args.mini, args.micro, generator, composed)
                times[name].append((time.perf_counter() - start) * 1e3)
    finally:
        Batch.select = kept  # type: ignore[method-assign]
    medians = {name: round(statistics.median(values[1:]), 2) for name, values in times.items()}
    summary = {
        "rows": args.rows,
        "micro_batches": count,
        "torch_threads": torch.get_num_threads(),
        "median_ms": medians,
        "ratio_to_first": {name: round(medians[next(iter(medians))] / ms, 2) for name, ms in medians.items()},
    }
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
