"""`fulcrum tune [--steps N] [--levers a,b] [--max-trials N] KEY=VALUE ...`: short probes over the throughput
levers; prints the fastest configuration that fits in memory as overrides to paste, and every trial.

Each trial is the user's configuration plus one change, trained for a few steps (`--steps`, default 3)
in its own process (so its peak memory is its own and an out-of-memory cannot poison the next trial),
with validation, checkpoints and resuming off. The levers are tried one after another (coordinate
search): each keeps the best value found so far, and within a lever the candidates run from the least
memory to the most, stopping at the first out-of-memory. A configuration that runs out of memory itself
is first shrunk (checkpointing on, micro-batches halved) until it fits. A trial's throughput is the median
`perf/throughput` of its steps after the first (the first compiles and allocates); its memory the
peak reserved CUDA memory (the trainer process's peak resident memory on the CPU).

Levers (docs/levers.md): micro (every micro-batch size together), checkpointing, dynamic (dynamic batches
with token budgets of 2-8 longest sequences), max_num_seqs, max_num_batched_tokens and
gpu_memory_utilization (the native engine on CUDA only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fulcrum.config import ConfigError, FulcrumConfig, load_config, uses_critic, uses_reference, world_size

USAGE = "fulcrum tune [--steps N] [--levers L1,L2] [--max-trials N] [--trial-timeout S] [KEY=VALUE ...]"
OOM_MARKERS = (
    "out of device memory",  # the trainer's OutOfMemoryHelp
    "CUDA out of memory",
    "OutOfMemoryError",
    "leaves no room for the KV cache",
    "cannot hold a single decoding sequence",
)
# Keys a probe sets so that it only trains: no validation, no checkpoint, no resume.
PROBE_KEYS = (
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.val_before_train=False",
    "trainer.resume_mode=disable",
    "trainer.logger=[console]",
)

Overrides = dict[str, str]


@dataclass
class Trial:
    changes: Overrides  # overrides on top of the user's, as they would be pasted
    probe: str = "your configuration"  # what this trial changed on top of the best before it
    outcome: str = "not run"  # "ran", "out of memory", or "failed: <last line>"
    throughput: float | None = None  # tokens / s / device, median of the warm steps
    peak_memory_gb: float | None = None
    seconds: float = 0.0
    log: Path | None = None


@dataclass
class Lever:
    name: str
    candidates: list[Overrides] = field(default_factory=list)  # least memory first


# ------------------------------------------------------------------------------------ candidates
def _per_device_mini_batch(cfg: FulcrumConfig) -> int:
    actor = cfg.actor_rollout_ref.actor
    return actor.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n // max(world_size(cfg), 1)


def micro_batch_overrides(cfg: FulcrumConfig, micro: int) -> Overrides:
    """Every micro-batch size of the run at `micro` (training) and 2 x `micro` (no-grad forwards)."""
    out = {
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": str(micro),
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": str(2 * micro),
    }
    if uses_reference(cfg):
        out["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"] = str(2 * micro)
    if uses_critic(cfg):
        out["critic.ppo_micro_batch_size_per_gpu"] = str(micro)
        out["critic.forward_micro_batch_size_per_gpu"] = str(2 * micro)
    return out


def levers_for(cfg: FulcrumConfig, on_cuda: bool) -> list[Lever]:
    """The candidate values of each throughput lever for this configuration, least memory first."""
    arr = cfg.actor_rollout_ref
    rollout = arr.rollout
    levers = []
    per_device = _per_device_mini_batch(cfg)
    base_micro = arr.actor.ppo_micro_batch_size_per_gpu or 1
    micros = [
        m for m in (2**k for k in range(11)) if m > base_micro and m <= per_device and per_device % m == 0
    ]
    levers.append(Lever("micro", [micro_batch_overrides(cfg, m) for m in micros[:4]]))
    checkpointing = bool(arr.model.enable_gradient_checkpointing)
    flip = {"actor_rollout_ref.model.enable_gradient_checkpointing": str(not checkpointing)}
    if uses_critic(cfg):
        flip["critic.model.enable_gradient_checkpointing"] = str(not checkpointing)
    levers.append(Lever("checkpointing", [flip]))
    longest = rollout.prompt_length + rollout.response_length
    if not arr.actor.use_dynamic_bsz:
        dynamic = []
        for factor in (2, 4, 8):
            budget = factor * longest
            option = {
                "actor_rollout_ref.actor.use_dynamic_bsz": "True",
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": str(budget),
            }
            if uses_critic(cfg):
                option["critic.use_dynamic_bsz"] = "True"
                option["critic.ppo_max_token_len_per_gpu"] = str(budget)
            dynamic.append(option)
        levers.append(Lever("dynamic", dynamic))
    responses = cfg.data.train_batch_size * rollout.n // max(world_size(cfg), 1)
    if rollout.max_num_seqs < responses:
        levers.append(Lever("max_num_seqs", [{"actor_rollout_ref.rollout.max_num_seqs": str(responses)}]))
    if rollout.name == "native":
        budgets = sorted(
            {b for b in (2 * rollout.max_num_batched_tokens, 4 * rollout.max_num_batched_tokens)}
        )
        levers.append(
            Lever(
                "max_num_batched_tokens",
                [{"actor_rollout_ref.rollout.max_num_batched_tokens": str(b)} for b in budgets],
            )
        )
        if on_cuda:
            fractions = [f for f in (0.5, 0.65, 0.8) if f > rollout.gpu_memory_utilization]
            levers.append(
                Lever(
                    "gpu_memory_utilization",
                    [{"actor_rollout_ref.rollout.gpu_memory_utilization": str(f)} for f in fractions],
                )
            )
    return [lever for lever in levers if lever.candidates]


def shrink_lever(cfg: FulcrumConfig) -> Lever:
    """What to try when the user's configuration runs out of memory: gradient checkpointing on, then
    the micro-batches halved down to 1 (least memory last)."""
    arr = cfg.actor_rollout_ref
    checkpointing = {"actor_rollout_ref.model.enable_gradient_checkpointing": "True"}
    if uses_critic(cfg):
        checkpointing["critic.model.enable_gradient_checkpointing"] = "True"
    candidates = [] if arr.model.enable_gradient_checkpointing else [dict(checkpointing)]
    micro = (arr.actor.ppo_micro_batch_size_per_gpu or 1) // 2
    while micro >= 1:
        candidates.append({**checkpointing, **micro_batch_overrides(cfg, micro)})
        micro //= 2
    return Lever("shrink", candidates)


# ------------------------------------------------------------------------------------------ trials
def classify(returncode: int, output: str) -> str:
    """A finished trial's outcome from its exit status and output."""
    if returncode == 0:
        return "ran"
    if any(marker in output for marker in OOM_MARKERS):
        return "out of memory"
    last = next((line for line in reversed(output.splitlines()) if line.strip()), f"exit status {returncode}")
    return f"failed: {last.strip()[:160]}"


