"""Faults in a real training run: NaN losses, reward functions that raise or return NaN, and Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import cpu_ppo_overrides, make_assets
from safetensors.torch import load_file

from fulcrum.trainer import sampling
from fulcrum.trainer.checkpoint import is_complete, read_latest_step
from fulcrum.trainer.main_ppo import main as train_main
from fulcrum.trainer.sampling import score_batch


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_assets(tmp_path_factory.mktemp("assets"))
    (root / "nan_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return float('nan')\n"
    )
    (root / "raising_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    raise ValueError('cannot parse the answer')\n"
    )
    return root


def overrides(assets: Path, run_dir: Path, **extra: object) -> list[str]:
    keys = {
        "data.max_response_length": 8,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 2,
        "trainer.val_before_train": False,
        "trainer.test_freq": -1,
        "trainer.logger": "[console]",
    }
    return cpu_ppo_overrides(assets, run_dir, {**keys, **extra})


def logged_steps(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if "training/global_step" in row]


def test_nan_loss_skips_updates_counts_them_and_stops_after_max_nan_steps(
    assets: Path, tmp_path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NaN that reaches the losses (here: token scores made NaN after the reward manager checked them)."""
    torch.set_num_threads(1)
    run_dir = tmp_path / "run"

    def nan_scores(batch, tokenizer, manager):
        scores, result = score_batch(batch, tokenizer, manager)
        return torch.full_like(scores, float("nan")), result

    monkeypatch.setattr(sampling, "score_batch", nan_scores)
    args = overrides(
        assets,
        run_dir,
        **{
            "trainer.max_nan_steps": 2,
            "trainer.save_freq": 1,
            "trainer.total_training_steps": 4,
        },
    )
    assert train_main(args) == 1
    err = capsys.readouterr().err
    assert "stopping at step 2: 2 consecutive steps with a NaN/Inf loss or gradient norm" in err
    assert "trainer.max_nan_steps=2" in err and "no step had finite losses" in err

    rows = logged_steps(run_dir)
    assert [r["training/global_step"] for r in rows] == [
        1,
        2,
    ]  # the failing step is logged, then the run stops
    assert [r["training/nan_skipped_steps"] for r in rows] == [1, 2]
    # Step 1's update was skipped, so its checkpoint holds the initial, finite weights; step 2 is not saved.
    assert read_latest_step(run_dir) == 1 and not (run_dir / "global_step_2").exists()
    saved = load_file(str(run_dir / "global_step_1" / "actor" / "model.safetensors"))
    initial = load_file(str(assets / "model" / "model.safetensors"))
    assert all(torch.equal(saved[k], initial[k]) for k in initial)


def test_reward_function_that_raises_stops_with_sample_data_source_and_exception(
    assets: Path, tmp_path: Path, capsys
) -> None:
    torch.set_num_threads(1)
    args = overrides(
        assets,
        tmp_path / "run",
        **{"custom_reward_function.path": assets / "raising_reward.py", "trainer.total_training_steps": 1},
    )
    assert train_main(args) == 1
    err = capsys.readouterr().err
    assert "reward function failed on sample 0" in err
    assert "synthetic/arithmetic" in err and "ValueError: cannot parse the answer" in err


def test_reward_errors_can_score_zero_and_are_counted(assets: Path, tmp_path: Path) -> None:
    """reward_model.on_error=zero: the run goes on, every failed sample scores 0 and is counted."""
    torch.set_num_threads(1)
    run_dir = tmp_path / "run"
    args = overrides(
        assets,
        run_dir,
        **{
            "custom_reward_function.path": assets / "raising_reward.py",
            "reward_model.on_error": "zero",
            "trainer.total_training_steps": 1,
        },
    )
    assert train_main(args) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r.get("training/global_step") == 1)
    assert step["reward/num_errors"] == 2.0  # train_batch_size 2 prompts x n=1, every call raised
    assert step["critic/score/mean"] == 0.0


