"""One process per run directory: `fulcrum.lock`, held with the operating system's file lock.

The lock is `flock(LOCK_EX | LOCK_NB)` on `<run dir>/fulcrum.lock`, which holds the holder's PID,
host, command and start time (quoted by the refusal). The kernel releases it when the holder's
process ends in any way (exit, exception, kill -9), so a dead holder never blocks the folder: the
file it leaves is taken over by the next run. A holder that ends normally removes the file. Under torchrun only rank 0 takes it. When `fulcrum train` starts the
processes itself (fulcrum.trainer.launch), the launcher takes it and its children find it held by
their launcher (`FULCRUM_RUN_LOCK_OWNER`), which counts as held by them.

A lock is held until `release` or the end of the process; taking it again in the same process is a
no-op (a resume in the same process, the trainer opening the directory after `train` took it).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

LOCK_FILE = "fulcrum.lock"
OWNER_ENV = "FULCRUM_RUN_LOCK_OWNER"  # "<pid>@<host>" of the launcher holding the lock for its children


class RunDirBusyError(RuntimeError):
    """Another live process holds the run directory's lock; the message names it."""


@dataclass
class Holder:
    """Who holds (or last held) a lock, as written in the lock file."""

    pid: int | None
    host: str
    command: str
    started_unix: float | None

    @classmethod
    def read(cls, path: Path) -> Holder:
        """The holder recorded in `path`; fields unknown when the file is empty (the holder has not
        written them yet) or not ours."""
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            record = {}
        if not isinstance(record, dict):
            record = {}
        pid = record.get("pid")
        started = record.get("started_unix")
        return cls(
            pid if isinstance(pid, int) else None,
            str(record.get("host", "?")),
            str(record.get("command", "?")),
            float(started) if isinstance(started, int | float) else None,
        )

    def describe(self) -> str:
        since = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started_unix))
            if self.started_unix
            else "?"
        )
        return f"pid {self.pid if self.pid is not None else '?'} on host {self.host} ({self.command}, since {since})"


def owner_tag(pid: int | None = None) -> str:
    """`<pid>@<host>`: how a launcher names itself to its children."""
    return f"{os.getpid() if pid is None else pid}@{socket.gethostname()}"


_HELD: dict[Path, int | None] = {}  # resolved run dir -> lock file descriptor (None: held by our launcher)


def _key(run_dir: Path) -> Path:
    return Path(run_dir).expanduser().resolve()


def acquire(run_dir: Path, command: str) -> None:
    """Take `run_dir`'s lock for this process (creating the folder), or raise RunDirBusyError naming
    the process that holds it. A no-op when this process, or the launcher that started it, holds it."""
    key = _key(run_dir)
    if key in _HELD:
        return
    key.mkdir(parents=True, exist_ok=True)
    path = key / LOCK_FILE
    fd = _lock_file(path)
    if fd is None:
        holder = _recorded_holder(path)
        if holder.pid is not None and f"{holder.pid}@{holder.host}" == os.environ.get(OWNER_ENV):
            _HELD[key] = None  # our launcher holds it for its group
            return
        raise RunDirBusyError(
            f"trainer.default_local_dir={key} is in use by another fulcrum process: {holder.describe()} "
            f"holds {path}. One run directory holds one run: wait for that process to end (or stop it), "
            "or pick another trainer.default_local_dir."
        )
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": command,
        "started_unix": time.time(),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    _HELD[key] = fd


def _recorded_holder(path: Path, wait_s: float = 2.0) -> Holder:
    """The holder of the lock on `path`, waiting up to `wait_s` for it to write its record: it takes the
    lock first and writes second, so a process started at the same moment can find the file empty."""
    deadline = time.monotonic() + wait_s
    holder = Holder.read(path)
    while holder.pid is None and time.monotonic() < deadline:
        time.sleep(0.02)
        holder = Holder.read(path)
    return holder


def _lock_file(path: Path) -> int | None:
    """An open descriptor of `path` holding its flock, or None when another process holds it.

    A holder removes the file when it releases it, so a descriptor opened just before may lock a file
    that is no longer in the folder: locking is retried until the locked file is the one at `path`.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def release(run_dir: Path) -> None:
    """Give `run_dir`'s lock back and remove its file (a no-op when this process does not hold it)."""
    key = _key(run_dir)
    fd = _HELD.pop(key, None)
    if fd is not None:
        (key / LOCK_FILE).unlink(missing_ok=True)  # while still locked: see _lock_file
        os.close(fd)  # closing the only descriptor releases the flock


def holds(run_dir: Path) -> bool:
    """Whether this process (or its launcher, for it) holds `run_dir`'s lock."""
    return _key(run_dir) in _HELD
