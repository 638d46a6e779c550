"""Data parallelism in the step: each rank runs its share of the batch, then the ranks exchange results.

With one process these are plain calls. Under torchrun, the step's batch is the same on every rank
(the data loader is seeded alike), so:

- generation: engine g (rank g, or ranks g·t .. g·t+t-1 under tensor parallelism of size t) samples
  its contiguous share of the prompts (`fulcrum.parallel.share_bounds`) and the responses are
  gathered, in prompt order, into the whole batch on every rank;
- the no-gradient passes (old log-probs, reference log-probs, values) run on each rank's share of
  the rows and are gathered likewise;
- scoring, KL in reward and advantages run on the whole batch on every rank (cheap, and batch-wide
  statistics such as GRPO's groups and GAE's whitening stay exactly those of one process);
- the actor, critic and reference models are replicated on every rank or sharded by FSDP2
  (fulcrum.parallel.layout chooses, from fsdp_size and the model's size); in the
  updates each rank takes its share of every mini-batch and the gradients are summed over ranks,
  each rank's loss being its share of the mini-batch loss (the workers do this).

Engines share no sampling noise: engine g samples with seed + g × 7919.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from fulcrum.batch import Batch
from fulcrum.config import FulcrumConfig
from fulcrum.config.validate import sp_roles
from fulcrum.parallel import DistInfo, all_gather_objects, all_gather_rows, current, share_bounds
from fulcrum.rollout import RolloutEngine, RolloutOutput, SamplingParams
from fulcrum.rollout.budgets import generate_budgeted

SEED_STRIDE = 7919  # a prime: engine g's sampling seed is seed + g × SEED_STRIDE

T = TypeVar("T")
R = TypeVar("R")


def engine_tp_size(rollout: RolloutEngine) -> int:
    """How many ranks run one engine together (tensor parallelism); 1 for one engine per rank."""
    tp = getattr(rollout, "tp", None)
    return int(getattr(tp, "size", 1))


def generate_shares(
    rollout: RolloutEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    budgets: list[int] | None = None,
) -> RolloutOutput:
    """`rollout.generate(prompts, params)` with each engine generating its share of the prompts; every rank
    returns the whole output (prompt-major, as one process would). `budgets`: one response budget per
    prompt (fulcrum.rollout.budgets).

    The engines are data-parallel: with tensor parallelism of size t, ranks g·t .. g·t+t-1 form engine
    g, generate the same share together, and only the first of them hands its output on.
    """
    info = current()
    if not info.distributed:
        return generate_budgeted(rollout, prompts, params, budgets)
    tp_size = engine_tp_size(rollout)
    engine, engines = info.rank // tp_size, info.world_size // tp_size
    start, stop = share_bounds(len(prompts), engine, engines)
    seed = None if params.seed is None else params.seed + engine * SEED_STRIDE
    out = (
        generate_budgeted(
            rollout,
            prompts[start:stop],
            replace(params, seed=seed),
            None if budgets is None else budgets[start:stop],
        )
        if stop > start
        else RolloutOutput([], [], [], [])
    )
    if info.rank % tp_size:  # the engine's first rank sends its (identical) output
        out = RolloutOutput([], [], [], [])
    merged = RolloutOutput([], [], [], [])
    for first, part in all_gather_objects((start, out)):
        merged.token_ids += part.token_ids
        merged.logprobs += part.logprobs
        merged.finish_reasons += part.finish_reasons
        merged.prompt_index += [first + i for i in part.prompt_index]
    return merged


def map_shares(
    rollout: RolloutEngine,
    fn: Callable[[list[T], SamplingParams, int], list[R]],
    items: list[T],
    params: SamplingParams,
) -> list[R]:
    """`fn(items, params, 0)` with each engine running its contiguous share of `items` (`fn` gets the
    share, the engine's seed and the share's first index); every rank returns every result, in order.

    For rollouts that are not one `generate` call (multi-turn conversations). One engine per rank only:
    tensor-parallel ranks must step their engine in lockstep, and conversations whose tools answer at
    different times on different ranks would not.
    """
    info = current()
    if not info.distributed:
        return fn(items, params, 0)
    if engine_tp_size(rollout) > 1:
        raise ValueError(
            "actor_rollout_ref.rollout.multi_turn.enable=True runs one engine per process: set "
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1"
        )
    start, stop = share_bounds(len(items), info.rank, info.world_size)
    seed = None if params.seed is None else params.seed + info.rank * SEED_STRIDE
    out = fn(items[start:stop], replace(params, seed=seed), start) if stop > start else []
    return [result for part in all_gather_objects(out) for result in part]


def on_shares(fn: Callable[[Batch], T], batch: Batch, sp_size: int = 1) -> T:
    """`fn(batch)` for a pass whose output rows follow the batch's rows (a tensor, or a tuple of tensors
    and Nones): each rank runs its share of the rows; every rank returns the whole (CPU) result. With
    sequence parallelism of `sp_size`, each group of `sp_size` ranks runs one share together and only
    its first rank hands the (identical) result on."""
    info = current()
    if not info.distributed:
        return fn(batch)
    start, stop = share_bounds(len(batch), info.rank // sp_size, info.world_size // sp_size)
    out: Any = fn(batch.select(list(range(start, stop))))
    if isinstance(out, tuple):
        return tuple(None if t is None else all_gather_rows(t, sp_size) for t in out)  # type: ignore[return-value]
    return all_gather_rows(out, sp_size)


def share_text(total: int, parts: int) -> str:
    """Sizes of the shares of `total` over `parts`: "4", or "3-4" when they differ by one."""
    sizes = sorted({stop - start for start, stop in (share_bounds(total, r, parts) for r in (0, parts - 1))})
    return "-".join(map(str, sizes))


def startup_line(info: DistInfo, cfg: FulcrumConfig, tp_size: int = 1) -> str | None:
    """The summary a distributed run prints first: world size and each rank's share of the batch."""
    if not info.distributed:
        return None
    prompts = int(cfg.data.train_batch_size)
    n = int(cfg.actor_rollout_ref.rollout.n)
    responses, mini = prompts * n, int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size) * n
    engines = info.world_size // tp_size
    who = (
        "each rank generates" if tp_size == 1 else f"each engine of {tp_size} tensor-parallel ranks generates"
    )
    return (
        f"world size {info.world_size} ({info.local_world_size} process(es) per machine × {info.nnodes} "
        f"machine(s), {info.backend}): {who} {share_text(prompts, engines)} of the {prompts} prompts per step; "
        f"each rank runs the log-prob, reference and value passes on {share_text(responses, info.world_size)} "
        f"of the {responses} responses, and {share_text(mini, info.world_size)} of every mini-batch of {mini} in the "
        "updates (each model replicated or FSDP2-sharded by its size, fsdp_size; gradients summed)"
        + sequence_parallel_text(cfg, info.world_size)
    )


def sequence_parallel_text(cfg: FulcrumConfig, world: int) -> str:
    """What Ulysses sequence parallelism changes in the shares above ("" without it)."""
    parts = [
        f"{key.rsplit('.', 2)[-2]} in {world // sp} group(s) of {sp}"
        for key, sp, _, _ in sp_roles(cfg)
        if sp > 1
    ]
    if not parts:
        return ""
    return (
        f"; sequence parallelism: {', '.join(parts)} ranks, each group sharing one share of the rows and "
        "splitting every micro-batch's tokens"
    )
