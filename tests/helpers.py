"""Set-up shared by the end-to-end tests: a tiny model with synthetic data, and the CPU PPO overrides."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from fulcrum.algo.policy_losses import LossConfig, get_policy_loss_fn, vanilla_policy_loss
from fulcrum.data.synthetic import write_splits
from fulcrum.models.tiny import build_tiny_model

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}

# Qwen2.5-0.5B's shape (the keys doctor's rules and estimate read).
QWEN25_05B = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
}


def model_folder_of_shape(tiny_model: Path, out: Path, fields: dict[str, Any]) -> Path:
    """A copy of the tiny model folder at `out` whose config.json says `fields` (a shape for doctor, which
    reads the config and loads no weights)."""
    shutil.copytree(tiny_model, out)
    config_file = out / "config.json"
    config = {k: v for k, v in json.loads(config_file.read_text()).items() if k != "layer_types"}  # per layer
    config_file.write_text(json.dumps({**config, **fields}))
    return out


def make_assets(root: Path, num_train: int = 8, num_test: int = 2) -> Path:
    """`root/model` (the TINY model) and `root/data/{train,test}.parquet` (synthetic GSM8K rows)."""
    build_tiny_model(root / "model", intermediate_size=64, **TINY)
    write_splits(root / "data", num_train=num_train, num_test=num_test)
    return root


def cpu_ppo_overrides(assets: Path, run_dir: Path, keys: dict[str, object]) -> list[str]:
    """PPO with a critic on the CPU with the hf engine, batch 2, micro-batches of 2; `keys` add or replace keys."""
    base: dict[str, object] = {
        "data.train_files": assets / "data/train.parquet",
        "data.val_files": assets / "data/test.parquet",
        "data.train_batch_size": 2,
        "data.max_prompt_length": 128,
        "actor_rollout_ref.model.path": assets / "model",
        "critic.model.path": assets / "model",
        "actor_rollout_ref.rollout.name": "hf",
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
        "critic.ppo_micro_batch_size_per_gpu": 2,
        "trainer.device": "cpu",
        "trainer.n_gpus_per_node": 1,
        "trainer.default_local_dir": run_dir,
    }
    return [f"{k}={v}" for k, v in {**base, **keys}.items()]


def short_run_overrides(assets: Path, run_dir: Path, **extra: object) -> list[str]:
    """`cpu_ppo_overrides` for a short run: 2 steps of 4-token responses, no validation, a checkpoint
    every step; `extra` adds or replaces keys."""
    keys = {
        "data.max_response_length": 4,
        "trainer.val_before_train": False,
        "trainer.test_freq": -1,
        "trainer.save_freq": 1,
        "trainer.total_training_steps": 2,
    }
    return cpu_ppo_overrides(assets, run_dir, {**keys, **extra})


# The seed command lives in test_config.py; load it by path so this works however pytest is invoked.
_spec = importlib.util.spec_from_file_location("_test_config", Path(__file__).with_name("test_config.py"))
_test_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_test_config)
seed_command = _test_config.seed_command

# One verl-schema GSM8K row (the columns `fulcrum doctor` and the dataset read).
GSM8K_ROW = {
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": "1 + 1?"}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "2"},
    "extra_info": {"split": "train", "index": 0},
}


def verl_fixture_policy_loss(
    p: dict[str, torch.Tensor],
    loss_agg_mode: str,
    loss_mode: str,
    rollout_is_weights: torch.Tensor | None = None,
    **actor_keys: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The registered loss `loss_mode` on a verl fixture's `policy` inputs (clip_ratio 0.2, the fixture's
    clip_low and clip_high, `actor_keys` for the rest of the actor config), backpropagated; returns the
    loss, its metrics and the log-prob tensor (float [B, T], its `.grad` the loss's gradient)."""
    log_prob = p["log_prob"].clone().requires_grad_(True)
    config = LossConfig(
        clip_ratio=0.2, clip_ratio_low=p["clip_low"], clip_ratio_high=p["clip_high"], **actor_keys
    )
    loss, metrics = get_policy_loss_fn(loss_mode)(
        p["old_log_prob"], log_prob, p["advantages"], p["mask"], loss_agg_mode, config, rollout_is_weights
    )
    loss.backward()
    return loss, metrics, log_prob


def ppo_loss(
    old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped loss with the actor's default keys (clip 0.2, token-mean)."""
    return vanilla_policy_loss(old_log_prob, log_prob, advantages, mask, "token-mean", LossConfig())


def log_probs_of(
    model: Any,
    mb: Any,
    temperature: float,
    with_entropy: bool,
    device: torch.device,
    packed: bool = False,
    sp: Any = None,
    fp32_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The actor's forward on a micro-batch as the host holds it: log-probs (and entropies) (B, R)."""
    from fulcrum.workers.forwards import LogProbHead, forward_batch

    outs = forward_batch(model, mb, LogProbHead(temperature, with_entropy, fp32_logits), device, packed, sp)
    return outs[0], (outs[1] if with_entropy else None)


def values_of(
    model: Any, mb: Any, device: torch.device, packed: bool = False, sp: Any = None
) -> torch.Tensor:
    """The critic's forward on a micro-batch as the host holds it: values (B, R)."""
    from fulcrum.workers.forwards import ValueHead, forward_batch

    return forward_batch(model, mb, ValueHead(), device, packed, sp)[0]
