"""`fulcrum train` in this process, observed from outside fulcrum: where each step's compile time goes.

    python bench/cold_start_runner.py --report R.json [--profile P.txt] -- KEY=VALUE ...

`bench/cold_start.py` runs it as its child, once per condition (fresh or warm compile caches, compile on or
off). It calls the trainer's entry point (`fulcrum.trainer.main_ppo.main`, what `fulcrum train` runs) and
wraps, in this process only, the trainer's step (`PPOTrainer.train_step`: step 1 under cProfile) and its
phase timer (`fulcrum.trainer.metrics.timer`: which phase of which step each compile falls in). Dynamo's
compile callbacks time every compile (a new frame, a recompile, a lazily compiled backward). At exit
`--report` gets: torch's own accounting (`torch._dynamo.utils.compile_times`, its counters: frames,
graphs, graph breaks, AOTAutograd and FX graph cache hits and misses), the recompiles with dynamo's
reasons, and the compiles by step and phase.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import logging
import pstats
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STARTED = time.perf_counter()
TOP = 30  # rows of each profile table


class Observer:
    """The step and phase being run, and every compile dynamo reports with them."""

    def __init__(self) -> None:
        self.step = 0  # 0 before the first train_step (model loading, the engine's start-up)
        self.phases: list[str] = []
        self.compiles: list[dict[str, Any]] = []
        self._open: dict[str, float] = {}
        self.first_step_at: float | None = None
        self.recompile_reasons: list[str] = []

    def where(self) -> dict[str, Any]:
        return {"step": self.step, "phase": self.phases[-1] if self.phases else "outside phases"}

    def started(self, *args: Any) -> None:
        self._open[self._key(args)] = time.perf_counter()

    def ended(self, *args: Any) -> None:
        key = self._key(args)
        begun = self._open.pop(key, None)
        if begun is not None:
            self.compiles.append({"id": key, "s": time.perf_counter() - begun, **self.where()})

    @staticmethod
    def _key(args: tuple[Any, ...]) -> str:
        """`trigger:compile_id` from the callback's argument (torch >= 2.8); a counter's worth on older ones."""
        if args and hasattr(args[0], "compile_id"):
            trigger = getattr(args[0].callback_trigger, "name", "")
            return f"{trigger}:{args[0].compile_id}"
        from torch._guards import CompileContext

        return f"DYNAMO:{CompileContext.current_compile_id()}"


class ReasonHandler(logging.Handler):
    """Keeps dynamo's recompile messages (`TORCH_LOGS=recompiles`), each with the step and phase."""

    def __init__(self, observer: Observer) -> None:
        super().__init__(logging.DEBUG)
        self.observer = observer

    def emit(self, record: logging.LogRecord) -> None:
        where = self.observer.where()
        self.observer.recompile_reasons.append(
            f"step {where['step']} {where['phase']}: {record.getMessage()}"
        )


def install(observer: Observer, profile: Path | None) -> None:
    """Wrap the trainer's step and phase timer, and register dynamo's compile callbacks."""
    import torch

    from fulcrum.trainer import metrics
    from fulcrum.trainer.ppo_trainer import PPOTrainer

    handler = getattr(getattr(torch._dynamo, "callback", None), "callback_handler", None)
    if handler is not None:  # torch >= 2.6; before it the report has no compile events
        handler.register_start_callback(observer.started)
        handler.register_end_callback(observer.ended)
    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(ReasonHandler(observer))

    timer = metrics.timer

    @contextlib.contextmanager
    def phase_timer(name: str, *args: Any, **kwargs: Any) -> Iterator[None]:
        observer.phases.append(name)
        try:
            with timer(name, *args, **kwargs):
                yield
        finally:
            observer.phases.pop()

    metrics.timer = phase_timer
    train_step = PPOTrainer.train_step

    def observed_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        observer.step += 1
        if observer.step > 1 or profile is None:
            observer.first_step_at = observer.first_step_at or time.perf_counter()
            return train_step(self, *args, **kwargs)
        observer.first_step_at = time.perf_counter()
        profiler = cProfile.Profile()
        try:
            return profiler.runcall(train_step, self, *args, **kwargs)
        finally:
            profile.write_text(profile_tables(profiler))
            profiler.dump_stats(profile.with_suffix(".prof"))

    PPOTrainer.train_step = observed_step


