"""`math_equal`, the last resort of the numina_* scorer, behaving as verl's `prime_math/grader.py` (after
ToRA's grader and PRM800K).

Two answers are equal when, after `normalize` (a leading `$`, a trailing `%`, a base subscript `_b`
and `\\pi` -> a number):
1. their texts match (case and spaces aside), or both read as numbers and the answer is within a
   relative 1e-4 of the ground truth, or of it times 100 or divided by 100 (percentages);
2. they match with brackets and braces removed (an interval against a tuple), or part by part for
   intervals, comma lists, `Point(...)` and `pmatrix` matrices.

verl goes on to a symbolic comparison (`symbolic_equal`) that never runs: its time limit is a decorator
used as a context manager, which raises TypeError, which the comparison catches. So that step is
"not equal" here too, and the scores are verl's.

Where the reference evaluates model text with Python's `eval` (after replacing `\\pi`, and for a matrix
written as a list), `fulcrum.reward.safe_eval.arith_eval` evaluates arithmetic on literals only; any
other text counts as not evaluable, where `eval` would have run it.
"""

from __future__ import annotations

import math
import re
from typing import Any

from fulcrum.reward.extras import need
from fulcrum.reward.safe_eval import arith_eval

MAX_ANSWER_CHARS = 1000
_INTERVALS = (
    (re.compile(r"^Interval\((.*)\)$"), "[{}]"),
    (re.compile(r"^Interval\.Ropen\((.*)\)$"), "[{})"),
    (re.compile(r"^Interval\.Lopen\((.*)\)$"), "({}]"),
    (re.compile(r"^Interval\.open\((.*)\)$"), "({})"),
)


def as_number(value: Any) -> float | None:
    """The value as a float (`{,}` or `,` thousands separators removed); None when it is not one."""
    text = str(value)
    try:
        return float(text.replace("{,}", "") if "{,}" in text else text.replace(",", ""))
    except ValueError:
        return None


def _replace_pi(text: str, pi: float) -> Any:
    """Each `\\pi` as `*pi` after a digit and `1*pi` elsewhere, then the arithmetic evaluated; the text
    with the replacements when it does not evaluate."""
    at = text.find("\\pi")
    while at != -1:
        factor = f"*{pi}" if at > 0 and text[at - 1].isdigit() else f"1*{pi}"
        text = text[:at] + factor + text[at + 3 :]
        at = text.find("\\pi", at + 1)
    try:
        return arith_eval(text)
    except Exception:  # not arithmetic, or 1/0: the text stays
        return text


def normalize(answer: Any, pi: float) -> Any:
    """`$5` -> `5`, `50%` -> `50`, `101_2` -> 101 (the digits before a base subscript, as an int),
    `\\pi` -> `pi` evaluated. A base subscript after something not a number raises ValueError."""
    if not isinstance(answer, str):
        return answer
    if re.match(r"\$\d+(\.\d+)?", answer):
        return answer[1:]
    if re.match(r"^\d+(\.\d+)?%$", answer) or re.match(r"^\d+(\.\d+)?\\%$", answer):
        return answer.replace("\\%", "").replace("%", "")
    if "_" in answer:
        return int(float(answer.split("_")[0]))
    if "\\pi" in answer:
        return _replace_pi(answer, pi)
    return answer


def format_intervals(prediction: str) -> str:
    """sympy's `Interval(a, b)` spellings as bracket notation: `Interval.Ropen(a, b)` -> `[a, b)`."""
    for pattern, template in _INTERVALS:
        found = pattern.match(prediction)
        if found:
            return template.format(found.group(1))
    return prediction


def _all_equal(preds: list[Any], refs: list[Any], include_percentage: bool, tolerance: float) -> bool:
    """Every pair equal; all pairs are compared, as the reference builds the whole list first."""
    return all([math_equal(p, r, include_percentage, tolerance) for p, r in zip(preds, refs, strict=False)])


