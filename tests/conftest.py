"""Shared pytest setup: GPU tests are skipped where no CUDA device is present; the tiny models."""

import os

# Before torch loads OpenMP: spinning worker threads made busy 2-core runs several times slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pathlib import Path

import pytest
import torch

from fulcrum.models.tiny import build_tiny_model

# Two cores in CI, shared by pytest-xdist's workers (`scripts/test.sh` runs two): keep torch from
# oversubscribing them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(torch.get_num_threads(), 2) // _WORKERS))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer tiny model folder (read-only: copy it before changing it)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model",
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=2048,
    )


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The default tiny Qwen2 model folder (`build_tiny_model`, seed 0), built once (read-only)."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2", seed=0))
