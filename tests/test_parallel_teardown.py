"""The end of a torchrun run: every rank leaves the process group and exits with its own code, even
when a peer never arrives (a rank stuck elsewhere) or failed; never a silent hang at exit.

Each rank is a real process (gloo), as torchrun starts them, running `run_then_leave` as `fulcrum
train` does."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers_dist import free_port

# rank 0: BODY0; rank 1: BODY1; then `run_then_leave`'s exit code is the process's.
SCRIPT = """
import sys, time
import torch.distributed as dist
from fulcrum.parallel import init_distributed
from fulcrum.parallel.group import run_then_leave

init_distributed("cpu")
rank = dist.get_rank()

def body():
    {body}

sys.exit(run_then_leave(body, timeout_s=float(sys.argv[1])))
"""


def launch(bodies: list[str], timeout_s: float) -> list[subprocess.Popen]:
    port = free_port()
    processes = []
    for rank, body in enumerate(bodies):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(sys.path),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(len(bodies)),
            "LOCAL_WORLD_SIZE": str(len(bodies)),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        script = SCRIPT.format(body=body)
        processes.append(
            subprocess.Popen(
                [sys.executable, "-c", script, str(timeout_s)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return processes


def finish(process: subprocess.Popen, timeout_s: float = 120) -> tuple[int, str]:
    try:
        _, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
        raise AssertionError(f"the rank did not exit (hung at teardown):\n{err[-3000:]}") from None
    return process.returncode, err


def test_a_finished_rank_exits_with_its_code_when_a_peer_never_reaches_the_end():
    # Rank 0 is stuck elsewhere (as in a collective the others never call); rank 1 finished its run.
    # Without the bound, rank 1 would wait in the final barrier until the group's 30-minute timeout.
    stuck, done = launch(["time.sleep(600)", "return 0"], timeout_s=3)
    try:
        code, err = finish(done)
        assert code == 0, err[-3000:]
        assert "rank 1 could not leave the process group (not done after 3 s" in err
        assert stuck.poll() is None  # it is still stuck: rank 1 did not wait for it
    finally:
        stuck.kill()
        stuck.communicate()


def test_a_failing_rank_and_a_finished_one_both_exit_with_their_own_codes():
    # Rank 0 fails while rank 1 finishes: rank 0 leaves without the barrier and shows its error; rank 1
    # sees its peer gone (or waits out the bound) and still exits 0.
    failing, done = launch(['raise RuntimeError("reward function broke")', "return 0"], timeout_s=20)
    codes = [finish(failing), finish(done)]
    assert codes[0][0] == 1 and "RuntimeError: reward function broke" in codes[0][1]
    assert codes[1][0] == 0, codes[1][1][-3000:]


def test_ranks_that_all_finish_leave_together_and_return_their_code():
    ranks = launch(["return 0", "return 0"], timeout_s=60)
    for code, err in map(finish, ranks):
        assert code == 0, err[-3000:]
        assert "could not leave" not in err
