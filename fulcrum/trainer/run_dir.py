"""One run directory, one run: the rules a training run applies to `trainer.default_local_dir` at start.

- One process at a time: `fulcrum.lock` (fulcrum.trainer.run_lock) is held for the whole run.
- fulcrum knows its own files (fulcrum.trainer.run_ownership): a folder holding files of the names it
  writes that it did not write (a user's `config.yaml` or `attempts.jsonl`) is refused, naming them,
  and nothing in it is written.
- A fresh start where another run's metrics or checkpoints are stops with a message naming them and
  the choices; `trainer.overwrite_run=True` moves the old run into `old_runs/<time>/` (never deletes),
  and only in a folder that holds nothing but fulcrum's files. A resume from another run's checkpoint
  (`resume_path` outside the folder) is a new run here, under the same rule.
- A resume compares the configuration with the one the checkpoint was trained under: changes to what
  or how the run trains stop it unless `trainer.accept_config_changes=True`; harmless ones are listed.
- `metrics.jsonl` never holds a step twice: on resume, rows after the checkpoint's step move to
  `metrics.dropped.jsonl`; `attempts.jsonl` records each start (where its rows begin, which
  configuration, which checkpoint), and `configs/attempt_<k>.yaml` keeps every configuration.
- Every file is written whole or not at all (a temporary file renamed into place); a failed write
  (a full disk) names its path and leaves nothing partial.
"""

from __future__ import annotations

import fnmatch
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fulcrum.config import save_config, to_dict, uses_critic
from fulcrum.config.keys import flatten
from fulcrum.config.schema import ActorConfig, CriticConfig, DataConfig, RolloutConfig, TrainerConfig
from fulcrum.trainer import run_lock
from fulcrum.trainer.checkpoint import ResumeChoice, read_run_config, step_folders
from fulcrum.trainer.checkpoint.atomic import fsync_dir, write_text_atomic
from fulcrum.trainer.run_ownership import (
    ATTEMPTS_FILE,
    CONFIG_FILE,
    CONFIGS_DIR,
    DROPPED_METRICS_FILE,
    METRICS_FILE,
    OLD_RUNS_DIR,
    RunDirError,
    check_own_files,
    foreign_entries,
    mark_run_dir,
    name_list,
    read_metrics_rows,
    row_step,
    run_dir_entries,
    write_whole,
)

