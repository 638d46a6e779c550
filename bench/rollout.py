"""Rollout throughput: the native engine against Hugging Face static-cache `generate`, same call, same model.

Workload: the Qwen2.5-0.5B shape (random weights, bf16), 512 prompts with GSM8K-like prompt
lengths, 256 new tokens each with EOS ignored, temperature 1, prefill included. Then the GRPO shape
(64 prompts x n=8) with and without prefix sharing, the weight-sync time and the bf16 log-prob gap
between the engine and the HF forward.

    python bench/rollout.py                       # on one GPU: everything, prints a JSON summary
    python bench/rollout.py --small --device cpu  # a smoke run of the same code on a tiny model

Prompt lengths: `--lengths FILE` (a JSON list of ints), else a seeded log-normal fitted to GSM8K's
training questions: 50 template/instruction tokens + lognormal(mu=4.005, sigma=0.379) question tokens
(chars / 4), clipped to [60, 300]; median 105, 5-95% 80-154 tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shapes import shape_of

from fulcrum.data.dataset import left_pad
from fulcrum.rollout import SamplingParams, logprob_diff
from fulcrum.rollout.native import EngineConfig, NativeEngine
from fulcrum.rollout.testing import random_causal_lm

SMALL_SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def prompt_lengths(count: int, path: str | None, seed: int = 0) -> list[int]:
    if path:
        lengths = json.loads(Path(path).read_text())
        return [int(x) for x in (lengths * (count // len(lengths) + 1))[:count]]
    generator = torch.Generator().manual_seed(seed)
    question = torch.empty(count).log_normal_(4.005, 0.379, generator=generator)
    return (50 + question.ceil()).clamp(60, 300).long().tolist()


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def timed(fn, device: torch.device) -> float:
    """Seconds of fn() measured with CUDA events on GPU (wall clock on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1000
    tick = time.perf_counter()
    fn()
    return time.perf_counter() - tick


def build_model(args, device: torch.device) -> torch.nn.Module:
    """The random model of `--shape` (bench/shapes.py), or a tiny Qwen2 with `--small`."""
    model_type, shape = (
        ("qwen2", SMALL_SHAPE) if args.small else shape_of(getattr(args, "shape", "qwen2.5-0.5b"))
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = random_causal_lm(model_type, seed=0, dtype=dtype, **shape)
    model.generation_config.eos_token_id = None  # EOS ignored: every response is max_tokens long
    return model


def bench_native(args, model, prompts, device, summary: dict) -> NativeEngine:
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max(len(p) for p in prompts) + args.new_tokens + 64,
        gpu_memory_utilization=args.gpu_memory_utilization,
        decode_steps=args.decode_steps,
        enforce_eager=args.enforce_eager,
        free_cache_engine=False,  # timed generates back to back: the cache (and its graphs) stay
        indirect_kv_cache=args.indirect_kv_cache,
        overlap_windows=not getattr(args, "sequential_windows", False),
        num_kv_blocks=getattr(args, "num_kv_blocks", None),
        decode_order=getattr(args, "decode_order", "batch"),
    )
    tick = time.perf_counter()
    engine = NativeEngine(model, [1], 0, config, device)
    engine.runner.capture_all()
    summary["native_start_s"] = round(time.perf_counter() - tick, 2)
    summary["native_graph_capture_s"] = round(engine.runner.graph_capture_s, 2)
    summary["kv_cache_gib"] = round(engine.runner.cache_bytes() / 2**30, 2)
    params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=0)
    engine.generate(prompts, params)  # warm-up: Triton compiles, allocator settles
    times = []
    for _ in range(args.repeats):
        out = None

        def run():
            nonlocal out
            out = engine.generate(prompts, params)

        times.append(timed(run, device))
    generated = sum(len(r) for r in out.token_ids)
    assert generated == len(prompts) * args.new_tokens
    median = statistics.median(times)
    summary["native_s"] = [round(t, 4) for t in times]
    summary["native_tok_per_s"] = round(generated / median)
    summary["native_stats"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in engine.stats.items()}
    print(f"native: {generated} tokens, median {median:.3f} s = {generated / median:,.0f} tok/s", flush=True)
    return engine


