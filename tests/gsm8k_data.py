"""Where the GSM8K tests read their problems: the committed GSM8K-format rows of `tests/fixtures/gsm8k` (made
up, its README says how) always, and the whole release beside the checkout (`../shared/data/gsm8k`, 7,473 train and 1,319
test problems) as well when it is there. `SOURCES` lists them for `pytest.mark.parametrize`: nothing is
skipped where the release is missing, and nothing depends on where the checkout sits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FIXTURE_DIR = REPO / "tests" / "fixtures" / "gsm8k"
RELEASE_DIR = REPO.parent / "shared" / "data" / "gsm8k"
RELEASE_ROWS = {"train": 7473, "test": 1319}  # the published split sizes
SOURCES = [FIXTURE_DIR] + ([RELEASE_DIR] if (RELEASE_DIR / "test.jsonl").is_file() else [])
SOURCE_IDS = ["fixture", "release"][: len(SOURCES)]


def rows(source: Path, split: str) -> list[dict[str, Any]]:
    """The `question` / `answer` rows of `split` ("train" or "test") in `source`."""
    return [json.loads(line) for line in (source / f"{split}.jsonl").read_text().splitlines()]


def expected_rows(source: Path, split: str) -> int:
    """How many rows `split` of `source` holds: the published size for the release."""
    return RELEASE_ROWS[split] if source == RELEASE_DIR else len(rows(source, split))
