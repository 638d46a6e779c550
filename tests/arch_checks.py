"""What every architecture of the native engine is checked for (the per-family test files call these).

On the CPU in fp32, on a small random config of the family: the native engine's greedy tokens equal
transformers' `generate` for 64 tokens; the training path's log-probs (padded and packed) are within
1e-5 of Hugging Face's own forward of each sequence alone; two tensor-parallel ranks (gloo) load their
shards and sample what one rank samples; one GRPO step (`check_grpo_step`) samples with the native
engine and updates the actor on the packed path. On a GPU (`@pytest.mark.gpu`): the engine in bf16, with its
Triton kernels and CUDA graphs, is within 0.02 (mean |log-prob gap|) of HF's bf16 forward and as
close to the float32 forward as HF's bf16 forward is (`bf16_gaps`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import log_probs_of
from test_workers_units import make_batch, unpadded_log_probs  # tests/ is on sys.path under pytest
from test_workers_update import cfg_for

from fulcrum.algo.advantages import grpo_advantage
from fulcrum.config.schema_rollout import RolloutConfig
from fulcrum.config.sections import actor_section
from fulcrum.models.arch import SPECS, model_shape
from fulcrum.models.arch.spec import matmul_param_count, param_count
from fulcrum.models.load import load_causal_lm
from fulcrum.models.packed import enable_packed_attention
from fulcrum.models.router_loss import load_balancing_loss, recorded_router_logits, router_loss_settings
from fulcrum.rollout import build_rollout
from fulcrum.rollout.base import SamplingParams
from fulcrum.rollout.native import EngineConfig, NativeEngine, native_unsupported_reason
from fulcrum.rollout.testing import TINY_SHAPE, random_causal_lm, scoring_batch
from fulcrum.tools.memory_estimate import read_model_shape
from fulcrum.workers.actor import ActorWorker
from fulcrum.workers.forwards import LogProbHead, ModelForwards, micro_inputs

CPU = torch.device("cpu")
EOS = 1
VOCAB = 1024  # make_batch draws token ids below 1000
GREEDY_TOKENS = 64
TOL = 1e-5
# Gated DeltaNet sizes of the hybrid families' random models: two key heads of 8 serve four value heads of 12.
GATED_DELTANET_SHAPE = dict(
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
)


def require_model_type(arch: str) -> None:
    """Skip, saying so, where the installed transformers predates the family (the GPU image may)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if arch not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no model_type {arch!r}")


def arch_model(
    arch: str, shape: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32, init_std: float = 0.2
) -> torch.nn.Module:
    """A random `arch` model whose norm weights are random too (they initialise to ones, which would hide
    a norm the engine skips or loads into the wrong slot)."""
    model = random_causal_lm(
        arch, seed=seed, dtype=dtype, init_std=init_std, **{"vocab_size": VOCAB, **shape}
    )
    # norm scales drawn in [0.5, 1.5]; a family that stores them as w - 1 (Gemma) gets w - 1 stored
    offset = SPECS[arch].norm_offset
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5 - offset)
    return model


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def engine_config(**overrides: Any) -> EngineConfig:
    base = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, decode_steps=4)
    return EngineConfig(**{**base, **overrides})


