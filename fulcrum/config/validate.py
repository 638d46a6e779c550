"""Rules of a resolved configuration: each number inside its key's domain (fulcrum.config.domains),
the cross-key rules (verl's `_validate_config` and worker asserts, and ours), and prompt + response
within the actor's `max_position_embeddings` (its config.json, read without loading the model).

`validate(cfg, n_devices)` returns the findings that make a run fail or waste compute; `advise(cfg)`
returns warnings that do not stop a run. Each finding names the key(s) it is about. The names the
algorithm package implements are checked above this layer (fulcrum.trainer.checks), where `fulcrum
train` and `fulcrum doctor` both take the whole list. Over 400 lines because it is the one list of
cross-key rules (one short function per family), which both share.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path

from fulcrum.config.compat import FSDP_ROLES, UNSUPPORTED, fsdp_size_note
from fulcrum.config.finding import Finding
from fulcrum.config.keys import get_path as _get
from fulcrum.config.schema import FulcrumConfig, KLControlConfig
from fulcrum.config.validate_domains import domain_problems
from fulcrum.config.validate_recipes import recipe_notes, recipe_problems
from fulcrum.config.validate_signal import signal_problems
from fulcrum.config.validate_sizes import (
    CRITIC_ESTIMATORS,
    size_problems,
    uneven_mini_batches,
    uses_critic,
    uses_reference,
    world_size,
)

SUPPORTED_LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
VERL_ONLY_LOGGERS = ("swanlab", "vemlp_wandb", "clearml")
# Estimators whose baseline needs several responses per prompt (with one they are plain REINFORCE).
GROUP_ESTIMATORS_NEEDING_N2 = ("rloo",)


# ------------------------------------------------------------------------------------ error rules
def _choices(cfg: FulcrumConfig) -> list[Finding]:
    """Values a field's type cannot restrict (the algorithm package's names: fulcrum.trainer.checks)."""
    problems, reward = [], cfg.reward_model
    if reward.on_error not in ("raise", "zero"):
        problems.append(
            Finding((reward.key("on_error"),), f"expected raise or zero, got {reward.on_error!r}")
        )
    for key in (cfg.actor_rollout_ref.actor.key("optim.betas"), cfg.critic.key("optim.betas")):
        if len(_get(cfg, key)) != 2:
            problems.append(Finding((key,), f"AdamW takes two betas [beta1, beta2], got {_get(cfg, key)}"))
    return problems


def _context_length(cfg: FulcrumConfig) -> list[Finding]:
    """prompt + response fit the actor's position embeddings, read from its config.json (no weights):
    past them the model runs on positions it was never trained on, without a word. A composite
    (vision-language) config keeps them in its `text_config`."""
    path = Path(os.path.expanduser(str(cfg.actor_rollout_ref.model.path))) / "config.json"
    try:
        config = json.loads(path.read_text())
        limit = config.get(
            "max_position_embeddings", (config.get("text_config") or {}).get("max_position_embeddings")
        )
    except (OSError, ValueError, AttributeError):
        return []  # a hub id, or a folder the model-folder checks name as broken
    rollout = cfg.actor_rollout_ref.rollout
    needed = rollout.prompt_length + rollout.response_length
    if not isinstance(limit, int) or needed <= limit:
        return []
    return [
        Finding(
            (cfg.data.key("max_prompt_length"), cfg.data.key("max_response_length")),
            f"prompt + response = {needed} tokens exceeds {cfg.actor_rollout_ref.model.key('path')}'s "
            f"max_position_embeddings = {limit} ({path})",
        )
    ]


def _devices(cfg: FulcrumConfig, n_devices: int | None) -> list[Finding]:
    problems = []
    n_gpus, trainer = world_size(cfg), cfg.trainer
    if n_devices is not None and n_gpus > n_devices:
        problems.append(
            Finding(
                (trainer.key("n_gpus_per_node"), trainer.key("nnodes")),
                f"the run asks for {n_gpus} device(s) but {n_devices} are visible; "
                f"set {trainer.key('n_gpus_per_node')}={max(n_devices, 1)}"
                + (f" or {trainer.key('device')}=cpu" if n_devices == 0 else ""),
            )
        )
    return problems


def sp_roles(cfg: FulcrumConfig) -> list[tuple[str, int, str, bool]]:
    """(key, ulysses_sequence_parallel_size, its padding key, use_remove_padding) of each model the run
    trains or scores with."""
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    sp_key = "ulysses_sequence_parallel_size"
    padding = (arr.model.key("use_remove_padding"), bool(arr.model.use_remove_padding))
    roles = [(arr.actor.key(sp_key), arr.actor.ulysses_sequence_parallel_size, *padding)]
    if uses_reference(cfg):
        size = arr.ref.ulysses_sequence_parallel_size or arr.actor.ulysses_sequence_parallel_size
        roles.append((arr.ref.key(sp_key), size, *padding))
    if uses_critic(cfg):
        critic_padding = (critic.model.key("use_remove_padding"), bool(critic.model.use_remove_padding))
        roles.append((critic.key(sp_key), critic.ulysses_sequence_parallel_size, *critic_padding))
    return [(key, int(size), pad_key, pad) for key, size, pad_key, pad in roles]


def _sequence_parallel(cfg: FulcrumConfig) -> list[Finding]:
    """Ulysses splits each micro-batch's packed stream over sp ranks: the packed path, and sp dividing the
    processes (the world is data-parallel groups × sp). The heads' rule needs the model: checked at start."""
    problems = []
    n_gpus = world_size(cfg)
    for key, sp, pad_key, packed in sp_roles(cfg):
        if sp == 1:
            continue
        if n_gpus % sp:
            problems.append(
                Finding(
                    (key, cfg.trainer.key("n_gpus_per_node")),
                    f"{key}={sp} must divide the {n_gpus} device(s): the world is data-parallel groups × {sp}",
                )
            )
        if not packed:
            problems.append(
                Finding((key, pad_key), f"{key}={sp} runs on the packed path only: set {pad_key}=True")
            )
    return problems


