"""One run directory, one run: the rules a training run applies to `trainer.default_local_dir` at start.

- A fresh start where another run's metrics or checkpoints are stops with a message naming them and
  the choices; `trainer.overwrite_run=True` moves the old run into `old_runs/<time>/` (never deletes).
- A resume compares the configuration with the one the checkpoint was trained under: changes to what
  or how the run trains stop it unless `trainer.accept_config_changes=True`; harmless ones are listed.
- `metrics.jsonl` never holds a step twice: on resume, rows after the checkpoint's step move to
  `metrics.dropped.jsonl`; `attempts.jsonl` records each start (where its rows begin, which
  configuration, which checkpoint), and `configs/attempt_<k>.yaml` keeps every configuration.
"""

from __future__ import annotations

import fnmatch
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fulcrum.config import save_config, to_dict
from fulcrum.config.keys import flatten
from fulcrum.trainer.checkpoint import LATEST_FILE, ResumeChoice, read_run_config, step_folders
from fulcrum.trainer.checkpoint.atomic import fsync_dir

METRICS_FILE = "metrics.jsonl"
DROPPED_METRICS_FILE = "metrics.dropped.jsonl"
ATTEMPTS_FILE = "attempts.jsonl"
CONFIG_FILE = "config.yaml"
CONFIGS_DIR = "configs"
OLD_RUNS_DIR = "old_runs"

# Keys whose change leaves what the run trains on, and how, alone: bookkeeping, frequencies, the step
# budget, validation, and the throughput levers (micro-batching, engine memory, the number of ranks)
# whose results agree up to floating-point summation order.
HARMLESS_KEYS = (
    "trainer.logger",
    "trainer.project_name",
    "trainer.experiment_name",
    "trainer.default_local_dir",
    "trainer.save_freq",
    "trainer.test_freq",
    "trainer.total_training_steps",
    "trainer.total_epochs",
    "trainer.max_*_ckpt_to_keep",
    "trainer.resume_mode",
    "trainer.resume_from_path",
    "trainer.val_before_train",
    "trainer.val_only",
    "trainer.log_val_generations",
    "trainer.rollout_data_dir",
    "trainer.validation_data_dir",
    "trainer.save_on_interrupt",
    "trainer.max_nan_steps",
    "trainer.overwrite_run",
    "trainer.accept_config_changes",
    "*.optim.total_training_steps",
    "data.val_files",
    "data.val_batch_size",
    "actor_rollout_ref.rollout.val_kwargs.*",
    "*micro_batch_size*",
    "*max_token_len*",
    "*.use_dynamic_bsz",
    "*.enable_gradient_checkpointing",
    "actor_rollout_ref.rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.max_num_seqs",
    "actor_rollout_ref.rollout.max_num_batched_tokens",
    "actor_rollout_ref.rollout.enforce_eager",
    "actor_rollout_ref.rollout.free_cache_engine",
    # the world size and the engine layout: the same global batches, split over other ranks
    "trainer.n_gpus_per_node",
    "trainer.nnodes",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
)


class RunDirError(RuntimeError):
    """The run directory holds another run, or a resume would change the run; the message says what to do."""


def is_harmless(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in HARMLESS_KEYS)


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """("key: old -> new" lines that change the training, lines that do not), comparing flattened trees."""
    before, after = flatten(old), flatten(new)
    blocking, harmless = [], []
    for key in sorted(set(before) | set(after)):
        was, now = before.get(key, "<absent>"), after.get(key, "<absent>")
        if was == now:
            continue
        line = f"{key}: {was!r} -> {now!r}"
        (harmless if is_harmless(key) else blocking).append(line)
    return blocking, harmless


# ------------------------------------------------------------------------------------ metrics.jsonl
def _row_step(row: dict[str, Any]) -> float | None:
    step = row.get("training/global_step", row.get("step"))
    return float(step) if isinstance(step, int | float) else None


def read_metrics_rows(path: Path) -> list[dict[str, Any] | None]:
    """Rows of a metrics.jsonl; None for a line cut short by a kill."""
    if not path.is_file():
        return []
    rows: list[dict[str, Any] | None] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            rows.append(None)
    return rows


def trim_metrics_log(
    path: str | os.PathLike, last_step: int, dropped_to: Path | None = None, attempt: int | None = None
) -> int:
    """Move rows of a `metrics.jsonl` logged after `last_step` out of it; returns how many.

    A run killed past its last checkpoint logged steps that the resumed run logs again. The dropped
    rows are appended to `dropped_to` (with `dropped_by_attempt`), so nothing is lost; a line cut
    short by the kill is kept there as text. Rewritten in place, so a handle open for append stays valid.
    """
    file = Path(path)
    if not file.is_file():
        return 0
    kept, dropped = [], []
    for line in file.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            dropped.append({"dropped_by_attempt": attempt, "unreadable_line": line})
            continue
        step = _row_step(row)
        if step is not None and step > last_step:
            dropped.append({"dropped_by_attempt": attempt, **row})
        else:
            kept.append(line)
    if not dropped:
        return 0
    if dropped_to is not None:
        with open(dropped_to, "a") as f:
            f.write("".join(json.dumps(row) + "\n" for row in dropped))
            f.flush()
            os.fsync(f.fileno())
    with open(file, "r+") as f:
        f.write("".join(f"{line}\n" for line in kept))
        f.truncate()
        f.flush()
        os.fsync(f.fileno())
    return len(dropped)


