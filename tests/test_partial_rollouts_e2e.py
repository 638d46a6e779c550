"""trainer.v1.trainer_mode=colocate_async end to end on the CPU: GRPO with the tiny model and uneven
response budgets; carried-over groups are trained at a later step within the staleness bound, the
off-policy metrics are logged, a resumed run drops the groups in flight with a line that says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from budget_data import with_budgets
from helpers import cpu_ppo_overrides, make_assets

from fulcrum.trainer.main_ppo import main

SPANS = "training/off_policy/trajectory_spans"
WORST = "training/off_policy/trajectory_staleness_worst"
THRESHOLD = "trainer.v1.sampler.max_off_policy_threshold"


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every other row may answer in 2 tokens, the others in up to 8 (their extra_info says so): a
    long tail."""
    root = make_assets(tmp_path_factory.mktemp("assets"), num_train=32, num_test=2)
    with_budgets(root / "data/train.parquet", lambda i: 2 if i % 2 else 8)
    return root


def overrides(assets: Path, run: Path, *extra: str) -> list[str]:
    keys = {
        "data.max_response_length": 8,
        "actor_rollout_ref.rollout.name": "native",
        "actor_rollout_ref.rollout.n": 2,
        "+actor_rollout_ref.rollout.engine_kwargs.native.decode_steps": 2,  # stop soon after enough groups
        "algorithm.adv_estimator": "grpo",
        "algorithm.rollout_correction.rollout_is": "token",
        "trainer.use_v1": True,
        "trainer.v1.trainer_mode": "colocate_async",
        "trainer.v1.colocate_async.num_warmup_batches": 2,
        "trainer.val_before_train": False,
        "trainer.logger": "[console]",
    }
    return [*cpu_ppo_overrides(assets, run, keys), *extra]


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_carried_groups_are_trained_later_within_the_bound(assets: Path, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    run = tmp_path / "bound4"
    assert main(overrides(assets, run, "trainer.total_training_steps=6", f"{THRESHOLD}=4")) == 0
    steps = rows(run)
    assert [r["training/global_step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert max(r[f"{SPANS}/max"] for r in steps) >= 2  # a trajectory sampled across a weight update
    assert max(r["training/off_policy/carried_token_share"] for r in steps) > 0
    assert max(r["response_length/max"] for r in steps) == 8  # the long answers are trained too
    assert all(r[f"{WORST}/max"] <= 3 for r in steps)  # at most 4 versions spanned
    # the engine's work each step, as a synchronous step reports it (none in a step whose groups were all
    # complete already), counting the tokens of the groups in flight where they were sampled
    assert all((r["rollout/decode_steps"] > 0) == (r["rollout/generated_tokens"] > 0) for r in steps)
    trained = sum(r["response_length/mean"] * 2 * 2 for r in steps)  # 2 prompts x n=2 a step
    assert sum(r["rollout/generated_tokens"] for r in steps) >= trained


@pytest.mark.parametrize("strategy", ["drop", "wait"])
def test_groups_at_the_bound_are_dropped_or_waited_for(assets: Path, tmp_path: Path, strategy: str) -> None:
    torch.set_num_threads(1)
    run = tmp_path / strategy
    keys = (
        "trainer.total_training_steps=4",
        f"{THRESHOLD}=2",
        f"trainer.v1.sampler.max_off_policy_strategy={strategy}",
    )
    assert main(overrides(assets, run, *keys)) == 0
    steps = rows(run)
    assert all(r[f"{WORST}/max"] <= 1 for r in steps)  # threshold 2: at most one version behind
    long_trained = max(r["response_length/max"] for r in steps) == 8
    dropped = sum(r["training/off_policy/dropped_groups"] for r in steps)
    if strategy == "drop":  # the long groups need three steps: dropped before they complete
        assert dropped > 0 and not long_trained
    else:  # the step at the bound finishes them
        assert long_trained and max(r[f"{SPANS}/max"] for r in steps) == 2


def test_on_policy_threshold_trains_no_carried_token(assets: Path, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    run = tmp_path / "on_policy"
    keys = ("trainer.total_training_steps=3", f"{THRESHOLD}=1")
    assert main(overrides(assets, run, *keys)) == 0
    steps = rows(run)
    assert all(r[f"{SPANS}/max"] == 1 and r["training/off_policy/carried_token_share"] == 0 for r in steps)
    assert sum(r["training/off_policy/dropped_groups"] for r in steps) > 0


def test_a_resumed_run_drops_the_groups_in_flight_and_says_so(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.set_num_threads(1)
    run = tmp_path / "resume"
    assert main(overrides(assets, run, "trainer.total_training_steps=2", "trainer.save_freq=1")) == 0
    capsys.readouterr()
    assert main(overrides(assets, run, "trainer.total_training_steps=3", "trainer.save_freq=1")) == 0
    out = capsys.readouterr().out
    assert "resumed from global_step 2" in out
    assert "partial rollouts: the 4 prompt groups in flight at global_step 2 are dropped" in out
    assert [r["training/global_step"] for r in rows(run)][-1] == 3