def _lm_head_fp32(cfg: FulcrumConfig) -> list[Finding]:
    """Float32 LM-head logits on one side only widen the rollout-vs-training gap: the engine and the
    actor/reference must both follow the key. The hf backend's generate and the padded forward run
    Hugging Face's own head, rounded to the model's dtype. (An architecture the native engine does not
    run, or rollout.name=vllm on the CPU, is refused when the rollout is built.)"""
    model, rollout = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.rollout
    if not model.lm_head_fp32:
        return []
    problems, key = [], model.key("lm_head_fp32")
    if rollout.name == "hf":
        name_key = rollout.key("name")
        problems.append(Finding((key, name_key), "needs the native engine: the hf backend rounds its logits"))
    if not model.use_remove_padding:
        pad_key = model.key("use_remove_padding")
        problems.append(
            Finding((key, pad_key), "needs the packed path: the padded forward rounds its logits")
        )
    return problems


def _algorithm(cfg: FulcrumConfig) -> list[Finding]:
    problems = []
    estimator = cfg.algorithm.adv_estimator
    if cfg.critic.enable is False and estimator in CRITIC_ESTIMATORS:
        keys = (cfg.critic.key("enable"), cfg.algorithm.key("adv_estimator"))
        problems.append(Finding(keys, f"{estimator} needs a critic"))
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.val_kwargs.do_sample and rollout.val_kwargs.temperature <= 0:
        keys = (rollout.key("val_kwargs.do_sample"), rollout.key("val_kwargs.temperature"))
        problems.append(Finding(keys, "sampling at validation needs a temperature > 0"))
    if (
        rollout.max_model_len is not None
        and rollout.prompt_length + rollout.response_length > rollout.max_model_len
    ):
        problems.append(
            Finding(
                (rollout.key("max_model_len"),),
                f"{rollout.max_model_len} is shorter than prompt_length + response_length = "
                f"{rollout.prompt_length + rollout.response_length}",
            )
        )
    return problems