# Keys whose change leaves what the run trains on, and how, alone: bookkeeping, frequencies, the step
# budget, validation, and the throughput levers (micro-batching, engine memory, the number of ranks)
# whose results agree up to floating-point summation order. A pattern (fnmatch) reaches every section.
HARMLESS_KEYS = (
    *map(TrainerConfig.key, ("logger", "project_name", "experiment_name", "default_local_dir")),
    *map(TrainerConfig.key, ("save_freq", "test_freq", "total_training_steps", "total_epochs")),
    f"{TrainerConfig.PATH}.max_*_ckpt_to_keep",
    *map(TrainerConfig.key, ("resume_mode", "resume_from_path", "overwrite_run", "accept_config_changes")),
    *map(TrainerConfig.key, ("save_on_interrupt", "save_in_background", "max_nan_steps")),
    *map(TrainerConfig.key, ("val_before_train", "val_only", "log_val_generations")),
    *map(TrainerConfig.key, ("rollout_data_dir", "validation_data_dir")),
    "*.optim.total_training_steps",
    *map(DataConfig.key, ("val_files", "val_batch_size")),
    RolloutConfig.key("val_kwargs") + ".*",
    "*micro_batch_size*",
    "*max_token_len*",
    "*.use_dynamic_bsz",
    "*.enable_gradient_checkpointing",
    *map(RolloutConfig.key, ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens")),
    *map(RolloutConfig.key, ("enforce_eager", "free_cache_engine")),
    # how the training passes launch (graphs, the compiled code's wrapper), where idle AdamW state waits
    "*.cuda_graphs",
    ActorConfig.key("inductor_cpp_wrapper"),
    TrainerConfig.key("park_optimizer_state"),
    # the world size and the engine layout: the same global batches, split over other ranks
    *map(TrainerConfig.key, ("n_gpus_per_node", "nnodes")),
    RolloutConfig.key("tensor_model_parallel_size"),
)


# The keys that set how many steps the run has: the length a warm-up ratio or a cosine schedule spans.
RUN_LENGTH_KEYS = (TrainerConfig.key("total_training_steps"), TrainerConfig.key("total_epochs"))
# The keys the one-run rule's messages offer.
RUN_DIR, OVERWRITE, ACCEPT_CHANGES = map(
    TrainerConfig.key, ("default_local_dir", "overwrite_run", "accept_config_changes")
)
RESUME_MODE, RESUME_PATH = TrainerConfig.key("resume_mode"), TrainerConfig.key("resume_from_path")


def is_harmless(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in HARMLESS_KEYS)


def schedule_spans_run(flat: dict[str, Any], sections: tuple[str, ...]) -> list[str]:
    """The optimiser settings ("key=value") whose learning-rate schedule is laid over the run's total steps,
    as `fulcrum.workers.optim.build_lr_scheduler` builds it: a cosine decay, or a warm-up given as a ratio
    (`lr_warmup_steps` null, 0 or negative). [] when the schedule does not depend on the run's length."""
    spans = []
    for section in sections:
        style = flat.get(f"{section}.lr_scheduler_type") or flat.get(f"{section}.warmup_style") or "constant"
        if style == "cosine":
            spans.append(f"{section}.lr_scheduler_type={style}")
        steps, ratio = flat.get(f"{section}.lr_warmup_steps"), flat.get(f"{section}.lr_warmup_steps_ratio")
        if (steps is None or int(steps) <= 0) and ratio and float(ratio) > 0:
            spans.append(f"{section}.lr_warmup_steps_ratio={ratio}")
    return spans


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
def trim_metrics_log(
    path: str | os.PathLike, last_step: int, dropped_to: Path | None = None, attempt: int | None = None
) -> int:
    """Move rows of a `metrics.jsonl` logged after `last_step` out of it; returns how many.

    A run killed past its last checkpoint logged steps that the resumed run logs again. The dropped
    rows are appended to `dropped_to` (with `dropped_by_attempt`), so nothing is lost; a line cut
    short by the kill is kept there as text. `dropped_to` is replaced whole (`write_text_atomic`) before
    `path` changes, so a failure leaves at worst a row in both files, never in neither. `path` is
    rewritten in place, so a handle open for append stays valid; the kept rows are never more bytes
    than were there, so the rewrite needs no new disk space.
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
        step = row_step(row)
        if step is not None and step > last_step:
            dropped.append({"dropped_by_attempt": attempt, **row})
        else:
            kept.append(line)
    if not dropped:
        return 0
    if dropped_to is not None:
        before = dropped_to.read_text() if dropped_to.is_file() else ""
        write_text_atomic(dropped_to, before + "".join(json.dumps(row) + "\n" for row in dropped))
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
        steps = sorted({int(s) for r in rows if r is not None and (s := row_step(r)) is not None})
        span = f", steps {steps[0]}..{steps[-1]}" if steps else ""
        found.append(f"{METRICS_FILE} with {len(rows)} row(s){span}")
    folders = [path.name for _, path in step_folders(run_dir)]
    if folders:
        found.append(f"checkpoint folder(s) {', '.join(folders)}")
    return found


def move_old_run_aside(run_dir: Path) -> Path:
    """Move fulcrum's files in `run_dir` (but earlier set-aside runs and the lock) into
    `run_dir/old_runs/<time>/`. A folder that also holds other files, or whose fulcrum-named files
    fulcrum did not write, is refused with their names: nothing is moved."""
    check_own_files(run_dir)
    foreign = foreign_entries(run_dir)
    if foreign:
        raise RunDirError(
            f"{OVERWRITE}=True: {run_dir} also holds {name_list(foreign)}, which fulcrum did not write. "
            f"overwrite_run moves a run into {run_dir / OLD_RUNS_DIR}/<time>/ only from a folder that holds "
            f"nothing else: move those out, or give the run a folder of its own ({RUN_DIR})."
        )
    target = run_dir / OLD_RUNS_DIR / time.strftime("%Y%m%d-%H%M%S")
    suffix = 0
    while target.exists():
        suffix += 1
        target = target.with_name(f"{target.name.split('.')[0]}.{suffix}")
    target.mkdir(parents=True)
    for name in run_dir_entries(run_dir):
        if name not in (OLD_RUNS_DIR, run_lock.LOCK_FILE):  # the lock stays: this process holds it
            os.rename(run_dir / name, target / name)
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


def check_not_in_use(run_dir: Path, command: str) -> None:
    """Stop when another live process holds the folder's lock. `train` holds it for the whole run; a
    trainer built directly (tests, scripts) only checks here, holding nothing after."""
    if run_lock.holds(run_dir):
        return
    try:
        run_lock.acquire(run_dir, command)
    except run_lock.RunDirBusyError as err:
        raise RunDirError(str(err)) from None
    run_lock.release(run_dir)


def _outside(ckpt: Path, run_dir: Path) -> bool:
    return ckpt.parent.resolve() != run_dir.resolve()


def _another_run_message(run_dir: Path, there: list[str], ckpt: Path | None) -> str:
    listing = "; ".join(there)
    if ckpt is None:
        return (
            f"{RUN_DIR}={run_dir} holds another run ({listing}). A run directory "
            f"holds one run. Resume it ({RESUME_MODE}=auto, or resume_path with a checkpoint), pick "
            f"another {RUN_DIR}, or set {OVERWRITE}=True to move the old run "
            f"into {run_dir / OLD_RUNS_DIR}/<time>/ (nothing is deleted)."
        )
    return (
        f"{RESUME_PATH}={ckpt} is another run's checkpoint, and {RUN_DIR}={run_dir} "
        f"holds its own run ({listing}): continuing the other run here would write its steps over this run's "
        "checkpoints and mix two runs in one metrics.jsonl. Give the continuation a new or empty "
        f"{RUN_DIR}, resume this folder's own run ({RESUME_MODE}=auto), or set "
        f"{OVERWRITE}=True to move this folder's run into {run_dir / OLD_RUNS_DIR}/<time>/ first."
    )


def open_run_dir(run_dir: Path, cfg: Any, choice: ResumeChoice, manager: Any) -> Attempt:
    """Apply the one-run rule or the resume checks, then record this attempt; returns it.

    Called before any model or data is loaded, so a refusal costs nothing. Everything is checked
    before the first write: a refusal leaves the folder as it was.
    """
    trainer = cfg.trainer
    notes = list(choice.report())
    check_not_in_use(run_dir, "fulcrum train")
    run_dir.mkdir(parents=True, exist_ok=True)
    check_own_files(run_dir)
    # A start that does not continue this folder's own checkpoint is a new run here.
    new_run = choice.path is None or _outside(choice.path, run_dir)
    there = other_run_contents(run_dir) if new_run else []
    if there and not trainer.overwrite_run:
        raise RunDirError(_another_run_message(run_dir, there, choice.path))
    if choice.path is not None:
        notes += _check_resume_config(choice.path, cfg)
    if there:
        notes.append(f"moved the previous run to {move_old_run_aside(run_dir)}")
    mark_run_dir(run_dir, "fulcrum train")
    number = len(read_metrics_rows(run_dir / ATTEMPTS_FILE)) + 1
    config_rel = f"{CONFIGS_DIR}/attempt_{number}.yaml"
    (run_dir / CONFIGS_DIR).mkdir(exist_ok=True)
    for path in (run_dir / config_rel, run_dir / CONFIG_FILE):
        write_whole(path, lambda tmp: save_config(cfg, tmp))
    if choice.path is not None:
        notes += _drop_newer(run_dir, choice.path, manager, number)
    record = {
        "attempt": number,
        "started_unix": time.time(),
        "resumed_from": str(choice.path) if choice.path is not None else None,
        "config": config_rel,
        "metrics_rows_before": len(read_metrics_rows(run_dir / METRICS_FILE)),
    }
    attempts = run_dir / ATTEMPTS_FILE
    before = attempts.read_text() if attempts.is_file() else ""
    write_whole(attempts, lambda tmp: tmp.write_text(before + json.dumps(record) + "\n"))
    return Attempt(number, choice.path, notes)


def _drop_newer(run_dir: Path, ckpt: Path, manager: Any, attempt: int) -> list[str]:
    """Set aside this folder's checkpoints and metrics rows newer than the resumed checkpoint `ckpt`."""
    notes = []
    step = _resume_step(ckpt)
    if not _outside(ckpt, run_dir):
        for moved in manager.set_aside_newer(step):
            notes.append(f"set aside {moved.name}: newer than the checkpoint resumed")
    try:
        dropped = trim_metrics_log(run_dir / METRICS_FILE, step, run_dir / DROPPED_METRICS_FILE, attempt)
    except OSError as err:
        raise RunDirError(
            f"cannot move the rows after {ckpt.name} out of {run_dir / METRICS_FILE}: {err.strerror or err}; "
            "the file is unchanged. Free space and start again."
        ) from err
    if dropped:
        notes.append(
            f"moved {dropped} {METRICS_FILE} row(s) logged after {ckpt.name} to {DROPPED_METRICS_FILE}"
        )
    if _outside(ckpt, run_dir):
        notes.append(f"resuming from {ckpt}, outside this run directory")
    return notes


def _check_resume_config(ckpt: Path, cfg: Any) -> list[str]:
    """Stop when the configuration changed in keys that alter the training; list the harmless changes."""
    saved = read_run_config(ckpt)
    if saved is None:
        return [f"{ckpt.name} does not hold its configuration (an older checkpoint): changes are not checked"]
    blocking, harmless = config_changes(saved, to_dict(cfg))
    # A schedule laid over the run's steps would be bent mid-run (the step restored, the length changed):
    # the warm-up end and the cosine's progress move, so the run's length counts as a training change.
    optims = (ActorConfig.key("optim"), CriticConfig.key("optim"))
    sections = optims if uses_critic(cfg) else optims[:1]
    spans = schedule_spans_run(flatten(to_dict(cfg)), sections)
    if spans:
        fixed = saved.get("trainer", {}).get("total_training_steps") is not None
        keys = (
            RUN_LENGTH_KEYS[:1] if fixed and cfg.trainer.total_training_steps is not None else RUN_LENGTH_KEYS
        )
        length = [line for line in harmless if line.split(":", 1)[0] in keys]
        harmless = [line for line in harmless if line not in length]
        blocking += [
            f"{line} (the learning-rate schedule spans the run's steps: {', '.join(spans)})"
            for line in length
        ]
    notes = [f"resuming with changed key {line}" for line in harmless]
    if blocking and not cfg.trainer.accept_config_changes:
        # one change on the line itself; several listed one a line
        listing = f" {blocking[0]}. " if len(blocking) == 1 else "\n  " + "\n  ".join(blocking) + "\n"
        raise RunDirError(
            f"resuming {ckpt} with a configuration that changes what or how the run trains:{listing}"
            f"Set {ACCEPT_CHANGES}=True to resume with these changes (the data position is kept "
            "in prompts, so no prompt is trained twice or skipped), restore the old values, or start a new "
            f"run in another {RUN_DIR}."
        )
    notes += [f"accepted changed key {line} ({ACCEPT_CHANGES}=True)" for line in blocking]
    return notes
