"""Benchmark: the host's time to cut one update's micro-batches (`Batch.select`), on the CPU.

    python bench/micro_batch_host.py [--rows 512] [--mini 128] [--micro 8] [--repeats 7] [--json out.json]

An update (`fulcrum.workers.update.ppo_update`) shuffles the batch, splits it into mini-batches, and cuts
each into packed micro-batches before it runs them: every cut copies the rows of every tensor of the
batch. This builds a seed-sized batch (512 rows, prompts of 70–239 tokens left-padded to 512, 256 response
tokens; the twelve tensors an update's batch carries) and times that cutting for one update, with rows
taken by `index_select` (what `Batch.select` does) and by advanced indexing (`tensor[index]`, what it did),
alternating, in one process; the median of --repeats each. Host work only: while it runs the GPU waits.
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


def cut_update(batch: Batch, mini: int, micro: int, generator: torch.Generator) -> int:
    """The cutting `ppo_update` does for one epoch; the number of micro-batches."""
    count = 0
    for part in batch.select(torch.randperm(len(batch), generator=generator)).split(mini):
        micro_batches, _ = make_micro_batches(
            part.select(list(range(len(part)))), micro, False, None, "micro", packed=True
        )
        count += len(micro_batches)
    return count


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
    selects = {"index_select": Batch.select, "advanced_indexing": advanced_indexing_select}
    times: dict[str, list[float]] = {name: [] for name in selects}
    count = 0
    try:
        for _ in range(args.repeats + 1):  # the first round warms up
            for name, select in selects.items():
                Batch.select = select  # type: ignore[method-assign]
                start = time.perf_counter()
                count = cut_update(batch, args.mini, args.micro, generator)
                times[name].append((time.perf_counter() - start) * 1e3)
    finally:
        Batch.select = selects["index_select"]  # type: ignore[method-assign]
    medians = {name: round(statistics.median(values[1:]), 2) for name, values in times.items()}
    summary = {
        "rows": args.rows,
        "micro_batches": count,
        "torch_threads": torch.get_num_threads(),
        "median_ms": medians,
        "ratio": round(medians["advanced_indexing"] / medians["index_select"], 2),
    }
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
