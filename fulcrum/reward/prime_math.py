"""The NuminaMath scorer (`numina_*` data sources), behaving as verl's `prime_math` (from PRIME, after
OpenAI's PRM800K grader). Needs sympy and pylatexenc (the `math` extra).

The answer is cut from the response by `match_answer` (after "answer:" / "the answer is", then the last
box, then after the last "is " / "=" / ": "...). It is correct when (a) its Hendrycks normalisation
equals the ground truth's, or (b) PRM800K's normalisation makes them equal, element by element for
tuples and intervals, with `sympy.simplify(gt - answer) == 0` under a 10 s limit (integers and plain
fractions must match exactly), or else (c) `fulcrum.reward.prime_grader.math_equal` holds. The score
is 1.0 or 0.0 (verl takes the first element of the scorer's tuple).
"""

from __future__ import annotations

import math
import re
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fulcrum.reward import hendrycks
from fulcrum.reward.extras import need
from fulcrum.reward.prime_grader import math_equal

SYMPY_LIMIT_S = 10.0
WHAT = "the numina_* scorer (prime_math)"
# Expressions that make sympy hang: not tried, as in PRM800K.
_BAD_SUBSTRINGS = ("^{", "^(")
_BAD_REGEXES = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
_TUPLE_CHARS = "()[]"
_UNITS = (
    "degree cm centimeter meter mile second minute hour day week month year foot feet inch yard liter".split()
)
_UNIT_PATTERNS = tuple(re.compile(f"{unit}(es)?(s)? *(\\^[0-9]+)?") for unit in _UNITS)
_GROUPED_COMMAS = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_MIXED_NUMBER = re.compile(r"([0-9]) +([0-9])")
_TEXT_WRAPPED = re.compile(r"^\\text\{(?P<text>.+?)\}$")


