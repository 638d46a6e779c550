"""The tool agent loop over the native engine (random model, CPU): tool answers appended as the chat
template renders them and masked out of the loss, verl's turn and budget limits, held blocks released;
the template delta; the batch's multi-turn metrics by hand."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_rollout_requests import engine_for

from fulcrum.agent import BaseTool, OpenAIFunctionToolSchema, ToolResponse, ToolSet
from fulcrum.agent.chat import ChatDelta
from fulcrum.agent.conversations import run_conversations
from fulcrum.agent.loop import SINGLE_TURN_AGENT, ConversationRequest, LoopLimits, ToolAgentLoop, request_of
from fulcrum.agent.metrics import conversation_metrics
from fulcrum.agent.parser import FunctionCall, ParsedMessage
from fulcrum.rollout import SamplingParams
from fulcrum.rollout.testing import random_causal_lm

# Nearly every id ends a turn, so the random model's turns are a token or two long.
PARAMS = SamplingParams(temperature=1.0, max_tokens=1, seed=3, stop_token_ids=list(range(3, 240)))


class ByteTokenizer:
    """Characters as ids 3..252 and a Qwen-like template that adds a default system block."""

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, **kw: Any) -> str:
        text = "" if messages and messages[0]["role"] == "system" else "<s>default</s>\n"
        text += "".join(f"<{m['role']}>{m['content']}</{m['role']}>\n" for m in messages)
        return text + ("<assistant>" if kw.get("add_generation_prompt") else "")

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [3 + b % 250 for b in text.encode()]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)


class Echo(BaseTool):
    async def execute(
        self, instance_id: str, parameters: dict, **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text=f"got {parameters['v']}"), 0.5, {}


ECHO_SCHEMA = {"type": "function", "function": {"name": "echo", "description": "echoes v"}}


def tool_set() -> ToolSet:
    tools = ToolSet([Echo({}, OpenAIFunctionToolSchema.from_dict(ECHO_SCHEMA, "test"))])
    tools.parse = lambda text: ParsedMessage(text, [FunctionCall("echo", '{"v": 7}')])
    return tools


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    return random_causal_lm("qwen2", init_std=0.2)


def run(
    model: torch.nn.Module, limits: LoopLimits, agent: str = "tool_agent", n: int = 2
) -> tuple[list, Any]:
    engine = engine_for(model)
    loop = ToolAgentLoop(tool_set(), ByteTokenizer(), limits)
    requests = [ConversationRequest([5, 6, 7, 8], [{"role": "user", "content": "q"}], agent_name=agent)] * 2
    return run_conversations(engine, loop, requests, SamplingParams(**{**PARAMS.__dict__, "n": n})), engine


def zero_runs(mask: list[int], ids: list[int]) -> list[list[int]]:
    runs, start = [], None
    for i, m in enumerate([*mask, 1]):
        if m == 0 and start is None:
            start = i
        elif m == 1 and start is not None:
            runs.append(ids[start:i])
            start = None
    return runs


ANSWER = ByteTokenizer()("<tool>got 7</tool>\n<assistant>")["input_ids"]


def test_tool_answers_are_appended_as_the_template_renders_them_and_masked(model) -> None:
    conversations, engine = run(model, LoopLimits(response_length=200, max_assistant_turns=3))
    assert [c.prompt_index for c in conversations] == [0, 0, 1, 1]
    for c in conversations:
        assert (c.assistant_turns, c.user_turns, c.num_turns) == (3, 2, 6)
        assert zero_runs(c.loss_mask, c.token_ids) == [ANSWER, ANSWER]
        assert [lp for lp, m in zip(c.logprobs, c.loss_mask, strict=True) if not m] == [0.0] * 2 * len(ANSWER)
        assert c.tool_rewards == [0.5, 0.5] and c.metrics["tools/calls"] == 2.0
    assert engine.counters["held"] == 0 and engine.counters["blocks_in_use"] == 0


def test_user_turn_limit_and_an_answer_that_would_fill_the_budget_end_the_conversation(model) -> None:
    conversations, _ = run(model, LoopLimits(response_length=200, max_user_turns=1))
    assert all((c.assistant_turns, c.user_turns) == (2, 1) for c in conversations)
    # Room for one answer, not two: the second is not appended, the response stays under the budget.
    budget = 2 * len(ANSWER) + 1
    conversations, engine = run(model, LoopLimits(response_length=budget))
    for c in conversations:
        assert len(c.token_ids) <= budget and c.finish_reason == "length"
        assert zero_runs(c.loss_mask, c.token_ids) == [ANSWER] * c.user_turns and c.user_turns <= 1
        if c.metrics["tools/calls"] > c.user_turns:  # an answer left out: the turns stopped short of it
            assert len(c.token_ids) + len(ANSWER) >= budget > len(c.token_ids)
    assert any(c.metrics["tools/calls"] > c.user_turns for c in conversations)
    assert engine.counters["held"] == 0


def test_a_single_turn_row_gets_one_turn_and_no_tools(model) -> None:
    conversations, engine = run(model, LoopLimits(response_length=200), agent=SINGLE_TURN_AGENT)
    assert all(c.num_turns == 2 and all(c.loss_mask) and not c.tool_rewards for c in conversations)
    assert engine.counters["held"] == 0


def test_the_delta_drops_the_default_system_block_as_verl_does() -> None:
    delta = ChatDelta(ByteTokenizer())
    assert delta.prefix == "<s>default</s>\n"
    assert delta.appended_text([{"role": "tool", "content": "a"}]) == "<tool>a</tool>\n<assistant>"


def test_request_of_reads_the_datas_kwargs_and_refuses_an_unknown_agent() -> None:
    item = {
        "input_ids": [1, 2],
        "raw_prompt": [{"role": "user", "content": "q"}],
        "agent_name": None,
        "extra_info": {"tools_kwargs": {"t": {"create_kwargs": {"g": 1}}}, "interaction_kwargs": {"k": 2}},
    }
    request = request_of(item)
    assert request.agent_name == "tool_agent" and request.tools_kwargs == {"t": {"create_kwargs": {"g": 1}}}
    assert request.interaction_kwargs == {"k": 2}
    with pytest.raises(ValueError, match=r"agent_name 'react' .* known: tool_agent, single_turn_agent"):
        request_of({**item, "agent_name": "react"})


def test_conversation_metrics_by_hand() -> None:
    per_sample = [
        {"tools/calls": 2.0, "tools/errors": 1.0, "tools/errors/timeout": 1.0, "agent_loop/tool_calls": 0.5},
        {"tools/calls": 0.0, "tools/errors": 0.0, "agent_loop/tool_calls": 0.0},
    ]
    out = conversation_metrics([4, 2], per_sample)
    assert out["num_turns/mean"] == 3.0 and out["num_turns/max"] == 4 and out["num_turns/min"] == 2
    assert out["tool_call_counts/mean"] == 1.0 and out["tools/calls"] == 1.0
    assert out["tools/errors"] == 0.5 and out["tools/errors/timeout"] == 0.5
    assert out["tools/call_rate"] == 0.5 and out["agent_loop/tool_calls/max"] == 0.5


def test_multi_turn_with_hf_and_an_interaction_without_multi_turn_are_refused_naming_the_keys() -> None:
    from fulcrum.config import load_config, validate

    mt = "actor_rollout_ref.rollout.multi_turn"
    cfg = load_config([f"{mt}.enable=True", "actor_rollout_ref.rollout.name=hf"])
    problems = "\n".join(str(p) for p in validate(cfg, n_devices=1))
    assert "multi-turn rollouts need rollout.name=native" in problems
    problems = "\n".join(str(p) for p in validate(load_config([f"{mt}.interaction_config_path=i.yaml"])))
    assert f"{mt}.interaction_config_path" in problems and "multi_turn.enable=True" in problems
    assert "multi_turn.enable" not in [
        str(p).split(":")[0] for p in validate(load_config([f"{mt}.enable=True"]))
    ]
