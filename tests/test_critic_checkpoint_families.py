"""A critic whose backbone's model type transformers gives no token classifier (OLMo 3, Gemma 3's text
model, Qwen3.5's text model alone) is saved in the token classifier's layout with its backbone's config
(`architectures` = the `AutoModel` class, `fulcrum_value_head = "score"`): the run's resume reads it back
with the same values, and `AutoModel` loads its backbone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from arch_checks import GATED_DELTANET_SHAPE, require_model_type
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel
from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

from fulcrum.models.load import load_backbone
from fulcrum.models.value_head import CriticModel
from fulcrum.rollout.testing import random_causal_lm
from fulcrum.trainer.checkpoint.hf_folder import load_model_weights, save_model_folder

CPU = torch.device("cpu")
SLIDING = {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}
FAMILIES = {
    "olmo3": SLIDING,
    "gemma3_text": {**SLIDING, "head_dim": 16, "query_pre_attn_scalar": 16},
    "qwen3_5_text": {**GATED_DELTANET_SHAPE, "layer_types": ["linear_attention", "full_attention"]},
}


def critic_of(folder: Path, seed: int) -> CriticModel:
    """The critic as the PPO worker builds it from `folder`, its value head drawn from `seed`."""
    torch.manual_seed(seed)
    critic = CriticModel(load_backbone(str(folder), CPU)).eval()
    with torch.no_grad():
        critic.score.bias.fill_(0.1 * seed + 0.3)
    return critic


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_the_critic_saves_and_resumes_with_its_values(arch: str, tmp_path: Path) -> None:
    require_model_type(arch)
    assert arch not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES  # the case this layout is for
    torch.set_num_threads(1)
    folder = tmp_path / "model"
    random_causal_lm(arch, init_std=0.2, **FAMILIES[arch]).save_pretrained(folder)
    critic = critic_of(folder, seed=1)
    ids = torch.tensor([[5, 9, 200, 41, 7, 3, 88], [17, 2, 250, 4, 66, 31, 9]])
    with torch.no_grad():
        values = critic(ids)

    save_model_folder(critic, None, tmp_path / "critic")
    saved = AutoConfig.from_pretrained(tmp_path / "critic")
    assert saved.model_type == arch and saved.num_labels == 1
    assert saved.fulcrum_value_head == "score"

    resumed = critic_of(folder, seed=2)
    with torch.no_grad():
        assert not torch.allclose(resumed(ids), values)  # a fresh head gives other values
        load_model_weights(resumed, tmp_path / "critic")
        assert torch.equal(resumed(ids), values)

        # The documented reading without fulcrum: AutoModel's backbone, then score.weight / score.bias.
        backbone = AutoModel.from_pretrained(tmp_path / "critic").eval()
        assert saved.architectures == [type(backbone).__name__]
        head = load_file(str(tmp_path / "critic" / "model.safetensors"))
        hidden = backbone(input_ids=ids).last_hidden_state
        by_hand = (hidden @ head["score.weight"].T + head["score.bias"]).squeeze(-1)
        torch.testing.assert_close(by_hand, values, atol=1e-5, rtol=1e-5)
