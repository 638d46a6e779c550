"""Test data whose rows carry their own response budgets (extra_info.max_response_length)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def with_budgets(path: Path, budget: Callable[[int], object]) -> Path:
    """Rewrite parquet `path` so row i's extra_info.max_response_length is `budget(i)`."""
    rows = pq.read_table(path).to_pylist()
    for i, row in enumerate(rows):
        row["extra_info"] = {**row["extra_info"], "max_response_length": budget(i)}
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
