"""One `fulcrum tune` trial: the user's configuration plus one change, trained for a few steps in its own
process group (so its peak memory is its own, an out-of-memory cannot poison the next trial, and
stopping it stops its compile workers too), and its outcome and figures read back from its
metrics.jsonl. The trials live in a work folder, one `trial-N` folder each, beside `trials.json`."""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STOPPED = "stopped: time budget"  # the outcome of a trial cut short by --time-budget
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
TRIALS_FILE = "trials.json"
TRIAL_DIR = re.compile(r"^trial-(\d+)$")


class WorkDirError(Exception):
    """A work folder that cannot hold the trials; the one-line message names it."""


@dataclass
class Trial:
    changes: Overrides  # overrides on top of the user's, as they would be pasted
    probe: str = "your configuration"  # what this trial changed on top of the best before it
    outcome: str = "not run"  # "ran", "out of memory", STOPPED or "failed: <last line>"
    throughput: float | None = None  # tokens / s / device, median of the warm steps
    peak_memory_gb: float | None = None
    seconds: float = 0.0
    log: Path | None = None
    step_seconds: float | None = None  # timing_s/step, median of the warm steps
    train_memory_gb: float | None = None  # the largest per-phase CUDA peak outside generation
    phases: dict[str, float] = field(default_factory=dict)  # timing_s/* and per-phase peaks, warm median


def open_work_dir(work: Path) -> list[dict[str, Any]]:
    """Create `work` if missing; the trials an earlier tune recorded in its trials.json, kept so that
    this tune adds its own after them. Refuses a file, a folder it cannot write, and a trials.json
    that no tune wrote (it would be overwritten)."""
    if work.exists() and not work.is_dir():
        raise WorkDirError(f"--work-dir {work}: is a file, not a folder; choose a folder")
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WorkDirError(f"--work-dir {work}: cannot create it ({exc.strerror or exc})") from exc
    if not os.access(work, os.W_OK | os.X_OK):
        raise WorkDirError(f"--work-dir {work}: not writable; choose another folder")
    record = work / TRIALS_FILE
    if not record.exists():
        return []
    try:
        rows = json.loads(record.read_text())
    except (OSError, ValueError):
        rows = None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "probe" in r for r in rows):
        raise WorkDirError(
            f"--work-dir {work}: holds a {TRIALS_FILE} that fulcrum tune did not write; choose another folder"
        )
    return rows


def next_trial_dir(work: Path) -> Path:
    """`work/trial-N` with N one past the highest taken: earlier trials stay, and a gap (a folder
    removed by hand) is never filled over a later one."""
    taken = [int(m.group(1)) for p in work.iterdir() if (m := TRIAL_DIR.match(p.name))]
    return work / f"trial-{max(taken, default=-1) + 1}"


def classify(returncode: int, output: str) -> str:
    """A finished trial's outcome from its exit status and output."""
    if returncode == 0:
        return "ran"
    if any(marker in output for marker in OOM_MARKERS):
        return "out of memory"
    last = next((line for line in reversed(output.splitlines()) if line.strip()), f"exit status {returncode}")
    return f"failed: {last.strip()[:160]}"


PHASE_PEAK = "perf/max_memory_allocated_gb/"


def measure(run_dir: Path, trial: Trial, warm_only: bool = False) -> Trial:
    """Fill `trial`'s figures from its metrics.jsonl: the medians of the steps after the first (the first
    compiles and allocates; with one step, that step unless `warm_only`), and the peaks over all steps."""
    path = run_dir / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # the last line of a trial stopped while writing it
                continue
    rows = [r for r in rows if isinstance(r.get("perf/throughput"), (int, float))]
    warm = rows[1:] or ([] if warm_only else rows)
    if not warm:
        return trial

    def median(key: str) -> float | None:
        values = [r[key] for r in warm if isinstance(r.get(key), (int, float))]
        return float(statistics.median(values)) if values else None

    trial.throughput = median("perf/throughput")
    trial.step_seconds = median("timing_s/step")
    gpu = max((r.get("perf/max_memory_reserved_gb") or 0.0) for r in rows)
    cpu = max((r.get("perf/cpu_memory_peak_rss_gb") or 0.0) for r in rows)
    trial.peak_memory_gb = float(gpu if gpu > 0 else cpu)
    keys = sorted({k for r in warm for k in r if k.startswith(("timing_s/", PHASE_PEAK))})
    trial.phases = {k: v for k in keys if (v := median(k)) is not None}
    training = [v for k, v in trial.phases.items() if k.startswith(PHASE_PEAK) and k != PHASE_PEAK + "gen"]
    trial.train_memory_gb = max(training) if training else None
    return trial


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM the trial's process group (the trainer and its compile workers), SIGKILL it 10 s later."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_trial(
    base: list[str], trial: Trial, work: Path, steps: int, timeout: float, budget_left: float | None = None
) -> Trial:
    """Train `steps` steps of base + trial.changes in a child process; fill in outcome and figures. The
    child is stopped after `timeout` seconds (outcome failed) or, when sooner, `budget_left` (STOPPED)."""
    run_dir = next_trial_dir(work)
    run_dir.mkdir(parents=True)
    argv = [
        *base,
        *(f"{k}={v}" for k, v in trial.changes.items()),
        *PROBE_KEYS,
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={run_dir}",
    ]
    trial.log = run_dir / "trial.log"
    limit = timeout if budget_left is None else min(timeout, budget_left)
    start = time.perf_counter()
    with trial.log.open("w") as log:  # a file, not a pipe: a killed trial's leftovers cannot block the read
        process = subprocess.Popen(
            [sys.executable, "-m", "fulcrum.trainer.main_ppo", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "TQDM_DISABLE": "1"},
            start_new_session=True,  # its own process group, stopped as a whole
        )
        try:
            returncode = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            returncode = None
        except BaseException:  # Ctrl-C or SIGTERM of the tune itself: leave no trial behind
            _stop_group(process)
            raise
        finally:
            if process.poll() is None:
                _stop_group(process)
    trial.seconds = time.perf_counter() - start
    output = trial.log.read_text(errors="replace")
    if returncode is None:
        cut_by_budget = budget_left is not None and budget_left < timeout
        trial.outcome = STOPPED if cut_by_budget else f"failed: over --trial-timeout {timeout:.0f} s"
    else:
        trial.outcome = classify(returncode, output)
    measure(run_dir, trial, warm_only=returncode is None)
    if trial.outcome == "ran" and trial.throughput is None:
        trial.outcome = "failed: no step was logged"
    return trial
