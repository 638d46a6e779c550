"""Benchmark: the native engine's decode at long contexts, and its prefill of long prompts, on one GPU, as
fractions of the card's memory and compute rooflines.

    python bench/long_context.py --json long_context.json    # one H100 / H200, < 8 minutes (--deadline-s)
    python bench/long_context.py --smoke --json /tmp/lc.json # the same code on the CPU at tiny shapes

Rows: Qwen3-0.6B's and Qwen2.5-0.5B's shapes (bench/shapes.py; random bf16 weights) at contexts of 8k,
16k and 2k tokens (in that order: the 8k figures, those with targets, come first if the deadline cuts the
rest). A row: as many prompts of `context` random tokens as the KV cache holds at that length (at most
`--max-seqs`, 512), each then decoding `--new-tokens` (128) with EOS ignored, temperature 1. The engine:
`gpu_memory_utilization` 0.9, prefill steps of 16,384 tokens (`max_num_batched_tokens`, so a 16k prompt
is one chunk), decode windows of 16, one CUDA graph at the row's batch (`cudagraph_capture_sizes`), and
`max_num_seqs` the sequences the cache holds: an engine sized at max_num_seqs 512 gives its KV blocks,
`blocks // blocks_per_seq()` of them per sequence (`max_model_len` = context + new tokens, plus the
windows in flight), then the row's engine is built for that many (its cache then covers them, so
nothing is preempted). A warm-up generate of two prompts compiles the kernels and captures the graph;
then `--repeats` (3) times: the prompts added (`add_request`), the prefill steps stepped and timed, then
the decode windows stepped and timed (CUDA events, wall clock on the CPU); medians.

Decode, each step reads every weight once and every sequence's K/V (a memory-bound step):

    bytes a step   = W + N · kv · (c + n/2)          W: the engine's bf16 weights (a tied embedding once:
                                                      the LM head reads it whole), N sequences,
                                                      kv = layers · 2 · kv_heads · head_dim · 2 B a token
                                                      (Qwen3-0.6B 112 KiB, Qwen2.5-0.5B 12 KiB), c + n/2
                                                      the mean context over the n - 1 timed steps
    roofline tok/s = N · B / bytes a step             B: HBM bandwidth, from the device name: H100 SXM
                                                      3.35 TB/s, H100 NVL 3.9, H100 PCIe 2.0, H200 4.8
    fraction       = measured decode tok/s / roofline tok/s

Not counted: the K/V written, the logits and the sampler's passes over them (a few % of a step at 512
sequences of 2k), so the fraction is a floor on the attention's own efficiency.

Prefill of N prompts of c tokens, dense bf16 FLOPs:

    FLOPs          = 2 · P_l · N·c + 2 · V · h · N + L · 4 · c² · q / 2 · N
                     P_l the decoder layers' matmul parameters (attention and MLP projections), the LM
                     head (V · h) on each prompt's last token only, and causal attention: QKᵀ and PV
                     are 2 · c² · q each (q = heads · head_dim), half of them under the causal mask
    fraction       = FLOPs / prefill seconds / peak (H100 and H200 989 TFLOP/s dense bf16,
                     `fulcrum.device_facts.PEAK_BF16_FLOPS`)

The prefill seconds include the host's scheduling between steps and the first token's sampling.

Then, per row on CUDA, the decode attention alone (one layer's call, bench/tools/attention_sweep.py's
timing: CUDA events, median of 20 after 3) at the row's batch and contexts (c .. c + n, blocks scattered)
under SPLITS 1, 2, 4, 8, 16 and the engine's own choice (`decode_grid.decode_splits`): microseconds and K/V
bytes read per second, to show whether the split count the engine picks is the fastest at long contexts.
`--decode-launch '{"SPLITS": 1}'` runs the whole rows with one fixed launch (bench/rollout.py's option).

And where a prefill's time goes: the row's first `PROFILED_PROMPTS` (16) prompts prefilled once more under
the profiler (`prefill_split`: GPU busy and wall, busy per kernel category as bench/tools/decode_profile.py
sorts them, the busiest kernels), and one prefill step's attention alone (`prefill_kernel`: the prompts a
step of `--max-num-batched-tokens` holds, under aten's flash kernel and SDPA's cuDNN backend, K/V heads
repeated or grouped, and FlashAttention-4's where the fa4 extra is installed; bench/tools/prefill_attention.py)
with its TFLOP/s; then the whole prefill again with each other kernel in the engine (`prefill_by_kernel`:
`engine_kwargs.native.prefill_attention=cudnn`, then `=fa4` with FlashAttention-4's own `pack_gqa` and with
`pack_gqa=False`, `PREFILL_REPEATS` times, each generating the first token only), its fraction of the peak
and its speed over the flash prefill (a kernel that cannot run is reported with its error).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))

from attention_sweep import BLOCK, decode_batch, time_call
from decode_profile import annotate_engine, prefill_figures, profiled_generate
from prefill_attention import attention_flops
from prefill_attention import sweep as prefill_attention_sweep
from rollout import add_launch_options, random_prompts, set_launches, timed
from shapes import shape_of

from fulcrum.device_facts import device_peak_flops, hbm_bandwidth
from fulcrum.models import packed_attention
from fulcrum.models.arch import model_shape
from fulcrum.models.arch.spec import decoder_matmul_params, kv_bytes_per_token
from fulcrum.rollout import SamplingParams
from fulcrum.rollout.native import EngineConfig, NativeEngine, decode_grid, kernels
from fulcrum.rollout.testing import random_causal_lm

SHAPES = ("qwen3-0.6b", "qwen2.5-0.5b")
CONTEXTS = (8192, 16384, 2048)
SWEEP_SPLITS = (1, 2, 4, 8, 16)
# Timed beside the engine's default (flash) on CUDA: each name's `prefill_attention` key and FlashAttention-4's
# `pack_gqa` (packed_attention.FA4_PACK_GQA; None: FA4's own choice, which packs under grouped-query heads).
OTHER_PREFILL_KERNELS: dict[str, tuple[str, bool | None]] = {
    "cudnn": ("cudnn", None),
    "fa4": ("fa4", None),
    "fa4_unpacked": ("fa4", False),
}
PREFILL_REPEATS = 2  # prefill_under's timed prefills
PROFILED_PROMPTS = 16  # prefill_split's prompts: steps enough for the split, a trace that loads fast


@dataclass(frozen=True)
class Row:
    shape: str
    context: int


def decode_bytes_per_step(weight_bytes: int, sequences: int, kv_per_token: int, mean_context: float) -> float:
    """Bytes one decode step reads: W + N · kv · mean context (the module docstring)."""
    return weight_bytes + sequences * kv_per_token * mean_context


def prefill_flops(shape: Any, prompts: int, context: int) -> float:
    """Dense FLOPs of prefilling `prompts` prompts of `context` tokens: 2 · P_l · N·c + 2 · V · h · N +
    L · 4 · c² · q / 2 · N (the module docstring)."""
    attention = shape.attention_layers * attention_flops(1, context, shape.heads, shape.head_dim)
    layers = decoder_matmul_params(shape)  # the embedding is a lookup
    return prompts * (2 * layers * context + 2 * shape.vocab * shape.hidden + attention)


def engine_config(
    args: argparse.Namespace, context: int, sequences: int, device: torch.device
) -> EngineConfig:
    """The row's engine: max_model_len context + new tokens, `sequences` rows in one graph bucket."""
    return EngineConfig(
        max_num_seqs=sequences,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=context + args.new_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        decode_steps=args.decode_steps,
        free_cache_engine=False,  # the timed repeats run back to back over one cache
        cudagraph_capture_sizes=[sequences],
        num_kv_blocks=args.num_kv_blocks,
        decode_order=args.decode_order,
    )