def bench_grpo(args, engine, prompts, device, summary: dict) -> None:
    """64 prompts x n=8 (shared prefix) against the same 512 sequences as independent prompts."""
    group = prompts[: args.grpo_prompts]
    params = SamplingParams(
        n=args.grpo_n, temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=1
    )
    flat = [p for p in group for _ in range(args.grpo_n)]
    flat_params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=1)
    results = {}
    for name, batch, p in (("shared", group, params), ("unshared", flat, flat_params)):
        engine.generate(batch, p)
        seconds = timed(lambda batch=batch, p=p: engine.generate(batch, p), device)
        results[name] = {
            "s": round(seconds, 4),
            "tok_per_s": round(len(flat) * args.new_tokens / seconds),
            "prefill_tokens": engine.stats["prefill_tokens"],
            "prefill_s": round(engine.stats["prefill_s"], 4),
            "peak_kv_gib": round(engine.stats["peak_kv_gib"], 3),
        }
    summary["grpo"] = results
    print(f"grpo {args.grpo_prompts}x{args.grpo_n}: {json.dumps(results)}", flush=True)


def bench_hybrid_cycle(args, engine, prompts, device, summary: dict) -> None:
    """sleep -> (training uses memory) -> update_weights -> wake_up -> generate, as every RL step does."""
    params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=3)
    captured = engine.runner.graph_capture_s

    def cycle():
        engine.sleep()
        if device.type == "cuda":
            hog = torch.empty(8 << 30, dtype=torch.uint8, device=device)  # the trainer's activations
            del hog
        engine.update_weights(engine_model_weights)
        engine.wake_up()
        engine.generate(prompts, params)

    engine_model_weights = list(summary.pop("_weights"))
    seconds = timed(cycle, device)
    summary["hybrid_cycle_s"] = round(seconds, 4)
    summary["hybrid_cycle_recapture_s"] = round(engine.runner.graph_capture_s - captured, 4)
    print(f"sleep + update_weights + wake_up + generate: {seconds:.3f} s "
          f"(graph recapture {summary['hybrid_cycle_recapture_s']} s)", flush=True)  # fmt: skip


def bench_variable_lengths(args, engine, prompts, device, summary: dict) -> None:
    """Responses of varied lengths (1,500 stop ids: ~1% a token): the batch shrinks as they finish.

    Measured warm, then right after a sleep/wake-up (where graphs of direct-pointer kernels are
    recaptured for every batch size the shrinking batch passes through).
    """
    params = SamplingParams(
        temperature=1.0, max_tokens=args.new_tokens, stop_token_ids=list(range(1000, 2500)), seed=4
    )
    engine.generate(prompts, params)
    out = None

    def run():
        nonlocal out
        out = engine.generate(prompts, params)

    warm = timed(run, device)
    generated = sum(len(r) for r in out.token_ids)
    captured = engine.runner.graph_capture_s
    engine.sleep()
    engine.wake_up()
    after_wake = timed(run, device)
    summary["variable_lengths"] = {
        "mean_response": round(generated / len(prompts), 1),
        "warm_s": round(warm, 4),
        "warm_tok_per_s": round(generated / warm),
        "after_wake_s": round(after_wake, 4),
        "recapture_s": round(engine.runner.graph_capture_s - captured, 4),
    }
    print(f"variable lengths: {json.dumps(summary['variable_lengths'])}", flush=True)


