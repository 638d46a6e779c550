"""bench/learning.py with a real model and GSM8K: `--set FIELD=VALUE` becomes the plan a user meant (or
stops the benchmark with the field named), and the answers of a run's validations are scored as verl's
GSM8K scorer scores them (strict, flexible, format, length, cut at the limit)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from learning import Plan, with_settings
from learning_warm import answer_stats, dump_stats


def test_settings_take_each_fields_type() -> None:
    plan = with_settings(
        Plan(), ["task=gsm8k", "gradient_checkpointing=true", "sft_lr=5e-5", "seeds=4,5", "micro_batch=32"]
    )
    assert (plan.task, plan.gradient_checkpointing, plan.sft_lr) == ("gsm8k", True, 5e-5)
    assert (plan.seeds, plan.micro_batch) == ((4, 5), 32)
    assert Plan().task == "multistep"  # the default plan is untouched


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("no_such_field=1", "Plan field"),
        ("micro_batch", "FIELD=VALUE"),
        ("gradient_checkpointing=yes", "true or false"),
    ],
)
def test_a_bad_setting_names_what_is_wrong(setting: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        with_settings(Plan(), [setting])
    with pytest.raises(ValueError, match="invalid literal"):
        with_settings(Plan(), ["micro_batch=many"])


def test_answers_are_scored_as_verls_gsm8k_scorer() -> None:
    responses = ["6 * 3 = 18 eggs.\n#### 18", "The answer is 18", "#### 17", "no number"]
    stats = answer_stats(responses, ["18", "18", "18", "18"], [10, 20, 30, 40])
    assert stats["strict"] == 0.25  # only a `#### N` counts
    assert stats["flexible"] == 0.5  # the last number, with or without ####
    assert stats["format"] == 0.5  # a `#### N` present, right or wrong
    assert stats["response_length"] == 25.0 and stats["num_problems"] == 4


def test_dump_stats_reads_the_first_and_last_validation(tmp_path: Path) -> None:
    def write(step: int, outputs: list[str], finished: list[bool]) -> None:
        rows = [
            {"output": o, "gts": "7", "response_length": 5, "finished": f}
            for o, f in zip(outputs, finished, strict=True)
        ]
        (tmp_path / f"{step}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    write(0, ["#### 3", "cut off"], [True, False])
    write(5, ["#### 7", "#### 7"], [True, True])
    write(10, ["#### 7", "7"], [True, True])  # step 10 sorts after 5 as a number, not as text
    stats = dump_stats(tmp_path)
    assert (stats["first"]["step"], stats["first"]["strict"], stats["first"]["truncated"]) == (0, 0.0, 0.5)
    assert (stats["last"]["step"], stats["last"]["strict"], stats["last"]["flexible"]) == (10, 0.5, 1.0)
    assert dump_stats(tmp_path / "none") == {}
