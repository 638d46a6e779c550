"""The first code a jailed Python process runs: it runs the model's code as `__main__` and says how it
ended.

Started inside the jail as `python -I -B -u python_child.py CODE_FILE STATUS_FD` (fulcrum.sandbox.jail);
the limits are already set (prlimit) and the isolation is the kernel's, so this file guards nothing. It
imports only the standard library. SIGXFSZ is ignored so that a write past the file-size limit fails
with an error the code can see instead of killing the process. On the status descriptor it writes one
line, `exit ok`, `exit memory`, `exit exception` or `exit <SystemExit code>`, which the parent reads to
tell a MemoryError from another exception. A traceback shows the model's lines (`File "<code>"`), not
this file's.
"""

from __future__ import annotations

import linecache
import os
import signal
import sys
import traceback
import types

EXIT_ERROR = 1


def without_own_frames(report: traceback.TracebackException) -> None:
    """Drop this file's frames from a report and from its chained ones: the model should see its code."""
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


def model_traceback(err: BaseException) -> str:
    """The traceback of `err` as the model should read it."""
    report = traceback.TracebackException(type(err), err, err.__traceback__)
    without_own_frames(report)
    return "".join(report.format())


def status(fd: int, line: str) -> None:
    """One line to the parent's status descriptor; nothing if the code closed it."""
    try:
        os.write(fd, (line + "\n").encode())
    except OSError:
        pass


def run(code: str, status_fd: int) -> int:
    """Run `code` as `__main__`; report how it ended; the process exit status."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main  # the model's code sees its own module, not this one
    filename = "<code>"
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
    try:
        exec(compile(code, filename, "exec", dont_inherit=True), main.__dict__)
    except SystemExit as exit_:
        status(status_fd, f"exit {exit_.code!r}")
        raise
    except MemoryError:
        status(status_fd, "exit memory")
        sys.stderr.write("MemoryError: the memory limit was reached\n")
        return EXIT_ERROR
    except BaseException as err:
        status(status_fd, "exit exception")
        sys.stderr.write(model_traceback(err))
        return EXIT_ERROR
    status(status_fd, "exit ok")
    return 0


def main(argv: list[str]) -> int:
    """`argv[1]`: the code file; `argv[2]`: the status descriptor."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    with open(argv[1], encoding="utf-8") as f:
        code = f.read()
    return run(code, int(argv[2]))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
