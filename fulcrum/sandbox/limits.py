"""The limits of a jailed call and how it ended (fulcrum.sandbox.jail runs it)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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
