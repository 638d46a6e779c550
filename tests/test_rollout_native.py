"""The native engine against the `hf` backend and the training forward, on the CPU in fp32.

What a user relies on: the same greedy text as Hugging Face whatever the batch (prompt lengths
1-300, n > 1, stop ids, a cache so small that sequences get preempted, prompts chunked by a small
token budget), log-probs equal to the trainer's, weights that follow the actor after a sync.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import pytest
import torch

from fulcrum.config.schema_rollout import RolloutConfig
from fulcrum.rollout import HFRollout, SamplingParams, build_rollout
from fulcrum.rollout.native import EngineConfig, NativeEngine
from fulcrum.rollout.native.block_manager import BlockManager
from fulcrum.rollout.native.launcher import Launched, packed_positions, padded_tables
from fulcrum.rollout.native.scheduler import DecodeWork, PrefillWork, Scheduler
from fulcrum.rollout.native.sequence import Sequence
from fulcrum.rollout.testing import random_causal_lm

CPU = torch.device("cpu")
EOS = 1


def mixed_prompts(seed: int, lengths: list[int], vocab: int = 256) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


LENGTHS = [1, 300, 7, 64, 16, 150, 33, 2, 95, 17]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request) -> torch.nn.Module:
    torch.set_num_threads(1)
    return random_causal_lm(request.param, init_std=0.2)


def engine_for(model: torch.nn.Module, **overrides) -> NativeEngine:
    config = dict(max_num_seqs=16, max_num_batched_tokens=128, max_model_len=512, decode_steps=4)
    return NativeEngine(model, [EOS], 0, EngineConfig(**{**config, **overrides}), CPU)


@pytest.mark.parametrize("overlap", [False, True], ids=["windows-in-turn", "overlap-windows"])
def test_greedy_matches_hf_under_preemption_chunked_prefill_and_stop_ids(model, overlap):
    """With overlap_windows the next window is launched before this one is read (rows that stopped in
    it decode for nothing, sequences that stopped leave the next): the same tokens, stops and order."""
    prompts = mixed_prompts(0, LENGTHS)
    hf = HFRollout(model, [EOS], 0, CPU)
    free = hf.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    # A stop id that some responses hit and others do not.
    stop = Counter(t for r in free.token_ids for t in r[1:]).most_common(1)[0][0]
    params = SamplingParams(n=2, temperature=0, max_tokens=24, stop_token_ids=[stop])
    expected = hf.generate(prompts, params)
    assert "stop" in expected.finish_reasons and "length" in expected.finish_reasons
    # 24 blocks of 16 tokens cannot hold 20 sequences of up to 324 tokens: preemption is forced, once
    # prompts are admitted into whatever blocks are free (no headroom kept for the running ones).
    engine = engine_for(
        model, num_kv_blocks=24, max_num_batched_tokens=64, overlap_windows=overlap, headroom_tokens=0
    )
    out = engine.generate(prompts, params)
    assert not engine.has_unfinished_requests() and engine.counters["blocks_in_use"] == 0
    assert engine.stats["preemptions"] > 0
    assert engine.stats["prefill_steps"] >= sum(LENGTHS) // 64  # the 300-token prompt came in chunks
    assert out.token_ids == expected.token_ids
    assert out.finish_reasons == expected.finish_reasons
    assert out.prompt_index == expected.prompt_index
    for ours, theirs in zip(out.logprobs, expected.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-4, rtol=0)


def test_sampled_logprobs_match_the_training_forward(model):
    prompts = mixed_prompts(1, [5, 40, 120])
    engine = engine_for(model)
    out = engine.generate(
        prompts, SamplingParams(n=3, temperature=0.8, max_tokens=16, seed=3, ignore_eos=True)
    )
    assert len({tuple(r) for r in out.token_ids[:3]}) > 1, "3 samples of one prompt should differ"
    for response, logprobs, index in zip(out.token_ids, out.logprobs, out.prompt_index, strict=True):
        ids = torch.tensor([prompts[index] + response])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompts[index]) - 1 : -1] / 0.8
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)


def test_seeded_sampling_repeats_and_top_k_1_is_greedy(model):
    prompts = mixed_prompts(2, [3, 30])
    engine = engine_for(model)
    a = engine.generate(prompts, SamplingParams(n=2, max_tokens=8, seed=5, ignore_eos=True))
    b = engine.generate(prompts, SamplingParams(n=2, max_tokens=8, seed=5, ignore_eos=True))
    assert a.token_ids == b.token_ids
    greedy = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    top1 = engine.generate(prompts, SamplingParams(top_k=1, max_tokens=8, seed=1, ignore_eos=True))
    assert top1.token_ids == greedy.token_ids


def test_update_weights_in_place_and_sleep_wake_up(model):
    prompts = mixed_prompts(3, [4, 50])
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = engine_for(model)
    before = engine.generate(prompts, params)
    changed = random_causal_lm(model.config.model_type, seed=1, init_std=0.2)
    embed = engine.model.embed
    engine.sleep()
    assert engine.runner.kv_cache is None
    engine.update_weights(changed.named_parameters())
    assert engine.model.embed is embed  # copied into, not replaced
    after = engine.generate(prompts, params)  # wakes up by itself
    assert after.token_ids == HFRollout(changed, [EOS], 0, CPU).generate(prompts, params).token_ids
    assert after.token_ids != before.token_ids


def test_the_cache_stops_at_what_max_num_seqs_full_sequences_hold_and_gives_the_same_tokens(model):
    """Without num_kv_blocks the cache is cut to max_num_seqs sequences at full length (plus a chunked
    prompt and the scratch block): twice max_num_seqs sequences, three of them run to max_model_len, are
    generated without a preemption and give the tokens of an engine with ten times the cache."""
    config = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=64, decode_steps=4)
    engine = engine_for(model, **config)
    # 96 tokens + two windows' overrun of 4 = 104 slots, 7 blocks of 16: 5 x 7 + 1
    assert engine.runner.num_blocks == engine.config.usable_cache_blocks() == 36
    prompts = mixed_prompts(5, [64, 30, 1, 48, 64, 17, 5, 64])  # the 64-token ones end at max_model_len
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs, schedules = [], []
    for e in (engine, engine_for(model, num_kv_blocks=360, **config)):
        outs.append(e.generate(prompts, params).token_ids)
        assert e.stats["preemptions"] == 0
        schedules.append([e.stats[k] for k in ("prefill_steps", "prefill_tokens", "decode_steps")])
    assert outs[0] == outs[1]
    assert schedules[0] == schedules[1]  # the same steps: no window waited for blocks


@pytest.mark.parametrize("free_cache_engine", [True, False])
def test_generate_releases_the_cache_under_free_cache_engine(model, free_cache_engine):
    engine = engine_for(model, free_cache_engine=free_cache_engine)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for _ in range(2):  # asleep or awake before the call, generate leaves the same state
        started = time.perf_counter()
        out = engine.generate(mixed_prompts(4, [3, 9]), params)
        call_s = time.perf_counter() - started
        assert [len(r) for r in out.token_ids] == [4, 4]
        assert engine.awake is not free_cache_engine
        assert (engine.runner.kv_cache is None) is free_cache_engine
        # the allocation and release around the call are timed apart from the generation: three
        # disjoint parts of this call, none stale from the one before; no graph on the CPU
        metrics = engine.metrics()
        parts = [metrics[f"rollout/{part}_s"] for part in ("wake_up", "generate", "sleep")]
        assert all(0 < part for part in parts) and sum(parts) <= call_s, (parts, call_s)
        assert metrics["rollout/graph_capture_s"] == 0


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_sequences_past_max_position_embeddings_match_hf(arch):
    """max_model_len above the model's max_position_embeddings: the RoPE table grows (HF computes the
    rotary angles for any position), and greedy text still equals Hugging Face's."""
    short = random_causal_lm(arch, init_std=0.2, max_position_embeddings=32)
    engine = engine_for(short, max_model_len=64)
    assert all(table.shape[0] >= 64 + engine.config.decode_steps for table in engine.model.cos_sin.values())
    prompts = mixed_prompts(5, [28, 5])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)  # 48 > 32 positions
    expected = HFRollout(short, [EOS], 0, CPU).generate(prompts, params)
    assert engine.generate(prompts, params).token_ids == expected.token_ids


