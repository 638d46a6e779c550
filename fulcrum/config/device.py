"""Which device a run trains on, from `trainer.device` (auto | cpu | cuda): one rule for every command.

torch is imported only inside these functions, so `import fulcrum.config` stays light.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from fulcrum.config.keys import ConfigError
from fulcrum.config.schema import TrainerConfig

if TYPE_CHECKING:
    import torch


class DeviceError(ConfigError):
    """Fewer devices than the configuration asks for."""


def cuda_device_count() -> int:
    """Visible CUDA devices (0 without a CUDA build or driver)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def select_device(
    want: str,
    n_gpus_per_node: int = 1,
    nnodes: int = 1,
    cpu_when_no_cuda: bool = False,
    local_rank: int = 0,
) -> torch.device:
    """The training device. `cpu` always runs on the CPU; `auto` and `cuda` need n_gpus_per_node visible
    CUDA devices on this machine (else DeviceError says what to change) and train on cuda:local_rank
    (torchrun's LOCAL_RANK: one GPU per process). `cpu_when_no_cuda` (the one-device tools: `fulcrum
    sft`, the demo): `auto` without CUDA runs on the CPU.
    """
    import torch

    if want == "cpu":
        return torch.device("cpu")
    available = cuda_device_count()
    if want == "auto" and cpu_when_no_cuda and available == 0:
        return torch.device("cpu")
    asked = n_gpus_per_node * nnodes
    device, per_node, nodes = map(TrainerConfig.key, ("device", "n_gpus_per_node", "nnodes"))
    # No device at all: advising n_gpus_per_node=1 would not help.
    if n_gpus_per_node > available == 0:
        raise DeviceError(
            f"{device}={want} with {per_node}={n_gpus_per_node} × {nodes}={nnodes} "
            f"asks for {asked} CUDA device(s) but this machine has 0 (no GPU, or CUDA_VISIBLE_DEVICES hides "
            f"them). Set {device}=cpu to run on the CPU (slowly).",
            device,
        )
    if n_gpus_per_node > available:
        raise DeviceError(
            f"{per_node}={n_gpus_per_node} (× {nodes}={nnodes}) asks for {n_gpus_per_node} "
            f"CUDA device(s) on each machine but this one has {available}. Set "
            f"{per_node}={max(available, 1)} to match, or {device}=cpu to run on the CPU "
            "(slowly).",
            device,
        )
    return torch.device("cuda", local_rank)


# torch's intra-op CPU threads in a process that trains on CUDA. Its CPU work is small ops (batch assembly,
# each micro-batch's packing and padding, pinned copies) whose parallel regions, on a loaded host, wait for
# the slowest thread of the pool: with more than one thread a micro-batch's host work can outlast its GPU
# work, and the step becomes as slow as the busiest core.
HOST_THREADS_ON_CUDA = 1


def cap_host_threads(device: torch.device) -> int | None:
    """On CUDA, lower torch's intra-op threads to HOST_THREADS_ON_CUDA, unless OMP_NUM_THREADS says how
    many (torchrun sets 1 for its processes; a user's setting wins). Returns the count now in force when
    it was changed, None when left alone (a CPU run keeps every core: its compute is there)."""
    import torch

    if device.type != "cuda" or os.environ.get("OMP_NUM_THREADS"):
        return None
    threads = min(torch.get_num_threads(), HOST_THREADS_ON_CUDA)
    torch.set_num_threads(threads)
    return threads
