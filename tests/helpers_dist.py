"""Run a function in N CPU processes joined by gloo, as torchrun would start them (tests only)."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

# A hung rank fails its test after this long instead of hanging the suite (a GPU run is seconds; a
# CPU run on a busy 2-core CI machine takes up to a few minutes).
TIMEOUT_S = {"cpu": 900.0, "cuda": 300.0}
LOG_TAIL_CHARS = 3000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, out_dir: str, device: str
) -> None:
    # Each rank writes its own log (stdout and stderr), shown by `run_ranks` when a rank fails or hangs.
    log = os.open(os.path.join(out_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    os.environ.setdefault("FULCRUM_TEARDOWN_TIMEOUT_S", "60")  # a rank that cannot leave fails soon
    torch.set_num_threads(1)
    from fulcrum.parallel import init_distributed
    from fulcrum.parallel.group import run_then_leave

    init_distributed(device)
    results: list[Any] = []

    def body() -> int:
        results.append(fn(rank, world, *args))
        return 0

    # As `fulcrum train` ends a rank: a rank that cannot leave ends without a result (see run_ranks).
    run_then_leave(body, timeout_s=60.0)
    torch.save(results[0], os.path.join(out_dir, f"rank{rank}.pt"))


def log_tails(out_dir: str | Path, world: int) -> str:
    """The end of each rank's log, for a failure message."""
    parts = []
    for rank in range(world):
        path = Path(out_dir) / f"rank{rank}.log"
        text = path.read_text(errors="replace") if path.exists() else "(no log)"
        parts.append(f"--- rank {rank} (last {LOG_TAIL_CHARS} characters) ---\n{text[-LOG_TAIL_CHARS:]}")
    return "\n".join(parts)


def run_ranks(
    fn: Callable[..., Any], world: int = 2, *args: Any, device: str = "cpu", timeout_s: float | None = None
) -> list[Any]:
    """`fn(rank, world, *args)` in `world` processes joined by gloo (device "cpu") or NCCL ("cuda", one
    GPU each); returns each rank's result (torch.save-able, on the CPU).

    CPU processes are forked (a spawn re-imports torch and costs seconds each); CUDA ones are spawned
    (a forked child cannot use CUDA), so there `fn` must be a module-level function. A rank that fails,
    or any still running after `timeout_s` (default `TIMEOUT_S[device]`), fails the call with the tail
    of every rank's log; the ranks left are killed.
    """
    method = "spawn" if device == "cuda" else "fork"
    timeout_s = TIMEOUT_S[device] if timeout_s is None else timeout_s
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _entry,
            args=(world, free_port(), fn, args, out_dir, device),
            nprocs=world,
            join=False,
            start_method=method,
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{world} ranks still running after {timeout_s:g} s (hung?)\n{log_tails(out_dir, world)}"
                    )
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            raise RuntimeError(f"{err}\n{log_tails(out_dir, world)}") from err
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        missing = [r for r in range(world) if not os.path.exists(os.path.join(out_dir, f"rank{r}.pt"))]
        if missing:  # e.g. a rank that ended itself early (os._exit) with code 0
            raise RuntimeError(f"ranks {missing} exited without a result\n{log_tails(out_dir, world)}")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
