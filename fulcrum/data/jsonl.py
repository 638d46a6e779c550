"""Reading a user's jsonl source file, one JSON object a line, with errors that name the file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def jsonl_objects(
    path: Path, error: type[Exception], where: str = "{path}:{line}"
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(place, object) for each non-blank line of `path`, `place` being `where` filled with the path and
    line number; `error` naming the place for a line that is not JSON or not a JSON object."""
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            place = where.format(path=path, line=line_no)
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise error(f"{place}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise error(f"{place}: not a JSON object")
            yield place, row
