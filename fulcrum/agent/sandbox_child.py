"""The first code a sandboxed Python process runs: limits, an audit hook, then the model's code.

Started by fulcrum.agent.sandbox as `python -I -B -u sandbox_child.py SETTINGS_JSON`, in the call's
working directory with a minimal environment. It imports nothing from fulcrum (`-I` keeps the checkout
off sys.path) and only the standard library.

In order: resource limits (address space, CPU seconds, file size, no core file); SIGXFSZ ignored, so a
write past the size limit fails with an error instead of killing the process; the C function behind
every subprocess replaced by a refusal and `os.mknod` / `os.mkfifo` removed (neither raises an audit
event); the audit hook installed; the code compiled and run as `__main__`.

The hook refuses, by raising SandboxRefusal (a PermissionError) and writing a line to the status file:
opening for writing, creating, renaming or removing outside the working directory; reading or listing
outside it and the Python installation; links, permission and owner changes; processes (fork, exec,
spawn, system, subprocess), signals to other processes, resource limits; sockets other than a local
pair and every connect, bind, send-to and name lookup; ctypes, sub-interpreters, object-graph walks
(gc), and rewriting the hook's own helpers or a path class's `__fspath__`. Importing a refused extension module raises
SandboxImportRefusal (an ImportError, so that `try: import ctypes except ImportError:` still works).

The hook's policy and every function it calls are bound as default arguments when it is defined: the
model's code can replace `os.path.realpath` or `builtins.isinstance`, but not what the hook already holds.
This is still a Python-level guard, not a security boundary (see docs/multi-turn.md).
"""

from __future__ import annotations

import json
import linecache
import os
import pathlib
import posix
import resource
import signal
import sys
import traceback
import types
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

EXIT_ERROR = 1
_S_IFMT, _S_IFLNK = 0o170000, 0o120000
_MAX_LINKS = 40  # the kernel's own limit on symbolic links followed in one path

# Extension modules whose fresh import is refused: each gives direct memory, process or file access
# that no audit event covers.
REFUSED_IMPORTS = frozenset(
    {
        "ctypes",
        "_ctypes",
        "cffi",
        "_cffi_backend",
        "_posixsubprocess",
        "posix",
        "_xxsubinterpreters",
        "_testcapi",
        "_testinternalcapi",
        "_testmultiphase",
        "_gdbm",
        "_dbm",
        "readline",
    }
)
PROCESS_EVENTS = frozenset(
    {
        "os.exec",
        "os.fork",
        "os.forkpty",
        "os.posix_spawn",
        "os.spawn",
        "os.system",
        "subprocess.Popen",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "resource.setrlimit",
        "resource.prlimit",
        "cpython.PyInterpreterState_New",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "sqlite3.enable_load_extension",
        "sqlite3.load_extension",
    }
)
LINK_AND_MODE_EVENTS = frozenset(
    {"os.link", "os.symlink", "os.chmod", "os.chown", "os.chflags", "os.setxattr", "os.removexattr"}
)
# event → indices of its path arguments and of its dir_fd arguments (a dir_fd makes a path relative to
# a directory the hook cannot see, so any dir_fd is refused).
WRITE_PATH_EVENTS: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]] = MappingProxyType(
    {
        "os.mkdir": ((0,), (2,)),
        "os.rmdir": ((0,), (1,)),
        "os.remove": ((0,), (1,)),
        "os.rename": ((0, 1), (2, 3)),
        "os.truncate": ((0,), ()),
        "os.utime": ((0,), (3,)),
        "shutil.rmtree": ((0,), (1,)),
        "sqlite3.connect": ((0,), ()),
    }
)
READ_PATH_EVENTS = frozenset({"os.listdir", "os.scandir", "os.chdir", "os.getxattr", "os.listxattr"})
# Setting `__fspath__` on a class would change how its paths answer the hook. A function's code and
# defaults are guarded only on the hook's own helpers, whose defaults are the policy: the standard
# library rewrites others' (collections.namedtuple sets defaults, types.coroutine sets code).
GUARDED_ATTRIBUTES = frozenset({"__fspath__"})
GUARDED_DEFAULTS = frozenset({"__code__", "__defaults__", "__kwdefaults__"})
# Path objects whose `__fspath__` is the standard library's (exact types: a subclass could override it).
SAFE_PATH_TYPES = (pathlib.PurePosixPath, pathlib.PosixPath, os.DirEntry)
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
READABLE_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")


class SandboxRefusal(PermissionError):
    """Raised into the model's code for an operation the sandbox refuses."""


class SandboxImportRefusal(ImportError):
    """Raised into the model's code for an import the sandbox refuses."""


