"""One process per run directory: two `fulcrum train` started together on one folder, a dead holder,
the launcher's group; and Ctrl-C that stops a run at once ends with one line and nothing partial."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import make_assets, short_run_overrides

from fulcrum.trainer import run_lock
from fulcrum.trainer.checkpoint import manager as manager_module
from fulcrum.trainer.checkpoint import read_latest_step
from fulcrum.trainer.main_ppo import main as train_main

# Each call waits for the test to open the gate: the run that got the folder stays alive until the
# other one has been turned away, however the two processes happen to be scheduled.
GATED_REWARD = """
import os, time
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    deadline = time.monotonic() + 120
    while not os.path.exists({gate!r}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return 0.0
"""
HOLD_LOCK = """
import sys, time
from pathlib import Path
from fulcrum.trainer import run_lock
run_lock.acquire(Path(sys.argv[1]), "test holder")
print("locked", flush=True)
time.sleep(120)
"""
TAKE_LOCK = """
import sys
from pathlib import Path
from fulcrum.trainer import run_lock
try:
    run_lock.acquire(Path(sys.argv[1]), "test child")
except run_lock.RunDirBusyError as err:
    print(err)
    sys.exit(1)
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_assets(tmp_path_factory.mktemp("assets"))


def logged_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [int(r["training/global_step"]) for r in rows if "training/global_step" in r]


def test_two_trains_started_together_one_trains_the_other_stops_at_once(assets: Path, tmp_path: Path) -> None:
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    reward = tmp_path / "gated_reward.py"
    reward.write_text(GATED_REWARD.format(gate=str(gate)))
    command = [sys.executable, "-m", "fulcrum.trainer.main_ppo"]
    command += short_run_overrides(
        assets, run_dir, **{"custom_reward_function.path": reward, "trainer.total_training_steps": 1}
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        deadline = time.monotonic() + 120
        while all(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "neither process stopped: both train the same run directory"
            time.sleep(0.1)
        (loser,) = [p for p in procs if p.poll() is not None]
        (winner,) = [p for p in procs if p is not loser]
        gate.touch()
        out, err = loser.communicate(timeout=30)
        winner_out, winner_err = winner.communicate(timeout=120)
    finally:
        gate.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert loser.returncode == 1
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert (
        f"is in use by another fulcrum process: pid {winner.pid} on host {socket.gethostname()}" in lines[0]
    )
    assert "KL:" not in out  # stopped before the trainer was built: no data, no model loaded
    assert winner.returncode == 0, winner_out[-2000:] + winner_err[-2000:]
    assert logged_steps(run_dir) == [1]  # the step once: one run wrote the folder
    assert read_latest_step(run_dir) == 1
    assert not (run_dir / run_lock.LOCK_FILE).exists()  # given back at the end


def test_a_live_holder_is_named_and_a_dead_ones_lock_is_taken_over(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(run_lock.RunDirBusyError) as info:
            run_lock.acquire(run_dir, "fulcrum train")
        assert f"pid {holder.pid} on host {socket.gethostname()} (test holder, since" in str(info.value)
        holder.send_signal(signal.SIGKILL)  # dies without giving the lock back: its file stays
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.stdout.close()
    assert json.loads((run_dir / run_lock.LOCK_FILE).read_text())["pid"] == holder.pid
    run_lock.acquire(run_dir, "fulcrum train")
    try:
        assert json.loads((run_dir / run_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        run_lock.release(run_dir)
    assert not (run_dir / run_lock.LOCK_FILE).exists()


def test_the_launchers_lock_counts_for_its_own_processes_only(tmp_path: Path) -> None:
    """`fulcrum train` holds the lock while torchrun runs its processes: rank 0 of that group (told by
    FULCRUM_RUN_LOCK_OWNER) goes on; any other process is refused."""
    run_dir = tmp_path / "run"
    run_lock.acquire(run_dir, "fulcrum train")
    try:
        child = [sys.executable, "-c", TAKE_LOCK, str(run_dir)]
        ours = {**os.environ, run_lock.OWNER_ENV: run_lock.owner_tag()}
        assert subprocess.run(child, env=ours, capture_output=True, text=True).returncode == 0
        stranger = {k: v for k, v in os.environ.items() if k != run_lock.OWNER_ENV}
        refused = subprocess.run(child, env=stranger, capture_output=True, text=True)
        assert refused.returncode == 1 and f"pid {os.getpid()} on host" in refused.stdout
    finally:
        run_lock.release(run_dir)


def test_a_second_ctrl_c_while_saving_ends_with_one_line_and_no_partial_checkpoint(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second Ctrl-C lands while step 2's checkpoint is being fsync'ed (the first asked to stop)."""
    run_dir = tmp_path / "run"
    fsync_tree = manager_module.fsync_tree
    saves = []

    def ctrl_c_on_second_save(root: Path) -> None:
        saves.append(root)
        if len(saves) == 2:
            raise KeyboardInterrupt
        fsync_tree(root)

    monkeypatch.setattr(manager_module, "fsync_tree", ctrl_c_on_second_save)
    try:
        code = train_main(short_run_overrides(assets, run_dir, **{"trainer.total_training_steps": 3}))
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped fulcrum train")
    err = capsys.readouterr().err
    assert code == 130
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("fulcrum train:")]
    assert f"the last complete checkpoint is {run_dir / 'global_step_1'}" in line
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith("global_step")) == ["global_step_1"]
    assert read_latest_step(run_dir) == 1
    assert not list(run_dir.rglob("*.tmp-*")) and not (run_dir / run_lock.LOCK_FILE).exists()


def test_ctrl_c_while_the_data_loads_ends_with_one_line(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fulcrum.trainer import ppo_trainer

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ppo_trainer, "rl_datasets", interrupted)
    try:
        code = train_main(short_run_overrides(assets, tmp_path / "run"))
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped fulcrum train")
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("fulcrum train:")] == [
        "fulcrum train: stopped at once by Ctrl-C; no partial checkpoint is left; no checkpoint saved"
    ]
