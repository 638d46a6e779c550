"""Data parallelism in the step: each rank runs its share of the batch, then the ranks exchange results.

With one process these are plain calls. Under torchrun, the step's batch is the same on every rank
(the data loader is seeded alike), so:

- generation: rank r samples its contiguous share of the prompts (`fulcrum.parallel.share_bounds`)
  and the responses are gathered, in prompt order, into the whole batch on every rank;
- the no-gradient passes (old log-probs, reference log-probs, values) run on each rank's share of
  the rows and are gathered likewise;
- scoring, KL in reward and advantages run on the whole batch on every rank (cheap, and batch-wide
  statistics such as GRPO's groups and GAE's whitening stay exactly those of one process);
- the updates still run on the whole batch on every rank (replicated, the same result everywhere)
  until FSDP2 gives each rank its share of each mini-batch.

Prompts for one rank share no sampling noise with another's: rank r samples with seed + r × 7919.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from fulcrum.batch import Batch
from fulcrum.config import FulcrumConfig
from fulcrum.parallel import DistInfo, all_gather_objects, all_gather_rows, current, share_bounds
from fulcrum.rollout import RolloutEngine, RolloutOutput, SamplingParams

SEED_STRIDE = 7919  # a prime: rank r's sampling seed is seed + r × SEED_STRIDE

T = TypeVar("T")


def generate_shares(
    rollout: RolloutEngine, prompts: list[list[int]], params: SamplingParams
) -> RolloutOutput:
    """`rollout.generate(prompts, params)` with each rank generating its share of the prompts; every rank
    returns the whole output (prompt-major, as one process would)."""
    info = current()
    if not info.distributed:
        return rollout.generate(prompts, params)
    start, stop = share_bounds(len(prompts), info.rank, info.world_size)
    seed = None if params.seed is None else params.seed + info.rank * SEED_STRIDE
    out = (
        rollout.generate(prompts[start:stop], replace(params, seed=seed))
        if stop > start
        else RolloutOutput([], [], [], [])
    )
    merged = RolloutOutput([], [], [], [])
    for first, part in all_gather_objects((start, out)):
        merged.token_ids += part.token_ids
        merged.logprobs += part.logprobs
        merged.finish_reasons += part.finish_reasons
        merged.prompt_index += [first + i for i in part.prompt_index]
    return merged


def on_shares(fn: Callable[[Batch], T], batch: Batch) -> T:
    """`fn(batch)` for a pass whose output rows follow the batch's rows (a tensor, or a tuple of tensors
    and Nones): each rank runs its share of the rows; every rank returns the whole (CPU) result."""
    info = current()
    if not info.distributed:
        return fn(batch)
    start, stop = share_bounds(len(batch), info.rank, info.world_size)
    out: Any = fn(batch.select(list(range(start, stop))))
    if isinstance(out, tuple):
        return tuple(None if t is None else all_gather_rows(t) for t in out)  # type: ignore[return-value]
    return all_gather_rows(out)


def startup_line(info: DistInfo, cfg: FulcrumConfig) -> str | None:
    """The summary a distributed run prints first: world size and each rank's share of the batch."""
    if not info.distributed:
        return None
    prompts = int(cfg.data.train_batch_size)
    n = int(cfg.actor_rollout_ref.rollout.n)
    low, high = share_bounds(prompts, info.world_size - 1, info.world_size)
    first = share_bounds(prompts, 0, info.world_size)
    share = f"{high - low}" if first[1] - first[0] == high - low else f"{high - low}-{first[1] - first[0]}"
    return (
        f"world size {info.world_size} ({info.local_world_size} process(es) per machine × {info.nnodes} "
        f"machine(s), {info.backend}): each rank generates {share} of the {prompts} prompts per step "
        f"(× n={n} responses) and runs the log-prob, reference and value passes on its share of the rows; "
        "the actor and critic updates run on the whole batch on every rank (replicated)"
    )
