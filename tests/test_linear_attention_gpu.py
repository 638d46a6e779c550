"""Gated DeltaNet on CUDA with flash-linear-attention (the `linear-attention` extra), against the torch
reference on the CPU: the engine's varlen prefill (sequences fresh and continuing their slots, across
fla's 64-token chunks) and its in-place decode step; the trainer's packed log-probs and gradients
(Qwen3.5, and Qwen3-Next's fused projections); the engine's greedy tokens (Triton kernels, decode CUDA
graphs) against Hugging Face's `generate` on the same device; and the engine's graphed decode against
its eager decode through held turns and a sleep; in float32 and bfloat16 where it applies.

Float32 compares to float32 with Triton's and cuBLAS's TF32 off (Triton's own switch, TRITON_F32_DEFAULT,
set for these tests only); bfloat16 compares to the float32 reference, the torch path's own bfloat16
error setting the bar where one exists.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
from arch_checks import (
    EOS,
    GATED_DELTANET_SHAPE,
    arch_model,
    check_bf16_gap_on_gpu,
    engine_config,
    prompts_of,
    require_model_type,
)
from helpers import log_probs_of

from fulcrum.models import gated_delta
from fulcrum.models.gated_delta import use_fla
from fulcrum.models.packed import enable_packed_attention
from fulcrum.rollout.base import SamplingParams
from fulcrum.rollout.native import NativeEngine
from fulcrum.rollout.native.models.linear_attention import RecurrentStates, StateStep, linear_attention
from fulcrum.rollout.testing import scoring_batch

pytestmark = pytest.mark.gpu
CUDA, CPU = torch.device("cuda"), torch.device("cpu")

# fla's kernels take tensor-core tiles of at least 16: head dims of 32 and 64 (Qwen3.5's are 128); two key
# heads serve four value heads, so q/k are shared by groups as in Qwen3.5-9B's 16 / 32.
SHAPE = dict(
    GATED_DELTANET_SHAPE,
    linear_key_head_dim=32,
    linear_value_head_dim=64,
    num_hidden_layers=4,
)
NEXT_SHAPE = dict(
    SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
)


@pytest.fixture(autouse=True)
def fla_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("fla", reason="needs flash-linear-attention: pip install -e '.[linear-attention]'")
    assert use_fla(CUDA)
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")  # part of Triton's cache key: recompiled, not reused
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float().cpu() - expected.float().cpu()).norm() / expected.float().cpu().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engines_kernels_equal_the_torch_reference(dtype: torch.dtype) -> None:
    """A prefill of four sequences in one varlen call (two from zeros, two continuing the states their
    slots hold; 70 and 130 tokens cross fla's 64-token chunks), then three decode steps of five rows
    (one row's turn ended: its step goes to the scratch slot and its own slot stays; one padding row):
    layer outputs and the sequences' slots as the torch path's on the CPU (float32, the same weights,
    inputs and starting states), the other slots untouched."""
    require_model_type("qwen3_5_text")
    model = arch_model("qwen3_5_text", SHAPE, init_std=0.1).to(dtype)
    decoder = NativeEngine(model, [EOS], 0, engine_config(dtype=dtype), CUDA).model
    layer, shape, eps = decoder.layers[0], decoder.linear_shape, decoder.eps  # layer 0: Gated DeltaNet
    ref_layer = {name: weight.float().cpu() for name, weight in layer.items()}
    generator = torch.Generator().manual_seed(0)
    states = RecurrentStates.empty(1, 9, shape, dtype, CUDA)
    states.conv.copy_(torch.randn(states.conv.shape, generator=generator))
    states.delta.copy_(0.1 * torch.randn(states.delta.shape, generator=generator))
    ref = RecurrentStates(states.conv.float().cpu().clone(), states.delta.cpu().clone())
    before = states.delta[0].clone()
    used, unused = [2, 3, 5, 7], [1, 4, 6, 8]  # slot 0 is scratch, which several decode rows write
    hidden = ref_layer["lin_qkv"].shape[1]
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2

    def both(step_of, rows: int, compared: slice) -> None:
        x = torch.randn(rows, hidden, generator=generator).to(dtype)
        got = linear_attention(
            layer, x.to(CUDA), shape, states.conv[0], states.delta[0], step_of(CUDA, True), eps
        )
        expected = linear_attention(
            ref_layer, x.float(), shape, ref.conv[0], ref.delta[0], step_of(CPU, False), eps
        )
        assert relative(got[compared], expected[compared]) < tolerance
        assert relative(states.delta[0, used], ref.delta[0, used]) < tolerance
        assert relative(states.conv[0, used], ref.conv[0, used]) < tolerance
        assert torch.equal(states.delta[0, unused], before[unused])  # no sequence's slot

    lengths, fresh, slots = [70, 5, 1, 130], [True, False, True, False], [3, 5, 7, 2]
    cu = torch.tensor([0, 70, 75, 76, 206], dtype=torch.int32)
    both(
        lambda dev, fla: StateStep.prefill(torch.tensor(slots, device=dev), lengths, fresh, cu.to(dev), fla),
        sum(lengths),
        slice(None),
    )
    untouched = states.delta[0, 7].clone()
    for _ in range(3):
        both(
            lambda dev, fla: StateStep.decode(
                torch.tensor([3, 5, 7, 2, 0], device=dev), torch.tensor([3, 5, 0, 2, 0], device=dev), fla
            ),
            5,
            slice(0, 4),
        )
    assert torch.equal(states.delta[0, 7], untouched)


def test_the_trainer_leaves_fla_exactly_where_fla_refuses_the_backward() -> None:
    """`fla_training_refusal` (the trainer's Gated DeltaNet passes then run the torch reference) holds on
    this GPU exactly where fla's chunked gated delta rule raises in its backward (fla #640: Hopper GPUs
    with Triton 3.4.0-3.7.0), so the trainer takes fla's kernels wherever fla gives their gradients."""
    generator = torch.Generator().manual_seed(0)
    tokens, heads, dk, dv = 80, 2, 32, 64
    q, k = (torch.randn(tokens, heads, dk, generator=generator) for _ in range(2))
    v = torch.randn(tokens, heads, dv, generator=generator)
    g = -torch.rand(tokens, heads, generator=generator)
    beta = torch.rand(tokens, heads, generator=generator)
    dtypes = (torch.bfloat16,) * 3 + (
        torch.float32,
        torch.bfloat16,
    )  # the decay in float32, as `decay` gives it
    leaves = [t.to(CUDA, dtype).requires_grad_() for t, dtype in zip((q, k, v, g, beta), dtypes, strict=True)]
    cu_seqlens = torch.tensor([0, 30, tokens], dtype=torch.int32, device=CUDA)
    out, _ = gated_delta.delta_rule_varlen(*leaves, cu_seqlens)
    try:
        out.float().square().sum().backward()
        refused = None
    except RuntimeError as error:
        if "chunk_bwd_dqkwg" not in str(error):
            raise
        refused = str(error)
    reason = gated_delta.fla_training_refusal(torch.cuda.current_device())
    assert (reason is not None) == (refused is not None), (reason, refused)
    assert gated_delta.fla_trains(CUDA) == (refused is None)
    if refused is None:
        assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)


def long_batch(vocab: int) -> object:
    """Five sequences of 20 to 150 tokens (prompt + response), three of them across fla's 64-token chunks."""
    lengths = [(12, 8), (40, 30), (7, 90), (100, 50), (3, 17)]
    prompts = prompts_of([p for p, _ in lengths], seed=1)
    responses = prompts_of([r for _, r in lengths], seed=2)
    assert max(max(p + r) for p, r in zip(prompts, responses, strict=True)) < vocab
    return scoring_batch(prompts, responses)


def packed_pass(model: torch.nn.Module, batch: object, device: torch.device) -> tuple[torch.Tensor, dict]:
    """The actor's packed log-probs of the responses (B, R) on `device`, and the gradients of their sum."""
    model = model.to(device).train()
    enable_packed_attention(model)
    logp, _ = log_probs_of(model, batch, 1.0, False, device, packed=True)
    logp.sum().backward()
    grads = {name: p.grad.float().cpu() for name, p in model.named_parameters() if p.grad is not None}
    return logp.detach().float().cpu(), grads


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_next"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_log_probs_and_gradients_equal_the_torch_reference(arch: str, dtype: torch.dtype) -> None:
    """The trainer's packed pass on CUDA, with fla's varlen kernels (zero state at every sequence start,
    fla's backward) where fla takes their gradients here, else the torch reference on CUDA
    (`fla_trains`), against the torch path on the CPU in float32: log-probs and the gradients of the
    linear-attention layers' parameters. In float32 within 1e-4 (log-probs) and 5e-3 relative
    (gradients: the decay's, reached through a chunk's cumulative products, is the least conditioned);
    in bfloat16 within 2x + 1e-3 of the torch path's own bfloat16 error (log-probs, mean) and 3x + 1e-2
    (each gradient)."""
    require_model_type(arch)
    model = arch_model(arch, NEXT_SHAPE if arch == "qwen3_next" else SHAPE, init_std=0.1)
    batch = long_batch(model.config.vocab_size)
    mask = batch["response_mask"].bool()
    ref_logp, ref_grads = packed_pass(copy.deepcopy(model), batch, CPU)
    logp, grads = packed_pass(copy.deepcopy(model).to(dtype), batch, CUDA)
    names = [name for name in ref_grads if "linear_attn" in name]
    assert len(names) == 3 * (7 if arch == "qwen3_next" else 9)  # three Gated DeltaNet layers
    if dtype == torch.float32:
        assert (logp - ref_logp)[mask].abs().max() < 1e-4
        for name in names:
            assert relative(grads[name], ref_grads[name]) < 5e-3, name
        return
    torch_logp, torch_grads = packed_pass(copy.deepcopy(model).to(dtype), batch, CPU)
    gap, torch_gap = ((x - ref_logp)[mask].abs().mean() for x in (logp, torch_logp))
    assert gap <= 2 * torch_gap + 1e-3, (gap, torch_gap)
    for name in names:
        bar = 3 * relative(torch_grads[name], ref_grads[name]) + 1e-2
        assert relative(grads[name], ref_grads[name]) <= bar, name


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_next"])
def test_native_greedy_equals_hf_generate_on_cuda(arch: str) -> None:
    """float32 on CUDA: the engine (fla's prefill over a 64-token budget, so the 150-token prompt spans
    three steps; fla's decode; the engine's Triton kernels; decode CUDA graphs for Qwen3.5, whose
    float32 has no expert products to read on the host) samples Hugging Face's greedy tokens, 64 a
    prompt."""
    require_model_type(arch)
    model = arch_model(arch, NEXT_SHAPE if arch == "qwen3_next" else SHAPE, seed=1, init_std=0.1).to(CUDA)
    model.generation_config.eos_token_id = None  # every response runs 64 tokens on both sides
    prompts = prompts_of([1, 40, 9, 150])
    engine = NativeEngine(model, [EOS], 0, engine_config(max_model_len=256, dtype=torch.float32), CUDA)
    graphed = arch != "qwen3_next"  # float32 experts read their row counts on the host: decode eager
    assert engine.runner.use_triton and engine.runner.use_graphs == graphed
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    assert bool(engine.runner.graphs) == graphed  # decode replayed captured graphs
    for prompt, tokens in zip(prompts, out.token_ids, strict=True):
        with torch.no_grad():
            expected = model.generate(
                torch.tensor([prompt], device=CUDA),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=CUDA),
                do_sample=False,
                max_new_tokens=64,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert tokens == expected


def run_all(engine: NativeEngine) -> dict[int, list[int]]:
    """Step until nothing is in flight; each finished turn's tokens by its id."""
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.seq_id: out.token_ids for out in engine.step()})
    return done


