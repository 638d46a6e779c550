"""fulcrum writes over nothing that is not its own: a user's files under its names, a folder that is
also the user's project (trainer.overwrite_run), another run's checkpoint resumed into a folder holding
a run, a full disk while a resume records itself, and a checkpoint saved twice for one step."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from helpers import make_assets, short_run_overrides
from transformers import AutoModelForCausalLM

from fulcrum.config import ConfigError
from fulcrum.trainer import run_dir as run_dir_module
from fulcrum.trainer.checkpoint import CheckpointManager
from fulcrum.trainer.main_ppo import main as train_main
from fulcrum.trainer.sft import load_sft_config, run_sft

USER_CONFIG = "# my experiment notes\nlr: 0.1\n"
USER_ATTEMPTS = '{"trial": 1, "score": 0.3}\n'


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_assets(tmp_path_factory.mktemp("assets"))


def train(assets: Path, run_dir: Path, **extra: object) -> int:
    torch.set_num_threads(1)
    return train_main(short_run_overrides(assets, run_dir, **extra))


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative path -> content)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("fulcrum train:")]


def test_a_users_config_and_attempts_are_never_written_over(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "experiment"
    folder.mkdir()
    (folder / "config.yaml").write_text(USER_CONFIG)
    (folder / "attempts.jsonl").write_text(USER_ATTEMPTS)
    capsys.readouterr()
    assert train(assets, folder) == 1
    (line,) = error_lines(capsys.readouterr().err)
    assert "holds attempts.jsonl, config.yaml, which fulcrum did not write" in line
    assert snapshot(folder) == {"attempts.jsonl": USER_ATTEMPTS.encode(), "config.yaml": USER_CONFIG.encode()}


def test_sft_never_writes_over_a_users_config(tmp_path: Path) -> None:
    folder = tmp_path / "experiment"
    folder.mkdir()
    (folder / "config.yaml").write_text(USER_CONFIG)
    cfg = load_sft_config(
        [
            f"data.train_files={tmp_path / 'x.parquet'}",
            f"model.partial_pretrain={tmp_path / 'model'}",
            f"trainer.default_local_dir={folder}",
            "trainer.device=cpu",
        ]
    )
    with pytest.raises(ConfigError, match=r"holds config\.yaml, which fulcrum did not write"):
        run_sft(cfg, log=lambda *_: None)
    assert snapshot(folder) == {"config.yaml": USER_CONFIG.encode()}


def test_overwrite_run_in_a_folder_that_is_also_the_users_project_moves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`trainer.default_local_dir=.` in a project holding its README, data and model: the first run may
    write there (nothing of the user's is touched), but overwrite_run refuses to move the folder aside."""
    project = make_assets(tmp_path / "project")  # model/ and data/ inside the run directory
    (project / "README.md").write_text("my project\n")
    cwd = os.getcwd()
    os.chdir(project)
    try:
        assert train(Path("."), Path("."), **{"trainer.total_training_steps": 1}) == 0
        before = snapshot(project)
        capsys.readouterr()
        again = {"trainer.resume_mode": "disable", "trainer.overwrite_run": True}
        assert train(Path("."), Path("."), **again) == 1
    finally:
        os.chdir(cwd)
    (line,) = error_lines(capsys.readouterr().err)
    assert "also holds README.md, data, model, which fulcrum did not write" in line
    assert snapshot(project) == before and not (project / "old_runs").exists()


def test_resuming_another_runs_checkpoint_into_a_folder_holding_a_run_is_refused(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mine, other = tmp_path / "mine", tmp_path / "other"
    assert train(assets, mine) == 0
    assert train(assets, other, **{"trainer.seed": 7}) == 0
    before = snapshot(mine)
    capsys.readouterr()
    fork = {
        "trainer.resume_mode": "resume_path",
        "trainer.resume_from_path": other / "global_step_1",
        "trainer.seed": 7,
    }
    assert train(assets, mine, **fork) == 1
    (line,) = error_lines(capsys.readouterr().err)
    assert f"trainer.resume_from_path={other / 'global_step_1'} is another run's checkpoint" in line
    assert f"trainer.default_local_dir={mine} holds its own run" in line
    assert snapshot(mine) == before  # its own global_step_2 and metrics untouched

    # Into a new folder the same resume is a fork: it trains step 2 there.
    assert train(assets, tmp_path / "fork", **fork) == 0
    rows = (tmp_path / "fork" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["training/global_step"] for r in rows] == [2]


def test_a_full_disk_when_a_resume_records_itself_names_the_path_and_leaves_nothing_partial(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    assert train(assets, run, **{"trainer.total_training_steps": 1}) == 0
    before = snapshot(run)
    save_config = run_dir_module.save_config

    def disk_fills_halfway(cfg: object, path: Path) -> None:
        save_config(cfg, path)
        text = Path(path).read_bytes()
        Path(path).write_bytes(text[: len(text) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as write() reports it: no file name

    monkeypatch.setattr(run_dir_module, "save_config", disk_fills_halfway)
    capsys.readouterr()
    assert train(assets, run) == 1
    err = capsys.readouterr().err
    (line,) = error_lines(err)
    assert f"cannot write {run / 'configs' / 'attempt_2.yaml'}: No space left on device" in line
    assert "Traceback" not in err
    assert snapshot(run) == before  # no truncated attempt_2.yaml, no temporary file, config.yaml intact


def test_a_second_save_of_a_step_sets_the_first_aside_instead_of_deleting_it(
    tmp_path: Path, tiny_model: Path
) -> None:
    role = {"actor": type("Role", (), {"model": AutoModelForCausalLM.from_pretrained(tiny_model)})()}
    manager = CheckpointManager(tmp_path, {"resume_mode": "auto"})
    first = manager.save(1, role, {"epoch": 0})
    manifest = (first / "checkpoint.json").read_text()
    manager.save(1, role, {"epoch": 0})
    (aside,) = tmp_path.glob("global_step_1.set-aside-*")
    assert (aside / "checkpoint.json").read_text() == manifest
    assert (tmp_path / "global_step_1" / "checkpoint.json").is_file()