def sequences_held(
    args: argparse.Namespace, model: torch.nn.Module, context: int, device: torch.device
) -> int:
    """How many sequences of context + new tokens the KV cache holds (at most --max-seqs): the blocks an
    engine sized for --max-seqs gets, over the blocks a sequence can take."""
    engine = NativeEngine(model, [], 0, engine_config(args, context, args.max_seqs, device), device)
    held = (engine.runner.num_blocks - 1) // engine.config.blocks_per_seq()  # block 0 is scratch
    release(engine, device)
    return min(args.max_seqs, held)


def release(engine: NativeEngine, device: torch.device) -> None:
    """Give the engine's cache, graphs and weights back to the device before the next one is sized."""
    engine.close()
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_row(
    args: argparse.Namespace, row: Row, model: torch.nn.Module, device: torch.device, started: float
) -> dict[str, Any]:
    """One (shape, context) row: the prefill and decode timings, their roofline fractions and, on CUDA,
    the decode attention kernel under each split count."""
    sequences = sequences_held(args, model, row.context, device)
    if sequences < 1:
        return {"shape": row.shape, "context": row.context, "skipped": "the KV cache holds no such sequence"}
    engine = NativeEngine(model, [], 0, engine_config(args, row.context, sequences, device), device)
    prompts = random_prompts([row.context] * sequences, model.config.vocab_size, seed=row.context)
    warm = SamplingParams(temperature=1.0, max_tokens=2 * args.decode_steps, ignore_eos=True, seed=0)
    engine.generate(prompts[:2], warm)  # Triton compiles, the graph is captured
    prefill_s: list[float] = []
    decode_s: list[float] = []
    outputs: list = []
    for repeat in range(args.repeats):
        if repeat and time.perf_counter() - started + (prefill_s[-1] + decode_s[-1]) > args.deadline_s:
            break
        params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=repeat)
        engine.seed_requests(params)
        for prompt in prompts:
            engine.add_request(prompt, params)
        prefill_s.append(timed(lambda: prefill(engine), device))
        outputs.clear()
        decode_s.append(timed(lambda: outputs.extend(drain(engine)), device))
        assert sum(len(out.token_ids) for out in outputs) == sequences * args.new_tokens
    shape = model_shape(model.config)
    kv = kv_bytes_per_token(shape)
    weights = sum(t.numel() * t.element_size() for t in engine.model.weight_tensors())
    split = prefill_split(engine, prompts[:PROFILED_PROMPTS], device)
    flops = prefill_flops(shape, sequences, row.context)
    other_kernels = {
        name: prefill_under(engine, kernel, prompts, flops, prefill_s, device, pack_gqa=pack)
        for name, (kernel, pack) in OTHER_PREFILL_KERNELS.items()
    }
    release(engine, device)
    result = figures(args, row, shape, sequences, weights, kv, prefill_s, decode_s, device)
    result["prefill_split"] = split
    result["prefill_by_kernel"] = other_kernels  # the CPU runs SDPA under either key: the mechanics only
    if device.type == "cuda":
        result["decode_kernel"] = kernel_sweep(args, row, shape, sequences, device)
        result["prefill_kernel"] = prefill_attention_sweep(
            row.context, shape.heads, shape.kv_heads, shape.head_dim, device, args.max_num_batched_tokens
        )
        torch.cuda.empty_cache()  # the sweeps' caches
    return result


