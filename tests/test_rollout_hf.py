"""The `hf` rollout backend and the shared sampler: what the trainer relies on when it generates."""

from __future__ import annotations

import pytest
import torch

from fulcrum.config.schema_rollout import RolloutConfig
from fulcrum.rollout import HFRollout, SamplingParams, build_rollout, logprob_diff
from fulcrum.rollout.sampling import filter_top_k_top_p, sample_next
from fulcrum.rollout.testing import random_causal_lm

CPU = torch.device("cpu")
EOS = 1


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    return random_causal_lm("qwen2", init_std=0.2)


def teacher_forced_logprobs(
    model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float
):
    """log softmax(logits / T) of each response token from one plain forward over prompt + response."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    scaled = logits / (temperature if temperature > 0 else 1.0)
    return scaled.log_softmax(-1).gather(-1, torch.tensor(response).view(-1, 1)).squeeze(-1)


def greedy_reference(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation by re-running the whole sequence each step (no cache, no padding)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


PROMPTS = [[5, 6, 7], [9] * 20, [3], list(range(10, 50))]


def test_greedy_matches_uncached_forward_despite_left_padding(model):
    engine = HFRollout(model, [EOS], 0, CPU)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, response in zip(PROMPTS, out.token_ids, strict=True):
        assert response == greedy_reference(model, prompt, 8)


def test_n_samples_are_prompt_major_and_logprobs_match_the_training_forward(model):
    engine = HFRollout(model, [EOS], 0, CPU)
    params = SamplingParams(n=3, temperature=0.7, max_tokens=12, seed=1, ignore_eos=True)
    out = engine.generate(PROMPTS, params)
    assert out.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert len({tuple(r) for r in out.token_ids[:3]}) > 1, "3 samples of one prompt should differ"
    for i, (response, logprobs) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        expected = teacher_forced_logprobs(model, PROMPTS[out.prompt_index[i]], response, 0.7)
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)


def test_stops_at_stop_id_including_it(model):
    engine = HFRollout(model, [EOS], 0, CPU)
    free = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    stop_token = free.token_ids[0][3]
    first = free.token_ids[0].index(stop_token)
    out = engine.generate(
        [[5, 6, 7], [3]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_token])
    )
    assert out.token_ids[0] == free.token_ids[0][: first + 1]
    assert out.finish_reasons[0] == "stop"
    assert len(out.logprobs[0]) == len(out.token_ids[0])
    if stop_token not in out.token_ids[1]:
        assert out.finish_reasons[1] == "length" and len(out.token_ids[1]) == 8


def test_eos_ends_a_response_unless_ignored(model):
    free = HFRollout(model, [EOS], 0, CPU).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6))
    eos = free.token_ids[0][2]  # make the third greedy token the "EOS" of a second engine
    out = HFRollout(model, [eos], 0, CPU).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6))
    assert out.token_ids[0][-1] == eos and out.finish_reasons == ["stop"]
    ignored = HFRollout(model, [eos], 0, CPU).generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    assert len(ignored.token_ids[0]) == 6 and ignored.finish_reasons == ["length"]


def test_chunking_by_max_num_seqs_changes_nothing_for_greedy(model):
    params = SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True)
    whole = HFRollout(model, [EOS], 0, CPU, max_num_seqs=64).generate(PROMPTS, params)
    chunked = HFRollout(model, [EOS], 0, CPU, max_num_seqs=3).generate(PROMPTS, params)
    assert whole.token_ids == chunked.token_ids


def test_same_seed_same_samples_other_seed_other_samples(model):
    engine = HFRollout(model, [EOS], 0, CPU)
    a = engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=10, seed=7, ignore_eos=True))
    b = engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=10, seed=7, ignore_eos=True))
    c = engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=10, seed=8, ignore_eos=True))
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_generate_restores_training_mode(model):
    model.train()
    HFRollout(model, [EOS], 0, CPU).generate([[4, 5]], SamplingParams(temperature=0, max_tokens=2))
    assert model.training
    model.eval()


def test_sampler_frequencies_follow_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    generator = torch.Generator().manual_seed(0)
    tokens, logprobs = sample_next(logits, 0.5, generator=generator)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    expected = (logits[0] / 0.5).softmax(-1)
    torch.testing.assert_close(freq, expected, atol=0.01, rtol=0)
    torch.testing.assert_close(logprobs, expected.log()[tokens])


def test_top_k_and_top_p_keep_only_the_nucleus():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])  # probs ~ [0.03, 0.64, 0.24, 0.09]
    assert torch.isinf(filter_top_k_top_p(logits, 2, 1.0)).tolist() == [[True, False, False, True]]
    assert torch.isinf(filter_top_k_top_p(logits, -1, 0.8)).tolist() == [[True, False, False, True]]
    assert torch.isinf(filter_top_k_top_p(logits, -1, 0.5)).tolist() == [[True, False, True, True]]
    tokens, _ = sample_next(logits.repeat(500, 1), 1.0, top_p=0.5, generator=torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {1}


def test_logprob_diff_counts_only_masked_tokens():
    rollout = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]])
    actor = torch.tensor([[-1.1, -2.0, 0.0], [-0.5, -0.8, -0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    diff = logprob_diff(rollout, actor, mask)
    assert diff["rollout/logprob_diff_max"] == pytest.approx(0.3)
    assert diff["rollout/logprob_diff_mean"] == pytest.approx(0.4 / 5)


class _Tok:
    eos_token_id = EOS
    pad_token_id = 0


def _cfg() -> RolloutConfig:
    return RolloutConfig(name="hf", max_num_seqs=4)


def test_build_rollout_hf_wraps_the_actor_module_itself(model):
    engine = build_rollout(_cfg(), model, _Tok(), CPU)
    assert isinstance(engine, HFRollout) and engine.model is model and engine.max_num_seqs == 4


def test_build_rollout_rejects_unknown_backend_naming_the_key(model):
    cfg = _cfg()
    cfg.name = "tgi"
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.name"):
        build_rollout(cfg, model, _Tok(), CPU)


def test_decoding_writes_into_a_preallocated_cache(model):
    """The backend's cache (preallocated_cache) is really used with this transformers version, fills one
    position per decoded token, and gives the logits of transformers' own growing cache."""
    import inspect

    from fulcrum.rollout.hf import PreallocatedLayer, cache_of, preallocated_cache

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = preallocated_cache(model, capacity=8)
    assert cache is not None and all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
    ids, step = torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[4]])
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{name: cache})
        ours = model(input_ids=step, use_cache=True, **{name: cache})
        theirs = model(input_ids=ids, use_cache=True)
        theirs = model(input_ids=step, use_cache=True, **{name: cache_of(theirs)})
    assert [layer.filled for layer in cache.layers] == [6] * len(cache.layers)
    assert cache.get_seq_length() == 6
    torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="is full"), torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **{name: cache})
