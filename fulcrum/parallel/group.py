"""The process group: who this process is (rank, world size, local rank) and how it talks to the others.

torchrun (`torch.distributed.run`) starts the processes and tells each one, through environment
variables, its RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and the rendezvous address
(MASTER_ADDR, MASTER_PORT). `init_distributed` reads them and joins the group: NCCL when the run
trains on CUDA (each process on cuda:LOCAL_RANK), gloo on the CPU. A process not started by torchrun
is a world of one and creates no group.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
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


def barrier() -> None:
    """Wait for every rank (nothing to wait for in a single process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def shutdown() -> None:
    """Leave the process group (at the end of a run, so that NCCL does not warn about a leak)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
