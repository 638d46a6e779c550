"""Which device a run uses: `trainer.device` = auto | cpu | cuda."""

from __future__ import annotations

from fulcrum.config.coerce import ConfigError


def cuda_device_count() -> int:
    """Visible CUDA devices (0 without a CUDA build or driver). torch is imported only here."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(name: str) -> str:
    """'auto' -> 'cuda' when a CUDA device is visible, else 'cpu'; 'cuda' without one is an error."""
    if name == "cpu":
        return "cpu"
    count = cuda_device_count()
    if name == "auto":
        return "cuda" if count > 0 else "cpu"
    if name == "cuda":
        if count == 0:
            raise ConfigError(
                "trainer.device: cuda asked for but no CUDA device is visible; use trainer.device=cpu"
            )
        return "cuda"
    raise ConfigError(f"trainer.device: expected one of [auto, cpu, cuda], got {name!r}")
