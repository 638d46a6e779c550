"""Every random generator a run draws from, saved as tensors and numbers (loadable with weights_only=True)."""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """Python's `random`, numpy's legacy global generator, torch's CPU generator and each CUDA device's."""
    version, mt_state, gauss_next = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state(legacy=True)
    return {
        "python": {"version": version, "state": list(mt_state), "gauss_next": gauss_next},
        "numpy": {
            "kind": np_kind,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_cached),
        },
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what `capture_rng_state` took; warns when the CUDA device count differs."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npy = state["numpy"]
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch_cpu"])
    cuda_states = state.get("torch_cuda") or []
    if cuda_states and torch.cuda.is_available():
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            warnings.warn(
                f"checkpoint holds CUDA RNG state for {len(cuda_states)} devices, this machine has "
                f"{torch.cuda.device_count()}: CUDA sampling will not repeat the original run exactly",
                stacklevel=2,
            )
