"""Running one assistant turn's tool calls, as verl's ToolAgentLoop does (`_call_tool`), without ever
raising into the agent loop.

For each call: an unparsable call, an unknown tool or arguments that are not an object become an error
message; otherwise `create(create_kwargs=...)`, `execute(...)`, `release(...)`, and anything the tool
raises becomes `Error when executing tool: <error>` (verl's text). The response text is then cut to
`max_tool_response_length` characters (verl counts characters, not tokens) on
`tool_response_truncate_side`. Each result carries the counters of fulcrum.agent.metrics.

`max_parallel_calls` is verl's: the first that many calls of a turn run, concurrently; verl drops the
rest, and so does `run_turn` (the loop sees how many by comparing lengths).

Every call into a tool (`create`, `execute`, `release`) has a time limit, `multi_turn.call_timeout`,
enforced from outside the call (fulcrum.agent.guard): past it the model reads `Error when executing
tool: ... took longer than N s` and the call counts as `call_timeout`. A tool's answer that is not one
(text that is not a string, a reward that is not a number, metrics that are not a mapping) counts as
`invalid_response`; anything the tool raises, SystemExit included, as `tool_failed`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fulcrum.agent.guard import DEFAULT_TIMEOUT_S, CallExit, CallGuard, CallTimeout
from fulcrum.agent.metrics import call_metrics, error_kinds
from fulcrum.agent.parser import FunctionCall, ParsedMessage, get_parser
from fulcrum.agent.registry import load_tool_config
from fulcrum.agent.schema import ToolResponse
from fulcrum.agent.tool import BaseTool

log = logging.getLogger("fulcrum.agent")

TRUNCATE_SIDES = ("left", "right", "middle")


def truncate_text(text: str, max_length: int, side: str) -> str:
    """`text` cut to `max_length` characters plus a marker, exactly as verl's ToolAgentLoop cuts it.

    verl's sides name what is kept: "left" keeps the beginning (`text[:n] + "...(truncated)"`), "right"
    the end (`"(truncated)..." + text[-n:]`), "middle" both ends, n // 2 characters each.
    """
    if side not in TRUNCATE_SIDES:
        raise ValueError(
            f"actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side: {side!r} is not one of "
            f"{', '.join(TRUNCATE_SIDES)}"
        )
    if len(text) <= max_length:
        return text
    if side == "left":
        return text[:max_length] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-max_length:]
    half = max_length // 2
    return text[:half] + "...(truncated)..." + text[-half:]


@dataclass
class ToolCallResult:
    """One call's answer to the model, its step reward (None: the tool gives none) and its counters."""

    name: str
    response: ToolResponse
    reward: float | None = 0.0
    metrics: dict[str, float] = field(default_factory=dict)

    def message(self) -> dict[str, Any]:
        """The chat message for a text-only answer, as verl builds it: `{"role": "tool", "content": ...}`."""
        return {"role": "tool", "content": self.response.text or ""}


def failed(name: str, error: str, kind: str) -> ToolCallResult:
    """A call that gives the model `Error when executing tool: <error>` and counts one `kind` error."""
    return ToolCallResult(
        name=name,
        response=ToolResponse(text=f"Error when executing tool: {error}"),
        reward=0.0,
        metrics=call_metrics([kind]),
    )


def invalid_answer(response: Any, reward: Any, metrics: Any) -> str | None:
    """What is wrong with a tool's `(response, reward, metrics)`, or None when it can be used: the
    response a ToolResponse whose text is a string (or None), or a bare string (verl's tools sometimes
    return one); the reward a number or None; the metrics a mapping or None."""
    text = response.text if isinstance(response, ToolResponse) else response
    if text is not None and not isinstance(text, str):
        return f"the tool returned text of type {type(text).__name__}, not a string"
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
        return f"the tool returned a reward of type {type(reward).__name__} ({reward!r:.40}), not a number"
    if metrics is not None and not isinstance(metrics, Mapping):
        return f"the tool returned metrics of type {type(metrics).__name__}, not a mapping"
    return None


