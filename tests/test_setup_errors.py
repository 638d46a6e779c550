"""Errors before the first step are one paragraph naming the key, the file and what to do (no traceback)."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from helpers import cpu_ppo_overrides, make_assets

from fulcrum.config import load_config
from fulcrum.config.validate import advise
from fulcrum.models import folder as model_folder
from fulcrum.trainer.main_ppo import main as train_main


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_assets(tmp_path_factory.mktemp("assets"))
    pq.write_table(pq.read_table(root / "data/test.parquet").slice(0, 0), root / "empty.parquet")
    return root


def args(assets: Path, run_dir: Path, **extra: object) -> list[str]:
    keys = {"data.max_response_length": 4, "trainer.total_training_steps": 1}
    return cpu_ppo_overrides(assets, run_dir, {**keys, **extra})


def setup_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run `fulcrum train`, expect exit 1 with a message and no traceback; return the message."""
    assert train_main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip()
    return err


def model_copy(assets: Path, tmp_path: Path, drop: tuple[str, ...] = ()) -> Path:
    out = tmp_path / "model"
    shutil.copytree(assets / "model", out, ignore=lambda _d, names: [n for n in names if n in drop])
    return out


def test_a_missing_relative_model_path_is_not_a_minute_of_hub_retries(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_network(*_args: object, **_kwargs: object) -> socket.socket:
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(model_folder.socket, "create_connection", no_network)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    err = setup_error(
        capsys, args(assets, tmp_path / "run", **{"actor_rollout_ref.model.path": "models/nope"})
    )
    assert "actor_rollout_ref.model.path=models/nope: no such local folder" in err
    assert "no network" in err
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    err = setup_error(
        capsys, args(assets, tmp_path / "run", **{"actor_rollout_ref.model.path": "models/nope"})
    )
    assert "HF_HUB_OFFLINE is set" in err
    err = setup_error(capsys, args(assets, tmp_path / "run", **{"critic.model.path": "./models/nope"}))
    assert "critic.model.path=./models/nope: no such model folder" in err


@pytest.mark.parametrize(
    "drop, expected",
    [
        (("tokenizer.json", "tokenizer_config.json"), "no tokenizer"),
        (("chat_template.jinja",), "no chat template"),
        (("config.json",), "no config.json"),
    ],
)
def test_an_incomplete_model_folder_is_named(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], drop: tuple[str, ...], expected: str
) -> None:
    model = model_copy(assets, tmp_path, drop)
    err = setup_error(capsys, args(assets, tmp_path / "run", **{"actor_rollout_ref.model.path": model}))
    assert f"actor_rollout_ref.model.path={model}" in err and expected in err


def test_a_truncated_weight_file_is_named(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = model_copy(assets, tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    err = setup_error(capsys, args(assets, tmp_path / "run", **{"critic.model.path": model}))
    assert "critic.model.path" in err and f"{weights}" in err and "truncated" in err


def test_a_critic_with_a_smaller_vocabulary_is_named_before_loading(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = model_copy(assets, tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["vocab_size"] = 100
    (model / "config.json").write_text(json.dumps(config))
    err = setup_error(capsys, args(assets, tmp_path / "run", **{"critic.model.path": model}))
    assert f"critic.model.path={model}: its vocabulary has 100 tokens" in err


def test_empty_or_too_small_data_files_name_the_key(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = setup_error(capsys, args(assets, tmp_path / "a", **{"data.val_files": assets / "empty.parquet"}))
    assert "data.val_files" in err and "empty.parquet holds no prompts" in err
    assert "set FULCRUM_DEBUG=1 to see the traceback" in err
    err = setup_error(capsys, args(assets, tmp_path / "b", **{"data.train_files": assets / "empty.parquet"}))
    assert "data.train_files" in err and "no prompts" in err
    err = setup_error(capsys, args(assets, tmp_path / "c", **{"data.train_batch_size": 16}))
    assert "data.train_files" in err and "holds 8 prompt(s)" in err and "data.train_batch_size=16" in err


def test_a_misspelled_key_is_reported_before_the_demo_runs(capsys: pytest.CaptureFixture[str]) -> None:
    err = setup_error(capsys, ["data.train_file=x.parquet"])
    assert "data.train_file" in err and "data.train_files" in err  # the unknown key and the closest one


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it_says_so(assets: Path, tmp_path: Path, capsys) -> None:
    err = setup_error(capsys, args(assets, tmp_path / "run", **{"trainer.device": "cuda"}))
    assert "this machine has 0" in err and "trainer.device=cpu" in err and "n_gpus_per_node=1 to" not in err


def test_the_debug_switch_shows_the_traceback(
    assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv("FULCRUM_DEBUG", "1")
    with pytest.raises(model_folder.ModelPathError):
        train_main(args(assets, tmp_path / "run", **{"actor_rollout_ref.model.path": tmp_path / "absent"}))


def test_a_zero_learning_rate_is_a_warning() -> None:
    cfg = load_config(["actor_rollout_ref.actor.optim.lr=0"])
    assert any("optim.lr=0" in str(p) and "never trains" in str(p) for p in advise(cfg))