def _trainer(cfg: FulcrumConfig) -> list[Finding]:
    problems = []
    trainer = cfg.trainer
    if trainer.resume_mode == "resume_path" and not trainer.resume_from_path:
        problems.append(
            Finding(
                (trainer.key("resume_mode"), trainer.key("resume_from_path")),
                "resume_path needs resume_from_path",
            )
        )
    return problems


def _unsupported(cfg: FulcrumConfig) -> list[Finding]:
    problems, logger_key = [], cfg.trainer.key("logger")
    verl_only = [name for name in cfg.trainer.logger if name in VERL_ONLY_LOGGERS]
    unknown = [name for name in cfg.trainer.logger if name not in SUPPORTED_LOGGERS + VERL_ONLY_LOGGERS]
    if verl_only:
        problems.append(Finding((logger_key,), f"{verl_only}: verl loggers fulcrum does not support yet"))
    if unknown:
        problems.append(
            Finding((logger_key,), f"unknown logger(s) {unknown}; one of {list(SUPPORTED_LOGGERS)}")
        )
    for key, (allowed, why) in UNSUPPORTED.items():
        value = _get(cfg, key)
        if value not in allowed:
            problems.append(Finding((key,), f"{why} (got {value!r})"))
    return problems


RULES: list[Callable[[FulcrumConfig], list[Finding]]] = [
    domain_problems,  # every number inside the domain its key declares (fulcrum.config.domains)
    _choices,
    _context_length,
    size_problems,  # micro/mini-batch sizes and token budgets (fulcrum.config.validate_sizes)
    _sequence_parallel,
    _lm_head_fp32,
    _algorithm,
    _trainer,
    _unsupported,
    recipe_problems,
    signal_problems,  # runs that would train nothing into the policy the engine samples
]


def validate(cfg: FulcrumConfig, n_devices: int | None = None) -> list[Finding]:
    """Findings that make the run fail or waste compute ([] = can run).

    `n_devices`: accelerators visible to the run; None skips the device-count check (CPU runs).
    """
    problems = _devices(cfg, n_devices)
    for rule in RULES:
        problems.extend(rule(cfg))
    return problems