def measure(run_dir: Path) -> tuple[float | None, float | None]:
    """(median throughput of the steps after the first, peak memory in GB) from the trial's metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None, None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if isinstance(r.get("perf/throughput"), (int, float))]
    if not rows:
        return None, None
    warm = rows[1:] or rows
    throughput = statistics.median(r["perf/throughput"] for r in warm)
    gpu = max((r.get("perf/max_memory_reserved_gb") or 0.0) for r in rows)
    cpu = max((r.get("perf/cpu_memory_peak_rss_gb") or 0.0) for r in rows)
    return float(throughput), float(gpu if gpu > 0 else cpu)


def run_trial(base: list[str], trial: Trial, work: Path, steps: int, timeout: float) -> Trial:
    """Train `steps` steps of base + trial.changes in a child process; fill in outcome and figures."""
    index = len(list(work.glob("trial-*")))
    run_dir = work / f"trial-{index}"
    run_dir.mkdir(parents=True)
    argv = [
        *base,
        *(f"{k}={v}" for k, v in trial.changes.items()),
        *PROBE_KEYS,
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={run_dir}",
    ]
    trial.log = run_dir / "trial.log"
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "fulcrum.trainer.main_ppo", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "TQDM_DISABLE": "1"},
        )
        output = done.stdout + done.stderr
        trial.outcome = classify(done.returncode, output)
    except subprocess.TimeoutExpired as exc:
        output = f"{exc.stdout or ''}{exc.stderr or ''}"
        trial.outcome = f"failed: over --trial-timeout {timeout:.0f} s"
    trial.seconds = time.perf_counter() - start
    trial.log.write_text(output if isinstance(output, str) else str(output))
    trial.throughput, trial.peak_memory_gb = measure(run_dir)
    if trial.outcome == "ran" and trial.throughput is None:
        trial.outcome = "failed: no step was logged"
    return trial


def _short(overrides: Overrides) -> str:
    return " ".join(f"{k.removeprefix('actor_rollout_ref.')}={v}" for k, v in overrides.items())


def better(candidate: Trial, best: Trial) -> bool:
    return (
        candidate.outcome == "ran"
        and candidate.throughput is not None
        and (best.throughput is None or candidate.throughput > best.throughput)
    )


def search(
    base: list[str],
    levers: list[Lever],
    run: Callable[[Trial], Trial],
    max_trials: int,
    shrink: Lever | None = None,
) -> tuple[Trial, list[Trial]]:
    """Coordinate search: the base first, then each lever's candidates on top of the best so far. When
    the base runs out of memory, `shrink`'s candidates come first, until one fits."""
    best = run(Trial({}))
    trials = [best]
    if best.outcome == "out of memory" and shrink is not None:
        for candidate in shrink.candidates:
            if len(trials) >= max_trials:
                return best, trials
            trial = run(Trial(dict(candidate), f"{shrink.name}: " + _short(candidate)))
            trials.append(trial)
            if trial.outcome == "ran":
                best = trial
                break
    for lever in levers:
        for candidate in lever.candidates:
            if len(trials) >= max_trials:
                return best, trials
            changes = {**best.changes, **candidate}
            if changes == best.changes:
                continue
            trial = run(Trial(changes, f"{lever.name}: " + _short(candidate)))
            trials.append(trial)
            if trial.outcome == "out of memory":
                break  # the lever's later candidates take more memory still
            if better(trial, best):
                best = trial
    return best, trials


