"""Which files in a run directory are fulcrum's, and how they are written.

fulcrum writes a fixed set of names in a run directory (WRITTEN_NAMES, `global_step_N`). Whether the
files of those names are its own is told by `fulcrum_run.json`, written when a run first opens the
folder (or, for runs older than the marker, by a fulcrum checkpoint or fulcrum's own record of
attempts or metrics). A folder holding such names without that proof is refused, naming them; names
fulcrum never writes are the user's and are never touched. Every file is written whole or not at all
(`write_whole`), and a failed write names its path.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fulcrum.trainer import run_lock
from fulcrum.trainer.checkpoint import LATEST_FILE, STEP_PREFIX, CheckpointError, step_folders
from fulcrum.trainer.checkpoint.atomic import write_file_atomic
from fulcrum.trainer.checkpoint.layout import read_manifest

METRICS_FILE = "metrics.jsonl"
DROPPED_METRICS_FILE = "metrics.dropped.jsonl"
ATTEMPTS_FILE = "attempts.jsonl"
CONFIG_FILE = "config.yaml"
CONFIGS_DIR = "configs"
OLD_RUNS_DIR = "old_runs"
RUN_MARKER = "fulcrum_run.json"  # written when a run first opens the folder: the names below are fulcrum's
MARKER_FORMAT = "fulcrum-run"

# The names `fulcrum train` and `fulcrum sft` write directly in a run directory (with `global_step_N`
# and its temporary and set-aside forms): without the marker, one of them present is not fulcrum's.
WRITTEN_NAMES = frozenset(
    {CONFIG_FILE, CONFIGS_DIR, METRICS_FILE, DROPPED_METRICS_FILE, ATTEMPTS_FILE, LATEST_FILE, OLD_RUNS_DIR}
    | {"tensorboard"}
)
# Everything fulcrum puts in a run directory: the above, the marker and the lock, `fulcrum report`'s
# default output and the built-in demo's work folder. Anything else is the user's.
OWN_NAMES = WRITTEN_NAMES | {RUN_MARKER, run_lock.LOCK_FILE, "report.html", "demo"}
TEMP_SUFFIX = re.compile(r"\.(tmp|old)-\d+$")  # a file or checkpoint being written (atomic.temp_beside)
LISTED_NAMES = 12  # a refusal lists this many names, then how many more


class RunDirError(RuntimeError):
    """The run directory holds another run, or a resume would change the run; the message says what to do."""


# ------------------------------------------------------------------------------------ metrics.jsonl
def row_step(row: dict[str, Any]) -> float | None:
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


# ------------------------------------------------------------------------------- what is fulcrum's
def is_own_name(name: str) -> bool:
    """Whether fulcrum writes an entry of this name in a run directory (its temporary forms included)."""
    name = TEMP_SUFFIX.sub("", name)
    return (
        name in OWN_NAMES
        or name.startswith(STEP_PREFIX)  # global_step_N and global_step_N.set-aside-<time>
        or (name.startswith(f".{STEP_PREFIX}") and name.endswith(".partial"))  # fulcrum sft's save
    )


def _is_written_name(name: str) -> bool:
    name = TEMP_SUFFIX.sub("", name)
    return name in WRITTEN_NAMES or name.startswith(STEP_PREFIX) or name.startswith(f".{STEP_PREFIX}")


def _jsonl_objects_with(path: Path, key: str) -> bool:
    """Whether `path` holds at least one line and every readable line is a JSON object with `key`."""
    rows = [r for r in read_metrics_rows(path) if r is not None]
    return bool(rows) and all(isinstance(r, dict) and key in r for r in rows)


def _has_fulcrum_checkpoint(run_dir: Path) -> bool:
    for _, path in step_folders(run_dir):
        try:
            read_manifest(path)
        except CheckpointError:
            continue
        return True
    return False


def made_by_fulcrum(run_dir: Path) -> bool:
    """Whether a fulcrum run wrote this folder: it holds the marker or, for runs of versions before the
    marker, a fulcrum checkpoint, fulcrum's record of attempts or metrics rows as fulcrum logs them."""
    try:
        marker = json.loads((run_dir / RUN_MARKER).read_text())
    except (OSError, ValueError):
        marker = None
    if isinstance(marker, dict) and marker.get("format") == MARKER_FORMAT:
        return True
    return (
        _has_fulcrum_checkpoint(run_dir)
        or _jsonl_objects_with(run_dir / ATTEMPTS_FILE, "attempt")
        or _jsonl_objects_with(run_dir / METRICS_FILE, "step")
    )


def run_dir_entries(run_dir: Path) -> list[str]:
    """The names directly in `run_dir`, sorted (none when it is not a folder)."""
    return sorted(child.name for child in run_dir.iterdir()) if run_dir.is_dir() else []


def unowned_entries(run_dir: Path) -> list[str]:
    """Entries fulcrum would write to but did not create: names it writes, in a folder it never marked."""
    written = [name for name in run_dir_entries(run_dir) if _is_written_name(name)]
    return [] if not written or made_by_fulcrum(run_dir) else written


def foreign_entries(run_dir: Path) -> list[str]:
    """Entries of names fulcrum never writes (a README, a data or model folder)."""
    return [name for name in run_dir_entries(run_dir) if not is_own_name(name)]


def name_list(names: list[str]) -> str:
    """`a, b, c` (at most LISTED_NAMES, then how many more)."""
    shown = ", ".join(names[:LISTED_NAMES])
    return shown + (f" and {len(names) - LISTED_NAMES} more" if len(names) > LISTED_NAMES else "")


def check_own_files(run_dir: Path) -> None:
    """Stop when the folder holds files under fulcrum's names that fulcrum did not write."""
    unowned = unowned_entries(run_dir)
    if unowned:
        raise RunDirError(
            f"trainer.default_local_dir={run_dir} holds {name_list(unowned)}, which fulcrum did not write (no "
            f"{RUN_MARKER}, no fulcrum checkpoint). A run writes files of these names; fulcrum never writes over "
            "files that are not its own. Move them out, or pick another trainer.default_local_dir."
        )


def mark_run_dir(run_dir: Path, command: str) -> None:
    """Write the marker once: from now on the folder's fulcrum-named files are fulcrum's."""
    marker = run_dir / RUN_MARKER
    if not marker.is_file():
        record = {"format": MARKER_FORMAT, "version": 1, "created_by": command, "created_unix": time.time()}
        write_whole(marker, lambda tmp: tmp.write_text(json.dumps(record, indent=2) + "\n"))


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """`atomic.write_file_atomic`, with a failure (a full disk, a read-only folder) as a RunDirError
    that names the path: nothing partial is left and the old file is unchanged."""
    try:
        write_file_atomic(path, write)
    except OSError as err:
        reason = err.strerror or str(err)
        raise RunDirError(
            f"cannot write {path}: {reason}; nothing was changed in it and no partial file is left. "
            "Free space (or fix the folder's permissions) and start again."
        ) from err
