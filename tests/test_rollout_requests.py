"""The native engine's request API on the CPU in fp32: turns continued over kept KV blocks equal a
fresh request over the whole prefix, the prefix is not prefilled again, many conversations of
different lengths share the steps, held blocks give way under memory pressure without changing a
token, and a seed repeats."""

from __future__ import annotations

import pytest
import torch

from fulcrum.rollout import SamplingParams
from fulcrum.rollout.base import SequenceOutput
from fulcrum.rollout.native import EngineConfig, NativeEngine
from fulcrum.rollout.native.block_manager import BlockManager
from fulcrum.rollout.native.memory import prefill_context_tokens
from fulcrum.rollout.native.scheduler import DecodeWork, Scheduler
from fulcrum.rollout.native.sequence import Sequence
from fulcrum.rollout.testing import random_causal_lm

CPU = torch.device("cpu")
EOS = 1
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    return random_causal_lm("qwen2", init_std=0.2)


def engine_for(model: torch.nn.Module, **overrides) -> NativeEngine:
    config = dict(max_num_seqs=16, max_num_batched_tokens=128, max_model_len=256, decode_steps=4)
    return NativeEngine(model, [EOS], 0, EngineConfig(**{**config, **overrides}), CPU)


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_to(engine: NativeEngine, seq_id: int) -> SequenceOutput:
    """Step until the turn of `seq_id` finishes (nothing else is in flight)."""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.seq_id == seq_id:
                return out
    raise AssertionError(f"sequence {seq_id} never finished")


@pytest.mark.parametrize(
    "params",
    [GREEDY, SamplingParams(temperature=0.7, top_k=1, max_tokens=6, ignore_eos=True, seed=0)],
    ids=["greedy", "tempered-top1"],
)
def test_a_second_turn_equals_a_fresh_request_over_the_whole_prefix(model, params):
    engine = engine_for(model)
    prompt, tool = ids(0, 21), ids(1, 5)
    first = run_to(
        engine, engine.add_request(prompt, SamplingParams(**{**vars(params), "max_tokens": 7}), keep=True)
    )
    assert first.held and first.loss_mask == [1] * 7 and first.turn_start == 0
    before = engine.counters["prefill_tokens"]
    engine.resume(first.seq_id, tool, params)
    second = run_to(engine, first.seq_id)
    # Only the tool's tokens and the last sampled token (whose K/V a turn never writes) were prefilled.
    assert engine.counters["prefill_tokens"] - before == len(tool) + 1
    assert second.token_ids[:12] == first.token_ids + tool
    assert second.loss_mask == [1] * 7 + [0] * 5 + [1] * 6
    assert second.logprobs[7:12] == [0.0] * 5 and second.logprobs[:7] == first.logprobs
    assert second.turn_start == 12 and second.last_turn == second.token_ids[12:]
    assert not second.held and engine.counters["blocks_in_use"] == 0

    prefix = prompt + second.token_ids[:12]
    before = engine.counters["prefill_tokens"]
    fresh = run_to(engine, engine.add_request(prefix, params))
    assert engine.counters["prefill_tokens"] - before == len(prefix)
    assert fresh.token_ids == second.last_turn
    torch.testing.assert_close(
        torch.tensor(second.logprobs[12:]), torch.tensor(fresh.logprobs), atol=1e-5, rtol=0
    )


def conversation_plan(index: int) -> list[list[int]]:
    """Conversation `index`: the tool answers appended after each of its turns but the last (0-3 of them)."""
    return [ids(100 * index + turn, 2 + (index + turn) % 5) for turn in range(index % 4)]


def run_conversations(
    engine: NativeEngine, count: int, params: SamplingParams, tool_steps: int = 0
) -> dict[int, SequenceOutput]:
    """`count` conversations added at once; a turn's tool answer comes `tool_steps` engine steps after
    the turn ended (the conversation stays held meanwhile). The final outputs, by seq id."""
    plans = {}
    for index in range(count):
        seq_id = engine.add_request(ids(7 + index, 3 + 11 * index % 40), params, keep=True)
        plans[seq_id] = conversation_plan(index)
    final: dict[int, SequenceOutput] = {}
    tools: list[tuple[int, int]] = []  # (step the answer comes at, seq id)
    clock = 0
    while engine.has_unfinished_requests() or tools:
        for ready, seq_id in [t for t in tools if t[0] <= clock]:
            tools.remove((ready, seq_id))
            engine.resume(seq_id, plans[seq_id].pop(0), params, keep=True)
        clock += 1
        for out in engine.step():
            if plans[out.seq_id]:
                tools.append((clock + tool_steps, out.seq_id))
            else:
                engine.release(out.seq_id)
                final[out.seq_id] = out
    return final


