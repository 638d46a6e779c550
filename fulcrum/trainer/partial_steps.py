"""Stage 1 of a step under `trainer.v1.trainer_mode=colocate_async`: partial rollouts on the training GPU.

The first step puts `1 + trainer.v1.colocate_async.num_warmup_batches` prompt batches in flight; each
later step adds its own batch. A step trains the first `data.train_batch_size` prompt groups to complete
(groups carried from earlier steps first) and carries the rest: their finished samples, and their
unfinished ones held in the engine with their tokens and rollout log-probs, continued next step under the
new weights (fulcrum.rollout.partial). The weights that sampled each token are the step's policy
version (the global step that generated it).

Staleness bound (`trainer.v1.sampler`): a group trained at step t whose first token was sampled at step
t0 spans t - t0 + 1 versions; `max_off_policy_threshold` bounds it. `drop` discards a carried group
past the bound before the step generates; `wait` makes the step generate on until the carried groups at
the bound are complete and trains them first. The older tokens enter the loss with the log-probs they
were sampled with (`rollout_log_probs`): bypass mode takes them as old log-probs, decoupled mode weighs
them by `algorithm.rollout_correction` (verl's keys), as with any engine/trainer mismatch.

A resumed run does not restore carried groups (the engine's held sequences are not checkpointed): the
count at the checkpoint is logged as dropped, and their prompts are not generated again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fulcrum.agent.metrics import spread
from fulcrum.batch import Batch, assemble_batch
from fulcrum.config import FulcrumConfig
from fulcrum.data.budgets import response_budget
from fulcrum.rollout import SamplingParams
from fulcrum.rollout.partial import Group, PartialRollout, SuspendableEngine

logger = logging.getLogger(__name__)


def versions_spanned(step: int, first_version: int) -> int:
    """Policy versions from a group's first sampled token to the step that trains it: t - t0 + 1."""
    return step - first_version + 1


def off_policy_metrics(groups: list[Group], step: int) -> dict[str, float]:
    """verl's `training/off_policy/*` per trajectory (sample) trained at `step`: trajectory_spans (the
    distinct versions that sampled it), trajectory_staleness (step - its newest version),
    trajectory_staleness_worst (step - its oldest); and ours: carried_token_share (response tokens
    sampled before `step` / all response tokens), carried_groups (groups begun before `step`)."""
    samples = [s for g in groups for s in g.samples if s.versions]
    tokens = sum(len(s.versions) for s in samples)
    carried = sum(sum(v < step for v in s.versions) for s in samples)
    prefix = "training/off_policy"
    return {
        **spread(f"{prefix}/trajectory_spans", [float(len(set(s.versions))) for s in samples]),
        **spread(f"{prefix}/trajectory_staleness", [float(step - max(s.versions)) for s in samples]),
        **spread(f"{prefix}/trajectory_staleness_worst", [float(step - min(s.versions)) for s in samples]),
        f"{prefix}/carried_token_share": carried / tokens if tokens else 0.0,
        f"{prefix}/carried_groups": float(sum(bool(g.versions) and g.versions[0] < step for g in groups)),
    }


def carried_groups(steps: PartialSteps | None) -> int:
    """The groups in flight, for the checkpoint's trainer state (0 without partial rollouts)."""
    return steps.carried if steps is not None else 0


def dropped_on_resume(state: dict[str, Any]) -> str:
    """The line (after a newline) a resumed run prints when the checkpoint had groups in flight: their
    held sequences are not checkpointed, so they are dropped (their prompts not generated again); ""
    when it had none."""
    carried = int(state.get("carried_groups", 0))
    if not carried:
        return ""
    return (
        f"\npartial rollouts: the {carried} prompt groups in flight at global_step {state['global_step']} "
        "are dropped (their sequences are not checkpointed); new prompts follow"
    )


class PartialSteps:
    """The groups of one run across steps (see the module docstring)."""

    def __init__(self, cfg: FulcrumConfig, engine: SuspendableEngine, pad_id: int) -> None:
        v1 = cfg.trainer.v1
        self.threshold = int(v1.sampler.max_off_policy_threshold)
        self.strategy = v1.sampler.max_off_policy_strategy
        self.warmup = int(v1.colocate_async.num_warmup_batches)
        self.batch_size = int(cfg.data.train_batch_size)
        self.max_prompt_length = int(cfg.data.max_prompt_length)
        self.response_length = int(cfg.actor_rollout_ref.rollout.response_length)
        self.pad_id = pad_id
        self.partial = PartialRollout(engine)
        self.started = False

    @property
    def carried(self) -> int:
        """Groups handed to no step yet (their prompts were taken from the data)."""
        return len(self.partial.carried)

    def generate(
        self,
        items: list[dict[str, Any]],
        step: int,
        params: SamplingParams,
        more_prompts: Callable[[], list[dict[str, Any]] | None],
    ) -> tuple[Batch, dict[str, float]]:
        """The step's batch of complete groups and its off-policy metrics."""
        if not self.started:
            self.started = True
            for _ in range(self.warmup):
                extra = more_prompts()
                if extra is None:
                    break
                items = [*items, *extra]
        dropped = self._drop_stale(step)
        must = self._at_bound(step)
        budgets = [response_budget(item, self.response_length) for item in items]
        groups = self.partial.generate(
            [item["input_ids"] for item in items],
            items,
            params,
            enough=self.batch_size,
            version=step,
            max_tokens=budgets,
            must_finish=must,
        )
        keys = [g.key for g in groups]
        samples = [(i, s) for i, g in enumerate(groups) for s in g.samples]
        batch = assemble_batch(
            keys,
            [s.token_ids for _, s in samples],
            [s.logprobs for _, s in samples],
            [i for i, _ in samples],
            self.max_prompt_length,
            self.response_length,
            self.pad_id,
            f"s{step}",
        )
        metrics = off_policy_metrics(groups, step)
        metrics.update({f"rollout/{key}": value for key, value in self.partial.figures.items()})
        metrics["training/off_policy/dropped_groups"] = float(dropped)
        metrics["training/off_policy/in_flight_groups"] = float(self.carried)
        return batch, metrics

    def _drop_stale(self, step: int) -> int:
        """Discard the carried groups that would span more than the threshold at `step` (under `wait`, only
        those a step at the bound had no room for)."""
        stale = [
            g
            for g in self.partial.carried
            if g.versions and versions_spanned(step, g.versions[0]) > self.threshold
        ]
        if stale:
            self.partial.drop(stale)
        return len(stale)

    def _at_bound(self, step: int) -> list[Group]:
        """Under `wait`, the carried groups that `step` must finish: trained later they would exceed it.
        The unfinished ones come first: a step has room for `data.train_batch_size` groups, and dropping
        the ones still generating would drop the longest answers, biasing training toward short ones."""
        if self.strategy != "wait":
            return []
        at_bound = [
            g
            for g in self.partial.carried
            if g.versions and versions_spanned(step, g.versions[0]) >= self.threshold
        ]
        return sorted(at_bound, key=lambda g: g.complete)
