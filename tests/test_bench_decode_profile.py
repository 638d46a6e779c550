"""bench/tools/decode_profile.py: a hand-made profiler trace of a prefill and two decode windows, split into
steps, kernel kinds, launch gaps and the gap between windows."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "tools"))
from decode_profile import category_of, decode_figures, decode_windows, prefill_figures

MS = 1000.0  # the trace's clock is in µs; the events below are laid out in ms


def host(name: str, ts: float, dur: float) -> dict[str, Any]:
    return {"cat": "user_annotation", "name": name, "ts": ts * MS, "dur": dur * MS}


def launch(name: str, ts: float, correlation: int, cat: str = "cuda_runtime") -> dict[str, Any]:
    return {"cat": cat, "name": name, "ts": ts * MS, "dur": 1, "args": {"correlation": correlation}}


def device(name: str, ts: float, dur: float, correlation: int, cat: str = "kernel") -> dict[str, Any]:
    return {"cat": cat, "name": name, "ts": ts * MS, "dur": dur * MS, "args": {"correlation": correlation}}


def window(start: float, correlation: int) -> list[dict[str, Any]]:
    """Two steps, each a graph replay (three kernels under one correlation id) and then the Triton
    sampler (a driver launch), 10 ms busy; the window ends with the tokens' copy to the host (3 ms).
    GPU: step 0 from start+5 to start+17 (2 ms idle), step 1 from start+17 to start+33 (3 ms idle)."""
    events = [
        host("decode_window", start, 40),
        host("decode_step", start + 2, 3),
        host("decode_step", start + 12, 3),
    ]
    for k in range(2):
        c, t = correlation + 2 * k, start + 5 + 12 * k
        events += [launch("cudaGraphLaunch", start + 2 + 10 * k, c)]
        events += [launch("cuLaunchKernelEx", start + 4 + 10 * k, c + 1, "cuda_driver")]
        events += [device("sm90_xmma_gemm_bf16bf16", t, 4, c), device("_paged_decode_kernel", t + 4, 3, c)]
        events += [
            device("_add_rms_norm_kernel", t + 7, 1, c),
            device("_sample_pick_kernel", t + 8, 2, c + 1),
        ]
    copy = correlation + 4
    events += [launch("cudaMemcpyAsync", start + 30, copy)]
    events += [device("Memcpy DtoH (Device -> Pageable)", start + 30, 3, copy, "gpu_memcpy")]
    return events


def test_decode_steps_split_into_kernel_kinds_launch_gaps_and_the_gap_between_windows() -> None:
    trace = [host("prefill", 0, 50), launch("cudaLaunchKernel", 10, 1), device("flash_fwd_kernel", 20, 25, 1)]
    trace += window(100, 10) + window(150, 20)
    windows = decode_windows(trace)
    assert [len(w.steps) for w in windows] == [2, 2]
    figures = decode_figures(windows, on_device=True)
    assert figures["steps"] == 4
    mean = {key: value / MS for key, value in figures["step_mean_us"].items()}
    assert mean["wall"] == (12 + 16) / 2 and mean["busy"] == (10 + 13) / 2 and mean["idle"] == (2 + 3) / 2
    assert (mean["gemm"], mean["attention"], mean["norm_rope_act"], mean["sampling"]) == (4, 3, 1, 2)
    assert mean["copy"] == 1.5 and mean["other"] == 0
    # The GPU waits 22 ms between the windows' events; the host spends 10 ms outside both windows.
    assert figures["between_windows_median_us"] == {"gpu_idle": 22 * MS, "host": 10 * MS}
    # The decode phase's wall is its busy time plus both kinds of idle time.
    assert figures["wall_s"] == 0.078 and figures["gpu_busy_s"] == 0.046
    assert figures["idle_in_windows_s"] == 0.01 and figures["idle_between_windows_s"] == 0.022
    assert figures["top_kernels"]["gemm"] == [["sm90_xmma_gemm_bf16bf16", 4 * MS, 1.0]]
    prefill = prefill_figures(trace, on_device=True)
    assert prefill == {
        "steps": 1,
        "host_s": 0.05,
        "gpu_busy_s": 0.025,
        "gpu_wall_s": 0.025,
        "gpu_busy_by_category_s": {"attention": 0.025},
        "top_kernels": {"attention": [["flash_fwd_kernel", 0.025, 1]]},
        "idle_gaps": {"count": 0, "idle_ms": 0.0, "long_count": 0, "long_idle_ms": 0.0, "largest": []},
    }


def test_kernel_names_fall_into_their_categories() -> None:
    assert category_of("nvjet_tst_128x64_64x8_1x1_v_bz_TNT") == "gemm"
    assert category_of("void at::native::index_copy_kernel_impl<float>") == "kv_write"
    assert category_of("flash_fwd_splitkv_kernel (softmax inside)") == "attention"
    assert category_of("void at::native::vectorized_elementwise_kernel<4, FillFunctor<long>>") == "copy"
    assert category_of("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<long>>") == "other"


def test_prefill_counts_each_launch_whether_before_its_read_or_inside_the_step_before() -> None:
    """Overlapped prefill steps: step 0 is launched before its read, steps 1 and 2 inside the read of the
    step before (launched ahead). The phase's host time is the union of reads and launches (0-80 ms),
    its GPU busy time every launched kernel's (6-46 and 50-70 ms), step 0's included."""
    trace = [
        host("prefill_launch", 0, 10), launch("cudaLaunchKernel", 5, 1), device("flash_fwd_kernel", 6, 20, 1),
        host("prefill", 10, 30), host("prefill_launch", 15, 10), launch("cudaLaunchKernel", 20, 2),
        device("flash_fwd_kernel", 26, 20, 2),
        host("prefill", 40, 30), host("prefill_launch", 45, 10), launch("cudaLaunchKernel", 50, 3),
        device("flash_fwd_kernel", 50, 20, 3),
        host("prefill", 70, 10),
    ]  # fmt: skip
    prefill = prefill_figures(trace, on_device=True)
    assert (prefill["steps"], prefill["host_s"], prefill["gpu_busy_s"]) == (3, 0.08, 0.06)
    # Busy 60 ms of a 64 ms span (6-70 ms): the GPU waited 4 ms between steps 1 and 2.
    assert prefill["gpu_wall_s"] == 0.064 and prefill["gpu_busy_by_category_s"] == {"attention": 0.06}
    # That wait is one gap, long (a host's, not a launch's), between the second and third kernels.
    gaps = prefill["idle_gaps"]
    assert (gaps["count"], gaps["idle_ms"], gaps["long_count"], gaps["long_idle_ms"]) == (1, 4.0, 1, 4.0)
    assert gaps["largest"] == [[4000.0, "flash_fwd_kernel", "flash_fwd_kernel"]]


def test_idle_gaps_split_launch_gaps_from_the_host_waits_and_name_the_kernels_around_the_longest() -> None:
    from decode_profile import DeviceEvent, idle_gaps

    events = [
        DeviceEvent("gemm_a", 0, 100, "gemm"),
        DeviceEvent("side_stream", 50, 120, "other"),  # overlaps: the union reaches 120
        DeviceEvent("rms_norm", 123, 130, "norm_rope_act"),  # a 3 µs launch gap
        DeviceEvent("flash_fwd", 330, 400, "attention"),  # the host kept the device waiting 200 µs
        DeviceEvent("silu_mul", 402, 410, "norm_rope_act"),  # 2 µs
    ]
    gaps = idle_gaps(events, largest=2)
    assert (gaps["count"], gaps["long_count"]) == (3, 1)
    assert (gaps["idle_ms"], gaps["long_idle_ms"]) == (0.205, 0.2)
    assert gaps["largest"] == [[200.0, "rms_norm", "flash_fwd"], [3.0, "side_stream", "rms_norm"]]


def test_a_cpu_run_annotates_the_engine_prefill_windows_and_steps(tmp_path: Path) -> None:
    """Two prompts of 8 tokens in windows of 4 steps: one prefill step samples the first token, then
    7 decode steps in two windows (4 + 3), each found by its annotation on the engine's instance."""
    from decode_profile import main

    out = tmp_path / "profile.json"
    argv = ["--small", "--device", "cpu", "--prompts", "2", "--new-tokens", "8", "--decode-steps", "4"]
    assert main([*argv, "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["prefill"]["steps"] == 1
    assert (summary["decode"]["windows"], summary["decode"]["steps"]) == (2, 7)
