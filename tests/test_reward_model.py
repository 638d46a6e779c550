"""Model-based rewards: the score at the last response token, as the Hugging Face model itself gives it."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from fulcrum.models.load import load_tokenizer
from fulcrum.models.reward_model import RewardModel
from fulcrum.models.tiny import build_tiny_model, build_tiny_reward_model

SIZE = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64
)
OTHER_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rm")
    return {
        "policy": build_tiny_model(root / "policy", **SIZE),
        "rm": build_tiny_reward_model(root / "rm", seed=3, **SIZE),
        "rm_own_template": build_tiny_reward_model(
            root / "rm2", seed=3, chat_template=OTHER_TEMPLATE, **SIZE
        ),
    }


def hf_scores(path: Path, rows: list[list[int]]) -> torch.Tensor:
    """The sequence classifier's own output, one unpadded row at a time (it pools the last token)."""
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([row])).logits[0, 0] for row in rows])


def test_scores_are_the_models_own_at_the_last_response_token(models: dict[str, Path]) -> None:
    tok = load_tokenizer(str(models["policy"]))
    prompts = [tok("question one")["input_ids"], tok("a second, longer question here")["input_ids"]]
    responses = [
        tok("yes")["input_ids"],
        tok("no, because of many reasons")["input_ids"] + [tok.eos_token_id],
    ]
    rm = RewardModel(str(models["rm"]), tok, torch.device("cpu"), micro_batch_size=1)
    assert not rm.switch_template  # same tokenizer and template: the policy's tokens are scored directly
    rows = [p + r for p, r in zip(prompts, responses, strict=True)]
    expected = hf_scores(models["rm"], rows)
    torch.testing.assert_close(rm.score(prompts, responses), expected, atol=1e-5, rtol=1e-5)
    # Micro-batching (padding inside a micro-batch) does not change a score.
    wide = RewardModel(str(models["rm"]), tok, torch.device("cpu"), micro_batch_size=2)
    torch.testing.assert_close(wide.score(prompts, responses), expected, atol=1e-5, rtol=1e-5)


def test_a_reward_model_with_its_own_template_rerenders_the_chat(models: dict[str, Path]) -> None:
    tok = load_tokenizer(str(models["policy"]))
    rm = RewardModel(str(models["rm_own_template"]), tok, torch.device("cpu"), max_length=12)
    assert rm.switch_template
    chat = [{"role": "user", "content": "2 + 2?"}]
    response = tok("4")["input_ids"] + [tok.eos_token_id]
    (row,) = rm.reward_inputs([[1, 2, 3]], [response], [chat])
    rendered = "<|im_start|>user: 2 + 2?<|im_end|><|im_start|>assistant: 4<|im_end|>"
    assert row == rm.tokenizer(rendered, add_special_tokens=False)["input_ids"][:12]  # cut from the right
    with pytest.raises(ValueError, match="chat template"):
        rm.reward_inputs([[1]], [response], None)


def test_a_multi_label_classifier_is_refused(models: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "three"
    shutil.copytree(models["rm"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["id2label"] = {str(i): f"LABEL_{i}" for i in range(3)}
    config["label2id"] = {f"LABEL_{i}": i for i in range(3)}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="3 labels; a reward model has one"):
        RewardModel(str(folder), None, torch.device("cpu"))
