"""Shared pytest setup: GPU tests are skipped where no CUDA device is present."""

import os

# Before torch loads OpenMP: spinning worker threads made busy 2-core runs several times slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

# Two cores in CI: keep torch from oversubscribing them.
torch.set_num_threads(min(torch.get_num_threads(), 2))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
