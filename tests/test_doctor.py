"""`fulcrum doctor`: exit 0 with a summary on a valid configuration, exit 1 naming each problem."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from fulcrum.tools import doctor

# The seed command lives in test_config.py; load it by path so this works however pytest is invoked.
_spec = importlib.util.spec_from_file_location("_test_config", Path(__file__).with_name("test_config.py"))
_test_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_test_config)
seed_command = _test_config.seed_command


@pytest.fixture
def files(tmp_path: Path) -> Path:
    """The files the seed command points at: two parquet names and a model folder with config.json."""
    (tmp_path / "train.parquet").write_bytes(b"PAR1")
    (tmp_path / "test.parquet").write_bytes(b"PAR1")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return tmp_path


def test_seed_command_passes(files, capsys):
    assert doctor.main(seed_command(files)) == 0
    out = capsys.readouterr().out
    assert "can run" in out
    assert "512 prompts x n=1 = 512 responses" in out
    assert "4 mini-batch(es) of 128 prompts (128 responses per device)" in out
    assert "16 micro-batch(es) of 8" in out
    assert "device      cpu" in out


def test_keys_without_effect_are_listed(files, capsys):
    argv = [
        *seed_command(files),
        "actor_rollout_ref.actor.fsdp_config.param_offload=True",
        "actor_rollout_ref.rollout.name=vllm",
    ]
    assert doctor.main(argv) == 0
    out = capsys.readouterr().out
    assert "accepted for compatibility, no effect" in out
    assert "actor_rollout_ref.actor.fsdp_config.param_offload=True" in out
    assert "fulcrum has no vllm backend" in out


def test_bad_key_exits_1_with_suggestion(files, capsys):
    assert doctor.main([*seed_command(files), "actor_rollout_ref.actor.ppo_mini_batchsize=64"]) == 1
    assert "did you mean actor_rollout_ref.actor.ppo_mini_batch_size?" in capsys.readouterr().out


def test_missing_files_are_named(files, capsys):
    (files / "test.parquet").unlink()
    (files / "model" / "config.json").unlink()
    assert doctor.main(seed_command(files)) == 1
    out = capsys.readouterr().out
    assert f"data.val_files: {files}/test.parquet does not exist" in out
    assert f"actor_rollout_ref.model.path: {files}/model has no config.json" in out
    assert "data.train_files" not in out


def test_batch_rule_and_custom_reward(files, capsys):
    reward = files / "my_reward.py"
    reward.write_text(
        "def other(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    )
    argv = [
        *seed_command(files),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=7",
        f"custom_reward_function.path={reward}",
    ]
    assert doctor.main(argv) == 1
    out = capsys.readouterr().out
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu" in out
    assert "defines no function 'compute_score'" in out


def test_config_file_and_keys_listing(files, capsys, tmp_path):
    from fulcrum.config import load_config, save_config

    path = save_config(load_config(seed_command(files)), tmp_path / "run" / "config.yaml")
    assert doctor.main(["--config", str(path)]) == 0
    assert doctor.main(["--keys"]) == 0
    out = capsys.readouterr().out
    assert "actor_rollout_ref.rollout.response_length = null" in out
