"""Run a function in N CPU processes joined by gloo, as torchrun would start them (tests only)."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, out_dir: str, device: str
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    from fulcrum.parallel import init_distributed, shutdown

    init_distributed(device)
    try:
        result = fn(rank, world, *args)
    finally:
        shutdown()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_ranks(fn: Callable[..., Any], world: int = 2, *args: Any, device: str = "cpu") -> list[Any]:
    """`fn(rank, world, *args)` in `world` processes joined by gloo (device "cpu") or NCCL ("cuda", one
    GPU each); returns each rank's result (torch.save-able, on the CPU).

    CPU processes are forked (a spawn re-imports torch and costs seconds each); CUDA ones are spawned
    (a forked child cannot use CUDA), so there `fn` must be a module-level function.
    """
    method = "spawn" if device == "cuda" else "fork"
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _entry, args=(world, free_port(), fn, args, out_dir, device), nprocs=world, start_method=method
        )
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
