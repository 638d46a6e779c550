"""Run model-written code in a jail the kernel enforces, and say how it ended.

    result = await run_jailed("print(6 * 7)", limits=JailLimits(timeout_s=5))        # Python code
    result = run_jailed_sync(["python3", "sol.py"], files={"sol.py": src}, stdin="3 4\\n")  # a program

Each call gets fresh namespaces from bubblewrap (fulcrum.sandbox.command): user, PID, network (only a
loopback of its own), mount, IPC and UTS; it runs as an unprivileged user (uid 1000 inside, never root,
no capabilities) with no further user namespaces and a seccomp filter (fulcrum.sandbox.seccomp_filter).
It sees /usr, the Python installation and a few files of /etc read-only, a fresh /proc that shows only
its own processes, a minimal /dev, and one writable place: a tmpfs of `disk_mb` at /tmp (its working
directory, HOME and TMPDIR; /dev/shm has the same cap). Nothing of the trainer's reaches it: no
environment variable, no file, no descriptor but its stdin, stdout, stderr and (Python) status pipe.

Limits: wall clock `timeout_s` (then the PID namespace's init is killed, which kills every process of
the call, `setsid` or not); per process, CPU seconds, address space and file size; processes and threads
(RLIMIT_NPROC, counted in the call's own user namespace). When the call's main process exits, every other
process of the call is killed with it. stdout and stderr go to memory files (at most `max_file_bytes`
each); the first `max_output_bytes` of each are read back.

Where no jail can be built, `jail_problem()` says why in one line and `run_jailed` raises
JailUnavailable; `unjailed=True` runs the same command with the same limits in a plain subprocess (no
isolation at all: only for code the user trusts).
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from fulcrum.sandbox import command, python_child, seccomp_filter

STATUS_LIMIT_BYTES = 4096
KILL_WAIT_S = 5.0  # after SIGKILL to the namespace's init, how long its teardown may take
PROBE_TIMEOUT_S = 20.0
HOW_TO_ALLOW = (
    "install bubblewrap (apt-get install bubblewrap) and allow unprivileged user namespaces "
    "(docs/multi-turn.md, 'The jail'), or set the tool config's `sandbox: unjailed` to run model code "
    "without isolation"
)


class JailUnavailable(RuntimeError):
    """No jail can be built on this machine; the message says why and how to allow one."""


@dataclass(frozen=True)
class JailLimits:
    """What one call may use. `cpu_s` None follows `timeout_s` (rounded up to whole seconds)."""

    timeout_s: float = 30.0
    memory_mb: int = 1024
    cpu_s: int | None = None
    max_processes: int = 64
    max_file_bytes: int = 16 * 1024 * 1024
    disk_mb: int = 64
    max_output_bytes: int = 16 * 1024

    def __post_init__(self) -> None:
        for key in (
            "timeout_s",
            "memory_mb",
            "max_processes",
            "max_file_bytes",
            "disk_mb",
            "max_output_bytes",
        ):
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
class JailResult:
    """How a call ended. `exit_code` is the program's status (None when it was killed by a signal, then
    `signal` names it, as a shell reads a status above 128); `timed_out` covers the wall clock and the CPU
    limit; `ending` (Python code only) is `ok`, `memory`, `exception` or a SystemExit's code."""

    stdout: str
    stderr: str
    exit_code: int | None
    signal: int | None = None
    timed_out: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_s: float = 0.0
    jailed: bool = True
    ending: str | None = None
    limits: JailLimits = field(default_factory=JailLimits)


def memory_file(name: str, content: bytes = b"") -> int:
    """A descriptor of an anonymous in-memory file holding `content`, positioned at its start."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    if content:
        os.write(fd, content)
        os.lseek(fd, 0, os.SEEK_SET)
    return fd


def read_head(fd: int, limit: int) -> tuple[str, bool]:
    """The first `limit` bytes of a descriptor's file as text, and whether it was longer."""
    size = os.fstat(fd).st_size
    return os.pread(fd, limit, 0).decode("utf-8", errors="replace"), size > limit


