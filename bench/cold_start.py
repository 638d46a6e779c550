"""Benchmark: a run's first step against its warm steps, and where the first step's extra time goes.

    python bench/cold_start.py --model DIR --data DIR --out $OUT              # the seed PPO command
    python bench/cold_start.py --grpo --model DIR --data DIR --out $OUT       # verl's GSM8K GRPO example
    python bench/cold_start.py --smoke --out /tmp/cold_start_smoke            # the CPU, tiny model, < 1 min

The command (bench/train_step.py's `seed_command`, or bench/seed_real.py's `verl_grpo_example`) runs for
`--steps` steps (validation and checkpoints off) in a child process (bench/cold_start_runner.py), once per
condition, in this order:

- `cold`: new, empty TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR (a user's first run on a machine);
- `warm`: the same command and the same cache folders again (the user's second run);
- `python_wrapper`: `actor_rollout_ref.actor.inductor_cpp_wrapper=False` (compiled, inductor's Python
  wrapper instead of its C++ one, whose wrapper source g++ compiles per graph), caches of its own, new and
  empty: what the C++ wrapper costs a first step and buys a warm one;
- `python_wrapper_warm`: the same again on the caches `python_wrapper` left (its second run);
- `eager`: `actor_rollout_ref.actor.use_torch_compile=False` (the reference and the critic follow it),
  with caches of its own, new and empty.

Per condition: each phase's seconds in step 1 against the mean of the later steps (`timing_s/*`, and the
CUDA graph captures, `perf/graph_capture*`), the seconds from the process's start to step 1, and from the
runner, inside the trainer's process: torch's compile accounting (`compile_times`, frames, graphs,
recompiles with dynamo's reasons, graph breaks, cache hits), the compiles by step and phase, and step 1's
cProfile (top 30 by cumulative and by own time, the subprocesses' callers, a cached module load's callees).
`--out` gets cold_start.json, cold_start.md, one file of every condition's step-1 profile tables, one tar
of their raw cProfile data (`pstats.Stats` reads each), and one of the logs' tails (five files: the device
returns eight).
`--deadline-s` bounds the whole call (a condition left without time is skipped, said so in the summary).
On one H100 the seed command's cold run takes about 2 minutes; verl's GRPO example takes several per
condition: give it one call per condition (`--conditions cold`, then `--conditions warm` with the same
`--work` on the same machine).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import IO, Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from seed_real import replace_keys, verl_grpo_example  # noqa: E402  bench/ is on sys.path when a script of it runs
from train_step import seed_command, summarise  # noqa: E402

CONDITIONS = ("cold", "warm", "python_wrapper", "python_wrapper_warm", "eager")
# The keys a condition sets on top of the command (cold and warm run it as it is).
PYTHON_WRAPPER_KEYS = {"actor_rollout_ref.actor.inductor_cpp_wrapper": "False"}
CONDITION_KEYS = {
    "python_wrapper": PYTHON_WRAPPER_KEYS,
    "python_wrapper_warm": PYTHON_WRAPPER_KEYS,
    "eager": {"actor_rollout_ref.actor.use_torch_compile": "False"},
}
# A second run, on the caches of the condition named: the user's next run of the same command.
SECOND_RUN_OF = {"warm": "cold", "python_wrapper_warm": "python_wrapper"}
# What every condition's run adds: a fixed number of steps, nothing but steps (validation and checkpoints
# would land in the last step), a fresh run.
RUN_KEYS = {
    "trainer.val_before_train": "False",
    "trainer.test_freq": "-1",
    "trainer.save_freq": "-1",
    "trainer.resume_mode": "disable",
    "trainer.logger": "[console]",
}
LOG_TAIL = 120  # lines of each condition's log in the results


def command(grpo: bool, model: Path, data: Path) -> list[str]:
    """The measured command: the seed PPO command or verl's GRPO example, as those benches write them."""
    return verl_grpo_example(model, data) if grpo else seed_command(data, model)


def smoke_keys() -> list[str]:
    """The CPU smoke's sizes, as bench/smoke_args.sh gives them to the other benches' smoke runs."""
    text = (BENCH / "smoke_args.sh").read_text()
    match = re.search(r'^SMOKE_STEP_ARGS="([^"]*)"', text, re.MULTILINE)
    assert match, "bench/smoke_args.sh has no SMOKE_STEP_ARGS"
    return match.group(1).split()


def overrides(base: list[str], condition: str, run: Path, steps: int, extra: list[str]) -> list[str]:
    """`base` for `steps` steps in `run`, the user's `extra` KEY=VALUE after, the condition's keys last."""
    keys = {**RUN_KEYS, "trainer.total_training_steps": str(steps), "trainer.default_local_dir": str(run)}
    keys.update(dict(kv.split("=", 1) for kv in extra))
    keys.update(CONDITION_KEYS.get(condition, {}))
    return replace_keys(base, keys)


