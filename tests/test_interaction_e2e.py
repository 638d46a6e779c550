"""verl's GSM8K multi-turn script with an interaction
(examples/sglang_multiturn/run_qwen2.5-0.5b_gsm8k_multiturn_w_interaction.sh), shrunk to the tiny model on
the CPU with the native engine: two GRPO steps over data in the shape of verl's
examples/data_preprocess/gsm8k_multiturn_w_interaction.py and verl's GSM8K interaction config, every key
of the script as verl wrote it but sizes and paths.

A random tiny model never writes `#### 3`, so a stand-in reads the model's second and later answers as
`#### 3`: the first answer is wrong (the user says so, the model goes on), the second is right (the user
says so, the conversation ends). The engine, the loop, the interaction's scoring, the template delta,
the batch and the update are the real ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_agent_loop import zero_runs
from test_multi_turn_e2e import SHRINK, tiny_model_with_short_turns
from test_verl_examples import EXAMPLES, as_user_would, gsm8k_interaction_config

from fulcrum.agent import gsm8k_interaction
from fulcrum.agent.gsm8k_interaction import CORRECT, INCORRECT
from fulcrum.trainer.sampling import Sampler

SCRIPT = "examples/sglang_multiturn/run_qwen2.5-0.5b_gsm8k_multiturn_w_interaction.sh"
RESPONSE = 96
SIZES = [
    *(s for s in SHRINK if "max_response_length" not in s and "max_model_len" not in s),
    f"data.max_response_length={RESPONSE}",
    f"actor_rollout_ref.rollout.max_model_len={512 + RESPONSE}",
]
SYSTEM = (
    "You are a math expert. You are given a question and you need to solve it step by step. "
    "You should rethinking carefully if user point out your answer is wrong. "
    "Put your final answer in the format of `#### <answer>`."
)


def verl_row(index: int) -> dict[str, Any]:
    """A row as verl's gsm8k_multiturn_w_interaction.py writes it."""
    question = "Tom has 1 apple and buys 2. How many? Let's think step by step and output the final answer after `####`."
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "3"},
        "extra_info": {
            "split": "train",
            "index": index,
            "interaction_kwargs": {"name": "gsm8k", "query": question, "ground_truth": "3"},
        },
    }


def second_answer_right(messages: list[dict[str, Any]]) -> str:
    """The stand-in for a model that corrects itself: its first answer is wrong, later ones say 3."""
    answers = [m for m in messages if m.get("role") == "assistant"]
    return "#### 3" if len(answers) >= 2 else str(answers[-1]["content"])


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("interaction")
    tiny_model_with_short_turns(root / "model")
    pq.write_table(pa.Table.from_pylist([verl_row(i) for i in range(4)]), root / "data.parquet")
    gsm8k_interaction_config(root)
    return root


def test_verl_interaction_script_trains_two_steps_with_user_turns_masked(
    assets: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fulcrum.config import load_config
    from fulcrum.trainer.ppo_trainer import PPOTrainer

    monkeypatch.setattr(gsm8k_interaction, "last_assistant_content", second_answer_right)
    batches = []
    converse = Sampler.converse
    monkeypatch.setattr(
        Sampler, "converse", lambda self, *a: batches.append(converse(self, *a)) or batches[-1]
    )
    argv = [*as_user_would(EXAMPLES["scripts"][SCRIPT], assets, "1"), *SIZES]
    argv = [a for a in argv if not a.startswith("trainer.default_local_dir=")]
    run = assets / "run"
    trainer = PPOTrainer(load_config([*argv, f"trainer.default_local_dir={run}"]), torch.device("cpu"))
    trainer.fit()
    trainer.close()

    assert len(batches) == 2 and all(len(b) == 4 for b in batches)  # 2 prompts x n=2, per step
    render = trainer.tokenizer.decode
    wrong = f"<|im_start|>user\n{INCORRECT}<|im_end|>\n<|im_start|>assistant\n"
    right = f"<|im_start|>user\n{CORRECT}<|im_end|>\n<|im_start|>assistant\n"
    ended, outcomes = 0, []
    for batch in batches:
        lengths = batch["attention_mask"][:, batch.prompt_length :].sum(-1).tolist()
        for row, length in enumerate(lengths):
            ids = batch["responses"][row, :length].tolist()
            mask = batch["response_mask"][row, :length].tolist()
            runs = [render(r, skip_special_tokens=False) for r in zero_runs(mask, ids)]
            scores = batch.non_tensors["turn_scores"][row]
            assert batch.non_tensors["extra_info"][row]["turn_scores"] == scores  # for the reward function
            # verl's count: the prompt, each assistant turn, each user turn.
            assert batch.non_tensors["num_turns"][row] == 2 * len(runs) + 1 + (mask[-1] == 1)
            if length < RESPONSE:  # not cut by the budget: wrong, then right, which ends it
                assert runs == [wrong, right] and scores == [0.0, 1.0] and mask[-1] == 0
                ended += 1
            else:  # the budget ran out first; a reply cut short can only be the last thing in it
                assert len(runs) == len(scores) <= 2 and scores == [0.0, 1.0][: len(scores)]
                assert runs[:-1] == [wrong][: len(runs) - 1] and [wrong, right][len(runs) - 1].startswith(
                    runs[-1]
                )
            outcomes.append((length, len(runs)))
            assert all(batch["rollout_log_probs"][row, i] == 0.0 for i in range(length) if mask[i] == 0)
    assert ended > 0, outcomes

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "training/global_step" in r]
    assert [r["training/global_step"] for r in steps] == [1, 2]
    assert all(r["num_turns/max"] <= 5 and "actor/pg_loss" in r for r in steps)
    assert trainer.rollout.counters["held"] == 0
