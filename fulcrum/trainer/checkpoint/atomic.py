"""Files that are either whole or absent: fsync, atomic replace, streamed content hashes.

A checkpoint (and an export) is written into a temporary folder, every file fsync'ed, and renamed
into place; small files such as `latest_checkpointed_iteration.txt` are written beside their target
and `os.replace`d over it. After a crash a reader finds the old version or the new one, never half.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

HASH_CHUNK_BYTES = 8 * 2**20  # large reads: hashing runs at the speed of sha256, not of Python calls


def fsync_dir(path: Path) -> None:
    """fsync a folder, so that a rename inside it survives a power loss (where the file system allows)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return  # some file systems do not open folders; nothing more we can do
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under `root` (so the rename publishes data that is really on disk)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def temp_beside(path: Path) -> Path:
    """The temporary name `path` is written under before it is renamed into place (`<name>.tmp-<pid>`)."""
    return path.with_name(f"{path.name}.tmp-{os.getpid()}")


def write_file_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Make `path` whole or leave it as it was: `write(tmp)` fills a file beside it, which is fsync'ed
    and renamed over `path`. On any failure (a full disk, an interrupt) the temporary file is removed
    and the error raised again, so no partial file is ever left under either name."""
    tmp = temp_beside(path)
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text`, whole or not at all (`write_file_atomic`)."""
    write_file_atomic(path, lambda tmp: tmp.write_text(text))


def sha256_file(path: Path) -> str:
    """The file's SHA-256 as hex, read in 8 MiB chunks (memory stays flat for multi-GB weight files)."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
