"""The update loop every trained model runs (actor and critic): ppo_epochs × shuffled mini-batches ×
micro-batches, gradients accumulated over the micro-batches, one clipped optimiser step per mini-batch.

A worker gives its step on one micro-batch (`Trainable.fwd_bwd`: forward, loss, backward, from the
micro-batch's device inputs alone); everything else — shuffling, splitting, this rank's share, how the
step runs (`ModelForwards.run`), compute weights, grad clip, LR schedule, metric reduction — is here once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.optim.lr_scheduler import LRScheduler

from fulcrum.batch import Batch
from fulcrum.parallel import all_gather_rows, rank_rows, reduce_metrics
from fulcrum.workers.forwards import ModelForwards
from fulcrum.workers.micro_batch import MicroInputs, make_micro_batches
from fulcrum.workers.optim import clip_and_step, warn_skipped_steps
from fulcrum.workers.placement import Placement
from fulcrum.workers.state_parking import OptimizerStateParking

# Metrics that are a micro-batch's share of the mini-batch loss: summed per mini-batch (and over ranks).
LOSS_SHARES = frozenset({"actor/pg_loss", "actor/kl_loss", "critic/vf_loss"})


@dataclass(frozen=True)
class UpdatePlan:
    """How one update walks a batch."""

    role: str  # "actor" or "critic": the metric prefix
    ppo_epochs: int
    mini_batch_size: int  # responses per optimiser step
    micro_batch_size: int | None  # responses per forward/backward (None with use_dynamic_bsz)
    use_dynamic_bsz: bool
    max_token_len: int | None  # tokens per micro-batch with use_dynamic_bsz
    micro_batch_key: str  # the configuration key of micro_batch_size, for error messages
    grad_clip: float
    seed: int  # trainer.seed (per role): the shuffle


Metrics = dict[str, torch.Tensor | float]


@dataclass(frozen=True)
class Step:
    """What an update's micro-batches run: the worker's `fwd_bwd(inputs, *static)`, reading the batch's
    (B, R) columns `keys`, giving `per_row` tensors (B, R) besides its metrics; `device_only`: it reads no
    value on the host (so it can be replayed)."""

    keys: list[str]
    static: tuple[object, ...] = ()
    per_row: int = 0
    device_only: bool = True


class Trainable(Protocol):
    """A worker the loop can update: its model's forwards, optimiser, schedule and placement, its plan,
    and its step on one micro-batch: forward, loss, backward from the micro-batch's inputs (the
    mini-batch's `agg_loss` counts among them); its detached metrics back, and per-row tensors (B, R)
    the update returns in the batch's row order."""

    forwards: ModelForwards
    optimizer: torch.optim.Optimizer
    lr_scheduler: LRScheduler
    placement: Placement
    plan: UpdatePlan
    parking: OptimizerStateParking | None  # the other models' optimiser state off the device meanwhile

    def fwd_bwd(self, inputs: MicroInputs, *static: object) -> tuple[Metrics, tuple[torch.Tensor, ...]]: ...


def one_optimizer_step(plan: UpdatePlan, rows: int) -> bool:
    """An update of `rows` responses takes one optimiser step (one epoch, one mini-batch): it is strictly
    on-policy, its forward sees the weights the batch was scored under."""
    return plan.ppo_epochs == 1 and rows <= plan.mini_batch_size


