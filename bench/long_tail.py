"""Benchmark: GRPO 64 x 8 with long-tailed response lengths, synchronous steps against partial rollouts
(`trainer.use_v1=True trainer.v1.trainer_mode=colocate_async`), in one call on one GPU.

    python bench/long_tail.py --out .bench/long_tail --steps 6 --json long_tail.json
    python bench/long_tail.py --smoke --out /tmp/long_tail     # the CPU path, tiny model, < 2 minutes
    python bench/long_tail.py --out DIR --modes partial-kept  # a third mode into DIR's comparison

The modes (`MODE_KEYS`): `sync`; `partial`, with verl's decoupled loss (token-level importance weights
against an old-log-prob pass) and the KV cache released for training, so the held samples are prefilled
again each step; `partial-kept`, what partial rollouts cost at least on one GPU: bypass mode (the engine's
log-probs are the old ones, no old-log-prob pass) and `rollout.free_cache_engine=False`, so the held
samples keep their K/V through training and nothing is prefilled again.

Lengths: every prompt row carries its own response budget (`extra_info.max_response_length`, see
fulcrum.data.budgets) drawn from a log-normal distribution, median `--median` (1,536) tokens, log-space
sigma `--sigma` (0.8), cut at `--cap` (8,192 = data.max_response_length), seeded: with these about 2 % of
the draws are cut, the mean is about 2k tokens. The model is Qwen3-0.6B-shaped with random weights and
the tiny tokenizer (bench/shapes.py); with `rollout.ignore_eos` every response runs to its budget, so a
group's length is its row's draw and the tail is the distribution's. The prompts are GSM8K-format
arithmetic questions (fulcrum.data.synthetic); every reward is 0: this measures time, not learning.

Micro-batches are cut by tokens (`use_dynamic_bsz`, `--micro-tokens` 32,768 a micro-batch in every pass):
a fixed 32 sequences of up to 8k tokens would make a micro-batch of a quarter of a million tokens. The
modes share `--deadline-s` (480): each run gets `trainer.wall_clock_budget_s` = what is left of it over the
modes left, so the call ends in time whatever a step costs, and `--steps` is an upper bound. Where one
call cannot hold two warm steps of each mode, `--modes sync` and then `--modes partial` run them in calls
one after another on one machine (the same `--out`): each mode's figures are kept there (`sync.json`,
`partial.json`, `partial-kept.json`), and every call that finds sync and another mode there prints and
writes the comparison of all it finds.

Per mode, over the steps after the first (the first compiles, and under partial rollouts it also puts the
warm-up batches in flight): the median step time, the response tokens trained per second
(response_length/mean x 512 / step time; in a steady state what is generated is trained or dropped), the
share of trained tokens carried from an earlier step (`training/off_policy/carried_token_share`), and the
GPU's utilisation over the last step, polled every 50 ms in a thread (NVML through `torch.cuda.utilization`,
else nvidia-smi): its mean and the share of samples below 50 % (the idle tail). The table's last columns
divide each partial mode by sync; its first row, trained response tokens a second, is the comparison of
equal work: the first partial steps train the groups that complete first, shorter ones while the carried
groups build up, so their step rate alone flatters them. Beside them, the engine's own figures (`rollout/*`,
docs/metrics.md): the tokens it sampled per second of generation (under partial rollouts these include the
tokens of groups carried on), the tokens it prefilled (carried samples are prefilled again after
`free_cache_engine` released their K/V), its preemptions, and its decode's memory floor over the decode's
time (`rollout/decode_roofline_share`: 1 would be the card's bandwidth).

The rollout's KV-read floor: a decode step reads the K/V of every sequence in flight, so a response of
b tokens after a prompt of P (its first token from the prefill) reads kv · ((b-1)·P + b(b-1)/2) bytes over
its decode steps, whatever the batching: a step of G groups of n samples needs at least
G · n · E[(b-1)·P + b(b-1)/2] · kv / HBM bandwidth seconds (E over the data's budgets;
`fulcrum.rollout.native.pipeline.decode_floor_s`). Where that floor is most of the synchronous step's generation, the
tail costs what its tokens cost, and carrying it over cannot shorten a step much; where generation is
far above it (a small K/V a token: Qwen2.5-0.5B's 12 KiB against Qwen3-0.6B's 112 KiB), the tail runs
at a batch too small to use the card and partial rollouts have time to take back. `--shape` picks the
model (bench/shapes.py).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import shape_of
from train_step import GRPO_STEP, make_model, seed_command

from fulcrum.data.synthetic import ArithmeticTask, make_rows, write_parquet
from fulcrum.device_facts import hbm_bandwidth
from fulcrum.models.arch import model_shape
from fulcrum.models.arch.spec import kv_bytes_per_token
from fulcrum.rollout.native.pipeline import decode_floor_s
from fulcrum.trainer.main_ppo import main as train

V1_COLOCATE_ASYNC = ["trainer.use_v1=True", "trainer.v1.trainer_mode=colocate_async"]
# Each mode's keys over the common ones. `partial`: the decoupled loss (an old-log-prob pass, the older
# tokens weighed by the policy that sampled them) and the KV cache released for training, as verl's
# defaults; `partial-kept`: what partial rollouts cost at least on one GPU, no old-log-prob pass (bypass
# mode: the engine's log-probs are the old ones) and the held samples' K/V kept through training, so none is
# prefilled again (the cache then stays beside the training passes: doctor counts it).
MODE_KEYS: dict[str, list[str]] = {
    "sync": [],
    "partial": [*V1_COLOCATE_ASYNC, "algorithm.rollout_correction.rollout_is=token"],
    "partial-kept": [
        *V1_COLOCATE_ASYNC,
        "algorithm.rollout_correction.bypass_mode=True",
        "actor_rollout_ref.rollout.free_cache_engine=False",
    ],
}
MODES = tuple(MODE_KEYS)


def lognormal_budgets(count: int, median: float, sigma: float, cap: int, seed: int) -> list[int]:
    """`count` response budgets: b = min(cap, max(1, round(median * exp(sigma * z)))), z ~ N(0, 1) from
    numpy's PCG64 seeded with `seed` (log b is normal with mean ln(median) and sd `sigma`, cut at `cap`)."""
    z = np.random.default_rng(seed).standard_normal(count)
    return [min(cap, max(1, round(median * math.exp(sigma * float(v))))) for v in z]


