"""The multi-step task with a calculator: RL rows that run the tool agent, and SFT traces that call it.

    python -m fulcrum.data.multistep --out DATA --dev 200          # the plain task (worked solutions)
    python -m fulcrum.agent.multistep_tools --src DATA --out DATA_TOOLS

From the same problems (so the with-tools and without-tools arms of a comparison see the same sums),
`--out` gets:

- `train.parquet`, `test.parquet` (and `dev.parquet`): RL rows as `fulcrum data gsm8k --multi-turn-tool`
  writes them: a system message that describes the calculator and the call format, the question with
  GSM8K's instruction, `agent_name` `tool_agent`, `extra_info.need_tools_kwargs` and `tools_kwargs`;
- `sft.parquet`: one conversation per training problem in `messages` (the prompt's two messages, then per
  worked line an assistant turn that calls the calculator and the tool's answer, then `#### N`) and the
  tool's schema in `tools`, for `fulcrum sft data.multiturn.enable=true`.

A call is written in the assistant's text, in the Hermes format the agent loop parses
(`<tool_call>\\n{"name": "calculator", "arguments": {"expression": "12 + 7"}}\\n</tool_call>`), not in a
`tool_calls` field: what the model must learn to write is that text, and templates that do not know
tools (SmolLM2's) render only the text. The same templates show no tool schema, which is why the
system message describes the tool in words; a template that renders `tools` (Qwen's) shows both.
The tool's answer is a `tool` message, as the agent loop appends it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from fulcrum.agent.calculator_tool import CalculatorTool
from fulcrum.agent.parser import hermes_call
from fulcrum.data.multistep import equation_chain
from fulcrum.data.synthetic import write_parquet

TOOL_NAME = "calculator"
AGENT_NAME = "tool_agent"
SPLITS = ("train", "test", "dev")


def tool_call_text(expression: str) -> str:
    """One Hermes call of the calculator, as the agent loop parses it."""
    return hermes_call(TOOL_NAME, {"expression": expression})


SYSTEM_PROMPT = (
    "You can use a calculator. To compute something, call it like this:\n"
    + tool_call_text("2 + 3")
    + "\n"
    + 'Call it once for each step, using its answers, then give the final answer after "####".'
)


def worked_steps(solution: str) -> list[tuple[str, str]]:
    """(expression, result) of each worked line `a op b = c` of a multi-step solution."""
    steps = []
    for line in equation_chain(solution).splitlines():
        expression, _, result = line.rpartition(" = ")
        steps.append((expression.strip(), result.strip()))
    return steps


def tool_prompt(row: dict[str, Any]) -> list[dict[str, str]]:
    """The RL prompt of a plain row: the calculator's system message, then the row's own user turn."""
    user = [m for m in row["prompt"] if m["role"] == "user"]
    return [{"role": "system", "content": SYSTEM_PROMPT}, *user]


def tool_row(row: dict[str, Any]) -> dict[str, Any]:
    """A plain multi-step row as a tool-agent row (the reward and extra_info kept)."""
    ground_truth = row["reward_model"]["ground_truth"]
    extra = dict(row["extra_info"])
    extra.update(
        need_tools_kwargs=True, tools_kwargs={TOOL_NAME: {"create_kwargs": {"ground_truth": ground_truth}}}
    )
    return {**row, "prompt": tool_prompt(row), "agent_name": AGENT_NAME, "extra_info": extra}


def trace_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """The conversation that solves a plain row with the calculator: a call per worked line, each
    followed by the tool's answer, then `#### N`."""
    messages = tool_prompt(row)
    for expression, result in worked_steps(row["extra_info"]["answer"]):
        messages.append({"role": "assistant", "content": tool_call_text(expression)})
        messages.append({"role": "tool", "content": result})
    messages.append({"role": "assistant", "content": f"#### {row['reward_model']['ground_truth']}"})
    return messages


def calculator_schema() -> dict[str, Any]:
    """The calculator's OpenAI function schema, as the tool config gives it to the template."""
    return CalculatorTool.default_tool_schema().to_dict()


def trace_row(row: dict[str, Any]) -> dict[str, Any]:
    """One SFT row: `messages` (the trace) and `tools` (the schema), plus the row's ground truth."""
    return {
        "messages": trace_messages(row),
        "tools": [calculator_schema()],
        "ground_truth": row["reward_model"]["ground_truth"],
    }


def write_tool_data(src: str | Path, out: str | Path) -> list[Path]:
    """The tool-agent splits of `src`'s multi-step splits and `sft.parquet` (traces of `src/train`)."""
    src, out = Path(src), Path(out)
    written = []
    for split in SPLITS:
        if not (src / f"{split}.parquet").is_file():
            continue
        rows = pq.read_table(src / f"{split}.parquet").to_pylist()
        written.append(write_parquet([tool_row(r) for r in rows], out / f"{split}.parquet"))
        if split == "train":
            written.append(write_parquet([trace_row(r) for r in rows], out / "sft.parquet"))
    if not written:
        raise ValueError(
            f"{src}: no train/test/dev parquet (write them with python -m fulcrum.data.multistep)"
        )
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fulcrum.agent.multistep_tools", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--src", required=True, help="a folder written by python -m fulcrum.data.multistep")
    parser.add_argument("--out", required=True, help="folder for the tool-agent splits and sft.parquet")
    args = parser.parse_args(argv)
    try:
        written = write_tool_data(args.src, args.out)
    except ValueError as err:
        parser.error(str(err))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