# ------------------------------------------------------------------------------------------ output
def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(trials: list[Trial]) -> list[str]:
    """One line per trial; `probe` is its change on top of the best configuration found before it."""
    lines = [f"{'#':>2}  {'tok/s/dev':>10}  {'peak GB':>8}  {'seconds':>7}  {'outcome':<16}  probe"]
    for i, t in enumerate(trials):
        lines.append(
            f"{i:>2}  {_fmt(t.throughput, '10.1f')}  {_fmt(t.peak_memory_gb, '8.2f')}  {t.seconds:7.1f}  "
            f"{t.outcome:<16}  {t.probe}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fulcrum tune", usage=USAGE, description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="training steps per trial (default 3; 2 on the CPU)")
    parser.add_argument("--levers", help="comma-separated levers to probe (default: all that act here)")
    parser.add_argument(
        "--max-trials",
        type=int,
        help="stop after this many trials (default 12; 3 on the CPU, where probes are slow)",
    )
    parser.add_argument("--trial-timeout", type=float, default=900.0, help="seconds per trial (default 900)")
    parser.add_argument(
        "--work-dir", help="where the trials' run directories go (default: a temporary folder)"
    )
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    unknown = [a for a in overrides if "=" not in a]
    if unknown:
        parser.error(f"not KEY=VALUE: {unknown}")
    try:
        cfg = load_config(overrides)
    except ConfigError as exc:
        print(f"fulcrum tune: {exc}", file=sys.stderr)
        return 1
    on_cuda = cfg.trainer.device != "cpu"
    args.steps = args.steps or (3 if on_cuda else 2)
    args.max_trials = args.max_trials or (12 if on_cuda else 3)
    levers = levers_for(cfg, on_cuda)
    if args.levers:
        wanted = [name.strip() for name in args.levers.split(",") if name.strip()]
        known = {lever.name for lever in levers}
        missing = [name for name in wanted if name not in known]
        if missing:
            print(
                f"fulcrum tune: --levers {missing} do not act on this configuration; choose from {sorted(known)}",
                file=sys.stderr,
            )
            return 1
        levers = [lever for lever in levers if lever.name in wanted]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="fulcrum-tune-")).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    total = 1 + sum(len(lever.candidates) for lever in levers)
    print(
        f"fulcrum tune: up to {min(total, args.max_trials)} trials of {args.steps} steps "
        f"({', '.join(lever.name for lever in levers) or 'no lever'}); runs in {work}",
        flush=True,
    )

    def run(trial: Trial) -> Trial:
        run_trial(overrides, trial, work, args.steps, args.trial_timeout)
        print(
            f"  {trial.outcome}: {_fmt(trial.throughput, '.1f')} tok/s/device, peak {_fmt(trial.peak_memory_gb, '.2f')} "
            f"GB  ({trial.probe})",
            flush=True,
        )
        return trial

    best, trials = search(overrides, levers, run, args.max_trials, shrink_lever(cfg))
    print("\n".join(table(trials)))
    if best.outcome != "ran":
        print(f"fulcrum tune: no trial ran; the first: {best.outcome} (its log: {best.log})", file=sys.stderr)
        return 1
    base = trials[0]
    if not best.changes:
        print(
            f"fastest that fits: your configuration ({_fmt(best.throughput, '.1f')} tok/s/device); no change"
        )
        return 0
    if base.outcome == "ran":
        gain = best.throughput / base.throughput if base.throughput and best.throughput else math.nan
        versus = f"{gain:.2f}x your configuration"
    else:
        versus = f"your configuration: {base.outcome}"
    print(f"fastest that fits: {_fmt(best.throughput, '.1f')} tok/s/device, {versus}; add these overrides:")
    print(" ".join(f"{k}={v}" for k, v in best.changes.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