def kv_read_floor_s(
    budgets: list[int], prompt_tokens: float, samples: int, groups: int, kv_bytes: int, bandwidth: float
) -> float:
    """The K/V bytes a step's decoding must read at least, over the HBM bandwidth (s): `groups` x `samples`
    responses, each the mean over `budgets` of one response's K/V reads after `prompt_tokens` (rounded)
    (`decode_floor_s` without the weights, which a step reads once a decode step, not once a response)."""
    prompt = round(prompt_tokens)
    per_response = statistics.mean(decode_floor_s(1, prompt, b, 0.0, kv_bytes, bandwidth) for b in budgets)
    return groups * samples * per_response


def write_data(out: Path, rows: int, median: float, sigma: float, cap: int, seed: int) -> Path:
    """`out/train.parquet` and `out/test.parquet`: GSM8K-format rows, each with a long-tailed budget."""
    task = ArithmeticTask()
    budgets = lognormal_budgets(rows, median, sigma, cap, seed)
    train_rows = make_rows(rows, seed, task, "train")
    for row, budget in zip(train_rows, budgets, strict=True):
        row["extra_info"]["max_response_length"] = budget
    write_parquet(train_rows, out / "train.parquet")
    write_parquet(make_rows(4, seed, task, "test"), out / "test.parquet")
    return out