def prefill_under(
    engine: NativeEngine,
    kernel: str,
    prompts: list[list[int]],
    flops: float,
    flash_s: list[float],
    device: torch.device,
    pack_gqa: bool | None = None,
) -> dict[str, Any]:
    """The row's prefill timed again (`PREFILL_REPEATS` times, after one untimed step of two prompts) on the
    same engine with another prefill attention kernel (`EngineConfig.prefill_attention`; under "fa4",
    FlashAttention-4's `pack_gqa`); the prompts are dropped once prefilled. Its seconds, TFLOP/s, fraction of
    the peak and speed over the flash prefill timed before."""
    own, engine.config.prefill_attention = engine.config.prefill_attention, kernel
    own_pack, packed_attention.FA4_PACK_GQA = packed_attention.FA4_PACK_GQA, pack_gqa
    seconds: list[float] = []
    try:
        # round 0, two prompts, untimed: the kernel's one-time work (FlashAttention-4 compiles its kernel,
        # cuDNN builds a plan for the step's shape) is not the prefill's
        for repeat in range(PREFILL_REPEATS + 1):
            params = SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True, seed=repeat)
            engine.seed_requests(params)
            for prompt in prompts if repeat else prompts[:2]:
                engine.add_request(prompt, params)
            took = timed(lambda: prefill(engine), device)
            if repeat:
                seconds.append(took)
            drain(engine)
    except Exception as exc:  # a kernel this torch or card refuses: said, the row kept
        return {"failed": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    finally:
        engine.config.prefill_attention = own
        packed_attention.FA4_PACK_GQA = own_pack
    median = statistics.median(seconds)
    peak = device_peak_flops(device)
    return {
        "prefill_s": [round(t, 4) for t in seconds],
        "tflop_per_s": round(flops / median / 1e12, 1),
        "peak_fraction": round(flops / median / peak, 3) if peak else None,
        "over_flash": round(statistics.median(flash_s) / median, 3),
    }


def prefill_split(engine: NativeEngine, prompts: list[list[int]], device: torch.device) -> dict[str, Any]:
    """`prompts` prefilled once more, under the profiler (a generate of one token a prompt): the steps,
    the GPU's busy time and wall, busy per kernel category (bench/tools/decode_profile.py's) and the
    busiest kernels, so the attention's share and the GPU's idle time between steps show (on the CPU,
    the steps and host seconds alone)."""
    annotate_engine(engine)
    params = SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True, seed=0)
    with tempfile.TemporaryDirectory() as folder:
        seconds, trace, _ = profiled_generate(engine, prompts, params, device, Path(folder) / "trace.json")
    return {"profiled_s": round(seconds, 4), **prefill_figures(trace, on_device=device.type == "cuda")}


