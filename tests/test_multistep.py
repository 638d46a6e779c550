"""The multi-step task: right worked solutions that carry each result on, GSM8K-scored, held out."""

import re

import pyarrow.parquet as pq
import pytest

from fulcrum.data.multistep import (
    DATA_SOURCE,
    MultiStepTask,
    equation_chain,
    main,
    make_rows,
    write_splits,
)
from fulcrum.reward import default_compute_score
from fulcrum.reward.gsm8k import compute_score

LINE = re.compile(r"^(\d+) ([-+*/]) (\d+) = (\d+)$")


@pytest.mark.parametrize(
    "task",
    [
        MultiStepTask(),
        MultiStepTask(min_steps=4, max_steps=4, max_factor=9, max_value=999),
        MultiStepTask(operations=("+", "-")),
    ],
)
def test_worked_solutions_chain_are_right_and_score_one_in_strict_mode(task):
    for row in make_rows(300, 0, task, "train"):
        info, truth = row["extra_info"], row["reward_model"]["ground_truth"]
        solution = info["answer"]
        assert compute_score(solution, truth, method="strict") == 1.0, solution
        assert default_compute_score(row["data_source"], solution, truth) == 1.0
        lines = solution.split("\n")
        assert lines[-1] == f"#### {truth}"
        assert task.min_steps <= len(lines) - 1 == info["num_steps"] <= task.max_steps
        numbers = [int(n) for n in re.findall(r"\d+", info["question"])]
        value = numbers[0]
        for i, line in enumerate(lines[:-1]):
            a, op, b, c = LINE.match(line).groups()
            a, b, c = int(a), int(b), int(c)
            assert op in task.operations
            assert a == value, f"line {i} does not start from the previous result: {solution}"
            assert b == numbers[i + 1], f"operand not the question's: {info['question']}"
            exact = {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op]
            assert c == exact and 1 <= c <= task.max_value, line
            value = c
        assert str(value) == truth
        # verl's schema, the GSM8K instruction after the question
        assert row["data_source"] == DATA_SOURCE
        assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"].startswith(info["question"])
        assert row["prompt"][0]["content"].endswith('output the final answer after "####".')


def test_problems_use_two_to_four_steps_and_every_operation():
    rows = make_rows(2000, 1, MultiStepTask(), "train")
    assert {r["extra_info"]["num_steps"] for r in rows} == {2, 3, 4}
    ops = {line.split()[1] for r in rows for line in r["extra_info"]["answer"].split("\n")[:-1]}
    assert ops == {"+", "-", "*", "/"}


def test_same_seed_same_rows():
    task = MultiStepTask()
    assert make_rows(50, 3, task, "train") == make_rows(50, 3, task, "train")
    assert make_rows(50, 3, task, "train") != make_rows(50, 4, task, "train")


def test_validation_set_never_overlaps_training(tmp_path):
    train_path, test_path = write_splits(tmp_path, num_train=5000, num_test=600, seed=2)
    train, test = pq.read_table(train_path).to_pylist(), pq.read_table(test_path).to_pylist()
    assert len(train) == 5000 and len(test) == 600
    train_questions = {r["extra_info"]["question"] for r in train}
    train_chains = {equation_chain(r["extra_info"]["answer"]) for r in train}
    test_questions = [r["extra_info"]["question"] for r in test]
    test_chains = [equation_chain(r["extra_info"]["answer"]) for r in test]
    assert not train_questions & set(test_questions)
    assert not train_chains & set(test_chains)
    assert len(set(test_questions)) == len(set(test_chains)) == 600
    assert {r["extra_info"]["split"] for r in test} == {"test"}


def test_bad_task_and_impossible_sizes_are_named(tmp_path):
    with pytest.raises(ValueError, match="min_steps"):
        MultiStepTask(min_steps=3, max_steps=2)
    with pytest.raises(ValueError, match="operations"):
        MultiStepTask(operations=("-", "*"))
    with pytest.raises(ValueError, match="distinct train problems"):
        make_rows(
            500,
            0,
            MultiStepTask(min_steps=1, max_steps=1, max_start=3, max_operand=1, max_factor=2, max_value=5),
            "train",
        )
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--operations", "+%"])


def test_cli_writes_both_splits(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--train", "40", "--test", "10", "--max-steps", "3"]) == 0
    assert pq.read_table(tmp_path / "train.parquet").num_rows == 40
    test = pq.read_table(tmp_path / "test.parquet").to_pylist()
    assert len(test) == 10 and max(r["extra_info"]["num_steps"] for r in test) <= 3


def test_dev_set_shares_no_problem_with_train_or_test(tmp_path):
    assert main(["--out", str(tmp_path), "--train", "2000", "--test", "300", "--dev", "200"]) == 0
    splits = {
        name: pq.read_table(tmp_path / f"{name}.parquet").to_pylist() for name in ("train", "test", "dev")
    }
    assert [len(splits[n]) for n in ("train", "test", "dev")] == [2000, 300, 200]
    dev_chains = {equation_chain(r["extra_info"]["answer"]) for r in splits["dev"]}
    dev_questions = {r["extra_info"]["question"] for r in splits["dev"]}
    for other in ("train", "test"):
        assert not dev_chains & {equation_chain(r["extra_info"]["answer"]) for r in splits[other]}
        assert not dev_questions & {r["extra_info"]["question"] for r in splits[other]}
    assert {r["extra_info"]["split"] for r in splits["dev"]} == {"dev"}
    # The dev set does not change the other two: they are what they were without it.
    write_splits(tmp_path / "plain", num_train=2000, num_test=300)
    assert pq.read_table(tmp_path / "plain" / "test.parquet").to_pylist() == splits["test"]
