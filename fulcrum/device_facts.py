"""What fulcrum knows of a CUDA card by its name: its dense bf16 peak and its memory bandwidth, the
denominators of MFU (`fulcrum.trainer.metrics`) and of the rollout's memory roofline
(`fulcrum.rollout.native.engine`). An unknown card gets None, and the figures built on it are left out."""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peaks (FLOP/s) by device-name fragment, as verl's `get_device_flops`.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40": 181e12,
    "A10": 125e12,
    "4090": 165e12,
    "3090": 71e12,
    "B200": 2250e12,
}

# HBM bandwidth (bytes/s) by device-name fragment, the more specific names first (an H100 SXM's name is
# "NVIDIA H100 80GB HBM3").
HBM_BANDWIDTH = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12))


def hbm_bandwidth(name: str) -> float | None:
    """The card's HBM bandwidth (bytes/s) from its name; None for an unknown card."""
    return next((bw for key, bw in HBM_BANDWIDTH if key in name), None)


def device_hbm_bandwidth(device: torch.device) -> float | None:
    """`hbm_bandwidth` of a CUDA device; None for the CPU or an unknown card."""
    return hbm_bandwidth(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def device_peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of a CUDA device by name; None for the CPU or an unknown device."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)
