"""A user's own policy loss, from their own file: validation finds it through
actor_rollout_ref.actor.policy_loss.path, and a two-step run on the CPU trains with it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import make_assets, short_run_overrides

from fulcrum.config import load_config
from fulcrum.trainer.checks import configuration_findings
from fulcrum.trainer.main_ppo import main

LOSS_FILE = Path(__file__).parent / "fixtures" / "user_policy_loss.py"
USER_LOSS = {
    "actor_rollout_ref.actor.policy_loss.loss_mode": "ppo_penalty",
    "actor_rollout_ref.actor.policy_loss.path": LOSS_FILE,
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_assets(tmp_path_factory.mktemp("assets"))


def loss_problems(assets: Path, tmp_path: Path, **keys: object) -> list[str]:
    cfg = load_config(short_run_overrides(assets, tmp_path / "run", **keys))
    return [f"{p.keys[0]}: {p.message}" for p in configuration_findings(cfg) if "policy_loss" in p.keys[0]]


def test_validation_knows_the_user_loss_only_with_its_path(assets: Path, tmp_path: Path) -> None:
    assert loss_problems(assets, tmp_path, **USER_LOSS) == []
    missing = loss_problems(
        assets, tmp_path, **{**USER_LOSS, "actor_rollout_ref.actor.policy_loss.path": "nope.py"}
    )
    assert any(p.startswith("actor_rollout_ref.actor.policy_loss.path: ") and "nope.py" in p for p in missing)
    unnamed = loss_problems(
        assets, tmp_path, **{"actor_rollout_ref.actor.policy_loss.loss_mode": "ppo_penalt"}
    )
    assert any("'ppo_penalt' is not implemented" in p for p in unnamed)


def test_two_steps_train_with_a_loss_from_the_user_s_file(assets: Path, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    run = tmp_path / "run"
    assert main(short_run_overrides(assets, run, **USER_LOSS)) == 0  # PPO with a critic (gae)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert [r["training/global_step"] for r in steps] == [1, 2]
    for row in steps:
        # The loss's own metric reached the log: the actor ran the user's function.
        assert row["actor/kl_penalty"] >= 0.0 and math.isfinite(row["actor/pg_loss"])
        assert math.isfinite(row["actor/grad_norm"]) and row["actor/grad_norm"] > 0
        assert row["actor/pg_clipfrac"] == 0.0  # it clips nothing
    assert (run / "config.yaml").read_text().count("ppo_penalty") == 1
