"""Hybrid linear attention on one GPU: a Qwen3.5-0.8B-shaped model beside a Qwen3-0.6B-shaped one (random
weights, bf16), both in one run: the engine's throughput, a GRPO step, where the hybrid's engine time goes
and what its recurrent state costs.

    python bench/hybrid.py --json hybrid.json    # one GPU, flash-linear-attention installed; < 8 min
    python bench/hybrid.py --smoke               # the same code on the CPU at tiny shapes

Shapes (bench/shapes.py): `qwen3.5-0.8b`, Qwen3.5-0.8B's text model as released (24 layers: 18 Gated
DeltaNet layers, 16 key and 16 value heads of 128, a conv of 4 taps; 6 attention layers, 8 heads / 2 KV
heads of 256; hidden 1024, intermediate 3584, vocabulary 248,320, tied embeddings; 0.75B parameters), and
`qwen3-0.6b`, Qwen3-0.6B's. For each:

- engine: 512 prompts of GSM8K-like lengths x 256 new tokens, EOS ignored, temperature 1: bench/rollout.py's
  `bench_native` (a warm-up generate, then `--repeats` generates timed with CUDA events; the median);
  then the rollout-vs-training gap in bf16: the engine's log-probs of 64 sampled tokens on 64 prompts
  against the Hugging Face forward's on the same weights (`bench_logprob_gap`);
- a GRPO step of 64 prompts x 8: bench/train_step.py `run --grpo` (the trainer's step: native rollout,
  micro-batches of 32, gradient checkpointing; max_num_seqs 512), each model in its own process, the
  median `timing_s/step` of the steps after the first (`fla_trains` in the summary: whether its
  training passes ran fla's kernels, or the torch reference where fla refuses their backward); on
  GSM8K (`--data`, verl's parquet, as bench/run_all.sh) or else the built-in arithmetic prompts
  (`fulcrum.data.synthetic`);
- for the hybrid: one more generate with CUDA events around every layer's token mixer, summed by kind and
  phase: `linear_attention` (projections, the conv and the delta rule (fla's kernels), the gated norm, the
  output projection) and `attention` (projections, RoPE, paged attention, output) in prefill and decode;
  the rest of the generate is MLPs, norms, the LM head, sampling and the host. Decode replays CUDA
  graphs, which no host-side event can split: this generate runs eagerly (graphs off for it), so its
  shares are those of an eager generate, slower than the throughput above. And its recurrent state:
  bytes a sequence, the engine's slots at this run's max_num_seqs, and the line of doctor's memory
  estimate for the GRPO step's configuration.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout import bench_logprob_gap, bench_native, prompt_lengths, random_prompts, timed
from shapes import shape_of
from train_step import GRPO_STEP, make_model, seed_command, summarise

from fulcrum.config import load_config
from fulcrum.models.arch import model_shape
from fulcrum.models.arch.spec import recurrent_state_bytes
from fulcrum.models.gated_delta import fla_trains, use_fla
from fulcrum.rollout import SamplingParams
from fulcrum.rollout.native.models import decoder as decoder_module
from fulcrum.rollout.testing import random_causal_lm
from fulcrum.tools.memory_estimate import estimate

BENCH = Path(__file__).resolve().parent
HYBRID, DENSE = "qwen3.5-0.8b", "qwen3-0.6b"
# Trainer keys beside the GRPO step's (train_step.GRPO_STEP): 512 sequences, so 512 engine rows for both.
GRPO_KEYS = ["actor_rollout_ref.rollout.max_num_seqs=512"]
PROCESS_START_S = 30.0  # imports and CUDA start-up before the trainer counts its budget
# The smoke's step on the CPU: 2 prompts x 2 responses of 8 tokens, micro-batches of 2.
SMOKE_GRPO_KEYS = [
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "data.max_response_length=8",
    "trainer.device=cpu",
]


def engine_args(args: argparse.Namespace) -> argparse.Namespace:
    """bench_native's settings: bench/rollout.py's defaults (512 rows, 16,384-token prefill budget, decode
    windows of 16, half the device for the engine), the smoke's sizes on the CPU."""
    return argparse.Namespace(
        max_num_seqs=args.prompts,
        max_num_batched_tokens=16384,
        new_tokens=args.new_tokens,
        gpu_memory_utilization=0.5,
        decode_steps=16 if not args.smoke else 4,
        enforce_eager=False,
        indirect_kv_cache=False,
        repeats=args.repeats,
    )


def random_model(name: str, tiny: bool, device: torch.device) -> torch.nn.Module:
    """The random model of a bench/shapes.py shape (bf16 on CUDA), EOS never sampled as a stop."""
    model_type, fields = shape_of(name, tiny)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = random_causal_lm(model_type, seed=0, dtype=dtype, **fields)
    model.generation_config.eos_token_id = None
    return model


