"""LoRA checkpoints: adapters and their optimiser state only (with a checked pointer to the base), exact
resume as for full fine-tuning, and `fulcrum export` as a merged Hugging Face folder or a PEFT adapter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import make_assets
from test_checkpoint_resume import overrides, read_metrics, repeatable

from fulcrum.config import load_config
from fulcrum.tools.export import main as export_main
from fulcrum.trainer.checkpoint import CheckpointError
from fulcrum.trainer.ppo_trainer import PPOTrainer

LORA = {
    "actor_rollout_ref.model.lora_rank": 4,
    "actor_rollout_ref.model.lora_alpha": 8,
    "critic.model.lora_rank": 4,
    "actor_rollout_ref.rollout.name": "native",  # keeps its own weights: a resume must re-sync them
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_assets(tmp_path_factory.mktemp("assets"), num_train=4)


@pytest.fixture(scope="module")
def straight(assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four LoRA steps (actor and critic), a checkpoint at steps 2 and 4."""
    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("lora") / "straight"
    PPOTrainer(load_config(overrides(assets, run, **LORA)), torch.device("cpu")).fit()
    return run


def test_checkpoint_holds_adapters_and_a_pointer_to_the_base(straight: Path, assets: Path) -> None:
    actor = straight / "global_step_2" / "actor"
    assert {"adapter_config.json", "adapter_model.safetensors", "base_model.json", "optimizer.pt"} <= {
        p.name for p in actor.iterdir()
    }
    assert not list(actor.glob("model*.safetensors"))  # the frozen base is not copied
    pointer = json.loads((actor / "base_model.json").read_text())
    assert pointer["path"] == str((assets / "model").resolve())
    assert set(pointer["files"]) >= {"config.json", "model.safetensors"}
    optimizer = torch.load(actor / "optimizer.pt", weights_only=True)
    from safetensors.torch import load_file

    adapters = load_file(str(actor / "adapter_model.safetensors"))
    assert len(optimizer["state"]) == len(adapters)  # AdamW moments of the adapters only
    critic = straight / "global_step_2" / "critic"
    assert (critic / "trained_weights.safetensors").is_file()  # the value head trains whole


def test_resume_equals_the_straight_run(straight: Path, assets: Path, tmp_path: Path) -> None:
    expected = read_metrics(straight)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(straight / "global_step_2", resumed / "global_step_2")
    PPOTrainer(load_config(overrides(assets, resumed, **LORA)), torch.device("cpu")).fit()
    got = read_metrics(resumed)
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        want, have = repeatable(expected[step]), repeatable(got[step])
        differing = {k: (want[k], have[k]) for k in want if want[k] != have.get(k)}
        assert not differing, f"step {step} differs after resume: {differing}"


def test_resume_refuses_a_changed_base_or_whole_weights(straight: Path, assets: Path, tmp_path: Path) -> None:
    other = tmp_path / "assets"
    shutil.copytree(assets, other)
    with torch.no_grad():  # the same architecture, other weights
        from safetensors.torch import load_file, save_file

        state = load_file(str(other / "model" / "model.safetensors"))
        save_file({k: v + 0.01 for k, v in state.items()}, str(other / "model" / "model.safetensors"))
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(straight / "global_step_2", run / "global_step_2")
    accept = {"trainer.accept_config_changes": True}  # past the run's own check of changed keys
    with pytest.raises(CheckpointError, match="base model"):
        PPOTrainer(load_config(overrides(other, run, **LORA, **accept)), torch.device("cpu")).fit()
    with pytest.raises(CheckpointError, match="holds LoRA adapters"):
        PPOTrainer(load_config(overrides(assets, run, **accept)), torch.device("cpu")).fit()


def test_export_merged_and_adapter(straight: Path, assets: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = straight / "global_step_4"
    assert export_main([str(ckpt), "--out", str(tmp_path / "merged")]) == 0
    assert export_main([str(ckpt), "--out", str(tmp_path / "adapter"), "--adapter"]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in (tmp_path / "adapter").iterdir()
    }
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    base = AutoModelForCausalLM.from_pretrained(assets / "model", dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        want = peft(input_ids=ids).logits
        with peft.disable_adapter():
            plain = peft(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (want - plain).abs().max() > 1e-4  # the adapters were trained: merging them matters
    assert export_main([str(ckpt), "--out", str(tmp_path / "critic"), "--role", "critic"]) == 1
