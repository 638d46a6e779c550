"""The typed section each worker is built from: its own keys and the few it shares, every size resolved.

As verl's workers take an `ActorConfig` / `CriticConfig`, fulcrum's take an `ActorSection`,
`ReferenceSection` or `CriticSection` built here once from a resolved `FulcrumConfig`, so no worker
re-derives "null follows another key" (the loader resolves every one, fulcrum.config.loader.DERIVED) and a
worker can be built (and tested) from its section alone. Sizes are checked once, by
fulcrum.config.validate (set, inside their domain, dividing the mini-batch): sections copy them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fulcrum.config.schema import ActorConfig, CriticConfig, FSDPConfig, FulcrumConfig, ModelConfig


@dataclass(frozen=True)
class ForwardSizes:
    """How a no-grad forward pass (log-probs, values) is split: fixed micro-batches or a token budget."""

    micro_batch_size: int | None  # responses per micro-batch (None with use_dynamic_bsz)
    use_dynamic_bsz: bool
    max_token_len: int | None  # tokens per micro-batch with use_dynamic_bsz
    key: str  # the configuration key of micro_batch_size, for error messages


def per_device(size_per_gpu: int | None, deprecated_global: int | None) -> int | None:
    """A micro-batch size from its two spellings: the per-device key, else verl's deprecated global one
    (the same on one device; validate() reports setting both). Which key a null size follows is the
    loader's (DERIVED): sections read resolved values and derive none."""
    return size_per_gpu if size_per_gpu is not None else deprecated_global


def log_prob_sizes(section: Any) -> ForwardSizes:
    """The log-prob pass's `log_prob_*` sizes of `section` (the rollout's for the actor, or the ref's)."""
    return ForwardSizes(
        per_device(section.log_prob_micro_batch_size_per_gpu, section.log_prob_micro_batch_size),
        bool(section.log_prob_use_dynamic_bsz),
        section.log_prob_max_token_len_per_gpu,
        section.key("log_prob_micro_batch_size_per_gpu"),
    )


def scoring_temperature(cfg: FulcrumConfig) -> float:
    """verl divides the logits by the rollout temperature wherever the policy is scored (1 when greedy)."""
    return float(cfg.actor_rollout_ref.rollout.temperature) or 1.0


@dataclass(frozen=True)
class ActorSection:
    model: ModelConfig  # actor_rollout_ref.model
    actor: ActorConfig  # actor_rollout_ref.actor (optim, clip ratios, losses), resolved
    temperature: float  # scoring_temperature()
    mini_batch_size: int  # responses per optimiser step: ppo_mini_batch_size × rollout.n
    micro_batch_size: int | None  # responses per forward/backward
    log_prob: ForwardSizes  # the old-log-prob pass (actor_rollout_ref.rollout.log_prob_*)
    seed: int  # trainer.seed: mini-batch shuffles


@dataclass(frozen=True)
class ReferenceSection:
    model_path: str  # the actor's initial weights
    temperature: float  # scoring_temperature()
    log_prob: ForwardSizes  # actor_rollout_ref.ref.log_prob_*
    use_remove_padding: bool  # actor_rollout_ref.model.use_remove_padding (the actor's model)
    use_torch_compile: bool  # actor_rollout_ref.ref.use_torch_compile (follows the actor's)
    fsdp: FSDPConfig  # actor_rollout_ref.ref.fsdp_config (several processes)
    ulysses_sequence_parallel_size: int = 1  # actor_rollout_ref.ref.* (follows the actor's)
    # actor_rollout_ref.model.override_config: verl builds the reference from the actor's model config
    override_config: Mapping[str, Any] = field(default_factory=dict)
    lm_head_fp32: bool = False  # actor_rollout_ref.model.lm_head_fp32: as the actor and the engine
    cuda_graphs: bool = True  # actor_rollout_ref.ref.cuda_graphs (follows the actor's)
    inductor_cpp_wrapper: bool = True  # actor_rollout_ref.actor.inductor_cpp_wrapper


@dataclass(frozen=True)
class CriticSection:
    critic: CriticConfig  # critic.* resolved (epochs, loss_agg_mode, dynamic bsz follow the actor's)
    mini_batch_size: int  # responses per optimiser step: critic.ppo_mini_batch_size × critic.rollout_n
    micro_batch_size: int | None  # responses per forward/backward
    values: ForwardSizes  # the values pass (critic.forward_*)
    seed: int  # mini-batch shuffles (trainer.seed + 7: not the actor's order)
    use_torch_compile: bool  # actor_rollout_ref.actor.use_torch_compile (verl's critic has no key)
    inductor_cpp_wrapper: bool = True  # actor_rollout_ref.actor.inductor_cpp_wrapper


def actor_section(cfg: FulcrumConfig) -> ActorSection:
    arr = cfg.actor_rollout_ref
    actor, rollout = arr.actor, arr.rollout
    return ActorSection(
        model=arr.model,
        actor=actor,
        temperature=scoring_temperature(cfg),
        mini_batch_size=actor.ppo_mini_batch_size * rollout.n,
        micro_batch_size=per_device(actor.ppo_micro_batch_size_per_gpu, actor.ppo_micro_batch_size),
        log_prob=log_prob_sizes(rollout),
        seed=cfg.trainer.seed,
    )


def reference_section(cfg: FulcrumConfig) -> ReferenceSection:
    ref = cfg.actor_rollout_ref.ref
    return ReferenceSection(
        model_path=cfg.actor_rollout_ref.model.path,
        temperature=scoring_temperature(cfg),
        log_prob=log_prob_sizes(ref),
        use_remove_padding=bool(cfg.actor_rollout_ref.model.use_remove_padding),
        use_torch_compile=bool(ref.use_torch_compile),
        fsdp=ref.fsdp_config,
        ulysses_sequence_parallel_size=int(ref.ulysses_sequence_parallel_size or 1),
        override_config=cfg.actor_rollout_ref.model.override_config,
        lm_head_fp32=bool(cfg.actor_rollout_ref.model.lm_head_fp32),
        cuda_graphs=bool(ref.cuda_graphs),
        inductor_cpp_wrapper=bool(cfg.actor_rollout_ref.actor.inductor_cpp_wrapper),
    )


def critic_section(cfg: FulcrumConfig) -> CriticSection:
    c = cfg.critic
    assert c.ppo_mini_batch_size is not None and c.rollout_n is not None, "resolve() the configuration first"
    return CriticSection(
        critic=c,
        mini_batch_size=c.ppo_mini_batch_size * c.rollout_n,
        micro_batch_size=per_device(c.ppo_micro_batch_size_per_gpu, c.ppo_micro_batch_size),
        values=ForwardSizes(
            per_device(c.forward_micro_batch_size_per_gpu, c.forward_micro_batch_size),
            bool(c.use_dynamic_bsz),
            c.forward_max_token_len_per_gpu,
            c.key("forward_micro_batch_size_per_gpu"),
        ),
        seed=cfg.trainer.seed + 7,
        use_torch_compile=bool(cfg.actor_rollout_ref.actor.use_torch_compile),
        inductor_cpp_wrapper=bool(cfg.actor_rollout_ref.actor.inductor_cpp_wrapper),
    )