def prefill(engine: NativeEngine) -> None:
    """Step the engine until every queued prompt is prefilled and its first token read."""
    while engine.scheduler.waiting or engine.pipeline.ahead is not None:
        engine.step()


def drain(engine: NativeEngine) -> list:
    """Step the engine until every request has finished; their outputs."""
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def figures(
    args: argparse.Namespace,
    row: Row,
    shape: Any,
    sequences: int,
    weights: int,
    kv: int,
    prefill_s: list[float],
    decode_s: list[float],
    device: torch.device,
) -> dict[str, Any]:
    """The row's medians, rates and roofline fractions, with the arithmetic behind them."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bandwidth, peak = hbm_bandwidth(name), device_peak_flops(device)
    steps = args.new_tokens - 1  # the first token comes from the prefill
    mean_context = row.context + args.new_tokens / 2
    step_bytes = decode_bytes_per_step(weights, sequences, kv, mean_context)
    decode_median, prefill_median = statistics.median(decode_s), statistics.median(prefill_s)
    decode_rate = sequences * steps / decode_median
    flops = prefill_flops(shape, sequences, row.context)
    out: dict[str, Any] = {
        "shape": row.shape,
        "context": row.context,
        "sequences": sequences,
        "new_tokens": args.new_tokens,
        "repeats": len(decode_s),
        "decode_s": [round(t, 4) for t in decode_s],
        "prefill_s": [round(t, 4) for t in prefill_s],
        "decode_tok_per_s": round(decode_rate),
        "decode_step_ms": round(decode_median / steps * 1e3, 3),
        "weight_bytes": weights,
        "kv_bytes_per_token": kv,
        "decode_bytes_per_step": step_bytes,
        "prefill_tok_per_s": round(sequences * row.context / prefill_median),
        "prefill_flops": flops,
        "prefill_tflop_per_s": round(flops / prefill_median / 1e12, 1),
        "hbm_bytes_per_s": bandwidth,
        "peak_flop_per_s": peak,
        "decode_roofline_fraction": None,
        "prefill_peak_fraction": None,
    }
    arithmetic = (
        f"decode: {weights / 1e9:.3f} GB + {sequences} x {kv:,} B x {mean_context:,.0f} = "
        f"{step_bytes / 1e9:.2f} GB a step"
    )
    if bandwidth:
        roofline = sequences * bandwidth / step_bytes
        out["decode_roofline_tok_per_s"] = round(roofline)
        out["decode_roofline_fraction"] = round(decode_rate / roofline, 3)
        arithmetic += (
            f"; at {bandwidth / 1e12:.2f} TB/s {step_bytes / bandwidth * 1e3:.2f} ms a step, roofline "
            f"{roofline:,.0f} tok/s; measured {decode_median / steps * 1e3:.2f} ms, {decode_rate:,.0f} tok/s = "
            f"{decode_rate / roofline:.1%}"
        )
    arithmetic += f" | prefill: {flops / 1e12:,.1f} TFLOP in {prefill_median:.3f} s"
    if peak:
        out["prefill_peak_fraction"] = round(flops / prefill_median / peak, 3)
        arithmetic += (
            f" = {flops / prefill_median / 1e12:,.0f} TFLOP/s, {flops / prefill_median / peak:.1%} of peak"
        )
    out["arithmetic"] = arithmetic
    return out


def kernel_sweep(
    args: argparse.Namespace, row: Row, shape: Any, sequences: int, device: torch.device
) -> dict[str, Any]:
    """One layer's decode attention at the row's batch and contexts under each split count and the
    engine's choice: microseconds and K/V bytes read per second."""
    context = (row.context, row.context + args.new_tokens)
    batch = decode_batch(sequences, shape.heads, shape.kv_heads, shape.head_dim, device, context=context)
    kv_bytes = batch.pop("kv_bytes")
    max_context = batch["block_tables"].shape[1] * BLOCK
    chosen = decode_grid.decode_splits(sequences, shape.kv_heads, max_context, decode_grid.sm_count(device))

    def call(splits: int) -> torch.Tensor:
        launch = {"SPLITS": splits}
        return kernels.paged_decode_attention(
            **batch, block_size=BLOCK, scale=shape.head_dim**-0.5, launch=launch
        )

    reference = call(1)
    times, failed = {}, {}
    for splits in sorted({*SWEEP_SPLITS, chosen}):
        try:
            torch.testing.assert_close(call(splits), reference, atol=2e-2, rtol=2e-2)
            times[splits] = time_call(lambda splits=splits: call(splits), repeats=20, warmup=3)
        except Exception as exc:  # a launch Triton cannot build, or a wrong result: said, the rest timed
            failed[str(splits)] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    if chosen not in times:
        return {"chosen_splits": chosen, "failed": failed}
    best = min(times, key=times.get)
    return {
        "failed": failed,
        "chosen_splits": chosen,
        "us": {str(s): round(t, 1) for s, t in times.items()},
        "kv_tb_per_s": {str(s): round(kv_bytes / t / 1e6, 3) for s, t in times.items()},
        "best_splits": best,
        "chosen_over_best": round(times[chosen] / times[best], 3),
    }


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of the rows."""

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1%}"

    lines = [
        "| shape | context | sequences | decode tok/s | decode ms/step | of memory roofline | prefill tok/s "
        "| prefill TFLOP/s | of bf16 peak | splits chosen / fastest | prefill, cuDNN over flash "
        "| prefill, FA4 over flash | prefill, FA4 unpacked over flash |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['shape']} | {r['context']} | {r['skipped']} ||||||||||")
            continue
        kernel = r.get("decode_kernel")
        splits = f"{kernel['chosen_splits']} / {kernel['best_splits']}" if kernel else "n/a"
        over = []
        for name in OTHER_PREFILL_KERNELS:
            other = r.get("prefill_by_kernel", {}).get(name, {})
            over.append(
                f"{other['over_flash']}x" if "over_flash" in other else other.get("failed", "n/a")[:40]
            )
        lines.append(
            f"| {r['shape']} | {r['context']} | {r['sequences']} | {r['decode_tok_per_s']:,} | "
            f"{r['decode_step_ms']} | {pct(r['decode_roofline_fraction'])} | {r['prefill_tok_per_s']:,} | "
            f"{r['prefill_tflop_per_s']} | {pct(r['prefill_peak_fraction'])} | {splits} | {' | '.join(over)} |"
        )
    return "\n".join(lines)


def host_model(name: str, tiny: bool, device: torch.device) -> torch.nn.Module:
    """The named shape's random model (bf16; float32 on the CPU), initialised on `device` and kept on the
    host: each engine copies its weights, so the card holds one copy."""
    model_type, fields = shape_of(name, tiny=tiny)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = random_causal_lm(model_type, seed=0, dtype=dtype, **fields)
    model = model.cpu()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="bench/shapes.py names, comma-separated")
    parser.add_argument(
        "--contexts", default=",".join(map(str, CONTEXTS)), help="prompt tokens, in run order"
    )
    parser.add_argument("--max-seqs", type=int, default=512, help="at most this many sequences a row")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens decoded after each prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="a fixed cache (the CPU's default)")
    parser.add_argument(
        "--deadline-s", type=float, default=420.0, help="no row or repeat starts that would end after it"
    )
    parser.add_argument("--smoke", action="store_true", help="the CPU, tiny shapes, contexts 96 and 48")
    parser.add_argument("--json", type=Path, help="the summary, rewritten after every row")
    add_launch_options(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.contexts = "cpu", "96,48"
        args.max_seqs, args.new_tokens, args.decode_steps, args.repeats = 3, 8, 4, 2
        args.max_num_batched_tokens, args.num_kv_blocks = 256, args.num_kv_blocks or 64
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device)
    torch.set_num_threads(1 if args.smoke else min(torch.get_num_threads(), 8))
    summary: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "argv": sys.argv[1:] if argv is None else argv,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "launch": set_launches(args.decode_launch, args.sample_launch),
        "rows": [],
    }
    models: dict[str, torch.nn.Module] = {}
    longest = 0.0  # the longest row so far: a row starts only if one as long ends by the deadline
    for context in [int(c) for c in args.contexts.split(",")]:
        for name in args.shapes.split(","):
            if time.perf_counter() - started + longest > args.deadline_s:
                summary["rows"].append({"shape": name, "context": context, "skipped": "deadline"})
                continue
            row_started = time.perf_counter()
            if name not in models:
                models[name] = host_model(name, args.smoke, device)
            row = run_row(args, Row(name, context), models[name], device, started)
            longest = max(longest, time.perf_counter() - row_started)
            print(f"{name} @ {context}: {row.get('arithmetic', row.get('skipped'))}", flush=True)
            summary["rows"].append(row)
            if args.json:
                args.json.write_text(json.dumps(summary, indent=1))
    summary["elapsed_s"] = round(time.perf_counter() - started, 1)
    print(table(summary["rows"]))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
