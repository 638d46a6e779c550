"""The reward manager as the trainer calls it: its own copy of the inputs, a time limit on each batch,
and every failure named (the function and its file) and handled by `reward_model.on_error`.

Around any manager (built in or a user's), `GuardedRewardManager.score`:

- gives the call its own deep copy of each sample's `extra_info`: the dataset's dicts are shared by the
  n responses of a prompt and by every epoch, so a function that mutates one would change what the next
  sample and the next epoch receive;
- runs it under `reward_model.timeout_s` (fulcrum.reward.limits.TimeLimit);
- turns what fails the whole batch into the `on_error` policy: running past the limit, `sys.exit`, an
  exception a manager did not handle itself, a result whose length is not the batch's. "raise" stops the
  run with a RewardError naming the function and its file; "zero" scores the batch 0, counts every
  response in `reward/num_errors` and keeps the message for the step's warning;
- checks each score is finite (a user's manager may return NaN), per sample, as the naive manager does.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fulcrum.reward import describe
from fulcrum.reward.limits import GRACE_S, RewardTimeout, TimeLimit
from fulcrum.reward.scoring import (
    NonFiniteRewardError,
    RewardError,
    RewardResult,
    as_result,
    error_text,
    sample_failed,
)


def own_copies(extra_infos: Sequence[Any] | None, num: int) -> list[Any]:
    """One deep copy per sample, copied one at a time: a single deepcopy of the list would keep the
    sharing between samples of one prompt (deepcopy's memo copies a shared dict once)."""
    if extra_infos is None:
        return [None] * num
    return [copy.deepcopy(info) for info in extra_infos]


def describe_manager(manager: Any) -> str:
    """The reward function a manager calls (`name in file`), else the manager's own class."""
    fn = getattr(manager, "compute_score", None)
    if callable(fn):
        return describe(fn)
    return f"reward manager {describe(type(manager))}"


@dataclass
class GuardedRewardManager:
    """`manager.score(...)` with a copy of the inputs, a time limit and on_error for whole-batch failures."""

    manager: Any
    on_error: Literal["raise", "zero"] = "raise"
    timeout_s: float | None = 600.0
    grace_s: float = GRACE_S

    def __post_init__(self) -> None:
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(
                f"reward_model.timeout_s must be a positive number of seconds or null, got {self.timeout_s!r}"
            )
        self.what = describe_manager(self.manager)

    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[str],
        data_sources: Sequence[str],
        extra_infos: Sequence[dict | None] | None = None,
        response_lengths: Sequence[int] | None = None,
    ) -> RewardResult:
        """The manager's scores, one per response, each finite (or the batch's failure by on_error)."""
        num = len(responses)
        infos = own_copies(extra_infos, num)
        try:
            with TimeLimit(self.timeout_s, f"the reward function {self.what}", self.grace_s) as limit:
                value = self.manager.score(responses, ground_truths, data_sources, infos, response_lengths)
            if limit.expired:  # the function caught the interruption and returned anyway
                raise RewardTimeout
            result = as_result(value)
        except RewardError:
            raise  # a sample's failure, already handled by the manager's on_error
        except RewardTimeout:
            return self._batch_failed(
                num,
                f"did not finish scoring {num} responses within reward_model.timeout_s={self.timeout_s:g} s",
            )
        except (Exception, SystemExit) as err:
            return self._batch_failed(num, f"failed: {error_text(err)}", err)
        if len(result.scores) != num:
            return self._batch_failed(num, f"returned {len(result.scores)} scores for {num} responses")
        self._check_finite(result, data_sources)
        return result

    def close(self) -> None:
        """End the manager's scoring processes, if it has a pool."""
        pool = getattr(self.manager, "pool", None)
        if pool is not None:
            pool.close()

    def _batch_failed(self, num: int, reason: str, err: BaseException | None = None) -> RewardResult:
        """on_error for a failure of the whole batch: raise, or every response scored 0 and counted."""
        message = f"the reward function {self.what} {reason}"
        if self.on_error == "raise":
            raise RewardError(
                f"{message} (reward_model.on_error=raise; with zero such a batch scores 0 and the run goes on)"
            ) from err
        return RewardResult(scores=[0.0] * num, num_errors=num, errors=[f"all {num} responses: {message}"])

    def _check_finite(self, result: RewardResult, data_sources: Sequence[str]) -> None:
        """A NaN or infinite score left in would void every update of the step: on_error per sample."""
        for i, score in enumerate(result.scores):
            if not math.isfinite(score):
                result.scores[i] = 0.0
                err = NonFiniteRewardError(f"the reward function returned {score} (not a finite number)")
                sample_failed(result, i, data_sources[i], err, self.on_error, self.what)


def guard_manager(manager: Any, reward_model_cfg: Any) -> GuardedRewardManager:
    """`manager` under `reward_model.{on_error, timeout_s}`."""
    timeout = reward_model_cfg.timeout_s
    return GuardedRewardManager(
        manager, on_error=reward_model_cfg.on_error, timeout_s=None if timeout is None else float(timeout)
    )


__all__ = ["GuardedRewardManager", "describe_manager", "guard_manager", "own_copies"]