def test_update_weights_rejects_a_wrong_shape_naming_the_tensor(model):
    engine = engine_for(model)
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])


def test_prompt_longer_than_max_model_len_is_an_error_naming_the_key(model):
    engine = engine_for(model, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt 1 .*rollout\.max_model_len"):
        engine.generate([[5, 6], list(range(3, 63))], SamplingParams(max_tokens=8))


def test_a_prompt_the_kv_cache_cannot_hold_is_refused_naming_it_and_the_key(model):
    """A batch's prompt too large for the whole cache is refused before anything is sampled, naming its
    place in the batch and the key to raise; nothing of the batch stays queued."""
    engine = engine_for(model, num_kv_blocks=4)  # 3 usable blocks of 16 tokens
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(RuntimeError, match=r"prompt 1 refused: .*engine_kwargs\.native\.num_kv_blocks"):
        engine.generate([[5, 6], list(range(3, 63))], params)
    assert not engine.has_unfinished_requests() and engine.counters["blocks_in_use"] == 0
    assert [len(r) for r in engine.generate([[5, 6]], params).token_ids] == [4]


def test_n_samples_share_the_prompts_full_blocks():
    blocks = BlockManager(num_blocks=20, block_size=16)
    scheduler = Scheduler(EngineConfig(max_num_seqs=8, max_num_batched_tokens=256), blocks)
    scheduler.add(
        Sequence(token_ids=list(range(40)), num_prompt_tokens=40, output_index=0, max_tokens=5, num_samples=4)
    )
    work = scheduler.schedule()
    assert isinstance(work, PrefillWork) and work.lengths == [40] and work.completes == [True]
    assert blocks.num_free == 19 - 3  # 3 blocks hold the 40-token prompt
    copies = scheduler.commit_prefill(work)
    scheduler.postprocess(work, [[7, 8, 9, 10]], [[-1.0, -1.0, -1.0, -1.0]])
    # 2 full blocks shared by the 4 samples, 1 partial block each: 2 + 4 blocks, not 4 * 3.
    assert blocks.num_usable - blocks.num_free == 6
    assert len(copies) == 3
    first = scheduler.running[0].block_table
    assert all(s.block_table[:2] == first[:2] for s in scheduler.running)
    assert [blocks.ref_counts[b] for b in first] == [4, 4, 1]
    assert [s.token_ids[-1] for s in scheduler.running] == [7, 8, 9, 10]
    decode = scheduler.schedule()
    assert isinstance(decode, DecodeWork) and decode.steps == 4  # max_tokens 5, one already sampled


def test_packed_positions_index_each_token_by_its_sequence_and_position():
    """A prefill step's chunks: sequence i contributes lengths[i] tokens from position starts[i]."""
    starts, lengths = [0, 5, 17, 3], [3, 1, 4, 2]
    index, positions, offsets = packed_positions(starts, lengths, torch.device("cpu"))
    assert index.tolist() == [i for i, n in enumerate(lengths) for _ in range(n)]
    assert positions.tolist() == [p for s, n in zip(starts, lengths, strict=True) for p in range(s, s + n)]
    assert offsets == [0, 3, 4, 8, 10] and positions.dtype == index.dtype == torch.long


def test_padded_tables_put_each_table_in_its_row_and_zeros_elsewhere():
    """Rows beyond the tables (the CUDA graph's padding) and an empty table are all block 0."""
    tables = [[5, 9, 2], [], [7], [1, 2, 3, 4]]
    out = padded_tables(tables, rows=6, width=5)
    assert out.dtype == torch.int32 and out.shape == (6, 5)
    expected = [table + [0] * (5 - len(table)) for table in tables] + [[0] * 5] * 2
    assert out.tolist() == expected


def test_build_rollout_native_on_cpu_and_fallback_for_other_architectures(model, caplog):
    def rollout_cfg() -> RolloutConfig:
        return RolloutConfig(name="native", max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256)

    class Tok:
        eos_token_id = EOS
        pad_token_id = 0

    assert isinstance(build_rollout(rollout_cfg(), model, Tok(), CPU), NativeEngine)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with caplog.at_level(logging.WARNING):
        engine = build_rollout(rollout_cfg(), gpt2, Tok(), CPU)
    assert isinstance(engine, HFRollout)
    assert "model_type='gpt2'" in caplog.text and "hf backend" in caplog.text


def test_engine_config_reads_verl_keys_and_our_engine_kwargs():
    from fulcrum.config import load_config
    from fulcrum.rollout.native.config import engine_config_from

    cfg = load_config(
        [
            "actor_rollout_ref.rollout.max_num_seqs=64",
            "actor_rollout_ref.rollout.enforce_eager=true",
            "+actor_rollout_ref.rollout.engine_kwargs.native.block_size=32",
            "+actor_rollout_ref.rollout.engine_kwargs.native.decode_steps=4",
            "+actor_rollout_ref.rollout.engine_kwargs.native.overlap_windows=false",
        ]
    )
    rollout = cfg.actor_rollout_ref.rollout
    config = engine_config_from(rollout, model_max_len=4096)
    assert (config.max_num_seqs, config.block_size, config.decode_steps, config.enforce_eager) == (
        64,
        32,
        4,
        True,
    )
    assert config.max_model_len == rollout.prompt_length + rollout.response_length
    assert config.free_cache_engine is bool(rollout.free_cache_engine)
    assert config.overlap_windows is False  # on by default
    rollout.engine_kwargs["native"] = {"blocksize": 8}
    with pytest.raises(ValueError, match=r"engine_kwargs\.native: unknown keys \['blocksize'\]"):
        engine_config_from(rollout, model_max_len=4096)


def test_the_prefill_attention_key_is_read_and_a_wrong_value_named() -> None:
    """engine_kwargs.native.prefill_attention: flash by default, cudnn or fa4 when asked, anything else
    refused naming the key and the values it takes."""
    from fulcrum.config import load_config
    from fulcrum.rollout.native.config import engine_config_from

    key = "+actor_rollout_ref.rollout.engine_kwargs.native.prefill_attention"
    assert engine_config_from(load_config([]).actor_rollout_ref.rollout, 4096).prefill_attention == "flash"
    for kernel in ("cudnn", "fa4"):
        rollout = load_config([f"{key}={kernel}"]).actor_rollout_ref.rollout
        assert engine_config_from(rollout, 4096).prefill_attention == kernel
    with pytest.raises(
        ValueError, match=r"native\.prefill_attention: expected one of flash, cudnn, fa4, got 'fa3'"
    ):
        engine_config_from(load_config([f"{key}=fa3"]).actor_rollout_ref.rollout, 4096)


def test_the_decode_order_key_is_read_and_a_wrong_value_named() -> None:
    """engine_kwargs.native.decode_order: the batch's order by default, longest_first when asked, anything
    else refused naming the key and the values it takes."""
    from fulcrum.config import load_config
    from fulcrum.rollout.native.config import engine_config_from

    key = "+actor_rollout_ref.rollout.engine_kwargs.native.decode_order"
    assert engine_config_from(load_config([]).actor_rollout_ref.rollout, 4096).decode_order == "batch"
    rollout = load_config([f"{key}=longest_first"]).actor_rollout_ref.rollout
    assert engine_config_from(rollout, 4096).decode_order == "longest_first"
    with pytest.raises(
        ValueError, match=r"native\.decode_order: expected one of batch, longest_first, got 'shortest'"
    ):
        engine_config_from(load_config([f"{key}=shortest"]).actor_rollout_ref.rollout, 4096)


def test_fa4_prefill_says_why_it_cannot_run() -> None:
    """FlashAttention-4 needs CUDA, the fa4 extra and a Hopper or Blackwell card: each reason names what is
    missing (this machine has no flash-attn-4 installed, and the CPU is checked first)."""
    import importlib.util

    from fulcrum.models.packed_attention import fa4_unavailable_reason

    assert "runs on CUDA, not cpu" in fa4_unavailable_reason(torch.device("cpu"))
    if importlib.util.find_spec("flash_attn") is None:
        reason = fa4_unavailable_reason(torch.device("cuda"))
        assert reason is not None and "pip install 'fulcrum[fa4]'" in reason


def test_cudnn_prefill_on_the_cpu_generates_as_flash_does() -> None:
    """The CPU has neither cuDNN attention nor FlashAttention-4: the key leaves its SDPA prefill as it is,
    token for token."""
    model = random_causal_lm("qwen2", init_std=0.2)
    prompts = [[5, 9, 13, 2, 7], [3] * 40, [11, 4]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for kernel in ("flash", "cudnn", "fa4"):
        config = EngineConfig(max_num_seqs=4, max_model_len=64, num_kv_blocks=32, prefill_attention=kernel)
        outputs[kernel] = NativeEngine(model, [1], 0, config, CPU).generate(prompts, params)
    for kernel in ("cudnn", "fa4"):
        assert outputs[kernel].token_ids == outputs["flash"].token_ids
        assert outputs[kernel].logprobs == outputs["flash"].logprobs


def test_the_triton_kernels_key_picks_the_engine_kernels(monkeypatch: pytest.MonkeyPatch):
    """engine_kwargs.native.triton_kernels: null runs Triton on CUDA only (the CPU has torch ops), false
    never, true also on the CPU under Triton's interpreter, and is refused, naming the key, where
    Triton cannot run; a value that is not a boolean is refused."""
    from fulcrum.config import load_config
    from fulcrum.config.keys import ConfigError
    from fulcrum.rollout.native import model_runner
    from fulcrum.rollout.native.config import engine_config_from

    key = "+actor_rollout_ref.rollout.engine_kwargs.native.triton_kernels"
    read = {
        value: engine_config_from(
            load_config([f"{key}={value}"]).actor_rollout_ref.rollout, 4096
        ).triton_kernels
        for value in ("null", "true", "false")
    }
    assert read == {"null": None, "true": True, "false": False}
    with pytest.raises(ValueError, match=r"triton_kernels: expected true, false or null, got 'yes please'"):
        engine_config_from(load_config([f"{key}='yes please'"]).actor_rollout_ref.rollout, 4096)
    monkeypatch.setattr(model_runner, "HAVE_TRITON", True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda = torch.device("cuda")
    assert [model_runner.use_triton_on(cuda, wanted) for wanted in (None, True, False)] == [True, True, False]
    assert [model_runner.use_triton_on(CPU, wanted) for wanted in (None, False)] == [False, False]
    with pytest.raises(
        ConfigError, match=r"triton_kernels=true, but on the CPU Triton needs TRITON_INTERPRET=1"
    ):
        model_runner.use_triton_on(CPU, True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert [model_runner.use_triton_on(CPU, wanted) for wanted in (None, True)] == [False, True]
    monkeypatch.setattr(model_runner, "HAVE_TRITON", False)
    assert model_runner.use_triton_on(cuda, None) is False
    with pytest.raises(ConfigError, match="triton is not installed"):
        model_runner.use_triton_on(cuda, True)


def test_the_engine_defaults_are_the_documented_ones():
    """A run that sets none of the engine's keys, and a benchmark that builds EngineConfig directly, get
    the defaults `fulcrum doctor --keys` lists."""
    from fulcrum.config import describe, load_config
    from fulcrum.rollout.native.config import engine_config_from

    documented = {info.key: info.default for info in describe()}
    rollout = load_config().actor_rollout_ref.rollout
    run, direct = engine_config_from(rollout, model_max_len=4096), EngineConfig()
    keys = (
        "max_num_seqs",
        "max_num_batched_tokens",
        "gpu_memory_utilization",
        "enforce_eager",
        "free_cache_engine",
    )
    for key in keys:
        expected = documented[f"actor_rollout_ref.rollout.{key}"]
        assert getattr(run, key) == getattr(direct, key) == expected, key
    assert run.dtype == direct.dtype == torch.bfloat16


@pytest.mark.parametrize("overlap", [False, True], ids=["windows-in-turn", "overlap-windows"])
@pytest.mark.parametrize("trial", range(6))
def test_greedy_matches_hf_across_random_engine_shapes(trial, overlap):
    """Block sizes 1-32, 1-8 decode steps, caches down to the minimum, tiny token budgets and seat counts."""
    import random

    rng = random.Random(trial)
    model = random_causal_lm(("qwen2", "llama")[trial % 2], init_std=0.2)
    lengths = [rng.randint(1, 120) for _ in range(rng.randint(2, 6))]
    prompts = mixed_prompts(100 + trial, lengths)
    n, max_tokens = rng.randint(1, 4), rng.randint(1, 20)
    block_size = (1, 3, 16, 32)[trial % 4]
    longest = max(lengths) + max_tokens
    tightest = -(-longest // block_size) + n + 1  # the whole family of the longest prompt, plus scratch
    config = EngineConfig(
        max_num_seqs=rng.randint(n, 3 * n),
        max_num_batched_tokens=rng.choice([5, 17, 64]),
        max_model_len=longest + 1,
        block_size=block_size,
        num_kv_blocks=rng.choice([tightest, tightest + 5]),
        decode_steps=rng.randint(1, 8),
        overlap_windows=overlap,
    )
    params = SamplingParams(
        n=n, temperature=0, max_tokens=max_tokens, stop_token_ids=[rng.randint(3, 255) for _ in range(20)]
    )
    out = NativeEngine(model, [EOS], 0, config, CPU).generate(prompts, params)
    expected = HFRollout(model, [EOS], 0, CPU).generate(prompts, params)
    assert out.token_ids == expected.token_ids, config
    assert out.finish_reasons == expected.finish_reasons


def test_overlapped_windows_are_launched_ahead_and_give_the_same_tokens(model, monkeypatch):
    """Most windows of a batch whose responses stop at different lengths are launched before the one
    before them is read, and greedy tokens, log-probs and finish reasons equal windows in turn; sampled
    runs repeat for a seed."""
    prompts = mixed_prompts(3, LENGTHS)
    free = HFRollout(model, [EOS], 0, CPU).generate(prompts, SamplingParams(temperature=0, max_tokens=30))
    stop = Counter(t for r in free.token_ids for t in r[2:]).most_common(2)[1][0]
    greedy = SamplingParams(n=2, temperature=0, max_tokens=30, stop_token_ids=[stop])
    expected = engine_for(model, overlap_windows=False).generate(prompts, greedy)  # windows in turn
    assert "stop" in expected.finish_reasons and "length" in expected.finish_reasons
    engine = engine_for(model, overlap_windows=True)
    ahead: list[int] = []
    launch = engine.launcher.launch_decode

    def counted(work, sampler, slot):
        ahead.append(work.rows is not None)
        return launch(work, sampler, slot)

    monkeypatch.setattr(engine.launcher, "launch_decode", counted)
    out = engine.generate(prompts, greedy)
    assert sum(ahead) >= len(ahead) // 2 and engine.stats["decode_steps"] > 0
    assert out.token_ids == expected.token_ids and out.finish_reasons == expected.finish_reasons
    for ours, theirs in zip(out.logprobs, expected.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-5, rtol=0)
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=30, stop_token_ids=[stop], seed=7)
    assert engine.generate(prompts, sampled).token_ids == engine.generate(prompts, sampled).token_ids
    assert not engine.has_unfinished_requests() and engine.counters["blocks_in_use"] == 0


def test_prefill_steps_are_launched_ahead_and_sample_the_same_tokens(model, monkeypatch):
    """With overlap_windows, while prompts wait that fit, the next prefill step is launched before the
    first tokens of the one before it are read; prompts in chunks, forks of n samples and seeded
    sampling give the tokens and log-probs of steps read in turn (no response ends on its first token
    here, so the steps hold the same sequences)."""
    prompts = mixed_prompts(4, LENGTHS)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, ignore_eos=True, seed=5)
    small_steps = dict(max_num_batched_tokens=48, max_num_seqs=64)
    expected = engine_for(model, overlap_windows=False, **small_steps).generate(prompts, params)
    engine = engine_for(model, overlap_windows=True, **small_steps)
    launches: list[int] = []
    reads: list[int] = []  # per read prefill step: how many steps had been launched by then
    launch, read = engine.launcher.launch_prefill, Launched.read

    def counted_launch(work, sampler):
        launches.append(1)
        return launch(work, sampler)

    def counted_read(launched):
        if isinstance(launched.work, PrefillWork):
            reads.append(len(launches))
        return read(launched)

    monkeypatch.setattr(engine.launcher, "launch_prefill", counted_launch)
    monkeypatch.setattr(Launched, "read", counted_read)
    out = engine.generate(prompts, params)
    steps = engine.stats["prefill_steps"]
    assert steps >= sum(LENGTHS) // 48 and len(launches) == steps == len(reads)
    ahead = sum(launched > i + 1 for i, launched in enumerate(reads))  # step i read after step i + 1 left
    assert ahead >= steps - 2, reads
    assert out.token_ids == expected.token_ids
    for ours, theirs in zip(out.logprobs, expected.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-5, rtol=0)
    assert not engine.has_unfinished_requests() and engine.counters["blocks_in_use"] == 0


def test_every_decode_steps_output_row_starts_16_byte_aligned(model):
    """The sampler writes each step's tokens and log-probs into a row of the window's outputs; Triton
    compiles a kernel variant per pointer alignment, so every row must start aligned whatever
    max_num_seqs (7 here: rows of 7 int64 would put every other one off by 8 bytes)."""
    engine = engine_for(model, max_num_seqs=7, decode_steps=4)
    for buffer in (engine.launcher.out_tokens, engine.launcher.out_logprobs):
        assert len(buffer) == engine.config.windows_in_flight == 2
        assert all(buffer[s, k].data_ptr() % 16 == 0 for s in range(2) for k in range(4))


@pytest.mark.parametrize(
    ("headroom", "first_max_tokens", "admitted"),
    [(64, 1000, False), (0, 1000, True), (64, 2, True)],
)
def test_a_prompt_is_admitted_only_where_the_running_sequences_keep_their_headroom(
    headroom: int, first_max_tokens: int, admitted: bool
) -> None:
    """A running sequence of 17 tokens keeps room for its next `headroom_tokens` (64: 81 tokens, 6 blocks
    of 16, 5 more than it holds) or for the rest of its max_tokens where that is less; a second prompt
    (1 block) waits while the 5 free blocks cannot hold both, and the running one decodes meanwhile."""
    blocks = BlockManager(num_blocks=7, block_size=16)  # 6 usable
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, headroom_tokens=headroom)
    scheduler = Scheduler(config, blocks)
    first = Sequence(
        token_ids=list(range(16)), num_prompt_tokens=16, output_index=0, max_tokens=first_max_tokens
    )
    scheduler.add(first)
    work = scheduler.schedule()
    scheduler.commit_prefill(work)
    scheduler.postprocess(work, [[7]], [[-1.0]])
    assert scheduler.running == [first] and blocks.num_free == 5
    scheduler.add(Sequence(token_ids=list(range(16)), num_prompt_tokens=16, output_index=1, max_tokens=8))
    work = scheduler.schedule()
    assert isinstance(work, PrefillWork if admitted else DecodeWork)
    if not admitted:
        assert work.seqs == [first] and len(scheduler.waiting) == 1


@pytest.mark.parametrize(("headroom", "admitted"), [(64, 1), (0, 2)])
def test_the_headroom_counts_the_prompts_admitted_in_the_same_step(headroom: int, admitted: int) -> None:
    """Nothing runs yet: a first prompt of 16 tokens takes 1 of the 6 free blocks and, once admitted, runs
    beside whatever comes after it, so it keeps room for its next 64 tokens (4 more blocks); a second of
    32 tokens (2 blocks) then waits for a later step, where without the headroom both start at once."""
    blocks = BlockManager(num_blocks=7, block_size=16)  # 6 usable
    scheduler = Scheduler(
        EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, headroom_tokens=headroom), blocks
    )
    for index, length in enumerate((16, 32)):
        scheduler.add(
            Sequence(
                token_ids=list(range(length)), num_prompt_tokens=length, output_index=index, max_tokens=1000
            )
        )
    work = scheduler.schedule()
    assert isinstance(work, PrefillWork) and work.lengths == [16, 32][:admitted]
    assert len(scheduler.waiting) == 2 - admitted


def test_a_turn_over_its_cached_prefix_does_not_wait_for_the_headroom() -> None:
    """The headroom holds back only sequences with nothing cached: a next turn whose 16 tokens' K/V are
    kept (1 block held, 1 token to prefill) runs beside a sequence whose 64 tokens of headroom the free
    blocks do not cover, where a fresh prompt of the same length waits."""
    blocks = BlockManager(num_blocks=7, block_size=16)  # 6 usable
    scheduler = Scheduler(
        EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, headroom_tokens=64), blocks
    )
    first = Sequence(token_ids=list(range(16)), num_prompt_tokens=16, output_index=0, max_tokens=1000)
    scheduler.add(first)
    work = scheduler.schedule()
    scheduler.commit_prefill(work)
    scheduler.postprocess(work, [[7]], [[-1.0]])
    turn = Sequence(token_ids=list(range(17)), num_prompt_tokens=17, output_index=1, max_tokens=8)
    blocks.grow(turn, 16)
    turn.num_computed = 16
    scheduler.add(turn)
    assert blocks.num_free == 4  # the 5 blocks of the first one's headroom are not there
    work = scheduler.schedule()
    assert isinstance(work, PrefillWork) and work.seqs == [turn] and work.lengths == [1]