def resolve(
    path: str,
    _getcwd: Callable[[], str] = posix.getcwd,
    _lstat: Callable[[str], Any] = posix.lstat,
    _readlink: Callable[[str], str] = posix.readlink,
    _ifmt: int = _S_IFMT,
    _iflnk: int = _S_IFLNK,
    _max_links: int = _MAX_LINKS,
    _refusal: type = SandboxRefusal,
) -> str:
    """The absolute path with `.`, `..` and symbolic links resolved (a missing tail is kept as given).

    A copy of what `os.path.realpath` does, built only from functions bound here, because the model's
    code may replace `os.path.realpath` and everything it calls.
    """
    if not path.startswith("/"):
        path = _getcwd() + "/" + path
    done: list[str] = []
    pending = path.split("/")
    pending.reverse()
    links = 0
    while pending:
        part = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        candidate = "/" + "/".join([*done, part])
        try:
            is_link = (_lstat(candidate).st_mode & _ifmt) == _iflnk
        except OSError:
            is_link = False
        if not is_link:
            done.append(part)
            continue
        links += 1
        if links > _max_links:
            raise _refusal(f"refused by the sandbox: too many symbolic links in {path!r}")
        target = _readlink(candidate)
        if target.startswith("/"):
            done = []
        rest = target.split("/")
        rest.reverse()
        pending.extend(rest)
    return "/" + "/".join(done)


def within(path: str, roots: tuple[str, ...], _any: Callable[[Any], bool] = any) -> bool:
    """True when `path` is one of `roots` or inside one."""
    return _any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def plain_path(
    value: Any,
    _as_str: Callable[[Any], str] = str.__str__,
    _decode: Callable[..., str] = bytes.decode,
    _fspath: Callable[[Any], Any] = posix.fspath,
    _isinstance: Callable[[Any, Any], bool] = isinstance,
    _type: type = type,
    _safe: tuple[type, ...] = SAFE_PATH_TYPES,
    _refusal: type = SandboxRefusal,
) -> str | None:
    """A path argument as an exact str, None for a file descriptor; a refusal for anything that could
    give a different answer when the operation itself reads it again (a str subclass with its own
    methods, an object of the model's with its own `__fspath__`)."""
    if value is None or _type(value) is int:
        return None
    if _isinstance(value, str):
        return _as_str(value)
    if _isinstance(value, bytes):
        return _decode(value, "utf-8", "surrogateescape")
    if _type(value) in _safe:
        return _as_str(_fspath(value))
    raise _refusal(f"refused by the sandbox: a path of type {_type(value).__name__}")


def make_hook(work: str, read_roots: tuple[str, ...], status_fd: int) -> Callable[[str, tuple], None]:
    """The audit hook for a call whose working directory is `work`; refusals are written to `status_fd`."""

    def hook(
        event: str,
        args: tuple,
        _work: tuple[str, ...] = (work,),
        _read: tuple[str, ...] = (work, *read_roots, *READABLE_DEVICES),
        _fd: int = status_fd,
        _write: Callable[[int, bytes], int] = posix.write,
        _plain: Callable[[Any], str | None] = plain_path,
        _resolve: Callable[[str], str] = resolve,
        _within: Callable[[str, tuple[str, ...]], bool] = within,
        _as_str: Callable[[Any], str] = str.__str__,
        _isinstance: Callable[[Any, Any], bool] = isinstance,
        _len: Callable[[Any], int] = len,
        _repr: Callable[[Any], str] = repr,
        _type: type = type,
        _int: type = int,
        _and: Callable[[int, int], int] = int.__and__,
        _refusal: type = SandboxRefusal,
        _import_refusal: type = SandboxImportRefusal,
        _refused_imports: frozenset[str] = REFUSED_IMPORTS,
        _process: frozenset[str] = PROCESS_EVENTS,
        _links: frozenset[str] = LINK_AND_MODE_EVENTS,
        _write_paths: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]] = WRITE_PATH_EVENTS,
        _read_paths: frozenset[str] = READ_PATH_EVENTS,
        _rewrites: frozenset[str] = GUARDED_ATTRIBUTES,
        _defaults: frozenset[str] = GUARDED_DEFAULTS,
        _helpers: tuple[Callable[..., Any], ...] = (resolve, within, plain_path),
        _write_flags: int = WRITE_FLAGS,
        _write_modes: str = "wax+",
        _unix: int = 1,  # AF_UNIX on Linux; a pair of local sockets is how asyncio wakes itself
    ) -> None:
        def refuse(what: str, cls: type = _refusal) -> None:
            # A refused import is reported only if nobody catches it: libraries probe optional modules
            # (numpy tries ctypes) and carry on without them.
            if cls is not _import_refusal:
                _write(_fd, ("refused " + what.replace("\n", " ")[:300] + "\n").encode())
            raise cls("refused by the sandbox: " + what)

        if event == "open":
            path, mode, flags = args
            raw = _plain(path)
            if raw is None:
                return
            if mode is None and not raw.startswith("/"):
                # os.open may carry a dir_fd, which the event does not show; an absolute path ignores it.
                refuse(f"os.open({raw!r}) with a relative path: use an absolute one")
            resolved = _resolve(raw)
            writes = False
            if _type(flags) is _int and _and(flags, _write_flags):
                writes = True
            if _isinstance(mode, str):
                for char in _as_str(mode):
                    if char in _write_modes:
                        writes = True
            if writes and not _within(resolved, _work):
                refuse(f"open({raw!r}) for writing outside the working directory")
            if not writes and not _within(resolved, _read):
                refuse(f"open({raw!r}) outside the working directory")
        elif event == "import":
            if _isinstance(args[0], str) and _as_str(args[0]) in _refused_imports:
                refuse(f"import {_as_str(args[0])}", _import_refusal)
        elif event in _process or event in _links:
            refuse(event + _repr(args)[:200])
        elif event in _write_paths:
            path_indices, dir_fd_indices = _write_paths[event]
            for i in dir_fd_indices:
                if i < _len(args) and args[i] is not None and not (_type(args[i]) is _int and args[i] == -1):
                    refuse(f"{event} with a dir_fd")
            for i in path_indices:
                raw = _plain(args[i]) if i < _len(args) else None
                if raw is not None and raw != ":memory:" and not _within(_resolve(raw), _work):
                    refuse(f"{event}({raw!r}) outside the working directory")
        elif event in _read_paths:
            raw = _plain(args[0]) if args else None
            if raw is not None and not _within(_resolve(raw), _read):
                refuse(f"{event}({raw!r}) outside the working directory")
        elif event == "socket.__new__":
            if not (_type(args[1]) is _int and args[1] == _unix):
                refuse("creating a network socket (no network in the sandbox)")
        elif event.startswith("socket."):
            refuse(event + " (no network in the sandbox)")
        elif event.startswith("ctypes."):
            refuse(event)
        elif event == "object.__setattr__" and _isinstance(args[1], str):
            name = _as_str(args[1])
            if name in _rewrites:
                refuse(f"setting {name}")
            if name in _defaults:
                for helper in _helpers:
                    if args[0] is helper:
                        refuse(f"setting the sandbox's own {name}")

    return hook


