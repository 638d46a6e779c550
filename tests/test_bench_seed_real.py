"""bench/seed_real.py: the runs are the seed's command (or verl's GRPO example) for one GPU with only the
experiment's keys added, each key given once; every validation's answers are scored strict, flexible, by
format and by truncation, against the step and the seconds since the trainer started."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from seed_real import run_overrides, summarise_run, wait_or_stop


def keys_of(overrides: list[str]) -> dict[str, str]:
    pairs = [o.split("=", 1) for o in overrides]
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), "a key given twice"
    return dict(pairs)


@pytest.mark.parametrize("name", ["ppo", "original", "grpo", "grpo-per-gpu"])
def test_each_run_is_its_command_on_one_gpu_with_the_budget(name: str, tmp_path: Path) -> None:
    keys = keys_of(run_overrides(name, Path("M"), Path("D"), 3, 540, tmp_path / "run"))
    assert keys["trainer.n_gpus_per_node"] == "1"
    assert keys["actor_rollout_ref.rollout.tensor_model_parallel_size"] == "1"
    assert keys["trainer.val_before_train"] == "True"  # the seed writes False: step 0 is validated here
    assert (keys["trainer.seed"], keys["trainer.wall_clock_budget_s"]) == ("3", "540")
    assert keys["trainer.validation_data_dir"] == str(tmp_path / "run" / "generations")
    assert "trainer.total_training_steps" not in keys  # the budget ends the run
    if name == "ppo":
        assert (keys["data.train_batch_size"], keys["actor_rollout_ref.actor.optim.lr"]) == ("512", "1.5e-6")
    if name == "original":  # the seed's starting values
        assert (keys["data.train_batch_size"], keys["actor_rollout_ref.actor.optim.lr"]) == ("256", "1e-6")
        assert keys["actor_rollout_ref.rollout.gpu_memory_utilization"] == "0.4"
        assert keys["algorithm.kl_ctrl.target_kl"] == "0.1"
    if name == "grpo":
        assert (keys["algorithm.adv_estimator"], keys["actor_rollout_ref.rollout.n"]) == ("grpo", "5")
        assert (keys["data.train_batch_size"], keys["actor_rollout_ref.actor.ppo_mini_batch_size"]) == (
            "1024",
            "256",
        )
    if (
        name == "grpo-per-gpu"
    ):  # one of the example's 8 GPUs: its share of the global batch, all else as written
        whole = keys_of(run_overrides("grpo", Path("M"), Path("D"), 3, 540, tmp_path / "run"))
        assert (keys["data.train_batch_size"], keys["actor_rollout_ref.actor.ppo_mini_batch_size"]) == (
            "128",
            "32",
        )
        changed = {k for k in whole if whole[k] != keys.get(k)}
        assert changed == {"data.train_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size"}


def answer(text: str, truth: str, finished: bool = True) -> dict[str, object]:
    return {"output": text, "gts": truth, "response_length": len(text.split()), "finished": finished}


def test_validations_are_scored_against_steps_and_seconds(tmp_path: Path) -> None:
    run = tmp_path / "ppo-s1"
    (run / "generations").mkdir(parents=True)
    rows = [
        {"val-core/openai/gsm8k/reward/mean@1": 0.0, "perf/elapsed_s": 18.0},  # the step-0 validation
        *({"training/global_step": s, "timing_s/step": 4.0, "perf/throughput": 3e4, "timing_s/gen": 0.7,
           "perf/elapsed_s": 18.0 + 5 * s} for s in range(1, 11)),
    ]  # fmt: skip
    rows[-1]["timing_s/testing"] = 2.0
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    before = [answer("so the answer is 72", "72"), answer("it costs 1,250 dollars", "1250", finished=False)]
    after = [answer("48 + 24 = 72\n#### 72", "72"), answer("#### 1,250", "1250")]
    for step, answers in ((0, before), (10, after)):
        (run / "generations" / f"{step}.jsonl").write_text("\n".join(json.dumps(a) for a in answers))
    summary = summarise_run(run)
    base, final = summary["base"], summary["final"]
    assert (base["step"], base["strict"], base["flexible"], base["format"], base["truncated"]) == (
        0,
        0,
        1,
        0,
        0.5,
    )
    assert (final["step"], final["strict"], final["format"], final["truncated"]) == (10, 1, 1, 0)
    assert (base["elapsed_s"], final["elapsed_s"]) == (18.0, 68.0)
    assert summary["time_to_90pct_of_best_s"] == 68.0 and summary["steps_to_90pct_of_best"] == 10
    assert summary["warm_step_s"] == 4.0  # steps after the third, without a validation


GRACEFUL = """
import signal, sys, time
def stop(*_):
    open(sys.argv[1], "w").write("saved")
    sys.exit(130)
signal.signal(signal.SIGINT, stop)
print("ready", flush=True)
time.sleep(60)
"""


def test_a_run_past_its_hard_limit_is_stopped_by_the_signal_it_saves_on(tmp_path: Path) -> None:
    """`--hard-limit-s`: a run still going is sent SIGINT (the trainer finishes its step, saves and exits),
    and the bench goes on to summarise it, seconds later, with the run's own exit code."""
    marker = tmp_path / "saved"
    proc = subprocess.Popen([sys.executable, "-c", GRACEFUL, str(marker)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    started = time.monotonic()
    assert wait_or_stop(proc, 0.5) == 130
    assert time.monotonic() - started < 5 and marker.read_text() == "saved"


def test_a_run_deaf_to_sigint_is_killed_after_two_graces(tmp_path: Path) -> None:
    deaf = GRACEFUL.replace(
        "signal.signal(signal.SIGINT, stop)", "signal.signal(signal.SIGINT, signal.SIG_IGN)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", deaf, str(tmp_path / "saved")], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    started = time.monotonic()
    assert wait_or_stop(proc, 0.2) == -9  # SIGKILL
    assert time.monotonic() - started < 10


def test_a_run_that_ends_in_time_keeps_its_exit_code() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert wait_or_stop(proc, 30) == 3
