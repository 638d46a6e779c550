"""Scoring a batch: what a score is, what a manager's result holds, how a failed sample is handled.

`score_batch` decodes a Batch's responses, calls a reward manager's `score(...)`
(fulcrum.reward.managers), and puts each score on the last response token. A scorer that raises on a
sample either stops the run with an error naming the sample (`on_error="raise"`, the default) or
scores that sample 0 and counts it (`on_error="zero"`), so one malformed row does not end a long run
unnoticed: the count is in `RewardResult.num_errors`.

A score must be a real number (a bool counts, as in verl): a string such as "0.5" is an error, not
coerced. A NaN or infinite score is an error too (it would void every update of the step), handled
by `on_error` like a raising function and counted in `RewardResult.num_nonfinite`. So is a function
that calls `sys.exit`: left alone, it would end the run with its exit code and no message.

What concerns the whole batch (a time limit, a copy of the inputs per call, a result of the wrong
length) is `fulcrum.reward.guard`'s, around whichever manager the configuration names.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fulcrum.batch import Batch, response_lengths, reward_positions


class RewardError(RuntimeError):
    """A reward function raised on one sample; the message names the sample, data_source and exception."""


class NonFiniteRewardError(ValueError):
    """The reward function returned NaN or an infinity."""


@dataclass
class RewardResult:
    """Per-sample scores (len B) and, when the function returned dicts, their other keys per sample."""

    scores: list[float]
    extra: dict[str, list[Any]] = field(default_factory=dict)
    num_errors: int = 0
    num_nonfinite: int = 0  # of num_errors: scores that were NaN or infinite
    num_timeouts: int = 0  # samples past the per-sample time limit, scored 0 (not among num_errors)
    errors: list[str] = field(default_factory=list)  # "sample i (data_source): exception", first few only

    def add_error(self, index: int, data_source: str, err: BaseException, max_messages: int = 5) -> str:
        """Count sample `index` as failed (one of num_errors) and keep its message among the first
        `max_messages`; returns the message: "sample i (data_source 'x'): ExceptionType: text"."""
        message = f"sample {index} (data_source {data_source!r}): {error_text(err)}"
        self.num_errors += 1
        if len(self.errors) < max_messages:
            self.errors.append(message)
        return message


def error_text(err: BaseException) -> str:
    """The "Type: text" of a reward function's failure; a sys.exit call said as such."""
    if isinstance(err, SystemExit):
        return (
            f"SystemExit: the function called sys.exit({err.code!r}); a reward function must return a score"
        )
    return f"{type(err).__name__}: {err}"


def sample_failed(
    result: RewardResult,
    index: int,
    data_source: str,
    err: BaseException,
    on_error: str,
    what: str,
    max_messages: int = 5,
) -> None:
    """Sample `index` failed (`what` names the function): on_error="raise" raises RewardError naming
    the sample, its data_source, the exception and the function; "zero" leaves its score 0 and counts it."""
    if isinstance(err, NonFiniteRewardError):
        result.num_nonfinite += 1
    # On "raise" the result (and its count) is dropped: only the message matters.
    message = result.add_error(index, data_source, err, max_messages)
    if on_error == "raise":
        raise RewardError(f"reward function failed on {message} (function {what})") from err


def to_score(value: Any, index: int, result: RewardResult) -> float:
    """A reward function's answer for sample `index` as a finite float; a dict's other keys go to
    `result.extra`. Raises on anything else (the manager's on_error then handles it)."""
    if isinstance(value, dict):
        if "score" not in value:
            raise KeyError(f"the reward function returned a dict without 'score' (keys: {sorted(value)})")
        for key, item in value.items():
            if key != "score":
                column = result.extra.setdefault(key, [None] * len(result.scores))
                column[index] = item
        value = value["score"]
    # numbers.Real covers bool, int, float and numpy's scalars; str, None, tensors are refused.
    if not isinstance(value, numbers.Real):
        raise TypeError(
            f"the reward function returned {value!r} ({type(value).__name__}); a score must be a real number"
        )
    score = float(value)
    if not math.isfinite(score):
        raise NonFiniteRewardError(f"the reward function returned {score} (not a finite number)")
    return score


def as_result(value: RewardResult | Sequence[float]) -> RewardResult:
    """A manager may return plain scores (a user's manager, for instance)."""
    return value if isinstance(value, RewardResult) else RewardResult(scores=[float(v) for v in value])


def score_batch(batch: Batch, tokenizer: Any, manager: Any) -> tuple[torch.Tensor, RewardResult]:
    """Decode each response (special tokens skipped, as verl), score the batch with `manager` (any reward
    manager: `score(responses, ground_truths, data_sources, extra_infos, response_lengths)`), and put
    each score on its response's last policy token (`fulcrum.batch.reward_positions`). Returns token_level_scores (B, R) and the manager's result.
    """
    lengths = [int(n) for n in response_lengths(batch).tolist()]
    texts = [
        tokenizer.decode(batch["responses"][i, :n].tolist(), skip_special_tokens=True)
        for i, n in enumerate(lengths)
    ]
    result = as_result(
        manager.score(
            texts,
            batch.non_tensors["ground_truth"],
            batch.non_tensors["data_source"],
            batch.non_tensors["extra_info"],
            lengths,
        )
    )
    return token_level_scores(batch, result.scores), result


def token_level_scores(batch: Batch, scores: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """(B, R) float32: each row's score on its last policy token (`fulcrum.batch.reward_positions`),
    0 elsewhere; an empty response gets none."""
    out = torch.zeros(batch["responses"].shape, dtype=torch.float32)
    positions = reward_positions(batch)
    rows = torch.nonzero(positions >= 0).squeeze(-1)
    out[rows, positions[rows]] = torch.as_tensor(scores, dtype=torch.float32)[rows]
    return out
