"""Tool calls in a model's message, in the Hermes format of Qwen's chat template.

Qwen2.5's template asks for each call as

    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

and a message may hold several. `parse_hermes(text)` returns the text without the call blocks and the
calls in order, each with its arguments re-serialised as JSON (verl's `FunctionCall.arguments` is a JSON
string too). As in verl's HermesToolParser, a message without both tags has no calls, and a block with
no closing tag (a response cut by the length limit) is not a call.

One difference from verl: verl logs a malformed block and drops it, so the model never learns its call
failed. Here the block becomes a FunctionCall whose `error` says what is wrong (not JSON, no name,
arguments not an object), and the agent loop answers it like any other call, with that error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class FunctionCall:
    """One call: the function's name and its arguments as a JSON object string, or why it is unusable."""

    name: str
    arguments: str = "{}"
    error: str | None = None

    def parsed_arguments(self) -> dict[str, Any]:
        """The arguments as a dict (a ValueError when they are not a JSON object)."""
        value = json.loads(self.arguments)
        if not isinstance(value, dict):
            raise ValueError(f"arguments must be a JSON object, got {type(value).__name__}")
        return value


@dataclass(frozen=True)
class ParsedMessage:
    """A message split into its text (call blocks removed) and its calls, in the order written."""

    content: str
    calls: list[FunctionCall] = field(default_factory=list)


def parse_call(block: str) -> FunctionCall:
    """One `<tool_call>` block's JSON as a FunctionCall; a FunctionCall with `error` when malformed.

    `arguments` may be an object, or a string holding one (some models write it that way).
    """
    try:
        payload = json.loads(block)
    except json.JSONDecodeError as err:
        return FunctionCall(name="", error=f"the tool call is not valid JSON ({err.msg} at char {err.pos})")
    except RecursionError:
        return FunctionCall(name="", error="the tool call nests too deeply to be read")
    if not isinstance(payload, dict):
        return FunctionCall(
            name="", error='the tool call must be a JSON object {"name": ..., "arguments": {...}}'
        )
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return FunctionCall(name="", error='the tool call has no "name" string')
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return FunctionCall(name=name, error=f'"arguments" of {name} must be a JSON object')
    try:
        return FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))
    except (RecursionError, ValueError):
        return FunctionCall(name=name, error=f'"arguments" of {name} nest too deeply to be read')


def hermes_call(name: str, arguments: dict[str, Any]) -> str:
    """One call written in the Hermes format, as `parse_hermes` reads it back (and Qwen's template
    renders a `tool_calls` entry): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""
    return f"{TOOL_CALL_START}\n{json.dumps({'name': name, 'arguments': arguments})}\n{TOOL_CALL_END}"


def parse_hermes(text: str) -> ParsedMessage:
    """The calls of a decoded assistant message written in the Hermes format (see the module docstring)."""
    if TOOL_CALL_START not in text or TOOL_CALL_END not in text:
        return ParsedMessage(content=text)
    calls = [parse_call(block) for block in _TOOL_CALL.findall(text)]
    return ParsedMessage(content=_TOOL_CALL.sub("", text), calls=calls)


# `actor_rollout_ref.rollout.multi_turn.format` → parser. verl also has "gpt-oss" (OpenAI's harmony
# format), which needs the model's special tokens kept at decoding; not provided here.
PARSERS: dict[str, Callable[[str], ParsedMessage]] = {"hermes": parse_hermes}


def get_parser(format: str) -> Callable[[str], ParsedMessage]:
    """The parser for `multi_turn.format`; a ValueError naming the key and the formats there are."""
    if format not in PARSERS:
        raise ValueError(
            f"actor_rollout_ref.rollout.multi_turn.format: {format!r} is not supported; "
            f"fulcrum parses {', '.join(sorted(PARSERS))} (Qwen's <tool_call> JSON)"
        )
    return PARSERS[format]
