"""The MATH scorer (Hendrycks et al.), behaving as verl's `verl/utils/reward_score/math_reward.py`.

The answer is the content of the response's last `\\boxed{...}` (`fulcrum.reward.hendrycks.last_boxed`);
the score is 1.0 when it is equivalent to the ground truth under Hendrycks' `strip_string`, else 0.0.
The whole response is searched (no 300-character window here, unlike GSM8K and DAPO). A response with
no box, an unclosed box or an `\\fbox` scores 0.
"""

from __future__ import annotations

from fulcrum.reward.hendrycks import boxed_answer, is_equiv


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer equals the ground truth after `strip_string`, else 0.0."""
    answer = boxed_answer(solution_str)
    return 1.0 if answer is not None and is_equiv(answer, ground_truth) else 0.0
