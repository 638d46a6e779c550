"""Strictly on-policy updates (one epoch, one mini-batch) take their old log-probs from their own forward:
the update trains exactly as with a separate old-log-prob pass, returns what that pass would give, and the
trainer leaves the pass out only when nothing reads old log-probs before the update."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import make_assets, short_run_overrides
from test_workers_update import cfg_for, rl_batch

from fulcrum.config.sections import actor_section
from fulcrum.trainer.main_ppo import main as train_main
from fulcrum.workers.actor import ActorWorker

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def test_an_update_without_old_log_probs_trains_as_with_their_pass_and_returns_it(tiny_dir: str) -> None:
    batch = rl_batch()
    with_pass = ActorWorker(actor_section(cfg_for(tiny_dir)), CPU, total_training_steps=10)
    old, entropy = with_pass.compute_log_prob(batch)
    scored = rl_batch()
    scored["old_log_probs"] = old
    metrics_with, none = with_pass.update_policy(scored, global_step=1)
    assert none is None  # the batch had them

    without = ActorWorker(actor_section(cfg_for(tiny_dir)), CPU, total_training_steps=10)
    metrics_without, given = without.update_policy(rl_batch(), global_step=1)
    assert given is not None
    recorded, recorded_entropy = given

    mask = batch["response_mask"].bool()
    assert torch.allclose(recorded[mask], old[mask], atol=1e-5)  # the batch's row order, as the pass's
    assert torch.allclose(recorded_entropy[mask], entropy[mask], atol=1e-5)
    for a, b in zip(with_pass.model.parameters(), without.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
    assert metrics_without["actor/pg_loss"] == pytest.approx(metrics_with["actor/pg_loss"], abs=1e-6)
    assert metrics_without["actor/ppo_kl"] == 0.0 and metrics_without["actor/pg_clipfrac"] == 0.0


def test_an_update_of_several_steps_without_old_log_probs_is_refused(tiny_dir: str) -> None:
    cfg = cfg_for(tiny_dir, "actor_rollout_ref.actor.ppo_mini_batch_size=4")  # 8 responses: 2 steps
    actor = ActorWorker(actor_section(cfg), CPU, total_training_steps=10)
    with pytest.raises(ValueError, match=r"no old_log_probs.*more than one optimiser step"):
        actor.update_policy(rl_batch(), global_step=1)


def step_rows(run_dir: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return [r for r in rows if "training/global_step" in r]


@pytest.mark.parametrize(
    ("extra", "pass_runs"),
    [
        ({}, False),  # GRPO, 2 prompts x 2 in one mini-batch: the update gives the old log-probs
        ({"actor_rollout_ref.actor.ppo_mini_batch_size": 1}, True),  # two optimiser steps
        ({"algorithm.use_kl_in_reward": True}, True),  # the reward's KL penalty reads them first
    ],
    ids=["on-policy", "two-mini-batches", "kl-in-reward"],
)
def test_the_trainer_leaves_the_pass_out_only_when_nothing_needs_it(
    tmp_path: Path, extra: dict[str, object], pass_runs: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    assets = make_assets(tmp_path / "assets")
    keys = {
        "algorithm.adv_estimator": "grpo",
        "actor_rollout_ref.rollout.n": 2,
        "trainer.save_freq": -1,
        **extra,
    }
    run_dir = tmp_path / "run"
    assert train_main(short_run_overrides(assets, run_dir, **keys)) == 0
    said = "old log-probs: from the actor's update" in capsys.readouterr().out  # the start-up line
    assert said != pass_runs
    for row in step_rows(run_dir):
        assert (row["timing_s/old_log_prob"] > 0) == pass_runs
        # the pass's metrics either way: from the pass, or from the update's forward
        assert row["actor/entropy"] > 0
        assert 0 <= row["rollout/logprob_diff_mean"] <= row["rollout/logprob_diff_max"] < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_update_returns_what_the_compiled_pass_gives(tiny_dir: str) -> None:
    """The packed bf16 path on CUDA, decoder layers and log-softmax chunks compiled (the chunks with the
    entropy too, in the update): what an update without old log-probs returns is its pass's result at
    bf16's tolerance (the project's: mean gap 0.02), and the loss saw a ratio of exactly 1."""
    actor = ActorWorker(actor_section(cfg_for(tiny_dir)), CUDA, total_training_steps=10)
    batch = rl_batch()
    old, entropy = actor.compute_log_prob(batch)
    metrics, given = actor.update_policy(rl_batch(), global_step=1)
    assert given is not None
    recorded, recorded_entropy = given
    mask = batch["response_mask"].bool()
    assert (recorded[mask] - old[mask]).abs().mean() < 0.02
    assert (recorded_entropy[mask] - entropy[mask]).abs().mean() < 0.02 * entropy[mask].abs().mean()
    assert metrics["actor/ppo_kl"] == 0.0 and torch.isfinite(recorded).all()
