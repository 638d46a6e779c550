"""Hugging Face's Math-Verify as a MATH scorer, as verl's `verl/utils/reward_score/math_verify.py` calls it
(the `math` extra: math-verify, latex2sympy2-extended).

The ground truth is wrapped as `\\boxed{<ground truth>}` and read as LaTeX; the answer is read from the
response as an expression or LaTeX; 1.0 when Math-Verify finds them equal, else 0.0. Math-Verify's
own time limit raising means the sample timed out: `ScoringTimeout` is raised so that the sample scores
0 and is counted in `reward/num_timeouts` (verl returns `timeout_score`, 0 by default, uncounted).
"""

from __future__ import annotations

from typing import Any

from fulcrum.reward.extras import need
from fulcrum.reward.pool import ScoringTimeout

WHAT = "Math-Verify scoring (math_verify)"


def compute_score(model_output: str, ground_truth: str) -> float:
    """1.0 when Math-Verify finds the response's answer equal to `\\boxed{ground_truth}`, else 0.0."""
    metric = need("math_verify.metric", "math", WHAT)
    parser = need("math_verify.parser", "math", WHAT)
    errors = need("math_verify.errors", "math", WHAT)
    verify: Any = metric.math_metric(
        gold_extraction_target=(parser.LatexExtractionConfig(),),
        pred_extraction_target=(parser.ExprExtractionConfig(), parser.LatexExtractionConfig()),
    )
    try:
        score, _ = verify(["\\boxed{" + ground_truth + "}"], [model_output])
    except errors.TimeoutException as err:
        raise ScoringTimeout(f"Math-Verify ran past its own time limit: {err}") from None
    except Exception:  # Math-Verify's parse errors on model text: not equal
        return 0.0
    return float(score)
