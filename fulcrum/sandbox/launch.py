"""One jailed call's command line and descriptors, built before its process starts and closed after;
the reading of how it ended."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath

from fulcrum.sandbox import command, python_child, seccomp_filter
from fulcrum.sandbox.limits import HOW_TO_ALLOW, JailLimits, JailResult, JailUnavailable

STATUS_LIMIT_BYTES = 4096


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
        limits = command.limit_args(h.prlimit, lim, count_processes=True)
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
        limits = command.limit_args(prlimit, self.limits, count_processes=False) if prlimit else []
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
        namespace, setsid or not) and to the launcher's process group. The init's pid is read from bwrap's
        info first if it has not been yet: the main process may be gone while others of the call live on."""
        if self.jailed and self.init_fd is None:
            self.info_arrived()
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
