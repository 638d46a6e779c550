"""Where metrics go: one compact console line per step, `metrics.jsonl` always, and the backends named
in `trainer.logger` (console, tensorboard, wandb, mlflow; `jsonl` is accepted and always on).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Protocol, TextIO

from fulcrum.config.keys import flatten

KNOWN_LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow", "swanlab", "vemlp_wandb", "clearml")

# (metric, short name, format) shown on the console line when present.
CONSOLE_FIELDS = [
    ("critic/score/mean", "score", ".3f"),
    ("critic/rewards/mean", "reward", ".3f"),
    ("actor/pg_loss", "pg_loss", ".4f"),
    ("actor/ppo_kl", "ppo_kl", ".2e"),
    ("actor/entropy", "entropy", ".3f"),
    ("actor/kl_loss", "kl_loss", ".2e"),
    ("critic/vf_loss", "vf_loss", ".4f"),
    ("actor/grad_norm", "gnorm", ".3f"),
    ("response_length/mean", "resp_len", ".1f"),
    ("perf/time_per_step", "step_s", ".1f"),
    ("perf/throughput", "tok/s", ".0f"),
]


class Logger(Protocol):
    def log(self, data: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def console_line(data: dict[str, float], step: int) -> str:
    """One compact line: the step, the headline metrics present, and any validation score."""
    parts = [f"step {step}"]
    for key, short, fmt in CONSOLE_FIELDS:
        if key in data:
            parts.append(f"{short} {data[key]:{fmt}}")
    parts += [f"{k} {v:.3f}" for k, v in data.items() if k.startswith("val-core/")]
    return " | ".join(parts)


class ConsoleLogger:
    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream

    def log(self, data: dict[str, float], step: int) -> None:
        print(console_line(data, step), file=self.stream or sys.stdout, flush=True)

    def close(self) -> None:
        pass


def _jsonable(v: Any) -> Any:
    """Floats stay floats (NaN/inf written as strings JSON can hold); tensors and numpy scalars become numbers."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsWriteError(RuntimeError):
    """A row of `metrics.jsonl` could not be written (a full disk); the file was left whole."""


class JsonlLogger:
    """Appends one JSON object per `log` call to `<run_dir>/metrics.jsonl` (`step` plus the metrics).

    Each row goes straight to the file descriptor, unbuffered: a write that fails (a full disk) leaves
    nothing pending for a later flush or `close` to fail on again, and a row the kernel took only part
    of is cut off again, so the file only ever holds whole rows."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self.fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(self, data: dict[str, float], step: int) -> None:
        if self.fd is None:
            raise MetricsWriteError(f"{self.path} is closed")
        row = {"step": step, **{k: _jsonable(v) for k, v in data.items()}}
        line = (json.dumps(row) + "\n").encode()
        end = os.lseek(self.fd, 0, os.SEEK_END)
        try:
            written = 0
            while written < len(line):
                written += os.write(self.fd, line[written:])
        except OSError as err:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, end)  # the part of the row that did go in
            raise MetricsWriteError(
                f"cannot append the row of step {step} to {self.path}: {err.strerror or err}; the file holds "
                "whole rows up to the step before. Free space, then resume from the last checkpoint "
                "(trainer.resume_mode=auto)"
            ) from None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class TensorBoardLogger:
    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, data: dict[str, float], step: int) -> None:
        for k, v in data.items():
            if isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, project: str, name: str, config: dict[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project, name=name, config=config)

    def log(self, data: dict[str, float], step: int) -> None:
        self.run.log(data, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    def __init__(self, project: str, name: str, config: dict[str, Any]) -> None:
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(project)
        mlflow.start_run(run_name=name)
        flat = flatten(config)
        mlflow.log_params({k: str(v)[:250] for k, v in list(flat.items())[:100]})

    def log(self, data: dict[str, float], step: int) -> None:
        # mlflow metric names may not contain '@'.
        self.mlflow.log_metrics({k.replace("@", "_at_"): float(v) for k, v in data.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class Tracking:
    """All the loggers of a run behind one `log(data, step)`."""

    def __init__(
        self, backends: list[str], run_dir: Path, project: str, experiment: str, config: dict[str, Any]
    ) -> None:
        unknown = [b for b in backends if b not in KNOWN_LOGGERS]
        if unknown:
            raise ValueError(
                f"trainer.logger: unknown logger(s) {unknown}; choose from {list(KNOWN_LOGGERS)}"
            )
        for name, module in (("wandb", "wandb"), ("mlflow", "mlflow")):
            if name in backends and importlib.util.find_spec(module) is None:
                raise ModuleNotFoundError(
                    f"trainer.logger lists {name!r} but the package {module!r} is not installed: "
                    f"`pip install {module}` or remove it from trainer.logger"
                )
        unsupported = [b for b in backends if b in ("swanlab", "vemlp_wandb", "clearml")]
        if unsupported:
            raise ValueError(f"trainer.logger: {unsupported} are verl loggers fulcrum does not support yet")
        self.loggers: list[Logger] = [JsonlLogger(run_dir)]
        if "console" in backends:
            self.loggers.append(ConsoleLogger())
        if "tensorboard" in backends:
            self.loggers.append(TensorBoardLogger(run_dir))
        if "wandb" in backends:
            self.loggers.append(WandbLogger(project, experiment, config))
        if "mlflow" in backends:
            self.loggers.append(MlflowLogger(project, experiment, config))

    @classmethod
    def silent(cls) -> Tracking:
        """No loggers at all: the ranks other than 0 of a torchrun run (rank 0 logs the run's metrics)."""
        tracking = cls.__new__(cls)
        tracking.loggers = []
        return tracking

    def log(self, data: dict[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log(data, step)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