@pytest.mark.parametrize("overlap", [False, True], ids=["windows-in-turn", "overlap-windows"])
def test_interleaved_conversations_of_different_turn_counts_equal_each_one_run_alone(model, overlap):
    count = 7
    engine = engine_for(model, overlap_windows=overlap)
    together = run_conversations(engine, count, GREEDY)
    assert engine.counters["held"] == 0 and engine.counters["blocks_in_use"] == 0
    steps_together = engine.counters["prefill_steps"] + engine.counters["decode_steps"]
    steps_alone = 0
    for index, (_, out) in enumerate(sorted(together.items())):
        alone_engine = engine_for(model)
        plans = conversation_plan(index)
        mask = [1] * 6
        for answer in plans:
            mask += [0] * len(answer) + [1] * 6
        assert out.loss_mask == mask
        # The same conversation with an engine to itself.
        prompt = ids(7 + index, 3 + 11 * index % 40)
        turn = run_to(alone_engine, alone_engine.add_request(prompt, GREEDY, keep=True))
        for answer in plans:
            alone_engine.resume(turn.seq_id, answer, GREEDY, keep=True)
            turn = run_to(alone_engine, turn.seq_id)
        steps_alone += alone_engine.counters["prefill_steps"] + alone_engine.counters["decode_steps"]
        assert turn.token_ids == out.token_ids, f"conversation {index}"
        torch.testing.assert_close(torch.tensor(turn.logprobs), torch.tensor(out.logprobs), atol=1e-5, rtol=0)
    assert steps_together < steps_alone / 2  # turns of different conversations shared the steps


@pytest.mark.parametrize("overlap", [False, True], ids=["windows-in-turn", "overlap-windows"])
def test_held_blocks_give_way_under_memory_pressure_without_changing_a_token(model, overlap):
    roomy = run_conversations(engine_for(model, overlap_windows=False), 6, GREEDY)
    # 12 blocks of 8 tokens: six conversations of up to 70 tokens cannot all keep their blocks.
    tight = engine_for(model, num_kv_blocks=12, block_size=8, overlap_windows=overlap)
    squeezed = run_conversations(tight, 6, GREEDY, tool_steps=3)
    assert tight.counters["evictions"] > 0
    assert {k: v.token_ids for k, v in squeezed.items()} == {k: v.token_ids for k, v in roomy.items()}
    assert tight.counters["blocks_in_use"] == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["windows-in-turn", "overlap-windows"])
def test_an_evicted_or_slept_sequence_recomputes_its_prefix_and_continues_alike(model, overlap):
    engine = engine_for(model, overlap_windows=overlap)
    first = run_to(engine, engine.add_request(ids(3, 30), GREEDY, keep=True))
    engine.resume(first.seq_id, [5, 6], GREEDY, keep=True)
    expected = run_to(engine, first.seq_id)
    engine.release(first.seq_id)
    assert engine.counters["blocks_in_use"] == 0

    again = run_to(engine, engine.add_request(ids(3, 30), GREEDY, keep=True))
    engine.sleep()  # the cache goes: the held sequence keeps its tokens, not its K/V
    assert engine.counters["held"] == 1 and engine.counters["blocks_in_use"] == 0
    before = engine.counters["prefill_tokens"]
    engine.resume(again.seq_id, [5, 6], GREEDY)
    assert run_to(engine, again.seq_id).token_ids == expected.token_ids
    assert engine.counters["prefill_tokens"] - before == 30 + 6 + 2


def test_a_held_sequence_is_evicted_before_a_running_one_is_preempted():
    blocks = BlockManager(num_blocks=6, block_size=4)
    scheduler = Scheduler(EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, decode_steps=4), blocks)
    held = Sequence(token_ids=list(range(12)), num_prompt_tokens=8, output_index=0, max_tokens=4, keep=True)
    blocks.grow(held, 12)
    scheduler.held[0] = held
    # 8 tokens in the cache and a 9th sampled: its decode step writes into a third block.
    running = Sequence(token_ids=list(range(9)), num_prompt_tokens=8, output_index=1, max_tokens=8)
    blocks.grow(running, 8)
    running.num_computed = 8
    scheduler.running.append(running)
    assert blocks.num_free == 0  # 3 held + 2 running of 5 usable
    work = scheduler.schedule()
    assert isinstance(work, DecodeWork) and work.seqs == [running]
    assert scheduler.num_evictions == 1 and scheduler.num_preemptions == 0
    assert held.block_table == [] and held.num_computed == 0 and 0 in scheduler.held


