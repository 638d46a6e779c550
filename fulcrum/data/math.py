"""MATH (Hendrycks et al. 2021) in verl's parquet schema, as verl's `examples/data_preprocess/math_dataset.py` writes it.

Each row: `data_source` "DigitalLearningGmbH/MATH-lighteval", `prompt` [{role: user, content: the
problem + " Let's think step by step and output the final answer within \\boxed{}."}], `ability`
"math", `reward_model` {style: "rule", ground_truth: the content of the solution's last `\\boxed{}`},
`extra_info` {split, index}.

The source is a jsonl file of {problem, solution, ...} rows (the lighteval export's format; its split is
its name when that is "train" or "test", else "test"), or a folder holding `train.jsonl` and/or
`test.jsonl`. A solution without a box is an error naming its line (verl's script stops there too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from fulcrum.data.jsonl import jsonl_objects
from fulcrum.reward.hendrycks import boxed_answer

DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
SPLITS = ("train", "test")


class MathDataError(ValueError):
    """A source file that is not MATH's format; the message names the file and line."""


def math_row(example: dict[str, Any], split: str, index: int, where: str) -> dict[str, Any]:
    """One example as a verl row (see the module docstring)."""
    for key in ("problem", "solution"):
        if not isinstance(example.get(key), str):
            raise MathDataError(f"{where}: no {key!r} text (keys: {sorted(example)})")
    answer = boxed_answer(example["solution"])
    if answer is None:
        raise MathDataError(f"{where}: the solution has no \\boxed{{...}} answer")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": example["problem"] + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index},
    }


def convert_file(path: Path, split: str) -> pa.Table:
    """The verl table of one MATH jsonl file; errors name the file and line."""
    rows = []
    for where, example in jsonl_objects(path, MathDataError, "{path}, line {line}"):
        rows.append(math_row(example, split, len(rows), where))
    if not rows:
        raise MathDataError(f"{path}: no examples")
    return pa.Table.from_pylist(rows)


def sources(src: Path) -> dict[str, Path]:
    """{split: jsonl file} of `src` (see the module docstring)."""
    if src.is_dir():
        found = {s: src / f"{s}.jsonl" for s in SPLITS if (src / f"{s}.jsonl").is_file()}
        if not found:
            raise MathDataError(f"--src {src}: a folder without train.jsonl or test.jsonl")
        return found
    if src.is_file():
        return {src.stem if src.stem in SPLITS else "test": src}
    raise MathDataError(f"--src {src}: no such file or folder")


def prepare_math(src: str | Path, out_dir: str | Path) -> dict[str, Path]:
    """Write `out_dir/<split>.parquet` for each split of `src`; returns the paths by split."""
    tables = {split: convert_file(path, split) for split, path in sources(Path(src).expanduser()).items()}
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, table in tables.items():
        paths[split] = out / f"{split}.parquet"
        pq.write_table(table, paths[split])
    return paths
