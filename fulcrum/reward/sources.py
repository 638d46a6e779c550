"""Which scorer scores a `data_source`: verl's `default_compute_score` dispatch, family by family.

| data_source | scorer (verl's module) | extra |
| --- | --- | --- |
| `openai/gsm8k`, names holding `gsm8k`, `synthetic/*` | gsm8k | - |
| `lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`, `HuggingFaceH4/MATH-500` | math_reward (`math_verify=True`: math_verify) | - (`math`) |
| `math_dapo`, `math`, `math_dapo_reasoning`, `aime*` | math_dapo | - |
| `numina_aops_forum`, `numina_synthetic_math`, `numina_amc_aime`, `numina_synthetic_amc`, `numina_cn_k12`, `numina_olympiads` | prime_math | math |
| `codecontests`, `apps`, `codeforces`, `taco` | prime_code (in the jail), or sandbox_fusion with a URL | - |
| `openai/openai_humaneval` (fulcrum's, `fulcrum data humaneval`) | HumanEval's `check(candidate)` (in the jail) | - |
| `searchR1_nq`, `searchR1_triviaqa`, `searchR1_popqa`, `searchR1_hotpotqa`, `searchR1_2wikimultihopqa`, `searchR1_musique`, `searchR1_bamboogle` | search_r1_like_qa_em | - |
| `hiyouga/geometry3k` | refused: a vision data set | - |

Two deliberate differences from verl, both for a ground truth verl's own preprocessing never writes:
an integer ground truth (72, as a parquet integer column gives it) is compared as the string "72"
(verl compares the integer with the extracted string and scores every correct answer 0); a float, bool
or missing ground truth of a text family is refused with an error, where verl would score 0.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")  # and every name starting with "aime"
NUMINA_SOURCES = tuple(
    f"numina_{s}"
    for s in ("aops_forum", "synthetic_math", "amc_aime", "synthetic_amc", "cn_k12", "olympiads")
)
CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")
HUMANEVAL_SOURCES = ("openai/openai_humaneval", "openai_humaneval")  # fulcrum data humaneval
SEARCH_R1_SOURCES = tuple(
    f"searchR1_{s}"
    for s in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
)
VISION_SOURCES = ("hiyouga/geometry3k",)


class UnscoredSource(ValueError):
    """No built-in scorer scores this data_source."""


class GroundTruthError(ValueError):
    """A ground truth the scorer of its data_source cannot compare with (a float, a bool, None)."""


@dataclass(frozen=True)
class Family:
    """A group of data sources and the scorer verl gives them."""

    scorer: str  # verl's module name, as the docs and error messages call it
    isolated: bool  # scored in the scoring pool under a per-sample time limit (sympy, Math-Verify, code)
    text_truth: bool  # the ground truth is one answer string (an integer is read as its digits)


GSM8K = Family("gsm8k", isolated=False, text_truth=True)
MATH = Family("math_reward", isolated=False, text_truth=True)
MATH_VERIFY = Family("math_verify", isolated=True, text_truth=True)
DAPO = Family("math_dapo", isolated=False, text_truth=True)
NUMINA = Family("prime_math", isolated=True, text_truth=True)
CODE = Family("prime_code", isolated=True, text_truth=False)
SANDBOX = Family("sandbox_fusion", isolated=True, text_truth=False)
SEARCH_R1 = Family("search_r1_like_qa_em", isolated=False, text_truth=False)


def family_of(data_source: str, math_verify: bool = False, sandbox_fusion_url: str | None = None) -> Family:
    """The family scoring `data_source` (verl's dispatch order); UnscoredSource naming it when none does."""
    if "gsm8k" in data_source.lower() or data_source.startswith("synthetic/"):
        return GSM8K
    if data_source in MATH_SOURCES:
        return MATH_VERIFY if math_verify else MATH
    if data_source in DAPO_SOURCES or data_source.startswith("aime"):
        return DAPO
    if data_source in NUMINA_SOURCES:
        return NUMINA
    if data_source in CODE_SOURCES or data_source in HUMANEVAL_SOURCES:
        return SANDBOX if sandbox_fusion_url else CODE
    if data_source in SEARCH_R1_SOURCES:
        return SEARCH_R1
    if data_source in VISION_SOURCES:
        raise UnscoredSource(
            f"data_source {data_source!r} is a vision data set (verl scores it with geo3k on image "
            "prompts); fulcrum trains text-only models: set custom_reward_function.path and .name to score it"
        )
    raise UnscoredSource(
        f"no reward function for data_source {data_source!r}: the built-in scorers cover verl's data "
        "sources (openai/gsm8k and names holding 'gsm8k', lighteval/MATH and the MATH family, math_dapo and "
        "aime*, numina_*, apps/codecontests/codeforces/taco, searchR1_*; see docs/configuration.md); set "
        "custom_reward_function.path and custom_reward_function.name to score it"
    )


def configured_family(data_source: str, options: dict[str, Any]) -> Family:
    """`family_of` under the built-in scorers' options (`math_verify`, `sandbox_fusion_url`)."""
    return family_of(data_source, bool(options.get("math_verify")), options.get("sandbox_fusion_url"))


def text_ground_truth(ground_truth: Any, data_source: str) -> str:
    """The ground truth of a text family as a string: a string as is, an integer as its digits; a
    GroundTruthError naming the data source for a float, a bool, None or anything else."""
    if isinstance(ground_truth, str):
        return ground_truth
    if isinstance(ground_truth, numbers.Integral) and not isinstance(ground_truth, bool):
        return str(int(ground_truth))
    raise GroundTruthError(
        f"data_source {data_source!r}: ground_truth {ground_truth!r} is a {type(ground_truth).__name__}; "
        'write reward_model.ground_truth as a string ("72", as verl\'s preprocessing does)'
    )


def _as_float(result: Any) -> float | dict[str, Any]:
    """verl's result convention: a dict as is, a number as a float, a tuple's first element as a float."""
    if isinstance(result, dict):
        return result
    if isinstance(result, (int, float, bool)):
        return float(result)
    return float(result[0])


def _score(family: Family, solution_str: str, ground_truth: Any, options: dict[str, Any]) -> Any:
    """Run the family's scorer (modules imported here: some need the `math` extra)."""
    if family is GSM8K:
        from fulcrum.reward import gsm8k

        return gsm8k.compute_score(solution_str, ground_truth, method=options.get("method", "strict"))
    if family is MATH:
        from fulcrum.reward import math_reward

        return math_reward.compute_score(solution_str, ground_truth)
    if family is MATH_VERIFY:
        from fulcrum.reward import math_verify

        return math_verify.compute_score(solution_str, ground_truth)
    if family is DAPO:
        from fulcrum.reward import math_dapo

        return math_dapo.compute_score(solution_str, ground_truth)
    if family is NUMINA:
        from fulcrum.reward import prime_math

        return prime_math.compute_score(solution_str, ground_truth)
    if family is SEARCH_R1:
        from fulcrum.reward import search_r1

        return search_r1.compute_score(solution_str, ground_truth)
    from fulcrum.reward import code

    return code.compute_score(solution_str, ground_truth, options)  # CODE, or SANDBOX with its URL


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    sandbox_fusion_url: str | None = None,
    concurrent_semaphore: Any = None,
    memory_limit_mb: int | None = None,
    method: str = "strict",
    math_verify: bool = False,
    **kwargs: Any,
) -> float | dict[str, Any]:
    """verl's `default_compute_score`: the score of `solution_str` by the scorer of `data_source` (a
    float, or a dict with "score" for math_dapo). `method` is GSM8K's (strict or flexible, verl's
    `reward.compute_score_kwargs.method`); `math_verify=True` scores the MATH family with Math-Verify."""
    family = family_of(data_source, math_verify, sandbox_fusion_url)
    if family.text_truth:
        ground_truth = text_ground_truth(ground_truth, data_source)
    options = {
        "method": method,
        "sandbox_fusion_url": sandbox_fusion_url,
        "memory_limit_mb": memory_limit_mb,
        "concurrent_semaphore": concurrent_semaphore,
        **kwargs,
    }
    return _as_float(_score(family, solution_str, ground_truth, options))


@dataclass
class BuiltinScorer:
    """`default_compute_score` with the options of the configuration bound (verl's
    `reward.compute_score_kwargs`, the sandbox URL): picklable, so the scoring pool can run it, and
    able to say which samples need the pool (`isolated`)."""

    options: dict[str, Any]

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
    ) -> float | dict[str, Any]:
        return default_compute_score(data_source, solution_str, ground_truth, extra_info, **self.options)

    def isolated(self, data_source: str) -> bool:
        """Whether the sample's scorer runs in the scoring pool (sympy, Math-Verify, code)."""
        try:
            family = configured_family(data_source, self.options)
        except UnscoredSource:
            return False  # scored in-process, where the error names the sample
        return family.isolated


def scorer_name(data_source: str, math_verify: bool = False, sandbox_fusion_url: str | None = None) -> str:
    """verl's name of the scorer of `data_source` (UnscoredSource when none)."""
    return family_of(data_source, math_verify, sandbox_fusion_url).scorer


__all__ = [
    "BuiltinScorer",
    "Family",
    "GroundTruthError",
    "UnscoredSource",
    "configured_family",
    "default_compute_score",
    "family_of",
    "scorer_name",
    "text_ground_truth",
]
