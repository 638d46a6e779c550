"""The process group: who this process is (rank, world size, local rank) and how it talks to the others.

torchrun (`torch.distributed.run`) starts the processes and tells each one, through environment
variables, its RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and the rendezvous address
(MASTER_ADDR, MASTER_PORT). `init_distributed` reads them and joins the group: NCCL when the run
trains on CUDA (each process on cuda:LOCAL_RANK), gloo on the CPU. A process not started by torchrun
is a world of one and creates no group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from fulcrum.config.keys import ConfigError

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# A collective that waits longer than this is a hung peer (a rank that crashed or took another path):
# fail with a message instead of hanging until the job is killed. Generation of a long batch on a
# slow CPU is the longest legitimate wait between two collectives.
DEFAULT_TIMEOUT = timedelta(minutes=30)
# Leaving the group at the end of a run waits at most this long (the slowest rank's last work, e.g. rank
# 0 closing its loggers, then NCCL's teardown). Past it the run's outputs are already written: a rank
# that cannot leave says so and exits anyway, rather than hanging until a job timeout kills it.
TEARDOWN_TIMEOUT_S = 120.0
TEARDOWN_TIMEOUT_ENV = "FULCRUM_TEARDOWN_TIMEOUT_S"  # seconds; overrides TEARDOWN_TIMEOUT_S

logger = logging.getLogger(__name__)


class WorldSizeError(ConfigError):
    """torchrun started a different number of processes than the configuration asks for."""


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the run. The defaults are a single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    backend: str | None = None  # "nccl" | "gloo"; None when no process group exists

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the run directory's shared files (metrics, config, checkpoints' shared parts)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def nnodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def launched_by_torchrun(env: Mapping[str, str] | None = None) -> bool:
    """Whether torchrun (or any launcher that sets its variables) started this process."""
    env = os.environ if env is None else env
    return all(key in env for key in TORCHRUN_ENV)


def info_from_env(env: Mapping[str, str] | None = None) -> DistInfo:
    """The rank, world size and local rank torchrun gave this process (one process without torchrun)."""
    env = os.environ if env is None else env
    if not launched_by_torchrun(env):
        return DistInfo()
    world = int(env["WORLD_SIZE"])
    return DistInfo(
        rank=int(env["RANK"]),
        world_size=world,
        local_rank=int(env["LOCAL_RANK"]),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
    )


def check_world_size(n_gpus_per_node: int, nnodes: int, world_size: int) -> None:
    """`trainer.n_gpus_per_node × trainer.nnodes` must be the number of processes torchrun started."""
    asked = n_gpus_per_node * nnodes
    if asked != world_size:
        raise WorldSizeError(
            f"trainer.n_gpus_per_node={n_gpus_per_node} × trainer.nnodes={nnodes} = {asked} processes, but "
            f"torchrun started a world size of {world_size}. Set trainer.n_gpus_per_node to torchrun's "
            "--nproc_per_node and trainer.nnodes to its --nnodes.",
            "trainer.n_gpus_per_node",
        )


def backend_for(device_type: str) -> str:
    """NCCL between CUDA devices, gloo between CPU processes."""
    return "nccl" if device_type == "cuda" else "gloo"


def init_distributed(device_type: str, timeout: timedelta = DEFAULT_TIMEOUT) -> DistInfo:
    """Join torchrun's process group (once); a single process without torchrun gets `DistInfo()`.

    On CUDA this process uses cuda:LOCAL_RANK from here on (`torch.cuda.set_device`), so every
    `torch.device("cuda")` and NCCL call of this rank lands on its own GPU.
    """
    info = info_from_env()
    if not info.distributed:
        return info
    backend = backend_for(device_type)
    if not dist.is_initialized():
        kwargs = {}
        if device_type == "cuda":
            torch.cuda.set_device(info.local_rank)
            # Binding the group to the device lets NCCL set up its communicators eagerly.
            kwargs["device_id"] = torch.device("cuda", info.local_rank)
        dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
    return DistInfo(info.rank, info.world_size, info.local_rank, info.local_world_size, backend)


def current() -> DistInfo:
    """This process's place, from the initialised group (a single process when there is none)."""
    if not (dist.is_available() and dist.is_initialized()):
        return DistInfo()
    env = info_from_env()
    return DistInfo(
        dist.get_rank(), dist.get_world_size(), env.local_rank, env.local_world_size, dist.get_backend()
    )


