"""What belongs to a run: the files no tool may write over, even when told to (`--force`).

A run directory's own files (metrics, attempts, configurations, checkpoints, earlier runs set aside)
and the run's inputs and outputs named in its configuration (data files, model folders, reward
function, generation dumps) are the run's. `fulcrum report --out` refuses them, with or without
`--force`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fulcrum.config.keys import flatten
from fulcrum.trainer.checkpoint import STEP_PREFIX
from fulcrum.trainer.run_lock import LOCK_FILE
from fulcrum.trainer.run_ownership import RUN_MARKER, WRITTEN_NAMES

# Names directly in a run directory that the run wrote (its report.html aside): the trainer's own list.
RUN_DIR_NAMES = WRITTEN_NAMES | {RUN_MARKER, LOCK_FILE}
# Configuration keys naming a file or folder the run read or wrote, by the end of their name. The run
# directory itself (default_local_dir) is left out: the run's report lives there.
PATH_KEY_ENDINGS = ("path", "_files", "tokenizer", "_dir")
NOT_INPUTS = {"trainer.default_local_dir"}


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def config_paths(config: dict[str, Any]) -> dict[str, Path]:
    """{key: resolved path} for every key of `config` (a run's config.yaml) that names a file or folder."""
    found: dict[str, Path] = {}
    for key, value in flatten(config).items():
        if key in NOT_INPUTS or not key.rsplit(".", 1)[-1].endswith(PATH_KEY_ENDINGS):
            continue
        values = value if isinstance(value, list) else [value]
        for index, item in enumerate(values):
            if isinstance(item, str) and item.strip():
                name = key if len(values) == 1 else f"{key}[{index}]"
                found[name] = Path(os.path.expanduser(item)).resolve()
    return found


def run_own_path(path: Path, run_dir: Path, config: dict[str, Any]) -> str | None:
    """What `path` is to the run in `run_dir` (configuration `config`) when it is the run's own: its
    metrics, configurations, checkpoints, or an input or output its configuration names; else None."""
    target, run = path.resolve(), run_dir.resolve()
    if run in target.parents:
        top = target.relative_to(run).parts[0]
        if top in RUN_DIR_NAMES:
            return f"the run's own {top}"
        if top.startswith(STEP_PREFIX):
            return f"checkpoint {top} of the run"
    for key, named in config_paths(config).items():
        # A named folder holding the run directory (say ".") would make the whole run directory an
        # input, the report included; only what lies outside the run is taken as its input.
        if _inside(target, named) and not _inside(run, named):
            return f"the run's {key} ({named})"
    return None
