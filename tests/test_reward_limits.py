"""A user's reward function cannot hang the run, end it as a "success", or change the data it is given.

Unit tests of the guard (fulcrum.reward.guard) and its time limit (fulcrum.reward.limits), then real
CPU training runs with functions that sleep, call sys.exit, mutate extra_info, or sleep while SIGTERM
arrives.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import make_assets
from test_faults_training import logged_steps, overrides

from fulcrum.reward.guard import GuardedRewardManager
from fulcrum.reward.limits import LIMIT_SIGNAL, RewardTimeout, TimeLimit
from fulcrum.reward.managers import NaiveRewardManager, build_reward_manager
from fulcrum.reward.scoring import RewardError, RewardResult
from fulcrum.trainer.checkpoint import is_complete, read_latest_step
from fulcrum.trainer.main_ppo import main as train_main


def sleeper(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    time.sleep(60)
    return 1.0


def exits(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    sys.exit(0)


def score(manager: object, n: int = 2, infos: list | None = None) -> RewardResult:
    return manager.score(["#### 1"] * n, ["1"] * n, ["openai/gsm8k"] * n, infos, [3] * n)  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------- the time limit
def test_time_limit_cuts_a_sleep_and_restores_the_signal_handler() -> None:
    before = signal.getsignal(LIMIT_SIGNAL)
    start = time.monotonic()
    with pytest.raises(RewardTimeout), TimeLimit(0.5, "test block"):
        time.sleep(30)
    assert time.monotonic() - start < 5
    assert signal.getsignal(LIMIT_SIGNAL) == before
    with TimeLimit(5.0, "quick block") as limit:
        total = sum(range(1000))
    assert total == 499500 and not limit.expired


def test_a_functions_own_alarm_timeout_neither_breaks_nor_cancels_the_limit() -> None:
    """Math graders time themselves with signal.alarm and cancel with alarm(0): both keep working."""

    class OwnTimeout(Exception):
        pass

    def own_handler(signum: int, frame: object) -> None:
        raise OwnTimeout

    fired = []
    previous = signal.signal(signal.SIGALRM, own_handler)
    start = time.monotonic()
    try:
        with pytest.raises(RewardTimeout), TimeLimit(2.0, "grader"):
            signal.alarm(1)
            try:
                time.sleep(5)
            except OwnTimeout:  # the function's own timeout fires after 1 s
                fired.append(time.monotonic() - start)
            signal.alarm(5)
            signal.alarm(0)  # ... and its clean-up cancels every alarm: the limit must still fire
            time.sleep(30)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert len(fired) == 1 and fired[0] < 1.9 and time.monotonic() - start < 10


def test_a_function_that_ignores_the_limit_ends_the_process_with_a_message(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import time
        from fulcrum.reward.limits import TimeLimit
        with TimeLimit(0.5, "the reward function stubborn in r.py", grace_s=0.5):
            while True:
                try:
                    time.sleep(10)
                except BaseException:
                    pass
        """
    )
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and time.monotonic() - start < 30
    assert "the reward function stubborn in r.py is still running 0.5 s after its time limit" in proc.stderr


# ---------------------------------------------------------------------------------- the guard
def test_a_sleeping_function_is_named_and_handled_by_on_error() -> None:
    start = time.monotonic()
    with pytest.raises(RewardError) as info:
        score(GuardedRewardManager(NaiveRewardManager(sleeper), timeout_s=0.5))
    message = str(info.value)
    assert f"sleeper in {__file__}" in message
    assert "did not finish scoring 2 responses within reward_model.timeout_s=0.5 s" in message

    result = score(GuardedRewardManager(NaiveRewardManager(sleeper), on_error="zero", timeout_s=0.5))
    assert result.scores == [0.0, 0.0] and result.num_errors == 2
    assert "sleeper" in result.errors[0] and "timeout_s=0.5" in result.errors[0]
    assert time.monotonic() - start < 10