def cache_env(caches: Path) -> dict[str, str]:
    """The compile caches of a run: inductor's (FX graphs, AOTAutograd, C++ wrappers) and Triton's kernels."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "TRITON_CACHE_DIR": str(caches / "triton")}


def caches_of(work: Path, condition: str) -> Path:
    """A second run shares its first run's cache folder (`SECOND_RUN_OF`); the others have their own."""
    first = SECOND_RUN_OF.get(condition, condition)
    return work / ("caches_compiled" if first == "cold" else f"caches_{first}")


def profile_of(work: Path, condition: str) -> Path:
    """Where a condition's run writes its step-1 profile (`main` gathers them into one file)."""
    return work / f"{condition}.step1_profile.txt"


def phase_table(steps: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per `timing_s/*` phase and graph-capture figure: step 1, the mean of the later steps, the difference."""
    first, later = steps[0], steps[1:]
    keys = [k for k in first if k.startswith("timing_s/") or k.startswith("perf/graph_capture")]
    table: dict[str, dict[str, float | None]] = {}
    for key in keys:
        warm = [s[key] for s in later if isinstance(s.get(key), int | float)]
        mean = statistics.mean(warm) if warm else None
        table[key] = {
            "step1": first[key],
            "warm": mean,
            "extra": first[key] - mean if mean is not None else None,
        }
    return table


def run_condition(
    condition: str, base: list[str], args: argparse.Namespace, limit_s: float
) -> dict[str, Any]:
    """One condition's run (at most `limit_s` seconds): its step figures and the runner's accounting."""
    run, log = args.work / condition / "run", args.work / f"{condition}.log"
    shutil.rmtree(run, ignore_errors=True)
    caches = caches_of(args.work, condition)
    if condition not in SECOND_RUN_OF:
        shutil.rmtree(caches, ignore_errors=True)
    caches.mkdir(parents=True, exist_ok=True)
    keys = overrides(base, condition, run, args.steps, args.overrides)
    report = args.work / f"{condition}.report.json"
    report.unlink(missing_ok=True)
    profile = profile_of(args.work, condition)
    profile.unlink(missing_ok=True)
    profile.with_suffix(".prof").unlink(missing_ok=True)
    cmd = [sys.executable, str(BENCH / "cold_start_runner.py"), "--report", str(report)]
    cmd += [] if args.no_profile else ["--profile", str(profile)]
    env = {**os.environ, **cache_env(caches), "PYTHONUNBUFFERED": "1"}
    print(f"{condition}: {' '.join(cmd[1:])} -- ... ({len(keys)} keys, {cache_env(caches)})", flush=True)
    started = time.monotonic()
    with open(log, "w") as f:
        code, timed_out = run_bounded([*cmd, "--", *keys], f, env, limit_s)
    result: dict[str, Any] = {
        "condition": condition,
        "exit_code": code,
        "timed_out": timed_out,
        "wall_s": time.monotonic() - started,
        "caches": str(caches),
        "command": keys,
    }
    metrics = run / "metrics.jsonl"
    if metrics.exists() and '"training/global_step"' in metrics.read_text():
        steps = summarise(run)["steps"]
        result["steps"] = steps
        if steps:
            result["phases"] = phase_table(steps)
            result["startup_s"] = steps[0].get("perf/elapsed_s", 0.0) - steps[0].get("timing_s/step", 0.0)
    if report.exists():
        result["inside"] = json.loads(report.read_text())
    print(
        f"{condition}: exit {code}{' (timed out)' if timed_out else ''}, {result['wall_s']:.0f} s", flush=True
    )
    return result


def run_bounded(cmd: list[str], log: IO[str], env: dict[str, str], limit_s: float) -> tuple[int | None, bool]:
    """`cmd`'s exit code, and whether it ran out of `limit_s`: then it gets SIGTERM, which the trainer
    ends its run on (the runner still writes its report), and SIGKILL 30 s later."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        return proc.wait(timeout=limit_s), False
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            return proc.wait(timeout=30), True
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(), True


def markdown(results: list[dict[str, Any]]) -> str:
    """The phases' step 1 / warm / extra seconds side by side, then each condition's compile accounting."""
    done = [r for r in results if r.get("phases")]
    lines = ["| phase | " + " | ".join(f"{r['condition']} step 1 / warm / extra" for r in done) + " |"]
    lines.append("|---|" + "---:|" * len(done))
    keys = list(dict.fromkeys(k for r in done for k in r["phases"]))
    for key in keys:
        cells = []
        for r in done:
            row = r["phases"].get(key)
            cells.append("—" if row is None else " / ".join(_fmt(row[c]) for c in ("step1", "warm", "extra")))
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines.append("")
    for r in results:
        if r.get("skipped"):
            lines += [f"## {r['condition']}: skipped ({r['skipped']})", ""]
            continue
        lines.append(
            f"## {r['condition']}: exit {r['exit_code']}, {r['wall_s']:.0f} s"
            + (" (timed out)" if r["timed_out"] else "")
        )
        inside = r.get("inside") or {}
        if "startup_s" in r:
            lines.append(f"- start-up before step 1 (loading, engine): {r['startup_s']:.1f} s")
        if inside:
            lines.append(f"- process start to step 1 (imports included): {inside['to_first_step_s']:.1f} s")
            lines.append(
                f"- dynamo compiles {inside['compiles']} (recompiles {inside['recompiles']}), graph breaks "
                f"{sum(inside['graph_breaks'].values())}, counters {inside['counters']}, caches {inside['inductor_cache']}"
            )
            step1 = inside["compiles_by_step_and_phase"].get("1", {})
            lines.append(f"- step 1 compiles by phase: {json.dumps(step1)}")
            later = {s: v for s, v in inside["compiles_by_step_and_phase"].items() if s not in ("0", "1")}
            lines.append(f"- compiles after step 1: {json.dumps(later) if later else 'none'}")
            top = list(inside["compile_times_s"].items())[:12]
            lines.append("- compile_times (s, whole run): " + ", ".join(f"{k} {v:.1f}" for k, v in top))
            for reason in inside["recompile_reasons"][:8]:
                lines.append("  - " + " | ".join(x.strip() for x in reason.splitlines() if x.strip())[:300])
        lines.append("")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def smoke_inputs(work: Path) -> tuple[Path, Path]:
    """The tiny model (`fulcrum tiny-model`) and synthetic GSM8K-format data, made once in `work`."""
    from fulcrum.data.synthetic import write_splits
    from fulcrum.models.tiny import build_tiny_model

    model, data = work / "tiny_model", work / "data"
    if not (model / "config.json").exists():
        build_tiny_model(model)
    if not (data / "train.parquet").exists():
        write_splits(data, num_train=64, num_test=4)
    return model, data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="model folder (the smoke makes a tiny one)")
    parser.add_argument("--data", type=Path, help="folder with train.parquet and test.parquet")
    parser.add_argument(
        "--grpo", action="store_true", help="verl's GSM8K GRPO example instead of the seed PPO command"
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--conditions", default=",".join(CONDITIONS), help="comma-separated, of " + ", ".join(CONDITIONS)
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/cold_start"), help="runs, caches and logs")
    parser.add_argument("--out", type=Path, required=True, help="the summary, profiles and logs' tails")
    parser.add_argument("--deadline-s", type=float, default=450.0, help="the whole call's seconds")
    parser.add_argument(
        "--no-profile", action="store_true", help="no cProfile of step 1 (it slows Python work)"
    )
    parser.add_argument("--smoke", action="store_true", help="the CPU, a tiny model and synthetic data")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE trainer overrides for every condition")
    args = parser.parse_args(argv)
    started = time.monotonic()
    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    if unknown := [c for c in conditions if c not in CONDITIONS]:
        parser.error(f"--conditions: unknown {', '.join(unknown)} (known: {', '.join(CONDITIONS)})")
    if args.steps < 2:
        parser.error("--steps must be at least 2: step 1 is compared with the later steps")
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        args.model, args.data = smoke_inputs(args.work)
        args.overrides = [*smoke_keys(), *args.overrides]
    elif args.model is None or args.data is None:
        parser.error("--model and --data are needed (or --smoke)")
    base = command(args.grpo, args.model.resolve(), args.data.resolve())
    results = []
    for condition in conditions:
        left = args.deadline_s - (time.monotonic() - started) - 45  # a stopped run's 30 s, the summary's
        if left < 30:
            skipped = {"exit_code": None, "timed_out": True, "wall_s": 0.0, "skipped": "out of time"}
            results.append({"condition": condition, **skipped})
            continue
        results.append(run_condition(condition, base, args, left))
    summary = {"command": "grpo" if args.grpo else "ppo", "steps": args.steps, "conditions": results}
    (args.out / "cold_start.json").write_text(json.dumps(summary, indent=1))
    text = markdown(results)
    (args.out / "cold_start.md").write_text(text)
    tails = []
    for r in results:
        log = args.work / f"{r['condition']}.log"
        if log.exists():
            lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL:]
            tails.append(f"===== {r['condition']} ({log})\n" + "\n".join(lines))
    (args.out / "cold_start_logs.txt").write_text("\n\n".join(tails) + "\n")
    profiles = {r["condition"]: profile_of(args.work, r["condition"]) for r in results}
    (args.out / "step1_profiles.txt").write_text(
        "".join(f"===== {c}\n{p.read_text(errors='replace')}\n" for c, p in profiles.items() if p.exists())
    )
    with tarfile.open(args.out / "step1_profiles.tar.gz", "w:gz") as tar:
        for condition, p in profiles.items():
            if p.with_suffix(".prof").exists():
                tar.add(p.with_suffix(".prof"), arcname=f"{condition}.prof")
    print(text, flush=True)
    return 0 if all(r.get("exit_code") == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