# ------------------------------------------------------------------------------------- one run rule
def other_run_contents(run_dir: Path) -> list[str]:
    """What in `run_dir` belongs to a run (metrics rows, checkpoints), described for a message."""
    found = []
    rows = [r for r in read_metrics_rows(run_dir / METRICS_FILE)]
    if rows:
        steps = sorted({int(s) for r in rows if r is not None and (s := _row_step(r)) is not None})
        span = f", steps {steps[0]}..{steps[-1]}" if steps else ""
        found.append(f"{METRICS_FILE} with {len(rows)} row(s){span}")
    folders = [path.name for _, path in step_folders(run_dir)]
    if folders:
        found.append(f"checkpoint folder(s) {', '.join(folders)}")
    return found


def move_old_run_aside(run_dir: Path) -> Path:
    """Move everything in `run_dir` (but earlier set-aside runs) into `run_dir/old_runs/<time>/`."""
    target = run_dir / OLD_RUNS_DIR / time.strftime("%Y%m%d-%H%M%S")
    suffix = 0
    while target.exists():
        suffix += 1
        target = target.with_name(f"{target.name.split('.')[0]}.{suffix}")
    target.mkdir(parents=True)
    for child in run_dir.iterdir():
        if child.name != OLD_RUNS_DIR:
            os.rename(child, target / child.name)
    fsync_dir(run_dir)
    return target


# ---------------------------------------------------------------------------------------- the start
@dataclass
class Attempt:
    number: int  # 1 for the first start of the run, +1 for each resume
    resumed_from: Path | None
    notes: list[str]


def _resume_step(path: Path) -> int:
    return int(path.name.rsplit("_", 1)[1])


def open_run_dir(run_dir: Path, cfg: Any, choice: ResumeChoice, manager: Any) -> Attempt:
    """Apply the one-run rule or the resume checks, then record this attempt; returns it.

    Called before any model or data is loaded, so a refusal costs nothing.
    """
    trainer = cfg.trainer
    notes = list(choice.report())
    run_dir.mkdir(parents=True, exist_ok=True)
    if choice.path is None:
        there = other_run_contents(run_dir)
        if there and not trainer.overwrite_run:
            raise RunDirError(
                f"trainer.default_local_dir={run_dir} holds another run ({'; '.join(there)}). A run directory "
                "holds one run. Resume it (trainer.resume_mode=auto, or resume_path with a checkpoint), pick "
                "another trainer.default_local_dir, or set trainer.overwrite_run=True to move the old run "
                f"into {run_dir / OLD_RUNS_DIR}/<time>/ (nothing is deleted)."
            )
        if there:
            notes.append(f"moved the previous run to {move_old_run_aside(run_dir)}")
    else:
        notes += _check_resume_config(choice.path, cfg)
        step = _resume_step(choice.path)
        if choice.path.parent.resolve() == run_dir.resolve():
            for moved in manager.set_aside_newer(step):
                notes.append(f"set aside {moved.name}: newer than the checkpoint resumed")
    number = len(read_metrics_rows(run_dir / ATTEMPTS_FILE)) + 1
    if choice.path is not None:
        dropped = trim_metrics_log(
            run_dir / METRICS_FILE, _resume_step(choice.path), run_dir / DROPPED_METRICS_FILE, number
        )
        if dropped:
            notes.append(
                f"moved {dropped} {METRICS_FILE} row(s) logged after {choice.path.name} to {DROPPED_METRICS_FILE}"
            )
        if not (run_dir / LATEST_FILE).exists() and choice.path.parent.resolve() != run_dir.resolve():
            notes.append(f"resuming from {choice.path}, outside this run directory")
    config_rel = f"{CONFIGS_DIR}/attempt_{number}.yaml"
    save_config(cfg, run_dir / CONFIG_FILE)
    save_config(cfg, run_dir / config_rel)
    record = {
        "attempt": number,
        "started_unix": time.time(),
        "resumed_from": str(choice.path) if choice.path is not None else None,
        "config": config_rel,
        "metrics_rows_before": len(read_metrics_rows(run_dir / METRICS_FILE)),
    }
    with open(run_dir / ATTEMPTS_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")
    return Attempt(number, choice.path, notes)


def _check_resume_config(ckpt: Path, cfg: Any) -> list[str]:
    """Stop when the configuration changed in keys that alter the training; list the harmless changes."""
    saved = read_run_config(ckpt)
    if saved is None:
        return [f"{ckpt.name} does not hold its configuration (an older checkpoint): changes are not checked"]
    blocking, harmless = config_changes(saved, to_dict(cfg))
    notes = [f"resuming with changed key {line}" for line in harmless]
    if blocking and not cfg.trainer.accept_config_changes:
        listing = "\n  ".join(blocking)
        raise RunDirError(
            f"resuming {ckpt} with a configuration that changes what or how the run trains:\n  {listing}\n"
            "Set trainer.accept_config_changes=True to resume with these changes (the data position is kept "
            "in prompts, so no prompt is trained twice or skipped), restore the old values, or start a new "
            "run in another trainer.default_local_dir."
        )
    notes += [f"accepted changed key {line} (trainer.accept_config_changes=True)" for line in blocking]
    return notes
