"""`fulcrum sft` on multi-turn conversations, as verl's `MultiTurnSFTDataset` (`data.multiturn.enable`).

Each row's `messages_key` column holds a chat (system, user, assistant, tool, ... messages) and its
`tools_key` column, when present, the OpenAI function schemas the template shows with the first
message. Every message is rendered alone by the chat template and the pieces concatenated, as verl
does: messages after the first lose the system block the template puts in front of any conversation
(`fulcrum.agent.chat.system_block`, the delta the agent loop appends between turns). The loss counts
the tokens of assistant messages only, less their generation prompt (`<|im_start|>assistant\\n`):
what the policy writes in an RL rollout, tool calls included. System, user and tool messages have
loss mask 0, as the agent loop gives the tool answers it appends.

An assistant message's generation prompt and its content are tokenized apart, as a rollout has them
(the prompt ends with the generation prompt; the sampled tokens follow), so a token never straddles
the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from fulcrum.agent.chat import render, system_block


@dataclass
class SFTMultiturnConfig:
    """verl's `data.multiturn` section."""

    enable: bool = False  # rows are conversations (`messages_key`) rather than prompt/response pairs
    messages_key: str = "messages"  # column holding the list of chat messages
    tools_key: str = "tools"  # column holding the tool schemas (optional)
    enable_thinking_key: str = "enable_thinking"  # column passed as the template's enable_thinking


@dataclass
class TokenizedChat:
    """One conversation's token ids and per-token loss mask (1 = a target of the loss)."""

    input_ids: list[int]
    loss_mask: list[int]


def generation_prompt(tokenizer: Any) -> str:
    """The text the template adds for `add_generation_prompt=True` (`<|im_start|>assistant\\n`)."""
    empty = [{"role": "user", "content": ""}]
    with_prompt = render(tokenizer, empty, add_generation_prompt=True)
    without = render(tokenizer, empty, add_generation_prompt=False)
    if not with_prompt.startswith(without):
        raise ValueError("the chat template's generation prompt is not a suffix of the conversation")
    return with_prompt[len(without) :]


def _encode(tokenizer: Any, text: str) -> list[int]:
    """`text` as ids, no special tokens added (the template wrote them)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def tokenize_chat(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **kwargs: Any
) -> TokenizedChat:
    """`messages` rendered one by one and concatenated; loss on the assistant messages after their
    generation prompt. `kwargs` go to the chat template (`enable_thinking`)."""
    prefix, prompt = system_block(tokenizer), generation_prompt(tokenizer)
    ids: list[int] = []
    mask: list[int] = []
    for index, message in enumerate(messages):
        text = render(tokenizer, [message], tools=tools if index == 0 else None, **kwargs)
        if index and message.get("role") != "system":
            if not text.startswith(prefix):
                raise ValueError(f"message {index} does not start with the template's system block")
            text = text[len(prefix) :]
        if message.get("role") == "assistant":
            if not text.startswith(prompt):
                raise ValueError(f"assistant message {index} does not start with {prompt!r}")
            head, body = _encode(tokenizer, prompt), _encode(tokenizer, text[len(prompt) :])
            ids += head + body
            mask += [0] * len(head) + [1] * len(body)
        else:
            piece = _encode(tokenizer, text)
            ids += piece
            mask += [0] * len(piece)
    return TokenizedChat(ids, mask)


def _plain(value: Any) -> Any:
    """A parquet cell as plain lists and dicts, null struct fields dropped (pyarrow fills a struct's
    missing keys with None; a message or schema without them is what was written)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def truncate(chat: TokenizedChat, max_length: int, side: str, where: str) -> TokenizedChat:
    """`chat` cut to `max_length` tokens on `side` (left | right), or a ValueError naming `where`
    when `side` is error."""
    if len(chat.input_ids) <= max_length:
        return chat
    if side == "error":
        raise ValueError(
            f"{where}: {len(chat.input_ids)} tokens > data.max_length={max_length} "
            "(raise it or set data.truncation=left|right)"
        )
    cut = slice(len(chat.input_ids) - max_length, None) if side == "left" else slice(0, max_length)
    return TokenizedChat(chat.input_ids[cut], chat.loss_mask[cut])


def load_chats(files: list[str], tokenizer: Any, cfg: Any) -> list[TokenizedChat]:
    """Every row of the parquet `files` tokenized (`cfg` is the SFT `data` section); errors name the
    file, row and column."""
    multiturn: SFTMultiturnConfig = cfg.multiturn
    chats: list[TokenizedChat] = []
    for path in files:
        if not Path(path).is_file():
            raise FileNotFoundError(f"SFT data file not found: {path}")
        table = pq.read_table(path)
        if multiturn.messages_key not in table.column_names:
            raise ValueError(
                f"{path}: no column {multiturn.messages_key!r} (data.multiturn.messages_key; "
                f"columns: {table.column_names})"
            )
        messages = table.column(multiturn.messages_key).to_pylist()
        tools = _optional_column(table, multiturn.tools_key)
        thinking = _optional_column(table, multiturn.enable_thinking_key)
        for row, chat in enumerate(messages):
            where = f"{path} row {row}"
            if not isinstance(chat, list) or not all(isinstance(m, dict) and "role" in m for m in chat):
                raise ValueError(
                    f"{where} column {multiturn.messages_key!r}: expected a list of chat messages"
                )
            kwargs = {} if thinking[row] is None else {"enable_thinking": bool(thinking[row])}
            tokenized = tokenize_chat(tokenizer, _plain(chat), _plain(tools[row]) or None, **kwargs)
            chats.append(truncate(tokenized, cfg.max_length, cfg.truncation, where))
    return chats


def _optional_column(table: Any, name: str) -> list[Any]:
    """The column's cells, or a None per row when the table lacks it."""
    return table.column(name).to_pylist() if name in table.column_names else [None] * table.num_rows
