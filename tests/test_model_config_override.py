"""verl's `model.override_config` reaches every model built from the folder (actor, reference, critic,
the engine's copy), a key the config lacks is an error naming it, and an MoE override turns the
router's load-balancing loss on; the engine's own copy of a sharded actor is built in the compute dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from arch_checks import arch_model
from test_lora import rl_batch  # tests/ is on sys.path under pytest
from test_workers_update import cfg_for

from fulcrum.config.sections import actor_section, critic_section, reference_section
from fulcrum.models import precision
from fulcrum.models.config_override import apply_override
from fulcrum.trainer import startup
from fulcrum.trainer.startup import engine_model_of
from fulcrum.workers.actor import ActorWorker, ReferenceWorker
from fulcrum.workers.critic import CriticWorker

CPU = torch.device("cpu")
KEY = "actor_rollout_ref.model.override_config"


def test_apply_override_sets_fields_and_names_an_unknown_key() -> None:
    from transformers import Qwen2Config

    config = Qwen2Config()
    apply_override(config, {"attention_dropout": 0.25, "attn_implementation": "eager"}, KEY)
    assert config.attention_dropout == 0.25
    apply_override(config, {"head_dim": 32}, KEY)  # not a Qwen2 field, but its attention reads it
    assert config.head_dim == 32
    with pytest.raises(
        ValueError, match=rf"{KEY}\.attention_dropot: .*did you mean {KEY}\.attention_dropout"
    ):
        apply_override(config, {"attention_dropot": 0.0}, KEY)
    assert config.attention_dropout == 0.25  # a refused override changes nothing


def test_override_reaches_actor_reference_critic_and_engine(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = cfg_for(
        str(tiny_model),
        f"+{KEY}.attention_dropout=0.25",
        "+critic.model.override_config.attention_dropout=0.5",
    )
    actor = ActorWorker(actor_section(cfg), CPU, total_training_steps=1)
    ref = ReferenceWorker(reference_section(cfg), CPU)
    critic = CriticWorker(critic_section(cfg), CPU, total_training_steps=1)
    assert actor.model.config.attention_dropout == 0.25
    assert ref.model.config.attention_dropout == 0.25
    assert critic.model.config.attention_dropout == 0.5
    arr = cfg.actor_rollout_ref
    assert engine_model_of(actor, arr, CPU).config.attention_dropout == 0.25  # the actor's own module
    monkeypatch.setattr(startup, "is_sharded", lambda _: True)  # the engine's copy of a sharded actor
    assert engine_model_of(actor, arr, CPU).config.attention_dropout == 0.25


def test_an_unknown_override_key_stops_the_load_naming_it(tiny_model: Path) -> None:
    cfg = cfg_for(str(tiny_model), f"+{KEY}.attention_dropot=0.0")
    with pytest.raises(ValueError, match=rf"{KEY}\.attention_dropot"):
        ActorWorker(actor_section(cfg), CPU, total_training_steps=1)


def test_engine_copy_of_a_sharded_actor_is_built_in_the_compute_dtype(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine runs in the compute dtype: its copy is loaded in it (bf16 on CUDA, forced here), not
    as float32 masters (28 GB for a 7B), with the actor's weights rounded once."""
    cfg = cfg_for(str(tiny_model))
    actor = ActorWorker(actor_section(cfg), CPU, total_training_steps=1)
    monkeypatch.setitem(precision.COMPUTE_DTYPES, "cpu", torch.bfloat16)
    monkeypatch.setattr(startup, "is_sharded", lambda _: True)
    engine_model = engine_model_of(actor, cfg.actor_rollout_ref, CPU)
    assert engine_model is not actor.model
    trained = dict(actor.model.named_parameters())
    for name, param in engine_model.named_parameters():
        assert param.dtype == torch.bfloat16, name
        torch.testing.assert_close(param, trained[name].detach().to(torch.bfloat16), atol=0, rtol=0)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small Qwen3-MoE folder whose config leaves the router loss off (as released checkpoints do)."""
    shape = dict(
        num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=16
    )
    model = arch_model("qwen3_moe", shape)
    assert not model.config.output_router_logits
    folder = Path(tmp_path_factory.mktemp("moe"))
    model.save_pretrained(folder)
    return str(folder)


def test_an_moe_override_turns_the_router_loss_on(moe_dir: str) -> None:
    plain = ActorWorker(actor_section(cfg_for(moe_dir)), CPU, total_training_steps=1)
    assert plain.loss.router is None
    cfg = cfg_for(moe_dir, f"+{KEY}.output_router_logits=true", f"+{KEY}.router_aux_loss_coef=0.01")
    actor = ActorWorker(actor_section(cfg), CPU, total_training_steps=1)
    assert actor.loss.router == (0.01, 2)
    batch = rl_batch(seed=0)  # token ids below 1000: within arch_model's vocabulary
    batch["old_log_probs"], _ = actor.compute_log_prob(batch)
    metrics, _ = actor.update_policy(batch, global_step=1)
    assert metrics["actor/load_balancing_loss"] > 0
