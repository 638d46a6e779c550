"""Tools and interactions cannot stall or crash a step: a call that never returns or blocks the event loop
is abandoned at `multi_turn.call_timeout`; a malformed call, a malformed answer, a tool that exits and an
interaction that fails mid-step each become an error message (or the conversation's end) and a counted
metric, never a traceback. The agent-loop cases run on the native engine with a random model (CPU)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch
from test_agent_loop import PARAMS
from test_interactions import ScriptedTokenizer
from test_rollout_requests import engine_for

from fulcrum.agent import BaseTool, FunctionCall, OpenAIFunctionToolSchema, ToolResponse, ToolSet
from fulcrum.agent.conversations import run_conversations
from fulcrum.agent.interaction import BaseInteraction
from fulcrum.agent.loop import ConversationRequest, LoopLimits, ToolAgentLoop
from fulcrum.agent.metrics import conversation_metrics
from fulcrum.agent.parser import parse_hermes
from fulcrum.agent.python_tool import PythonTool
from fulcrum.rollout.testing import random_causal_lm

SCHEMA = {
    "type": "function",
    "function": {
        "name": "probe",
        "description": "d",
        "parameters": {"type": "object", "properties": {}, "required": []},
    },
}


class Scripted(BaseTool):
    """A user tool whose execute does what `behave` says."""

    def __init__(self, behave: Any) -> None:
        super().__init__({}, OpenAIFunctionToolSchema.from_dict(SCHEMA, "test"))
        self.behave = behave

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        return await self.behave()


def call(behave: Any, timeout: float = 60.0) -> Any:
    toolset = ToolSet([Scripted(behave)], call_timeout=timeout)
    (result,) = asyncio.run(toolset.run_turn([FunctionCall("probe", "{}")]))
    return result


def kinds(result: Any) -> set[str]:
    return {k.split("/")[-1] for k, v in result.metrics.items() if k.startswith("tools/errors/") and v}


def test_a_call_nested_a_thousand_deep_is_an_error_for_the_model_not_a_recursion_error() -> None:
    deep = "[" * 1000 + "]" * 1000
    args = '{"a": ' * 1000 + "1" + "}" * 1000
    for block in (deep, '{"name": "probe", "arguments": ' + args + "}"):
        parsed = parse_hermes(f"<tool_call>{block}</tool_call>")
        (found,) = parsed.calls
        assert found.error is not None
        (result,) = asyncio.run(ToolSet([Scripted(None)]).run_turn(parsed.calls))
        assert result.response.text.startswith("Error when executing tool:") and kinds(result) == {
            "invalid_call"
        }


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        ((ToolResponse(text=42), None, {}), "text of type int"),  # type: ignore[arg-type]
        (({"answer": 1}, None, {}), "text of type dict"),
        ((ToolResponse(text="ok"), "high", {}), "a reward of type str"),
        ((ToolResponse(text="ok"), None, ["x"]), "metrics of type list"),
        ("just text", "execute must return (response, reward, metrics)"),
    ],
)
def test_an_answer_that_is_not_one_is_an_error_for_the_model(answer: Any, said: str) -> None:
    async def behave() -> Any:
        return answer

    result = call(behave)
    assert result.response.text == f"Error when executing tool: {result.response.text.split(': ', 1)[1]}"
    assert said in result.response.text and kinds(result) == {"invalid_response"}
    assert result.reward == 0.0


def test_a_tool_raising_system_exit_is_a_failed_call() -> None:
    async def behave() -> Any:
        raise SystemExit(3)

    result = call(behave)
    assert result.response.text == "Error when executing tool: the tool raised SystemExit(3)"
    assert kinds(result) == {"tool_failed"}


def test_a_fulcrum_tool_raising_system_exit_is_a_failed_call_and_the_loop_goes_on() -> None:
    async def behave() -> Any:
        raise SystemExit(3)

    class Own(Scripted):  # one of fulcrum's own tools runs on the agent loop itself, not on a worker
        pass

    Own.__module__ = "fulcrum.agent.own_tool"

    # the SystemExit must not escape the event loop (asyncio.run would raise it)
    (result,) = asyncio.run(ToolSet([Own(behave)]).run_turn([FunctionCall("probe", "{}")]))
    assert result.response.text == "Error when executing tool: the tool raised SystemExit(3)"
    assert kinds(result) == {"tool_failed"}


def test_an_execute_that_never_returns_is_abandoned_at_the_limit() -> None:
    async def behave() -> Any:
        await asyncio.Event().wait()

    started = time.monotonic()
    result = call(behave, timeout=0.5)
    assert time.monotonic() - started < 3
    assert "took longer than 0.5 s" in result.response.text and kinds(result) == {"call_timeout"}


def test_an_execute_that_blocks_the_loop_does_not_stall_the_others() -> None:
    async def sleeps() -> Any:
        time.sleep(5)  # blocks whatever loop runs it
        return ToolResponse(text="late"), None, {}

    async def answers() -> Any:
        return ToolResponse(text="fine"), None, {}

    toolset = ToolSet([Scripted(sleeps)], call_timeout=0.5)
    ticks: list[float] = []

    async def go() -> Any:
        async def ticker() -> None:
            for _ in range(10):
                ticks.append(time.monotonic())
                await asyncio.sleep(0.05)

        (stuck,), _ = await asyncio.gather(toolset.run_turn([FunctionCall("probe", "{}")]), ticker())
        toolset.tools["probe"].behave = answers  # type: ignore[attr-defined]
        (after,) = await toolset.run_turn([FunctionCall("probe", "{}")])
        return stuck, after

    started = time.monotonic()
    stuck, after = asyncio.run(go())
    assert time.monotonic() - started < 3
    assert kinds(stuck) == {"call_timeout"} and after.response.text == "fine"
    assert len(ticks) == 10 and ticks[-1] - ticks[0] < 1.5  # the agent's loop kept turning


def test_the_python_tools_own_limit_must_be_below_the_call_limit() -> None:
    with pytest.raises(ValueError, match=r"multi_turn\.call_timeout"):
        ToolSet([PythonTool({"default_timeout": 90}, None)], call_timeout=60)


# ------------------------------------------------------------------------- interactions in the loop
class Failing(BaseInteraction):
    """A user that answers once, then fails in the way `how` says."""

    def __init__(self, how: str) -> None:
        super().__init__({"name": "u"})
        self.how = how
        self.asked = 0

    async def generate_response(self, instance_id: str, messages: list, **kwargs: Any) -> Any:
        self.asked += 1
        if self.asked == 1:
            return False, "try again", 0.0, {}
        if self.how == "raise":
            raise RuntimeError("the judge is down")
        if self.how == "exit":
            raise SystemExit(2)
        if self.how == "hang":
            time.sleep(3)
        return "not a reply"


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    return random_causal_lm("qwen2", init_std=0.2)


@pytest.mark.parametrize(
    ("how", "kind"), [("raise", "failed"), ("exit", "failed"), ("bad", "failed"), ("hang", "timeout")]
)
def test_an_interaction_failing_mid_step_ends_its_conversation_and_is_counted(
    model, how: str, kind: str
) -> None:
    engine = engine_for(model)
    user = Failing(how)
    tools = ToolSet([], call_timeout=0.5)
    loop = ToolAgentLoop(
        tools, ScriptedTokenizer(["a", "b", "c"]), LoopLimits(response_length=240), {"u": user}
    )
    request = ConversationRequest(
        [5, 6, 7, 8], [{"role": "user", "content": "q"}], interaction_kwargs={"name": "u"}
    )
    [c] = run_conversations(engine, loop, [request], PARAMS)
    assert (c.assistant_turns, c.user_turns) == (2, 1)  # the second reply never came
    assert c.metrics["interaction/errors"] == 1.0 and c.metrics[f"interaction/errors/{kind}"] == 1.0
    assert conversation_metrics([c.num_turns], [c.metrics])[f"interaction/errors/{kind}"] == 1.0
    assert engine.counters["held"] == 0
