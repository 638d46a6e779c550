"""Tools for multi-turn rollouts, without the sandbox: verl's tool-config YAML and its errors, the GSM8K
tool against verl's Gsm8kTool, Hermes `<tool_call>` parsing, verl's tool-response truncation, and the
ToolSet that turns a turn's calls into tool messages without ever raising.

The GSM8K expectations are read off verl's `verl/tools/gsm8k_tool.py`: flexible scoring, step reward 0
for an improvement and −0.05 otherwise (the first wrong answer included), `Current parsed {answer=}
{reward=}` as the text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import textwrap
from pathlib import Path
from typing import Any

import pytest

from fulcrum.agent import (
    BaseTool,
    FunctionCall,
    OpenAIFunctionToolSchema,
    ToolConfigError,
    ToolResponse,
    ToolSet,
    load_tool_config,
    parse_hermes,
    truncate_text,
)
from fulcrum.agent.gsm8k_tool import Gsm8kTool
from fulcrum.agent.python_tool import PythonTool

GSM8K_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calc_gsm8k_reward",
        "description": "A tool for calculating the reward of gsm8k.",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "The model's answer"}},
            "required": ["answer"],
        },
    },
}


def write_yaml(tmp_path: Path, text: str, name: str = "tools.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def gsm8k_config(tmp_path: Path) -> Path:
    """verl's examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml, in its shape."""
    return write_yaml(
        tmp_path,
        """
        tools:
          - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
            config:
              type: native
            tool_schema:
              type: "function"
              function:
                name: "calc_gsm8k_reward"
                description: "A tool for calculating the reward of gsm8k."
                parameters:
                  type: "object"
                  properties:
                    answer:
                      type: "string"
                      description: "The model's answer"
                  required: ["answer"]
        """,
    )


# --- the tool-config YAML ---------------------------------------------------------------------------


def test_verl_gsm8k_config_loads_as_ours_and_its_schema_reaches_the_chat_template(tmp_path: Path) -> None:
    tools = load_tool_config(gsm8k_config(tmp_path))
    assert len(tools) == 1 and isinstance(tools[0], Gsm8kTool)
    assert tools[0].name == "calc_gsm8k_reward"
    # verl dumps with exclude_unset: `strict`, absent from the YAML, stays absent.
    assert ToolSet(tools).schemas == [GSM8K_SCHEMA]


def test_verl_sandbox_fusion_config_runs_locally_and_says_so(tmp_path: Path, caplog: Any) -> None:
    path = write_yaml(
        tmp_path,
        """
        tools:
          - class_name: "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
            config:
              sandbox_fusion_url: "https://example.invalid/run_code"
              num_workers: 10
              enable_global_rate_limit: true
              rate_limit: 4
              default_timeout: 30
              default_language: "python"
              memory_limit_mb: 1024
              type: native
            tool_schema:
              type: "function"
              function:
                name: "code_interpreter"
                description: "A tool for executing code."
                parameters:
                  type: "object"
                  properties:
                    code:
                      type: "string"
                      description: "The code to execute."
                  required: ["code"]
        """,
    )
    with caplog.at_level(logging.WARNING, logger="fulcrum.agent"):
        (tool,) = load_tool_config(path)
    assert isinstance(tool, PythonTool)
    assert tool.limits.timeout_s == 30 and tool.limits.memory_mb == 1024 and tool.max_concurrent == 4
    notes = [r.getMessage() for r in caplog.records if "SandboxFusionTool" in r.getMessage()]
    assert len(notes) == 1 and "locally" in notes[0] and "not on a Sandbox Fusion server" in notes[0]


def test_other_verl_tools_are_refused_naming_the_class_and_what_fulcrum_offers(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        """
        tools:
          - class_name: verl.tools.gsm8k_tool.Gsm8kTool
          - class_name: verl.tools.search_tool.SearchTool
            config: {type: native, retrieval_service_url: "http://127.0.0.1:8000/retrieve"}
            tool_schema: {type: function, function: {name: search, description: Searches.}}
        """,
    )
    with pytest.raises(ToolConfigError) as err:
        load_tool_config(path)
    message = str(err.value)
    assert str(path) in message and "tools[1].class_name" in message
    assert "verl.tools.search_tool.SearchTool" in message
    assert (
        "fulcrum.agent.gsm8k_tool.Gsm8kTool" in message and "fulcrum.agent.python_tool.PythonTool" in message
    )


def with_function(function: dict[str, Any]) -> dict[str, Any]:
    """A GSM8K tool entry whose schema's `function` is `function`."""
    return {
        "class_name": "verl.tools.gsm8k_tool.Gsm8kTool",
        "tool_schema": {"type": "function", "function": function},
    }


