"""One run directory, one run: refusals over another run, resume checks of the configuration, damaged
checkpoints skipped with a reason, and every writing command keeping its hands off what is not its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import make_assets, short_run_overrides

from fulcrum.config import ConfigError, load_config
from fulcrum.data.cli import main as data_main
from fulcrum.models.tiny import main as tiny_main
from fulcrum.trainer.checkpoint import read_latest_step
from fulcrum.trainer.ppo_trainer import PPOTrainer
from fulcrum.trainer.run_dir import RunDirError, config_changes
from fulcrum.trainer.sft import load_sft_config, run_sft


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_assets(tmp_path_factory.mktemp("assets"))


overrides = short_run_overrides  # PPO with a critic on 8 prompts, batch 2, a checkpoint every step


def train(assets: Path, run_dir: Path, **extra: object) -> PPOTrainer:
    torch.set_num_threads(1)
    trainer = PPOTrainer(load_config(overrides(assets, run_dir, **extra)), torch.device("cpu"))
    trainer.fit()
    return trainer


def logged_steps(run_dir: Path, name: str = "metrics.jsonl") -> list[int]:
    rows = [json.loads(line) for line in (run_dir / name).read_text().splitlines() if line.strip()]
    return [int(r["training/global_step"]) for r in rows if "training/global_step" in r]


def test_a_new_run_over_another_stops_and_overwrite_moves_the_old_one_aside(
    assets: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    train(assets, run)
    metrics_before = (run / "metrics.jsonl").read_text()
    with pytest.raises(RunDirError) as info:
        PPOTrainer(
            load_config(overrides(assets, run, **{"trainer.resume_mode": "disable"})), torch.device("cpu")
        )
    message = str(info.value)
    assert "metrics.jsonl with 2 row(s)" in message and "global_step_1, global_step_2" in message
    assert "trainer.resume_mode=auto" in message and "trainer.overwrite_run=True" in message
    assert (run / "metrics.jsonl").read_text() == metrics_before

    train(assets, run, **{"trainer.resume_mode": "disable", "trainer.overwrite_run": True})
    (old,) = (run / "old_runs").iterdir()
    assert (old / "metrics.jsonl").read_text() == metrics_before and (old / "global_step_2").is_dir()
    assert logged_steps(run) == [1, 2]


def test_a_run_killed_before_its_first_checkpoint_is_not_mixed_with_the_next(
    assets: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "training/global_step": 1}\n')
    with pytest.raises(RunDirError, match=r"metrics.jsonl with 1 row\(s\), steps 1..1"):
        PPOTrainer(load_config(overrides(assets, run)), torch.device("cpu"))


def test_resume_stops_on_changes_that_alter_training_and_lists_harmless_ones(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    train(assets, run, **{"trainer.total_training_steps": 1})
    with pytest.raises(RunDirError) as info:
        PPOTrainer(load_config(overrides(assets, run, **{"data.train_batch_size": 4})), torch.device("cpu"))
    assert "data.train_batch_size: 2 -> 4" in str(info.value)
    assert "trainer.accept_config_changes=True" in str(info.value)
    assert "total_training_steps" not in str(info.value)  # harmless: listed, not refused
    capsys.readouterr()
    trainer = train(assets, run, **{"data.train_batch_size": 4, "trainer.accept_config_changes": True})
    out = capsys.readouterr().out
    assert "accepted changed key data.train_batch_size: 2 -> 4" in out
    assert "resuming with changed key trainer.total_training_steps: 1 -> 2" in out
    assert trainer.train_loader.state_dict()["prompts"] == 2 + 4  # 2 prompts at batch 2, then 4 at batch 4
    assert logged_steps(run) == [1, 2]
    attempts = [json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines()]
    assert [a["attempt"] for a in attempts] == [1, 2] and attempts[1]["resumed_from"].endswith(
        "global_step_1"
    )
    assert (run / "configs" / "attempt_1.yaml").is_file() and (run / "configs" / "attempt_2.yaml").is_file()


def test_resume_with_another_length_under_a_schedule_spanning_the_run_is_refused(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cosine decay with a warm-up ratio is laid over trainer.total_training_steps: resuming with another
    total would move the warm-up end and the cosine mid-run. One line names the key and both values."""
    run = tmp_path / "run"
    cosine = {
        "actor_rollout_ref.actor.optim.lr_scheduler_type": "cosine",
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.5,
    }
    train(assets, run, **{**cosine, "trainer.total_training_steps": 1})
    with pytest.raises(RunDirError) as info:
        PPOTrainer(load_config(overrides(assets, run, **cosine)), torch.device("cpu"))
    message = str(info.value)
    assert "\n" not in message and "trainer.total_training_steps: 1 -> 2" in message, message
    assert "lr_scheduler_type=cosine" in message and "trainer.accept_config_changes=True" in message
    assert logged_steps(run) == [1]
    capsys.readouterr()
    train(assets, run, **{**cosine, "trainer.accept_config_changes": True})
    assert "accepted changed key trainer.total_training_steps: 1 -> 2" in capsys.readouterr().out
    assert logged_steps(run) == [1, 2]