class MixerTimes:
    """Seconds spent inside wrapped calls, by key: CUDA events around each call on a GPU (read once, at
    `seconds`), the wall clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)
        self.wall: dict[str, float] = defaultdict(float)

    def wrap(self, fn: Callable, key_of: Callable[[tuple], str]) -> Callable:
        def timed_call(*args: object, **kwargs: object) -> object:
            key = key_of(args)
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(*args, **kwargs)
                end.record()
                self.events[key].append((start, end))
            else:
                tick = time.perf_counter()
                out = fn(*args, **kwargs)
                self.wall[key] += time.perf_counter() - tick
            return out

        return timed_call

    def seconds(self) -> dict[str, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return {k: sum(s.elapsed_time(e) for s, e in pairs) / 1000 for k, pairs in self.events.items()}
        return dict(self.wall)


def mixer_split(engine, prompts: list[list[int]], params: SamplingParams, device: torch.device) -> dict:
    """One eager generate (events cannot split a graph's replay) with every token mixer's calls timed:
    seconds by kind and phase, their share of it."""
    times = MixerTimes(device)
    model, graphs = engine.model, engine.runner.use_graphs
    engine.runner.use_graphs = False
    linear = decoder_module.linear_attention
    decoder_module.linear_attention = times.wrap(
        linear, lambda a: "linear_attention/" + ("decode" if a[5].q_lens is None else "prefill")
    )
    model._attention = times.wrap(
        model._attention, lambda a: "attention/" + ("prefill" if a[4].is_prefill else "decode")
    )
    try:
        total = timed(lambda: engine.generate(prompts, params), device)
    finally:
        decoder_module.linear_attention = linear
        del model._attention
        engine.runner.use_graphs = graphs
    spent = {k: round(v, 4) for k, v in sorted(times.seconds().items())}
    inside = sum(spent.values())
    return {
        "generate_s": round(total, 4),
        "mixers_s": spent,
        "share": {k: round(v / total, 3) for k, v in spent.items()},
        "rest_share": round(1 - inside / total, 3),
    }


def bench_engine(name: str, args: argparse.Namespace, device: torch.device) -> dict:
    """The engine's throughput at 512 x 256 (bench_native), its bf16 log-probs against the Hugging Face
    forward's (bench_logprob_gap: 64 rows of 64 sampled tokens), and for the hybrid the split and its
    states."""
    model = random_model(name, args.smoke, device)
    lengths = prompt_lengths(args.prompts, None)
    if args.smoke:  # a few tokens, not GSM8K's hundred
        lengths = [n // 8 for n in lengths]
    prompts = random_prompts(lengths, model.config.vocab_size)
    out: dict = {}
    engine = bench_native(engine_args(args), model, prompts, device, out)
    bench_logprob_gap(args, engine, model, prompts, device, out)
    if engine.runner.states is not None:
        shape = model_shape(model.config)
        out["recurrent_state"] = {
            "bytes_per_sequence": recurrent_state_bytes(shape),
            "engine_slots": engine.runner.num_state_slots,
            "engine_gib": round(engine.runner.state_bytes() / 2**30, 3),
        }
        params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=5)
        out["split"] = mixer_split(engine, prompts, params, device)
        print(f"{name} split: {json.dumps(out['split'])}", flush=True)
    engine.sleep()
    del engine, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def estimate_line(model_dir: Path, data: Path) -> dict:
    """The recurrent-state line of doctor's memory estimate for the GRPO step's configuration (an 80 GiB
    device, one process)."""
    cfg = load_config([*seed_command(data, model_dir), *GRPO_STEP, *GRPO_KEYS])
    from transformers import AutoConfig

    est = estimate(
        cfg, model_shape(AutoConfig.from_pretrained(model_dir)), 80 * 2**30, False, False, False, 512
    )
    lines = {k: v for k, v in est.phases[0].items.items() if k.startswith("recurrent states")}
    return {k: round(v / 2**30, 3) for k, v in lines.items()}


def grpo_step(name: str, model_dir: Path, data: Path, args: argparse.Namespace, limit_s: float) -> dict:
    """bench/train_step.py `run --grpo` for `name` in its own process: the median warm step. The run ends
    itself within `limit_s` (`trainer.wall_clock_budget_s`, less the process's start); a process stopped
    at the limit still gives the steps it finished."""
    run = args.work / f"run_{name}"
    shutil.rmtree(run, ignore_errors=True)  # metrics.jsonl is appended to: a run before this one's rows
    keys = GRPO_KEYS + (SMOKE_GRPO_KEYS if args.smoke else [])
    keys = [*keys, f"trainer.wall_clock_budget_s={max(limit_s - PROCESS_START_S, 1.0):.0f}"]
    command = [sys.executable, str(BENCH / "train_step.py"), "run", "--grpo", "--data", str(data)]
    command += ["--model", str(model_dir), "--run", str(run), "--steps", str(args.steps), *keys]
    log = args.work / f"grpo_{name}.log"
    tick = time.perf_counter()
    try:
        with log.open("w") as out:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=limit_s).returncode
    except subprocess.TimeoutExpired:
        code = None  # stopped at the limit: the steps it finished are the figure
    if code:
        return {"failed": f"exit {code}: " + " | ".join(log.read_text().splitlines()[-5:])}
    steps = summarise(run)["steps"] if (run / "metrics.jsonl").exists() else []
    if not steps:
        ended = "exited" if code == 0 else f"stopped at its {limit_s:.0f} s limit"
        return {"failed": f"{ended} before a step ended (log {log})"}
    warm = [s["timing_s/step"] for s in steps[1:]] or [steps[0]["timing_s/step"]]
    return {
        "step_s": round(statistics.median(warm), 3),
        "steps_s": [round(s["timing_s/step"], 3) for s in steps],
        "gen_s": round(statistics.median(s["timing_s/gen"] for s in steps[1:] or steps), 3),
        "tok_per_s": round(statistics.median(s.get("perf/throughput", 0.0) for s in steps[1:] or steps)),
        "process_s": round(time.perf_counter() - tick, 1),
        **({} if code == 0 else {"stopped": f"at its {limit_s:.0f} s limit"}),
    }


def grpo_data(args: argparse.Namespace) -> Path:
    """GSM8K in verl's parquet when `--data` holds it; else the built-in arithmetic prompts."""
    if args.data is not None and (args.data / "train.parquet").exists():
        return args.data
    from fulcrum.data.synthetic import write_splits

    out = args.work / "data"
    write_splits(out, num_train=max(640, 64 * args.steps), num_test=8)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, a few tokens")
    parser.add_argument(
        "--data", type=Path, default=BENCH.parent / ".bench/gsm8k", help="GSM8K parquet folder"
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_hybrid"), help="models, runs and logs")
    parser.add_argument("--repeats", type=int, default=3, help="timed generates per model (after a warm-up)")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per model (the first is warm-up)")
    parser.add_argument("--deadline-s", type=float, default=450.0, help="the GRPO steps stop by then")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    device = torch.device("cpu" if args.smoke else "cuda")
    args.prompts, args.new_tokens = (8, 8) if args.smoke else (512, 256)
    if args.smoke:
        args.repeats, args.steps = 1, 2
    if device.type == "cuda" and not use_fla(device):
        raise SystemExit(
            "bench/hybrid.py: flash-linear-attention does not import: pip install -e '.[linear-attention]'"
        )
    args.work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(min(torch.get_num_threads(), 8))
    summary: dict = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:], "torch": torch.__version__}
    summary["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    summary["fla"] = use_fla(device)
    summary["fla_trains"] = fla_trains(device)  # else the GRPO step's training passes ran the torch reference
    for name in (HYBRID, DENSE):
        summary[name] = {"engine": bench_engine(name, args, device)}
    data = grpo_data(args)
    summary["grpo_data"] = str(data)
    for name in (HYBRID, DENSE):
        model_dir = make_model(args.work / f"model_{name}", shape=name, tiny=args.smoke)
        if name == HYBRID:
            summary[name]["memory_estimate"] = estimate_line(model_dir, data)
        left = args.deadline_s - (time.perf_counter() - started)
        limit = left if name == DENSE else left * 0.55  # the hybrid's first: leave the dense one its share
        summary[name]["grpo"] = grpo_step(name, model_dir, data, args, max(limit, 1.0))
        print(f"{name} GRPO step: {json.dumps(summary[name]['grpo'])}", flush=True)
    hybrid, dense = summary[HYBRID], summary[DENSE]
    summary["ratio_hybrid_over_dense"] = {
        "engine_tok_per_s": round(
            hybrid["engine"]["native_tok_per_s"] / dense["engine"]["native_tok_per_s"], 3
        )
    }
    if all(len(m["grpo"].get("steps_s", [])) >= 2 for m in (hybrid, dense)):  # warm steps, not a first one
        summary["ratio_hybrid_over_dense"]["grpo_step_s"] = round(
            hybrid["grpo"]["step_s"] / dense["grpo"]["step_s"], 3
        )
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