def bench_weight_sync(engine, model, device, summary: dict) -> None:
    times = [timed(lambda: engine.update_weights(model.named_parameters()), device) for _ in range(5)]
    summary["update_weights_ms_bf16_source"] = round(statistics.median(times) * 1000, 2)
    fp32 = {name: t.detach().float() for name, t in model.named_parameters()}  # the actor's master weights
    times = [timed(lambda: engine.update_weights(fp32.items()), device) for _ in range(5)]
    summary["update_weights_ms_fp32_source"] = round(statistics.median(times) * 1000, 2)
    print(f"update_weights: {summary['update_weights_ms_bf16_source']} ms (bf16 source), "
          f"{summary['update_weights_ms_fp32_source']} ms (fp32 source)", flush=True)  # fmt: skip


def bench_logprob_gap(args, engine, model, prompts, device, summary: dict) -> None:
    """Engine log-probs of sampled tokens vs the HF forward's (same bf16 weights), teacher-forced."""
    batch = prompts[:64]
    out = engine.generate(batch, SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=2))
    width = max(len(p) + len(r) for p, r in zip(batch, out.token_ids, strict=True))
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, (p, r) in enumerate(zip(batch, out.token_ids, strict=True)):
        ids[row, : len(p) + len(r)] = torch.tensor(p + r)
        mask[row, : len(p) + len(r)] = 1
    with torch.no_grad():
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
    actor = torch.zeros(len(batch), 64)
    rollout = torch.tensor(out.logprobs)
    for row, p in enumerate(batch):
        span = logits[row, len(p) - 1 : len(p) + 63].log_softmax(-1)
        actor[row] = span.gather(-1, torch.tensor(out.token_ids[row], device=device)[:, None])[:, 0].cpu()
    gap = logprob_diff(rollout, actor, torch.ones_like(rollout))
    summary["logprob_gap_bf16"] = {k: round(v, 5) for k, v in gap.items()}
    print(f"log-prob gap (bf16, engine vs HF forward): {summary['logprob_gap_bf16']}", flush=True)


def bench_hf(args, model, prompts, device, summary: dict) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True)
    batch = len(prompts)
    ids, mask = (t.to(device) for t in left_pad(prompts, 0))
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=params.max_tokens,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        pad_token_id=0,
        cache_implementation=args.hf_cache,
    )
    with torch.no_grad():
        first = timed(lambda: model.generate(ids, **kwargs), device)  # compiles the static-cache forward
        times = [timed(lambda: model.generate(ids, **kwargs), device) for _ in range(args.hf_repeats)]
    median = statistics.median(times)
    summary["hf_first_call_s"] = round(first, 2)
    summary["hf_s"] = [round(t, 4) for t in times]
    summary["hf_tok_per_s"] = round(batch * params.max_tokens / median)
    print(f"hf generate ({args.hf_cache} cache): median {median:.3f} s = {summary['hf_tok_per_s']:,} tok/s "
          f"(first call {first:.1f} s)", flush=True)  # fmt: skip


def add_launch_options(parser: argparse.ArgumentParser) -> None:
    """--decode-launch and --sample-launch: the kernel launches to run with (set_launches); --decode-order:
    the engine's engine_kwargs.native.decode_order."""
    parser.add_argument(
        "--decode-launch",
        default=None,
        help="JSON over decode_grid.DECODE_LAUNCH, e.g. '{\"SPLITS\": 2}' (bench/tools/attention_sweep.py's best_common)",
    )
    parser.add_argument(
        "--decode-order",
        default="batch",
        choices=("batch", "longest_first"),
        help="the order the decode kernel takes a step's rows in (engine_kwargs.native.decode_order)",
    )
    parser.add_argument(
        "--sample-launch",
        default=None,
        help="JSON of the sampler's launch: BLOCK, programs_per_sm, GROUP, num_warps, num_stages "
        "(bench/tools/sample_sweep.py's best_common)",
    )


def known_options(launch: dict, known: Iterable[str], flag: str) -> dict:
    """`launch` when every key is a known option; else an error naming the unknown ones (a launch
    option the kernels no longer take would otherwise be timed as if it applied)."""
    unknown = sorted(set(launch) - set(known))
    if unknown:
        raise SystemExit(f"{flag}: unknown launch options {unknown}; known: {sorted(known)}")
    return launch


