"""The trainer with checkpoints: exact resume across an epoch boundary, and SIGKILL in the middle of a save."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import cpu_ppo_overrides, make_assets

from fulcrum.config import load_config
from fulcrum.trainer.checkpoint import read_latest_step
from fulcrum.trainer.ppo_trainer import PPOTrainer

# Metrics that measure time or memory differ between any two runs; everything else must repeat.
UNREPEATABLE = ("timing_s/", "timing_per_token_ms/", "perf/")
# `fulcrum train` whose save of step {step} stops for 120 s once the actor is written, so the test can kill
# it there (with trainer.save_in_background, the write's thread stops; training goes on).
SLOW_SAVE_OF_STEP = """
import sys, time
from fulcrum.trainer.checkpoint import manager
from fulcrum.trainer.main_ppo import main
write_role = manager.CheckpointManager._write_role
def slow_write_role(role_dir, role):
    write_role(role_dir, role)
    if role_dir.parent.name.startswith("global_step_{step}.tmp-") and role_dir.name == "actor":
        time.sleep(120)
manager.CheckpointManager._write_role = staticmethod(slow_write_role)
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 4 prompts, batch 2: an epoch is 2 steps
    return make_assets(tmp_path_factory.mktemp("assets"), num_train=4)


def overrides(assets: Path, run_dir: Path, **extra: object) -> list[str]:
    """PPO with a critic, adaptive KL in the reward (reference + KL controller state) and a cosine LR."""
    keys = {
        "data.max_response_length": 8,
        "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 1,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 4,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 4,
        "actor_rollout_ref.actor.optim.lr": 1e-3,
        "actor_rollout_ref.actor.optim.warmup_style": "cosine",
        "actor_rollout_ref.actor.optim.lr_warmup_steps": 1,
        "critic.optim.lr": 1e-3,
        "algorithm.use_kl_in_reward": True,
        "algorithm.kl_ctrl.type": "adaptive",
        "algorithm.kl_ctrl.kl_coef": 0.01,
        "trainer.val_before_train": False,
        "trainer.test_freq": -1,
        "trainer.save_freq": 2,
        "trainer.total_training_steps": 4,
        "trainer.logger": "[console]",
    }
    return cpu_ppo_overrides(assets, run_dir, {**keys, **extra})


def read_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [int(r["training/global_step"]) for r in rows if "training/global_step" in r]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {int(r["training/global_step"]): r for r in rows if "training/global_step" in r}


def kill_when(script: str, args: list[str], env: dict[str, str], ready: Callable[[], bool]) -> int:
    """Run `python -c script args`, SIGKILL it as soon as `ready()` (polled every 0.1 s, 120 s at most),
    and return its exit status."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 120
        while not ready():
            assert proc.poll() is None, f"trainer ended early:\n{proc.stdout.read().decode()[-3000:]}"
            assert time.monotonic() < deadline, "the trainer never got there"
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    return proc.returncode


def repeatable(row: dict[str, float]) -> dict[str, float]:
    """Drop time and memory figures: the prefixed groups and the engine's seconds (`rollout/*_s`)."""
    return {
        k: v
        for k, v in row.items()
        if not k.startswith(UNREPEATABLE) and not (k.startswith("rollout/") and k.endswith("_s"))
    }


# native: the engine keeps its own copy of the weights, so a resume must hand it the restored ones.
@pytest.mark.parametrize("rollout", ["hf", "native"])
def test_two_steps_resume_two_steps_equals_four_steps(assets: Path, tmp_path: Path, rollout: str) -> None:
    torch.set_num_threads(1)
    straight = tmp_path / "straight"
    # hf: checkpoints written in the background (the default); native: in the step
    engine = {"actor_rollout_ref.rollout.name": rollout, "trainer.save_in_background": rollout == "hf"}
    PPOTrainer(load_config(overrides(assets, straight, **engine)), torch.device("cpu")).fit()
    expected = read_metrics(straight)
    assert sorted(expected) == [1, 2, 3, 4]
    assert (straight / "global_step_2").is_dir() and read_latest_step(straight) == 4

    # What a run stopped after step 2 leaves behind: its checkpoint. A new trainer resumes from it.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(straight / "global_step_2", resumed / "global_step_2")
    PPOTrainer(load_config(overrides(assets, resumed, **engine)), torch.device("cpu")).fit()
    got = read_metrics(resumed)
    assert sorted(got) == [3, 4], "resume at the epoch boundary must train steps 3 and 4"
    assert got[3]["training/epoch"] == 1.0  # the checkpoint ended epoch 0: next epoch, position 0
    for step in (3, 4):
        want, have = repeatable(expected[step]), repeatable(got[step])
        assert want.keys() == have.keys()
        differing = {k: (want[k], have[k]) for k in want if want[k] != have[k]}
        assert not differing, f"step {step} differs after resume: {differing}"  # identical, not just close
    assert "actor/reward_kl_penalty_coeff" in got[4] and "critic/vf_loss" in got[4]