def checked_names(files: Mapping[str, str | bytes]) -> dict[str, bytes]:
    """`files` with every name a plain relative path (no `..`, not absolute) and content as bytes."""
    out = {}
    for name, content in files.items():
        parts = PurePosixPath(name).parts
        if not name or name.startswith("/") or ".." in parts or "\0" in name:
            raise ValueError(f"sandbox files: {name!r} must be a relative path inside the call's folder")
        out[str(PurePosixPath(*parts))] = content.encode() if isinstance(content, str) else bytes(content)
    return out


def environment(home: str) -> dict[str, str]:
    """A minimal environment: nothing of the trainer's; one thread per numeric library (a BLAS pool
    reserves address space per thread and would hit the memory limit at import)."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": home,
        "USER": "sandbox",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


class Launch:
    """One call's command line and descriptors, built before the process starts and closed after."""

    def __init__(
        self,
        program: str | Sequence[str],
        files: Mapping[str, str | bytes],
        stdin: str | bytes | None,
        limits: JailLimits,
        unjailed: bool,
    ) -> None:
        self.limits = limits
        self.jailed = not unjailed
        self.python = isinstance(program, str)
        self.fds: list[int] = []
        self.workdir: Path | None = None
        data = checked_names(files)
        stdin_bytes = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        self.stdin = self.own(memory_file("stdin", stdin_bytes))
        self.stdout = self.own(memory_file("stdout"))
        self.stderr = self.own(memory_file("stderr"))
        self.status = self.own(memory_file("status"))
        self.info, self.init_fd = b"", None
        self.info_r, self.info_w = os.pipe()
        self.fds += [self.info_r, self.info_w]
        os.set_blocking(self.info_r, False)
        try:
            self.argv, self.env, self.cwd = (
                self.jail_command(program, data) if self.jailed else self.plain_command(program, data)
            )
        except BaseException:
            self.close()
            raise
        streams = (self.stdin, self.stdout, self.stderr, self.info_r)
        self.pass_fds = tuple(fd for fd in self.fds if fd not in streams)

    def own(self, fd: int) -> int:
        self.fds.append(fd)
        return fd

    def python_argv(self, child: str, code_file: str) -> list[str]:
        return [sys.executable, "-I", "-B", "-u", child, code_file, str(self.status)]

    def jail_command(
        self, program: str | Sequence[str], data: dict[str, bytes]
    ) -> tuple[list[str], dict[str, str], str | None]:
        h = command.host()
        missing = h.missing()
        if missing:
            raise JailUnavailable(f"no jail for model-written code: {missing}; {HOW_TO_ALLOW}")
        assert h.prlimit is not None
        ro: dict[str, tuple[int, str]] = {
            "/etc/passwd": (self.own(memory_file("passwd", command.PASSWD.encode())), "0644"),
            "/etc/group": (self.own(memory_file("group", command.GROUP.encode())), "0644"),
        }
        if isinstance(program, str):
            child, code = f"{command.CODE_DIR}/runner.py", f"{command.CODE_DIR}/code.py"
            ro[child] = (self.own(memory_file("runner", runner_source())), "0444")
            ro[code] = (self.own(memory_file("code", program.encode())), "0444")
            argv = self.python_argv(child, code)
        else:
            argv = list(program)
        files = {name: self.own(memory_file("file", content)) for name, content in data.items()}
        seccomp = seccomp_filter.filter_bytes()
        seccomp_fd = self.own(memory_file("seccomp", seccomp)) if seccomp else None
        lim = self.limits
        view = command.view_args(h, lim.disk_mb * 1024 * 1024, ro, files)
        limits = command.limit_args(
            h.prlimit, lim.memory_mb * 1024 * 1024, lim.cpu_seconds, lim.max_file_bytes, lim.max_processes
        )
        env = environment(command.WORK)
        full = command.jail_argv(h, view, limits, argv, env, seccomp_fd, self.info_w)
        return full, env, None

    def plain_command(
        self, program: str | Sequence[str], data: dict[str, bytes]
    ) -> tuple[list[str], dict[str, str], str | None]:
        """Unjailed: the same limits (but processes, which the kernel would count over the trainer's
        whole user) in a plain subprocess whose working directory is a fresh temporary folder."""
        self.workdir = Path(tempfile.mkdtemp(prefix="fulcrum-unjailed-"))
        for name, content in data.items():
            target = self.workdir / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        prlimit = command.host().prlimit
        lim = self.limits
        limits = (
            command.limit_args(
                prlimit, lim.memory_mb * 1024 * 1024, lim.cpu_seconds, lim.max_file_bytes, None
            )
            if prlimit
            else []
        )
        if isinstance(program, str):
            code_file = self.workdir / ".code.py"
            code_file.write_text(program, encoding="utf-8")
            argv = self.python_argv(python_child.__file__, str(code_file))
        else:
            argv = list(program)
        return [*limits, *argv], environment(str(self.workdir)), str(self.workdir)

    def popen_kwargs(self) -> dict[str, object]:
        return dict(
            stdin=self.stdin,
            stdout=self.stdout,
            stderr=self.stderr,
            env=self.env,
            cwd=self.cwd,
            pass_fds=self.pass_fds,
            start_new_session=True,
        )

    def started(self) -> None:
        """The child holds its own copy of the info pipe's writing end; ours goes, so EOF can be seen."""
        os.close(self.info_w)
        self.fds.remove(self.info_w)

    def info_arrived(self) -> bool:
        """Read what bwrap wrote on the info pipe; True once it is complete (or the pipe closed). On the
        way, a pidfd of the PID namespace's init is kept: killing it ends every process of the call."""
        try:
            chunk = os.read(self.info_r, 65536)
        except BlockingIOError:
            return False
        self.info += chunk
        try:
            pid = int(json.loads(self.info.decode())["child-pid"])
        except (ValueError, KeyError, TypeError):
            return not chunk
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return True  # already gone, and with it the namespace
        # The pid was read while bwrap held it; the check rules out a reused number all the same.
        if namespace_init(pid):
            self.init_fd = self.own(fd)
        else:
            os.close(fd)
        return True

    def end(self, pid: int) -> None:
        """SIGKILL to the call: to its PID namespace's init (the kernel then kills every process of the
        namespace, setsid or not) and to the launcher's process group."""
        if self.init_fd is not None:
            try:
                signal.pidfd_send_signal(self.init_fd, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def result(self, returncode: int | None, timed_out: bool, duration_s: float) -> JailResult:
        lim = self.limits
        stdout, out_long = read_head(self.stdout, lim.max_output_bytes)
        stderr, err_long = read_head(self.stderr, lim.max_output_bytes)
        status_text, _ = read_head(self.status, STATUS_LIMIT_BYTES)
        endings = [line[len("exit ") :] for line in status_text.splitlines() if line.startswith("exit ")]
        code, sig = returncode, None
        if returncode is not None and returncode < 0:
            code, sig = None, -returncode
        elif returncode is not None and returncode > 128 and self.jailed:
            code, sig = None, returncode - 128  # bwrap reports a signal as a shell does
        cpu = sig in (signal.SIGXCPU, signal.SIGKILL) and not endings
        return JailResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=None if timed_out else code,
            signal=signal.SIGKILL if timed_out else sig,
            timed_out=timed_out or cpu,
            stdout_truncated=out_long,
            stderr_truncated=err_long,
            duration_s=duration_s,
            jailed=self.jailed,
            ending=endings[-1] if endings else None,
            limits=lim,
        )

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def namespace_init(pid: int) -> bool:
    """Whether host process `pid` is the init (pid 1) of a PID namespace below this one."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            ids = line.split()[1:]
            return len(ids) > 1 and ids[-1] == "1"
    return False


@functools.lru_cache(maxsize=1)
def runner_source() -> bytes:
    """The in-jail runner of Python code (fulcrum.sandbox.python_child), as a file's content."""
    return Path(python_child.__file__).read_bytes()


