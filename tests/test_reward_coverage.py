"""`fulcrum doctor` and `fulcrum train` refuse, before any model loads, data that nothing would score."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fulcrum.config import ConfigError, load_config
from fulcrum.reward.coverage import unscored_problems
from fulcrum.trainer.checks import check


def _write(path: Path, sources: list[str], truths: list[object]) -> str:
    rows = [
        {
            "data_source": s,
            "prompt": [{"role": "user", "content": "q"}],
            "reward_model": {"style": "rule", "ground_truth": t},
        }
        for s, t in zip(sources, truths, strict=True)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_an_unscored_source_is_named_with_its_file(tmp_path: Path) -> None:
    train = _write(tmp_path / "train.parquet", ["openai/gsm8k", "my_org/unscored_source"], ["1", "2"])
    val = _write(tmp_path / "val.parquet", ["lighteval/MATH", "aime2024"], ["1", "2"])
    problems = unscored_problems(load_config([f"data.train_files={train}", f"data.val_files={val}"]))
    assert len(problems) == 1
    key, message = problems[0]
    assert key == "data.train_files" and train in message and "'my_org/unscored_source'" in message


def test_a_custom_reward_function_scores_every_source(tmp_path: Path) -> None:
    train = _write(tmp_path / "train.parquet", ["my_org/unscored_source"], ["1"])
    cfg = load_config(
        [f"data.train_files={train}", f"data.val_files={train}", "custom_reward_function.path=r.py"]
    )
    assert unscored_problems(cfg) == []


def test_a_float_ground_truth_is_named_by_row(tmp_path: Path) -> None:
    val = _write(tmp_path / "val.parquet", ["openai/gsm8k"] * 2, [72.0, 3.0])
    cfg = load_config([f"data.train_files={val}", f"data.val_files={val}"])
    messages = [m for k, m in unscored_problems(cfg) if k == "data.val_files"]
    assert len(messages) == 1 and "row(s) 0, 1 (2 in all)" in messages[0] and "72.0 is a float" in messages[0]


def test_train_refuses_before_any_model_loads(tmp_path: Path) -> None:
    train = _write(tmp_path / "train.parquet", ["hiyouga/geometry3k"], ["1"])
    cfg = load_config(
        [f"data.train_files={train}", f"data.val_files={train}", "actor_rollout_ref.model.path=/nonexistent"]
    )
    with pytest.raises(ConfigError, match="'hiyouga/geometry3k' is a vision data set"):
        check(cfg, n_devices=None)
