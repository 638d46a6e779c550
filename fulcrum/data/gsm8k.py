"""GSM8K → verl's parquet schema, byte for byte what verl's `examples/data_preprocess/gsm8k.py` writes.

Each row: `data_source` "openai/gsm8k", `prompt` [{role: user, content: question + " " + instruction}],
`ability` "math", `reward_model` {style: "rule", ground_truth: the number after "#### ", commas
removed}, `extra_info` {split, index, answer, question} (the original answer and question).

Two multi-turn variants (`variant`): "tool" is what verl's `examples/data_preprocess/gsm8k_multiturn_w_tool.py`
writes: a system message asking for the `calc_gsm8k_reward` tool, the question with verl's backquoted
instruction, and in `extra_info` also `need_tools_kwargs`, `tools_kwargs` (the ground truth for the
tool's `create`) and `interaction_kwargs` {query, ground_truth}; "interaction" is what
`gsm8k_multiturn_w_interaction.py` writes: a system message asking the model to rethink when told it is
wrong, the backquoted instruction, and `interaction_kwargs` {name: "gsm8k", query, ground_truth}, which
picks verl's GSM8K interaction (`fulcrum.agent.gsm8k_interaction`).

The source is a folder with the release's `train.jsonl` and `test.jsonl`, or the hub name
`openai/gsm8k` (needs the `datasets` package and a network).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from fulcrum.data.jsonl import jsonl_objects

DATA_SOURCE = "openai/gsm8k"
HUB_NAME = "openai/gsm8k"
SPLITS = ("train", "test")
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# The multi-turn script's own wording (backquotes, not quotes) and system message.
TOOL_INSTRUCTION = "Let's think step by step and output the final answer after `####`."
TOOL_SYSTEM_PROMPT = (
    "You are a math expert. You are given a question and you need to solve it step by step. "
    "Reasoning step by step before any tool call. "
    "You should use the `calc_gsm8k_reward` tool after step by step solving the question, "
    "before generate final answer at least once and refine your answer if necessary. "
    "Put your final answer in the format of `#### <answer>`."
)
INTERACTION_SYSTEM_PROMPT = (
    "You are a math expert. You are given a question and you need to solve it step by step. "
    "You should rethinking carefully if user point out your answer is wrong. "
    "Put your final answer in the format of `#### <answer>`."
)
INTERACTION_NAME = "gsm8k"
TOOL_NAME = "calc_gsm8k_reward"
# verl's pattern: the first "#### " followed by an optional minus and digits, dots and commas.
_FINAL_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")

DOWNLOAD_HINT = (
    "download train.jsonl and test.jsonl of the GSM8K release (https://github.com/openai/grade-school-math, "
    "folder grade_school_math/data) into a folder and pass that folder as --src"
)

# Column types as verl's files have them, fixed so that an empty or odd split still gets this schema.
SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [
                    ("split", pa.string()),
                    ("index", pa.int64()),
                    ("answer", pa.string()),
                    ("question", pa.string()),
                ]
            ),
        ),
    ]
)

TOOL_SCHEMA = pa.schema(
    [
        *(SCHEMA.field(i) for i in range(4)),
        (
            "extra_info",
            pa.struct(
                [
                    *SCHEMA.field("extra_info").type,
                    ("need_tools_kwargs", pa.bool_()),
                    (
                        "tools_kwargs",
                        pa.struct(
                            [
                                (
                                    TOOL_NAME,
                                    pa.struct(
                                        [("create_kwargs", pa.struct([("ground_truth", pa.string())]))]
                                    ),
                                )
                            ]
                        ),
                    ),
                    (
                        "interaction_kwargs",
                        pa.struct([("query", pa.string()), ("ground_truth", pa.string())]),
                    ),
                ]
            ),
        ),
    ]
)

INTERACTION_SCHEMA = pa.schema(
    [
        *(SCHEMA.field(i) for i in range(4)),
        (
            "extra_info",
            pa.struct(
                [
                    *SCHEMA.field("extra_info").type,
                    (
                        "interaction_kwargs",
                        pa.struct(
                            [("name", pa.string()), ("query", pa.string()), ("ground_truth", pa.string())]
                        ),
                    ),
                ]
            ),
        ),
    ]
)


class GSM8KError(ValueError):
    """Bad GSM8K input; the message names the file (and line) or the source."""


def extract_ground_truth(answer: str) -> str | None:
    """The number after the first "#### " in a GSM8K answer, commas removed; None if there is none."""
    found = _FINAL_ANSWER.search(answer)
    return found.group(1).replace(",", "") if found else None


def make_row(question: str, answer: str, split: str, index: int) -> dict[str, Any]:
    """One verl-schema row; raises GSM8KError when the answer has no "#### <number>"."""
    ground_truth = extract_ground_truth(answer)
    if ground_truth is None:
        raise GSM8KError(f"answer has no '#### <number>' line: {answer[-80:]!r}")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def make_tool_row(question: str, answer: str, split: str, index: int) -> dict[str, Any]:
    """One row of verl's multi-turn-with-tool variant (see the module docstring)."""
    row = make_row(question, answer, split, index)
    ground_truth = row["reward_model"]["ground_truth"]
    prompt = question + " " + TOOL_INSTRUCTION
    row["prompt"] = [{"role": "system", "content": TOOL_SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
    row["extra_info"].update(
        need_tools_kwargs=True,
        tools_kwargs={TOOL_NAME: {"create_kwargs": {"ground_truth": ground_truth}}},
        interaction_kwargs={"query": prompt, "ground_truth": ground_truth},
    )
    return row


def make_interaction_row(question: str, answer: str, split: str, index: int) -> dict[str, Any]:
    """One row of verl's multi-turn-with-interaction variant (see the module docstring)."""
    row = make_row(question, answer, split, index)
    ground_truth = row["reward_model"]["ground_truth"]
    prompt = question + " " + TOOL_INSTRUCTION
    row["prompt"] = [
        {"role": "system", "content": INTERACTION_SYSTEM_PROMPT},
        {"role": "user", "content": prompt},
    ]
    row["extra_info"]["interaction_kwargs"] = {
        "name": INTERACTION_NAME,
        "query": prompt,
        "ground_truth": ground_truth,
    }
    return row


# variant -> (row maker, schema)
VARIANTS = {
    "single": (make_row, SCHEMA),
    "tool": (make_tool_row, TOOL_SCHEMA),
    "interaction": (make_interaction_row, INTERACTION_SCHEMA),
}


def read_jsonl(path: Path) -> list[dict[str, str]]:
    """Rows {question, answer} of a GSM8K jsonl file; errors name the file and line."""
    rows = []
    for where, row in jsonl_objects(path, GSM8KError):
        missing = [k for k in ("question", "answer") if not isinstance(row.get(k), str)]
        if missing:
            raise GSM8KError(f"{where}: missing or non-string field(s) {', '.join(missing)}")
        rows.append(row)
    return rows


def convert_split(
    examples: Iterable[dict[str, str]], split: str, origin: str, variant: str = "single"
) -> pa.Table:
    """Rows {question, answer} → a verl-schema table (`variant`: one of `VARIANTS`); `origin` (file or
    hub split) names errors."""
    make, schema = VARIANTS[variant]
    rows = []
    for index, example in enumerate(examples):
        try:
            rows.append(make(example["question"], example["answer"], split, index))
        except GSM8KError as err:
            raise GSM8KError(f"{origin}, row {index}: {err}") from err
    return pa.Table.from_pylist(rows, schema=schema)


def _load_local(folder: Path) -> dict[str, tuple[list[dict[str, str]], str]]:
    missing = [str(folder / f"{s}.jsonl") for s in SPLITS if not (folder / f"{s}.jsonl").is_file()]
    if missing:
        raise GSM8KError(f"GSM8K source folder lacks {', '.join(missing)}; {DOWNLOAD_HINT}")
    return {s: (read_jsonl(folder / f"{s}.jsonl"), str(folder / f"{s}.jsonl")) for s in SPLITS}


def _load_hub(name: str) -> dict[str, tuple[list[dict[str, str]], str]]:
    try:
        import datasets
    except ImportError as err:
        raise GSM8KError(
            f"--src {name} needs the `datasets` package, which is not installed: `pip install datasets`, or "
            f"{DOWNLOAD_HINT}"
        ) from err
    try:
        loaded = datasets.load_dataset(name, "main")
    except Exception as err:  # offline, hub down, auth: all end the same way for the user
        raise GSM8KError(f"could not load {name} from the Hugging Face hub ({err}); {DOWNLOAD_HINT}") from err
    return {s: (list(loaded[s]), f"{name} [{s}]") for s in SPLITS}


def prepare_gsm8k(src: str | Path, out_dir: str | Path, variant: str = "single") -> dict[str, Path]:
    """Write `out_dir/train.parquet` and `out_dir/test.parquet` from `src` (`variant`: verl's single-turn
    rows, or one of its multi-turn variants, `VARIANTS`); return the paths by split."""
    src_path = Path(src).expanduser()
    if src_path.is_dir():
        splits = _load_local(src_path)
    elif str(src) == HUB_NAME:
        splits = _load_hub(HUB_NAME)
    else:
        raise GSM8KError(f"--src {src}: not a folder, nor the hub name {HUB_NAME}; {DOWNLOAD_HINT}")
    out = Path(out_dir).expanduser()
    # Convert both before writing either, so a bad test split leaves no half-written output behind.
    tables = {
        split: convert_split(examples, split, origin, variant) for split, (examples, origin) in splits.items()
    }
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, table in tables.items():
        paths[split] = out / f"{split}.parquet"
        pq.write_table(table, paths[split])
    return paths
