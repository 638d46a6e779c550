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
import select
import subprocess
import time
from collections.abc import Mapping, Sequence

from fulcrum.sandbox.launch import Launch
from fulcrum.sandbox.limits import HOW_TO_ALLOW, JailLimits, JailResult, JailUnavailable

__all__ = ["JailLimits", "JailResult", "JailUnavailable", "jail_problem", "run_jailed", "run_jailed_sync"]

KILL_WAIT_S = 5.0  # after SIGKILL to the namespace's init, how long its teardown may take
PROBE_TIMEOUT_S = 20.0


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
            launch.end(proc.pid)  # always: others of the call may outlive its main process
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
            launch.end(proc.pid)  # always: others of the call may outlive its main process
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