def hf_greedy(model: torch.nn.Module, prompt: list[int], tokens: int) -> list[int]:
    """transformers' greedy `generate` of `tokens` new tokens after `prompt` (EOS not stopping it)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def check_greedy_equals_hf_generate(model: torch.nn.Module, lengths: tuple[int, ...] = (1, 40, 9)) -> None:
    """The engine's greedy tokens = transformers' `generate(do_sample=False)` for 64 tokens per prompt
    (prefill chunked by a small token budget, decode windows of 4 steps)."""
    prompts = prompts_of(list(lengths))
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    out = NativeEngine(model, [EOS], 0, engine_config(), CPU).generate(prompts, params)
    for prompt, tokens in zip(prompts, out.token_ids, strict=True):
        assert tokens == hf_greedy(model, prompt, GREEDY_TOKENS)


def check_training_log_probs_equal_hf(model: torch.nn.Module, temperature: float = 0.7) -> None:
    """The actor's log-probs of responses, padded and packed, within 1e-5 of HF's forward of each
    sequence alone (fp32)."""
    batch = make_batch(b=5, p=12, r=9)
    expected = unpadded_log_probs(model, batch, temperature).float()
    packed_model = copy.deepcopy(model)
    enable_packed_attention(packed_model)
    mask = batch["response_mask"].bool()
    for name, runs, packed in (("padded", model, False), ("packed", packed_model, True)):
        with torch.no_grad():
            logp, _ = log_probs_of(runs, batch, temperature, False, CPU, packed=packed)
        gap = (logp - expected)[mask].abs().max()
        assert gap < TOL, f"{name}: max |log-prob - HF| = {gap:.2e}"


def tensor_parallel_greedy(rank: int, world: int, arch: str, shape: dict[str, Any]) -> dict[str, Any]:
    """One rank of `check_tensor_parallel_equals_one_rank` (run_ranks forks it)."""
    from fulcrum.parallel.tensor_parallel import tensor_parallel_group

    torch.set_num_threads(1)
    model = arch_model(arch, shape)
    config = engine_config(num_kv_blocks=16)
    params = SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True)
    prompts = prompts_of([1, 30, 7, 19])
    engine = NativeEngine(model, [EOS], 0, config, CPU, tp=tensor_parallel_group(world))
    single = NativeEngine(model, [EOS], 0, config, CPU)
    return {
        "heads": (engine.model.num_heads, engine.model.num_kv_heads),
        "tokens": engine.generate(prompts, params).token_ids,
        "single": single.generate(prompts, params).token_ids,
    }


def check_tensor_parallel_equals_one_rank(arch: str, shape: dict[str, Any]) -> None:
    """Two ranks (gloo) each load their shard of the heads and MLP columns and sample the same greedy
    tokens as one rank holding everything."""
    from helpers_dist import run_ranks

    results = run_ranks(tensor_parallel_greedy, 2, arch, shape)
    heads = shape.get("num_attention_heads", 4)
    for out in results:
        assert out["heads"][0] == heads // 2
        assert out["tokens"] == out["single"]


class StubTokenizer:
    """What `build_rollout` reads of a tokenizer."""

    eos_token_id = EOS
    pad_token_id = 0


def check_grpo_step(model: torch.nn.Module, folder: Path) -> None:
    """One GRPO step on the CPU from the saved checkpoint: the native engine (not the hf fallback) samples
    4 responses to each of 3 prompts; the actor's packed log-probs of them are the engine's (fp32); GRPO
    advantages of a made-up reward (a response's share of even tokens) drive one update, which changes
    the weights; the engine takes the new weights and samples them as Hugging Face's model then does."""
    model.save_pretrained(folder)
    cfg = cfg_for(
        str(folder), "actor_rollout_ref.rollout.name=native", "actor_rollout_ref.rollout.max_model_len=64"
    )
    actor = ActorWorker(actor_section(cfg), CPU, total_training_steps=1)
    engine = build_rollout(cfg.actor_rollout_ref.rollout, actor.model, StubTokenizer(), CPU)
    assert isinstance(engine, NativeEngine)
    prompts = prompts_of([5, 11, 3], seed=3)
    out = engine.generate(
        prompts, SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=0, ignore_eos=True)
    )
    batch = scoring_batch([prompts[i] for i in out.prompt_index], out.token_ids)
    mask = batch["response_mask"]
    rewards = torch.zeros(mask.shape)
    rewards[:, -1] = torch.tensor([sum(t % 2 == 0 for t in row) / len(row) for row in out.token_ids])
    batch["advantages"], _ = grpo_advantage(
        token_level_rewards=rewards, response_mask=mask, index=out.prompt_index
    )
    batch["old_log_probs"], _ = actor.compute_log_prob(batch)
    sampled = torch.zeros(mask.shape)
    for row, logprobs in enumerate(out.logprobs):
        sampled[row, : len(logprobs)] = torch.tensor(logprobs)
    assert (sampled - batch["old_log_probs"])[mask.bool()].abs().max() < 1e-4
    before = [p.detach().clone() for p in actor.model.parameters()]
    metrics, _ = actor.update_policy(batch, global_step=1)
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0
    assert any(not torch.equal(b, p) for b, p in zip(before, actor.model.parameters(), strict=True))
    engine.update_weights(actor.model.state_dict().items())
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = engine.generate(prompts[:1], greedy).token_ids[0]
    assert tokens == hf_greedy(actor.model, prompts[0], 8)


