"""LoRA as verl runs it: adapters on the named modules over a frozen base, the reference from the same
weights with the adapters off, the engine given the adapters' merged effect, packed equal to padded."""

from __future__ import annotations

import pytest
import torch
from test_workers_units import make_batch  # tests/ is on sys.path under pytest

from fulcrum.config import load_config
from fulcrum.config.sections import actor_section, critic_section, reference_section
from fulcrum.models.load import load_causal_lm, load_tokenizer
from fulcrum.models.lora import adapted_layers
from fulcrum.rollout import SamplingParams
from fulcrum.trainer.startup import engine_model_of
from fulcrum.workers.actor import (
    ActorWorker,
    AdaptersOffReference,
    ReferenceWorker,
    reference_worker,
)
from fulcrum.workers.critic import CriticWorker

CPU = torch.device("cpu")
ALL_LINEAR = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def cfg_for(model: str, *extra: str):
    return load_config(
        [
            f"actor_rollout_ref.model.path={model}",
            f"critic.model.path={model}",
            "actor_rollout_ref.model.lora_rank=4",
            "actor_rollout_ref.model.lora_alpha=8",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "critic.ppo_micro_batch_size_per_gpu=4",
            "trainer.device=cpu",
            *extra,
        ]
    )


def rl_batch(seed: int = 0):
    batch = make_batch(b=8, p=10, r=7, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=g) * batch["response_mask"].float()
    return batch


