"""The calculator tool, the multi-step task's tool traces, and multi-turn SFT's loss on assistant turns only."""

import asyncio

import pyarrow.parquet as pq
import pytest

from fulcrum.agent import load_tool_config
from fulcrum.agent.calculator_tool import CalculatorError, evaluate
from fulcrum.agent.multistep_tools import trace_messages, write_tool_data
from fulcrum.agent.parser import parse_hermes
from fulcrum.data.multistep import write_splits
from fulcrum.models.load import load_tokenizer
from fulcrum.models.tiny import build_tiny_model
from fulcrum.trainer.sft import load_examples, load_sft_config
from fulcrum.trainer.sft_multiturn import tokenize_chat

CONFIG = "fulcrum/agent/configs/calculator_tool_config.yaml"


@pytest.mark.parametrize(
    ("text", "value"), [("12 + 7", 19), ("57 / 3", 19.0), ("(1 + 2) * 3", 9), ("-4 * 2", -8)]
)
def test_calculator_evaluates_arithmetic(text, value):
    assert evaluate(text) == value


@pytest.mark.parametrize("text", ["__import__('os')", "x + 1", "1 / 0", "9 ** 9 ** 9", "'a' * 3", "10 ** 60"])
def test_calculator_refuses_everything_else(text):
    with pytest.raises(CalculatorError):
        evaluate(text)


def test_shipped_config_loads_and_answers():
    (tool,) = load_tool_config(CONFIG)
    assert tool.name == "calculator"
    response, _, metrics = asyncio.run(tool.execute("i", {"expression": "57 / 3"}))
    assert response.text == "19" and metrics == {}
    response, _, metrics = asyncio.run(tool.execute("i", {"expression": "open('x')"}))
    assert response.text.startswith("Error") and metrics == {"tools/errors/invalid_expression": 1.0}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    write_splits(root / "plain", num_train=12, num_test=4, seed=0, num_dev=2)
    write_tool_data(root / "plain", root / "tools")
    model = build_tiny_model(
        root / "model", seed=0, hidden_size=32, num_hidden_layers=1, intermediate_size=64
    )
    return root, model


def test_traces_call_the_tool_once_per_worked_line_and_end_with_the_answer(data):
    root, _ = data
    plain = pq.read_table(root / "plain" / "train.parquet").to_pylist()
    rl = pq.read_table(root / "tools" / "train.parquet").to_pylist()
    assert [r["reward_model"] for r in rl] == [r["reward_model"] for r in plain]
    assert rl[0]["agent_name"] == "tool_agent" and "calculator" in rl[0]["extra_info"]["tools_kwargs"]
    (tool,) = load_tool_config(CONFIG)
    for row in plain:
        messages = trace_messages(row)
        calls = [m for m in messages if m["role"] == "assistant"][:-1]
        answers = [m["content"] for m in messages if m["role"] == "tool"]
        assert len(calls) == row["extra_info"]["num_steps"] == len(answers)
        for call, answer in zip(calls, answers, strict=True):
            (parsed,) = parse_hermes(call["content"]).calls  # what the agent loop will parse
            response, _, _ = asyncio.run(tool.execute("i", parsed.parsed_arguments()))
            assert response.text == answer  # the trace's tool answers are the tool's
        assert messages[-1]["content"] == f"#### {row['reward_model']['ground_truth']}"


def test_multiturn_sft_loss_is_on_assistant_tokens_only(data):
    _, model = data
    tokenizer = load_tokenizer(str(model))
    messages = [
        {"role": "user", "content": "What is 2 + 3 then times 4?"},
        {"role": "assistant", "content": "<tool_call>\nA\n</tool_call>"},
        {"role": "tool", "content": "TOOLANSWER"},
        {"role": "assistant", "content": "#### 20"},
    ]
    chat = tokenize_chat(tokenizer, messages)
    assert tokenizer.decode(chat.input_ids) == tokenizer.apply_chat_template(messages, tokenize=False)
    scored = tokenizer.decode([t for t, m in zip(chat.input_ids, chat.loss_mask, strict=True) if m])
    unscored = tokenizer.decode([t for t, m in zip(chat.input_ids, chat.loss_mask, strict=True) if not m])
    assert "TOOLANSWER" in unscored and "TOOLANSWER" not in scored
    assert "2 + 3" not in scored and "<tool_call>" in scored and "#### 20" in scored
    assert "assistant" not in scored  # the generation prompt is the template's, not the policy's


def test_sft_reads_conversations_with_verls_keys(data):
    root, model = data
    cfg = load_sft_config(
        [
            f"data.train_files={root / 'tools' / 'sft.parquet'}",
            f"model.partial_pretrain={model}",
            "data.multiturn.enable=true",
            "data.multiturn.messages_key=messages",
            "data.max_length=4096",
        ]
    )
    examples = load_examples(cfg.data.train_files, load_tokenizer(str(model)), cfg.data)
    assert len(examples) == 12
    for e in examples:
        assert len(e.mask()) == len(e.input_ids) and 0 < sum(e.mask()) < len(e.input_ids)
