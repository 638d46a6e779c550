"""The synthetic arithmetic task: reproducible, correct, scored by the GSM8K scorer, in verl's schema."""

import re

import pyarrow.parquet as pq
import pytest

from fulcrum.data.synthetic import (
    DATA_SOURCE,
    GSM8K_INSTRUCTION,
    ArithmeticTask,
    main,
    make_rows,
    write_splits,
)
from fulcrum.reward import default_compute_score
from fulcrum.reward.gsm8k import compute_score

LINE = re.compile(r"^(\d+) ([+-]) (\d+) = (\d+)$")


def test_same_seed_same_rows_other_seed_other_rows():
    task = ArithmeticTask(num_operations=2)
    assert make_rows(50, 3, task, "train") == make_rows(50, 3, task, "train")
    assert make_rows(50, 3, task, "train") != make_rows(50, 4, task, "train")


@pytest.mark.parametrize(
    "task",
    [
        ArithmeticTask(),
        ArithmeticTask(max_operand=99, num_operations=3),
        ArithmeticTask(min_operand=0, max_operand=5, operations=("-",), num_operations=2),
        ArithmeticTask(show_work=False, instruction=None),
    ],
)
def test_gold_solutions_are_right_and_score_one(task):
    for row in make_rows(200, 0, task, "train"):
        info, truth = row["extra_info"], row["reward_model"]["ground_truth"]
        solution = info["answer"]
        # The gold response earns full marks from the scorer the trainer uses, in both modes.
        assert compute_score(solution, truth, method="strict") == 1.0, solution
        assert compute_score(solution, truth, method="flexible") == 1.0, solution
        assert default_compute_score(row["data_source"], solution, truth) == 1.0
        lines = solution.split("\n")
        assert lines[-1] == f"#### {truth}"
        if not task.show_work:
            assert len(lines) == 1
            continue
        # Each worked line is true arithmetic, chains from the previous result and uses the question's numbers.
        numbers_in_question = [int(n) for n in re.findall(r"\d+", info["question"])]
        value = None
        for i, line in enumerate(lines[:-1]):
            a, op, b, c = LINE.match(line).groups()
            a, b, c = int(a), int(b), int(c)
            assert c == (a + b if op == "+" else a - b) and c >= 0, line
            assert a == (numbers_in_question[0] if i == 0 else value)
            assert b == numbers_in_question[i + 1]
            value = c
        assert str(value) == truth
        assert len(lines) - 1 == task.num_operations


def test_rows_follow_verl_schema_and_prompt():
    row = make_rows(1, 0, ArithmeticTask(), "test")[0]
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["data_source"] == DATA_SOURCE
    assert row["reward_model"]["style"] == "rule"
    assert row["prompt"] == [
        {"role": "user", "content": f"{row['extra_info']['question']} {GSM8K_INSTRUCTION}"}
    ]
    assert row["extra_info"]["split"] == "test" and row["extra_info"]["index"] == 0


def test_mixed_styles_only_marked_answers_score_under_strict():
    rows = make_rows(400, 0, ArithmeticTask(marked_fraction=0.5), "train")
    marked = [r for r in rows if "####" in r["extra_info"]["answer"]]
    assert 0.35 < len(marked) / len(rows) < 0.65
    for r in rows:
        solution, truth = r["extra_info"]["answer"], r["reward_model"]["ground_truth"]
        strict = compute_score(solution, truth, method="strict")
        assert strict == (1.0 if r in marked else 0.0)
        if r not in marked:
            assert solution.endswith(f"The answer is {truth}.")


def test_style_fraction_per_story_kind():
    rows = make_rows(300, 0, ArithmeticTask(marked_fraction=(1.0, 0.0)), "train")
    for r in rows:
        container = " holds " in r["extra_info"]["question"]
        assert ("####" in r["extra_info"]["answer"]) == (not container)
    assert any(" holds " in r["extra_info"]["question"] for r in rows)


def test_write_splits_has_no_test_question_in_train(tmp_path):
    train, test = write_splits(
        tmp_path, num_train=300, num_test=100, seed=1, task=ArithmeticTask(max_operand=9)
    )
    train_q = {r["question"] for r in pq.read_table(train).column("extra_info").to_pylist()}
    test_q = [r["question"] for r in pq.read_table(test).column("extra_info").to_pylist()]
    assert len(train_q) == 300 and len(set(test_q)) == 100
    assert not train_q & set(test_q)


def test_bad_knobs_are_named():
    with pytest.raises(ValueError, match="max_operand"):
        ArithmeticTask(min_operand=5, max_operand=2)
    with pytest.raises(ValueError, match="operations"):
        ArithmeticTask(operations=("*",))
    with pytest.raises(ValueError, match="marked_fraction"):
        ArithmeticTask(marked_fraction=1.5)
    with pytest.raises(ValueError, match="marked_fraction"):
        ArithmeticTask(marked_fraction=(0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match="distinct"):
        make_rows(5000, 0, ArithmeticTask(min_operand=1, max_operand=1, operations=("+",)), "train")


def test_command_line_writes_both_files(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--train", "20", "--test", "5", "--answer-only"]) == 0
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert len(rows) == 20 and rows[0]["extra_info"]["answer"].startswith("#### ")
    assert pq.read_table(tmp_path / "test.parquet").num_rows == 5
