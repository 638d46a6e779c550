"""The GSM8K rule-based scorer, behaving exactly as verl's `verl/utils/reward_score/gsm8k.py`.

Only the last 300 characters of the response are searched (an answer is at the end; regexes on long
texts are slow). `strict` takes the number after the last `#### ` (commas and `$` removed);
`flexible` takes the last run of digits, `.`, `,` and a leading `-` that is not just `.`. The score
is `score` on an exact string match with the ground truth, `format_score` when a number was found
but differs, and 0 when none was found.

One deliberate difference from verl: `flexible` also removes the commas of the number it found.
verl keeps them there, so a comma-grouped answer ("#### 2,125") can never equal its comma-free
ground truth ("2125") and 14 of the 1,319 gold test solutions would score 0 in flexible mode. Only
answers with commas score differently. Everything else is verl's, quirks included: a trailing
period is part of the number (`#### 18.` is "18.", not "18"), and `1.0` does not match "1".
"""

from __future__ import annotations

import re

SOLUTION_CLIP_CHARS = 300

# verl's patterns, verbatim in meaning: `#### ` then an optional minus and digits/dots/commas.
_STRICT_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
_ANY_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_NOT_A_NUMBER = ("", ".")

METHODS = ("strict", "flexible")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer of `solution_str` as a string, or None when there is none.

    strict: the last `#### <number>`, with `,` and `$` removed. flexible: the last number-like run
    that is not just "." (commas removed: see the module docstring).
    """
    if method not in METHODS:
        raise ValueError(f"gsm8k: unknown method {method!r}, expected one of {METHODS}")
    text = solution_str[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT_ANSWER.findall(text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(_ANY_NUMBER.findall(text)):
        if candidate not in _NOT_A_NUMBER:
            return candidate.replace(",", "")
    return None


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` if the extracted answer equals `ground_truth` (as strings), else `format_score`; 0 if none.

    Reference: Trung et al., "ReFT: Reasoning with Reinforced Fine-Tuning", ACL 2024 (as in verl).
    """
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return float(score) if answer == ground_truth else float(format_score)
