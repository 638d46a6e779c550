"""How many CUDA devices are visible (`trainer.device` is auto | cpu | cuda; only cpu avoids CUDA)."""

from __future__ import annotations


def cuda_device_count() -> int:
    """Visible CUDA devices (0 without a CUDA build or driver). torch is imported only here."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
