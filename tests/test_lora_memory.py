"""What LoRA saves: the frozen base held once in the compute dtype (no float32 master, gradient or
optimiser state), only the adapters (and a critic's value head) as float32 masters with AdamW state;
and `fulcrum doctor`'s estimate counting it (the adapters peft makes, on dense, hybrid and expert
layers), so a 7B shape fits one H200 with LoRA and not without.

On the CPU the compute dtype is float32; these tests set it to bf16, as on CUDA, to see a GPU run's
dtypes and bytes (the other LoRA tests keep float32 and exact numerics)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from arch_checks import GATED_DELTANET_SHAPE, arch_model, require_model_type
from helpers import GSM8K_ROW, seed_command
from test_lora import CPU, cfg_for, perturb, rl_batch

from fulcrum.config.sections import actor_section, critic_section, reference_section
from fulcrum.models import precision
from fulcrum.models.arch import model_shape
from fulcrum.models.lora import Adapters, LoraSettings
from fulcrum.models.precision import optimizer_state_bytes, parameter_bytes
from fulcrum.tools import doctor, lora_params
from fulcrum.tools.lora_params import adapter_param_count
from fulcrum.workers.actor import ActorWorker, reference_worker
from fulcrum.workers.critic import CriticWorker

BF16, FP32 = torch.bfloat16, torch.float32


@pytest.fixture
def bf16_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(precision.COMPUTE_DTYPES, "cpu", BF16)


def counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trained, frozen) parameter counts."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trained, sum(p.numel() for p in model.parameters()) - trained


def test_lora_actor_holds_its_base_once_in_bf16(tiny_dir: str, bf16_compute: None) -> None:
    torch.manual_seed(0)
    full = ActorWorker(actor_section(cfg_for(tiny_dir, "actor_rollout_ref.model.lora_rank=0")), CPU, 2)
    n_full = sum(p.numel() for p in full.model.parameters())
    cfg = cfg_for(tiny_dir)
    actor = ActorWorker(actor_section(cfg), CPU, 2)
    n_adapters, n_base = counts(actor.model)
    assert n_base == n_full
    for name, p in actor.model.named_parameters():
        assert p.dtype == (FP32 if p.requires_grad else BF16), name
    # The compute copies are the adapters' alone: the base is already in the compute dtype.
    assert actor.forwards.compute is not None
    assert {id(p) for p in actor.forwards.compute.masters} == {
        id(p) for p in actor.model.parameters() if p.requires_grad
    }
    base = {n: p.detach().clone() for n, p in actor.model.named_parameters() if not p.requires_grad}

    perturb(actor)
    batch = rl_batch()
    batch["old_log_probs"], _ = actor.compute_log_prob(batch)
    batch["ref_log_prob"] = reference_worker(reference_section(cfg), CPU, actor).compute_ref_log_prob(batch)
    metrics, _ = actor.update_policy(batch, global_step=1)
    assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
    full.update_policy(batch, global_step=1)

    # Bytes: the LoRA actor 2 B per base parameter + 4 B per adapter + AdamW's 8 B per adapter; the
    # full actor 4 + 8 B per parameter. The gradients were released by the optimiser step.
    assert parameter_bytes(actor.model) == {"trained": 4 * n_adapters, "frozen": 2 * n_base}
    assert optimizer_state_bytes(actor.optimizer) == 8 * n_adapters
    assert parameter_bytes(full.model) == {"trained": 4 * n_full, "frozen": 0}
    assert optimizer_state_bytes(full.optimizer) == 8 * n_full
    assert actor.forwards.compute.copies == []  # nothing of the pass stays resident
    for name, p in actor.model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None and p.dtype == BF16 and torch.equal(p, base[name]), name
    # The engine gets W + scale·B·A summed in float32 from the bf16 base.
    name, merged = next(iter(actor.named_weights()))
    assert merged.dtype == FP32 and name.endswith(".weight")


def test_lora_critic_keeps_a_bf16_base_and_a_float32_value_head(tiny_dir: str, bf16_compute: None) -> None:
    cfg = cfg_for(tiny_dir, "critic.model.lora_rank=4", "critic.model.enable_gradient_checkpointing=False")
    critic = CriticWorker(critic_section(cfg), CPU, total_training_steps=1)
    for name, p in critic.model.named_parameters():
        assert p.dtype == (FP32 if p.requires_grad else BF16), name
    batch = rl_batch()
    batch["values"] = critic.compute_values(batch)
    batch["returns"] = batch["values"] + batch["advantages"]
    critic.update_critic(batch, global_step=1)
    trained, _ = counts(critic.model)
    assert optimizer_state_bytes(critic.optimizer) == 8 * trained


@pytest.mark.parametrize(
    "targets, exclude",
    [("all-linear", None), (["q_proj", "v_proj", "down_proj"], ".*down_proj"), (".*layers.0.*_proj", None)],
)
def test_adapter_count_of_the_estimate_equals_peft(tiny_dir: str, targets, exclude) -> None:
    keys = [f"actor_rollout_ref.model.target_modules={json.dumps(targets)}"]
    if exclude is not None:
        keys.append(f"actor_rollout_ref.model.exclude_modules={exclude}")
    actor = ActorWorker(actor_section(cfg_for(tiny_dir, *keys)), CPU, 1)
    shape = model_shape(json.loads((Path(tiny_dir) / "config.json").read_text()))
    assert adapter_param_count(shape, 4, targets, exclude) == counts(actor.model)[0]


# Qwen2.5-7B's shape: 7.6B parameters, an untied LM head.
QWEN25_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "max_position_embeddings": 32768,
}


def test_doctor_says_a_7b_shape_fits_one_h200_with_lora_only(
    tmp_path: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """GRPO with a KL loss on one 140 GiB device: full fine-tuning keeps 16 B a parameter (and a float32
    reference); LoRA rank 32 keeps the bf16 base, 80.7M adapters and no reference copy."""
    for name, rows in (("train.parquet", 64), ("test.parquet", 8)):
        pq.write_table(pa.Table.from_pylist([GSM8K_ROW] * rows), tmp_path / name)
    shutil.copytree(tiny_model, tmp_path / "model")
    config_file = tmp_path / "model" / "config.json"
    config = {k: v for k, v in json.loads(config_file.read_text()).items() if k != "layer_types"}
    config_file.write_text(json.dumps({**config, **QWEN25_7B}))
    grpo = [
        *seed_command(tmp_path),
        "data.train_batch_size=64",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=5",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
        "--device-memory-gib",
        "140",
    ]
    code, out = doctor.main(grpo), capsys.readouterr().out
    assert code == 1 and "error: predicted out of memory in actor update: 188.6 GiB" in out
    lora = ["actor_rollout_ref.model.lora_rank=32", "actor_rollout_ref.model.lora_alpha=32"]
    code, out = doctor.main([*grpo, *lora, "actor_rollout_ref.model.use_shm=True"]), capsys.readouterr().out
    assert "predicted out of memory" not in out
    assert "warning: actor_rollout_ref.model.use_shm=True: no effect, the model loads from its folder" in out
    assert "14.19 GiB  actor frozen base (bf16)" in out
    assert "0.30 GiB  actor LoRA adapters (fp32)" in out  # 28 x 32 x 90,112 = 80.7M parameters
    assert "reference weights" not in out  # the reference is the base with the adapters off
    assert adapter_param_count(model_shape(QWEN25_7B), 32, "all-linear") == 80_740_352


HYBRID_AND_EXPERT_SHAPES = {
    "qwen3_5_text": dict(GATED_DELTANET_SHAPE, num_hidden_layers=4),
    "qwen3_next": dict(
        GATED_DELTANET_SHAPE, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[2],
    ),
    "qwen3_moe": dict(
        num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1]
    ),
}  # fmt: skip


@pytest.mark.parametrize("arch", sorted(HYBRID_AND_EXPERT_SHAPES))
@pytest.mark.parametrize(
    "targets, exclude",
    [
        ("all-linear", None),
        (["q_proj", "v_proj", "down_proj"], ".*down_proj"),
        (".*layers.0.*_proj", None),
        (["in_proj_qkv", "in_proj_qkvz", "in_proj_b", "out_proj", "gate", "gate_proj", "up_proj"], None),
        ("all-linear", ["in_proj_z", "k_proj", "shared_expert_gate"]),
    ],
    ids=["all-linear", "names-and-exclude", "regex", "mixer-and-expert-names", "all-but-some"],
)
def test_adapter_count_of_hybrid_and_expert_layers_equals_peft(arch: str, targets, exclude) -> None:
    """What LoRA wraps on Qwen3.5 (Gated DeltaNet's in_proj_qkv/z/b/a and out_proj, an output-gated
    q_proj twice as wide), Qwen3-Next (its fused in_proj_qkvz and in_proj_ba, the shared expert's gate)
    and Qwen3-MoE, whose routers and fused experts peft adapts as parameters (and, from peft 0.22, the
    Linears of a dense layer or a shared expert of the experts' projection names too): the estimate's
    count is the trainable parameter count of the model `Adapters` makes with the installed peft."""
    require_model_type(arch)
    model = arch_model(arch, HYBRID_AND_EXPERT_SHAPES[arch])
    as_key = tuple(targets) if isinstance(targets, list) else targets
    settings = LoraSettings(rank=4, alpha=8.0, target_modules=as_key, exclude_modules=exclude)
    adapters = Adapters(model, settings, "unused", base_dtype=FP32)
    trained = sum(p.numel() for p in adapters.parameters())
    assert trained > 0
    assert adapter_param_count(model_shape(model.config), 4, targets, exclude) == trained


@pytest.mark.parametrize("version, linears_too", [("0.21.2", False), ("0.22.0", True), ("1.0.0rc1", True)])
def test_the_expert_name_rule_follows_the_installed_peft(
    monkeypatch: pytest.MonkeyPatch, version: str, linears_too: bool
) -> None:
    """A dense layer's MLP in a mixture of experts: adapted from peft 0.22 on, not under 0.21, and the
    count says so (Qwen3-MoE's shape above, all-linear, rank 4: layer 1's dense MLP is 3 x 4 x (64 + 128))."""
    monkeypatch.setattr(lora_params.importlib.metadata, "version", lambda name: version)
    assert lora_params.peft_adapts_linears_of_expert_names() is linears_too
    shape = model_shape(arch_model("qwen3_moe", HYBRID_AND_EXPERT_SHAPES["qwen3_moe"]).config)
    dense_mlp = 3 * 4 * (64 + 128)
    assert adapter_param_count(shape, 4, "all-linear") == 17_184 + (dense_mlp if linears_too else 0)