def check_load_balancing_loss_equals_hf(
    arch: str, shape: dict[str, Any], experts: int, reference: Callable[..., torch.Tensor], packed: bool
) -> None:
    """The actor's loss from the routers it records equals Hugging Face's `reference`
    (`load_balancing_loss_func`) of its own router logits over the same real tokens (the padded rows and
    their attention mask), and reaches the routers' gradient."""
    model = arch_model(arch, dict(shape, output_router_logits=True, router_aux_loss_coef=0.01))
    assert router_loss_settings(model) == (0.01, 2)
    batch = make_batch(b=5, p=12, r=9)
    ids, mask, pos, _, _ = micro_inputs(batch, [], CPU, packed=False).padded
    with torch.no_grad():
        # the base model: the causal LM's own aux_loss trips over the 4-D mask it builds (transformers 5.24)
        out = model.model(input_ids=ids, attention_mask=mask, position_ids=pos, output_router_logits=True)
    expected = reference(out.router_logits, experts, 2, mask)
    forwards = ModelForwards(model, CPU, packed, "actor")
    inputs = forwards.inputs(batch, [])
    with recorded_router_logits(model) as logits:
        forwards.forward(inputs, LogProbHead(1.0))
    got = load_balancing_loss(logits, 2, forwards.token_mask(inputs))
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-6)
    got.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def hf_forward_log_probs(
    model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]]
) -> torch.Tensor:
    """log softmax of HF's forward of each prompt + response alone, at the response tokens: (B, R) on
    the CPU (equal-length responses)."""
    device = next(model.parameters()).device
    out = torch.zeros(len(responses), len(responses[0]))
    with torch.no_grad():
        for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
            logits = model(input_ids=torch.tensor([prompt + response], device=device)).logits[0].float()
            span = logits[len(prompt) - 1 : -1].log_softmax(-1)
            out[row] = span.gather(-1, torch.tensor(response, device=device)[:, None])[:, 0].cpu()
    return out


# The bf16 check's models: init std 0.05 instead of 0.2. At 0.2 bf16 rounding alone moves a sampled token's
# log-prob by 0.05-0.47 on average (HF's own bf16 forward against float32, CPU), which would hide a kernel
# bug; at 0.05 that is 0.006, while one norm weight left at 1.0 still moves it by 0.17.
BF16_INIT_STD = 0.05


def bf16_gaps(arch: str, shape: dict[str, Any], device: torch.device) -> dict[str, float]:
    """Mean |log-prob gap| of sampled tokens in bf16: the engine's and HF's own bf16 forward's, each
    against the float32 forward of the same (bf16-rounded) weights, and the engine's against HF's bf16."""
    model16 = arch_model(arch, shape, init_std=BF16_INIT_STD).to(torch.bfloat16)
    model32 = copy.deepcopy(model16).float().to(device)  # the bf16 weights, computed in float32
    model16 = model16.to(device)
    prompts = prompts_of([90, 120, 150, 200] * 4)
    config = engine_config(max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=512)
    engine = NativeEngine(model16, [EOS], 0, config, device)
    if device.type == "cuda":
        assert engine.runner.use_triton and engine.runner.use_graphs
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True, seed=0))
    rollout = torch.tensor(out.logprobs)
    reference = hf_forward_log_probs(model32, prompts, out.token_ids)
    hf_bf16 = hf_forward_log_probs(model16, prompts, out.token_ids)
    return {
        "engine_vs_fp32": (rollout - reference).abs().mean().item(),
        "hf_bf16_vs_fp32": (hf_bf16 - reference).abs().mean().item(),
        "engine_vs_hf_bf16": (rollout - hf_bf16).abs().mean().item(),
    }