@pytest.mark.parametrize(
    ("entry", "where", "what"),
    [
        ({"config": {"type": "native"}}, "tools[0].class_name", "required"),
        (with_function({}), "tools[0].tool_schema.function.name", "required key is missing"),
        (
            with_function({"name": "f", "description": 3}),
            "tools[0].tool_schema.function.description",
            "expected a string",
        ),
        (
            with_function(
                {"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}
            ),
            "tools[0].tool_schema.function.parameters.required",
            "required key is missing",
        ),
        (
            with_function(
                {
                    "name": "f",
                    "description": "d",
                    "parameters": {
                        "type": "object",
                        "properties": {"x": {"type": "string", "enum": [1, 2]}},
                        "required": [],
                    },
                }
            ),
            "tools[0].tool_schema.function.parameters.properties.x.enum",
            "expected a list of strings",
        ),
        (
            {"class_name": "verl.tools.gsm8k_tool.Gsm8kTool", "config": {"type": "mcp"}},
            "tools[0].config.type",
            "mcp",
        ),
        ({"class_name": "verl.tools.gsm8k_tool.Gsm8kTool", "tool_shema": {}}, "tools[0]", "tool_shema"),
        (
            {
                "class_name": "verl.tools.sandbox_fusion_tools.SandboxFusionTool",
                "config": {"default_timeot": 5},
            },
            "tools[0]",
            "default_timeot",
        ),
        (
            {
                "class_name": "verl.tools.sandbox_fusion_tools.SandboxFusionTool",
                "config": {"memory_limit_mb": -1},
            },
            "tools[0]",
            "config.memory_limit_mb",
        ),
        ({"class_name": "no_such_package.tools.Tool"}, "tools[0].class_name", "cannot import module"),
        (
            {"class_name": "json.JSONDecoder"},
            "tools[0].class_name",
            "not a subclass of fulcrum.agent.BaseTool",
        ),
    ],
)
def test_config_errors_name_the_file_the_tool_and_the_key(
    tmp_path: Path, entry: dict[str, Any], where: str, what: str
) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(json.dumps({"tools": [entry]}))  # JSON is YAML
    with pytest.raises(ToolConfigError) as err:
        load_tool_config(path)
    message = str(err.value)
    assert str(path) in message and where in message and what in message, message


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ToolConfigError, match="tool_config_path: no such file"):
        load_tool_config(tmp_path / "missing.yaml")
    with pytest.raises(ToolConfigError, match="top-level `tools:` list"):
        load_tool_config(write_yaml(tmp_path, "tool: []\n"))
    twice = {"tools": [{"class_name": "verl.tools.gsm8k_tool.Gsm8kTool"}] * 2}
    path = tmp_path / "twice.yaml"
    path.write_text(json.dumps(twice))
    with pytest.raises(ToolConfigError, match=r"tools\[1\].*already the name of tools\[0\]"):
        load_tool_config(path)


def test_a_users_tool_is_found_by_its_class_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_weather.py").write_text(
        textwrap.dedent(
            """
            from fulcrum.agent import BaseTool, ToolResponse

            class WeatherTool(BaseTool):
                async def execute(self, instance_id, parameters, **kwargs):
                    return ToolResponse(text=f"sunny in {parameters['city']}, unit {self.config['unit']}"), 0.5, {}
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write_yaml(
        tmp_path,
        """
        tools:
          - class_name: my_weather.WeatherTool
            config: {type: native, unit: celsius}
            tool_schema:
              type: function
              function:
                name: weather
                description: The weather in a city.
                parameters: {type: object, properties: {city: {type: string}}, required: [city]}
        """,
    )
    toolset = ToolSet(load_tool_config(path))
    (result,) = asyncio.run(toolset.run_turn([FunctionCall("weather", '{"city": "Paris"}')]))
    assert result.response.text == "sunny in Paris, unit celsius" and result.reward == 0.5
    assert result.metrics == {"tools/calls": 1.0, "tools/errors": 0.0}


# --- the GSM8K tool ---------------------------------------------------------------------------------


def run_gsm8k(
    ground_truth: str, answers: list[Any], via_create_kwargs: bool = False
) -> list[tuple[str, float]]:
    """verl's sequence: create, then execute each answer; (text, step reward) per answer, then calc_reward."""

    async def go() -> list[tuple[str, float]]:
        tool = Gsm8kTool({"type": "native"}, OpenAIFunctionToolSchema.from_dict(GSM8K_SCHEMA))
        if via_create_kwargs:
            instance, _ = await tool.create(create_kwargs={"ground_truth": ground_truth})
        else:
            instance, _ = await tool.create(ground_truth=ground_truth)
        out = []
        for answer in answers:
            response, step_reward, _ = await tool.execute(instance, {"answer": answer})
            out.append((response.text, step_reward))
        out.append(("calc_reward", await tool.calc_reward(instance)))
        await tool.release(instance)
        return out

    return asyncio.run(go())


def test_gsm8k_tool_rewards_as_verls() -> None:
    assert run_gsm8k("72", ["72", "72", "71"]) == [
        ("Current parsed answer='72' reward=1.0", 0.0),  # improvement: no penalty
        ("Current parsed answer='72' reward=1.0", -0.05),  # the same again: penalised
        ("Current parsed answer='71' reward=0.0", -0.05),
        ("calc_reward", 0.0),  # the last submission counts
    ]
    # The first answer wrong is penalised too (0.0 is not more than the initial 0.0).
    assert run_gsm8k("72", ["71"]) == [("Current parsed answer='71' reward=0.0", -0.05), ("calc_reward", 0.0)]
    # An answer already in `#### n` form is kept; flexible extraction finds the last number in a sentence;
    # a number is turned into text; the ground truth may come through create_kwargs as the loop passes it.
    assert run_gsm8k("18", ["#### 18"])[0] == ("Current parsed answer='#### 18' reward=1.0", 0.0)
    assert run_gsm8k("18", ["She earns 18 dollars"])[-1] == ("calc_reward", 1.0)
    assert run_gsm8k("18", [18], via_create_kwargs=True)[0] == ("Current parsed answer='18' reward=1.0", 0.0)


def test_gsm8k_tool_without_a_schema_uses_verls_default() -> None:
    assert Gsm8kTool({}, None).tool_schema.to_dict()["function"]["name"] == "calc_gsm8k_reward"


# --- parsing and truncation -------------------------------------------------------------------------


def test_hermes_parsing_finds_every_call_in_order_and_reports_malformed_ones() -> None:
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "code_interpreter", "arguments": {"code": "print(1 + 1)"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calc_gsm8k_reward", "arguments": {"answer": "2"},}\n</tool_call>\n'
        '<tool_call>{"name": "calc_gsm8k_reward", "arguments": "{\\"answer\\": \\"3\\"}"}</tool_call>'
        '<tool_call>{"name": "calc_gsm8k_reward", "arguments": [1]}</tool_call>'
    )
    parsed = parse_hermes(text)
    assert parsed.content == "Let me compute.\n\n\n"
    first, second, third, fourth = parsed.calls
    assert first == FunctionCall("code_interpreter", '{"code": "print(1 + 1)"}')
    assert second.error is not None and "not valid JSON" in second.error
    assert third.parsed_arguments() == {"answer": "3"}  # arguments given as a JSON string
    assert fourth.error is not None and "must be a JSON object" in fourth.error


def test_hermes_parsing_needs_both_tags() -> None:
    cut = 'Answer: <tool_call>{"name": "f", "arguments": {}}'  # cut by the length limit
    assert parse_hermes(cut).calls == [] and parse_hermes(cut).content == cut
    assert parse_hermes("no calls here").calls == []


def test_unsupported_format_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"multi_turn\.format: 'gpt-oss' is not supported"):
        ToolSet([], format="gpt-oss")


