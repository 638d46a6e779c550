"""The RL prompt data set: verl-schema parquet rows → chat-templated prompt token ids, and its loader.

`RLHFDataset` reads one or several parquet files at once, applies the tokenizer's chat template
(with the generation prompt) to every row's `prompt` messages in one batched tokenizer call, and
handles `max_prompt_length` as verl does: `filter_overlong_prompts` drops longer prompts (and logs
how many); the remaining overlong ones are cut by `truncation` (`left` keeps the end, `right` the
start, `middle` both ends) or, with `error`, stop construction with the file, row and length.

`PromptLoader` batches items over epochs with a seeded shuffle whose order depends only on
(seed, epoch), so `state_dict()` = {epoch, position, seed} resumes exactly where a run stopped.
`left_pad` makes the padded (B, L) prompt tensors generation wants.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from fulcrum.data.budgets import budget_problem

logger = logging.getLogger(__name__)

TRUNCATIONS = ("error", "left", "right", "middle")
REQUIRED_COLUMNS = ("data_source", "reward_model")  # besides the prompt column


class DatasetError(ValueError):
    """Bad prompt data; the message names the file, and the row or column where it applies."""


def _read_parquet(path: Path, prompt_key: str) -> list[dict[str, Any]]:
    """The rows of one verl-schema parquet file as dicts, with the columns the data set uses."""
    if not path.is_file():
        raise DatasetError(f"data file not found: {path}")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise DatasetError(f"{path}: not a readable parquet file ({err})") from err
    columns = table.column_names
    for column in (prompt_key, *REQUIRED_COLUMNS):
        if column not in columns:
            raise DatasetError(f"{path}: missing column {column!r} (columns: {', '.join(columns)})")
    wanted = [
        c for c in (prompt_key, *REQUIRED_COLUMNS, "extra_info", "ability", "agent_name") if c in columns
    ]
    return table.select(wanted).to_pylist()


def _check_row(row: dict[str, Any], prompt_key: str, where: str) -> None:
    messages = row[prompt_key]
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") for m in messages
        )
    ):
        raise DatasetError(
            f"{where}: column {prompt_key!r} must be a non-empty list of chat messages "
            f"{{role, content}}, got {str(messages)[:100]}"
        )
    reward = row["reward_model"]
    if not isinstance(reward, dict) or reward.get("ground_truth") is None:
        raise DatasetError(f"{where}: column 'reward_model' has no 'ground_truth' (got {str(reward)[:100]})")
    problem = budget_problem(row.get("extra_info"))
    if problem:
        raise DatasetError(f"{where}: {problem}")


def truncate(ids: list[int], max_length: int, side: str) -> list[int]:
    """ids cut to max_length tokens: `left` keeps the last, `right` the first, `middle` both halves."""
    if len(ids) <= max_length:
        return ids
    if side == "left":
        return ids[-max_length:]
    if side == "right":
        return ids[:max_length]
    if side == "middle":
        head = max_length // 2
        return ids[:head] + ids[len(ids) - (max_length - head) :]
    raise ValueError(f"truncation must be one of {TRUNCATIONS}, got {side!r}")


class RLHFDataset:
    """Prompts of one or several verl-schema parquet files, tokenized with the chat template.

    Item i: {input_ids: list[int], data_source: str, ground_truth: str, extra_info: dict,
    index: int (extra_info's index, else the row number in its file), raw_prompt: list[dict], ability: str,
    agent_name: str | None (verl's column naming a row's agent loop), source: "file:row"}.

    `tools`: the tool schemas of a multi-turn run; the chat template renders them into every prompt
    (Qwen's puts them in the system block), so the length limits count the prompt the model sees.
    """

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        max_prompt_length: int,
        truncation: str = "error",
        filter_overlong_prompts: bool = True,
        prompt_key: str = "prompt",
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        if truncation not in TRUNCATIONS:
            raise DatasetError(f"data.truncation must be one of {', '.join(TRUNCATIONS)}, got {truncation!r}")
        if max_prompt_length < 1:
            raise DatasetError(f"data.max_prompt_length must be >= 1, got {max_prompt_length}")
        if not getattr(tokenizer, "chat_template", None):
            raise DatasetError(
                f"the tokenizer of {getattr(tokenizer, 'name_or_path', '?')} has no chat template; "
                "RL prompts are chat messages, so the model folder needs one (chat_template.jinja)"
            )
        paths = [Path(files)] if isinstance(files, (str, Path)) else [Path(f) for f in files]
        if not paths:
            raise DatasetError("no data files given")
        self.files = paths
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation

        rows: list[dict[str, Any]] = []
        origins: list[tuple[Path, int]] = []  # (file, row in file) of every row, for messages
        for path in paths:
            file_rows = _read_parquet(path, prompt_key)
            for row_no, row in enumerate(file_rows):
                _check_row(row, prompt_key, f"{path}, row {row_no}")
                origins.append((path, row_no))
            rows.extend(file_rows)

        messages = [row[prompt_key] for row in rows]
        with_tools: dict[str, Any] = {"tools": tools} if tools else {}
        texts = (
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **with_tools)
            if rows
            else []
        )
        # One batched call: the Rust tokenizer does 7.5k GSM8K prompts in about a second.
        all_ids = (
            tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
            if rows
            else []
        )

        self.items: list[dict[str, Any]] = []
        dropped = 0
        for (path, row_no), row, ids in zip(origins, rows, all_ids, strict=True):
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    dropped += 1
                    continue
                if truncation == "error":
                    raise DatasetError(
                        f"{path}, row {row_no}: prompt is {len(ids)} tokens, "
                        f"longer than data.max_prompt_length={max_prompt_length} (set data.truncation=left|right"
                        "|middle, or data.filter_overlong_prompts=True)"
                    )
                ids = truncate(ids, max_prompt_length, truncation)
            extra_info = dict(row.get("extra_info") or {})
            ground_truth = row["reward_model"]["ground_truth"]
            self.items.append(
                {
                    "input_ids": list(ids),
                    "data_source": row["data_source"],
                    # Numbers become strings (the rule scorers compare strings); lists etc. stay as written.
                    "ground_truth": str(ground_truth)
                    if isinstance(ground_truth, (int, float))
                    else ground_truth,
                    "extra_info": extra_info,
                    "index": int(extra_info.get("index", row_no)),
                    "raw_prompt": row[prompt_key],
                    "ability": row.get("ability"),
                    "agent_name": row.get("agent_name"),
                    "source": f"{path}:{row_no}",
                }
            )
        self.num_filtered = dropped
        if dropped:
            logger.warning(
                "dropped %d of %d prompts longer than max_prompt_length=%d tokens (%s)",
                dropped,
                len(rows),
                max_prompt_length,
                ", ".join(map(str, paths)),
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def require_prompts(dataset: RLHFDataset, key: str, batch_size: int = 1, batch_key: str = "") -> None:
    """A DatasetError naming the key and files when `dataset` has fewer than `batch_size` prompts.

    An empty validation file would otherwise train without a validation metric, and a training
    file smaller than the batch would fail later without naming the file.
    """
    if len(dataset) >= max(batch_size, 1):
        return
    files = ", ".join(map(str, dataset.files))
    filtered = (
        f" ({dataset.num_filtered} longer than data.max_prompt_length were dropped)"
        if dataset.num_filtered
        else ""
    )
    if len(dataset) == 0:
        raise DatasetError(f"{key}: {files} holds no prompts{filtered}; give a file with rows")
    raise DatasetError(
        f"{key}: {files} holds {len(dataset)} prompt(s){filtered}, fewer than {batch_key}={batch_size}: "
        f"not one full batch. Use more data or a smaller {batch_key}."
    )


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists to the longest: input_ids (B, L) long, attention_mask (B, L) long (1 = token)."""
    if not sequences:
        raise ValueError("left_pad: no sequences")
    length = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, ids in enumerate(sequences):
        if len(ids):
            input_ids[row, length - len(ids) :] = torch.as_tensor(list(ids), dtype=torch.long)
            attention_mask[row, length - len(ids) :] = 1
    return input_ids, attention_mask


class PromptLoader:
    """Batches (lists of items) of a data set, epoch after epoch, exactly resumable.

    Each `iter()` yields the rest of the current epoch; the order of epoch e is a permutation drawn
    from (seed, e) alone, so a loader restored from `state_dict()` continues with the same batches.
    The position is kept in prompts, so a run resumed with another batch size neither repeats nor
    skips a prompt of the epoch.
    """

    def __init__(
        self,
        dataset: Sequence[dict[str, Any]],
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = int(seed)
        self.epoch = 0
        self.offset = 0  # prompts of the current epoch already handed out
        if len(self) == 0:
            raise ValueError(
                f"the data set has {len(dataset)} prompts, fewer than the batch size {batch_size}: no full batch"
            )

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def order(self, epoch: int) -> np.ndarray:
        """The item indices of `epoch`, in the order they are served."""
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def _has_batch(self) -> bool:
        left = len(self.dataset) - self.offset
        return left >= self.batch_size or (left > 0 and not self.drop_last)

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        if not self._has_batch():  # a state saved right after an epoch's last batch
            self.epoch, self.offset = self.epoch + 1, 0
        order = self.order(self.epoch)
        while self._has_batch():
            batch = [self.dataset[int(i)] for i in order[self.offset : self.offset + self.batch_size]]
            # Count the batch as consumed before handing it out: a checkpoint taken while the
            # trainer works on it must resume with the next one.
            self.offset += len(batch)
            yield batch
        self.epoch, self.offset = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        """{epoch, position (batches served this epoch), prompts (prompts served this epoch), seed}."""
        return {
            "epoch": self.epoch,
            "position": -(-self.offset // self.batch_size),
            "prompts": self.offset,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        missing = {"epoch", "position", "seed"} - set(state)
        if missing:
            raise KeyError(f"PromptLoader state lacks {sorted(missing)}")
        self.epoch, self.seed = int(state["epoch"]), int(state["seed"])
        # States written before the position was kept in prompts count batches of this batch size.
        self.offset = (
            int(state["prompts"]) if "prompts" in state else int(state["position"]) * self.batch_size
        )


def rl_datasets(
    data_cfg: Any, tokenizer: Any, tools: list[dict[str, Any]] | None = None
) -> tuple[RLHFDataset, RLHFDataset | None, PromptLoader]:
    """The training set, the validation set (None without `data.val_files`) and the training loader that
    `data_cfg` (`cfg.data`, resolved: `data.seed` set) describes; too few prompts is an error naming the key.
    `tools`: a multi-turn run's tool schemas, templated into every prompt."""
    kwargs: dict[str, Any] = dict(
        max_prompt_length=int(data_cfg.max_prompt_length),
        truncation=data_cfg.truncation,
        filter_overlong_prompts=bool(data_cfg.filter_overlong_prompts),
        prompt_key=data_cfg.prompt_key,
        tools=tools,
    )
    train = RLHFDataset(data_cfg.train_files, tokenizer, **kwargs)
    val = RLHFDataset(data_cfg.val_files, tokenizer, **kwargs) if data_cfg.val_files else None
    require_prompts(train, "data.train_files", int(data_cfg.train_batch_size), "data.train_batch_size")
    if val is not None:
        require_prompts(val, "data.val_files")
    loader = PromptLoader(
        train,
        batch_size=int(data_cfg.train_batch_size),
        shuffle=bool(data_cfg.shuffle),
        seed=int(data_cfg.seed),
    )
    return train, val, loader