# Where a first step's subprocess waits come from (compilers, the preprocessor and openssl of inductor's
# precompiled headers, the vector-instruction check), and what loading a cached compiled module spends.
WAITS = r"subprocess.py:\d+\((run|check_call|check_output)\)"
CACHED_LOAD = r"codecache.py:\d+\((load_by_key_path|_precompile_header)\)"


def profile_tables(profiler: cProfile.Profile) -> str:
    """The step's TOP functions by cumulative time, then by own time; then who started subprocesses
    (`WAITS`), and what a cached compiled module's load called (`CACHED_LOAD`)."""
    out = io.StringIO()
    for order in ("cumulative", "tottime"):
        out.write(f"# step 1, top {TOP} by {order}\n")
        pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(TOP)
    out.write("# step 1, callers of the subprocess calls\n")
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_callers(WAITS)
    out.write("# step 1, callees of a compiled module's load\n")
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_callees(CACHED_LOAD)
    return out.getvalue()


def accounting(observer: Observer) -> dict[str, Any]:
    """torch's compile accounting and the observed compiles, as JSON-ready values."""
    from torch._dynamo.utils import compile_times, counters

    headers, values = compile_times(repr="csv", aggregate=True)
    times = {h: float(v) for h, v in zip(headers, values, strict=True) if _is_number(v)}
    by_step: dict[str, dict[str, dict[str, float]]] = {}
    for c in observer.compiles:
        cell = by_step.setdefault(str(c["step"]), {}).setdefault(c["phase"], {"compiles": 0, "s": 0.0})
        cell["compiles"] += 1
        cell["s"] += c["s"]
    dynamo = [c for c in observer.compiles if c["id"].startswith("DYNAMO:")]
    return {
        "compile_times_s": dict(sorted(times.items(), key=lambda kv: -kv[1])),
        "counters": {k: dict(counters[k]) for k in ("frames", "stats", "aot_autograd") if k in counters},
        "inductor_cache": {k: v for k, v in counters["inductor"].items() if "cache" in k},
        "graph_breaks": {reason.splitlines()[0][:200]: n for reason, n in counters["graph_break"].items()},
        "compiles": len(dynamo),
        "recompiles": sum(recompile(c["id"]) for c in dynamo),
        "recompile_reasons": observer.recompile_reasons[:40],
        "compiles_by_step_and_phase": by_step,
        "compile_events": observer.compiles,
    }


def recompile(key: str) -> bool:
    """Whether a compile id (`DYNAMO:frame/attempt`, maybe with a suffix) is a frame's second or later."""
    match = re.search(r"(\d+)/(\d+)", key)
    return bool(match) and int(match.group(2)) > 0


def _is_number(value: object) -> bool:
    try:
        float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, required=True, help="the accounting (JSON), written at exit")
    parser.add_argument("--profile", type=Path, help="step 1's cProfile tables (text); none without it")
    parser.add_argument("overrides", nargs="*", help="fulcrum train's KEY=VALUE arguments")
    args = parser.parse_args(argv)
    observer = Observer()
    install(observer, args.profile)
    from fulcrum.trainer.main_ppo import main as train_main

    code = 1
    try:
        code = train_main(args.overrides)
    finally:
        report = {
            "exit_code": code,
            "wall_s": time.perf_counter() - STARTED,
            "to_first_step_s": (observer.first_step_at or time.perf_counter()) - STARTED,
            "steps": observer.step,
            **accounting(observer),
        }
        args.report.write_text(json.dumps(report, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
