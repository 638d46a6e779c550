"""`fulcrum tune [--steps N] [--levers a,b] [--max-trials N] [--time-budget S] KEY=VALUE ...`: short probes over
the throughput levers; prints the fastest configuration that fits in memory as overrides to paste, and every trial.

Each trial is the user's configuration plus one change, trained for a few steps (`--steps`, default 3)
in its own process (so its peak memory is its own and an out-of-memory cannot poison the next trial),
with validation, checkpoints and resuming off. The levers are tried one after another (coordinate
search): each keeps the best value found so far, and within a lever the candidates run from the least
memory to the most, stopping at the first out-of-memory. A configuration that runs out of memory itself
is first shrunk (checkpointing on, micro-batches halved) until it fits. A trial's throughput is the median
`perf/throughput` of its steps after the first (the first compiles and allocates); its memory the
peak reserved CUDA memory (the trainer process's peak resident memory on the CPU).

`--time-budget S` bounds the whole search: no trial starts once the time left is below the quickest trial
so far, a trial still running when it is spent is stopped, and the table and the best overrides found by
then are printed (as they are on SIGTERM or Ctrl-C). A trial runs in its own process group, so stopping it
also stops its compile workers. Every trial is also written to `trials.json` in the work folder as it
ends, with its warm step's phase times (`timing_s/*`) and per-phase peak memory, for the record. A work
folder reused from an earlier tune keeps that tune's trials: new ones are numbered after them and added
to its `trials.json`.

Levers (docs/levers.md): micro (every micro-batch size together), checkpointing, dynamic (dynamic batches
with token budgets of 2-8 longest sequences), max_num_seqs, max_num_batched_tokens and
gpu_memory_utilization (the native engine on CUDA only), and decode_order (the native engine on CUDA, under
partial rollouts or responses of LONG_RESPONSE tokens or more).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fulcrum.config import ConfigError, FulcrumConfig, load_config, uses_critic, uses_reference, world_size
from fulcrum.config.schema_v1 import partial_rollouts_on
from fulcrum.tools.tune_trial import (
    STOPPED,
    TRIALS_FILE,
    Overrides,
    Trial,
    WorkDirError,
    open_work_dir,
    run_trial,
)

USAGE = (
    "fulcrum tune [--steps N] [--levers L1,L2] [--max-trials N] [--trial-timeout S] [--time-budget S] "
    "[--work-dir DIR] [KEY=VALUE ...]"
)


# Responses this long (tokens) leave a decode batch's contexts uneven enough for the decode kernel's row
# order to matter (`engine_kwargs.native.decode_order`); shorter ones grow together.
LONG_RESPONSE = 2048


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
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    out = {
        arr.actor.key("ppo_micro_batch_size_per_gpu"): str(micro),
        arr.rollout.key("log_prob_micro_batch_size_per_gpu"): str(2 * micro),
    }
    if uses_reference(cfg):
        out[arr.ref.key("log_prob_micro_batch_size_per_gpu")] = str(2 * micro)
    if uses_critic(cfg):
        out[critic.key("ppo_micro_batch_size_per_gpu")] = str(micro)
        out[critic.key("forward_micro_batch_size_per_gpu")] = str(2 * micro)
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
    flip = {arr.model.key("enable_gradient_checkpointing"): str(not checkpointing)}
    if uses_critic(cfg):
        flip[cfg.critic.model.key("enable_gradient_checkpointing")] = str(not checkpointing)
    levers.append(Lever("checkpointing", [flip]))
    longest = rollout.prompt_length + rollout.response_length
    if not arr.actor.use_dynamic_bsz:
        dynamic = []
        for factor in (2, 4, 8):
            budget = factor * longest
            option = {
                arr.actor.key("use_dynamic_bsz"): "True",
                arr.actor.key("ppo_max_token_len_per_gpu"): str(budget),
            }
            if uses_critic(cfg):
                option[cfg.critic.key("use_dynamic_bsz")] = "True"
                option[cfg.critic.key("ppo_max_token_len_per_gpu")] = str(budget)
            dynamic.append(option)
        levers.append(Lever("dynamic", dynamic))
    responses = cfg.data.train_batch_size * rollout.n // max(world_size(cfg), 1)
    if rollout.max_num_seqs < responses:
        levers.append(Lever("max_num_seqs", [{rollout.key("max_num_seqs"): str(responses)}]))
    if rollout.name == "native":
        budgets = sorted(
            {b for b in (2 * rollout.max_num_batched_tokens, 4 * rollout.max_num_batched_tokens)}
        )
        levers.append(
            Lever(
                "max_num_batched_tokens",
                [{rollout.key("max_num_batched_tokens"): str(b)} for b in budgets],
            )
        )
        if on_cuda:
            fractions = [f for f in (0.5, 0.65, 0.8) if f > rollout.gpu_memory_utilization]
            levers.append(
                Lever(
                    "gpu_memory_utilization",
                    [{rollout.key("gpu_memory_utilization"): str(f)} for f in fractions],
                )
            )
            uneven = partial_rollouts_on(cfg.trainer) or rollout.response_length >= LONG_RESPONSE
            order = (rollout.engine_kwargs.get("native") or {}).get("decode_order", "batch")
            if uneven and order != "longest_first":
                key = f"{rollout.key('engine_kwargs')}.native.decode_order"
                levers.append(Lever("decode_order", [{key: "longest_first"}]))
    return [lever for lever in levers if lever.candidates]


def shrink_lever(cfg: FulcrumConfig) -> Lever:
    """What to try when the user's configuration runs out of memory: gradient checkpointing on, then
    the micro-batches halved down to 1 (least memory last)."""
    arr = cfg.actor_rollout_ref
    checkpointing = {arr.model.key("enable_gradient_checkpointing"): "True"}
    if uses_critic(cfg):
        checkpointing[cfg.critic.model.key("enable_gradient_checkpointing")] = "True"
    candidates = [] if arr.model.enable_gradient_checkpointing else [dict(checkpointing)]
    micro = (arr.actor.ppo_micro_batch_size_per_gpu or 1) // 2
    while micro >= 1:
        candidates.append({**checkpointing, **micro_batch_overrides(cfg, micro)})
        micro //= 2
    return Lever("shrink", candidates)


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
    time_left: Callable[[], bool] = lambda: True,
) -> tuple[Trial, list[Trial]]:
    """Coordinate search: the base first, then each lever's candidates on top of the best so far. When
    the base runs out of memory, `shrink`'s candidates come first, until one fits. No trial starts
    once `max_trials` have run or `time_left()` says no."""
    best = run(Trial({}))
    trials = [best]

    def may_start() -> bool:
        return len(trials) < max_trials and trials[-1].outcome != STOPPED and time_left()

    if best.outcome == "out of memory" and shrink is not None:
        for candidate in shrink.candidates:
            if not may_start():
                return best, trials
            trial = run(Trial(dict(candidate), f"{shrink.name}: " + _short(candidate)))
            trials.append(trial)
            if trial.outcome == "ran":
                best = trial
                break
    for lever in levers:
        for candidate in lever.candidates:
            if not may_start():
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


def fastest(trials: list[Trial]) -> Trial | None:
    """The trial with the highest throughput among those that ran (what `search` returns as its best
    when it runs to the end; used for the trials done when the tune itself is stopped)."""
    ran = [t for t in trials if t.outcome == "ran" and t.throughput is not None]
    return max(ran, key=lambda t: t.throughput or 0.0) if ran else None


# ------------------------------------------------------------------------------------------ output
def _fmt(value: float | None, spec: str) -> str:
    if value is None:
        width = spec.split(".")[0]
        return "-".rjust(int(width)) if width.isdigit() else "-"
    return format(value, spec)


def table(trials: list[Trial]) -> list[str]:
    """One line per trial; `probe` is its change on top of the best configuration found before it.
    `peak GB` is the run's peak (reserved CUDA memory, or resident memory on the CPU); `train GB` the
    largest per-phase CUDA peak allocated outside generation (the updates and forwards)."""
    lines = [
        f"{'#':>2}  {'tok/s/dev':>10}  {'peak GB':>8}  {'step s':>7}  {'train GB':>8}  {'seconds':>7}  "
        f"{'outcome':<20}  probe"
    ]
    for i, t in enumerate(trials):
        lines.append(
            f"{i:>2}  {_fmt(t.throughput, '10.1f')}  {_fmt(t.peak_memory_gb, '8.2f')}  "
            f"{_fmt(t.step_seconds, '7.2f')}  {_fmt(t.train_memory_gb, '8.2f')}  {t.seconds:7.1f}  "
            f"{t.outcome:<20}  {t.probe}"
        )
    return lines


def write_trials(path: Path, trials: list[Trial], earlier: list[dict[str, Any]] | None = None) -> None:
    """Every trial so far as JSON, after an earlier tune's `earlier` rows (rewritten after each trial,
    so a stopped tune leaves its record; through a file renamed when whole, so an interrupt cannot
    leave half of it)."""
    rows = list(earlier or []) + [
        {
            "probe": t.probe,
            "changes": t.changes,
            "outcome": t.outcome,
            "throughput": t.throughput,
            "peak_memory_gb": t.peak_memory_gb,
            "step_seconds": t.step_seconds,
            "train_memory_gb": t.train_memory_gb,
            "seconds": round(t.seconds, 1),
            "phases": t.phases,
            "log": str(t.log) if t.log else None,
        }
        for t in trials
    ]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(rows, indent=1) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def report(best: Trial | None, trials: list[Trial]) -> int:
    """Print the table and the overrides of `best`; 1 when no trial ran."""
    print("\n".join(table(trials)), flush=True)
    if best is None or best.outcome != "ran":
        first = trials[0] if trials else None
        why = f"the first: {first.outcome} (its log: {first.log})" if first else "none started"
        print(f"fulcrum tune: no trial ran; {why}", file=sys.stderr)
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
    print(" ".join(f"{k}={v}" for k, v in best.changes.items()), flush=True)
    return 0


class _Terminated(Exception):
    """SIGTERM of the tune (e.g. `timeout`): stop the running trial, print what was found."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated


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
        "--time-budget",
        type=float,
        help="seconds for the whole search: stop starting trials and stop the running one when spent, "
        "then print what was found (default: no limit)",
    )
    parser.add_argument(
        "--work-dir", help="where the trials' run directories go (default: a temporary folder)"
    )
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    unknown = [a for a in overrides if "=" not in a]
    if unknown:
        parser.error(f"not KEY=VALUE: {unknown}")
    if args.time_budget is not None and args.time_budget <= 0:
        parser.error(f"--time-budget must be positive seconds, got {args.time_budget}")
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
    try:
        earlier = open_work_dir(work)
    except WorkDirError as exc:
        print(f"fulcrum tune: {exc}", file=sys.stderr)
        return 1
    total = 1 + sum(len(lever.candidates) for lever in levers)
    budget = f", within {args.time_budget:.0f} s" if args.time_budget else ""
    print(
        f"fulcrum tune: up to {min(total, args.max_trials)} trials of {args.steps} steps "
        f"({', '.join(lever.name for lever in levers) or 'no lever'}){budget}; runs in {work}",
        flush=True,
    )
    deadline = None if args.time_budget is None else time.monotonic() + args.time_budget
    done: list[Trial] = []

    def budget_left() -> float | None:
        return None if deadline is None else deadline - time.monotonic()

    def time_left() -> bool:
        """Start another trial only if the time left could hold the quickest one so far."""
        left = budget_left()
        quickest = min((t.seconds for t in done), default=0.0)
        return left is None or left > max(quickest, 1.0)

    def run(trial: Trial) -> Trial:
        run_trial(overrides, trial, work, args.steps, args.trial_timeout, budget_left())
        done.append(trial)
        write_trials(work / TRIALS_FILE, done, earlier)
        print(
            f"  {trial.outcome}: {_fmt(trial.throughput, '.1f')} tok/s/device, peak {_fmt(trial.peak_memory_gb, '.2f')} "
            f"GB, {trial.seconds:.0f} s  ({trial.probe})",
            flush=True,
        )
        return trial

    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        best, trials = search(overrides, levers, run, args.max_trials, shrink_lever(cfg), time_left)
    except (KeyboardInterrupt, _Terminated):
        print("fulcrum tune: stopped; the trials that finished:", file=sys.stderr, flush=True)
        best, trials = fastest(done), done
    finally:
        signal.signal(signal.SIGTERM, previous)
    if deadline is not None and len(trials) < min(total, args.max_trials):
        print(f"fulcrum tune: --time-budget {args.time_budget:.0f} s spent after {len(trials)} trials")
    return report(best, trials)


if __name__ == "__main__":
    sys.exit(main())
