"""`fulcrum doctor`'s checks that read a model's config.json or a multi-turn run's files: the native
engine's reading of the rollout keys, fields the engine does not run, linear-attention layers left to
their torch reference on this GPU, `override_config` keys the model's config lacks, and the tool and
interaction configs. Each returns findings; doctor.py runs them with the others (CHECKS)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from fulcrum.agent.interaction_config import config_problems
from fulcrum.config import uses_critic
from fulcrum.config.finding import Finding
from fulcrum.tools.doctor_rules import DoctorContext


def _error(text: str) -> Finding:
    return Finding((), text)


def _warning(text: str) -> Finding:
    return Finding((), text, "warning")


def _model_config(path_text: str) -> Any | None:
    """The Hugging Face config of a local model folder; None when there is none or transformers cannot
    read it (doctor's model-path check names that)."""
    path = Path(os.path.expanduser(path_text))
    if not (path / "config.json").is_file():
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except Exception:  # an architecture transformers does not know: check_model_paths speaks for it
        return None


def check_override_config(ctx: DoctorContext) -> list[Finding]:
    """Each `override_config` key names a field of its model's config (the load refuses one that does
    not: a typo would otherwise train on without effect); checked now, before any weights load."""
    from fulcrum.models.config_override import override_problems

    cfg = ctx.cfg
    models = [("actor_rollout_ref.model", cfg.actor_rollout_ref.model)]
    if uses_critic(cfg):
        models.append(("critic.model", cfg.critic.model))
    findings = []
    for key, section in models:
        config = _model_config(str(section.path)) if section.override_config else None
        if config is not None:
            problems = override_problems(config, dict(section.override_config), f"{key}.override_config")
            findings += [_error(problem) for problem in problems]
    return findings


def check_rollout_engine(ctx: DoctorContext) -> list[Finding]:
    """The native engine's own reading of the rollout keys (dtype, engine_kwargs.native), as the run does it."""
    rollout = ctx.cfg.actor_rollout_ref.rollout
    if rollout.name != "native":
        return []
    from fulcrum.rollout.native.config import engine_config_from

    try:
        engine_config_from(rollout, model_max_len=rollout.prompt_length + rollout.response_length)
    except (ValueError, TypeError) as exc:
        return [_error(str(exc))]
    return []


def check_native_model_fields(ctx: DoctorContext) -> list[Finding]:
    """A model field the native engine does not honour (hidden_act, RoPE type...) makes the run sample
    with the slower hf backend, as fulcrum.rollout.build_rollout does; say so now (reads config.json)."""
    if ctx.cfg.actor_rollout_ref.rollout.name != "native":
        return []
    model_config = _model_config(ctx.cfg.actor_rollout_ref.model.path)
    if model_config is None:
        return []
    from fulcrum.rollout.native import native_unsupported_reason

    try:  # against the engine this configuration builds (its max_model_len)
        reason = native_unsupported_reason(ctx.cfg.actor_rollout_ref.rollout, model_config)
    except (ValueError, TypeError):  # bad engine keys: check_native_engine_kwargs speaks for them
        return []
    if reason is None:
        return []
    return [
        _warning(
            f"actor_rollout_ref.rollout.name: the native engine does not run {reason}; the run samples "
            "with the hf backend (slower, same results)"
        )
    ]


def check_linear_attention_kernels(ctx: DoctorContext) -> list[Finding]:
    """A model with linear-attention layers (Gated DeltaNet: Qwen3.5, Qwen3-Next) runs them on CUDA with
    flash-linear-attention's kernels: without the package, everywhere with the torch reference; where fla
    refuses the delta rule's backward on this machine's GPU, in the trainer's passes (`fla_trains`). Both
    run, slower: said before the run, with the fix (reads config.json; needs the GPU to ask)."""
    if ctx.device != "cuda" or ctx.n_visible == 0:
        return []
    config = _model_config(ctx.cfg.actor_rollout_ref.model.path)
    if config is None:
        return []
    import torch

    from fulcrum.models import gated_delta
    from fulcrum.models.arch import model_shape

    layers = model_shape(config).linear_layers
    if not layers:
        return []
    key = "actor_rollout_ref.model.path"
    if not gated_delta.fla_importable():
        return [
            _warning(
                f"{key}: the model's {layers} linear-attention layers run the torch reference on CUDA "
                "(generation and training, slower): pip install -e '.[linear-attention]' "
                "(flash-linear-attention) gives them its kernels"
            )
        ]
    refusal = gated_delta.fla_refusal(torch.device("cuda", 0))
    if refusal is None:
        return []
    padded = [k for k, m in _trained_models(ctx) if not m.use_remove_padding]
    return [_warning(f"{key}: {refusal}")] + [
        _error(
            f"{k}=False: padded micro-batches send the linear-attention layers to fla's refused backward; set it to True"
        )
        for k in padded
    ]


def _trained_models(ctx: DoctorContext) -> list[tuple[str, Any]]:
    """(the use_remove_padding key, the model section) of each role that takes gradients."""
    from fulcrum.workers.forwards import PADDING_KEYS

    cfg = ctx.cfg
    models = [(PADDING_KEYS["actor"], cfg.actor_rollout_ref.model)]
    if uses_critic(cfg):
        models.append((PADDING_KEYS["critic"], cfg.critic.model))
    return models


def check_tool_config(ctx: DoctorContext) -> list[Finding]:
    """A multi-turn run's tool config exists and lists tools (their classes are not imported: doctor
    never runs user code; the trainer's start-up loads them)."""
    multi_turn = ctx.cfg.actor_rollout_ref.rollout.multi_turn
    key = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
    if not multi_turn.enable or (multi_turn.interaction_config_path and not multi_turn.tool_config_path):
        return []  # a conversation with a simulated user needs no tools
    if not multi_turn.tool_config_path:
        return [
            _warning(
                f"{key} is not set: the conversations have no tools (a call is answered as an unknown tool)"
            )
        ]
    path = Path(os.path.expanduser(multi_turn.tool_config_path))
    if not path.is_file():
        return [_error(f"{key}: {path} does not exist")]
    try:
        tools = OmegaConf.to_container(OmegaConf.load(path)).get("tools")  # type: ignore[union-attr]
    except Exception as exc:
        return [_error(f"{key}: {path} is not a YAML mapping ({exc})")]
    if not isinstance(tools, list) or not tools:
        return [_error(f"{key}: {path} has no `tools:` list")]
    return []


def check_interaction_config(ctx: DoctorContext) -> list[Finding]:
    """A multi-turn run's interaction config is well formed (its classes are imported at start-up only)."""
    multi_turn = ctx.cfg.actor_rollout_ref.rollout.multi_turn
    if not (multi_turn.enable and multi_turn.interaction_config_path):
        return []
    return [_error(problem) for problem in config_problems(multi_turn.interaction_config_path)]


MODEL_CHECKS: list[Callable[[DoctorContext], list[Finding]]] = [
    check_rollout_engine,
    check_native_model_fields,
    check_linear_attention_kernels,
    check_override_config,
    check_tool_config,
    check_interaction_config,
]
