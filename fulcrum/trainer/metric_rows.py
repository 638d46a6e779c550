"""A run's metrics rows (one dict per `metrics.jsonl` line, oldest first) read as numbers: what the
diagnosis rules and `fulcrum report` share. Values may be the strings "nan"/"inf" the JSON logger writes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

Row = dict[str, Any]


def as_float(value: Any) -> float | None:
    """A metric value as a float: numbers, and the "nan"/"inf" strings of metrics.jsonl; None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def training_rows(rows: Sequence[Row]) -> list[Row]:
    """The rows of training steps (those with a step time); a validation-only row (step 0) is not one."""
    return [r for r in rows if as_float(r.get("timing_s/step")) is not None]


def series(rows: Sequence[Row], key: str) -> list[tuple[int, float]]:
    """(step, value) of every row that has `key` with a numeric value (NaN included)."""
    out = []
    for i, row in enumerate(rows):
        value = as_float(row.get(key))
        if value is not None:
            out.append((int(row.get("step", i + 1)), value))
    return out


def finite_series(rows: Sequence[Row], key: str) -> list[tuple[int, float]]:
    """(step, value) of the training steps that have a finite `key` (NaN and Inf are `non_finite`'s)."""
    return [(s, v) for s, v in series(training_rows(rows), key) if math.isfinite(v)]


def step_of(row: Row, default: int) -> int:
    step = as_float(row.get("step"))
    return int(step) if step is not None else default
