"""Reward managers by name (`reward_model.reward_manager`, verl's names) and the registry users extend.

A manager turns decoded responses into one score per response; the trainer puts each score on the
response's last token. Built in, each with the meaning of verl's class of the same name
(verl/workers/reward_manager/):

- naive: one call of the reward function per response.
- dapo:  naive, plus DAPO's soft overlong penalty (Yu et al. 2025): with L the response length,
         L_max = max_resp_len and a buffer of b tokens,
             penalty = min(-(L - (L_max - b)) / b * penalty_factor, 0)
         is added to the score: 0 up to L_max - b tokens, then falling linearly to -penalty_factor at L_max.
         Keys: `reward_model.overlong_buffer.{enable,len,penalty_factor,log}` (verl's DAPO recipe) or
         `+reward_model.reward_kwargs.overlong_buffer_cfg.*` (verl's example scripts); max_resp_len
         defaults to data.max_response_length.
- batch: the reward function is called once for the whole batch, with verl's keyword names:
         `fn(data_sources=, solution_strs=, ground_truths=, extra_infos=, **reward_kwargs) -> list`.
- prime: per-response calls in a pool of processes, each bounded by a timeout; a response whose call
         fails or times out scores 0 (verl's PRIME manager), counted in `reward/num_errors`.

A user's manager plugs in by name: in the file named by `custom_reward_function.path` (imported
before the manager is built), decorate a class with `@register_reward_manager("mine")` and set
`reward_model.reward_manager=mine`. The class is built as `cls(compute_score=fn, **reward_kwargs)` and
needs one method, `score(responses, ground_truths, data_sources, extra_infos, response_lengths)`,
returning a RewardResult (or a list of floats).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from fulcrum.algo.registry import registrar
from fulcrum.reward import RewardFn, default_compute_score, describe, load_custom_reward_fn
from fulcrum.reward.pool import ScoringPool, ScoringTimeout
from fulcrum.reward.scoring import RewardResult, error_text, sample_failed, to_score
from fulcrum.reward.sources import BuiltinScorer


class RewardManager(Protocol):
    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[str],
        data_sources: Sequence[str],
        extra_infos: Sequence[dict | None] | None = None,
        response_lengths: Sequence[int] | None = None,
    ) -> RewardResult | list[float]: ...


REWARD_MANAGERS: dict[str, Callable[..., RewardManager]] = {}
# Class decorator: `reward_model.reward_manager=<name>` builds the class (verl's `register`).
register_reward_manager = registrar(REWARD_MANAGERS, "reward manager")


@register_reward_manager("naive")
@dataclass
class NaiveRewardManager:
    """compute_score: verl's signature `fn(data_source, solution_str, ground_truth, extra_info) -> float | dict`.

    A dict result must hold "score"; its other keys are collected per sample in `RewardResult.extra`.
    With a `pool`, the samples whose built-in scorer may run long (sympy, Math-Verify, code: the
    scorer's `isolated(data_source)`) are scored in its processes under its per-sample time limit; a
    sample past the limit (or whose scorer raises ScoringTimeout) scores 0 and is counted in
    `RewardResult.num_timeouts`, whatever on_error says.
    """

    compute_score: RewardFn = default_compute_score
    on_error: Literal["raise", "zero"] = "raise"
    max_error_messages: int = 5
    pool: ScoringPool | None = None

    def __post_init__(self) -> None:
        if self.on_error not in ("raise", "zero"):
            raise ValueError(f"on_error must be 'raise' or 'zero', got {self.on_error!r}")

    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[str],
        data_sources: Sequence[str],
        extra_infos: Sequence[dict | None] | None = None,
        response_lengths: Sequence[int] | None = None,
    ) -> RewardResult:
        """Score sample i with compute_score(data_sources[i], responses[i], ground_truths[i], extra_infos[i]).

        `response_lengths` (tokens) is part of the managers' common signature; the naive manager ignores it.
        """
        num = len(responses)
        infos = list(extra_infos) if extra_infos is not None else [None] * num
        if not (len(ground_truths) == len(data_sources) == len(infos) == num):
            raise ValueError(
                f"reward batch: {num} responses but {len(ground_truths)} ground truths, "
                f"{len(data_sources)} data sources and {len(infos)} extra_infos"
            )
        result = RewardResult(scores=[0.0] * num)
        what = describe(self.compute_score)
        isolated = getattr(self.compute_score, "isolated", None)
        pooled = [i for i in range(num) if self.pool is not None and isolated and isolated(data_sources[i])]
        if pooled:
            self._score_in_pool(pooled, responses, ground_truths, data_sources, infos, result, what)
        for i in sorted(set(range(num)) - set(pooled)):
            try:
                value = self.compute_score(data_sources[i], responses[i], ground_truths[i], infos[i])
                result.scores[i] = to_score(value, i, result)
            except ScoringTimeout:
                result.num_timeouts += 1
            except (Exception, SystemExit) as err:
                sample_failed(result, i, data_sources[i], err, self.on_error, what, self.max_error_messages)
        return result

    def _score_in_pool(
        self,
        indices: list[int],
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        data_sources: Sequence[str],
        infos: list[Any],
        result: RewardResult,
        what: str,
    ) -> None:
        """Score samples `indices` in the pool: a timeout is 0 and counted, an error goes to on_error."""
        assert self.pool is not None
        calls = [(data_sources[i], responses[i], ground_truths[i], infos[i]) for i in indices]
        for i, outcome in zip(indices, self.pool.map(self.compute_score, calls), strict=True):
            if outcome.timed_out:
                result.num_timeouts += 1
            elif outcome.error is not None:
                err = RuntimeError(outcome.error)
                sample_failed(result, i, data_sources[i], err, self.on_error, what, self.max_error_messages)
            else:
                try:
                    result.scores[i] = to_score(outcome.value, i, result)
                except Exception as err:
                    sample_failed(
                        result, i, data_sources[i], err, self.on_error, what, self.max_error_messages
                    )


def overlong_penalty(
    response_length: int, max_resp_len: int, buffer_len: int, penalty_factor: float
) -> float:
    """DAPO's soft overlong penalty, <= 0: min(-(L - (L_max - b)) / b * penalty_factor, 0)."""
    expected = max_resp_len - buffer_len
    return min(-(response_length - expected) / buffer_len * penalty_factor, 0.0)


@dataclass
class OverlongBuffer:
    """reward_model.overlong_buffer: DAPO's soft penalty for responses in the last `len` tokens."""

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0
    log: bool = False


@register_reward_manager("dapo")
class DapoRewardManager(NaiveRewardManager):
    """naive + the overlong penalty; `RewardResult.extra` gets "acc" (the score before the penalty, for
    a plain-float reward function, as verl) and, with overlong_buffer.log, "overlong_reward" and "overlong"."""

    def __init__(
        self,
        compute_score: RewardFn = default_compute_score,
        on_error: str = "raise",
        overlong_buffer_cfg: OverlongBuffer | dict[str, Any] | None = None,
        max_resp_len: int | None = None,
        pool: ScoringPool | None = None,
        **_unused: Any,
    ) -> None:
        super().__init__(compute_score=compute_score, on_error=on_error, pool=pool)  # type: ignore[arg-type]
        buffer = overlong_buffer_cfg or OverlongBuffer()
        self.buffer = buffer if isinstance(buffer, OverlongBuffer) else OverlongBuffer(**dict(buffer))
        self.max_resp_len = max_resp_len
        if self.buffer.enable:
            if max_resp_len is None:
                raise ValueError(
                    "reward_model.overlong_buffer.enable needs max_resp_len (data.max_response_length)"
                )
            if not 0 < self.buffer.len <= max_resp_len:
                raise ValueError(
                    f"reward_model.overlong_buffer.len={self.buffer.len} must be in 1..max_resp_len ({max_resp_len})"
                )

    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[str],
        data_sources: Sequence[str],
        extra_infos: Sequence[dict | None] | None = None,
        response_lengths: Sequence[int] | None = None,
    ) -> RewardResult:
        result = super().score(responses, ground_truths, data_sources, extra_infos)
        if "score" not in result.extra and "acc" not in result.extra:
            result.extra["acc"] = list(result.scores)
        if not self.buffer.enable:
            return result
        if response_lengths is None:
            raise ValueError("the dapo reward manager's overlong penalty needs the response lengths")
        assert self.max_resp_len is not None
        penalties = [
            overlong_penalty(int(n), self.max_resp_len, self.buffer.len, self.buffer.penalty_factor)
            for n in response_lengths
        ]
        result.scores = [s + p for s, p in zip(result.scores, penalties, strict=True)]
        if self.buffer.log:
            result.extra["overlong_reward"] = penalties
            result.extra["overlong"] = [p < 0 for p in penalties]
        return result