def gpu_utilisation() -> float | None:
    """The current GPU's utilisation (%): NVML through torch, else nvidia-smi; None when neither answers."""
    try:
        return float(torch.cuda.utilization())
    except Exception:  # torch asks NVML through pynvml, which may be missing
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
        return float(out.stdout.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


class UtilisationPoller:
    """(seconds since start, GPU utilisation %) every `period_s` in a daemon thread; nothing on a machine
    without CUDA or NVML."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.period_s = period_s
        self.samples: list[tuple[float, float]] = []
        self.start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            util = gpu_utilisation()
            if util is None:
                return
            self.samples.append((time.perf_counter() - self.start, util))
            self._stop.wait(self.period_s)

    def __enter__(self) -> UtilisationPoller:
        if torch.cuda.is_available():
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def window(self, begin: float, end: float) -> list[float]:
        """The samples taken between `begin` and `end` seconds since start."""
        return [u for t, u in self.samples if begin <= t <= end]


def utilisation_figures(samples: list[float]) -> dict[str, float | None]:
    """Mean utilisation (%) and the share of samples under 50 % (None without samples)."""
    if not samples:
        return {"gpu_util_mean": None, "gpu_util_idle_share": None}
    return {
        "gpu_util_mean": sum(samples) / len(samples),
        "gpu_util_idle_share": sum(u < 50 for u in samples) / len(samples),
    }


def step_figures(rows: list[dict[str, Any]], responses_per_step: int) -> dict[str, float]:
    """Median step time (s), trained response tok/s (median tokens over the median step, and all tokens over
    all the time, which a partial run's warm-up moves less) and mean carried-token share over the warm
    steps."""
    warm = rows[1:] or rows
    step_s = statistics.median(r["timing_s/step"] for r in warm)
    trained = [r["response_length/mean"] * responses_per_step for r in warm]
    tokens = statistics.median(trained)
    engine = [r for r in warm if r.get("rollout/generate_s")]
    shares = [r["rollout/decode_roofline_share"] for r in warm if "rollout/decode_roofline_share" in r]
    return {
        "step_s": step_s,
        "tok_per_s": tokens / step_s,
        "tok_per_s_total": sum(trained) / sum(r["timing_s/step"] for r in warm),
        "carried_token_share": statistics.mean(
            r.get("training/off_policy/carried_token_share", 0.0) for r in warm
        ),
        "response_length_mean": statistics.mean(r["response_length/mean"] for r in warm),
        "prompt_length_mean": statistics.mean(r["prompt_length/mean"] for r in warm),
        "gen_s": statistics.median(r["timing_s/gen"] for r in warm),
        "generated_tok_per_s": statistics.median(
            r["rollout/generated_tokens"] / r["rollout/generate_s"] for r in engine
        )
        if engine
        else None,
        "decode_roofline_share": statistics.median(shares) if shares else None,
        "prefill_tokens": statistics.median(r.get("rollout/prefill_tokens", 0.0) for r in warm),
        "preemptions": sum(r.get("rollout/preemptions", 0.0) for r in warm),
    }


def overrides(args: argparse.Namespace, data: Path, model: Path, run: Path, budget_s: float) -> list[str]:
    """The GRPO 64 x 8 step (bench/train_step.py) over the seed command, lengths from the rows' budgets,
    ending within `budget_s` seconds; `--smoke`: the same on the CPU at a size that runs in seconds."""
    keys = [
        *seed_command(data, model),
        *GRPO_STEP,
        f"data.max_response_length={args.cap}",
        "actor_rollout_ref.rollout.ignore_eos=True",  # every response runs to its budget
        f"trainer.total_training_steps={args.steps}",
        f"trainer.default_local_dir={run}",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",  # the log-prob passes follow the actor's two keys
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.micro_tokens}",
        f"trainer.wall_clock_budget_s={budget_s:.0f}",
    ]
    if args.smoke:
        keys += [
            "data.train_batch_size=4",
            "data.max_prompt_length=128",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            "trainer.device=cpu",
        ]
    return keys


def run_mode(args: argparse.Namespace, data: Path, model: Path, name: str, budget_s: float) -> dict[str, Any]:
    """One training run of mode `name` (MODE_KEYS) of at most `budget_s` seconds; its step figures, the
    GPU's utilisation over its last step and the call's own overrides."""
    run = args.out / args.shape / f"run_{name}"
    keys = [*overrides(args, data, model, run, budget_s), *MODE_KEYS[name], *args.overrides]
    with UtilisationPoller() as poller:
        if train(keys) != 0:
            raise SystemExit(f"the {name} run failed (keys: {' '.join(keys)})")
        end = time.perf_counter() - poller.start
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "training/global_step" in r]
    groups, samples = int(_key(keys, "data.train_batch_size")), int(_key(keys, "actor_rollout_ref.rollout.n"))
    figures = step_figures(steps, groups * samples)
    figures.update(utilisation_figures(poller.window(end - steps[-1]["timing_s/step"], end)))
    return {
        "mode": name, "steps": len(steps), "groups": groups, "samples": samples, **figures,
        "overrides": list(args.overrides),
    }  # fmt: skip


def share_of_deadline(args: argparse.Namespace, started: float, runs_left: int) -> float:
    """A run's wall-clock budget: what is left of `--deadline-s` since `started`, over the runs left
    (at least a minute: a budget shorter than the first step ends the run after it)."""
    return max(60.0, (args.deadline_s - (time.perf_counter() - started)) / runs_left)


def _key(keys: list[str], name: str) -> str:
    """The last value given to `name` in `keys` (later overrides win)."""
    return [k.split("=", 1)[1] for k in keys if k.startswith(f"{name}=")][-1]


def table(runs: dict[str, dict[str, Any]], floor_s: float | None) -> str:
    """A markdown table of the modes in `runs` (sync among them) and each other mode over sync; `floor_s`:
    the KV-read floor of a step. The first row compares like with like: trained response tokens a second (a
    partial step trains the groups that complete first, shorter ones while the carried groups build up, so
    its step rate alone flatters it)."""
    others = [m for m in runs if m != "sync"]
    cols = {m: {**r, "step_rate": 1 / r["step_s"], "floor": floor_s} for m, r in runs.items()}

    def cell(value: Any, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    def row(label: str, key: str, fmt: str, ratio: bool = True) -> str:
        cells = [cell(cols[m].get(key), fmt) for m in cols]  # a mode file written before a figure existed
        for m in others:
            a, b = cols[m].get(key), cols["sync"].get(key)
            cells.append("" if not ratio else "n/a" if a is None or not b else f"{a / b:.3f}")
        return f"| {label} | " + " | ".join(cells) + " |"

    return "\n".join(
        [
            "| figure | " + " | ".join(cols) + " | " + " | ".join(f"{m} / sync" for m in others) + " |",
            "|---|" + "---:|" * (len(cols) + len(others)),
            row("**trained response tok/s**", "tok_per_s", ".0f"),
            row("the same, all tokens over all the time", "tok_per_s_total", ".0f"),
            row("step time (s)", "step_s", ".3f"),
            row("step rate (steps/s)", "step_rate", ".4f"),
            row("mean response length", "response_length_mean", ".0f", ratio=False),
            row("carried-token share", "carried_token_share", ".3f", ratio=False),
            row("generation per step (s)", "gen_s", ".1f"),
            row("engine's sampled tok/s while generating", "generated_tok_per_s", ".0f"),
            row("decode's memory floor over its time", "decode_roofline_share", ".2f", ratio=False),
            row("tokens prefilled per step", "prefill_tokens", ".0f", ratio=False),
            row("preemptions over the warm steps", "preemptions", ".0f", ratio=False),
            row("the rollout's KV-read floor per step (s)", "floor", ".1f", ratio=False),
            row("GPU util over the last step (%)", "gpu_util_mean", ".1f", ratio=False),
            row("share of util samples < 50 %", "gpu_util_idle_share", ".3f", ratio=False),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the data, model and runs")
    parser.add_argument("--steps", type=int, default=6, help="training steps per mode")
    parser.add_argument("--median", type=float, default=1536, help="median response budget (tokens)")
    parser.add_argument("--sigma", type=float, default=0.8, help="sd of the log budget")
    parser.add_argument("--cap", type=int, default=8192, help="largest budget = data.max_response_length")
    parser.add_argument("--seed", type=int, default=0, help="seed of the budgets and the questions")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, median 12, cap 32, 4 x 2")
    parser.add_argument("--shape", default="qwen3-0.6b", help="the model's shape (bench/shapes.py)")
    parser.add_argument(
        "--micro-tokens", type=int, default=32768, help="tokens a micro-batch (use_dynamic_bsz), every pass"
    )
    parser.add_argument("--deadline-s", type=float, default=480.0, help="both runs end within this")
    parser.add_argument("--json", type=Path, help="write the summary here")
    parser.add_argument(
        "--modes",
        default="sync,partial",
        help=f"the runs of this call, in order, comma-separated ({', '.join(MODES)})",
    )
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE trainer overrides for both runs")
    args = parser.parse_args(argv)
    if set(args.modes.split(",")) - set(MODES):
        parser.error(f"--modes: a comma-separated list of {', '.join(MODES)}, got {args.modes!r}")
    if args.smoke:
        args.median, args.cap, args.steps = min(args.median, 12), min(args.cap, 32), min(args.steps, 3)
        torch.set_num_threads(1)
    started = time.perf_counter()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is left out of the figures")
    rows = 64 if args.smoke else 64 * (args.steps + 4)  # every step's batch, the warm-up batches and spare
    data = write_data(args.out / "data", rows, args.median, args.sigma, args.cap, args.seed)
    shape_of(args.shape)  # an unknown name stops here, before any model is written
    model = make_model(args.out / f"model-{args.shape}", shape=args.shape, tiny=args.smoke)
    modes = args.modes.split(",")
    for i, mode in enumerate(modes):
        budget_s = share_of_deadline(args, started, len(modes) - i)
        result = run_mode(args, data, model, mode, budget_s=budget_s)
        (args.out / args.shape / f"{mode}.json").write_text(json.dumps(result, indent=2))
    done = {mode: args.out / args.shape / f"{mode}.json" for mode in MODES}
    runs = {mode: json.loads(path.read_text()) for mode, path in done.items() if path.exists()}
    if "sync" not in runs or len(runs) < 2:
        print(f"{', '.join(modes)} measured; the comparison once sync and a partial mode are in {args.out}")
        return 0
    sync = runs["sync"]
    overrides = {mode: run.get("overrides", []) for mode, run in runs.items()}
    if len({tuple(keys) for keys in overrides.values()}) > 1:  # modes measured in calls of other settings
        print(
            "the modes ran with different overrides: "
            + "; ".join(f"{m}: {' '.join(k) or '(none)'}" for m, k in overrides.items())
        )
    bandwidth = hbm_bandwidth(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    floor_s = (
        kv_read_floor_s(
            lognormal_budgets(rows, args.median, args.sigma, args.cap, args.seed),
            sync["prompt_length_mean"],
            sync["samples"],
            sync["groups"],
            kv_bytes_per_token(model_shape(AutoConfig.from_pretrained(model))),
            bandwidth,
        )
        if bandwidth
        else None
    )
    summary = {
        "shape": args.shape,
        "kv_read_floor_s": floor_s,
        "overrides": overrides,
        "budgets": {
            "distribution": "log-normal",
            "median": args.median,
            "sigma": args.sigma,
            "cap": args.cap,
        },
        **runs,
        "over_sync": {
            mode: {
                "tok_per_s_ratio": run["tok_per_s"] / sync["tok_per_s"],
                "tok_per_s_total_ratio": run["tok_per_s_total"] / sync["tok_per_s_total"]
                if "tok_per_s_total" in run and "tok_per_s_total" in sync
                else None,
                "step_rate_ratio": sync["step_s"] / run["step_s"],
            }
            for mode, run in runs.items()
            if mode != "sync"
        },
    }
    print(table(runs, floor_s))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