def test_nan_reward_is_named_and_handled_by_on_error(assets: Path, tmp_path: Path, capsys) -> None:
    torch.set_num_threads(1)
    reward = {"custom_reward_function.path": assets / "nan_reward.py", "trainer.total_training_steps": 1}
    assert train_main(overrides(assets, tmp_path / "raise", **reward)) == 1
    err = capsys.readouterr().err
    assert "reward function failed on sample 0 (data_source 'synthetic/arithmetic')" in err
    assert "returned nan (not a finite number)" in err

    run_dir = tmp_path / "zero"
    assert train_main(overrides(assets, run_dir, **reward, **{"reward_model.on_error": "zero"})) == 0
    step = logged_steps(run_dir)[0]
    assert step["reward/num_nonfinite"] == 2.0 and step["reward/num_errors"] == 2.0
    assert step["critic/score/mean"] == 0.0 and step["training/nan_skipped_steps"] == 0  # the update ran


@pytest.mark.slow
def test_ctrl_c_finishes_the_step_saves_and_exits_130(assets: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = overrides(assets, run_dir, **{"trainer.save_freq": -1, "trainer.total_training_steps": 1000})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fulcrum.trainer.main_ppo", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").is_file() or not logged_steps(run_dir):
            assert proc.poll() is None, f"trainer ended early:\n{proc.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, "the trainer never finished a step"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output[-3000:]
    last = int(logged_steps(run_dir)[-1]["training/global_step"])
    assert last < 1000 and read_latest_step(run_dir) == last
    assert is_complete(run_dir / f"global_step_{last}", ["actor", "critic"])
    assert f"stopped after step {last} (checkpoint saved)" in output


def test_out_of_memory_in_the_critic_update_names_its_phase_and_levers(
    assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real critic worker runs out of memory in its optimiser step (Adam's first step allocates its
    state): the report names update_critic, from the step's timer, and the critic's levers first."""
    from fulcrum.config import load_config
    from fulcrum.trainer.faults import OutOfMemoryHelp
    from fulcrum.trainer.ppo_trainer import PPOTrainer

    torch.set_num_threads(1)
    cfg = load_config(overrides(assets, tmp_path / "run", **{"trainer.total_training_steps": 1}))
    trainer = PPOTrainer(cfg, torch.device("cpu"))
    assert trainer.critic is not None  # GAE, the default estimator, trains a critic

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(trainer.critic.optimizer, "step", out_of_memory)
    with pytest.raises(OutOfMemoryHelp) as info:
        trainer.fit()
    lines = str(info.value).splitlines()
    assert lines[0].startswith("out of device memory during update_critic: CUDA out of memory.")
    assert (
        lines[1].startswith("levers that cut memory")
        and "critic.ppo_micro_batch_size_per_gpu [2]" in lines[2]
    )


def test_ctrl_c_while_a_step_is_being_logged_still_saves_that_step(
    assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The signal lands after the step's own save check (here: while its metrics are written): the run
    must still checkpoint the step it stops after, as it says."""
    from fulcrum.config import load_config
    from fulcrum.trainer.ppo_trainer import PPOTrainer

    torch.set_num_threads(1)
    run_dir = tmp_path / "run"
    args = overrides(assets, run_dir, **{"trainer.save_freq": -1, "trainer.total_training_steps": 3})
    trainer = PPOTrainer(load_config(args), torch.device("cpu"))
    log = trainer.tracking.log

    def log_then_ctrl_c(data: dict, step: int) -> None:
        log(data, step)
        os.kill(os.getpid(), signal.SIGINT)  # the trainer's handler catches it (trainer.save_on_interrupt)

    monkeypatch.setattr(trainer.tracking, "log", log_then_ctrl_c)
    trainer.fit()
    assert trainer.exit_code == 130
    assert read_latest_step(run_dir) == 1 and is_complete(run_dir / "global_step_1", ["actor", "critic"])
