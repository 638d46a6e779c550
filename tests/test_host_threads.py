"""A run on CUDA keeps torch's CPU thread pool small; a user's OMP_NUM_THREADS and CPU runs are left alone."""

from __future__ import annotations

import pytest
import torch

from fulcrum.config.device import HOST_THREADS_ON_CUDA, cap_host_threads


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_a_cuda_run_caps_the_intra_op_threads(threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(HOST_THREADS_ON_CUDA + 4)
    assert cap_host_threads(torch.device("cuda", 0)) == HOST_THREADS_ON_CUDA
    assert torch.get_num_threads() == HOST_THREADS_ON_CUDA == 1


def test_omp_num_threads_and_cpu_runs_are_left_alone(threads, monkeypatch):
    torch.set_num_threads(HOST_THREADS_ON_CUDA + 4)
    monkeypatch.setenv("OMP_NUM_THREADS", "12")
    assert cap_host_threads(torch.device("cuda", 0)) is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert cap_host_threads(torch.device("cpu")) is None
    assert torch.get_num_threads() == HOST_THREADS_ON_CUDA + 4
