"""Benchmark: what a background checkpoint costs the training thread, piece by piece (one CUDA device).

    python bench/host_copy.py [--gb 12] [--dir /tmp/host_copy] [--json out.json]

1. Device -> host copy of `--gb` GB in 64 MB tensors (the seed run's actor + critic state is 12 GB):
   into fresh pageable memory, into the same memory again (touched), and into memory pinned in place
   with cudaHostRegister (no power-of-two rounding, unlike torch's pinned allocator).
2. A stand-in for a host-bound training step (a loop of small kernel launches, synchronised), timed
   alone and while a writer serialises the host copies to `--dir` the way a checkpoint does
   (safetensors for weights, torch.save for optimiser state, then sha256 of each file): on a thread of
   this process (also with each file fsync'ed, as a checkpoint's are), and in a child process. The
   ratio is how much a write beside training slows a step that waits on the host.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

CHUNK = 64 * 2**20  # bytes a tensor


def device_tensors(gb: float) -> list[torch.Tensor]:
    n = max(1, int(gb * 2**30 // CHUNK))
    return [torch.randn(CHUNK // 4, device="cuda") for _ in range(n)]


def timed_copy(sources: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for s, t in zip(sources, targets, strict=True):
        t.copy_(s, non_blocking=t.is_pinned())
    torch.cuda.synchronize()
    return time.perf_counter() - start


def register(tensors: list[torch.Tensor]) -> None:
    cudart = torch.cuda.cudart()
    for t in tensors:
        err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        assert int(err) == 0, f"cudaHostRegister failed: {err}"


def write_state(tensors: list[torch.Tensor], folder: Path, fsync: bool = False) -> float:
    """Half the tensors as safetensors, half through torch.save; sha256 of both files; with `fsync`,
    each file forced to disk as a checkpoint's are."""
    start = time.perf_counter()
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    half = len(tensors) // 2
    save_file({f"w{i}": t for i, t in enumerate(tensors[:half])}, str(folder / "model.safetensors"))
    torch.save({"state": {i: {"exp_avg": t} for i, t in enumerate(tensors[half:])}}, folder / "optim.pt")
    for path in sorted(folder.iterdir()):
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while block := f.read(8 * 2**20):
                digest.update(block)
            if fsync:
                os.fsync(f.fileno())
    return time.perf_counter() - start


def launch_loop(seconds: float) -> list[float]:
    """Times of 'steps' of 2,000 small kernel launches each, for about `seconds`."""
    x = torch.zeros(1024, device="cuda")
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(2000):
            x.add_(1.0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def child_write(tensors: list[torch.Tensor], folder: str, done: mp.Queue) -> None:
    done.put(write_state(tensors, Path(folder)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gb", type=float, default=12.0)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/host_copy"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    out: dict[str, float] = {}
    sources = device_tensors(args.gb)
    gb = len(sources) * CHUNK / 2**30
    out["gb"] = gb
    pageable = [torch.empty_like(s, device="cpu") for s in sources]
    out["d2h_fresh_pageable_s"] = timed_copy(sources, pageable)
    out["d2h_touched_pageable_s"] = timed_copy(sources, pageable)
    pinned = [torch.empty_like(s, device="cpu") for s in sources]
    for t in pinned:
        t.fill_(0)  # touch first, as kept buffers are
    start = time.perf_counter()
    register(pinned)
    out["host_register_s"] = time.perf_counter() - start
    out["d2h_registered_s"] = timed_copy(sources, pinned)
    out["d2h_registered_again_s"] = timed_copy(sources, pinned)
    print(json.dumps(out), flush=True)

    launch_loop(1.0)  # warm
    out["step_alone_ms"] = 1e3 * median(launch_loop(4.0))
    result: dict[str, float] = {}
    writer = threading.Thread(target=lambda: result.update(write_s=write_state(pageable, args.dir)))
    writer.start()
    beside = []
    while writer.is_alive():
        beside += launch_loop(0.5)
    writer.join()
    out["write_thread_s"] = result["write_s"]
    out["step_beside_thread_ms"] = 1e3 * median(beside)
    out["step_beside_thread_max_ms"] = 1e3 * max(beside)
    writer = threading.Thread(target=lambda: result.update(write_s=write_state(pageable, args.dir, True)))
    writer.start()
    beside = []
    while writer.is_alive():
        beside += launch_loop(0.5)
    writer.join()
    out["write_fsync_thread_s"] = result["write_s"]
    out["step_beside_fsync_thread_ms"] = 1e3 * median(beside)
    out["step_beside_fsync_thread_max_ms"] = 1e3 * max(beside)
    ctx = mp.get_context("fork")
    done = ctx.Queue()
    child = ctx.Process(target=child_write, args=(pageable, str(args.dir), done))
    child.start()
    beside = []
    while child.is_alive():
        beside += launch_loop(0.5)
    child.join()
    out["write_process_s"] = done.get()
    out["step_beside_process_ms"] = 1e3 * median(beside)
    out["step_beside_process_max_ms"] = 1e3 * max(beside)
    shutil.rmtree(args.dir, ignore_errors=True)
    print(json.dumps(out), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
