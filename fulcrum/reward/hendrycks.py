"""The answer normalisation of Hendrycks et al.'s MATH release, as verl's `math_reward.py` and
`prime_math/math_normalize.py` apply it (both carry the same `strip_string`).

`last_boxed` finds the last `\\boxed{...}` (or `\\boxed ...`, or `\\fbox{...}`) of a text by brace
counting; `strip_string` rewrites an answer into a canonical spelling (no spaces, `\\dfrac` -> `\\frac`,
`\\frac12` -> `\\frac{1}{2}`, `0.5` -> `\\frac{1}{2}`, `a/b` -> `\\frac{a}{b}`, units after `\\text{ `
dropped, ...). Two answers are equivalent when their stripped spellings are equal.

Behaviour kept from the reference on purpose, so that a score here is verl's score:
- a `\\boxed ` (with a space) anywhere wins over a later `\\boxed{`: its text up to the next `$` is taken;
- `\\fbox{x}` is found but its content is never accepted (`remove_boxed` knows only `\\boxed`);
- an answer `strip_string` cannot handle (two `\\text{ ` units, `\\sqrt` or `\\frac` at the very end)
  raises `StripError`; `is_equiv` then compares the raw strings.
"""

from __future__ import annotations


class StripError(ValueError):
    """An answer the normalisation does not handle (the reference's assertion or index error)."""


def last_boxed(text: str) -> str | None:
    """The last `\\boxed{...}` of `text`, braces included; a `\\boxed ` (space) form up to the next `$`;
    `\\fbox{...}` when there is no `\\boxed`; None when there is none or its braces never close."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    return last_braced_box(text)


def last_braced_box(text: str) -> str | None:
    """The last `\\boxed{...}` of `text` (else its last `\\fbox{...}`), braces included; None when there
    is none or its braces never close."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    return braced_from(text, start)


def braced_from(text: str, start: int) -> str | None:
    """`text` from `start` through the brace that closes the first one opened after it (brace counting);
    None when it never closes."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None


def boxed_answer(text: str) -> str | None:
    """The content of the last box of `text` (verl's `remove_boxed(last_boxed_only_string(...))`); None
    when there is none, it never closes, or it is an `\\fbox`."""
    boxed = last_boxed(text)
    if boxed is None:
        return None
    try:
        return unbox(boxed)
    except StripError:
        return None


def unbox(boxed: str) -> str:
    """The content of `\\boxed{x}` or `\\boxed x`; StripError for anything else (an `\\fbox`, say)."""
    if "\\boxed " in boxed:
        if not boxed.startswith("\\boxed "):
            raise StripError(f"not a boxed answer: {boxed[:40]!r}")
        return boxed[len("\\boxed ") :]
    if not (boxed.startswith("\\boxed{") and boxed.endswith("}")):
        raise StripError(f"not a boxed answer: {boxed[:40]!r}")
    return boxed[len("\\boxed{") : -1]


def _fix_fracs(text: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{72}` -> `\\frac{1}{72}`; braced fractions unchanged. A
    `\\frac` followed by fewer than two characters leaves the whole text as it was; one followed by
    nothing is a StripError."""
    head, *pieces = text.split("\\frac")
    out = head
    for piece in pieces:
        out += "\\frac"
        if not piece:
            raise StripError("\\frac at the end of the answer")
        if piece[0] == "{":
            out += piece
            continue
        if len(piece) < 2:
            return text
        num, den, rest = piece[0], piece[1], piece[2:]
        out += "{" + num + "}" + (den if den == "{" else "{" + den + "}") + rest
    return out


def _fix_a_slash_b(text: str) -> str:
    """`3/4` -> `\\frac{3}{4}` when both sides are integers written plainly; anything else unchanged."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        num, den = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    if text != f"{num}/{den}":
        return text
    return "\\frac{" + str(num) + "}{" + str(den) + "}"


def _remove_right_units(text: str) -> str:
    """Drop a unit written after `\\text{ ` (with the space); two such units are a StripError."""
    if "\\text{ " not in text:
        return text
    parts = text.split("\\text{ ")
    if len(parts) != 2:
        raise StripError("more than one \\text{ unit")
    return parts[0]


def _fix_sqrt(text: str) -> str:
    """`\\sqrt3` -> `\\sqrt{3}` (one character); `\\sqrt` at the very end is a StripError."""
    head, *pieces = text.split("\\sqrt")
    out = head
    for piece in pieces:
        if not piece:
            raise StripError("\\sqrt at the end of the answer")
        out += "\\sqrt" + (piece if piece[0] == "{" else "{" + piece[0] + "}" + piece[1:])
    return out


# Plain replacements, in the reference's order (the order matters: `\\\\` before `tfrac`, ...).
_BEFORE_UNITS = (
    ("\n", ""),
    ("\\!", ""),
    ("\\\\", "\\"),
    ("tfrac", "frac"),
    ("dfrac", "frac"),
    ("\\left", ""),
    ("\\right", ""),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
    ("\\$", ""),
)
_AFTER_UNITS = (("\\\\%", ""), ("\\%", ""), (" .", " 0."), ("{.", "{0."))


def strip_string(text: str) -> str:
    """The canonical spelling of a MATH answer (see the module docstring); StripError when the
    normalisation cannot handle it."""
    for old, new in _BEFORE_UNITS:
        text = text.replace(old, new)
    text = _remove_right_units(text)
    for old, new in _AFTER_UNITS:
        text = text.replace(old, new)
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    # "k = 3" -> "3": a short left-hand side of a single equation is a variable name.
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        text = sides[1]
    text = _fix_sqrt(text)
    text = text.replace(" ", "")
    text = _fix_fracs(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _fix_a_slash_b(text)


def is_equiv(answer: str | None, truth: str | None) -> bool:
    """Equal after strip_string (the raw strings equal, when either cannot be stripped); two Nones are
    equal, one None is not."""
    if answer is None or truth is None:
        return answer is None and truth is None
    try:
        return strip_string(answer) == strip_string(truth)
    except (StripError, AttributeError, TypeError):  # a non-string ground truth falls back too
        return answer == truth
