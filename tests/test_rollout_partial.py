"""Partial rollouts over the native engine (fulcrum.rollout.partial): stop once enough groups are
complete, hold the unfinished samples, continue them in a later call (KV kept or re-prefilled)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fulcrum.rollout import SamplingParams
from fulcrum.rollout.native import EngineConfig, NativeEngine
from fulcrum.rollout.partial import PartialRollout
from fulcrum.rollout.testing import random_causal_lm

CPU = torch.device("cpu")
EOS = 1
BUDGETS = [3, 48, 6, 40, 9, 33]  # per-prompt response budgets: a long tail
GREEDY = SamplingParams(n=2, temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    return random_causal_lm("qwen2", init_std=0.2)


def engine_for(model: torch.nn.Module, **overrides) -> NativeEngine:
    config = dict(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=128, decode_steps=4)
    return NativeEngine(model, [EOS], 0, EngineConfig(**{**config, **overrides}), CPU)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 200, (n,), generator=generator).tolist() for n in (5, 17, 9, 30, 2, 12)]


def one_shot(model: torch.nn.Module) -> list[list[list[int]]]:
    """Each prompt's greedy responses from one uninterrupted generate."""
    engine = engine_for(model)
    return [
        engine.generate([p], replace(GREEDY, max_tokens=b)).token_ids
        for p, b in zip(prompts(), BUDGETS, strict=True)
    ]


def first_call(engine: NativeEngine) -> tuple[PartialRollout, list]:
    partial = PartialRollout(engine)
    groups = partial.generate(prompts(), list(range(6)), GREEDY, enough=2, version=0, max_tokens=BUDGETS)
    assert len(groups) == 2 and all(g.complete for g in groups)
    assert {g.key for g in groups} <= {0, 2, 4}  # the short budgets end first
    assert any(s.token_ids and s.finish_reason is None for g in partial.carried for s in g.samples)
    return partial, groups


def test_a_continuation_equals_a_one_shot_generation_under_unchanged_weights(model):
    expected = one_shot(model)
    engine = engine_for(model)
    partial, groups = first_call(engine)
    assert engine.counters["held"] > 0
    groups += partial.generate([], [], GREEDY, enough=6, version=1)
    assert sorted(g.key for g in groups) == list(range(6)) and not partial.carried
    for group in groups:
        assert [s.token_ids for s in group.samples] == expected[group.key]
        assert all(len(s.versions) == len(s.token_ids) == len(s.logprobs) for s in group.samples)
    carried = [g for g in groups[2:] if g.versions == [0, 1]]
    assert carried, "some group was generated across both calls"
    assert engine.counters["held"] == 0


def test_each_call_reports_the_tokens_it_sampled_and_the_engine_work_it_took(model):
    engine = engine_for(model)
    partial, groups = first_call(engine)
    first = partial.figures
    in_flight = sum(len(s.token_ids) for g in partial.carried for s in g.samples)
    returned = sum(len(s.token_ids) for g in groups for s in g.samples)
    assert (
        first["generated_tokens"] == returned + in_flight
    )  # the carried samples' tokens count where sampled
    assert first["held"] == engine.counters["held"] > 0
    assert first["decode_steps"] > 0 and first["prefill_tokens"] >= sum(map(len, prompts()))
    groups += partial.generate([], [], GREEDY, enough=6, version=1)
    total = sum(len(s.token_ids) for g in groups for s in g.samples)
    assert first["generated_tokens"] + partial.figures["generated_tokens"] == total == 2 * sum(BUDGETS)
    assert partial.figures["held"] == 0


def test_carried_tokens_keep_the_log_probs_and_version_they_were_sampled_with(model):
    engine = engine_for(model)
    partial, _ = first_call(engine)
    before = {
        (g.key, j): (list(s.logprobs), len(s.token_ids))
        for g in partial.carried
        for j, s in enumerate(g.samples)
    }
    generator = torch.Generator().manual_seed(0)
    engine.update_weights(
        (name, t + 0.05 * torch.randn(t.shape, generator=generator)) for name, t in model.state_dict().items()
    )
    groups = partial.generate([], [], GREEDY, enough=6, version=1)
    for group in groups:
        for j, sample in enumerate(group.samples):
            old, count = before[(group.key, j)]
            assert sample.logprobs[:count] == old
            assert sample.versions == [0] * count + [1] * (len(sample.token_ids) - count)
            assert len(sample.token_ids) == BUDGETS[group.key]


@pytest.mark.parametrize("how", ["sleep", "memory-pressure"])
def test_a_held_sample_whose_kv_is_gone_is_re_prefilled_and_continues_the_same(model, how):
    expected = one_shot(model)
    engine = engine_for(model, num_kv_blocks=32 if how == "memory-pressure" else None)
    partial, groups = first_call(engine)
    carried_tokens = sum(len(s.token_ids) for g in partial.carried for s in g.samples)
    if how == "sleep":
        engine.sleep()
    else:  # another generation between the calls (validation) needs the held samples' blocks
        engine.generate(prompts(), replace(GREEDY, n=4))
        assert engine.counters["evictions"] > 0
    before = engine.counters
    groups += partial.generate([], [], GREEDY, enough=6, version=1)
    for group in groups:
        assert [s.token_ids for s in group.samples] == expected[group.key]
    if how == "sleep":
        # every carried sample's prompt and tokens are prefilled again
        assert engine.counters["prefill_tokens"] - before["prefill_tokens"] >= carried_tokens


def test_a_new_call_adds_its_prompts_after_the_carried_samples_and_returns_at_most_enough(model):
    engine = engine_for(model)
    partial, _ = first_call(engine)
    more = partial.generate(prompts()[:2], ["a", "b"], GREEDY, enough=3, version=1, max_tokens=[2, 2])
    assert len(more) == 3 and all(g.complete for g in more)
    started = [g for g in partial.carried if g.started]
    assert engine.counters["held"] == sum(len(g.held) for g in started) > 0
    partial.drop(list(partial.carried))
    assert engine.counters["held"] == 0 and not partial.carried


def test_groups_that_must_finish_are_generated_to_the_end_and_returned_first(model):
    engine = engine_for(model)
    partial, _ = first_call(engine)
    longest = next(g for g in partial.carried if g.key == 1)  # the 48-token budget
    new = partial.generate(prompts()[:2], ["a", "b"], GREEDY, enough=1, version=1, max_tokens=[2, 2])
    assert new[0] is not longest and not longest.complete
    groups = partial.generate([], [], GREEDY, enough=1, version=2, must_finish=[longest])
    assert groups == [longest] and longest.complete