def bucket(sizes: list[int], batch: int) -> int:
    """The smallest graph bucket that holds `batch` rows (`ModelRunner.padded_batch` with graphs)."""
    return next(size for size in sizes if size >= batch)


def conversation(engine: NativeEngine) -> dict[str, object]:
    """Greedy turns through the engine: two held conversations beside a longer request (one with a stop
    id its greedy run alone samples after 5 tokens, so that it stops mid-window, one at its max_tokens),
    their next turns (prefilling only the new tokens, from
    the states their slots kept), a sleep while the old recurrent states are still referenced (so the
    new ones land elsewhere), a third turn (the conversations recomputed) and a generate of 2 samples
    of 6 prompts (forks). Returns every turn's tokens, and whether the graphs were dropped at the
    wake-up and captured again by the end."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first, second, longer = prompts_of([13, 9, 20], seed=3)
    probe = engine.generate([first], params).token_ids[0]
    stop = next(t for k, t in enumerate(probe) if k >= 5 and t not in probe[:k])
    tokens: dict[str, object] = {"probe": probe}
    engine.seed_requests(params)
    a = engine.add_request(first, dataclasses.replace(params, stop_token_ids=[stop]), keep=True)
    b = engine.add_request(second, dataclasses.replace(params, max_tokens=6), keep=True)
    engine.add_request(longer, dataclasses.replace(params, max_tokens=40))
    tokens["turn 1"] = run_all(engine)
    tool = [5, 6, 7]
    for seq_id in (a, b):
        engine.resume(seq_id, tool, params, keep=True)
    tokens["turn 2"] = run_all(engine)
    held = engine.runner.states
    engine.sleep()
    engine.wake_up()
    tokens["dropped"] = not engine.runner.graphs
    assert engine.runner.states.delta.data_ptr() != held.delta.data_ptr()
    del held
    for seq_id in (a, b):
        engine.resume(seq_id, tool, params)
    tokens["turn 3"] = run_all(engine)
    prompts = prompts_of([1, 40, 9, 150, 3, 70], seed=4)
    out = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=32, ignore_eos=True))
    tokens["generate"] = out.token_ids
    tokens["captured"] = bool(engine.runner.graphs)
    return tokens


@pytest.mark.parametrize("indirect", [False, True], ids=["cache-address", "indirect-cache"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_next"])
def test_graphed_decode_equals_eager_decode_through_held_turns_and_a_sleep(
    arch: str, dtype: torch.dtype, indirect: bool
) -> None:
    """The engine with its decode CUDA graphs samples, token for token, what the same engine samples
    eagerly: through held turns (a row whose turn ended steps the scratch slot for the rest of its
    window, and its slot carries the state into the next turn) and a wake-up that puts the recurrent
    states elsewhere (the graphs, whose kernels hold the states' address, are dropped and recaptured,
    also where the KV cache is read through its device-held address). The eager engine runs each
    decode step over the same padded rows as the graph's bucket, so that both run the same kernels on
    the same shapes and bfloat16 compares exactly too. Qwen3-Next in float32 decodes eagerly, graphs
    refused with the reason (its experts' products read their row counts on the host)."""
    require_model_type(arch)
    model = arch_model(arch, NEXT_SHAPE if arch == "qwen3_next" else SHAPE, seed=1, init_std=0.1).to(CUDA)
    config = engine_config(dtype=dtype, indirect_kv_cache=indirect, free_cache_engine=False)
    refused = arch == "qwen3_next" and dtype == torch.float32
    runs = {}
    for eager in (True, False):
        engine = NativeEngine(model, [EOS], 0, dataclasses.replace(config, enforce_eager=eager), CUDA)
        runner = engine.runner
        assert ("row count on the host" in (runner.graphs_off_reason or "")) == refused
        graphed = not eager and not refused
        assert runner.use_triton and runner.use_graphs == graphed
        assert (runner.indirect is not None) == (indirect and graphed)
        if not graphed:  # the graphs' buckets: padding rows read and write the scratch block and state slot
            runner.padded_batch = functools.partial(bucket, runner.capture_sizes)
        runs[eager] = conversation(engine)
        dropped, captured = runs[eager].pop("dropped"), runs[eager].pop("captured")
        assert (dropped and captured) == graphed
    assert runs[False] == runs[True]


@pytest.mark.parametrize(("arch", "shape"), [("qwen3_5_text", SHAPE), ("qwen3_next", NEXT_SHAPE)])
def test_bf16_gap_on_gpu(arch: str, shape: dict) -> None:
    """The hybrids' rollout-against-training gap in bf16 (fla's kernels in the engine and in HF's forward),
    held to the dense families' bound and printed."""
    check_bf16_gap_on_gpu(arch, shape)
