"""Tiny models: load offline with transformers' Auto classes, deterministic weights, lossless tokenizer."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
import torch
from gsm8k_data import SOURCE_IDS, SOURCES
from gsm8k_data import rows as gsm8k_rows
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from fulcrum.models.tiny import ARCHS, SIZES, build_tiny_model, count_parameters, count_parameters_of, main
from fulcrum.models.tiny_tokenizer import TOKENIZER_JSON, load_tokenizer, train_tokenizer


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", arch="qwen2", seed=0)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", seed=0)


def test_qwen2_folder_loads_offline_and_generates(qwen2_dir: Path) -> None:
    assert (qwen2_dir / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(qwen2_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(qwen2_dir, local_files_only=True)
    assert model.config.model_type == "qwen2"
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 5_000_000
    assert model.config.vocab_size == len(tokenizer) == 2048
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # qwen2 has q/k/v biases
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id != tokenizer.eos_token_id

    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert ids[0, 0].item() == tokenizer.convert_tokens_to_ids("<|im_start|>")  # one token, no BOS added
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids.shape[1]


def test_llama_folder_loads_offline(llama_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(llama_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(llama_dir, local_files_only=True)
    assert model.config.model_type == "llama"
    assert model.config.num_key_value_heads == 2 and model.config.num_attention_heads == 4
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, len(tokenizer)) and torch.isfinite(logits).all()


def test_weights_are_a_function_of_the_seed(tmp_path: Path, qwen2_dir: Path) -> None:
    state = torch.get_rng_state()
    again = load_file(build_tiny_model(tmp_path / "again", seed=0) / "model.safetensors")
    other = load_file(build_tiny_model(tmp_path / "other", seed=1) / "model.safetensors")
    assert torch.equal(torch.get_rng_state(), state), "building a model must not move the global RNG"
    first = load_file(qwen2_dir / "model.safetensors")
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_sizes_are_options_and_bad_sizes_are_named(tmp_path: Path) -> None:
    out = build_tiny_model(tmp_path / "m", hidden_size=64, num_hidden_layers=2, tie_word_embeddings=True)
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["tie_word_embeddings"]) == (
        64,
        2,
        True,
    )
    with pytest.raises(ValueError, match="num_attention_heads=3"):
        build_tiny_model(tmp_path / "bad", num_attention_heads=3)
    with pytest.raises(ValueError, match="hidden_dim"):
        build_tiny_model(tmp_path / "bad", hidden_dim=3)
    with pytest.raises(ValueError, match="unknown arch 'gpt2'"):
        build_tiny_model(tmp_path / "bad", arch="gpt2")


def test_cli_writes_a_model_and_reports_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--out", str(tmp_path / "cli"), "--arch", "llama", "--num-layers", "1"]) == 0
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["num_hidden_layers"] == 1
    assert main(["--out", str(tmp_path / "bad"), "--num-kv-heads", "3"]) == 2
    assert "num_key_value_heads=3" in capsys.readouterr().err


@pytest.mark.parametrize("source", SOURCES, ids=SOURCE_IDS)
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tokenizer_is_lossless_on_gsm8k(arch: str, source: Path, qwen2_dir: Path, llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(qwen2_dir if arch == "qwen2" else llama_dir)
    rows = gsm8k_rows(source, "test")
    texts = [r["question"] for r in rows] + [r["answer"] for r in rows]
    encoded = tokenizer(texts)["input_ids"]
    decoded = tokenizer.batch_decode(encoded, skip_special_tokens=True)
    assert [i for i, (a, b) in enumerate(zip(texts, decoded, strict=True)) if a != b] == []
    # The vocabulary is fitted to this kind of text: well under one token per character.
    assert sum(map(len, encoded)) < 0.5 * sum(map(len, texts))


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_shipped_tokenizer_is_lossless_on_any_text(text: str) -> None:
    tokenizer = _raw_tokenizer()
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_qwen2_auto_tokenizer_is_lossless_on_nfc_text(qwen2_dir: Path, text: str) -> None:
    """transformers 5 loads model_type qwen2 with Qwen2Tokenizer, which adds an NFC normaliser."""
    tokenizer = _auto_tokenizer(qwen2_dir)
    nfc = unicodedata.normalize("NFC", text)
    assert tokenizer.decode(tokenizer(nfc)["input_ids"]) == nfc


def _auto_tokenizer(folder: Path):
    if folder not in _RAW:
        _RAW[folder] = AutoTokenizer.from_pretrained(folder)
    return _RAW[folder]


_RAW: dict = {}


def _raw_tokenizer():
    if "tok" not in _RAW:
        _RAW["tok"] = load_tokenizer()
    return _RAW["tok"]


def test_shipped_tokenizer_matches_a_rebuild() -> None:
    """The shipped json is what `python -m fulcrum.models.tiny_tokenizer` makes (the training is deterministic)."""
    rebuilt = json.loads(train_tokenizer().to_str())
    shipped = json.loads(TOKENIZER_JSON.read_text())
    assert rebuilt["model"]["vocab"] == shipped["model"]["vocab"]
    assert rebuilt["model"]["merges"] == shipped["model"]["merges"]
    assert [t["content"] for t in shipped["added_tokens"]] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.mark.parametrize(
    ("size", "low", "high"), [("small", 10e6, 15e6), ("medium", 20e6, 35e6), ("large", 40e6, 50e6)]
)
def test_size_presets_give_10_to_50_million_parameters(size: str, low: float, high: float) -> None:
    for arch in ARCHS:
        assert low <= count_parameters_of(arch, **SIZES[size]) <= high


def test_cli_size_preset_writes_that_model_and_options_override_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # a preset with fewer layers so the test writes ~5 MB, not 110 MB; the rest is the preset's
    assert main(["--out", str(tmp_path / "m"), "--size", "medium", "--num-layers", "1"]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (512, 1, 1536)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert count_parameters(model) == count_parameters_of(
        "qwen2", **{**SIZES["medium"], "num_hidden_layers": 1}
    )
    assert f"({count_parameters(model) / 1e6:.1f} M parameters)" in capsys.readouterr().out