@register_reward_manager("batch")
class BatchRewardManager:
    """One call for the whole batch: fn(data_sources=, solution_strs=, ground_truths=, extra_infos=, **kw)
    returns one float, or one dict with "score", per response. A response's bad score is handled by
    `on_error`; the call's own failure, and a list of the wrong length, by the guard around the manager
    (fulcrum.reward.guard), which names the function."""

    def __init__(self, compute_score: RewardFn, on_error: str = "raise", **reward_kwargs: Any) -> None:
        if compute_score is default_compute_score or isinstance(compute_score, BuiltinScorer):
            raise ValueError(
                "reward_model.reward_manager=batch calls a batched function: set custom_reward_function.path/name"
            )
        self.compute_score = compute_score
        self.on_error = on_error
        self.reward_kwargs = reward_kwargs

    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[str],
        data_sources: Sequence[str],
        extra_infos: Sequence[dict | None] | None = None,
        response_lengths: Sequence[int] | None = None,
    ) -> RewardResult:
        infos = list(extra_infos) if extra_infos is not None else [{} for _ in responses]
        values = list(
            self.compute_score(
                data_sources=list(data_sources),
                solution_strs=list(responses),
                ground_truths=list(ground_truths),
                extra_infos=infos,
                **self.reward_kwargs,
            )
        )
        result = RewardResult(scores=[0.0] * len(values))
        what = describe(self.compute_score)
        for i, value in enumerate(values):
            try:
                result.scores[i] = to_score(value, i, result)
            except Exception as err:
                source = data_sources[i] if i < len(data_sources) else "?"
                sample_failed(result, i, source, err, self.on_error, what)
        return result