def ppo_update(
    worker: Trainable, batch: Batch, global_step: int, step: Step
) -> tuple[dict[str, float], list[torch.Tensor]]:
    """One update over `batch` running `step`; returns the role's metrics (verl's reduction) and the
    per-row tensors the step gave, (B, R) each in the batch's row order, float32 on the CPU (every row,
    gathered from every rank), from the last epoch's forwards.

    The shuffle is seeded by (seed, global_step) so a resumed run repeats it exactly. Each micro-batch's
    loss is its share of the mini-batch loss (`global_agg_kwargs`), so the gradient does not depend on
    how the mini-batch is cut. Loss metrics are summed per mini-batch, the others averaged over
    micro-batches; grad_norm is per mini-batch; each then averaged over the update.
    """
    forwards, optimizer, plan = worker.forwards, worker.optimizer, worker.plan
    forwards.model.train()
    if worker.parking is not None:  # the other models' moments out, this one's back, beside the forwards
        worker.parking.activate(optimizer)
    metrics: dict[str, list[torch.Tensor | float]] = defaultdict(list)
    generator = torch.Generator().manual_seed(plan.seed * 1_000_003 + global_step)
    for _ in range(plan.ppo_epochs):
        order = torch.randperm(len(batch), generator=generator)
        # (rows of the batch, per-row tensors); an empty first entry: a rank whose share is empty still
        # has something to gather.
        empty = torch.zeros(0, batch.response_length, device=forwards.device)
        given = [(torch.zeros(0, dtype=torch.long), (empty,) * step.per_row)]
        for agg, rows, share in mini_batch_shares(batch, order, plan.mini_batch_size, forwards.sp_size):
            micro, grouped = make_micro_batches(
                share,
                plan.micro_batch_size,
                plan.use_dynamic_bsz,
                plan.max_token_len,
                plan.micro_batch_key,
                packed=forwards.packed,
                model=forwards.model,
            )
            optimizer.zero_grad(set_to_none=True)
            shares: dict[str, list[torch.Tensor]] = defaultdict(list)
            with forwards.active():
                forwards.start_accumulation()
                rows = rows if grouped is None else rows[grouped]
                for mb, mb_rows in zip(micro, rows.split([len(mb) for mb in micro]), strict=True):
                    step_metrics, per_row = forwards.run(
                        mb, step.keys, worker.fwd_bwd, step.static, agg, True, step.device_only
                    )
                    forwards.accumulate_grads()
                    given.append((mb_rows, per_row))
                    for k, v in step_metrics.items():
                        (shares if k in LOSS_SHARES else metrics)[k].append(v)  # type: ignore[index]
            for k, parts in shares.items():
                # The ranks of a sequence-parallel group hold the same share: counted once in the sum.
                metrics[k].append(torch.stack(parts).sum() / forwards.sp_size)
            if worker.parking is not None:
                worker.parking.before_step(optimizer)
            grad_norm = clip_and_step(forwards.model, optimizer, plan.grad_clip, worker.placement)
            metrics[f"{plan.role}/grad_norm"].append(grad_norm)
    metrics[f"{plan.role}/lr"].append(worker.lr_scheduler.get_last_lr()[0])
    worker.lr_scheduler.step()
    means = mean_metrics(metrics)  # the update's values reach the host here, all in one copy
    warn_skipped_steps(plan.role, metrics[f"{plan.role}/grad_norm"])
    return reduce_metrics(means, sums=LOSS_SHARES), in_row_order(given, forwards.sp_size)


def in_row_order(
    given: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]], sp_size: int
) -> list[torch.Tensor]:
    """Each per-row output of the micro-batches over the whole batch, in its row order, float32 on the CPU:
    each rank ran the rows of its share, and every rank gathers them all."""
    if not given[0][1]:
        return []
    rows = all_gather_rows(torch.cat([r for r, _ in given]), sp_size)
    order = torch.empty_like(rows)
    order[rows] = torch.arange(len(rows))
    return [
        all_gather_rows(torch.cat([out[i] for _, out in given]).float().cpu(), sp_size)[order]
        for i in range(len(given[0][1]))
    ]


def mini_batch_shares(
    batch: Batch, order: torch.Tensor, size: int, sp_size: int = 1
) -> Iterator[tuple[dict[str, float], torch.Tensor, Batch]]:
    """Per mini-batch of `size` rows taken in `order`: the whole mini-batch's `agg_loss` counts
    (`global_agg_kwargs`), and this rank's share of its rows (all of them in one process; its group's,
    with sequence parallelism of `sp_size`): their indices in `batch` and the rows.

    The share is taken from `batch` in one copy of its rows (the micro-batches copy them once more): the
    shuffled batch, its mini-batch and the share are never materialised one after the other, which
    copied every tensor's rows three times over on the host before a micro-batch could run."""
    for rows in order.split(size):
        agg = global_agg_kwargs(batch["response_mask"].index_select(0, rows))
        mine = rows[rank_rows(len(rows), sp_size)]
        yield agg, mine, batch.select(mine)


def global_agg_kwargs(response_mask: torch.Tensor) -> dict[str, float]:
    """`agg_loss` keywords for a micro-batch of this mini-batch: its token and sequence counts.

    token-mean divides by the mini-batch's tokens, seq-mean-* by its sequences with a token, so the
    micro-batch losses add up to the mini-batch loss however it is cut (verl 0.9.1's global-token
    normalisation). Counted on the host (the batch lives there): no device sync.
    """
    tokens_per_seq = response_mask.sum(-1)  # (B,)
    return {
        "batch_num_tokens": max(float(tokens_per_seq.sum()), 1.0),
        "global_batch_size": max(float((tokens_per_seq > 0).sum()), 1.0),
    }


def mean_metrics(metrics: dict[str, list[torch.Tensor | float]]) -> dict[str, float]:
    """Mean of each metric's values; device tensors are brought to the host in one copy (and replaced by
    their values in `metrics`' lists)."""
    tensors = [(k, i) for k, v in metrics.items() for i, x in enumerate(v) if isinstance(x, torch.Tensor)]
    if tensors:
        stacked = torch.stack([as_scalar(metrics[k][i]) for k, i in tensors])  # type: ignore[arg-type]
        for (k, i), value in zip(tensors, stacked.cpu().tolist(), strict=True):
            metrics[k][i] = value
    return {k: float(sum(float(x) for x in v) / len(v)) for k, v in metrics.items()}


def as_scalar(x: torch.Tensor) -> torch.Tensor:
    """`x` as a detached float32 0-d tensor; one that already is goes as it is (each detach or reshape
    is an op dispatched per metric per micro-batch)."""
    if x.dim() == 0 and x.dtype == torch.float32 and not x.requires_grad:
        return x
    return x.detach().float().reshape(())
