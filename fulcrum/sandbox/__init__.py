"""Running model-written code in a jail the kernel enforces (bubblewrap namespaces, no capabilities, an
unprivileged user, rlimits, seccomp). A low layer with no fulcrum imports, so that the agent's Python tool
and the code rewards share it:

    from fulcrum.sandbox import JailLimits, run_jailed, run_jailed_sync, jail_problem

See fulcrum.sandbox.jail for what a call may see and use, and docs/multi-turn.md for what it guarantees.
"""

from fulcrum.sandbox.jail import (
    JailLimits,
    JailResult,
    JailUnavailable,
    jail_problem,
    run_jailed,
    run_jailed_sync,
)

__all__ = ["JailLimits", "JailResult", "JailUnavailable", "jail_problem", "run_jailed", "run_jailed_sync"]