def test_sys_exit_is_a_failure_named_and_handled_by_on_error() -> None:
    with pytest.raises(RewardError, match=r"sample 0 .*called sys.exit\(0\).*function exits in "):
        score(GuardedRewardManager(NaiveRewardManager(exits)))
    result = score(GuardedRewardManager(NaiveRewardManager(exits, on_error="zero"), on_error="zero"))
    assert result.scores == [0.0, 0.0] and result.num_errors == 2

    def batched_exit(**kwargs: object) -> list[float]:
        raise SystemExit(3)

    with pytest.raises(RewardError, match=r"batched_exit in .* failed: SystemExit: .*sys.exit\(3\)"):
        score(GuardedRewardManager(build_reward_manager("batch", batched_exit)))


def test_wrong_length_and_non_finite_results_are_named_and_handled_by_on_error() -> None:
    def one_score_short(solution_strs: list[str], **kwargs: object) -> list[float]:
        return [1.0] * (len(solution_strs) - 1)

    with pytest.raises(RewardError, match=r"one_score_short in .* returned 1 scores for 2 responses"):
        score(GuardedRewardManager(build_reward_manager("batch", one_score_short)))
    short = score(GuardedRewardManager(build_reward_manager("batch", one_score_short), on_error="zero"))
    assert short.scores == [0.0, 0.0] and short.num_errors == 2

    class NanManager:  # a user's manager, returning plain floats
        def score(self, responses: list[str], *args: object) -> list[float]:
            return [1.0, math.nan]

    with pytest.raises(RewardError, match=r"sample 1 .*returned nan \(not a finite number\)"):
        score(GuardedRewardManager(NanManager()))
    result = score(GuardedRewardManager(NanManager(), on_error="zero"))
    assert result.scores == [1.0, 0.0] and result.num_errors == 1 and result.num_nonfinite == 1