def _numbers_equal(
    prediction: Any, reference: Any, include_percentage: bool, tolerance: float
) -> bool | None:
    """Step 1's numeric comparison: None when either is not a number."""
    pred, ref = as_number(prediction), as_number(reference)
    if pred is None or ref is None:
        return None
    candidates = [ref / 100, ref, ref * 100] if include_percentage else [ref]
    return any(math.isclose(c, pred, rel_tol=tolerance) for c in candidates)


def _matrix_equal(prediction: str, reference: str, include_percentage: bool, tolerance: float) -> bool:
    """A `pmatrix` ground truth against sympy's `Matrix(...)` or a nested list."""
    if prediction.startswith("Matrix"):
        try:
            parser = need("sympy.parsing.sympy_parser", "math", "the numina_* scorer (prime_math)")
            matrix = parser.parse_expr(prediction)
            items = reference.split()[1:-1:2]
            return len(matrix) == len(items) and _all_equal(
                list(matrix), items, include_percentage, tolerance
            )
        except Exception:  # sympy's errors on model text: not equal
            return False
    if prediction.startswith("[") and prediction.endswith("]"):
        if not isinstance(arith_eval(prediction), list):  # raises, as the reference's eval does
            return False
        try:
            matrix = arith_eval(prediction)
            body = (
                reference.removeprefix(r"\\begin{pmatrix}")
                .removeprefix(r"\begin{pmatrix}")
                .removesuffix(r"\\end{pmatrix}")
                .removesuffix(r"\end{pmatrix}")
            )
            rows: list[Any] = [row.split("&") if "&" in row else row for row in body.split("\\")]
            return len(matrix) == len(rows) and _all_equal(matrix, rows, include_percentage, tolerance)
        except Exception:
            return False
    return False


def math_equal(
    prediction: Any,
    reference: Any,
    include_percentage: bool = True,
    tolerance: float = 1e-4,
    timeout: float = 10.0,
    pi: float = math.pi,
) -> bool:
    """Whether `prediction` equals `reference` by the rules of the module docstring. `timeout` is the
    reference's limit for the symbolic step, which never runs (see the module docstring)."""
    prediction, reference = normalize(prediction, pi), normalize(reference, pi)
    if isinstance(prediction, str) and len(prediction) > MAX_ANSWER_CHARS:
        prediction = prediction[:MAX_ANSWER_CHARS]
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower():
            return True
        if prediction.replace(" ", "") == reference.replace(" ", ""):
            return True
    numbers = _numbers_equal(prediction, reference, include_percentage, tolerance)
    if numbers is not None:
        return numbers
    if not prediction and prediction not in [0, False]:
        return False
    reference, prediction = str(reference).strip(), str(prediction).strip()
    prediction = format_intervals(prediction)
    pred_bare, ref_bare = prediction, reference
    if (prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("(")) or (
        prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("[")
    ):
        pred_bare, ref_bare = pred_bare.strip("[]()"), ref_bare.strip("[]()")
    for bracket in "{}()":
        pred_bare, ref_bare = pred_bare.replace(bracket, ""), ref_bare.replace(bracket, "")
    if pred_bare == ref_bare:
        return True
    if (
        prediction
        and reference
        and prediction[0] in "(["
        and prediction[-1] in ")]"
        and prediction[0] == reference[0]
        and prediction[-1] == reference[-1]
    ):
        pred_parts, ref_parts = prediction[1:-1].split(","), reference[1:-1].split(",")
        if len(pred_parts) == len(ref_parts) and _all_equal(
            pred_parts, ref_parts, include_percentage, tolerance
        ):
            return True
    if "," in prediction and "," in reference:
        pred_parts = [p.strip() for p in prediction.split(",")]
        ref_parts = [r.strip() for r in reference.split(",")]
        if len(pred_parts) == len(ref_parts):
            return _all_equal(pred_parts, ref_parts, include_percentage, tolerance)
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":
        pred_parts = prediction[prediction.find("(") + 1 : -1].split(",")
        ref_parts = reference[1:-1].split(",")
        if len(pred_parts) == len(ref_parts) and _all_equal(
            pred_parts, ref_parts, include_percentage, tolerance
        ):
            return True
    if r"\begin{pmatrix}" in reference and _matrix_equal(
        prediction, reference, include_percentage, tolerance
    ):
        return True
    return False
