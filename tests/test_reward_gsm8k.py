"""The GSM8K scorer (verl's behaviour), data_source dispatch, custom reward functions, the batch manager."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gsm8k_data import SOURCE_IDS, SOURCES, expected_rows, rows

from fulcrum.reward import default_compute_score, load_custom_reward_fn, scorer_for
from fulcrum.reward.gsm8k import compute_score, extract_solution
from fulcrum.reward.managers import NaiveRewardManager
from fulcrum.reward.scoring import RewardError


def _gold(source: Path) -> list[tuple[str, str]]:
    """(gold solution, ground truth) of the test split; the ground truth as the preprocessing writes it:
    the text after "#### ", commas removed."""
    return [(r["answer"], r["answer"].split("#### ")[-1].replace(",", "")) for r in rows(source, "test")]


@pytest.mark.parametrize("source", SOURCES, ids=SOURCE_IDS)
@pytest.mark.parametrize("method", ["strict", "flexible"])
def test_every_gold_test_solution_scores_one(method: str, source: Path) -> None:
    gold = _gold(source)
    assert len(gold) == expected_rows(source, "test")
    assert any("," in answer.rpartition("#### ")[2] for answer, _ in gold)  # a thousands comma among them
    wrong = [gt for answer, gt in gold if compute_score(answer, gt, method=method) != 1.0]
    assert wrong == []


@pytest.mark.parametrize("source", SOURCES, ids=SOURCE_IDS)
@pytest.mark.parametrize("method", ["strict", "flexible"])
def test_changed_final_number_scores_zero(method: str, source: Path) -> None:
    gold = _gold(source)
    for answer, gt in gold:
        head, _, _ = answer.rpartition("#### ")
        changed = str(int(float(gt)) + 1)
        assert compute_score(head + "#### " + changed, gt, method=method) == 0.0, answer[-60:]


# (response, ground truth, method, expected score) with format_score=0.1, so "found but wrong" (0.1)
# differs from "nothing found" (0.0).
EDGE_CASES = [
    ("so she pays 1,000 dollars.\n#### 1,000", "1000", "strict", 1.0),  # commas removed
    ("She makes #### $18", "18", "strict", 0.0),  # `$` right after "#### ": not verl's format
    ("Total: #### 18 dollars ($18)", "18", "strict", 1.0),
    ("The change is #### -7", "-7", "strict", 1.0),  # negative
    ("#### 2.5", "2.5", "strict", 1.0),  # decimal
    ("#### 2.50", "2.5", "strict", 0.1),  # string match, not numeric: 2.50 != 2.5
    ("#### 3\nno wait, #### 4", "4", "strict", 1.0),  # several ####: the last one counts
    ("#### 3\nno wait, #### 4", "3", "strict", 0.1),
    ("#### 18" + " padding" * 50, "18", "strict", 0.0),  # answer more than 300 chars before the end
    ("#### 18" + "x" * 293, "18", "strict", 1.0),  # exactly within the last 300 characters
    ("", "18", "strict", 0.0),  # empty response
    ("", "18", "flexible", 0.0),
    ("#### 18.", "18", "strict", 0.1),  # trailing period is part of the number (verl)
    ("The answer is 18.", "18", "flexible", 0.1),  # ... in flexible mode too
    ("The answer is 18", "18", "strict", 0.0),  # no "#### ": strict finds nothing
    ("The answer is 18", "18", "flexible", 1.0),
    ("I got 17 then 18 apples.", "18", "flexible", 1.0),  # the last number wins
    ("It was 1,234 apples", "1234", "flexible", 1.0),  # flexible drops commas too
    ("It was -5 degrees", "-5", "flexible", 1.0),
    ("The end . . .", "18", "flexible", 0.0),  # lone dots are not numbers
    ("####18", "18", "strict", 0.0),  # the space after #### is required
]


@pytest.mark.parametrize(("response", "truth", "method", "expected"), EDGE_CASES)
def test_edge_cases(response: str, truth: str, method: str, expected: float) -> None:
    assert compute_score(response, truth, method=method, format_score=0.1) == expected


def test_score_and_format_score_are_returned_as_given() -> None:
    assert compute_score("#### 5", "5", score=2.0) == 2.0
    assert compute_score("#### 6", "5", format_score=-0.5) == -0.5


def test_extract_solution_values_and_bad_method() -> None:
    assert extract_solution("a #### 1,234,567 b") == "1234567"
    assert extract_solution("nothing here") is None
    assert extract_solution("x 12.5 y", method="flexible") == "12.5"
    with pytest.raises(ValueError, match="fuzzy"):
        extract_solution("#### 1", method="fuzzy")


def test_default_compute_score_dispatches_by_data_source() -> None:
    assert default_compute_score("openai/gsm8k", "#### 7", "7") == 1.0
    assert default_compute_score("my_org/gsm8k_clean", "#### 7", "7") == 1.0
    assert default_compute_score("synthetic/arithmetic", "3 + 4 = 7 #### 7", "7") == 1.0
    assert default_compute_score("openai/gsm8k", "#### 8", "7") == 0.0
    with pytest.raises(ValueError, match=r"my_org/unscored.*custom_reward_function"):
        scorer_for("my_org/unscored")


def test_load_custom_reward_fn(tmp_path: Path) -> None:
    file = tmp_path / "my_reward.py"
    file.write_text(
        "def length_reward(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n"
        "    return scale * len(solution_str)\n"
        "NOT_A_FUNCTION = 3\n"
    )
    fn = load_custom_reward_fn(file, "length_reward")
    assert fn("x", "abcd", "1") == 4
    scaled = load_custom_reward_fn(file, "length_reward", reward_kwargs={"scale": 0.5})
    assert scaled("x", "abcd", "1") == 2.0
    with pytest.raises(
        AttributeError, match=r"'compute_score' is not defined in .*my_reward.py.*length_reward"
    ):
        load_custom_reward_fn(file, "compute_score")
    with pytest.raises(AttributeError, match="NOT_A_FUNCTION' is not callable"):
        load_custom_reward_fn(file, "NOT_A_FUNCTION")
    with pytest.raises(FileNotFoundError, match=r"missing\.py"):
        load_custom_reward_fn(tmp_path / "missing.py", "compute_score")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ImportError, match=r"broken.py.*not_a_module_anywhere"):
        load_custom_reward_fn(broken, "compute_score")


def test_manager_scores_a_batch_and_collects_dict_results() -> None:
    manager = NaiveRewardManager()
    result = manager.score(["#### 1", "#### 2", "no answer"], ["1", "3", "1"], ["openai/gsm8k"] * 3)
    assert result.scores == [1.0, 0.0, 0.0]
    assert result.num_errors == 0

    def with_details(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(solution_str == ground_truth), "pred": solution_str}

    result = NaiveRewardManager(compute_score=with_details).score(
        ["a", "b"], ["a", "a"], ["t", "t"], [{}, {}]
    )
    assert result.scores == [1.0, 0.0]
    assert result.extra == {"pred": ["a", "b"]}


def test_manager_errors_name_the_sample_or_count_them() -> None:
    responses, truths, sources = ["#### 1", "#### 1"], ["1", "1"], ["openai/gsm8k", "unknown/source"]
    with pytest.raises(RewardError, match=r"sample 1 \(data_source 'unknown/source'\): UnscoredSource"):
        NaiveRewardManager().score(responses, truths, sources)
    result = NaiveRewardManager(on_error="zero").score(responses, truths, sources)
    assert result.scores == [1.0, 0.0]
    assert result.num_errors == 1 and "unknown/source" in result.errors[0]
    with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
        NaiveRewardManager().score(responses, ["1"], sources)


@pytest.mark.parametrize(
    "returned, accepted",
    [
        (0.5, 0.5),
        (1, 1.0),
        (True, 1.0),  # verl accepts bools
        (np.float32(0.25), 0.25),
        ({"score": False, "acc": 1}, 0.0),
        ("0.5", None),  # a string is not coerced
        (None, None),
        (torch.tensor(0.5), None),
    ],
)
def test_manager_accepts_only_real_numbers(returned: object, accepted: float | None) -> None:
    manager = NaiveRewardManager(compute_score=lambda *_: returned)
    if accepted is not None:
        assert manager.score(["r"], ["t"], ["my/source"]).scores == [accepted]
        return
    with pytest.raises(RewardError, match=r"sample 0 \(data_source 'my/source'\): TypeError: .*real number"):
        manager.score(["r"], ["t"], ["my/source"])


def test_manager_names_nan_and_inf_and_counts_them() -> None:
    scores = iter([float("nan"), 1.0, float("-inf")])
    manager = NaiveRewardManager(compute_score=lambda *_: next(scores), on_error="zero")
    result = manager.score(["a", "b", "c"], ["t"] * 3, ["s"] * 3)
    assert result.scores == [0.0, 1.0, 0.0]
    assert result.num_nonfinite == 2 and result.num_errors == 2
    assert "returned nan (not a finite number)" in result.errors[0]
    with pytest.raises(RewardError, match=r"sample 0 .*returned inf"):
        NaiveRewardManager(compute_score=lambda *_: float("inf")).score(["a"], ["t"], ["s"])
