"""The bubblewrap command line of one jailed call: namespaces, the read-only view of the system, the
call's writable temporary folder, the limits, and the seccomp filter.

Two shapes, because the kernel counts RLIMIT_NPROC per real user id and never for root:
- the trainer is not root: one unprivileged `bwrap` makes every namespace, user namespace included,
  and maps the jail's user (uid 1000 inside) to the trainer's own uid;
- the trainer is root: a privileged `bwrap` makes the mount, PID, network, IPC and UTS namespaces and
  the view (as root it can read a Python installation under a 0700 home such as /root/.pyenv),
  `setpriv` drops to `nobody` (uid 65534) with no capabilities and no groups, and an unprivileged
  `bwrap` inside makes the user namespace (uid 1000 inside), forbids further user namespaces and loads
  the seccomp filter. Inside, the code is never root and its processes count against its own limit.

In both, `prlimit` sets the call's limits right before the program starts (after the user namespace
exists: RLIMIT_NPROC then counts only this call's processes).
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import PurePosixPath

from fulcrum.sandbox.limits import JailLimits

JAIL_UID = 1000
NOBODY = 65534  # the host uid of jailed code when the trainer is root
WORK = "/tmp"  # the call's writable folder inside the jail: cwd, HOME and TMPDIR
CODE_DIR = "/jail"  # read-only: the runner and the code of a Python call
TOP_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")  # symlinks into /usr on merged-/usr systems
ETC_ENTRIES = ("alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "mime.types")
PASSWD = "root:x:0:0:root:/root:/usr/sbin/nologin\nsandbox:x:1000:1000:sandbox:/tmp:/bin/sh\n"
GROUP = "root:x:0:\nsandbox:x:1000:\n"


@dataclass(frozen=True)
class Host:
    """What this machine offers the jail, found once per process."""

    bwrap: str | None
    prlimit: str | None
    setpriv: str | None
    as_root: bool
    python_dirs: tuple[str, ...]

    def missing(self) -> str | None:
        """Which program the jail needs and this machine lacks, as a phrase; None when all are there."""
        if self.bwrap is None:
            return "bubblewrap (`bwrap`) is not installed"
        if self.prlimit is None:
            return "`prlimit` (util-linux) is not installed"
        if self.as_root and self.setpriv is None:
            return "`setpriv` (util-linux) is not installed"
        return None


def covered(path: str, roots: list[str]) -> bool:
    """Whether `path` is one of `roots` or lies under one."""
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def python_dirs() -> tuple[str, ...]:
    """The folders the jail's Python needs that /usr does not hold: the environment's prefix, its base
    interpreter's (resolved) and the directory of the resolved executable."""
    candidates = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    candidates |= {os.path.realpath(p) for p in list(candidates)}
    candidates.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    chosen: list[str] = ["/usr"]
    for path in sorted(candidates, key=len):
        if path and path != "/" and os.path.isdir(path) and not covered(path, chosen):
            chosen.append(path)
    return tuple(chosen[1:])


@functools.lru_cache(maxsize=1)
def host() -> Host:
    """This machine's jail programs and Python folders."""
    return Host(
        bwrap=shutil.which("bwrap"),
        prlimit=shutil.which("prlimit"),
        setpriv=shutil.which("setpriv"),
        as_root=os.geteuid() == 0,
        python_dirs=python_dirs(),
    )


def ancestors(path: str) -> list[str]:
    """The folders above `path`, outermost first, without the root."""
    parts = PurePosixPath(path).parents
    return [str(p) for p in reversed(list(parts)) if str(p) != "/"]


def view_args(
    h: Host, disk_bytes: int, data_fds: dict[str, tuple[int, str]], files: dict[str, int]
) -> list[str]:
    """The jail's file system: a size-capped tmpfs at /tmp (and /dev/shm), the system and Python
    read-only, a fresh /proc and a minimal /dev; `data_fds` are read-only files made from descriptors
    (path → (fd, mode)), `files` writable files copied into /tmp (name → fd)."""
    size = str(disk_bytes)
    args = ["--size", size, "--tmpfs", WORK, "--chmod", "1777", WORK]
    args += ["--ro-bind", "/usr", "/usr"]
    for name in TOP_LINKS:
        path = f"/{name}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    made: set[str] = {WORK}
    for path in h.python_dirs:
        for parent in ancestors(path):
            if parent not in made:
                made.add(parent)
                args += ["--perms", "0755", "--dir", parent]
        args += ["--ro-bind", path, path]
    args += ["--perms", "0755", "--dir", "/etc"]
    for name in ETC_ENTRIES:
        if os.path.exists(f"/etc/{name}"):
            args += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    args += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm"]
    args += ["--chmod", "1777", "/dev/shm", "--remount-ro", "/dev", "--perms", "0755", "--dir", CODE_DIR]
    for dest, (fd, mode) in data_fds.items():
        args += ["--perms", mode, "--ro-bind-data", str(fd), dest]
    for name, fd in files.items():
        dest = f"{WORK}/{name}"
        for parent in ancestors(dest):
            if parent not in made:
                made.add(parent)
                args += ["--perms", "0777", "--dir", parent]
        args += ["--perms", "0666", "--file", str(fd), dest]
    return args


def limit_args(prlimit: str, limits: JailLimits, count_processes: bool) -> list[str]:
    """`prlimit` setting hard limits the program cannot raise (CPU: SIGXCPU at `cpu_seconds`, SIGKILL a
    second later; no core files); processes only when `count_processes` (RLIMIT_NPROC counts over the
    real user, which only the jail's own user namespace narrows to the call)."""
    cpu_s = limits.cpu_seconds
    args = [
        prlimit,
        f"--as={limits.memory_mb * 1024 * 1024}",
        f"--cpu={cpu_s}:{cpu_s + 1}",
        f"--fsize={limits.max_file_bytes}",
        "--core=0",
    ]
    if count_processes:
        args.append(f"--nproc={limits.max_processes}")
    return [*args, "--"]


def jail_argv(
    h: Host,
    view: list[str],
    limits: list[str],
    program: list[str],
    env: dict[str, str],
    seccomp_fd: int | None,
    info_fd: int,
) -> list[str]:
    """The whole command line (see the module docstring for its two shapes)."""
    assert h.bwrap is not None
    inner = ["--unshare-user", "--disable-userns", "--uid", str(JAIL_UID), "--gid", str(JAIL_UID)]
    inner += ["--die-with-parent", "--new-session", "--chdir", WORK, "--clearenv"]
    for key, value in env.items():
        inner += ["--setenv", key, value]
    if seccomp_fd is not None:
        inner += ["--seccomp", str(seccomp_fd)]
    namespaces = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    outer = [*namespaces, "--hostname", "sandbox", "--die-with-parent", "--info-fd", str(info_fd)]
    if not h.as_root:
        return [h.bwrap, *outer, *view, *inner, "--", *limits, *program]
    assert h.setpriv is not None
    drop = [h.setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    drop += ["--inh-caps=-all", "--bounding-set=-all", "--"]
    return [h.bwrap, *outer, "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
            "--cap-add", "CAP_SETPCAP", *view, "--", *drop, h.bwrap, "--dev-bind", "/", "/", *inner, "--",
            *limits, *program]  # fmt: skip
