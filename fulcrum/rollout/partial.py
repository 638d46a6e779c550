"""Partial rollouts: generate for more prompt groups than a step needs, stop once enough groups are
complete, and carry the unfinished samples over to a later call, continued under newer weights.

    partial = PartialRollout(engine)
    groups = partial.generate(prompts, keys, params, enough=8, version=step)   # >= 8 complete groups
    ... train on `groups`, engine.update_weights(...) ...
    groups = partial.generate(more_prompts, more_keys, params, enough=8, version=step + 1)

A group is the `params.n` samples of one prompt; it is complete when every sample has ended (a stop
id or its `max_tokens`). When `enough` groups are complete the engine's turns in flight are suspended
(`NativeEngine.suspend`): a sample with tokens is held with its tokens and per-token rollout log-probs,
its K/V kept while memory allows (else its continuation prefills its tokens again, under the weights of
that call); a prompt not prefilled yet is queued again. The next call continues the held samples with
the rest of their `max_tokens` before it adds its own prompts. Every response token is tagged with
the policy version (`version`) of the call that sampled it, so the trainer can bound and correct the
staleness of the older part; the old tokens keep the log-probs they were sampled with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from fulcrum.rollout.base import FinishReason, RequestEngine, SamplingParams, SequenceOutput
from fulcrum.rollout.native.pipeline import figures_between


class SuspendableEngine(RequestEngine, Protocol):
    """A request engine that can stop its turns in flight and hold them (`NativeEngine`)."""

    def suspend(self) -> tuple[list[SequenceOutput], list[SequenceOutput], list[int]]: ...

    def seed_requests(self, params: SamplingParams) -> None: ...

    @property
    def counters(self) -> dict[str, float]: ...


@dataclass
class Sample:
    """One response so far: its tokens, their rollout log-probs and the policy version of each."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None  # None while it is unfinished

    def take(self, out: SequenceOutput, version: int) -> None:
        """The engine's turn `out` (the whole response so far): the new tokens are tagged `version`."""
        self.versions += [version] * (len(out.token_ids) - len(self.token_ids))
        self.token_ids = list(out.token_ids)
        self.logprobs = list(out.logprobs)
        self.finish_reason = None if out.finish_reason == "abort" else out.finish_reason


@dataclass
class Group:
    """The samples of one prompt. `key`: the caller's handle of the prompt (its data row);
    `max_tokens`: the response budget of each sample; `held`: engine seq id -> sample index of the
    samples suspended mid-response; `started`: whether the prompt's request has been prefilled."""

    key: Any
    prompt: list[int]
    max_tokens: int
    samples: list[Sample]
    held: dict[int, int] = field(default_factory=dict)
    started: bool = False

    @property
    def complete(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    @property
    def versions(self) -> list[int]:
        """Every policy version that sampled a token of the group (sorted, distinct)."""
        return sorted({v for s in self.samples for v in s.versions})


class PartialRollout:
    """Groups across calls over one engine (see the module docstring); `carried`: the groups handed
    to no caller yet (unfinished, or complete beyond a call's `enough`); `figures`: the last call's
    engine work (the engine's counters over the call, under the names a whole generate reports them:
    `generated_tokens` counts the tokens sampled in the call for groups returned or carried), its
    `generate_s`, and `held`, the samples held at its end."""

    def __init__(self, engine: SuspendableEngine) -> None:
        self.engine = engine
        self.carried: list[Group] = []
        self.figures: dict[str, float] = {}

    def generate(
        self,
        prompts: list[list[int]],
        keys: list[Any],
        params: SamplingParams,
        enough: int,
        version: int,
        max_tokens: list[int] | None = None,
        must_finish: list[Group] | None = None,
    ) -> list[Group]:
        """At most `enough` complete groups (`must_finish` first, in its order, then carried ones, then in the order
        they completed), fewer only when every group is complete; the rest is carried. `max_tokens`: one
        response budget per prompt (default `params.max_tokens`); `must_finish`: carried groups to
        generate to the end before suspending."""
        if len(keys) != len(prompts) or (max_tokens is not None and len(max_tokens) != len(prompts)):
            raise ValueError("partial rollout: one key (and one max_tokens, if given) per prompt")
        start, before = time.perf_counter(), self.engine.counters
        budgets = max_tokens or [params.max_tokens] * len(prompts)
        new = [
            Group(key, list(prompt), budget, [Sample() for _ in range(params.n)])
            for key, prompt, budget in zip(keys, prompts, budgets, strict=True)
        ]
        groups, self.carried = [*self.carried, *new], []
        ready = [g for g in groups if g.complete]
        owner: dict[int, tuple[Group, int]] = {}
        if not self.engine.has_unfinished_requests():
            self.engine.seed_requests(params)
        for group in groups:
            if group.complete:
                continue
            if not group.started:
                first = self.engine.add_request(group.prompt, replace(params, max_tokens=group.max_tokens))
                owner.update({first + j: (group, j) for j in range(params.n)})
                group.started = True
                continue
            for seq_id, index in group.held.items():
                left = group.max_tokens - len(group.samples[index].token_ids)
                self.engine.resume(seq_id, [], replace(params, n=1, max_tokens=left))
                owner[seq_id] = (group, index)
            group.held = {}
        must = must_finish or []
        while (
            len(ready) < enough or not all(g.complete for g in must)
        ) and self.engine.has_unfinished_requests():
            ready += self._take(self.engine.step(), owner, version)
        rank = {id(g): i for i, g in enumerate(must)}
        ready.sort(key=lambda g: rank.get(id(g), len(must)))  # stable: the rest keep their order
        if self.engine.has_unfinished_requests():
            finished, held, dropped = self.engine.suspend()
            ready += self._take(finished, owner, version)
            for out in held:
                group, index = owner[out.seq_id]
                group.samples[index].take(out, version)
                group.held[out.seq_id] = index
            for request_id in dropped:
                owner[request_id][0].started = False
        done = {id(g) for g in ready[:enough]}
        self.carried = [g for g in groups if id(g) not in done]
        after = self.engine.counters
        self.figures = {
            **figures_between(before, after),
            "generate_s": time.perf_counter() - start,
            "held": float(after["held"]),
        }
        return ready[:enough]

    @staticmethod
    def _take(outs: list[SequenceOutput], owner: dict[int, tuple[Group, int]], version: int) -> list[Group]:
        """Finished turns into their samples; the groups they complete."""
        completed = []
        for out in outs:
            group, index = owner.pop(out.seq_id)
            group.samples[index].take(out, version)
            if group.complete:
                completed.append(group)
        return completed

    def drop(self, groups: list[Group]) -> None:
        """Forget carried `groups`, releasing their held samples."""
        gone = {id(g) for g in groups}
        for group in groups:
            for seq_id in group.held:
                self.engine.release(seq_id)
            group.held = {}
        self.carried = [g for g in self.carried if id(g) not in gone]
