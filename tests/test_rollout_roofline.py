"""The native engine's memory roofline of decoding: the K/V tokens each decode step attends over,
counted as the windows are launched, and `decode_floor_s` / `decode_roofline_share` on a card whose
bandwidth is known (a CPU engine here, with a bandwidth set by hand)."""

from __future__ import annotations

import pytest
import torch

from fulcrum.device_facts import hbm_bandwidth
from fulcrum.rollout import SamplingParams
from fulcrum.rollout.native import EngineConfig, NativeEngine
from fulcrum.rollout.native.pipeline import decode_floor_s, window_kv_token_reads, with_roofline_share
from fulcrum.rollout.partial import PartialRollout
from fulcrum.rollout.testing import random_causal_lm

CPU = torch.device("cpu")
EOS = 1


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    return random_causal_lm("qwen2", init_std=0.2)


def engine_for(model: torch.nn.Module, **overrides) -> NativeEngine:
    config = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, decode_steps=4)
    return NativeEngine(model, [EOS], 0, EngineConfig(**{**config, **overrides}), CPU)


def test_a_window_reads_each_sequences_context_growing_by_one_a_step() -> None:
    assert window_kv_token_reads([5], 1) == 5  # the last token's K/V written, then all 5 read
    assert window_kv_token_reads([5, 10], 3) == (5 + 6 + 7) + (10 + 11 + 12)
    assert window_kv_token_reads([], 4) == 0


@pytest.mark.parametrize("decode_steps, overlap", [(1, False), (4, True)])
def test_one_sequence_reads_every_context_from_the_prompt_on(model, decode_steps, overlap) -> None:
    engine = engine_for(model, decode_steps=decode_steps, overlap_windows=overlap)
    prompt = list(range(3, 10))  # P = 7
    engine.generate([prompt], SamplingParams(n=1, temperature=0.0, max_tokens=10, ignore_eos=True))
    steps, reads = engine.stats["decode_steps"], engine.stats["kv_token_reads"]
    # the first token comes from the prefill; decode step d attends over P + d tokens
    assert steps >= 9 and reads == sum(7 + d for d in range(1, int(steps) + 1))


def test_the_floor_is_the_weights_and_the_k_v_read_at_the_cards_bandwidth(model) -> None:
    engine = engine_for(model)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True, seed=0)
    engine.generate([[3, 4, 5], [6, 7, 8, 9, 10]], params)
    assert "decode_floor_s" not in engine.stats  # the CPU: no bandwidth, no floor
    engine.bandwidth = 1e9
    engine.generate([[3, 4, 5], [6, 7, 8, 9, 10]], params)
    stats = engine.stats
    bytes_read = (
        stats["decode_steps"] * engine.weight_bytes + stats["kv_token_reads"] * engine.kv_bytes_per_token
    )
    assert stats["decode_floor_s"] == pytest.approx(bytes_read / 1e9)
    assert stats["decode_roofline_share"] == pytest.approx(stats["decode_floor_s"] / stats["decode_s"])
    # a K/V token: layers x (K and V) x KV heads x head dim x the dtype's bytes
    m = engine.model
    assert engine.kv_bytes_per_token == m.num_kv_layers * 2 * m.num_kv_heads * m.head_dim * 4  # float32 here


def test_partial_rollouts_report_the_same_floor_for_their_share_of_the_work(model) -> None:
    engine = engine_for(model)
    engine.bandwidth = 1e9
    partial = PartialRollout(engine)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[3, 4, 5], [6, 7, 8, 9], [10, 11]]
    partial.generate(prompts, [0, 1, 2], params, enough=1, version=0, max_tokens=[2, 24, 24])
    figures = partial.figures
    assert figures["kv_token_reads"] > 0 and figures["decode_floor_s"] > 0
    assert figures["decode_roofline_share"] == pytest.approx(figures["decode_floor_s"] / figures["decode_s"])


def test_no_share_without_a_floor_or_decode_time() -> None:
    assert with_roofline_share({"decode_s": 1.0}) == {"decode_s": 1.0}
    assert "decode_roofline_share" not in with_roofline_share({"decode_s": 0.0, "decode_floor_s": 1.0})
    assert with_roofline_share({"decode_s": 2.0, "decode_floor_s": 0.5})["decode_roofline_share"] == 0.25


def test_the_cards_bandwidth_comes_from_its_name() -> None:
    assert hbm_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert hbm_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert hbm_bandwidth("NVIDIA H200") == 4.8e12
    assert hbm_bandwidth("Some Other Card") is None


def test_the_floor_of_full_length_responses_counts_every_decode_step() -> None:
    # one response of 4 tokens after 10: the first from the prefill, then steps over 11, 12 and 13 tokens
    assert decode_floor_s(1, 10, 4, weight_bytes=100, kv_bytes=1, bandwidth=1) == 3 * 100 + 11 + 12 + 13
    assert decode_floor_s(2, 10, 4, weight_bytes=0, kv_bytes=2, bandwidth=4) == 2 * 36 * 2 / 4
