"""Generation with one response budget per prompt (fulcrum.data.budgets) on any engine."""

from __future__ import annotations

import inspect
from dataclasses import replace

from fulcrum.rollout.base import RolloutEngine, RolloutOutput, SamplingParams


def takes_budgets(engine: RolloutEngine) -> bool:
    """Whether `engine.generate` takes a per-prompt `max_tokens` list (the native engine)."""
    return "max_tokens" in inspect.signature(engine.generate).parameters


def truncated(out: RolloutOutput, budgets: list[int]) -> RolloutOutput:
    """`out` with each sample cut to its prompt's budget; a cut sample's finish reason is "length"."""
    token_ids, logprobs, reasons = [], [], []
    for ids, lps, reason, p in zip(
        out.token_ids, out.logprobs, out.finish_reasons, out.prompt_index, strict=True
    ):
        budget = budgets[p]
        token_ids.append(ids[:budget])
        logprobs.append(lps[:budget])
        reasons.append("length" if len(ids) > budget else reason)
    return RolloutOutput(token_ids, logprobs, reasons, list(out.prompt_index))


def generate_budgeted(
    engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams, budgets: list[int] | None
) -> RolloutOutput:
    """`engine.generate(prompts, params)` with prompt i's responses limited to `budgets[i]` tokens. An
    engine that schedules requests (native) stops each at its own budget; another generates up to the
    largest budget and cuts each sample to its own (the same samples, more decode steps)."""
    if budgets is None or all(b == params.max_tokens for b in budgets):
        return engine.generate(prompts, params)
    if len(budgets) != len(prompts):
        raise ValueError(f"one budget per prompt: {len(budgets)} budgets for {len(prompts)} prompts")
    if takes_budgets(engine):
        return engine.generate(prompts, params, max_tokens=budgets)  # type: ignore[call-arg]
    return truncated(engine.generate(prompts, replace(params, max_tokens=max(budgets))), budgets)
