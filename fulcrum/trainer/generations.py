"""`trainer.validation_data_dir`: each validation's generations as `<dir>/<step>.jsonl`, as verl dumps them.

One JSON object per validation sample with verl's keys — `input` (the prompt text, special tokens
kept, as the model saw it), `output` (the response text, special tokens skipped, as the reward
function saw it), `gts` (the ground truth), `score`, `step` — and ours beside them: `data_source`,
`response_length` (tokens) and `finished` (the response ended with the EOS token rather than at the
length limit). Reading these files is how a user checks what the model actually answers (format,
truncation, a reward function that scores the wrong thing) rather than only its mean score.

Each file is written under a temporary name and renamed, so a crash never leaves half a file; an
existing `<step>.jsonl` (a resumed run validating the same step again) is replaced, since it holds the
same step's generations of this run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fulcrum.batch import Batch, response_lengths


def generation_rows(
    batch: Batch, scores: list[float], tokenizer: Any, step: int, prompts: bool = True
) -> list[dict[str, Any]]:
    """One row per sample of a validation batch (verl's keys first, then ours); `prompts` False leaves
    out the decoded prompt (`input`), which only a dump of the generations needs."""
    prompt_lengths = batch["attention_mask"][:, : batch.prompt_length].sum(-1).tolist()
    lengths = response_lengths(batch).tolist()
    eos = tokenizer.eos_token_id
    rows = []
    for i, (p, r) in enumerate(zip(prompt_lengths, lengths, strict=True)):
        response_ids = batch["responses"][i, : int(r)].tolist()
        row: dict[str, Any] = {}
        if prompts:
            prompt_ids = batch["prompts"][i, batch.prompt_length - int(p) :].tolist()
            row["input"] = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        rows.append(
            row
            | {
                "output": tokenizer.decode(response_ids, skip_special_tokens=True),
                "gts": batch.non_tensors["ground_truth"][i],
                "score": float(scores[i]),
                "step": step,
                "data_source": batch.non_tensors["data_source"][i],
                "response_length": int(r),
                "finished": bool(response_ids) and response_ids[-1] == eos,
            }
        )
    return rows


def dump_generations(folder: str | Path, rows: list[dict[str, Any]], step: int) -> Path:
    """Write `rows` to `<folder>/<step>.jsonl` (the folder is created); returns the file's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{step}.jsonl"
    tmp = folder / f".{step}.jsonl.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
