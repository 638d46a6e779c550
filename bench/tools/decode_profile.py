"""Where a decode step's time goes in the native engine: kernels by kind, launch gaps, the host between windows.

    python bench/tools/decode_profile.py --json decode_profile.json               # one GPU, Qwen2.5-0.5B shape
    python bench/tools/decode_profile.py --model DIR --json smollm2_profile.json  # a real checkpoint (`fulcrum pretrained`)
    python bench/tools/decode_profile.py --small --device cpu --prompts 8 --new-tokens 32   # a smoke run

Workload and engine: bench/rollout.py's (`bench_native`: the same EngineConfig, CUDA graphs on unless
`--enforce-eager`, every bucket captured, a warm-up generate, then `--repeats` timed ones without the
profiler). Then one more generate runs under `torch.profiler` (CPU and CUDA activities), with four
host annotations added to the engine's instance (its code is unchanged): `prefill_launch` around each
prefill step's launch (`Launcher.launch_prefill`: its forward and first-token sampling), `prefill`
around the read of its first tokens into the scheduler (`Pipeline._postprocess` of a prefill step),
`decode_window` around each window's launch (`Launcher.launch_decode`: its `decode_steps` steps and
the copy of its tokens to the host; the read that waits for them follows, between windows, so the
host between windows includes that wait), `decode_step` around each step's forward
(`ModelRunner.decode_logits`: a graph replay, or the eager forward). A GPU event (kernel, memcpy,
memset) belongs to the step whose host span holds its launch (the runtime or driver call with the
same correlation id: the kernels of a graph replay share the `cudaGraphLaunch`'s), so a step is its
forward plus the sampler and bookkeeping that follow it.

Per decode step, on the GPU timeline: `wall` (first event of the step to the first of the next; the
last step of a window ends at its last event), `busy` (the union of its events), `idle` (wall - busy:
the GPU waiting for launches), `busy` split by `KERNEL_CATEGORIES`, and `host` (the host span of the
step). Medians over steps, and totals over the decode phase: its wall (first to last decode event),
busy, idle within windows, and the GPU idle between consecutive windows (the host reading the
window's tokens, the scheduler, the next window's block tables). The prefill phase: steps, host
seconds, GPU busy and wall, busy per kernel category and each category's busiest kernels, and its GPU
idle time as gaps (`idle_gaps`: launch gaps apart from the host's longer waits, the largest named by the
kernels around them). Printed as a
table, written as JSON with `--json`; `--trace FILE` keeps the Chrome trace (.json or .json.gz; Perfetto
opens it).

On the CPU there are no device events: step times are the host spans, the categories stay empty, and
the CPU ops with the most self time over the whole profiled generate are listed instead.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the suite it builds on

from rollout import (
    add_launch_options,
    bench_native,
    build_model,
    prompt_lengths,
    random_prompts,
    set_launches,
    timed,
)

from fulcrum.rollout import SamplingParams
from fulcrum.rollout.native import NativeEngine
from fulcrum.rollout.native.launcher import Launched
from fulcrum.rollout.native.scheduler import PrefillWork

# Kernel name -> category: the first category with a pattern that is a substring of the lower-cased
# name wins, so the order matters ("index_copy" is a KV write before "copy" is a copy; the prefill's
# flash kernels mention softmax but are attention). A name that matches none is "other"; the JSON
# lists the busiest names of every category, "other" included, so the patterns can be checked.
KERNEL_CATEGORIES: dict[str, tuple[str, ...]] = {
    # the paged decode kernel (kernels.py), the gather fallback's SDPA, the prefill's flash kernels
    "attention": ("paged_decode", "decode_attention", "flash", "fmha", "attention", "sdpa"),
    # K/V of the new tokens into the paged cache: `index_copy_`, or the indirect-cache kernel
    "kv_write": ("store_kv", "index_copy", "index_put"),
    # the Triton sampler's two kernels (_sample_tile_stats_kernel, _sample_pick_kernel; older trees'
    # _gumbel_sample_*); the torch sampler's softmax / argmax / sort / exponential noise
    "sampling": (
        "_sample_",
        "gumbel_sample",
        "softmax",
        "argmax",
        "topk",
        "sort",
        "distribution",
        "multinomial",
    ),
    # cuBLAS / CUTLASS GEMMs and GEMVs (Hopper: sm90_xmma_*, cutlass3x_sm90_*, nvjet_*)
    "gemm": ("gemm", "gemv", "cutlass", "cublas", "nvjet", "xmma", "sm90_", "splitkreduce"),
    # the Triton kernels of kernels.py (_add_rms_norm_kernel, _rope_kernel, _silu_mul_kernel)
    "norm_rope_act": ("rms_norm", "rope", "silu", "gelu"),
    # transfers and fills: Memcpy HtoD/DtoH/DtoD, Memset, copy and fill kernels
    "copy": ("memcpy", "memset", "copy", "fill"),
}
OTHER = "other"
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # the trace's device events
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")  # Triton launches through the driver API
PREFILL, WINDOW, STEP = "prefill", "decode_window", "decode_step"
# A prefill step's launch: inside the step before it when the steps overlap (`overlap_windows`), else just
# before the `PREFILL` span that reads it; the prefill phase is the union of both kinds of span.
PREFILL_LAUNCH = "prefill_launch"


@dataclass
class DeviceEvent:
    name: str
    start: float  # µs, the trace's clock
    end: float
    category: str


@dataclass
class Step:
    host_start: float
    host_end: float
    events: list[DeviceEvent] = field(default_factory=list)


@dataclass
class Window:
    host_start: float
    host_end: float
    steps: list[Step] = field(default_factory=list)

    def events(self) -> list[DeviceEvent]:
        return [e for step in self.steps for e in step.events]


def category_of(name: str) -> str:
    """The KERNEL_CATEGORIES entry of a device event's name (OTHER when no pattern matches)."""
    lowered = name.lower()
    for category, patterns in KERNEL_CATEGORIES.items():
        if any(pattern in lowered for pattern in patterns):
            return category
    return OTHER