def test_a_seed_gives_the_same_conversations_twice(model):
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=3)
    first = run_conversations(engine_for(model), 5, params)
    second = run_conversations(engine_for(model), 5, params)
    assert {k: (v.token_ids, v.finish_reason) for k, v in first.items()} == {
        k: (v.token_ids, v.finish_reason) for k, v in second.items()
    }
    assert len({tuple(v.token_ids) for v in first.values()}) == 5


def test_refusals_name_what_is_wrong(model):
    engine = engine_for(model, max_model_len=40)
    with pytest.raises(KeyError, match="not held"):
        engine.resume(123, [5], GREEDY)
    seq_id = engine.add_request(ids(0, 10), GREEDY, keep=True)
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request(ids(1, 10), SamplingParams(temperature=0.5, max_tokens=4))
    with pytest.raises(RuntimeError, match="in flight"):
        engine.generate([ids(2, 4)], GREEDY)
    with pytest.raises(RuntimeError, match="in flight"):
        engine.sleep()
    run_to(engine, seq_id)
    with pytest.raises(ValueError, match="max_model_len=40"):
        engine.resume(seq_id, ids(3, 20), GREEDY)
    engine.resume(seq_id, ids(3, 2), GREEDY)  # the refused turn left the sequence held
    assert len(run_to(engine, seq_id).token_ids) == 6 + 2 + 6


def test_an_interrupted_generate_leaves_nothing_in_flight(model, monkeypatch):
    engine = engine_for(model)
    prompts = [ids(0, 9), ids(1, 30)]
    expected = engine.generate(prompts, GREEDY)

    def broken(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(engine.launcher, "launch_decode", broken)
        with pytest.raises(KeyboardInterrupt):
            engine.generate(prompts, GREEDY)
    assert not engine.has_unfinished_requests() and engine.counters["blocks_in_use"] == 0
    assert engine.generate(prompts, GREEDY).token_ids == expected.token_ids


def test_a_prefill_step_reads_back_no_more_context_than_its_budget():
    blocks = BlockManager(num_blocks=32, block_size=4)
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, decode_steps=4)
    fresh = Sequence(token_ids=list(range(6)), num_prompt_tokens=6, output_index=0, max_tokens=4)
    turns = []
    for index in (1, 2):  # next turns: 16 tokens cached, 4 new
        turn = Sequence(token_ids=list(range(20)), num_prompt_tokens=20, output_index=index, max_tokens=4)
        blocks.grow(turn, 16)
        turn.num_computed = 16
        turns.append(turn)
    capped = Scheduler(config, blocks, context_budget=40)
    for seq in (fresh, *turns):
        capped.add(seq)
    # 6 + 20 keys; the second turn would make 46: it waits for the next step.
    assert capped.schedule().seqs == [fresh, turns[0]]
    assert list(capped.waiting) == [turns[1]]

    unbounded = Scheduler(config, BlockManager(num_blocks=32, block_size=4))
    for seq in (fresh, *turns):
        seq.block_table, seq.num_computed = [], 0
        unbounded.add(seq)
    assert unbounded.schedule().seqs == [fresh, *turns]  # nothing cached: no read-back, no bound


def test_conversations_under_a_small_context_budget_equal_the_unbounded_ones(model):
    reference = engine_for(model)
    unbounded = run_conversations(reference, 7, GREEDY)
    engine = engine_for(model)
    engine.scheduler.context_budget = 48  # a few continued turns a prefill step, where 7 would fit
    capped = run_conversations(engine, 7, GREEDY)
    assert engine.counters["prefill_steps"] > reference.counters["prefill_steps"]
    assert {k: v.token_ids for k, v in capped.items()} == {k: v.token_ids for k, v in unbounded.items()}
    for k, out in capped.items():
        torch.testing.assert_close(
            torch.tensor(out.logprobs), torch.tensor(unbounded[k].logprobs), atol=1e-5, rtol=0
        )


def test_the_read_back_budget_of_the_benchmarked_shapes(model):
    # Qwen3-0.6B (8 K/V heads of 128): 4 KiB a token a layer, 53,248 tokens (6 contexts of 8k) a step of
    # 8,192; Qwen2.5-0.5B (2 K/V heads of 64) reads 8x less a token: 581,632, which never binds.
    assert prefill_context_tokens(1024, 3072, 8, 128, 8192) == 53_248
    assert prefill_context_tokens(896, 4864, 2, 64, 8192) == 581_632
    assert prefill_context_tokens(64, 64, 64, 256, 100) == 100  # never under one step's new tokens
    engine = engine_for(model)
    m = engine.model
    assert engine.scheduler.context_budget == prefill_context_tokens(
        m.hidden, m.config.intermediate_size, m.num_kv_heads, m.head_dim, 128
    )
