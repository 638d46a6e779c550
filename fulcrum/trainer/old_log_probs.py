"""Stage 3's old log-probs: their own forward pass over the batch, or — when the actor's update is strictly
on-policy and nothing reads them before it — the update's forward itself.

An update that consumes the batch in one optimiser step (one epoch, one mini-batch) sees the weights the
batch was scored under, so its loss takes the old log-probs from its own forward, detached: the ratio is
exactly 1, as in verl's dp_actor (`on_policy`) and TRL (`num_iterations=1`). verl still runs the old
pass on that path, for the entropy metric and what reads old log-probs before the update; fulcrum runs
it only when something does: the KL penalty in the reward, rollout correction (decoupled weights or
rejection) or an advantage estimator that takes `old_log_probs`. Otherwise the batch goes to the update
without them, the update returns its forward's log-probs and entropies (with several processes every
rank gathers all the rows) and the same metrics come from them (`actor/entropy`,
`rollout/logprob_diff_*`); `timing_s/old_log_prob` is 0, and the run says so at start-up
(`startup.startup_lines`). `update_gives_old_log_probs` is where that is decided.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

from fulcrum.algo.advantages import ADVANTAGE_ESTIMATORS
from fulcrum.algo.losses import agg_loss
from fulcrum.batch import Batch
from fulcrum.rollout import logprob_diff
from fulcrum.trainer import metrics as M
from fulcrum.trainer.advantage_stage import rollout_correction_of
from fulcrum.trainer.data_parallel import on_shares

if TYPE_CHECKING:  # `fulcrum doctor` reads the settings rule here; the worker's imports cost it half a second
    from fulcrum.workers.actor import ActorWorker


def estimator_reads_old_log_probs(name: str) -> bool:
    """The advantage estimator `name` takes `old_log_probs` (declared in its signature)."""
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    return estimator is not None and "old_log_probs" in inspect.signature(estimator).parameters


def update_can_give_old_log_probs(cfg: Any) -> bool:
    """The run's settings let the actor's update give the old log-probs: one epoch, a mini-batch as large
    as the step's batch, and nothing that reads them before the update (the KL penalty in the reward,
    rollout correction, an estimator that takes them)."""
    actor = cfg.actor_rollout_ref.actor
    return (
        int(actor.ppo_epochs) == 1
        and int(actor.ppo_mini_batch_size) >= int(cfg.data.train_batch_size)
        and not cfg.algorithm.use_kl_in_reward
        and rollout_correction_of(cfg) is None
        and not estimator_reads_old_log_probs(cfg.algorithm.adv_estimator)
    )


def old_log_prob_pass_runs(cfg: Any) -> bool:
    """A step runs the old-log-prob forward: the update cannot give the old log-probs, and rollout
    correction's bypass mode does not take the engine's in their place."""
    return not update_can_give_old_log_probs(cfg) and not cfg.algorithm.rollout_correction.bypass_mode


def update_gives_old_log_probs(cfg: Any, global_step: int) -> bool:
    """The old-log-prob pass is left out this step: the settings allow it and the actor updates now. (A
    step's batch never outgrows train_batch_size × n, so the update takes one optimiser step; the actor
    refuses a batch without old log-probs that would take more.)"""
    return update_can_give_old_log_probs(cfg) and int(cfg.trainer.critic_warmup) <= global_step


def old_log_prob_metrics(
    batch: Batch, log_probs: torch.Tensor, entropys: torch.Tensor, loss_agg_mode: str
) -> dict[str, float]:
    """`actor/entropy` (aggregated as the loss) and the rollout-vs-training log-prob gap of the policy
    that scored the batch, whichever forward gave its log-probs."""
    mask = batch["response_mask"]
    return {
        "actor/entropy": agg_loss(entropys, mask.float(), loss_agg_mode).item(),
        **logprob_diff(batch["rollout_log_probs"], log_probs, mask),
    }


def old_log_prob_stage(
    actor: ActorWorker,
    batch: Batch,
    cfg: Any,
    global_step: int,
    timing: dict[str, float],
    peaks: dict[str, float],
) -> dict[str, float]:
    """Stage 3's old log-probs into `batch` by their own pass (timed as `old_log_prob`), with its
    metrics; or, when `update_gives_old_log_probs`, nothing now (`timing_s/old_log_prob` 0): the actor's
    update gives them and `update_actor` reports the same metrics after it."""
    if update_gives_old_log_probs(cfg, global_step):
        timing["old_log_prob"] = 0.0
        return {}
    with M.timer("old_log_prob", timing, peaks):
        log_probs, entropys = on_shares(actor.compute_log_prob, batch, actor.forwards.sp_size)
        batch["old_log_probs"] = log_probs
        return old_log_prob_metrics(batch, log_probs, entropys, actor.cfg.loss_agg_mode)


def update_actor(actor: ActorWorker, batch: Batch, global_step: int) -> dict[str, float]:
    """Stage 5's actor update: its metrics, with the old-log-prob pass's when the update gave the old
    log-probs (the batch came without them)."""
    metrics, old = actor.update_policy(batch, global_step)
    if old is not None:
        metrics.update(old_log_prob_metrics(batch, *old, actor.cfg.loss_agg_mode))
    return metrics