# ---------------------------------------------------------------------------------------- advice
def advise(cfg: FulcrumConfig) -> list[Finding]:
    """Warnings that do not stop a run (verl prints most of them as notices)."""
    notes = []
    arr, algo = cfg.actor_rollout_ref, cfg.algorithm
    # A tensor-parallel size that does not divide the processes runs one engine per process, so verl's
    # divisibility rule only warns: verl's default of 2 must not stop a one-device or CPU run.
    tp, n_gpus = arr.rollout.tensor_model_parallel_size, world_size(cfg)
    if tp > 1 and (tp > n_gpus or n_gpus % tp):
        notes.append(
            Finding(
                (arr.rollout.key("tensor_model_parallel_size"), cfg.trainer.key("n_gpus_per_node")),
                f"tensor parallel size {tp} does not divide the {n_gpus} device(s) of the run "
                "(verl would refuse; fulcrum runs one rollout engine per process instead)",
            )
        )
    for role in FSDP_ROLES:
        key = f"{role}.fsdp_config.fsdp_size"
        size = int(_get(cfg, key))
        note = fsdp_size_note(size, n_gpus)
        if note is not None:
            notes.append(Finding((key,), f"{key}={size}: {note}"))
    if cfg.data.val_batch_size is not None:
        notes.append(
            Finding(
                (cfg.data.key("val_batch_size"),),
                "deprecated in verl and ignored: validation runs as one batch",
            )
        )
    if algo.use_kl_in_reward and arr.actor.use_kl_loss:
        notes.append(
            Finding(
                (algo.key("use_kl_in_reward"), arr.actor.key("use_kl_loss")),
                "both KL in reward and KL loss are on",
            )
        )
    if algo.kl_ctrl.type == "adaptive" and not algo.use_kl_in_reward:
        notes.append(
            Finding(
                (algo.key("kl_ctrl.type"), algo.key("use_kl_in_reward")),
                "adaptive KL control acts only with use_kl_in_reward=True",
            )
        )
    if not algo.use_kl_in_reward and algo.kl_ctrl != KLControlConfig():
        notes.append(
            Finding(
                (algo.key("kl_ctrl"), algo.key("use_kl_in_reward")),
                "kl_ctrl settings act only with use_kl_in_reward=True (as in verl)",
            )
        )
    # verl runs these with n = 1 (its own rollout-correction example does): each row is its own group and
    # keeps its score as the advantage (plain REINFORCE), so it is a warning, not an error.
    if algo.adv_estimator in GROUP_ESTIMATORS_NEEDING_N2 and arr.rollout.n < 2:
        notes.append(
            Finding(
                (algo.key("adv_estimator"), arr.rollout.key("n")),
                f"{algo.adv_estimator} compares responses to the same prompt; with rollout.n=1 it has no baseline",
            )
        )
    if algo.adv_estimator == "grpo" and arr.rollout.n < 2:
        notes.append(
            Finding(
                (algo.key("adv_estimator"), arr.rollout.key("n")),
                "grpo with one response per prompt has no group baseline; usually n >= 4",
            )
        )
    notes += uneven_mini_batches(cfg)
    if not uses_reference(cfg) and (
        arr.ref.log_prob_micro_batch_size_per_gpu is not None or arr.ref.log_prob_micro_batch_size is not None
    ):
        notes.append(
            Finding(
                (arr.ref.key("log_prob_micro_batch_size_per_gpu"),),
                "no reference policy is used (use_kl_loss and use_kl_in_reward are off): the reference pass is skipped",
            )
        )
    notes += zero_learning_rates(cfg)
    notes += lower_clip_off(cfg)
    return [dataclasses.replace(note, severity="warning") for note in notes + recipe_notes(cfg)]


def zero_learning_rates(cfg: FulcrumConfig) -> list[Finding]:
    """A learning rate of 0 trains nothing: the run spends its compute and the weights never change."""
    roles = [(cfg.actor_rollout_ref.actor.key("optim.lr"), cfg.actor_rollout_ref.actor.optim.lr)]
    if uses_critic(cfg):
        roles.append((cfg.critic.key("optim.lr"), cfg.critic.optim.lr))
    return [
        Finding((key,), f"{key}=0: the optimiser steps change nothing, so the model never trains")
        for key, lr in roles
        if lr == 0
    ]


# Losses that clip the ratio itself to [1 - clip_ratio_low, 1 + clip_ratio_high] (geo_mean clips its
# logarithm, and CISPO runs a low of 10 on purpose in verl's example: no lower bound, as meant).
RATIO_CLIPPING_LOSSES = ("vanilla", "gspo")


def lower_clip_off(cfg: FulcrumConfig) -> list[Finding]:
    """clip_ratio_low >= 1 puts the lower clip at a ratio <= 0, which a ratio never reaches."""
    actor = cfg.actor_rollout_ref.actor
    low = actor.clip_ratio_low  # resolved: follows clip_ratio when unset
    assert low is not None, "a resolved configuration"
    if actor.policy_loss.loss_mode not in RATIO_CLIPPING_LOSSES or low < 1:
        return []
    return [
        Finding(
            (actor.key("clip_ratio_low"),),
            f"{low} >= 1: the lower clip bound 1 - {low} <= 0 never acts, so the {actor.policy_loss.loss_mode} "
            "loss does not limit how far a token's probability falls in one update",
        )
    ]