def _call_score(fn: RewardFn, data_source: str, response: str, ground_truth: str, extra_info: Any) -> Any:
    try:
        return fn(data_source, response, ground_truth, extra_info)
    except SystemExit as err:  # would end the pool's worker: the call would then wait for its timeout
        raise RuntimeError(error_text(err)) from None


@register_reward_manager("prime")
class PrimeRewardManager:
    """Per-response calls in `num_processes` forked processes, each within `timeout` seconds; a call that
    fails or times out scores 0 (verl's PRIME manager); such responses are counted as errors."""

    def __init__(
        self,
        compute_score: RewardFn = default_compute_score,
        on_error: str = "zero",
        num_processes: int = 64,
        timeout: float = 300.0,
        **_unused: Any,
    ) -> None:
        self.compute_score = compute_score
        self.num_processes = max(1, min(int(num_processes), multiprocessing.cpu_count()))
        self.timeout = float(timeout)

    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[str],
        data_sources: Sequence[str],
        extra_infos: Sequence[dict | None] | None = None,
        response_lengths: Sequence[int] | None = None,
    ) -> RewardResult:
        infos = list(extra_infos) if extra_infos is not None else [None] * len(responses)
        result = RewardResult(scores=[0.0] * len(responses))
        # fork: the reward function (possibly from a user's file) needs no pickling by module name.
        pool = multiprocessing.get_context("fork").Pool(self.num_processes)
        try:
            pending = [
                pool.apply_async(_call_score, (self.compute_score, ds, r, gt, info))
                for ds, r, gt, info in zip(data_sources, responses, ground_truths, infos, strict=True)
            ]
            for i, job in enumerate(pending):
                try:
                    value = job.get(timeout=self.timeout)
                    if isinstance(value, (list, tuple)):  # verl takes the first element of a sequence
                        value = value[0]
                    result.scores[i] = to_score(value, i, result)
                except Exception as err:  # a timeout or the function's own error: 0, as verl
                    result.add_error(i, data_sources[i], err)
        finally:
            pool.terminate()  # also stops calls still running past their timeout
            pool.join()
        return result