async def run_jailed(
    program: str | Sequence[str],
    files: Mapping[str, str | bytes] | None = None,
    limits: JailLimits | None = None,
    *,
    stdin: str | bytes | None = None,
    unjailed: bool = False,
) -> JailResult:
    """Run `program` (Python source as a str, or an argv list) in a fresh jail; never raises for what the
    program does. `files` are copied into its working folder first. JailUnavailable where no jail can be
    built (and `unjailed` is False)."""
    limits = limits or JailLimits()
    launch = Launch(program, files or {}, stdin, limits, unjailed)
    try:
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(*launch.argv, **launch.popen_kwargs())  # type: ignore[arg-type]
        launch.started()
        timed_out = False
        try:
            await asyncio.wait_for(running(launch, proc), timeout=limits.timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            # Always: the main process may be gone while others of the call live on (setsid or not).
            launch.end(proc.pid)
            await readable(launch.init_fd, KILL_WAIT_S)
            await proc.wait()
        return launch.result(proc.returncode, timed_out, time.monotonic() - started)
    finally:
        launch.close()


async def running(launch: Launch, proc: asyncio.subprocess.Process) -> None:
    """Until the call's main process exits, having read bwrap's info on the way."""
    if launch.jailed:
        loop = asyncio.get_running_loop()
        arrived = loop.create_future()

        def on_info() -> None:
            if launch.info_arrived() and not arrived.done():
                arrived.set_result(None)

        loop.add_reader(launch.info_r, on_info)
        try:
            await asyncio.wait(
                [arrived, asyncio.ensure_future(proc.wait())], return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            loop.remove_reader(launch.info_r)
    await proc.wait()


async def readable(fd: int | None, timeout_s: float) -> None:
    """Until `fd` (a pidfd: its process has exited) is readable, at most `timeout_s`."""
    if fd is None:
        return
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.add_reader(fd, lambda: done.done() or done.set_result(None))
    try:
        await asyncio.wait_for(asyncio.shield(done), timeout_s)
    except asyncio.TimeoutError:
        pass
    finally:
        loop.remove_reader(fd)


def run_jailed_sync(
    program: str | Sequence[str],
    files: Mapping[str, str | bytes] | None = None,
    limits: JailLimits | None = None,
    *,
    stdin: str | bytes | None = None,
    unjailed: bool = False,
) -> JailResult:
    """`run_jailed` for callers without an event loop (a reward function in a worker thread)."""
    limits = limits or JailLimits()
    launch = Launch(program, files or {}, stdin, limits, unjailed)
    try:
        started = time.monotonic()
        proc = subprocess.Popen(launch.argv, **launch.popen_kwargs())  # type: ignore[call-overload]
        launch.started()
        deadline = started + limits.timeout_s
        timed_out = False
        try:
            while launch.jailed and not launch.info_arrived():
                if not select.select([launch.info_r], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    break
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            launch.end(proc.pid)
            if launch.init_fd is not None:
                select.select([launch.init_fd], [], [], KILL_WAIT_S)
            proc.wait()
        return launch.result(proc.returncode, timed_out, time.monotonic() - started)
    finally:
        launch.close()


@functools.lru_cache(maxsize=1)
def jail_problem() -> str | None:
    """Why no jail can be built here, in one line with how to allow one; None when a jailed Python runs.
    Tried once per process (a real call, so that every namespace, mount and limit is exercised)."""
    try:
        result = run_jailed_sync("print('ok')", limits=JailLimits(timeout_s=PROBE_TIMEOUT_S))
    except JailUnavailable as err:
        return str(err)
    if result.stdout == "ok\n":
        return None
    said = (result.stderr.strip().splitlines() or [f"exit status {result.exit_code}"])[-1]
    return f"no jail for model-written code: bubblewrap failed ({said}); {HOW_TO_ALLOW}"