def _bounded(fn: Callable[[], None], timeout_s: float) -> str | None:
    """Run `fn` in a daemon thread; None when it returned within `timeout_s`, else why not.

    The torch.distributed calls used here release the GIL while they wait, so this thread keeps
    running and can give up on them; a daemon thread left blocked does not keep the process alive.
    """
    failed: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as err:  # reported from the caller's thread
            failed.append(err)

    thread = threading.Thread(target=target, name="fulcrum-teardown", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return f"not done after {timeout_s:g} s"
    if failed:
        return f"{type(failed[0]).__name__}: {failed[0]}"
    return None


def teardown_timeout_s() -> float:
    """How long leaving the group may take: $FULCRUM_TEARDOWN_TIMEOUT_S, else TEARDOWN_TIMEOUT_S (read
    at the end of a run, so a bad value is a warning, not an error after the work is done)."""
    raw = os.environ.get(TEARDOWN_TIMEOUT_ENV, "")
    try:
        return float(raw) if raw else TEARDOWN_TIMEOUT_S
    except ValueError:
        logger.warning(
            "%s=%r is not a number of seconds: using %g", TEARDOWN_TIMEOUT_ENV, raw, TEARDOWN_TIMEOUT_S
        )
        return TEARDOWN_TIMEOUT_S


def shutdown(timeout_s: float | None = None, wait_for_peers: bool = True) -> bool:
    """Leave the process group (every subgroup with it); True when that finished within `timeout_s`
    (default `teardown_timeout_s()`).

    In order: this rank's device work finishes (`torch.cuda.synchronize`), the ranks meet in a barrier
    (`wait_for_peers`: on success every rank gets here; after an error the others may never come, so
    skip it), then `destroy_process_group` tears down every group, subgroups first. NCCL's teardown can
    block for good (a communicator whose calls a live CUDA graph captured: pytorch/pytorch#115388;
    a peer that never arrives), so all of it runs under a bound; False means it did not finish and the
    caller should end the process without further teardown (`os._exit`), with the run's exit code.
    Whoever captured collectives in CUDA graphs must release those graphs before calling this.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return True
    timeout_s = teardown_timeout_s() if timeout_s is None else timeout_s
    multi = dist.get_world_size() > 1
    on_cuda = dist.get_backend() == "nccl" and torch.cuda.is_available()
    device = torch.cuda.current_device() if on_cuda else None

    def teardown() -> None:
        if device is not None:
            torch.cuda.set_device(device)  # the current device is per thread
            torch.cuda.synchronize(device)
        if wait_for_peers and multi:
            try:
                dist.barrier()
            except RuntimeError as err:  # a peer gone (gloo: connection closed): leave all the same
                logger.warning("the ranks' last barrier failed: %s", err)
        dist.destroy_process_group()

    problem = _bounded(teardown, timeout_s)
    if problem is not None:
        logger.warning(
            "rank %d could not leave the process group (%s: a peer still busy or gone, or NCCL's teardown "
            "blocked); exiting without it, the run's outputs are already written",
            info_from_env().rank,
            problem,
        )
    return problem is None


def run_then_leave(body: Callable[[], int], timeout_s: float | None = None) -> int:
    """`body()`'s exit code, after leaving the process group (`shutdown`).

    On success every rank meets in the final barrier; after an error (a non-zero code or an exception)
    the others may be anywhere, even inside a collective, so this rank leaves without waiting for them.
    When the group cannot be left within the bound, the process ends here with the code it would have
    returned (130 after Ctrl-C, 1 after another exception, whose traceback is printed first): the rest
    of the interpreter's teardown would meet the same stuck communicator.
    """
    try:
        code = body()
    except BaseException as err:
        if not shutdown(timeout_s, wait_for_peers=False):
            traceback.print_exc()
            exit_now(130 if isinstance(err, KeyboardInterrupt) else 1)
        raise
    if not shutdown(timeout_s, wait_for_peers=code == 0):
        exit_now(code)
    return code


def exit_now(code: int) -> None:
    """End the process with `code` at once (output streams flushed), skipping the interpreter's teardown."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
