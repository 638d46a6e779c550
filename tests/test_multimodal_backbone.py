"""The critic's backbone of a multimodal folder whose causal LM is its text model alone (Qwen3.5's `qwen3_5`,
Qwen3_5ForConditionalGeneration, its text model's config in `text_config`): the text model, as the
actor's `AutoModelForCausalLM` loads it, with no vision tower; the value head trains on it, padded and
packed; its checkpoint folder is the multimodal token classifier's, which `AutoModelForTokenClassification`
loads with the critic's values and the trainer reads back in place."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from arch_checks import EOS, GATED_DELTANET_SHAPE, VOCAB
from test_cuda_graphs import rl_batch
from test_workers_update import cfg_for
from transformers import AutoConfig, AutoModelForImageTextToText, AutoModelForTokenClassification

from fulcrum.config.sections import critic_section
from fulcrum.models.load import load_backbone, text_model_config
from fulcrum.models.value_head import CriticModel
from fulcrum.rollout.testing import TINY_SHAPE
from fulcrum.trainer.checkpoint.hf_folder import load_model_weights, save_model_folder
from fulcrum.workers.critic import CriticWorker

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A tiny Qwen3.5 checkpoint as released: the multimodal model, saved (its folder and the model)."""
    text = {**TINY_SHAPE, **GATED_DELTANET_SHAPE, "num_hidden_layers": 4, "vocab_size": VOCAB}
    text["eos_token_id"] = EOS
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=64)
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision)
    full = AutoModelForImageTextToText.from_config(config).eval()
    folder = tmp_path_factory.mktemp("qwen3_5")
    full.save_pretrained(folder)
    return folder, full


def test_the_backbone_is_the_text_model_with_its_weights(multimodal: tuple[Path, torch.nn.Module]) -> None:
    folder, full = multimodal
    assert any("visual" in name for name, _ in full.named_parameters())
    backbone = load_backbone(str(folder), CPU)
    assert backbone.config.model_type == "qwen3_5_text"
    assert not any("visual" in name for name, _ in backbone.named_parameters())
    expected = full.model.language_model.state_dict()
    got = backbone.state_dict()
    assert set(got) == set(expected)
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    ids = torch.tensor([[5, 9, 300, 41]])
    with torch.no_grad():
        assert torch.equal(
            backbone(input_ids=ids).last_hidden_state,
            full.model.language_model(input_ids=ids).last_hidden_state,
        )


def test_only_a_multimodal_config_whose_causal_lm_is_its_text_model_is_read_as_its_text_model() -> None:
    composite = AutoConfig.for_model("qwen3_5", text_config={"num_hidden_layers": 2})
    assert text_model_config(composite).model_type == "qwen3_5_text"
    assert text_model_config(composite.get_text_config()) is None  # already the text model
    assert text_model_config(AutoConfig.for_model("gemma3")) is None  # its causal LM is the whole model
    assert text_model_config(AutoConfig.for_model("qwen2")) is None


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_value_head_trains_on_the_text_model_and_its_checkpoint_reloads(
    multimodal: tuple[Path, torch.nn.Module], tmp_path: Path, packed: bool
) -> None:
    """Two critic updates move the value head and the backbone; the checkpoint folder, written as the
    multimodal token classifier's, loads in `AutoModelForTokenClassification` with the critic's values
    (its vision tower newly initialised, never run on text) and back into a fresh critic in place."""
    folder, _ = multimodal
    cfg = cfg_for(str(folder), f"critic.model.use_remove_padding={packed}")
    critic = CriticWorker(critic_section(cfg), CPU, total_training_steps=2)
    assert not any("visual" in name for name, _ in critic.model.named_parameters())
    before = {name: p.detach().clone() for name, p in critic.model.named_parameters()}
    batch = rl_batch()
    metrics = [critic.update_critic(batch, step) for step in range(2)]
    assert all(torch.isfinite(torch.tensor(m["critic/vf_loss"])) for m in metrics)
    moved = [name for name, p in critic.model.named_parameters() if not torch.equal(p, before[name])]
    assert "score.weight" in moved and any(name.startswith("model.layers.") for name in moved)

    save_model_folder(critic.model, None, tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).architectures == ["Qwen3_5ForTokenClassification"]
    ids = batch["input_ids"][:2]
    with torch.no_grad():
        values = critic.model.eval()(ids)
        hf = AutoModelForTokenClassification.from_pretrained(tmp_path).eval()
        torch.testing.assert_close(hf(input_ids=ids).logits[..., 0], values, atol=1e-5, rtol=1e-5)
    fresh = CriticModel(load_backbone(str(folder), CPU))
    load_model_weights(fresh, tmp_path)
    assert all(torch.equal(p, dict(critic.model.named_parameters())[n]) for n, p in fresh.named_parameters())
