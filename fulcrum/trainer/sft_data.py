"""`fulcrum sft`'s data: prompt/response parquet rows (or conversations, fulcrum.trainer.sft_multiturn)
tokenised through the chat template, and their right-padded batches with the loss mask of the response
tokens. `cfg` is the SFT `data` section (fulcrum.trainer.sft.SFTDataConfig); errors name the key, or the
file, row and column."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch

from fulcrum.trainer.sft_multiturn import load_chats


@dataclass
class SFTExample:
    input_ids: list[int]  # prompt (chat template, generation prompt) + response + EOS
    num_prompt_tokens: int  # the loss counts the tokens after these
    loss_mask: list[int] | None = None  # a conversation's: 1 on assistant tokens (num_prompt_tokens unused)

    def mask(self) -> list[int]:
        """1 where the token is a target of the loss."""
        if self.loss_mask is not None:
            return self.loss_mask
        return [0] * self.num_prompt_tokens + [1] * (len(self.input_ids) - self.num_prompt_tokens)


def _as_list(files: Any) -> list[str]:
    return [files] if isinstance(files, str) else [str(f) for f in files]


def _pick(value: Any, dict_keys: list[str], where: str) -> Any:
    """Follow `dict_keys` into a dict cell (verl's extra_info); non-dict cells are returned as they are."""
    for key in dict_keys:
        if not isinstance(value, dict):
            break
        if key not in value:
            raise ValueError(f"{where}: field {key!r} missing (has {sorted(value)})")
        value = value[key]
    return value


def _messages(prompt: Any, where: str) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt):
        return [{"role": str(m.get("role", "user")), "content": str(m["content"])} for m in prompt]
    raise ValueError(f"{where}: prompt must be text or a list of chat messages, got {type(prompt).__name__}")


def check_files(files: Any, key: str) -> None:
    """Each parquet file of `key` exists and holds rows; errors name the key and the file."""
    for path in _as_list(files):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{key}: SFT data file not found: {path}")
        try:
            rows = pq.ParquetFile(path).metadata.num_rows
        except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
            raise ValueError(f"{key}: {path} is not a readable parquet file ({err})") from None
        if rows == 0:
            raise ValueError(f"{key}: {path} has no rows")


def load_examples(files: Any, tokenizer: Any, cfg: Any, key: str = "data.train_files") -> list[SFTExample]:
    """Tokenise every row of the parquet `files` (the value of `key`); errors name the key or the file,
    row and column."""
    check_files(files, key)
    if cfg.multiturn.enable:
        chats = load_chats(_as_list(files), tokenizer, cfg)
        if not chats:
            raise ValueError(f"no SFT examples in {files}")
        return [SFTExample(c.input_ids, 0, c.loss_mask) for c in chats]
    examples: list[SFTExample] = []
    for path in _as_list(files):
        table = pq.read_table(path)
        for column in (cfg.prompt_key, cfg.response_key):
            if column not in table.column_names:
                raise ValueError(f"{path}: no column {column!r} (columns: {table.column_names})")
        prompts = table.column(cfg.prompt_key).to_pylist()
        responses = table.column(cfg.response_key).to_pylist()
        prompt_texts, response_texts = [], []
        for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
            where = f"{path} row {row}"
            messages = _messages(
                _pick(prompt, cfg.prompt_dict_keys, f"{where} column {cfg.prompt_key!r}"), where
            )
            response = _pick(response, cfg.response_dict_keys, f"{where} column {cfg.response_key!r}")
            if not isinstance(response, str):
                raise ValueError(f"{where} column {cfg.response_key!r}: response must be text")
            prompt_texts.append(
                tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            )
            response_texts.append(response + tokenizer.eos_token)
        # One batched call per file: tokenising thousands of rows one by one is slow.
        prompt_ids = tokenizer(prompt_texts, add_special_tokens=False)["input_ids"]
        response_ids = tokenizer(response_texts, add_special_tokens=False)["input_ids"]
        for row, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
            ids, num_prompt = list(p) + list(r), len(p)
            if len(ids) > cfg.max_length:
                if cfg.truncation == "error":
                    raise ValueError(
                        f"{path} row {row}: {len(ids)} tokens > data.max_length={cfg.max_length} "
                        "(raise it or set data.truncation=left|right)"
                    )
                cut = len(ids) - cfg.max_length
                ids = ids[cut:] if cfg.truncation == "left" else ids[: cfg.max_length]
                num_prompt = (
                    max(num_prompt - cut, 0) if cfg.truncation == "left" else min(num_prompt, len(ids))
                )
            examples.append(SFTExample(ids, num_prompt))
    if not examples:
        raise ValueError(f"no SFT examples in {files}")
    return examples


def collate(examples: list[SFTExample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask` and `loss_mask`, each (B, T).

    `loss_mask[b, t] = 1` when token t of example b is a response token, i.e. a target of the loss.
    """
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for b, e in enumerate(examples):
        input_ids[b, : len(e.input_ids)] = torch.tensor(e.input_ids)
        attention_mask[b, : len(e.input_ids)] = 1
        loss_mask[b, : len(e.input_ids)] = torch.tensor(e.mask())
    return input_ids, attention_mask, loss_mask
