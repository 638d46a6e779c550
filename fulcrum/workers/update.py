"""The update loop every trained model runs (actor and critic): ppo_epochs × shuffled mini-batches ×
micro-batches, gradients accumulated over the micro-batches, one clipped optimiser step per mini-batch.

A worker gives its loss on one micro-batch (`Trainable.micro_step`); everything else — shuffling, splitting, this rank's share, compute weights, grad
clip, LR schedule, metric reduction — is here once.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.optim.lr_scheduler import LRScheduler

from fulcrum.batch import Batch
from fulcrum.parallel import rank_rows, reduce_metrics
from fulcrum.workers.forwards import ModelForwards
from fulcrum.workers.micro_batch import make_micro_batches
from fulcrum.workers.optim import clip_and_step, warn_skipped_steps
from fulcrum.workers.placement import Placement
from fulcrum.workers.state_parking import OptimizerStateParking

logger = logging.getLogger(__name__)

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


class Trainable(Protocol):
    """A worker the loop can update: its model's forwards, optimiser, schedule and placement, its plan,
    and its loss on one micro-batch (forward, loss, backward; detached metrics back), given the
    mini-batch's `agg_loss` counts."""

    forwards: ModelForwards
    optimizer: torch.optim.Optimizer
    lr_scheduler: LRScheduler
    placement: Placement
    plan: UpdatePlan
    parking: OptimizerStateParking | None  # the other models' optimiser state off the device meanwhile

    def micro_step(self, mb: Batch, agg: dict[str, float]) -> dict[str, torch.Tensor | float]: ...


def one_optimizer_step(plan: UpdatePlan, rows: int) -> bool:
    """An update of `rows` responses takes one optimiser step (one epoch, one mini-batch): it is strictly
    on-policy, its forward sees the weights the batch was scored under."""
    return plan.ppo_epochs == 1 and rows <= plan.mini_batch_size


def ppo_update(worker: Trainable, batch: Batch, global_step: int) -> dict[str, float]:
    """One update over `batch`; returns the role's metrics (verl's reduction).

    The shuffle is seeded by (seed, global_step) so a resumed run repeats it exactly. Each micro-batch's
    loss is its share of the mini-batch loss (`global_agg_kwargs`), so the gradient does not depend on
    how the mini-batch is cut. Loss metrics are summed per mini-batch, the others averaged over
    micro-batches; grad_norm is per mini-batch; each then averaged over the update.
    """
    forwards, optimizer, plan = worker.forwards, worker.optimizer, worker.plan
    if len(batch) % plan.mini_batch_size != 0 and len(batch) > plan.mini_batch_size:
        logger.warning(
            "%s: %d responses do not divide into mini-batches of %d",
            plan.role,
            len(batch),
            plan.mini_batch_size,
        )
    forwards.model.train()
    if worker.parking is not None:  # the other models' moments out, this one's back, beside the forwards
        worker.parking.activate(optimizer)
    metrics: dict[str, list[torch.Tensor | float]] = defaultdict(list)
    generator = torch.Generator().manual_seed(plan.seed * 1_000_003 + global_step)
    for _ in range(plan.ppo_epochs):
        order = torch.randperm(len(batch), generator=generator)
        for agg, share in mini_batch_shares(batch, order, plan.mini_batch_size, forwards.sp_size):
            micro, _ = make_micro_batches(
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
                for mb in micro:
                    step_metrics = worker.micro_step(mb, agg)
                    forwards.accumulate_grads()
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
    return reduce_metrics(means, sums=LOSS_SHARES)


def mini_batch_shares(
    batch: Batch, order: torch.Tensor, size: int, sp_size: int = 1
) -> Iterator[tuple[dict[str, float], Batch]]:
    """Per mini-batch of `size` rows taken in `order`: the whole mini-batch's `agg_loss` counts
    (`global_agg_kwargs`) and this rank's share of its rows (all of them in one process; its group's,
    with sequence parallelism of `sp_size`).

    The share is taken from `batch` in one copy of its rows (the micro-batches copy them once more): the
    shuffled batch, its mini-batch and the share are never materialised one after the other, which
    copied every tensor's rows three times over on the host before a micro-batch could run."""
    for rows in order.split(size):
        agg = global_agg_kwargs(batch["response_mask"].index_select(0, rows))
        yield agg, batch.select(rows[rank_rows(len(rows), sp_size)])


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
