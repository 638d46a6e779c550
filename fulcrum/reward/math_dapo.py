"""The DAPO-Math / AIME scorer, behaving as verl's `verl/utils/reward_score/math_dapo.py`.

Only the last 300 characters of the response are read. The answer is the text after the last
`Answer:` (Minerva's format, case-insensitive, up to the end of its line), normalised by
`normalize_final_answer` (Lewkowycz et al., "Solving Quantitative Reasoning Problems with Language
Models", 2022) like the ground truth; the score is +1.0 when the two are equal and -1.0 otherwise (a
missing answer too), returned as `{"score", "acc", "pred"}`.

`strict_box_verify=True` instead takes the last `\\boxed{...}` of the final 100 characters and compares
its content with the raw ground truth. With `pause_tokens_index` the 100 characters start 100 before
its last entry; as in verl that position is applied to the 300-character tail, not to the whole
response, so an index computed on the full response points elsewhere in a long one (kept so that
scores equal verl's).

Like verl, the normaliser deletes its list of unit words wherever they occur, inside other words too
("sue" from "issue"), and drops "a " and "an " before anything else.
"""

from __future__ import annotations

import re
from typing import Any

from fulcrum.reward.hendrycks import braced_from

SOLUTION_CLIP_CHARS = 300
STRICT_BOX_CHARS = 100
MINERVA_ANSWER = r"(?i)Answer\s*:\s*([^\n]+)"
NO_ANSWER = "[INVALID]"

_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_REMOVED = (
    *"square ways integers dollars mph inches hours km units".split(),
    "\\ldots",
    *"sue points feet minutes digits cents degrees cm gm pounds meters meals edges students".split(),
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
# (pattern, replacement) applied in order: keep the math between the first pair of $, unwrap \text,
# \textbf, \overline and \boxed, then expand the shorthand \fracab and \sqrta.
_REWRITES = tuple(
    (re.compile(p), r)
    for p, r in (
        (r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$"),
        (r"(\\text\{)(.*?)(\})", "\\2"),
        (r"(\\textbf\{)(.*?)(\})", "\\2"),
        (r"(\\overline\{)(.*?)(\})", "\\2"),
        (r"(\\boxed\{)(.*)(\})", "\\2"),
        (r"(frac)([^{])(.)", "frac{\\2}{\\3}"),
        (r"(sqrt)([^{])", "sqrt{\\2}"),
    )
)


def normalize_final_answer(final_answer: str) -> str:
    """Minerva's normalisation: the right-hand side of the last `=`, units and filler words removed,
    TeX wrappers unwrapped, `$` dropped, `1,000` -> `1000`, surrounding whitespace stripped."""
    final_answer = final_answer.split("=")[-1]
    for old, new in _SUBSTITUTIONS:
        final_answer = final_answer.replace(old, new)
    for word in _REMOVED:
        final_answer = final_answer.replace(word, "")
    for pattern, replacement in _REWRITES:
        final_answer = pattern.sub(replacement, final_answer)
    final_answer = final_answer.replace("$", "")
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")
    return final_answer.strip()


def last_boxed(text: str) -> str | None:
    """The last `\\boxed{...}` of `text` with its braces (brace counting); None if none or unclosed."""
    start = text.rfind("\\boxed{")
    return None if start < 0 else braced_from(text, start)


def minerva_answer(solution_str: str) -> str:
    """The normalised text after the last `Answer:`; the normalised "[INVALID]" when there is none."""
    found = re.findall(MINERVA_ANSWER, solution_str)
    return normalize_final_answer(found[-1] if found else NO_ANSWER)


def strict_box_answer(solution_str: str, pause_tokens_index: list[int] | None = None) -> str | None:
    """The content of the last `\\boxed{}` in the final 100 characters (see the module docstring)."""
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index must hold 4 positions, got {len(pause_tokens_index)}")
        tail = solution_str[pause_tokens_index[-1] - STRICT_BOX_CHARS :]
    else:
        tail = solution_str[-STRICT_BOX_CHARS:]
    boxed = last_boxed(tail)
    return boxed[len("\\boxed{") : -1] if boxed is not None else None


def compute_score(
    solution_str: str,
    ground_truth: str,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> dict[str, Any]:
    """{"score": +1.0 if correct else -1.0, "acc": correct, "pred": the extracted answer}."""
    solution_str = solution_str[-SOLUTION_CLIP_CHARS:]
    if strict_box_verify:
        pred: str | None = strict_box_answer(solution_str, pause_tokens_index)
        correct = pred == ground_truth
    else:
        pred = minerva_answer(solution_str)
        correct = pred == normalize_final_answer(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
