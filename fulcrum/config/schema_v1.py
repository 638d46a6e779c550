# ruff: noqa: RUF009  -- `opt`/`sub` return dataclasses.field(...) objects, not shared default values
"""`trainer.use_v1` and `trainer.v1.*`: verl 0.9's V1 trainer keys, of which fulcrum runs `sync` (the
usual loop) and `colocate_async` (partial rollouts on the training GPU: fulcrum.trainer.partial_steps).
Same conventions as fulcrum.config.schema."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fulcrum.config.domains import AT_LEAST_0, AT_LEAST_1
from fulcrum.config.keys import opt, sub


@dataclass
class V1SamplerConfig:
    max_off_policy_threshold: int = opt(
        8,
        "most policy versions a prompt group may span from its first sampled token to the step that "
        "trains it (1: on-policy only)",
        AT_LEAST_1,
    )
    max_off_policy_strategy: Literal["drop", "wait"] = opt(
        "drop",
        "a carried group past the threshold: drop discards it; wait lets the step generate on until the "
        "groups at the threshold are complete, so they are trained rather than dropped",
    )


@dataclass
class ColocateAsyncConfig:
    num_warmup_batches: int = opt(
        1,
        "prompt batches in flight beyond the step's own (over-provisioning): the step trains the first "
        "data.train_batch_size groups to complete and carries the rest",
        AT_LEAST_0,
    )


@dataclass
class V1Config:
    trainer_mode: Literal["sync", "colocate_async"] = opt(
        "sync",
        "sync: generate, then train; colocate_async: partial rollouts on the same GPU (the native engine)",
    )
    colocate_async: ColocateAsyncConfig = sub(ColocateAsyncConfig, "colocated partial rollouts")
    sampler: V1SamplerConfig = sub(V1SamplerConfig, "staleness bound of carried groups")


def partial_rollouts_on(trainer: Any) -> bool:
    """The trainer section runs partial rollouts: `use_v1` with `v1.trainer_mode=colocate_async`."""
    return bool(trainer.use_v1) and trainer.v1.trainer_mode == "colocate_async"
