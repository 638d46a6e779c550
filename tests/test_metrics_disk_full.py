"""A disk that fills while `metrics.jsonl` is appended: the row is either whole in the file or not there,
and the run ends with one line naming the file and the step (no traceback), for `fulcrum train` and
`fulcrum sft`. The full disk is a write that takes part of a row and then fails with ENOSPC, as the
kernel's write() does when the space runs out mid-row."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from helpers import make_assets, short_run_overrides

from fulcrum.config import load_config
from fulcrum.models.tiny import build_tiny_model
from fulcrum.trainer.loggers import JsonlLogger, MetricsWriteError
from fulcrum.trainer.run import train
from fulcrum.trainer.sft import main as sft_main


def fill_disk_at_row(monkeypatch: pytest.MonkeyPatch, row: int) -> None:
    """From the `row`-th write to a metrics.jsonl on (1-based), half the bytes go in, then ENOSPC."""
    real_write = os.write
    seen = {"rows": 0, "full": False}

    def write(fd: int, data: bytes) -> int:
        if not os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl"):
            return real_write(fd, data)
        if seen["full"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        seen["rows"] += 1
        if seen["rows"] < row:
            return real_write(fd, data)
        seen["full"] = True
        return real_write(fd, data[: len(data) // 2])

    monkeypatch.setattr(os, "write", write)


def rows_of(path: Path) -> list[dict]:
    text = path.read_text()
    assert text == "" or text.endswith("\n"), f"a half-written row: {text[-80:]!r}"
    return [json.loads(line) for line in text.splitlines()]


def test_a_row_that_does_not_fit_is_cut_off_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    logger = JsonlLogger(tmp_path)
    fill_disk_at_row(monkeypatch, 2)
    logger.log({"a": 1.0}, step=1)
    with pytest.raises(MetricsWriteError) as info:
        logger.log({"a": 2.0, "b": "x" * 200}, step=2)
    message = str(info.value)
    assert "\n" not in message and "step 2" in message and str(tmp_path / "metrics.jsonl") in message
    assert os.strerror(errno.ENOSPC) in message
    logger.close()  # nothing is left pending to fail again
    assert rows_of(tmp_path / "metrics.jsonl") == [{"step": 1, "a": 1.0}]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_assets(tmp_path_factory.mktemp("assets"))


def test_fulcrum_train_ends_with_one_line(
    assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.set_num_threads(1)
    run = tmp_path / "run"
    cfg = load_config(short_run_overrides(assets, run, **{"trainer.total_training_steps": 3}))
    fill_disk_at_row(monkeypatch, 2)
    assert train(cfg) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "During handling" not in err, err
    assert err.strip().splitlines()[-1].startswith("fulcrum train: cannot append the row of step 2")
    assert [r["training/global_step"] for r in rows_of(run / "metrics.jsonl")] == [1]


def test_fulcrum_sft_ends_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fulcrum.data.synthetic import ArithmeticTask, write_splits

    model = build_tiny_model(
        tmp_path / "model", seed=0, hidden_size=32, num_hidden_layers=1, intermediate_size=64
    )
    train, _ = write_splits(
        tmp_path / "data", num_train=16, num_test=2, seed=0, task=ArithmeticTask(max_operand=9)
    )
    run = tmp_path / "run"
    fill_disk_at_row(monkeypatch, 2)
    args = [
        f"data.train_files={train}",
        "data.prompt_key=prompt",
        "data.response_key=extra_info",
        "data.train_batch_size=4",
        "data.micro_batch_size_per_gpu=4",
        f"model.partial_pretrain={model}",
        "trainer.device=cpu",
        "trainer.total_training_steps=3",
        f"trainer.default_local_dir={run}",
    ]
    assert sft_main(args) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("fulcrum sft: cannot append the row of step 2")
    assert [r["step"] for r in rows_of(run / "metrics.jsonl")] == [1]
