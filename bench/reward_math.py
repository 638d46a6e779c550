"""How long 512 MATH-format responses take to score, per scorer, as a run scores them.

    python bench/reward_math.py [--n 512] [--workers 2]

The responses are chain-of-thought texts of a few hundred characters ending in a boxed answer, built
from 64 MATH-style answers (fractions, roots, intervals, polynomials, units), each in eight spellings
that are right, equivalent or wrong. Scored by the naive manager as the trainer builds it: math_reward
in-process, Math-Verify (`math_verify=true`) and prime_math (numina_*) in the scoring pool of
`--workers` processes (started before the clock, as they are for every batch after a run's first).
"""

from __future__ import annotations

import argparse
import random
import time

from fulcrum.reward.managers import NaiveRewardManager
from fulcrum.reward.pool import ScoringPool
from fulcrum.reward.sources import BuiltinScorer

ANSWERS = [
    ("\\frac{1}{2}", ["\\frac12", "0.5", "\\dfrac{1}{2}", "\\frac{2}{4}", "1/2", "\\frac{1}{3}"]),
    ("10\\sqrt{2}", ["10\\sqrt2", "\\sqrt{200}", "10 \\sqrt{2}", "14.142", "5\\sqrt{2}"]),
    ("(3,-1)", ["(3, -1)", "\\left(3,-1\\right)", "(3,1)", "(-1,3)"]),
    ("x^2+7x+10", ["(x+2)(x+5)", "x^2 + 7x + 10", "x^2+7x+1"]),
    ("[2,5)", ["[2, 5)", "2 \\le x < 5", "(2,5)"]),
    ("\\frac{\\pi}{4}", ["\\pi/4", "0.7854", "45^\\circ", "\\frac{\\pi}{2}"]),
    ("18", ["18", "18\\text{ cm}^2", "18.0", "\\$18", "17"]),
    ("\\frac{3\\sqrt{3}}{2}", ["\\frac{3}{2}\\sqrt{3}", "1.5\\sqrt3", "\\frac{3\\sqrt{2}}{2}"]),
]
FILLER = (
    "We start from the given conditions and simplify step by step. Substituting the values and "
    "collecting like terms, the expression reduces as follows. "
)


def responses(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """n (response, ground truth) pairs in MATH's format."""
    rng = random.Random(seed)
    texts, truths = [], []
    for i in range(n):
        truth, spellings = ANSWERS[i % len(ANSWERS)]
        answer = rng.choice([truth, *spellings])
        texts.append(FILLER * rng.randint(1, 4) + f"Therefore the answer is $\\boxed{{{answer}}}$.")
        truths.append(truth)
    return texts, truths


def time_scorer(
    name: str, data_source: str, options: dict, texts: list[str], truths: list[str], workers: int
) -> None:
    pool = ScoringPool(workers, sample_timeout_s=30.0)
    manager = NaiveRewardManager(compute_score=BuiltinScorer(options), pool=pool, on_error="zero")
    try:
        manager.score(texts[:workers], truths[:workers], [data_source] * workers)  # start the processes
        start = time.perf_counter()
        result = manager.score(texts, truths, [data_source] * len(texts))
        took = time.perf_counter() - start
    finally:
        pool.close()
    accuracy = sum(s > 0 for s in result.scores) / len(texts)
    print(
        f"{name:<28} {len(texts)} responses  {took:6.2f} s  {len(texts) / took:7.1f}/s  "
        f"correct {accuracy:.3f}  timeouts {result.num_timeouts}  errors {result.num_errors}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    texts, truths = responses(args.n)
    time_scorer("math_reward (lighteval/MATH)", "lighteval/MATH", {}, texts, truths, args.workers)
    time_scorer(
        "math_verify (lighteval/MATH)", "lighteval/MATH", {"math_verify": True}, texts, truths, args.workers
    )
    time_scorer("prime_math (numina_olympiads)", "numina_olympiads", {}, texts, truths, args.workers)


if __name__ == "__main__":
    main()