def perturb(actor: ActorWorker, seed: int = 0) -> None:
    """Adapters of a given seed, non-zero (peft starts B at zero, where adapters change nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in actor.model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def test_all_linear_adapts_every_linear_but_lm_head_and_freezes_the_base(tiny_dir: str) -> None:
    actor = ActorWorker(actor_section(cfg_for(tiny_dir)), CPU, total_training_steps=1)
    layers = [name for name, _ in adapted_layers(actor.model)]
    assert {name.rsplit(".", 1)[1] for name in layers} == ALL_LINEAR
    assert len(layers) == len(ALL_LINEAR) * actor.model.config.num_hidden_layers
    trained = {name for name, p in actor.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in name or ".lora_B." in name for name in trained)
    optimised = {id(p) for group in actor.optimizer.param_groups for p in group["params"]}
    assert optimised == {id(p) for p in actor.model.parameters() if p.requires_grad}
    assert type(actor.model).__name__ == "Qwen2ForCausalLM"  # the module keeps its class


def test_target_and_exclude_modules_pick_the_adapted_layers(tiny_dir: str) -> None:
    cfg = cfg_for(
        tiny_dir,
        "actor_rollout_ref.model.target_modules=[q_proj,v_proj,down_proj]",
        "actor_rollout_ref.model.exclude_modules=.*down_proj",
    )
    actor = ActorWorker(actor_section(cfg), CPU, total_training_steps=1)
    assert {name.rsplit(".", 1)[1] for name, _ in adapted_layers(actor.model)} == {"q_proj", "v_proj"}
    with pytest.raises(ValueError, match="target_modules"):
        ActorWorker(
            actor_section(cfg_for(tiny_dir, "actor_rollout_ref.model.target_modules=[nothing_here]")),
            CPU,
            total_training_steps=1,
        )


def test_an_embedding_adapter_is_never_sent_to_the_engine_as_its_base(tiny_dir: str) -> None:
    """Past the configuration rule (which knows Hugging Face's `model.embed_tokens`, not every family's
    spelling), the weight sync refuses an adapted embedding instead of sending its untrained base."""
    cfg = cfg_for(tiny_dir, "actor_rollout_ref.model.target_modules='model\\.embed_tokens|.*q_proj'")
    actor = ActorWorker(actor_section(cfg), CPU, total_training_steps=1)
    with pytest.raises(ValueError, match=r"target_modules=.*model\.embed_tokens is an embedding"):
        dict(actor.adapters.merged_weights())


def test_update_trains_only_the_adapters(tiny_dir: str) -> None:
    actor = ActorWorker(actor_section(cfg_for(tiny_dir)), CPU, total_training_steps=10)
    perturb(actor)
    batch = rl_batch()
    batch["old_log_probs"], _ = actor.compute_log_prob(batch)
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    metrics, _ = actor.update_policy(batch, global_step=1)
    assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
    after = dict(actor.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and changed <= {n for n, p in after.items() if p.requires_grad}
    assert any("lora_A" in n for n in changed)


def test_reference_is_the_base_model_from_the_same_weights(tiny_dir: str) -> None:
    cfg = cfg_for(tiny_dir)
    actor = ActorWorker(actor_section(cfg), CPU, total_training_steps=1)
    ref = reference_worker(reference_section(cfg), CPU, actor)
    assert isinstance(ref, AdaptersOffReference) and ref.forwards.model is actor.model  # no second model
    perturb(actor)
    batch = rl_batch()
    plain = ReferenceWorker(reference_section(cfg), CPU)  # the base loaded on its own, to compare
    want = plain.compute_ref_log_prob(batch)
    got = ref.compute_ref_log_prob(batch)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-6, rtol=0)
    policy, _ = actor.compute_log_prob(batch)  # the adapters are back on after the reference pass
    assert (policy[mask] - want[mask]).abs().max() > 1e-2


def test_packed_log_probs_with_lora_equal_padded(tiny_dir: str) -> None:
    batch = rl_batch()
    out = {}
    for packed in (True, False):
        cfg = cfg_for(tiny_dir, f"actor_rollout_ref.model.use_remove_padding={packed}")
        actor = ActorWorker(actor_section(cfg), CPU, total_training_steps=1)
        assert actor.forwards.packed is packed
        perturb(actor)
        out[packed], _ = actor.compute_log_prob(batch)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(out[True][mask], out[False][mask], atol=1e-5, rtol=0)


def test_critic_lora_trains_adapters_and_the_value_head(tiny_dir: str) -> None:
    cfg = cfg_for(tiny_dir, "critic.model.lora_rank=4", "critic.model.enable_gradient_checkpointing=False")
    critic = CriticWorker(critic_section(cfg), CPU, total_training_steps=1)
    trained = {name for name, p in critic.model.named_parameters() if p.requires_grad}
    assert {"score.weight", "score.bias"} <= trained
    assert all("lora_" in name or name.startswith("score.") for name in trained)
    assert any("lora_A" in name for name in trained)


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_engine_samples_from_the_updated_adapters(tiny_dir: str, backend: str) -> None:
    """After a sync the engine's log-probs of its own samples equal the trainer's (fp32 on the CPU);
    an engine left with the old weights is far off, so the check would catch a missed sync."""
    from fulcrum.rollout import build_rollout

    cfg = cfg_for(tiny_dir, f"actor_rollout_ref.rollout.name={backend}", "data.max_response_length=6")
    arr = cfg.actor_rollout_ref
    actor = ActorWorker(actor_section(cfg), CPU, total_training_steps=1)
    engine = build_rollout(arr.rollout, engine_model_of(actor, arr, CPU), load_tokenizer(tiny_dir), CPU)
    engine.update_weights(actor.named_weights())
    perturb(actor, seed=3)  # what an update does to the adapters

    sent = [name for name, _ in actor.named_weights()]
    assert sent == [f"{name}.weight" for name, _ in adapted_layers(actor.model)]  # only the adapted modules

    def gap() -> float:
        prompts = [[1, 2, 3, 4], [5, 6, 7]]
        out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=0))
        gaps = []
        for i, (ids, logps) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            prompt = prompts[out.prompt_index[i]]
            full = torch.tensor([prompt + ids])
            with torch.no_grad():
                logits = actor.model(input_ids=full).logits[0, len(prompt) - 1 : -1].float()
            train = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
            gaps.append((train - torch.tensor(logps)).abs().max().item())
        return max(gaps)

    if backend == "native":
        assert gap() > 1e-2  # stale: the adapters moved, the engine was not told
    engine.update_weights(actor.named_weights())
    assert gap() < 1e-4
    base = dict(load_causal_lm(tiny_dir, CPU).named_parameters())
    for name, layer in adapted_layers(actor.model):  # the sync never wrote into the frozen base
        assert torch.equal(layer.get_base_layer().weight, base[f"{name}.weight"]), name