@pytest.mark.slow
def test_sigkill_during_save_resumes_from_previous_checkpoint(assets: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "fulcrum.trainer.main_ppo"]
    args = overrides(assets, run_dir, **{"trainer.save_freq": 1, "trainer.total_training_steps": 3})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # The save of step 2 sleeps after writing the actor: kill the trainer then.
    started = lambda: bool(list(run_dir.glob("global_step_2.tmp-*/actor/optimizer.pt")))  # noqa: E731
    assert kill_when(SLOW_SAVE_OF_STEP.format(step=2), args, env, started) == -signal.SIGKILL
    assert read_latest_step(run_dir) == 1 and not (run_dir / "global_step_2").exists()
    assert list(run_dir.glob("global_step_2.tmp-*")), "the killed save should have left its temp folder"

    done = subprocess.run(command + args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert read_latest_step(run_dir) == 3
    assert sorted(p.name for p in run_dir.glob("global_step_*")) == [
        "global_step_1",
        "global_step_2",
        "global_step_3",
    ]
    assert sorted(read_metrics(run_dir)) == [1, 2, 3]  # step 1 not trained (logged) again: resumed from it


def rows_logged(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line).get("training/global_step", 0) for line in lines if line.endswith("}")]


@pytest.mark.slow
def test_sigkill_during_a_background_write_resumes_from_the_previous_checkpoint_and_loses_nothing(
    assets: Path, tmp_path: Path
) -> None:
    """Step 4's write stops once its actor is on disk; training goes on to step 5, and the process is
    killed then. The resumed run starts from step 2 and ends as a run never killed ends."""
    torch.set_num_threads(1)
    straight = tmp_path / "straight"
    keys = {"trainer.save_freq": 2, "trainer.total_training_steps": 6}
    PPOTrainer(load_config(overrides(assets, straight, **keys)), torch.device("cpu")).fit()
    expected = read_metrics(straight)

    run_dir = tmp_path / "run"
    args = overrides(assets, run_dir, **keys)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Step 5 logged while step 4's checkpoint is still being written: the step did not wait for it.
    at_step_5 = lambda: 5 in rows_logged(run_dir)  # noqa: E731
    assert kill_when(SLOW_SAVE_OF_STEP.format(step=4), args, env, at_step_5) == -signal.SIGKILL
    assert list(run_dir.glob("global_step_4.tmp-*/actor/optimizer.pt")), "step 4's write was not under way"
    assert read_latest_step(run_dir) == 2 and not (run_dir / "global_step_4").exists()

    command = [sys.executable, "-m", "fulcrum.trainer.main_ppo"]
    done = subprocess.run(command + args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "resumed from global_step 2" in done.stdout
    assert not list(run_dir.glob("*.tmp-*")), "the killed write's folder is removed at resume"
    assert [p.name for p in sorted(run_dir.glob("global_step_*"))] == [
        "global_step_2",
        "global_step_4",
        "global_step_6",
    ]
    got = read_metrics(run_dir)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]  # each step once: the killed run's rows 3-5 were dropped
    for step in (3, 4, 5, 6):
        assert repeatable(got[step]) == repeatable(expected[step]), f"step {step} differs after the kill"
    assert got[4]["timing_s/save_checkpoint"] >= got[4]["perf/checkpoint_wait_s"] >= 0
    assert any("perf/checkpoint_write_s" in got[step] for step in (5, 6))  # step 4's write, reported
    assert "checkpoint global_step_6 written in" in done.stdout
