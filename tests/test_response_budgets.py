"""Per-row response budgets (extra_info.max_response_length): capped by data.max_response_length, honoured
by the synchronous sampler on either engine, and a bad one stops the run naming its file and row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from budget_data import with_budgets
from helpers import cpu_ppo_overrides, make_assets

from fulcrum.data.dataset import DatasetError, RLHFDataset
from fulcrum.models.tiny import build_tokenizer
from fulcrum.trainer.main_ppo import main


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Odd rows may answer in 3 tokens; even rows ask for 50, above the run's 8."""
    root = make_assets(tmp_path_factory.mktemp("assets"), num_train=8, num_test=2)
    with_budgets(root / "data/train.parquet", lambda i: 3 if i % 2 else 50)
    return root


@pytest.mark.parametrize("engine", ["hf", "native"])
def test_the_synchronous_sampler_keeps_each_row_within_its_budget(
    assets: Path, tmp_path: Path, engine: str
) -> None:
    torch.set_num_threads(1)
    keys = {
        "data.max_response_length": 8,
        "data.shuffle": False,
        "actor_rollout_ref.rollout.name": engine,
        "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.rollout.ignore_eos": True,  # every answer runs to its limit
        "algorithm.adv_estimator": "grpo",
        "trainer.total_training_steps": 2,
        "trainer.val_before_train": False,
        "trainer.logger": "[console]",
    }
    run = tmp_path / engine
    assert main(cpu_ppo_overrides(assets, run, keys)) == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(steps) == 2
    assert all(r["response_length/min"] == 3 for r in steps)  # the row's own budget
    assert all(r["response_length/max"] == 8 for r in steps)  # 50 capped by data.max_response_length


@pytest.mark.parametrize("bad", [0, -4, 2.5, "long"])
def test_a_bad_budget_names_its_file_and_row(tmp_path: Path, bad: object) -> None:
    root = make_assets(tmp_path, num_train=4, num_test=2)
    # the other rows have no budget, which is allowed
    train = with_budgets(root / "data/train.parquet", lambda i: bad if i == 2 else None)
    with pytest.raises(DatasetError) as err:
        RLHFDataset(train, build_tokenizer(), max_prompt_length=128)
    assert f"{train}, row 2" in str(err.value)
    assert "extra_info.max_response_length must be a positive integer" in str(err.value)
