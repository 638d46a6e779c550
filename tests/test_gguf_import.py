"""`fulcrum import-gguf` and `fulcrum pretrained`: a GGUF file written here with the `gguf` package's own
writer (as llama.cpp's converter lays it out: query/key rows permuted for its RoPE, the tokenizer and chat
template as metadata) comes back as a plain Hugging Face folder that computes what the original model
computed; bad files and occupied folders are refused with one line. The real SmolLM2 file is used when
present (`slow`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from fulcrum.models import gguf_import, pretrained  # noqa: E402
from fulcrum.models.tiny import build_tiny_model  # noqa: E402

SIZE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
}


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf reorders each head's rows from HF's rotate-half layout to interleaved
    pairs; the importer must undo it."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_gguf(
    model_dir: Path,
    path: Path,
    arch: str = "llama",
    drop: tuple[str, ...] = (),
    extra: dict[str, np.ndarray] | None = None,
) -> None:
    """The HF model in `model_dir` as an F32 GGUF file (llama layout), tokenizer and chat template included;
    the GGUF tensors named in `drop` left out and those of `extra` added."""
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    writer = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    tokens += [f"[PAD{i}]" for i in range(config["vocab_size"] - len(tokens))]
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in merges]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    special = set(tokenizer.all_special_tokens) | {t.content for t in tokenizer.added_tokens_decoder.values()}
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: CONTROL, as llama.cpp marks them
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    if tokenizer.bos_token_id is not None:
        writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, tensor in state.items():
        data = tensor.numpy().astype(np.float32)
        if name in names:
            writer.add_tensor(names[name], data)
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        module, kind = rest.rsplit(".", 1)
        if module == "self_attn.q_proj":
            data = llama_cpp_permute(data, heads)
        elif module == "self_attn.k_proj":
            data = llama_cpp_permute(data, kv_heads)
        if f"blk.{layer}.{per_layer[module]}.{kind}" not in drop:
            writer.add_tensor(f"blk.{layer}.{per_layer[module]}.{kind}", data)
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("orig") / "model", arch="llama", seed=3, **SIZE)


@pytest.fixture(scope="module")
def gguf_file(original: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(original, path)
    return path


def test_import_computes_what_the_original_computes(original: Path, gguf_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "imported"
    assert gguf_import.main([str(gguf_file), "--out", str(out), "--dtype", "float32"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    source = json.loads((out / "gguf_source.json").read_text())
    assert source["tensor_types"] == {"F32": 2 + 9 * SIZE["num_hidden_layers"] + 1}
    assert (out / "model.safetensors").is_file()
    ref_tok, tok = AutoTokenizer.from_pretrained(original), AutoTokenizer.from_pretrained(out)
    # the file's EOS and pad, whatever transformers' GGUF conversion would have guessed: SFT appends
    # the EOS to every example and generation stops at it
    assert (tok.eos_token, tok.pad_token) == (ref_tok.eos_token, ref_tok.pad_token)
    assert (config["eos_token_id"], config["pad_token_id"]) == (ref_tok.eos_token_id, ref_tok.pad_token_id)
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    text = ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    ids = ref_tok(text, return_tensors="pt")["input_ids"]
    assert tok(text, return_tensors="pt")["input_ids"].tolist() == ids.tolist()
    ref = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32)
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(got(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_bf16_import_is_bf16_on_disk(gguf_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "bf16"
    assert gguf_import.main([str(gguf_file), "--out", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert next(model.parameters()).dtype == torch.bfloat16


def test_refusals_are_one_line(gguf_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_text("not a gguf")
    assert gguf_import.main([str(bad), "--out", str(tmp_path / "o1")]) == 1
    assert "not a GGUF file" in capsys.readouterr().err
    assert not (tmp_path / "o1").exists()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf_file.read_bytes()[:200])
    assert gguf_import.main([str(truncated), "--out", str(tmp_path / "o2")]) == 1
    assert "unreadable GGUF file" in capsys.readouterr().err
    other = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(other), "phi3")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_import.main([str(other), "--out", str(tmp_path / "o3")]) == 1
    err = capsys.readouterr().err
    assert "'phi3' is not supported" in err and "gemma3, llama, qwen2" in err
    users = tmp_path / "users"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    assert gguf_import.main([str(gguf_file), "--out", str(users)]) == 1
    assert "not a folder this command wrote" in capsys.readouterr().err
    assert (users / "notes.txt").read_text() == "mine" and sorted(os.listdir(users)) == ["notes.txt"]
    assert not list(tmp_path.glob(".*.tmp-*"))


def test_reimport_needs_force(gguf_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m"
    assert gguf_import.main([str(gguf_file), "--out", str(out)]) == 0
    assert gguf_import.main([str(gguf_file), "--out", str(out)]) == 1
    assert "--force" in capsys.readouterr().err
    assert gguf_import.main([str(gguf_file), "--out", str(out), "--force", "--dtype", "float32"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # nothing set aside is left


def test_force_keeps_the_source_and_the_users_files(gguf_file: Path, tmp_path: Path) -> None:
    """--force on an earlier import that also holds the source file and the user's own files replaces only
    what the import wrote: the source and the notes stay; a file only the earlier import wrote goes."""
    out = tmp_path / "m"
    assert gguf_import.main([str(gguf_file), "--out", str(out)]) == 0
    source = out / "tiny.gguf"
    source.write_bytes(gguf_file.read_bytes())
    (out / "notes.txt").write_text("mine")
    record = json.loads((out / "gguf_source.json").read_text())
    record["files"].append("model-00002-of-00002.safetensors")  # as a sharded earlier import lists it
    (out / "gguf_source.json").write_text(json.dumps(record))
    (out / "model-00002-of-00002.safetensors").write_bytes(b"old shard")
    assert gguf_import.main([str(source), "--out", str(out), "--force", "--dtype", "float32"]) == 0
    assert source.read_bytes() == gguf_file.read_bytes()
    assert (out / "notes.txt").read_text() == "mine"
    assert not (out / "model-00002-of-00002.safetensors").exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.float32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


@pytest.mark.parametrize(
    ("drop", "extra", "named"),
    [
        (("blk.1.ffn_down.weight",), None, "1 tensor(s) missing, first blk.1.ffn_down.weight"),
        ((), {"blk.2.attn_norm.weight": np.ones(SIZE["hidden_size"], np.float32)}, "blk.2.attn_norm.weight"),
        ((), {"rope_freqs.weight": np.ones(8, np.float32)}, "rope_freqs.weight"),
    ],
    ids=["missing", "extra-layer", "unused"],
)
def test_missing_or_left_over_tensors_are_refused(
    original: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    drop: tuple[str, ...],
    extra: dict[str, np.ndarray] | None,
    named: str,
) -> None:
    """A weight the file lacks is never left at its random initialisation, nor a tensor dropped."""
    path = tmp_path / "damaged.gguf"
    write_gguf(original, path, drop=drop, extra=extra)
    capsys.readouterr()
    assert gguf_import.main([str(path), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".*.tmp-*"))


@pytest.mark.parametrize(("arch", "named"), [("qwen2", "blk.0.attn_q.bias"), ("gemma3", "blk.0.attn_q_norm")])
def test_a_mislabelled_architecture_is_one_line(
    original: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], arch: str, named: str
) -> None:
    """A llama file labelled qwen2 (which would get random attention biases) or gemma3 (whose shapes differ)."""
    path = tmp_path / f"{arch}.gguf"
    write_gguf(original, path, arch)
    capsys.readouterr()
    assert gguf_import.main([str(path), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert named in err and "general.architecture" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


REAL = Path(os.environ.get("FULCRUM_SMOLLM2_GGUF", "/nonexistent"))


@pytest.mark.slow
@pytest.mark.skipif(
    not REAL.is_file(), reason="set FULCRUM_SMOLLM2_GGUF to the SmolLM2-135M-Instruct GGUF file"
)
def test_real_smollm2_converts_and_answers(tmp_path: Path) -> None:
    """The real file: the folder fulcrum trains from, and greedy text equal to transformers' own GGUF load."""
    out = tmp_path / "smol"
    assert (
        pretrained.main(
            ["smollm2-135m-instruct", "--out", str(out), "--from", str(REAL), "--dtype", "float32"]
        )
        == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["vocab_size"], config["tie_word_embeddings"]) == (
        30,
        49152,
        True,
    )
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
    )
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(str(REAL.parent), gguf_file=REAL.name, dtype=torch.float32)
    a = ours.generate(ids, max_new_tokens=24, do_sample=False)
    b = theirs.generate(ids, max_new_tokens=24, do_sample=False)
    assert a.tolist() == b.tolist()
    assert "Paris" in tok.decode(a[0, ids.shape[1] :])
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|im_end|>", "<|im_start|>")
