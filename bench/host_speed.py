"""How fast this host runs the work that bounds a host-bound step: Python bytecode and kernel launches.

The seed command's updates at micro-batches of 8 are host-bound on an H200, and the same update code
on the same kind of machine measured 27.9k and 17.4k tok/s/GPU an hour apart (BENCHMARKS.md, trees
9f62fba and f06f231, 2026-12-01).
Each bench records this probe beside its figures, before and after the run, so a slow figure can be
told apart from a slow host. Only torch and the standard library: `bench/passes.py` measures older
trees through PYTHONPATH and imports this file from bench/ itself.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import torch


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def python_loop_ms(n: int = 1_000_000) -> float:
    """Milliseconds for a fixed pure-Python loop (median of 3): the interpreter's speed on this host now."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        total = 0
        for i in range(n):
            total += i & 7
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def launch_us(count: int = 2000) -> float | None:
    """Host microseconds per launch of a tiny CUDA kernel (an in-place add on one element; the GPU runs
    each faster than the host launches it, so the loop's wall time is the launch cost); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    x = torch.zeros(1, device="cuda")
    for _ in range(200):
        x.add_(1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(count):
        x.add_(1)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / count * 1e6


def host_speed() -> dict[str, object]:
    """The probe: CPU model, core count, 1-minute load average, Python loop ms, µs per kernel launch."""
    launch = launch_us()
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_1min": round(os.getloadavg()[0], 2),
        "python_loop_ms": round(python_loop_ms(), 1),
        "launch_us": round(launch, 2) if launch is not None else None,
    }


@contextlib.contextmanager
def cpu_burners(count: int) -> Iterator[None]:
    """`count` neighbour processes spinning a Python loop while the block runs: a slowed host, to show how
    much a figure depends on the host's speed. Each takes a core while cores are free, and beyond the
    host's core count they share them with the run; all are killed when the block ends, however it ends."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in burners:
            proc.kill()
        for proc in burners:
            proc.wait()


if __name__ == "__main__":
    print(host_speed())