def set_launches(decode: str | None, sample: str | None) -> dict:
    """Set the engine's kernel launches for this process from the sweeps' JSON (before the engine
    captures its graphs); returns the launches in force."""
    from fulcrum.rollout.native import decode_grid, sample_kernels

    if decode:
        decode_grid.DECODE_LAUNCH.update(
            known_options(json.loads(decode), decode_grid.DECODE_LAUNCH, "--decode-launch")
        )
    if sample:
        launch = known_options(
            json.loads(sample), {"BLOCK", "programs_per_sm", *sample_kernels.SAMPLE_LAUNCH}, "--sample-launch"
        )
        sample_kernels.SAMPLE_BLOCK = int(launch.pop("BLOCK", sample_kernels.SAMPLE_BLOCK))
        sample_kernels.SAMPLE_PROGRAMS_PER_SM = int(
            launch.pop("programs_per_sm", sample_kernels.SAMPLE_PROGRAMS_PER_SM)
        )
        sample_kernels.SAMPLE_LAUNCH.update(launch)
    return {
        "decode": dict(decode_grid.DECODE_LAUNCH),
        "sample": {
            "BLOCK": sample_kernels.SAMPLE_BLOCK,
            "programs_per_sm": sample_kernels.SAMPLE_PROGRAMS_PER_SM,
            **sample_kernels.SAMPLE_LAUNCH,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a tiny model (smoke test of the script)")
    parser.add_argument("--shape", default="qwen2.5-0.5b", help="qwen2.5-0.5b, qwen3-0.6b or qwen3-moe-small")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument(
        "--lengths", default=None, help="a JSON file: a list of prompt lengths, repeated to --prompts"
    )
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--indirect-kv-cache", action="store_true", help="graphs survive sleep (slower decode)"
    )
    parser.add_argument(
        "--sequential-windows",
        action="store_true",
        help="read each decode window before launching the next (engine_kwargs.native.overlap_windows=false)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--grpo-prompts", type=int, default=64)
    parser.add_argument("--grpo-n", type=int, default=8)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--hf-cache", default="static")
    parser.add_argument("--hf-repeats", type=int, default=1)
    add_launch_options(parser)
    parser.add_argument("--json", default=None, help="also write the summary here")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(torch.get_num_threads(), 8))
    device = torch.device(args.device)
    summary: dict = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:], "torch": torch.__version__}
    if device.type == "cuda":
        summary["gpu"] = torch.cuda.get_device_name(device)
    summary["launch"] = set_launches(args.decode_launch, args.sample_launch)
    model = build_model(args, device)
    lengths = prompt_lengths(args.prompts, args.lengths)
    summary["prompt_len"] = {
        "mean": round(sum(lengths) / len(lengths), 1),
        "min": min(lengths),
        "max": max(lengths),
    }
    prompts = random_prompts(lengths, model.config.vocab_size)
    engine = bench_native(args, model, prompts, device, summary)
    bench_grpo(args, engine, prompts, device, summary)
    bench_variable_lengths(args, engine, prompts, device, summary)
    bench_weight_sync(engine, model, device, summary)
    summary["_weights"] = list(model.named_parameters())
    bench_hybrid_cycle(args, engine, prompts, device, summary)
    bench_logprob_gap(args, engine, model, prompts, device, summary)
    if not args.skip_hf:
        engine.sleep()
        try:
            bench_hf(args, model, prompts, device, summary)
            summary["speedup_vs_hf"] = round(summary["native_tok_per_s"] / summary["hf_tok_per_s"], 2)
        except Exception as error:  # report the engine's figures even when HF's compile path fails
            summary["hf_error"] = repr(error)[:500]
            print(f"hf generate failed: {error!r}", flush=True)
    if device.type == "cuda":
        summary["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
