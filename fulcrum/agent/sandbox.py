"""What the model reads of a jailed Python call, and how the call is counted.

The jail itself is fulcrum.sandbox (namespaces, limits, seccomp; shared with the code rewards). Here a
JailResult becomes the tool's answer, stdout then stderr as Sandbox Fusion returns them plus one
bracketed line per failure, and the failure kinds of fulcrum.agent.metrics.
"""

from __future__ import annotations

from fulcrum.sandbox import JailResult


def failure_kinds(result: JailResult) -> set[str]:
    """The failure kinds of a finished call: timeout, memory, exception, output_truncated."""
    kinds: set[str] = set()
    if result.timed_out:
        kinds.add("timeout")
    elif result.ending == "memory":
        kinds.add("memory")
    elif result.ending == "exception" or result.exit_code not in (0, None) or result.signal is not None:
        kinds.add("exception")  # a SystemExit with a failing code, or death by a signal (a C crash)
    if result.stdout_truncated or result.stderr_truncated:
        kinds.add("output_truncated")
    return kinds


def answer_text(result: JailResult) -> str:
    """What the model reads: stdout then stderr, then one bracketed line per failure."""
    lim = result.limits
    notes = []
    if result.timed_out:
        notes.append(f"[timed out: the process was killed after {lim.timeout_s:g} s]")
    if result.ending == "memory":
        notes.append(f"[memory limit of {lim.memory_mb} MB reached]")
    if result.stdout_truncated or result.stderr_truncated:
        notes.append(f"[output truncated to the first {lim.max_output_bytes} bytes of each stream]")
    if result.signal is not None and not result.timed_out:
        notes.append(f"[killed by signal {result.signal}]")
    out = result.stdout + result.stderr
    if notes:
        out = (out + ("\n" if out and not out.endswith("\n") else "")) + "\n".join(notes)
    return out
