"""The Search-R1 scorer (`searchR1_*` data sources), behaving as verl's `search_r1_like_qa_em.py`.

The answer is the text of the last `<answer>...</answer>` (stripped; tags may span lines). It is
correct when its SQuAD normalisation (lower case, punctuation and the articles a/an/the removed,
whitespace collapsed) equals that of one of the ground truth's targets (`{"target": [...]}`, or one
string). Score: 1.0; 0.25 when the response holds more than ten `<answer>` or `</answer>` tags (a guard
against spraying answers); `format_score` (0) for a wrong answer; 0 when there is no answer.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Mapping
from typing import Any

MAX_ANSWER_TAGS = 10
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no ASCII punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _targets(ground_truth: Any) -> list[str]:
    """The accepted answers: `ground_truth["target"]` (a string or a list of strings)."""
    if not isinstance(ground_truth, Mapping) or "target" not in ground_truth:
        raise ValueError(f"searchR1 ground_truth must be a mapping with 'target', got {ground_truth!r:.80}")
    target = ground_truth["target"]
    return [target] if isinstance(target, str) else [str(t) for t in _as_list(target)]


def _as_list(value: Any) -> Iterable[Any]:
    return value.tolist() if hasattr(value, "tolist") else list(value)  # a numpy array from parquet


def extract_solution(solution_str: str) -> str | None:
    """The stripped text of the last `<answer>...</answer>`; None when there is none."""
    found = _ANSWER.findall(solution_str)
    return found[-1].strip() if found else None


def em_check(prediction: str, golden_answers: list[str]) -> bool:
    """Exact match after normalisation against any of the golden answers."""
    normalized = normalize_answer(prediction)
    return any(normalize_answer(g) == normalized for g in golden_answers)


def compute_score(
    solution_str: str,
    ground_truth: Any,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` for an exact match (a quarter of it past ten answer tags), `format_score` for a wrong
    answer, 0 without one. `method` is accepted for the reference's signature and not used."""
    answer = extract_solution(solution_str)
    targets = _targets(ground_truth)
    if answer is None:
        return 0.0
    if not em_check(answer, targets):
        return float(format_score)
    opened, closed = solution_str.count("<answer>"), solution_str.count("</answer>")
    return score / 4 if opened > MAX_ANSWER_TAGS or closed > MAX_ANSWER_TAGS else float(score)