def build_reward_manager(name: str, compute_score: RewardFn, **kwargs: Any) -> RewardManager:
    """The manager registered as `name`, built with the reward function and the manager's options."""
    if name not in REWARD_MANAGERS:
        raise ValueError(
            f"reward_model.reward_manager={name!r} is not registered; built in: {sorted(REWARD_MANAGERS)} "
            "(register your own with @fulcrum.reward.managers.register_reward_manager in custom_reward_function.path)"
        )
    cls = REWARD_MANAGERS[name]
    if cls is NaiveRewardManager:
        return NaiveRewardManager(
            compute_score=compute_score, on_error=kwargs.get("on_error", "raise"), pool=kwargs.get("pool")
        )
    return cls(compute_score=compute_score, **kwargs)


# reward_model.reward_kwargs that choose the built-in scorers' options rather than the manager's.
SCORER_KWARGS = ("math_verify", "method")


def builtin_options(reward_model_cfg: Any) -> dict[str, Any]:
    """The built-in scorers' options: `reward_model.compute_score_kwargs` (verl 0.9's
    `reward.compute_score_kwargs`: GSM8K's `method`, `math_verify`), the same names given in
    `reward_model.reward_kwargs`, and the SandboxFusion service when `reward_model.sandbox_fusion.url`
    is set (verl passes it to default_compute_score)."""
    rm = reward_model_cfg
    options = {k: v for k, v in dict(rm.reward_kwargs or {}).items() if k in SCORER_KWARGS}
    options.update(dict(rm.compute_score_kwargs or {}))
    if rm.sandbox_fusion.url:
        options.update(
            sandbox_fusion_url=rm.sandbox_fusion.url, memory_limit_mb=rm.sandbox_fusion.memory_limit_mb
        )
    return options


def reward_fn_from(custom_reward_cfg: Any, reward_model_cfg: Any = None) -> RewardFn:
    """`custom_reward_function.{path, name, reward_kwargs}` when a path is set (importing the file, which
    also registers any reward manager it defines), else the built-in scorers chosen by data_source with
    the configuration's options (`builtin_options`)."""
    crf = custom_reward_cfg
    if crf.path:
        return load_custom_reward_fn(crf.path, crf.name, dict(crf.reward_kwargs or {}) or None)
    return BuiltinScorer(builtin_options(reward_model_cfg) if reward_model_cfg is not None else {})


def scoring_pool(reward_model_cfg: Any) -> ScoringPool:
    """The scoring processes: `reward_model.num_workers` of them (null: the machine's cores, at most 8),
    each sample under `reward_model.sample_timeout_s`. Started on first use."""
    workers = reward_model_cfg.num_workers or min(8, multiprocessing.cpu_count())
    return ScoringPool(int(workers), float(reward_model_cfg.sample_timeout_s))


def manager_from_config(cfg: Any) -> RewardManager:
    """The manager `reward_model.reward_manager` names, over the configured reward function, with its
    options: dapo's overlong buffer (`reward_model.overlong_buffer`, or verl's example-script spelling
    `reward_model.reward_kwargs.overlong_buffer_cfg` / `max_resp_len`, max_resp_len defaulting to
    data.max_response_length); batch's keyword arguments (`reward_model.reward_kwargs`)."""
    rm = cfg.reward_model
    fn = reward_fn_from(cfg.custom_reward_function, rm)  # first: a user's file may register its manager
    kwargs: dict[str, Any] = {k: v for k, v in dict(rm.reward_kwargs or {}).items() if k not in SCORER_KWARGS}
    options: dict[str, Any] = {"on_error": rm.on_error}
    if rm.reward_manager in ("naive", "dapo") and isinstance(fn, BuiltinScorer):
        options["pool"] = scoring_pool(rm)
    if rm.reward_manager == "dapo":
        buffer = kwargs.pop("overlong_buffer_cfg", None)
        if buffer is None:
            ob = rm.overlong_buffer
            buffer = {"enable": ob.enable, "len": ob.len, "penalty_factor": ob.penalty_factor, "log": ob.log}
        options.update(
            overlong_buffer_cfg=dict(buffer),
            max_resp_len=int(kwargs.pop("max_resp_len", None) or cfg.data.max_response_length),
        )
    elif rm.reward_manager != "naive":
        options.update(kwargs)
    return build_reward_manager(rm.reward_manager, fn, **options)


__all__ = [
    "REWARD_MANAGERS",
    "NaiveRewardManager",
    "build_reward_manager",
    "manager_from_config",
    "register_reward_manager",
]
