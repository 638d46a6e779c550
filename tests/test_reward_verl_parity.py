"""fulcrum's built-in scorers against verl's own, on the responses of tests/verl_ref/cases.py.

The expected values were made by verl's `default_compute_score` (tests/verl_ref/make_verl_scores.py,
verl commit in the fixture): correct, wrong, malformed, boxed/nested/`\\frac`/units, huge and
non-ASCII responses for GSM8K, the MATH family, DAPO/AIME, numina_* and searchR1_*.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fulcrum.reward import default_compute_score, family_of

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "verl_ref"))
from cases import all_cases, expand  # noqa: E402

FIXTURE = json.loads((HERE / "fixtures" / "verl_reward_scores.json").read_text())
pytest.importorskip("sympy")
pytest.importorskip("pylatexenc")


def _key(case: dict) -> str:
    text = json.dumps(case["response"], ensure_ascii=False)
    return f"{case['data_source']}:{text[:60]}"


def test_fixture_holds_every_case() -> None:
    """The fixture was made from today's cases (regenerate it with make_verl_scores.py when they change)."""
    stored = [(c["data_source"], c["response"], c["ground_truth"]) for c in FIXTURE["cases"]]
    assert stored == all_cases()


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=_key)
def test_score_equals_verl(case: dict) -> None:
    ours = default_compute_score(case["data_source"], expand(case["response"]), case["ground_truth"])
    assert ours == case["verl"]


def test_every_family_has_a_right_and_a_wrong_answer() -> None:
    """The fixture is not one-sided: each family has cases verl scores correct and cases it does not."""
    seen: dict[str, set[bool]] = {}
    for case in FIXTURE["cases"]:
        verl = case["verl"]
        correct = verl["acc"] if isinstance(verl, dict) else verl == 1.0
        family = family_of(case["data_source"]).scorer
        seen.setdefault(family, set()).add(bool(correct))
    families = ["gsm8k", "math_reward", "math_dapo", "prime_math", "search_r1_like_qa_em"]
    assert seen == {family: {True, False} for family in families}
