"""A critic whose backbone's model type transformers gives no token classifier (OLMo 3, Gemma 3's text
model, Qwen3.5's text model alone) is saved in the token classifier's layout with its backbone's config
(`architectures` = the `AutoModel` class, `fulcrum_value_head = "score"`): the run's resume reads it back
with the same values, and `AutoModel` loads the exported folder's backbone."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from arch_checks import GATED_DELTANET_SHAPE, require_model_type
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel
from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

from fulcrum.models.load import load_backbone
from fulcrum.models.value_head import CriticModel
from fulcrum.rollout.testing import random_causal_lm
from fulcrum.tools.export import main as export_main
from fulcrum.trainer.checkpoint import CheckpointManager

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


def role(critic: CriticModel) -> SimpleNamespace:
    return SimpleNamespace(model=critic, optimizer=torch.optim.AdamW(critic.parameters()), tokenizer=None)


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_the_critic_saves_and_resumes_with_its_values(arch: str, tmp_path: Path, capsys) -> None:
    require_model_type(arch)
    assert arch not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES  # the case this layout is for
    torch.set_num_threads(1)
    folder = tmp_path / "model"
    random_causal_lm(arch, init_std=0.2, **FAMILIES[arch]).save_pretrained(folder)
    critic = critic_of(folder, seed=1)
    ids = torch.tensor([[5, 9, 200, 41, 7, 3, 88], [17, 2, 250, 4, 66, 31, 9]])
    with torch.no_grad():
        values = critic(ids)

    run_dir = tmp_path / "run"
    CheckpointManager(run_dir, None).save(3, {"critic": role(critic)}, {"epoch": 0})
    saved = AutoConfig.from_pretrained(run_dir / "global_step_3" / "critic")
    assert saved.model_type == arch and saved.num_labels == 1
    assert saved.fulcrum_value_head == "score"

    resumed = critic_of(folder, seed=2)
    with torch.no_grad():
        assert not torch.allclose(resumed(ids), values)  # a fresh head gives other values
    state = CheckpointManager(run_dir, None).resume({"critic": role(resumed)})
    assert state is not None and state["epoch"] == 0
    with torch.no_grad():
        assert torch.equal(resumed(ids), values)

    # The documented reading without fulcrum, of the exported folder: AutoModel's backbone, then the
    # value head's score.weight / score.bias.
    assert export_main([str(run_dir), "--out", str(tmp_path / "export"), "--role", "critic"]) == 0
    assert "transformers.AutoModel.from_pretrained" in capsys.readouterr().out
    backbone = AutoModel.from_pretrained(tmp_path / "export").eval()
    assert saved.architectures == [type(backbone).__name__]
    head = load_file(str(tmp_path / "export" / "model.safetensors"))
    with torch.no_grad():
        hidden = backbone(input_ids=ids).last_hidden_state
    by_hand = (hidden @ head["score.weight"].T + head["score.bias"]).squeeze(-1)
    torch.testing.assert_close(by_hand, values, atol=1e-5, rtol=1e-5)