def test_auto_resume_falls_back_past_a_damaged_checkpoint(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    train(assets, run, **{"trainer.total_training_steps": 3})
    weights = run / "global_step_3" / "actor" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # other bytes, same size: only the content hash can tell
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    train(assets, run, **{"trainer.total_training_steps": 3})
    out = capsys.readouterr().out
    assert "skipped damaged checkpoint global_step_3" in out and "SHA-256" in out
    assert "resuming from global_step_2" in out
    assert logged_steps(run) == [1, 2, 3]  # step 3 once: the damaged attempt's row moved out
    assert logged_steps(run, "metrics.dropped.jsonl") == [3]
    assert read_latest_step(run) == 3
    (aside,) = run.glob("global_step_3.set-aside-*")  # kept, not deleted
    assert (aside / "actor" / "model.safetensors").read_bytes() == bytes(data)
    assert (run / "global_step_3" / "checkpoint.json").is_file()


def test_config_changes_classifies_keys() -> None:
    old = {"data": {"train_batch_size": 8, "val_files": "a"}, "trainer": {"logger": ["console"]}}
    new = {
        "data": {"train_batch_size": 4, "val_files": "b"},
        "trainer": {"logger": ["console", "tensorboard"]},
    }
    blocking, harmless = config_changes(old, new)
    assert blocking == ["data.train_batch_size: 8 -> 4"]
    assert harmless == [
        "data.val_files: 'a' -> 'b'",
        "trainer.logger: ['console'] -> ['console', 'tensorboard']",
    ]


# ------------------------------------------------------------------ every writing command, same rule
def test_data_gsm8k_never_overwrites_existing_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "train.parquet").write_bytes(b"mine")
    assert data_main(["gsm8k", "--src", str(tmp_path), "--out", str(tmp_path)]) == 1
    assert "train.parquet" in capsys.readouterr().err
    assert (tmp_path / "train.parquet").read_bytes() == b"mine"


def test_tiny_model_never_overwrites_a_model_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert tiny_main(["--out", str(tmp_path)]) == 1
    assert "config.json" in capsys.readouterr().err
    assert (tmp_path / "config.json").read_text() == "{}" and sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json"
    ]


def test_sft_never_writes_over_another_run(tmp_path: Path) -> None:
    (tmp_path / "global_step_3").mkdir()
    cfg = load_sft_config(
        [
            f"data.train_files={tmp_path / 'x.parquet'}",
            f"model.partial_pretrain={tmp_path / 'model'}",
            f"trainer.default_local_dir={tmp_path}",
            "trainer.device=cpu",
        ]
    )
    with pytest.raises(ConfigError, match="holds another run"):
        run_sft(cfg, log=lambda *_: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_3"]
