"""Run a piece of Python in a separate process with limits, and say how it ended.

Each call gets its own temporary directory: `work/` (the process's working directory, `HOME` and
`TMPDIR`), beside it the code, the stdout and stderr files and a status file the child reports on. The
whole directory is removed after the call. The process runs `python -I -B -u sandbox_child.py` (see that
module for the limits and the audit hook it installs before the code runs), in a session of its own, with
a minimal environment (no variable of the trainer's, so no token or key), stdin from /dev/null, and,
where the system allows it, in a network namespace of its own (`unshare -n`: no interface but a down
loopback). Whether the namespace is available is detected once per process.

Limits: wall-clock `timeout_s` (then the whole process group is killed), CPU seconds (the kernel's
RLIMIT_CPU), address space (RLIMIT_AS), the size of any file written (RLIMIT_FSIZE; stdout and stderr
are files, so a program that prints megabytes stops at that size instead of filling a pipe or the
trainer's memory), and only the first `max_output_bytes` of each stream are read back.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from fulcrum.agent import sandbox_child

log = logging.getLogger("fulcrum.agent")

CHILD_SCRIPT = Path(sandbox_child.__file__)
STATUS_LIMIT_BYTES = 64 * 1024
_KILLED_BY_CPU_LIMIT = (-signal.SIGXCPU, -signal.SIGKILL)  # soft limit, then the hard one


@dataclass(frozen=True)
class SandboxLimits:
    """What one call may use. `cpu_s` None follows `timeout_s` (rounded up to whole seconds)."""

    timeout_s: float = 30.0
    memory_mb: int = 1024
    max_output_bytes: int = 16 * 1024
    max_file_bytes: int = 16 * 1024 * 1024
    cpu_s: int | None = None
    python: str = sys.executable

    def __post_init__(self) -> None:
        for key in ("timeout_s", "memory_mb", "max_output_bytes", "max_file_bytes"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"sandbox {key} must be a positive number, got {value!r}")
        if self.max_file_bytes <= self.max_output_bytes:
            raise ValueError(
                f"sandbox max_file_bytes ({self.max_file_bytes}) must exceed max_output_bytes "
                f"({self.max_output_bytes}): a longer output is how truncation is seen"
            )

    @property
    def cpu_seconds(self) -> int:
        """The CPU-time limit in whole seconds."""
        return self.cpu_s if self.cpu_s is not None else max(1, math.ceil(self.timeout_s))


@dataclass
class SandboxResult:
    """How a call ended: its output (each stream cut at the limit), the failures, what was refused."""

    stdout: str
    stderr: str
    returncode: int | None
    kinds: set[str] = field(default_factory=set)
    refusals: list[str] = field(default_factory=list)
    pgid: int = 0
    duration_s: float = 0.0
    limits: SandboxLimits = field(default_factory=SandboxLimits)

    def text(self) -> str:
        """What the model reads: stdout then stderr (as Sandbox Fusion returns them), then one bracketed
        line per failure."""
        notes = []
        if "timeout" in self.kinds:
            notes.append(f"[timed out: the process was killed after {self.limits.timeout_s:g} s]")
        if "memory" in self.kinds:
            notes.append(f"[memory limit of {self.limits.memory_mb} MB reached]")
        if "output_truncated" in self.kinds:
            notes.append(
                f"[output truncated to the first {self.limits.max_output_bytes} bytes of each stream]"
            )
        if self.refusals and "refused" in self.kinds:
            shown = "; ".join(self.refusals[:3])
            notes.append(f"[refused by the sandbox: {shown}]")
        out = self.stdout + self.stderr
        if notes:
            out = (out + ("\n" if out and not out.endswith("\n") else "")) + "\n".join(notes)
        return out


@functools.lru_cache(maxsize=1)
def network_namespace_prefix() -> tuple[str, ...]:
    """The `unshare` command line that gives a process no network, or () when this system refuses it.

    Root can make a network namespace directly; another user needs a user namespace too (`-r`), which
    some kernels and containers forbid. Tried once per process.
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    for flags in (("-n",), ("-r", "-n")):
        try:
            done = subprocess.run(
                [unshare, *flags, "true"],
                capture_output=True,
                timeout=10,
                check=False,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            return (unshare, *flags, "--")
    return ()


def describe_isolation() -> str:
    """One line on how the network is cut off here."""
    prefix = network_namespace_prefix()
    if prefix:
        return f"network: none (a network namespace, `{' '.join(prefix[:-1])}`, and the audit hook)"
    return "network: this system allows no network namespace; only the audit hook refuses sockets"


def child_environment(work: Path) -> dict[str, str]:
    """A minimal environment: nothing of the trainer's (tokens, keys), one thread per numeric library
    (a BLAS pool reserves address space per thread and would hit the memory limit at import)."""
    single = "1"
    return {
        "PATH": os.defpath,
        "HOME": str(work),
        "TMPDIR": str(work),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": single,
        "OPENBLAS_NUM_THREADS": single,
        "MKL_NUM_THREADS": single,
    }


def read_head(path: Path, limit: int) -> tuple[str, bool]:
    """The first `limit` bytes of a file as text, and whether the file was longer."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(limit)
    except FileNotFoundError:
        return "", False
    return head.decode("utf-8", errors="replace"), size > limit


def classify(
    returncode: int | None, timed_out: bool, status_lines: list[str], truncated: bool
) -> tuple[set[str], list[str]]:
    """The failure kinds of a finished call and the operations it was refused (see fulcrum.agent.metrics)."""
    refusals = [line[len("refused ") :] for line in status_lines if line.startswith("refused ")]
    exits = [line[len("exit ") :] for line in status_lines if line.startswith("exit ")]
    ending = exits[-1] if exits else None
    kinds: set[str] = set()
    if timed_out or (ending is None and returncode in _KILLED_BY_CPU_LIMIT):
        kinds.add("timeout")
    elif ending == "memory":
        kinds.add("memory")
    elif ending == "exception":
        kinds.add("exception")
    elif ending is None and returncode not in (0, None):
        kinds.add("exception")  # died before reporting: a crash in a C extension, or at start-up
    if refusals or ending == "refused":
        kinds.add("refused")
    if truncated:
        kinds.add("output_truncated")
    return kinds, refusals


def kill_group(pgid: int) -> None:
    """SIGKILL to the whole process group; nothing if it is already gone."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def run_python(code: str, limits: SandboxLimits) -> SandboxResult:
    """Run `code` in a fresh sandboxed process; never raises for anything the code does."""
    root = Path(tempfile.mkdtemp(prefix="fulcrum-tool-"))
    try:
        return await _run_in(root, code, limits)
    finally:
        await asyncio.to_thread(shutil.rmtree, root, True)


async def _run_in(root: Path, code: str, limits: SandboxLimits) -> SandboxResult:
    """The call itself, inside the temporary directory `root`."""
    work = root / "work"
    work.mkdir()
    code_file = root / "code.py"
    code_file.write_text(code, encoding="utf-8")
    settings: dict[str, object] = {
        "memory_bytes": limits.memory_mb * 1024 * 1024,
        "cpu_s": limits.cpu_seconds,
        "file_bytes": limits.max_file_bytes,
        "code_file": str(code_file),
    }
    started = time.monotonic()
    with (
        open(root / "stdout", "wb") as out,
        open(root / "stderr", "wb") as err,
        open(root / "status", "wb") as status,
    ):
        # pass_fds keeps the descriptor's number, so the child is told which one to write to.
        settings["status_fd"] = status.fileno()
        argv = [
            *network_namespace_prefix(),
            limits.python,
            "-I",
            "-B",
            "-u",
            str(CHILD_SCRIPT),
            json.dumps(settings),
        ]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            cwd=work,
            env=child_environment(work),
            start_new_session=True,
            pass_fds=(status.fileno(),),
        )
    timed_out = False
    try:
        await asyncio.wait_for(proc.wait(), timeout=limits.timeout_s)
    except asyncio.TimeoutError:
        timed_out = True
    finally:
        # Still running (timed out, or the caller was cancelled): the whole group goes. A process that
        # exited is left alone, since its id may already belong to someone else.
        if proc.returncode is None:
            kill_group(proc.pid)
            await proc.wait()
    stdout, out_long = read_head(root / "stdout", limits.max_output_bytes)
    stderr, err_long = read_head(root / "stderr", limits.max_output_bytes)
    # The code can write to the status descriptor too; a bounded read keeps that harmless.
    status_text, _ = read_head(root / "status", STATUS_LIMIT_BYTES)
    status_lines = status_text.splitlines()
    kinds, refusals = classify(proc.returncode, timed_out, status_lines, out_long or err_long)
    return SandboxResult(
        stdout=stdout,
        stderr=stderr,
        returncode=proc.returncode,
        kinds=kinds,
        refusals=refusals,
        pgid=proc.pid,
        duration_s=time.monotonic() - started,
        limits=limits,
    )