def test_truncation_matches_verls_three_sides() -> None:
    text = "0123456789"
    assert truncate_text(text, 4, "left") == "0123...(truncated)"
    assert truncate_text(text, 4, "right") == "(truncated)...6789"
    assert truncate_text(text, 4, "middle") == "01...(truncated)...89"
    assert truncate_text(text, 10, "middle") == text
    with pytest.raises(ValueError, match="tool_response_truncate_side: 'top'"):
        ToolSet([], tool_response_truncate_side="top")


# --- the ToolSet never raises -----------------------------------------------------------------------


class BrokenTool(BaseTool):
    """Raises in execute, as a tool with a bug or an outage would."""

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, float]]:
        raise RuntimeError("backend down")


class ChattyTool(BaseTool):
    """Answers 1,000 characters and counts its own metric."""

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, float]]:
        return ToolResponse(text="a" * 500 + "b" * 500), 0.0, {"chatty/bytes": 1000}


def schema(name: str) -> OpenAIFunctionToolSchema:
    return OpenAIFunctionToolSchema.from_dict(
        {"type": "function", "function": {"name": name, "description": name}}
    )


def test_every_failure_becomes_a_message_and_a_counted_kind() -> None:
    toolset = ToolSet([BrokenTool({}, schema("broken"))], max_parallel_calls=4)
    calls = [
        FunctionCall("broken", "{}"),
        FunctionCall("nowhere", "{}"),
        parse_hermes("<tool_call>{oops</tool_call>").calls[0],
    ]
    broken, unknown, malformed = asyncio.run(toolset.run_turn(calls))
    assert broken.response.text == "Error when executing tool: backend down"
    assert broken.metrics == {"tools/calls": 1.0, "tools/errors": 1.0, "tools/errors/tool_failed": 1.0}
    assert unknown.response.text == "Error when executing tool: unknown tool 'nowhere' (tools: broken)"
    assert unknown.metrics["tools/errors/invalid_call"] == 1.0
    assert (
        "not valid JSON" in malformed.response.text and malformed.metrics["tools/errors/invalid_call"] == 1.0
    )
    assert [r.message()["role"] for r in (broken, unknown, malformed)] == ["tool"] * 3


def test_responses_are_cut_and_only_max_parallel_calls_run() -> None:
    toolset = ToolSet(
        [ChattyTool({}, schema("chatty"))], max_tool_response_length=10, tool_response_truncate_side="middle"
    )
    results = asyncio.run(toolset.run_turn([FunctionCall("chatty", "{}")] * 3))
    assert len(results) == 1  # max_parallel_calls = 1, verl's default: the other two are dropped
    assert results[0].response.text == "aaaaa...(truncated)...bbbbb"
    assert results[0].metrics == {"chatty/bytes": 1000.0, "tools/calls": 1.0, "tools/errors": 0.0}
