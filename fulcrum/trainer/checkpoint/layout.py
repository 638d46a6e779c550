"""What a checkpoint folder holds, how its manifest proves its content, and which folders count.

A `global_step_N` folder counts only with its final name and a manifest (`checkpoint.json`, written
last). The manifest lists every file with its size and SHA-256; `verify_checkpoint` re-reads the
files and names each one that is missing, of another size, or of other content.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fulcrum.trainer.checkpoint.atomic import sha256_file

STEP_PREFIX = "global_step_"
LATEST_FILE = "latest_checkpointed_iteration.txt"
MANIFEST = "checkpoint.json"
TRAINER_STATE = "trainer_state.json"
RUN_CONFIG = "run_config.json"  # the resolved configuration the checkpoint was trained under
RNG_STATE = "rng_state.pt"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "lr_scheduler.pt"
FORMAT_NAME = "fulcrum-checkpoint"
# 1: files -> size; 2: files -> {bytes, sha256}. Both are read.
FORMAT_VERSION = 2
HASH_THREADS = 4  # files hashed at once by build_manifest

STEP_DIR = re.compile(rf"^{STEP_PREFIX}(\d+)$")
_TMP_DIR = re.compile(rf"^{STEP_PREFIX}(\d+)\.(?:tmp|old)-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the folder and what to do."""


class DiskFullError(CheckpointError):
    """The disk filled up during a save; the partial folder was removed, earlier checkpoints are intact."""


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step}"


def is_complete(ckpt_dir: Path, roles: list[str] | None = None) -> bool:
    """Complete: the folder has its final name, a manifest, and every asked role's folder."""
    if not STEP_DIR.match(ckpt_dir.name) or not (ckpt_dir / MANIFEST).is_file():
        return False
    return all((ckpt_dir / role).is_dir() for role in roles or [])


def step_folders(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every folder named `global_step_N`, complete or not, oldest first."""
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), child) for child in run_dir.iterdir() if (m := STEP_DIR.match(child.name))]
    return sorted(f for f in found if f[1].is_dir())


def complete_checkpoints(run_dir: Path, roles: list[str] | None = None) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint in `run_dir`, oldest first."""
    return [(step, path) for step, path in step_folders(run_dir) if is_complete(path, roles)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temp_dirs(run_dir: Path) -> list[Path]:
    """Delete `global_step_N.tmp-<pid>` / `.old-<pid>` folders left by a process that no longer runs."""
    removed: list[Path] = []
    if not run_dir.is_dir():
        return removed
    for child in run_dir.iterdir():
        match = _TMP_DIR.match(child.name)
        if match and child.is_dir():
            pid = int(match.group(2))
            if pid != os.getpid() and _pid_alive(pid):
                continue  # another live process is writing there right now
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def build_manifest(folder: Path, step: int, roles: list[str]) -> dict:
    """The manifest of a fully written checkpoint folder: every file's size and SHA-256.

    Hashing re-reads what was just written (from the page cache): about 1 s per GB on one core, so the
    files are hashed on up to `HASH_THREADS` threads at once (hashlib lets go of the GIL while it
    hashes): a PPO checkpoint's four large files (two roles' weights and optimiser states) in about the
    time of the largest.
    """
    paths = [p for p in sorted(folder.rglob("*")) if p.is_file()]
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        digests = list(pool.map(sha256_file, paths))
    files = {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": digest}
        for p, digest in zip(paths, digests, strict=True)
    }
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "global_step": step,
        "roles": roles,
        "files": files,
        "saved_at_unix": time.time(),
    }


def read_manifest(ckpt: Path) -> dict:
    """The checkpoint's manifest; a CheckpointError saying what is wrong when it is missing or unreadable."""
    path = ckpt / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{ckpt}: no {MANIFEST} (its save was interrupted, or the file was removed)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path}: not a fulcrum checkpoint manifest")
    return manifest


def verify_checkpoint(ckpt: Path, roles: list[str], check_hashes: bool = True) -> list[str]:
    """What is wrong with checkpoint `ckpt` for a run training `roles` (empty: intact).

    Checks the top-level files and those of `roles` against the manifest: present, same size and,
    with `check_hashes`, same SHA-256 (version-1 manifests hold sizes only).
    """
    try:
        manifest = read_manifest(ckpt)
    except CheckpointError as exc:
        return [str(exc)]
    problems = [f"{ckpt}: has no {role}/ folder" for role in roles if not (ckpt / role).is_dir()]
    for rel, entry in manifest.get("files", {}).items():
        if "/" in rel and rel.split("/")[0] not in roles:
            continue  # a role this run does not load (e.g. a critic, resumed by GRPO)
        size, digest = (entry, None) if isinstance(entry, int) else (entry["bytes"], entry.get("sha256"))
        file = ckpt / rel
        if not file.is_file():
            problems.append(f"{file}: missing")
        elif file.stat().st_size != size:
            problems.append(f"{file}: {file.stat().st_size} bytes, the manifest says {size} (truncated?)")
        elif check_hashes and digest is not None and sha256_file(file) != digest:
            problems.append(f"{file}: content differs from the manifest's SHA-256 (the file was changed)")
    return problems


def read_latest_step(run_dir: str | os.PathLike) -> int | None:
    """The step recorded in `latest_checkpointed_iteration.txt` (verl's file), or None."""
    path = Path(run_dir) / LATEST_FILE
    if not path.is_file():
        return None
    text = path.read_text().strip()
    return int(text) if text.isdigit() else None