def check_bf16_gap_on_gpu(arch: str, shape: dict[str, Any]) -> None:
    """bf16 on CUDA with the Triton kernels and CUDA graphs: the engine as close to the float32 forward as
    HF's bf16 forward is (within 1.5x + 0.002), and mean |engine - HF bf16 forward| <= 0.02 or 1.5x HF
    bf16's own gap to float32, whichever is larger: two bf16 forwards whose rounding errors are of one
    size and independent differ by about √2 times that size (a mixture of experts' routing makes the
    size larger than a dense model's). The gaps are printed (`pytest -rP` reports them, under xdist too)."""
    gaps = bf16_gaps(arch, shape, torch.device("cuda"))
    print(f"bf16 log-prob gaps, {arch}: " + ", ".join(f"{name} {gap:.4f}" for name, gap in gaps.items()))
    assert gaps["engine_vs_hf_bf16"] <= max(0.02, 1.5 * gaps["hf_bf16_vs_fp32"]), gaps
    assert gaps["engine_vs_fp32"] <= 1.5 * gaps["hf_bf16_vs_fp32"] + 0.002, gaps


def check_multimodal_folder_runs_as_its_text_model(
    arch: str, text_shape: dict[str, Any], folder: Path
) -> Any:
    """A multimodal `arch` folder (a tiny vision tower, the text model of `text_shape`) whose causal LM
    is its text model alone (Qwen3.5's `qwen3_5`, `qwen3_5_moe`): the trainer's loader gives the whole
    model's logits, the engine's check, doctor's folder check and the memory estimate read it as the text
    model, whose parameters the shape counts, and the engine samples Hugging Face's greedy tokens.
    Returns the shape."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = {**TINY_SHAPE, **text_shape, "vocab_size": VOCAB, "eos_token_id": EOS}
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=64)
    torch.manual_seed(0)
    full = AutoModelForImageTextToText.from_config(
        AutoConfig.for_model(arch, text_config=text, vision_config=vision)
    ).eval()
    full.save_pretrained(folder)
    loaded = load_causal_lm(str(folder), CPU).eval()
    prompt = prompts_of([9])[0]
    with torch.no_grad():
        assert torch.equal(loaded(torch.tensor([prompt])).logits, full(torch.tensor([prompt])).logits)
    rollout = RolloutConfig(name="native", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    assert native_unsupported_reason(rollout, AutoConfig.from_pretrained(folder)) is None
    shape = read_model_shape(str(folder))
    assert shape == model_shape(loaded.config)
    assert param_count(shape) == sum(p.numel() for p in loaded.parameters())
    engine = build_rollout(rollout, loaded, StubTokenizer(), CPU)
    assert isinstance(engine, NativeEngine)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert out.token_ids[0] == hf_greedy(loaded, prompt, 8)
    return shape


def check_hybrid_moe_parameter_counts(model: torch.nn.Module, idle_experts: int) -> Any:
    """The shape of a hybrid mixture of experts counts every parameter, and verl's N (the matmul weights,
    of the routed experts only the top k a token runs, the shared expert always) is the model's matmul
    weights less `idle_experts`' (the weights of the experts a token does not run). Returns the shape."""
    shape = model_shape(model.config)
    assert param_count(shape) == sum(p.numel() for p in model.parameters())
    small = ("norm", "dt_bias", "A_log", "conv1d")
    matmuls = sum(p.numel() for name, p in model.named_parameters() if not any(s in name for s in small))
    assert matmul_param_count(shape) == matmuls - idle_experts
    return shape