def union_us(spans: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (events on several streams may overlap)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


# ---------------------------------------------------------------------------------- trace -> windows
def host_spans(trace: list[dict[str, Any]], label: str) -> list[tuple[float, float]]:
    """(start, end) µs of the host annotations named `label`, in time order."""
    spans = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in trace
        if e.get("cat") == "user_annotation" and e.get("name") == label
    ]
    return sorted(spans)


def launched_events(trace: list[dict[str, Any]]) -> list[tuple[float, DeviceEvent]]:
    """(host launch time, event) of every device event whose launch call the trace holds."""
    launches = {
        e["args"]["correlation"]: float(e["ts"])
        for e in trace
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    out = []
    for e in trace:
        correlation = e.get("args", {}).get("correlation")
        if e.get("cat") in GPU_CATEGORIES and correlation in launches:
            start = float(e["ts"])
            event = DeviceEvent(e["name"], start, start + float(e.get("dur", 0)), category_of(e["name"]))
            out.append((launches[correlation], event))
    return sorted(out, key=lambda pair: pair[0])


def decode_windows(trace: list[dict[str, Any]]) -> list[Window]:
    """The decode windows, their steps, and each step's device events (by host launch time).

    A step runs from its forward's annotation to the next one's (the last to the window's end); the
    window's set-up before its first step (block tables, inputs) counts in its first step."""
    windows = [Window(start, end) for start, end in host_spans(trace, WINDOW)]
    step_starts = [start for start, _ in host_spans(trace, STEP)]
    for window in windows:
        starts = [s for s in step_starts if window.host_start <= s <= window.host_end]
        if not starts:
            continue
        bounds = [window.host_start, *starts[1:], window.host_end]
        window.steps = [Step(lo, hi) for lo, hi in itertools.pairwise(bounds)]
    for launch, event in launched_events(trace):
        for window in windows:
            if window.host_start <= launch <= window.host_end:
                step = next(s for s in reversed(window.steps) if s.host_start <= launch)
                step.events.append(event)
                break
    return [w for w in windows if w.steps]


def prefill_figures(trace: list[dict[str, Any]], on_device: bool) -> dict[str, Any]:
    """The prefill phase: steps (their reads), host seconds (the union of the reads' and the launches'
    spans) and, on a device, of the device events launched inside them: the union of their spans
    (busy), first start to last end (wall), the union per kernel category, and each category's
    busiest names ([name, seconds, events])."""
    reads = host_spans(trace, PREFILL)
    spans = reads + host_spans(trace, PREFILL_LAUNCH)
    figures: dict[str, Any] = {"steps": len(reads), "host_s": round(union_us(spans) / 1e6, 4)}
    if on_device:
        events = [e for launch, e in launched_events(trace) if any(lo <= launch <= hi for lo, hi in spans)]
        figures["gpu_busy_s"] = round(union_us((e.start, e.end) for e in events) / 1e6, 4)
        if events:
            figures["gpu_wall_s"] = round(
                (max(e.end for e in events) - min(e.start for e in events)) / 1e6, 4
            )
            figures["gpu_busy_by_category_s"] = {
                category: round(us / 1e6, 4) for category, us in busy_by_category(events).items()
            }
            figures["top_kernels"] = {
                category: [[name, round(us / 1e6, 4), count] for name, us, count in rows]
                for category, rows in busiest_names(events, count=3).items()
            }
            figures["idle_gaps"] = idle_gaps(events)
    return figures


LONG_GAP_US = 50.0  # a launch gap is a few µs; a longer wait is the host (a sync, the scheduler, a copy)


def idle_gaps(events: list[DeviceEvent], largest: int = 5) -> dict[str, Any]:
    """Where the device waits between `events`: the gaps in the union of their spans, as their count and
    milliseconds, split at `LONG_GAP_US` (launch gaps below, the host's waits above), and the `largest` gaps
    as [µs, the event before, the event after] (names cut to 80 characters)."""
    gaps: list[tuple[float, str, str]] = []
    ordered = sorted(events, key=lambda e: (e.start, e.end))
    reach, last = (ordered[0].end, ordered[0].name) if ordered else (0.0, "")
    for event in ordered[1:]:
        if event.start > reach:
            gaps.append((event.start - reach, last, event.name))
        if event.end > reach:
            reach, last = event.end, event.name
    long = [gap for gap in gaps if gap[0] > LONG_GAP_US]
    return {
        "count": len(gaps),
        "idle_ms": round(sum(g[0] for g in gaps) / 1e3, 3),
        "long_count": len(long),
        "long_idle_ms": round(sum(g[0] for g in long) / 1e3, 3),
        "largest": [
            [round(us, 1), before[:80], after[:80]]
            for us, before, after in sorted(gaps, reverse=True)[:largest]
        ],
    }


def busy_by_category(events: Iterable[DeviceEvent]) -> dict[str, float]:
    """µs per kernel category: the union of its events' spans (categories without an event left out)."""
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for event in events:
        spans[event.category].append((event.start, event.end))
    return {category: union_us(spans[category]) for category in sorted(spans)}


def busiest_names(events: Iterable[DeviceEvent], count: int) -> dict[str, list[tuple[str, float, int]]]:
    """Per category, its `count` busiest event names: (name, µs summed, events)."""
    time_of: dict[tuple[str, str], float] = defaultdict(float)
    calls: dict[tuple[str, str], int] = defaultdict(int)
    for event in events:
        time_of[event.category, event.name] += event.end - event.start
        calls[event.category, event.name] += 1
    out: dict[str, list[tuple[str, float, int]]] = defaultdict(list)
    for (category, name), us in sorted(time_of.items(), key=lambda item: -item[1]):
        if len(out[category]) < count:
            out[category].append((name[:120], us, calls[category, name]))
    return dict(out)


# ---------------------------------------------------------------------------------- windows -> figures
def step_rows(window: Window, on_device: bool) -> list[dict[str, float]]:
    """Per step (µs): wall, host, and on a device busy, idle and busy per category."""
    rows = []
    for k, step in enumerate(window.steps):
        row = {"host": step.host_end - step.host_start}
        if on_device and step.events:
            start = min(e.start for e in step.events)
            following = window.steps[k + 1].events if k + 1 < len(window.steps) else []
            end = min(e.start for e in following) if following else max(e.end for e in step.events)
            busy = union_us((e.start, min(e.end, end)) for e in step.events)
            row.update(wall=end - start, busy=busy, idle=end - start - busy)
            for category in (*KERNEL_CATEGORIES, OTHER):
                row[category] = sum(e.end - e.start for e in step.events if e.category == category)
        else:
            row["wall"] = row["host"]
        rows.append(row)
    return rows


def between_windows(windows: list[Window], on_device: bool) -> list[dict[str, float]]:
    """Per pair of consecutive windows (µs): host time outside both, and the GPU idle between them."""
    rows = []
    for before, after in itertools.pairwise(windows):
        row = {"host": after.host_start - before.host_end}
        if on_device and before.events() and after.events():
            row["gpu_idle"] = min(e.start for e in after.events()) - max(e.end for e in before.events())
        rows.append(row)
    return rows


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({key for row in rows for key in row})
    return {key: round(statistics.median(row[key] for row in rows if key in row), 1) for key in keys}


def top_names(windows: list[Window], steps: int, count: int = 5) -> dict[str, list[list[Any]]]:
    """Per category: its busiest device event names, [name, µs per step, events per step]."""
    events = (e for w in windows for e in w.events())
    return {
        category: [[name, round(us / steps, 1), round(calls / steps, 2)] for name, us, calls in rows]
        for category, rows in busiest_names(events, count).items()
    }


def decode_figures(windows: list[Window], on_device: bool) -> dict[str, Any]:
    """The decode phase: totals (s), per-step and between-window medians (µs), top kernels."""
    steps = [row for window in windows for row in step_rows(window, on_device)]
    gaps = between_windows(windows, on_device)
    figures: dict[str, Any] = {
        "windows": len(windows),
        "steps": len(steps),
        "step_median_us": medians(steps),
        "step_mean_us": {k: round(sum(r.get(k, 0) for r in steps) / len(steps), 1) for k in steps[0]},
        "between_windows_median_us": medians(gaps) if gaps else {},
    }
    events = [e for w in windows for e in w.events()]
    if on_device and events:
        totals_us = {
            "wall_s": max(e.end for e in events) - min(e.start for e in events),
            "gpu_busy_s": union_us((e.start, e.end) for e in events),
            "idle_in_windows_s": sum(r.get("idle", 0) for r in steps),
            "idle_between_windows_s": sum(r.get("gpu_idle", 0) for r in gaps),
        }
        figures.update({key: round(us / 1e6, 4) for key, us in totals_us.items()})
        figures["top_kernels"] = top_names(windows, len(steps))
    else:
        figures["wall_s"] = round((windows[-1].host_end - windows[0].host_start) / 1e6, 4)
    return figures


# ---------------------------------------------------------------------------------- profiling
def annotate(
    obj: object, method: str, label: str, when: Callable[..., bool] = lambda *args, **kwargs: True
) -> None:
    """Wrap `obj.method` (on the instance only) in a profiler annotation named `label`, on the calls
    whose arguments satisfy `when`."""
    original: Callable[..., Any] = getattr(obj, method)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not when(*args, **kwargs):
            return original(*args, **kwargs)
        with record_function(label):
            return original(*args, **kwargs)

    setattr(obj, method, wrapped)


def reads_prefill(launched: Launched, *args: Any) -> bool:
    """Whether the pipeline's postprocess reads a prefill step (rather than a decode window)."""
    return isinstance(launched.work, PrefillWork)


def annotate_engine(engine: NativeEngine) -> None:
    """Mark prefill steps, decode windows and decode steps; the step is a replay or an eager forward."""
    launcher = engine.launcher
    annotate(engine.pipeline, "_postprocess", PREFILL, when=reads_prefill)  # the read of its first tokens
    annotate(launcher, "launch_prefill", PREFILL_LAUNCH)
    annotate(launcher, "launch_decode", WINDOW)  # its steps' launches; the read comes after, between windows
    annotate(engine.runner, "decode_logits", STEP)


def load_trace(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return json.load(handle)["traceEvents"]


def profiled_generate(
    engine: NativeEngine, prompts: list[list[int]], params: SamplingParams, device: torch.device, trace: Path
) -> tuple[float, list[dict[str, Any]], list[list[Any]]]:
    """One generate under the profiler: (seconds, trace events, top CPU ops by self time).

    The CPU ops are listed on the CPU only: there they are the split; on a GPU, sorting a whole
    rollout's ops costs time and says less than the kernels do."""
    on_device = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with profile(activities=activities) as prof:
        seconds = timed(lambda: engine.generate(prompts, params), device)
    prof.export_chrome_trace(str(trace))
    cpu_ops: list[list[Any]] = []
    if not on_device:
        averages = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)
        cpu_ops = [[a.key[:80], round(a.self_cpu_time_total / 1e3, 2), a.count] for a in averages[:10]]
    return seconds, load_trace(trace), cpu_ops


# ---------------------------------------------------------------------------------- report
def print_table(summary: dict[str, Any]) -> None:
    decode, prefill = summary["decode"], summary["prefill"]
    step, mean = decode["step_median_us"], decode["step_mean_us"]
    busy = f", GPU busy {prefill['gpu_busy_s']:.4f} s" if "gpu_busy_s" in prefill else ""
    print(f"\ndecode: {decode['windows']} windows, {decode['steps']} steps, {decode['wall_s']:.4f} s; "
          f"prefill: {prefill['steps']} steps, host {prefill['host_s']:.4f} s{busy}")  # fmt: skip
    if gaps := prefill.get("idle_gaps"):
        print(f"prefill GPU idle: {gaps['idle_ms']:.3f} ms in {gaps['count']} gaps, of which "
              f"{gaps['long_idle_ms']:.3f} ms in {gaps['long_count']} over {LONG_GAP_US:.0f} µs")  # fmt: skip
        for us, before, after in gaps["largest"]:
            print(f"  gap {us:>9.1f} µs after {before[:50]} before {after[:50]}")
    print(f"{'per decode step (µs)':<28}{'median':>10}{'mean':>10}")
    keys = ["wall", "host", "busy", "idle", *KERNEL_CATEGORIES, OTHER]
    for key in (k for k in keys if k in step):
        print(f"{key:<28}{step[key]:>10.1f}{mean[key]:>10.1f}")
    for key, value in decode["between_windows_median_us"].items():
        print(f"{'between windows: ' + key:<28}{value:>10.1f}")
    for key in ("gpu_busy_s", "idle_in_windows_s", "idle_between_windows_s"):
        if key in decode:
            print(f"{'decode total: ' + key:<28}{decode[key]:>10.4f}")
    for category, rows in decode.get("top_kernels", {}).items():
        for name, us_per_step, per_step in rows:
            print(f"  {category:<14}{us_per_step:>8.1f} µs/step {per_step:>6} a step  {name[:70]}")
    for name, self_ms, calls in summary.get("top_cpu_ops", []):
        print(f"  cpu op {name[:40]:<40}{self_ms:>10.2f} ms self{calls:>8} calls")
    if "note" in summary:
        print(f"note: {summary['note']}")


def load_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """A checkpoint from `--model DIR` (bf16 on CUDA), else bench/rollout.py's random model."""
    if args.model is None:
        return build_model(args, device)
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    model.generation_config.eos_token_id = None  # EOS ignored: every response is max_tokens long
    return model


# The workload and engine options of bench/rollout.py, with its defaults: both scripts build one engine.
WORKLOAD_OPTIONS: dict[str, tuple[type, Any]] = {
    "--prompts": (int, 512),
    "--new-tokens": (int, 256),
    "--max-num-seqs": (int, 512),
    "--max-num-batched-tokens": (int, 16384),
    "--decode-steps": (int, 16),
    "--gpu-memory-utilization": (float, 0.5),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a tiny model (smoke test of the script)")
    parser.add_argument("--shape", default="qwen2.5-0.5b", help="a bench/shapes.py shape (random weights)")
    parser.add_argument("--model", default=None, help="a Hugging Face checkpoint folder instead of --shape")
    parser.add_argument(
        "--lengths", default=None, help="a JSON file: a list of prompt lengths, repeated to --prompts"
    )
    for option, (kind, default) in WORKLOAD_OPTIONS.items():
        parser.add_argument(option, type=kind, default=default)
    for flag in ("--enforce-eager", "--indirect-kv-cache", "--sequential-windows"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--repeats", type=int, default=1, help="timed generates without the profiler")
    parser.add_argument("--trace", default=None, help="keep the Chrome trace here (.json or .json.gz)")
    parser.add_argument("--json", default=None, help="also write the summary here")
    add_launch_options(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(min(torch.get_num_threads(), 8))
    device = torch.device(args.device)
    on_device = device.type == "cuda"
    summary: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "argv": sys.argv[1:],
        "torch": torch.__version__,
    }
    if on_device:
        summary["gpu"] = torch.cuda.get_device_name(device)
    summary["launch"] = set_launches(args.decode_launch, args.sample_launch)
    model = load_model(args, device)
    prompts = random_prompts(prompt_lengths(args.prompts, args.lengths), model.config.vocab_size)
    engine = bench_native(args, model, prompts, device, summary)  # built, captured, warmed up, timed
    annotate_engine(engine)
    summary["cuda_graphs"] = engine.runner.use_graphs
    params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=0)
    with tempfile.TemporaryDirectory() as folder:
        trace_path = Path(args.trace or Path(folder) / "trace.json")
        seconds, trace, cpu_ops = profiled_generate(engine, prompts, params, device, trace_path)
    summary["profiled_generate_s"] = round(seconds, 4)
    summary["prefill"] = prefill_figures(trace, on_device)
    summary["decode"] = decode_figures(decode_windows(trace), on_device)
    summary["kernel_categories"] = KERNEL_CATEGORIES
    if not on_device:
        summary["note"] = (
            "no device events on the CPU: step times are host spans, kernel categories are empty; "
            "top_cpu_ops lists [op, self ms, calls] over the whole profiled generate (an annotation's "
            "self time is the Python between its ops)"
        )
        summary["top_cpu_ops"] = cpu_ops
    print_table(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
