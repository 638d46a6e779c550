"""Benchmark: what a background checkpoint costs the training thread, piece by piece (one CUDA device).

    python bench/host_copy.py [--gb 12] [--dir /tmp/host_copy] [--json out.json]

1. Device -> host copy of `--gb` GB in 64 MB tensors (the seed run's actor + critic state is 12 GB):
   into fresh pageable memory, into the same memory again (touched), and into memory pinned in place
   with cudaHostRegister (no power-of-two rounding, unlike torch's pinned allocator).
2. Two stand-ins for a host-bound training step, each timed alone and beside each kind of writer:
   `launch` (2,000 small kernel launches, synchronised) and `host` (what the phases that slow beside
   a save do besides launching: a fresh 16 MB host tensor filled and copied to the device, 200 small
   kernels, a 512 KB result read back, a scalar read). The writers serialise the host copies the way a
   checkpoint does (safetensors for weights, torch.save for optimiser state, then sha256 of each file):
   `thread` (to `--dir`), `thread_fsync` (each file fsync'ed, as a checkpoint's are), `thread_nocache`
   (fsync'ed, then dropped from the page cache with posix_fadvise), `thread_sink` (the same bytes
   serialised into memory that is thrown away: no file, no page cache), `memcpy` (a thread copying the
   host tensors into other host memory: memory traffic alone) and `process` (a forked child writing to
   `--dir`). Beside each, the rise of the kernel's counters that say where a slowed thread may wait
   (/proc/vmstat: page faults, compaction stalls, direct reclaim, dirty throttling, the change in dirty
   pages; /proc/stat: steal time). On an H200 host the seed run's phases of many small kernels ran 4-10x
   slower beside a write while the `launch` stand-in slowed 13-22 % (BENCHMARKS.md): the variant that
   slows `host` as much names the cause (`--gb 4` keeps the whole sweep near two minutes).
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


def write_state(
    tensors: list[torch.Tensor], folder: Path, fsync: bool = False, nocache: bool = False
) -> float:
    """Half the tensors as safetensors, half through torch.save; sha256 of both files; with `fsync`,
    each file forced to disk as a checkpoint's are; with `nocache` also dropped from the page cache."""
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
            if fsync or nocache:
                os.fsync(f.fileno())
            if nocache:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return time.perf_counter() - start


def launch_step(x: torch.Tensor) -> None:
    """2,000 small kernel launches."""
    for _ in range(2000):
        x.add_(1.0)


def host_step(x: torch.Tensor) -> None:
    """A fresh host tensor to the device, small kernels, a result read back to the host."""
    batch = torch.empty(4 * 2**20, dtype=torch.float32).fill_(1.0)  # 16 MB, new pages each step
    y = batch.to("cuda")[: x.numel()]
    for _ in range(200):
        x.mul_(0.5).add_(y)
    x.view(512, -1).cpu().sum().item()


def timed_steps(step, seconds: float) -> list[float]:
    """Times of `step` (synchronised) for about `seconds`."""
    x = torch.zeros(512 * 256, device="cuda")
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(x)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


VMSTAT_KEYS = ("pgfault", "compact_stall", "pgscan_direct", "thp_fault_alloc", "nr_dirty", "pgsteal_direct")


def kernel_counters() -> dict[str, int]:
    """Counters of /proc/vmstat that a waiting thread may pay in, and the CPUs' steal ticks (/proc/stat)."""
    counters = {}
    with open("/proc/vmstat") as f:
        for line in f:
            key, value = line.split()
            if key in VMSTAT_KEYS or key.startswith("balance_dirty"):
                counters[key] = int(value)
    with open("/proc/stat") as f:
        cpu = f.readline().split()
    counters["steal_ticks"] = int(cpu[8]) if len(cpu) > 8 else 0
    return counters


class Sink:
    """A file-like object that counts and drops what is written (serialisation without a file)."""

    def __init__(self) -> None:
        self.bytes = 0

    def write(self, data: bytes) -> int:
        self.bytes += len(data)
        return len(data)

    def flush(self) -> None:
        pass


def write_to_sink(tensors: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    half = len(tensors) // 2
    save_file({f"w{i}": t for i, t in enumerate(tensors[:half])}, "/dev/null")
    torch.save({"state": {i: {"exp_avg": t} for i, t in enumerate(tensors[half:])}}, Sink())
    return time.perf_counter() - start


def copy_in_memory(tensors: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for t in tensors:
        t.clone()
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def record(out: dict, key: str, write_s: float, beside: list[float], before: dict[str, int]) -> None:
    """One stand-in beside one writer: the write's seconds, the steps' median and max, the counters' rise."""
    after = kernel_counters()
    out[f"{key}_write_s"] = round(write_s, 3)
    out[f"{key}_ms"] = round(1e3 * median(beside), 3)
    out[f"{key}_max_ms"] = round(1e3 * max(beside), 3)
    out[f"{key}_counters"] = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    print(key, {k: v for k, v in out.items() if k.startswith(key)}, flush=True)


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
    out: dict = {}
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

    stand_ins = {"launch": launch_step, "host": host_step}
    for name, step in stand_ins.items():
        timed_steps(step, 1.0)  # warm
        out[f"{name}_alone_ms"] = 1e3 * median(timed_steps(step, 4.0))
    writers = {
        "thread": lambda: write_state(pageable, args.dir),
        "thread_fsync": lambda: write_state(pageable, args.dir, fsync=True),
        "thread_nocache": lambda: write_state(pageable, args.dir, nocache=True),
        "thread_sink": lambda: write_to_sink(pageable),
        "memcpy": lambda: copy_in_memory(pageable),
    }
    for writer_name, write in writers.items():
        for name, step in stand_ins.items():
            result: dict[str, float] = {}
            before = kernel_counters()
            writer = threading.Thread(target=lambda write=write, result=result: result.update(s=write()))
            writer.start()
            beside = []
            while writer.is_alive():
                beside += timed_steps(step, 0.5)
            writer.join()
            record(out, f"{name}_beside_{writer_name}", result["s"], beside, before)
    ctx = mp.get_context("fork")
    for name, step in stand_ins.items():
        done = ctx.Queue()
        before = kernel_counters()
        child = ctx.Process(target=child_write, args=(pageable, str(args.dir), done))
        child.start()
        beside = []
        while child.is_alive():
            beside += timed_steps(step, 0.5)
        child.join()
        record(out, f"{name}_beside_process", done.get(), beside, before)
    shutil.rmtree(args.dir, ignore_errors=True)
    print(json.dumps(out), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
