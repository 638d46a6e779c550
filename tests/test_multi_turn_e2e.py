"""verl's GSM8K multi-turn script (examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh), shrunk to
the tiny model on the CPU with the native engine: two GRPO steps over `fulcrum data gsm8k --multi-turn-tool`
data and verl's GSM8K tool config, every key of the script as verl wrote it but sizes and paths.

A random tiny model writes no `<tool_call>` and rarely its EOS, so two things stand in for a model that
has learned the format: its generation config names 200 frequent ids as EOS (turns end after ~10
tokens), and the Hermes parser reads every turn as a call `calc_gsm8k_reward(answer="3")`. The engine,
the loop, the tool, the template delta, the batch and the update are the real ones.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_agent_loop import zero_runs
from test_agent_tools import gsm8k_config
from test_verl_examples import EXAMPLES, as_user_would

from fulcrum.agent import BaseTool, parser
from fulcrum.agent.parser import FunctionCall, ParsedMessage
from fulcrum.data.cli import main as data_main
from fulcrum.models.tiny import build_tiny_model
from fulcrum.trainer.checkpoint import is_complete, read_latest_step
from fulcrum.trainer.sampling import Sampler

SCRIPT = "examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh"
SHRINK = [
    "data.train_batch_size=2",
    "data.max_prompt_length=512",
    "data.max_response_length=64",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.rollout.max_model_len=576",
    "actor_rollout_ref.rollout.max_num_batched_tokens=1024",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
    "trainer.total_training_steps=2",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.val_before_train=False",
]
TOOL_TEXT = "Current parsed answer='3' reward=0.0"


def always_calls(text: str) -> ParsedMessage:
    """Every turn is a call of the GSM8K tool (the stand-in for a model that calls it)."""
    return ParsedMessage(text, [FunctionCall("calc_gsm8k_reward", json.dumps({"answer": "3"}))])


def tiny_model_with_short_turns(folder: Path) -> None:
    """The tiny model, its generation config naming 200 frequent ids as EOS: the random model's turns
    end after ~10 tokens, as a trained model's would."""
    build_tiny_model(
        folder, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    generation = json.loads((folder / "generation_config.json").read_text())
    generation["eos_token_id"] = [generation["eos_token_id"], *range(100, 300)]
    (folder / "generation_config.json").write_text(json.dumps(generation))


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("multi_turn")
    tiny_model_with_short_turns(root / "model")
    src = root / "gsm8k"
    src.mkdir()
    shared = Path(__file__).resolve().parents[2] / "shared/data/gsm8k"
    for split in ("train", "test"):
        if (shared / f"{split}.jsonl").is_file():
            lines = (shared / f"{split}.jsonl").read_text().splitlines()[:4]
            (src / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
        else:  # the release is not committed; made-up rows in its format, whose answer is not the
            # stand-in model's "3" (TOOL_TEXT's reward=0.0, as on the release's first rows)
            row = {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2 + 3 = 5\n#### 5"}
            (src / f"{split}.jsonl").write_text((json.dumps(row) + "\n") * 4)
    assert data_main(["gsm8k", "--src", str(src), "--out", str(root / "data"), "--multi-turn-tool"]) == 0
    shutil.copy(root / "data/train.parquet", root / "data.parquet")
    gsm8k_config(root)
    return root


def test_verl_multi_turn_script_trains_two_steps_with_tool_tokens_masked(
    assets: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fulcrum.config import load_config
    from fulcrum.trainer.ppo_trainer import PPOTrainer

    monkeypatch.setitem(parser.PARSERS, "hermes", always_calls)
    batches = []
    converse = Sampler.converse
    monkeypatch.setattr(
        Sampler, "converse", lambda self, *a: batches.append(converse(self, *a)) or batches[-1]
    )
    argv = [*as_user_would(EXAMPLES["scripts"][SCRIPT], assets, "1"), *SHRINK]
    argv = [a for a in argv if not a.startswith("trainer.default_local_dir=")]
    run = assets / "run"
    trainer = PPOTrainer(load_config([*argv, f"trainer.default_local_dir={run}"]), torch.device("cpu"))
    assert type(trainer.rollout).__name__ == "NativeEngine"  # sglang maps to native, on the CPU too
    trainer.fit()
    trainer.close()

    assert len(batches) == 2 and all(len(b) == 4 for b in batches)  # 2 prompts x n=2, per step
    tokenizer = trainer.tokenizer
    expected = f"<|im_start|>tool\n{TOOL_TEXT}<|im_end|>\n<|im_start|>assistant\n"
    masked_runs = 0
    for batch in batches:
        prompt_len = batch.prompt_length
        lengths = batch["attention_mask"][:, prompt_len:].sum(-1).tolist()
        for row, length in enumerate(lengths):
            ids = batch["responses"][row, :length].tolist()
            mask = batch["response_mask"][row, :length].tolist()
            assert length <= 64 and mask[0] == 1
            # Each run of zeros is exactly one tool answer as the template renders it, nothing else.
            runs = zero_runs(mask, ids)
            assert all(tokenizer.decode(r, skip_special_tokens=False) == expected for r in runs)
            # verl's count: the prompt, each assistant turn, each tool answer appended
            assert batch.non_tensors["num_turns"][row] == 2 * len(runs) + 2
            # The rollout's log-probs are 0 on the tool's tokens, as verl pads them.
            assert all(batch["rollout_log_probs"][row, i] == 0.0 for i in range(length) if mask[i] == 0)
            masked_runs += len(runs)
    assert masked_runs > 0

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "training/global_step" in r]
    assert [r["training/global_step"] for r in steps] == [1, 2]
    for row in steps:
        for key in (
            "num_turns/mean",
            "num_turns/max",
            "tool_call_counts/mean",
            "tools/calls",
            "tools/errors",
            "tools/call_rate",
            "agent_loop/tool_calls/mean",
            "actor/pg_loss",
            "response_length/mean",
        ):
            assert key in row, key
        assert row["tools/calls"] >= 1 and row["tools/errors"] == 0.0 and row["tools/call_rate"] == 1.0
    assert trainer.rollout.counters["held"] == 0  # every conversation released its blocks


class HangingTool(BaseTool):
    """A user tool whose first call asks the run to stop (SIGTERM, as a scheduler would) and whose every
    call then hangs: one awaits forever, one blocks its event loop."""

    calls = 0

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        HangingTool.calls += 1
        if HangingTool.calls == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        if HangingTool.calls % 2:
            await asyncio.Event().wait()
        time.sleep(30)


def test_sigterm_during_a_hanging_tool_ends_the_run_within_the_call_limit_and_saves(
    assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fulcrum.config import load_config
    from fulcrum.trainer.ppo_trainer import PPOTrainer

    config = tmp_path / "tools.yaml"
    config.write_text(
        (assets / "tools.yaml")
        .read_text()
        .replace('"verl.tools.gsm8k_tool.Gsm8kTool"', f'"{__name__}.HangingTool"')
    )
    monkeypatch.setitem(parser.PARSERS, "hermes", always_calls)
    argv = [*as_user_would(EXAMPLES["scripts"][SCRIPT], assets, "1"), *SHRINK]
    dropped = (
        "trainer.default_local_dir=",
        "trainer.total_training_steps=",
        "actor_rollout_ref.rollout.multi_turn.tool",
    )
    argv = [a for a in argv if not a.startswith(dropped)]
    run = tmp_path / "run"
    argv += [
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={config}",
        "actor_rollout_ref.rollout.multi_turn.call_timeout=0.5",
        "trainer.total_training_steps=3",
        f"trainer.default_local_dir={run}",
    ]

    def stalled(*_: Any) -> None:
        raise TimeoutError("the run did not stop within 120 s")

    previous = signal.signal(signal.SIGALRM, stalled)
    signal.alarm(120)
    try:
        trainer = PPOTrainer(load_config(argv), torch.device("cpu"))
        started = time.monotonic()
        trainer.fit()
        trainer.close()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert trainer.exit_code == 128 + signal.SIGTERM
    assert time.monotonic() - started < 60
    assert read_latest_step(run) == 1 and is_complete(run / "global_step_1", ["actor"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    [step] = [r for r in rows if "training/global_step" in r]
    assert step["tools/errors/call_timeout"] > 0