def test_each_call_gets_its_own_copy_of_extra_info() -> None:
    """The n responses of a prompt share one extra_info dict (and every epoch reuses it)."""
    seen: list[dict] = []

    def mutating(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> float:
        seen.append(json.loads(json.dumps(extra_info)))
        extra_info["answer"] = "overwritten"
        extra_info["steps"].append("x")
        return 1.0

    shared = {"answer": "42", "steps": ["a"]}
    manager = GuardedRewardManager(NaiveRewardManager(mutating))
    score(manager, 2, [shared, shared])
    score(manager, 2, [shared, shared])  # the next epoch
    assert seen == [{"answer": "42", "steps": ["a"]}] * 4
    assert shared == {"answer": "42", "steps": ["a"]}


def test_timeout_s_must_be_positive_or_null() -> None:
    with pytest.raises(ValueError, match=r"reward_model.timeout_s must be a positive number"):
        GuardedRewardManager(NaiveRewardManager(), timeout_s=0)
    assert score(GuardedRewardManager(NaiveRewardManager(), timeout_s=None)).scores == [1.0, 1.0]


# ---------------------------------------------------------------------------------- in a real run
@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_assets(tmp_path_factory.mktemp("assets"))
    head = "import os, signal, sys, threading, time\n"
    signature = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    (root / "sleeping_reward.py").write_text(head + signature + "    time.sleep(60)\n    return 1.0\n")
    (root / "exiting_reward.py").write_text(head + signature + "    sys.exit(0)\n")
    (root / "mutating_reward.py").write_text(
        head + signature + "    extra_info['seen'] = extra_info.get('seen', 0) + 1\n"
        "    return float(extra_info['seen'] == 1)\n"
    )
    # Step 2's reward: SIGTERM arrives from outside the function while it sleeps.
    (root / "sigterm_reward.py").write_text(
        head + "CALLS = []\n" + signature + "    CALLS.append(1)\n"
        "    if len(CALLS) == 3:  # batch 2 prompts, n=1: the first call of step 2\n"
        "        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()\n"
        "        time.sleep(30)\n"
        "    return 1.0\n"
    )
    return root


def run_overrides(assets: Path, run_dir: Path, reward_file: str, **extra: object) -> list[str]:
    """test_faults_training's small CPU run, one step, scored by `reward_file`."""
    keys = {"custom_reward_function.path": assets / reward_file, "trainer.total_training_steps": 1}
    return overrides(assets, run_dir, **{**keys, **extra})


def test_a_sleeping_reward_function_stops_the_run_at_its_time_limit(
    assets: Path, tmp_path: Path, capsys
) -> None:
    torch.set_num_threads(1)
    start = time.monotonic()
    args = run_overrides(assets, tmp_path / "raise", "sleeping_reward.py", **{"reward_model.timeout_s": 1})
    assert train_main(args) == 1
    err = capsys.readouterr().err
    assert f"compute_score in {assets / 'sleeping_reward.py'}" in err
    assert "did not finish scoring 2 responses within reward_model.timeout_s=1 s" in err
    run_dir = tmp_path / "zero"
    zero = {"reward_model.timeout_s": 1, "reward_model.on_error": "zero"}
    assert train_main(run_overrides(assets, run_dir, "sleeping_reward.py", **zero)) == 0
    assert logged_steps(run_dir)[0]["reward/num_errors"] == 2.0
    assert time.monotonic() - start < 30


def test_a_reward_function_calling_sys_exit_fails_the_run_with_a_message(
    assets: Path, tmp_path: Path, capsys
) -> None:
    torch.set_num_threads(1)
    assert train_main(run_overrides(assets, tmp_path / "run", "exiting_reward.py")) == 1
    err = capsys.readouterr().err
    assert "the function called sys.exit(0)" in err and "exiting_reward.py" in err


def test_a_reward_function_mutating_extra_info_changes_nothing_for_the_next_sample_or_epoch(
    assets: Path, tmp_path: Path
) -> None:
    """8 prompts, 2 a step, 2 responses each: 5 steps score each prompt's two responses, and the first
    prompt of the second epoch again; every call must see extra_info as the data set has it."""
    torch.set_num_threads(1)
    run_dir = tmp_path / "run"
    keys = {
        "actor_rollout_ref.rollout.n": 2,
        "trainer.total_training_steps": 5,
        "data.shuffle": False,
    }
    assert train_main(run_overrides(assets, run_dir, "mutating_reward.py", **keys)) == 0
    steps = logged_steps(run_dir)
    assert [row["training/epoch"] for row in steps][-1] == 1
    assert [row["critic/score/mean"] for row in steps] == [1.0] * 5


def test_sigterm_while_the_reward_function_sleeps_stops_at_once_and_saves_the_last_step(
    assets: Path, tmp_path: Path, capsys
) -> None:
    from fulcrum.config import load_config
    from fulcrum.trainer.ppo_trainer import PPOTrainer

    torch.set_num_threads(1)
    run_dir = tmp_path / "run"
    args = run_overrides(assets, run_dir, "sigterm_reward.py", **{"trainer.total_training_steps": 3})
    trainer = PPOTrainer(load_config(args), torch.device("cpu"))
    start = time.monotonic()
    trainer.fit()
    assert time.monotonic() - start < 20  # not the function's 30 s sleep, nor the 600 s limit
    assert trainer.exit_code == 128 + signal.SIGTERM
    assert [row["training/global_step"] for row in logged_steps(run_dir)] == [1]
    assert read_latest_step(run_dir) == 1 and is_complete(run_dir / "global_step_1", ["actor", "critic"])
    assert trainer.trainer_state()["data_loader"]["prompts"] == 2  # a resume scores step 2's prompts
    out = capsys.readouterr().out
    assert "stopped after step 1 (checkpoint saved); step 2 was dropped during its reward" in out
    # The run resumes from step 1 and trains step 2 (the reloaded file counts its calls afresh).
    resume = run_overrides(assets, run_dir, "sigterm_reward.py", **{"trainer.total_training_steps": 2})
    assert train_main(resume) == 0
    assert [row["training/global_step"] for row in logged_steps(run_dir)] == [1, 2]