class SympyTimeout(Exception):
    """sympy ran past SYMPY_LIMIT_S on one comparison."""


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """SympyTimeout after `seconds` (SIGALRM); no limit outside the main thread, where the scoring
    pool's own per-sample limit still applies."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise SympyTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def mathd_normalize(answer: str | None) -> str | None:
    """Hendrycks' normalisation with an enclosing `\\text{}` removed; the text as it stands when the
    normalisation fails."""
    if answer is None:
        return None
    answer = answer.strip()
    found = _TEXT_WRAPPED.search(answer)
    if found is not None:
        answer = found.group("text").strip()
    try:
        return hendrycks.strip_string(answer)
    except hendrycks.StripError:
        return answer


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_int(x: float) -> bool:
    try:
        return abs(x - round(x)) <= 1e-7
    except (OverflowError, ValueError):  # inf, nan
        return False


def _is_frac(expr: str) -> bool:
    return bool(re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr))


def strip_grouping_commas(expr: str) -> str:
    """`1,000,000` -> `1000000`, leaving the commas of tuples alone."""
    while True:
        stripped = _GROUPED_COMMAS.sub(r"\1\3\4", expr)
        if stripped == expr:
            return stripped
        expr = stripped


def _str_is_int(text: str) -> bool:
    try:
        return _is_int(float(strip_grouping_commas(text)))
    except ValueError:
        return False


def _str_to_int(text: str) -> int:
    return int(float(text.replace(",", "")))


def _latex_to_text(expr: str) -> str:
    """TeX -> plain text sympy can read (pylatexenc), with the symbols it writes spelled out."""
    latex2text = need("pylatexenc.latex2text", "math", WHAT)
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    expr = latex2text.LatexNodes2Text().latex_to_text(expr)
    for symbol, word in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*")):
        expr = expr.replace(symbol, word)
    return expr.strip()


def prm_normalize(expr: str) -> str:
    """PRM800K's normalisation: units, `$`, `%` and `\\text{}` dropped, "or"/"and" as commas, TeX read
    into plain text, integral floats as integers, lower case."""
    found = _TEXT_WRAPPED.search(expr)
    if found is not None:
        expr = found.group("text")
    for old, new in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , ")):
        expr = expr.replace(old, new)
    for word, power in (("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12")):
        expr = expr.replace(word, power)
    for pattern in _UNIT_PATTERNS:
        expr = pattern.sub("", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(",\\\\! *", "", expr)
    if _is_float(expr) and _is_int(float(expr)):
        expr = str(round(float(expr)))
    if "\\" in expr:
        try:
            expr = _latex_to_text(expr)
        except Exception:  # pylatexenc's many parse errors: keep the TeX, as the reference does
            pass
    expr = re.sub("- *", "-", expr)
    expr = _MIXED_NUMBER.sub(r"\1+\2", expr)  # "7 3/4" -> "7+3/4"
    expr = expr.lower()
    if _str_is_int(expr):
        expr = str(_str_to_int(expr))
    return expr


def _allows_sympy(expr: str) -> bool:
    """No more than two unknown letters and none of the patterns that make sympy hang."""
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2 or any(bad in expr for bad in _BAD_SUBSTRINGS):
        return False
    return all(pattern.search(expr) is None for pattern in _BAD_REGEXES)


def equal_under_sympy(truth: str, given: str) -> bool:
    """`simplify((truth) - (given)) == 0`, within SYMPY_LIMIT_S; False on any failure or timeout."""
    sympy = need("sympy", "math", WHAT)
    parser = need("sympy.parsing.sympy_parser", "math", WHAT)
    expr = f"({truth})-({given})"
    if not _allows_sympy(expr):
        return False
    transformations = (*parser.standard_transformations, parser.implicit_multiplication_application)
    try:
        with _time_limit(SYMPY_LIMIT_S):
            difference = parser.parse_expr(expr.replace("^", "**"), transformations=transformations)
            return bool(sympy.simplify(difference) == 0)
    except Exception:  # sympy's parse and simplify errors, and SympyTimeout
        return False


def split_tuple(expr: str) -> list[str]:
    """The elements of a tuple or interval `(a, b)` / `[a, b)`; `[expr]` for anything else."""
    expr = strip_grouping_commas(expr)
    if not expr:
        return []
    inner = expr[1:-1]
    if (
        len(expr) > 2
        and expr[0] in _TUPLE_CHARS
        and expr[-1] in _TUPLE_CHARS
        and not any(ch in inner for ch in _TUPLE_CHARS)
    ):
        return [elem.strip() for elem in inner.split(",")]
    return [expr]


def grade_answer(given: str | None, truth: str) -> bool:
    """PRM800K's grader: equal after Hendrycks' normalisation, or after PRM800K's, or element by element
    under sympy (integers and unreduced fractions must match as written)."""
    if given is None:
        return False
    if mathd_normalize(truth) == mathd_normalize(given):
        return True
    truth_n, given_n = prm_normalize(truth), prm_normalize(given)
    if truth_n == given_n:
        return True
    if not given_n:
        return False
    truth_elems, given_elems = split_tuple(truth_n), split_tuple(given_n)
    brackets_differ = truth_n[0] != given_n[0] or truth_n[-1] != given_n[-1]
    if (len(truth_elems) > 1 and brackets_differ) or len(truth_elems) != len(given_elems):
        return False
    for t, g in zip(truth_elems, given_elems, strict=True):
        if _is_frac(t) and _is_frac(g):
            correct = t == g
        elif _str_is_int(t) != _str_is_int(g):
            correct = False
        else:
            correct = equal_under_sympy(t, g)
        if not correct:
            return False
    return True


def _boxed_content(text: str) -> str | None:
    """The stripped content of the last `\\boxed`/`\\fbox` group; None when there is none."""
    boxed = hendrycks.last_braced_box(text)
    return None if boxed is None else boxed[boxed.index("{") + 1 : -1].strip()


def _after_last(response: str, markers: tuple[str, ...], matched: bool) -> tuple[str, bool]:
    """The text after the last occurrence of each marker in turn (case-insensitive search, positions
    taken in the lower-cased text as the reference does)."""
    for marker in markers:
        at = response.lower().rfind(marker)
        if at != -1:
            matched = True
            response = response[at + len(marker) :].strip()
    return response, matched


def match_answer(response: str) -> tuple[bool, str]:
    """(whether an answer was marked and holds a digit, the answer text cut from the response)."""
    response, matched = _after_last(response, ("answer:", "answer is", "answers are"), False)
    for marker in ("is answer", "is the answer", "are answers", "are the answers"):
        at = response.lower().rfind(marker)
        if at != -1:
            matched = True
            response = response[:at].strip()
    boxed = _boxed_content(response)
    if boxed:
        matched = True
        response = boxed
    if ". " in response:
        response = response[: response.lower().rfind(". ")].strip()
    markers = ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n")
    response, matched = _after_last(response, markers, matched)
    return matched and any(c.isdigit() for c in response), response


def compute_score(model_output: Any, ground_truth: Any) -> tuple[bool, bool, str]:
    """(correct, format ok: "Step 2:" and a box present, the extracted answer), as verl's prime_math."""
    need("sympy", "math", WHAT)
    need("pylatexenc", "math", WHAT)
    model_output, ground_truth = str(model_output), str(ground_truth)
    _, answer = match_answer(model_output)
    well_formed = "Step 2:" in model_output and "\\box" in model_output
    if grade_answer(answer, ground_truth):
        return True, True, answer
    check: Callable[[float], bool] = lambda pi: math_equal(answer, ground_truth, timeout=True, pi=pi)  # noqa: E731
    try:
        if "\\pi" in answer or "\\pi" in ground_truth:
            correct = any([check(math.pi), check(3.14)])
        else:
            correct = check(math.pi)
    except Exception:  # the grader's own errors (a base "_" that is no number, ...) mean "not equal"
        correct = False
    return correct, well_formed, answer
