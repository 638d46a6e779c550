"""Which device a run trains on, from `trainer.device` (auto | cpu | cuda): one rule for every command.

torch is imported only inside these functions, so `import fulcrum.config` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fulcrum.config.keys import ConfigError

if TYPE_CHECKING:
    import torch


class DeviceError(ConfigError):
    """Fewer devices than the configuration asks for."""


def cuda_device_count() -> int:
    """Visible CUDA devices (0 without a CUDA build or driver)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def select_device(
    want: str, n_gpus_per_node: int = 1, nnodes: int = 1, cpu_when_no_cuda: bool = False
) -> torch.device:
    """The training device. `cpu` always runs on the CPU; `auto` and `cuda` need n_gpus_per_node × nnodes
    visible CUDA devices (else DeviceError says what to change) and train on cuda:0 (this version
    trains on one device, and says so when more are asked). `cpu_when_no_cuda` (the one-device tools:
    `fulcrum sft`, the demo): `auto` without CUDA runs on the CPU.
    """
    import torch

    if want == "cpu":
        return torch.device("cpu")
    available = cuda_device_count()
    if want == "auto" and cpu_when_no_cuda and available == 0:
        return torch.device("cpu")
    asked = n_gpus_per_node * nnodes
    if asked > available == 0:  # advising n_gpus_per_node=1 would not help: there is no device at all
        raise DeviceError(
            f"trainer.device={want} with trainer.n_gpus_per_node={n_gpus_per_node} × trainer.nnodes={nnodes} "
            f"asks for {asked} CUDA device(s) but this machine has 0 (no GPU, or CUDA_VISIBLE_DEVICES hides "
            "them). Set trainer.device=cpu to run on the CPU (slowly).",
            "trainer.device",
        )
    if asked > available:
        raise DeviceError(
            f"trainer.n_gpus_per_node={n_gpus_per_node} × trainer.nnodes={nnodes} asks for {asked} CUDA "
            f"device(s) but this machine has {available}. Set trainer.n_gpus_per_node={max(available, 1)} "
            "to match, or trainer.device=cpu to run on the CPU (slowly).",
            "trainer.device",
        )
    if asked > 1:
        print(
            f"note: {asked} devices asked; this version trains on one device (cuda:0). Multi-GPU is a later issue."
        )
    return torch.device("cuda", 0)