def set_limits(memory_bytes: int, cpu_s: int, file_bytes: int) -> None:
    """Hard limits the process cannot raise again (the hook also refuses setrlimit, which root could)."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def disable_process_creation(status_fd: int) -> None:
    """Replace the C entry points that start processes without an audit event of their own."""
    import _posixsubprocess
    import subprocess  # noqa: F401  (loaded now, so that later imports find the patched module)

    def fork_exec(*args: Any, **kwargs: Any) -> None:
        status(status_fd, "refused starting a process")
        raise SandboxRefusal("refused by the sandbox: starting a process")

    _posixsubprocess.fork_exec = fork_exec
    for module in (os, posix):
        for name in ("mknod", "mkfifo"):
            if hasattr(module, name):
                delattr(module, name)


def read_roots() -> tuple[str, ...]:
    """The Python installation (the environment's and its base interpreter's prefixes), resolved."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return tuple(sorted(resolve(p) for p in prefixes if p))


def without_own_frames(report: traceback.TracebackException) -> None:
    """Drop this file's frames (the runner and the hook) from a report and from its chained ones: the
    model should see its own code, and reading this file's lines would itself be refused."""
    seen: set[int] = set()
    pending = [report]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        frames = [frame for frame in current.stack if frame.filename != __file__]
        current.stack = traceback.StackSummary.from_list(frames)
        pending.extend(r for r in (current.__cause__, current.__context__) if r is not None)


def model_traceback(err: BaseException) -> list[str]:
    """The traceback lines of `err` as the model should read them (see without_own_frames)."""
    report = traceback.TracebackException(type(err), err, err.__traceback__, lookup_lines=False)
    without_own_frames(report)
    return list(report.format())


def status(fd: int, line: str) -> None:
    """One line to the parent's status file."""
    os.write(fd, (line + "\n").encode())


def run(code: str, status_fd: int) -> int:
    """Run `code` as `__main__`; report how it ended on the status file; the process exit status."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main  # the model's code sees its own module, not this one
    filename = "<code>"
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
    try:
        exec(compile(code, filename, "exec"), main.__dict__)
    except SystemExit as exit_:
        status(status_fd, f"exit {exit_.code!r}")
        raise
    except MemoryError:
        status(status_fd, "exit memory")
        sys.stderr.write("MemoryError: the memory limit was reached\n")
        return EXIT_ERROR
    except BaseException as err:
        refused = isinstance(err, (SandboxRefusal, SandboxImportRefusal))
        status(status_fd, "exit refused" if refused else "exit exception")
        sys.stderr.write("".join(model_traceback(err)))
        return EXIT_ERROR
    status(status_fd, "exit ok")
    return 0


def main(argv: list[str]) -> int:
    """Apply the settings of argv[1] (JSON), install the hook and run the code."""
    settings = json.loads(argv[1])
    set_limits(settings["memory_bytes"], settings["cpu_s"], settings["file_bytes"])
    disable_process_creation(settings["status_fd"])
    with open(settings["code_file"], encoding="utf-8") as f:
        code = f.read()
    work = resolve(os.getcwd())
    sys.addaudithook(make_hook(work, read_roots(), settings["status_fd"]))
    return run(code, settings["status_fd"])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
