"""Start-up cost of one jailed Python call (fulcrum.sandbox) against a bare interpreter, on the CPU.

Each of `--calls` calls runs `pass`: a bare `python -I -B -c pass` subprocess, a jailed call
(`run_jailed_sync`: bubblewrap, setpriv when root, prlimit, the runner) and an unjailed one (the same
runner and limits, no jail). Prints the median of each in milliseconds, and the jail's own share (jailed
minus bare), as JSON.

    python bench/jail_startup.py [--calls 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from fulcrum.sandbox import jail_problem, run_jailed_sync


def median_ms(call: Callable[[], object], calls: int) -> float:
    """The median wall time of `calls` runs of `call`, in milliseconds."""
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    problem = jail_problem()
    if problem:
        sys.exit(problem)
    bare = median_ms(
        lambda: subprocess.run([sys.executable, "-I", "-B", "-c", "pass"], check=True), args.calls
    )
    jailed = median_ms(lambda: run_jailed_sync("pass"), args.calls)
    unjailed = median_ms(lambda: run_jailed_sync("pass", unjailed=True), args.calls)
    print(
        json.dumps(
            {
                "calls": args.calls,
                "bare_python_ms": round(bare, 1),
                "jailed_call_ms": round(jailed, 1),
                "unjailed_call_ms": round(unjailed, 1),
                "jail_cost_ms": round(jailed - bare, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
