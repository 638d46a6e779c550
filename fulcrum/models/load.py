"""Loading Hugging Face checkpoints for training: fp32 master weights, optional gradient checkpointing.

Mixed precision is applied at forward time (bf16 compute copies or autocast on CUDA, see
`fulcrum.models.precision` and `autocast_for`), so trained parameters and the optimiser state stay in
float32 as in verl's FSDP workers. A LoRA model's frozen base is loaded in the compute dtype instead
(`dtype`, from `LoraSettings.base_dtype`): it has no master to keep.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers import logging as hf_logging

from fulcrum.models.config_override import apply_override, loader_kwargs, override_key
from fulcrum.models.folder import ModelPathError, model_folder_problems, resolve_model_path


def _check_model_dir(path: str, key: str, needs_tokenizer: bool = False, needs_weights: bool = True) -> str:
    """The path to load from, or a ModelPathError naming the key, the folder and what is wrong."""
    resolved = resolve_model_path(path, key)
    problems = model_folder_problems(
        resolved, key, needs_tokenizer=needs_tokenizer, needs_weights=needs_weights
    )
    if problems:
        raise ModelPathError("; ".join(problems))
    return resolved


# From_pretrained's keyword that keeps transformers' Hub kernels off (`switch_off_hub_kernels`).
NO_HUB_KERNELS: dict[str, Any] = {"use_kernels": False}


def switch_off_hub_kernels(model: nn.Module) -> nn.Module:
    """`model` with transformers' Hub kernels switched off, its modules' own forwards back.

    With the `kernels` package installed (transformers 5.2x requires it), transformers kernelizes the models
    it builds, and again at every `train()` / `eval()`: it fetches kernels from the Hugging Face Hub at run
    time, where fulcrum downloads nothing, and it resets the `forward` of every module it has a mapping for
    (Qwen3.5's Gated DeltaNet among them), which would silently undo `enable_packed_recurrence` at the
    actor's first `train()` and carry the recurrent state across the sequences of a packed stream."""
    for module in model.modules():  # a LoRA wrapper holds the transformers model inside
        if isinstance(module, PreTrainedModel) and getattr(module, "use_kernels", False):
            module.use_kernels = False  # transformers' reset: the torch forwards, no kernelize on train()
    return model


def load_tokenizer(
    path: str, key: str = "actor_rollout_ref.model.path", trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer, with a pad token guaranteed (falls back to EOS as verl does)."""
    path = _check_model_dir(path, key, needs_tokenizer=True, needs_weights=False)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    path: str,
    device: torch.device,
    gradient_checkpointing: bool = False,
    key: str = "actor_rollout_ref.model.path",
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
    override_config: Mapping[str, Any] | None = None,
) -> nn.Module:
    """`AutoModelForCausalLM` in `dtype` (float32 masters by default) on `device` (the actor, the
    reference policy, the engine's copy, `fulcrum sft`), with verl's `override_config` of the model
    section `key` names set on its config (`fulcrum.models.config_override`)."""
    path = _check_model_dir(path, key)
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        **NO_HUB_KERNELS,
        **overridden(path, key, override_config, trust_remote_code),
    )
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model.to(device)


def text_model_config(config: Any) -> Any:
    """The text model's config when `config` is a multimodal model whose causal LM is its text model alone,
    else None. `AutoModelForCausalLM`'s rule: the class it maps the config to is built from the config's
    `text_config` class (Qwen3.5's `qwen3_5`, Qwen3_5ForCausalLM over its text config; Gemma 3's
    `gemma3` maps to the whole multimodal model, so it is not one)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    text_class = getattr(config, "sub_configs", {}).get("text_config")
    if text_class is None or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return None
    if getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], "config_class", None) is not text_class:
        return None
    return config.get_text_config()


def load_backbone(
    path: str,
    device: torch.device,
    key: str = "critic.model.path",
    dtype: torch.dtype = torch.float32,
    override_config: Mapping[str, Any] | None = None,
) -> nn.Module:
    """`AutoModel` (no LM head) in `dtype` (float32 masters by default): the critic's trunk, whose last
    hidden state feeds a value head; verl's `override_config` set on its config as in `load_causal_lm`.
    Of a multimodal folder whose causal LM is its text model alone (`text_model_config`), the text model
    alone, as `load_causal_lm` loads it (no vision tower), with the folder's config kept as its
    `fulcrum_multimodal_config` (a Hugging Face token classifier of it is the multimodal one's)."""
    path = _check_model_dir(path, key)
    kwargs = overridden(path, key, override_config) or {"config": AutoConfig.from_pretrained(path)}
    folder_config = kwargs["config"]
    text = text_model_config(folder_config)
    if text is not None:  # AutoModel maps the folder's config to the multimodal model
        kwargs["config"] = text
    # A causal-LM folder has an lm_head the backbone does not use, a multimodal one a vision tower:
    # expected, so silence the load report.
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = AutoModel.from_pretrained(path, dtype=dtype, **NO_HUB_KERNELS, **kwargs)
    finally:
        hf_logging.set_verbosity(previous)
    if text is not None:
        model.fulcrum_multimodal_config = folder_config
    return model.to(device)


def overridden(
    path: str, key: str, override: Mapping[str, Any] | None, trust_remote_code: bool = False
) -> dict[str, Any]:
    """`from_pretrained`'s keywords for verl's `override_config` (`config`: the folder's with the
    override set on it; `attn_implementation` as verl hands it over); none without an override. A key
    the config lacks is a ValueError naming `<section>.override_config.<key>` (`key` names the
    section's `path`)."""
    if not override:
        return {}
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    apply_override(config, override, override_key(key))
    return {"config": config, **loader_kwargs(override)}


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute activations in backward; non-reentrant so that inputs need no `requires_grad`."""
    # transformers >= 5.2x renamed the switch; older versions only have gradient_checkpointing_enable.
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # A KV cache is useless (and warned about) during a checkpointed training forward.
    if hasattr(model, "config"):
        model.config.use_cache = False


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (fp32 master weights stay untouched); plain fp32 elsewhere."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
