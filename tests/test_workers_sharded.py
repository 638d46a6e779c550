"""Workers under FSDP: every rank runs as many micro-batches as the others, whatever its rows' lengths
(each forward of a sharded model is a collective)."""

from __future__ import annotations

import torch
from helpers_dist import run_ranks

from fulcrum.batch import assemble_batch
from fulcrum.workers.micro_batch import split_to_count


def batch_of(prompt_lengths: list[int], response_lengths: list[int]):
    items = [{"input_ids": list(range(3, 3 + p))} for p in prompt_lengths]
    responses = [list(range(5, 5 + r)) for r in response_lengths]
    return assemble_batch(
        items, responses, [[0.0] * r for r in response_lengths], list(range(len(items))), 16, 16, 0, "u"
    )


def test_split_to_count_halves_the_widest_in_order():
    batch = batch_of([2] * 5, [3] * 5)
    micro = split_to_count([batch.select([0, 1, 2, 3]), batch.select([4])], 4)
    assert [len(m) for m in micro] == [1, 1, 2, 1]
    assert torch.equal(torch.cat([m["prompts"] for m in micro]), batch["prompts"])


def _counts(rank: int, world: int, packed: bool) -> int:
    from fulcrum.parallel.fsdp import shard_model
    from fulcrum.rollout.testing import random_causal_lm
    from fulcrum.workers.micro_batch import make_micro_batches

    model = shard_model(random_causal_lm("qwen2"), torch.device("cpu"))
    # rank 0: long rows (one per micro-batch under the budget), rank 1: short rows (all in one)
    lengths = [16] * 4 if rank == 0 else [2] * 4
    micro, _ = make_micro_batches(batch_of(lengths, lengths), 4, True, 40, "key", packed=packed, model=model)
    assert sum(len(m) for m in micro) == 4
    return len(micro)


def test_every_rank_runs_as_many_micro_batches():
    for packed in (False, True):
        counts = run_ranks(_counts, 2, packed)
        assert counts[0] == counts[1] >= 2
