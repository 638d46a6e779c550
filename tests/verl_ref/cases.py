"""Responses and ground truths on which fulcrum's scorers are compared with verl's (tests/test_reward_verl_parity.py).

Each family gets the same kinds of response: correct, wrong, malformed (no answer, an unclosed box),
boxed/nested/`\\frac`/units, huge (a long text before the answer, or the answer outside the scorer's
window) and non-ASCII. `make_verl_scores.py` scores them with verl's own functions into
`tests/fixtures/verl_reward_scores.json`; the test scores them with fulcrum's.
"""

from __future__ import annotations

from typing import Any

HUGE = 200_000  # characters of filler before the answer


def expand(response: Any) -> str:
    """A response as stored in the fixture: a string, or {"pad": n, "text": s} for n filler characters + s."""
    if isinstance(response, str):
        return response
    return ("lorem ipsum " * (response["pad"] // 12 + 1))[: response["pad"]] + response["text"]


def _math_cases() -> list[tuple[str, Any, Any]]:
    sources = ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"]
    truths = ["\\frac{1}{2}", "5", "10\\sqrt{2}", "(3,-1)", "\\text{(B)}", "18", "x^2+7x+10", "90^\\circ"]
    spellings = {
        "\\frac{1}{2}": ["\\frac{1}{2}", "\\dfrac12", "0.5", "1/2", ".5", "\\frac{2}{4}", "\\tfrac{1}{2}"],
        "5": ["5", "k = 5", "5\\text{ cm}", "5.0", "\\$5", "5\\%", "５"],
        "10\\sqrt{2}": ["10\\sqrt2", "10\\sqrt{2}", "10 \\sqrt{2}", "\\sqrt{200}"],
        "(3,-1)": ["(3, -1)", "\\left(3,-1\\right)", "(3,1)"],
        "\\text{(B)}": ["\\text{(B)}", "B", "(B)"],
        "18": ["18", "18\\text{ cm}^2", "18\\text{ cm}\\text{ m}", "18^{\\circ}"],
        "x^2+7x+10": ["x^2 + 7x + 10", "(x+2)(x+5)"],
        "90^\\circ": ["90", "90^\\circ", "90^{\\circ}"],
    }
    templates = [
        "So the answer is $\\boxed{ANS}$.",
        "We get \\boxed{ANS}",
        "\\boxed ANS$ done",
        "The final answer is \\fbox{ANS}.",
        "First \\boxed{7}, then \\boxed{ANS}",
        "\\boxed{\\boxed{ANS}}",
        "unclosed \\boxed{ANS",
        "答案是 \\boxed{ANS}。",
        "The answer is ANS.",
        {"pad": HUGE, "text": " so \\boxed{ANS}"},
    ]
    cases = []
    for i, truth in enumerate(truths):
        for j, spelling in enumerate(spellings[truth]):
            for k, template in enumerate(templates):
                if (i + j + k) % 3 and not isinstance(template, dict):
                    continue  # a third of the cross product keeps the fixture small; every template still appears
                if isinstance(template, dict):
                    response: Any = {
                        "pad": template["pad"],
                        "text": template["text"].replace("ANS", spelling),
                    }
                else:
                    response = template.replace("ANS", spelling)
                cases.append((sources[(i + j) % 3], response, truth))
    cases += [
        ("lighteval/MATH", "\\boxed{\\sqrt}", "\\sqrt"),
        ("lighteval/MATH", "\\boxed{\\frac}", "\\frac"),
        ("lighteval/MATH", "", "5"),
        ("lighteval/MATH", "}}}{{{\\boxed{}", ""),
    ]
    return cases


def _dapo_cases() -> list[tuple[str, Any, Any]]:
    sources = ["math_dapo", "math", "math_dapo_reasoning", "aime2024", "aime25"]
    pairs = [
        ("Answer: 42", "42"),
        ("answer : 42", "42"),
        ("Answer: 41", "42"),
        ("Answer: 1,000", "1000"),
        ("Answer: $\\frac{1}{2}$", "\\frac{1}{2}"),
        ("Answer: \\frac12", "\\frac{1}{2}"),
        ("Answer: \\boxed{42}", "42"),
        ("Answer: 5 cm", "5"),
        ("Answer: \\$5", "5"),
        ("Answer: x = 7", "7"),
        ("Answer: 90^\\circ", "90"),
        ("Answer: an apple", "apple"),
        ("Answer: 12 students", "12"),
        ("Answer: ５", "５"),
        ("答案 Answer: 七", "七"),
        ("Answer: 3\nAnswer: 4", "4"),
        ("no answer line, just \\boxed{42}", "42"),
        ("Answer: 42", "\\boxed{42}"),
        ("Answer:", "42"),
        ("Answer: \\sqrt2", "\\sqrt{2}"),
        ("Answer: \\text{issue}", "is"),
    ]
    cases: list[tuple[str, Any, Any]] = []
    for i, (response, truth) in enumerate(pairs):
        cases.append((sources[i % len(sources)], "Let me work it out.\n" + response, truth))
    cases.append(("math_dapo", {"pad": HUGE, "text": "\nAnswer: 42"}, "42"))
    cases.append(("aime2024", "Answer: 42\n" + "x" * 400, "42"))  # outside the 300-character window
    return cases


def _numina_cases() -> list[tuple[str, Any, Any]]:
    sources = [
        "numina_aops_forum",
        "numina_synthetic_math",
        "numina_amc_aime",
        "numina_synthetic_amc",
        "numina_cn_k12",
        "numina_olympiads",
    ]
    pairs = [
        ("\\boxed{0.5}", "\\frac{1}{2}"),
        ("The answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("The answer is 7.", "7"),
        ("so x = 3", "3"),
        ("\\boxed{(1, 2)}", "(1,2)"),
        ("\\boxed{(1, 3)}", "(1,2)"),
        ("\\boxed{[1, 2)}", "[1,2)"),
        ("\\boxed{2\\pi}", "2\\pi"),
        ("\\boxed{6.2832}", "2\\pi"),
        ("\\boxed{50\\%}", "50"),
        ("\\boxed{1,000}", "1000"),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}"),
        ("\\boxed{x^2 + 2x + 1}", "(x+1)^2"),
        ("\\boxed{2/4}", "\\frac{1}{2}"),
        ("\\boxed{10_2}", "10"),
        ("\\boxed{5 \\text{ cm}}", "5"),
        ("\\boxed{5 meters}", "5"),
        ("答案是 \\boxed{3}", "3"),
        ("答案是 \\boxed{٣}", "3"),
        ("\\boxed{3 \\text{ or } 4}", "3, 4"),
        ("\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
        ("\\boxed{[1, 2]}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
        ("no digits here", "7"),
        ("\\boxed{3}", "3.0"),
        ("\\boxed{1e3}", "1000"),
        ("\\boxed{\\infty}", "\\infty"),
        ("\\boxed{-\\frac{3}{4}}", "-0.75"),
        ("Step 1: ... Step 2: ... \\boxed{12}", "12"),
    ]
    cases: list[tuple[str, Any, Any]] = []
    for i, (response, truth) in enumerate(pairs):
        cases.append((sources[i % len(sources)], response, truth))
    cases.append(("numina_olympiads", {"pad": 20_000, "text": " The answer is \\boxed{12}."}, "12"))
    return cases


def _search_cases() -> list[tuple[str, Any, Any]]:
    sources = ["searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa"]
    pairs = [
        ("<answer>Paris</answer>", {"target": ["Paris"]}),
        ("<answer> the Paris. </answer>", {"target": ["paris"]}),
        ("<answer>Lyon</answer>", {"target": ["Paris", "Lyon"]}),
        ("<answer>Berlin</answer>", {"target": ["Paris"]}),
        ("Paris", {"target": ["Paris"]}),
        ("<answer>x</answer> <answer>Paris</answer>", {"target": "Paris"}),
        ("<answer>Paris</answer>" * 11, {"target": ["Paris"]}),
        ("<answer>Zürich</answer>", {"target": ["zürich"]}),
        ("<answer>\nNew\nYork\n</answer>", {"target": ["New York"]}),
    ]
    return [(sources[i % len(sources)], r, t) for i, (r, t) in enumerate(pairs)]


def _gsm8k_cases() -> list[tuple[str, Any, Any]]:
    return [
        ("openai/gsm8k", "So #### 72", "72"),
        ("openai/gsm8k", "So #### 72.", "72"),
        ("openai/gsm8k", "#### $1,200", "1200"),
        ("openai/gsm8k", "the answer is 72", "72"),
        ("openai/gsm8k", {"pad": HUGE, "text": " #### 18"}, "18"),
        ("openai/gsm8k", "#### 18" + " " * 300, "18"),
        ("openai/gsm8k", "答案 #### 5", "5"),
    ]


def all_cases() -> list[tuple[str, Any, Any]]:
    """(data_source, response (see `expand`), ground_truth) for every family verl scores in-process."""
    return _gsm8k_cases() + _math_cases() + _dapo_cases() + _numina_cases() + _search_cases()