class ToolSet:
    """The run's tools by name, with verl's multi_turn limits on calls and responses."""

    def __init__(
        self,
        tools: Sequence[BaseTool],
        max_parallel_calls: int = 1,
        max_tool_response_length: int = 256,
        tool_response_truncate_side: str = "middle",
        format: str = "hermes",
        call_timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if max_parallel_calls < 1 or max_tool_response_length < 1:
            raise ValueError(
                "actor_rollout_ref.rollout.multi_turn: max_parallel_calls and max_tool_response_length must be "
                f"at least 1, got {max_parallel_calls} and {max_tool_response_length}"
            )
        truncate_text("", 1, tool_response_truncate_side)  # the side is checked now, not at the first call
        self.tools = {tool.name: tool for tool in tools}
        self.max_parallel_calls = max_parallel_calls
        self.max_tool_response_length = max_tool_response_length
        self.truncate_side = tool_response_truncate_side
        self.parse = get_parser(format)
        self.guard = CallGuard(call_timeout)
        for tool in tools:
            own = getattr(getattr(tool, "limits", None), "timeout_s", None)
            if isinstance(own, (int, float)) and own >= call_timeout:
                raise ValueError(
                    f"tool {tool.name}: its own time limit ({own:g} s, config.default_timeout) must be below "
                    f"actor_rollout_ref.rollout.multi_turn.call_timeout ({call_timeout:g} s)"
                )

    @classmethod
    def from_config(cls, multi_turn: Any) -> ToolSet:
        """From `actor_rollout_ref.rollout.multi_turn` (any object with verl's attribute names)."""
        path = getattr(multi_turn, "tool_config_path", None)
        return cls(
            load_tool_config(path) if path else [],
            max_parallel_calls=getattr(multi_turn, "max_parallel_calls", 1),
            max_tool_response_length=getattr(multi_turn, "max_tool_response_length", 256),
            tool_response_truncate_side=getattr(multi_turn, "tool_response_truncate_side", "middle"),
            format=getattr(multi_turn, "format", "hermes"),
            call_timeout=getattr(multi_turn, "call_timeout", DEFAULT_TIMEOUT_S),
        )

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' schemas for `tokenizer.apply_chat_template(messages, tools=...)`."""
        return [tool.tool_schema.to_dict() for tool in self.tools.values()]

    def parse_message(self, text: str) -> ParsedMessage:
        """The calls in a decoded assistant message (multi_turn.format)."""
        return self.parse(text)

    async def call(
        self, call: FunctionCall, tools_kwargs: Mapping[str, Any] | None = None, **execute_kwargs: Any
    ) -> ToolCallResult:
        """Run one call; every failure becomes the result's text and counters, never an exception.

        `tools_kwargs` is the sample's `extra_info.tools_kwargs`: `{tool name: {"create_kwargs": {...}}}`.
        `execute_kwargs` go to `execute` as they are (verl passes `agent_data`).
        """
        if call.error is not None:
            return failed(call.name, call.error, "invalid_call")
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            return failed(call.name, f"unknown tool {call.name!r} (tools: {known})", "invalid_call")
        try:
            arguments = call.parsed_arguments()
        except (ValueError, RecursionError) as err:
            return failed(
                call.name, f"the arguments could not be read ({type(err).__name__})", "invalid_call"
            )
        create_kwargs = ((tools_kwargs or {}).get(call.name) or {}).get("create_kwargs") or {}
        instance_id = None
        guard = self.guard
        try:
            created = await guard.run(
                tool, lambda: tool.create(create_kwargs=create_kwargs), f"{call.name}.create"
            )
            instance_id = created[0]
            outcome = await guard.run(
                tool, lambda: tool.execute(instance_id, arguments, **execute_kwargs), f"{call.name}.execute"
            )
        except CallTimeout as err:
            return failed(call.name, str(err), "call_timeout")
        except (Exception, SystemExit) as err:
            log.warning("tool %s raised: %r", call.name, err)
            exited = isinstance(err, (SystemExit, CallExit))
            said = f"the tool raised SystemExit({err.code!r})" if exited else str(err)
            return failed(call.name, said, "tool_failed")
        finally:
            if instance_id is not None:
                await self._release(tool, instance_id)
        if not (isinstance(outcome, tuple) and len(outcome) == 3):
            return failed(call.name, "execute must return (response, reward, metrics)", "invalid_response")
        problem = invalid_answer(*outcome)
        if problem:
            log.warning("tool %s: %s", call.name, problem)
            return failed(call.name, problem, "invalid_response")
        response, reward, metrics = outcome
        return self._answer(call.name, response, reward, metrics or {})

    async def run_turn(
        self,
        calls: Sequence[FunctionCall],
        tools_kwargs: Mapping[str, Any] | None = None,
        **execute_kwargs: Any,
    ) -> list[ToolCallResult]:
        """The first `max_parallel_calls` calls of a turn, run concurrently, results in call order."""
        chosen = list(calls)[: self.max_parallel_calls]
        return list(await asyncio.gather(*(self.call(c, tools_kwargs, **execute_kwargs) for c in chosen)))

    async def _release(self, tool: BaseTool, instance_id: str) -> None:
        """`tool.release`, logged instead of raised: the answer is already there."""
        try:
            await self.guard.run(tool, lambda: tool.release(instance_id), f"{tool.name}.release")
        except (Exception, SystemExit) as err:
            log.warning("tool %s: release(%s) raised: %r", tool.name, instance_id, err)

    def _answer(
        self, name: str, response: Any, reward: float | None, metrics: Mapping[str, float]
    ) -> ToolCallResult:
        """The tool's answer with its text cut to length and the call's counters added."""
        if not isinstance(response, ToolResponse):
            # verl's tools sometimes return a bare string; accept it rather than fail the call.
            response = ToolResponse(text=response)
        text = response.text
        if text:
            text = truncate_text(text, self.max_tool_response_length, self.truncate_side)
        # A tool's own numbers pass through; anything else it put in the dict is not a counter.
        counters = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not k.startswith("tools/")
        }
        counters.update(call_metrics(error_kinds(metrics)))
        return ToolCallResult(
            name=name,
            response=ToolResponse(text=text, image=response.image, video=response.video),
            reward=reward,
            metrics=counters,
        )
