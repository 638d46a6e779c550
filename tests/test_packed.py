"""Padding-free (packed) forwards agree with the padded ones on the CPU in float32: log-probs,
entropies, values, the policy and value losses and their gradients; the chunked LM-head log-softmax
matches the dense one with gradients; compute-weight copies accumulate gradients into the masters."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from helpers import log_probs_of, ppo_loss, values_of
from test_workers_units import make_batch  # tests/ is on sys.path under pytest
from torch import nn

from fulcrum.algo.losses import compute_value_loss
from fulcrum.models import precision
from fulcrum.models.linear_logprob import linear_log_softmax
from fulcrum.models.load import load_backbone, load_causal_lm
from fulcrum.models.packed import enable_packed_attention, pack_micro_batch
from fulcrum.models.packed_attention import (
    cudnn_bucket,
    cudnn_causal_attention,
    right_padded_causal_attention,
)
from fulcrum.models.precision import ComputeWeights
from fulcrum.models.value_head import CriticModel
from fulcrum.rollout.testing import random_causal_lm
from fulcrum.workers.micro_batch import (
    make_micro_batches,
    packed_token_groups,
)

CPU = torch.device("cpu")
TOL = 1e-5


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    from fulcrum.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), arch=request.param, seed=0))


def rl_batch(seed: int = 0, b: int = 6, p: int = 10, r: int = 7):
    batch = make_batch(b=b, p=p, r=r, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    mask = batch["response_mask"].float()
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=g) * mask
    batch["old_log_probs"] = (torch.randn(batch["responses"].shape, generator=g) * 0.1 - 5.0) * mask
    batch["values"] = torch.randn(batch["responses"].shape, generator=g) * mask
    batch["returns"] = torch.randn(batch["responses"].shape, generator=g) * mask
    return batch


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_pack_indexes_every_response_token() -> None:
    batch = make_batch(b=4, p=6, r=5)
    packed = pack_micro_batch(batch["input_ids"], batch["attention_mask"], batch["position_ids"], 6)
    lengths = batch["attention_mask"].sum(-1)
    assert packed.input_ids.numel() == int(lengths.sum())
    assert packed.cu_seqlens.tolist() == [0, *lengths.cumsum(0).tolist()]
    assert packed.max_seqlen >= int(lengths.max())  # a bound (the padded width), constant per run
    # The label of each response token is the token right after its predictor in the stream.
    assert torch.equal(packed.input_ids[packed.predictor + 1], packed.labels)
    assert torch.equal(packed.labels, batch["responses"][packed.rows, packed.cols])
    # Positions restart at 0 in every sequence.
    starts = packed.cu_seqlens[:-1].long()
    assert (packed.position_ids[starts] == 0).all()


def test_pack_rejects_a_row_without_prompt() -> None:
    batch = make_batch(b=2, p=6, r=5)
    mask = batch["attention_mask"].clone()
    mask[1, :6] = 0
    with pytest.raises(ValueError, match="row 1"):
        pack_micro_batch(batch["input_ids"], mask, batch["position_ids"], 6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_log_probs_and_policy_gradients_equal_padded(tiny_dir: str, temperature: float) -> None:
    padded = load_causal_lm(tiny_dir, CPU)
    packed_model = load_causal_lm(tiny_dir, CPU)
    enable_packed_attention(packed_model)
    batch = rl_batch()
    mask = batch["response_mask"].float()
    results = {}
    for name, model, packed in (("padded", padded, False), ("packed", packed_model, True)):
        model.zero_grad()
        logp, ent = log_probs_of(model, batch, temperature, True, CPU, packed=packed)
        loss, *_ = ppo_loss(batch["old_log_probs"], logp, batch["advantages"], mask)
        (loss - 0.01 * (ent * mask).sum() / mask.sum()).backward()
        results[name] = (logp.detach(), ent.detach(), loss.detach(), grads(model))
    (lp_a, ent_a, loss_a, g_a), (lp_b, ent_b, loss_b, g_b) = results["padded"], results["packed"]
    assert torch.allclose(lp_a, lp_b, atol=TOL, rtol=0)
    assert torch.allclose(ent_a, ent_b, atol=TOL, rtol=0)
    assert (lp_b[~batch["response_mask"].bool()] == 0).all()
    assert torch.allclose(loss_a, loss_b, atol=TOL, rtol=0)
    assert g_a.keys() == g_b.keys()
    for name in g_a:
        assert torch.allclose(g_a[name], g_b[name], atol=TOL, rtol=1e-4), name


def test_packed_values_and_value_gradients_equal_padded(tiny_dir: str) -> None:
    torch.manual_seed(0)
    padded = CriticModel(load_backbone(tiny_dir, CPU))
    packed_model = CriticModel(load_backbone(tiny_dir, CPU))
    packed_model.load_state_dict(padded.state_dict())
    enable_packed_attention(packed_model.model)
    batch = rl_batch(seed=3)
    mask = batch["response_mask"].float()
    results = {}
    for name, model, packed in (("padded", padded, False), ("packed", packed_model, True)):
        values = values_of(model, batch, CPU, packed=packed)
        loss, _ = compute_value_loss(values, batch["returns"], batch["values"], mask, cliprange_value=0.5)
        loss.backward()
        results[name] = (values.detach(), loss.detach(), grads(model))
    (v_a, loss_a, g_a), (v_b, loss_b, g_b) = results["padded"], results["packed"]
    assert torch.allclose(v_a, v_b, atol=TOL, rtol=0)
    assert torch.allclose(loss_a, loss_b, atol=TOL, rtol=0)
    for name in g_a:
        assert torch.allclose(g_a[name], g_b[name], atol=TOL, rtol=1e-4), name


@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunked_linear_log_softmax_matches_dense_with_gradients(with_entropy: bool) -> None:
    g = torch.Generator().manual_seed(0)
    m, h, v, tau = 11, 8, 37, 0.8
    hidden = torch.randn(m, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, v, (m,), generator=g)
    w_lp, w_ent = (
        torch.randn(m, generator=g, dtype=torch.float64),
        torch.randn(m, generator=g, dtype=torch.float64),
    )

    z = (hidden @ weight.T + bias) / tau
    ref_lp = torch.log_softmax(z, -1).gather(1, labels[:, None]).squeeze(1)
    ref_ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    ref_loss = (ref_lp * w_lp).sum() + ((ref_ent * w_ent).sum() if with_entropy else 0.0)
    ref_grads = torch.autograd.grad(ref_loss, (hidden, weight, bias))

    lp, ent = linear_log_softmax(hidden, weight, labels, tau, with_entropy, bias=bias, rows=4)  # 3 chunks
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5)
    loss = (lp.double() * w_lp).sum()
    if with_entropy:
        assert ent is not None and torch.allclose(ent.double(), ref_ent, atol=1e-5)
        loss = loss + (ent.double() * w_ent).sum()
    else:
        assert ent is None
    for got, want in zip(torch.autograd.grad(loss, (hidden, weight, bias)), ref_grads, strict=True):
        assert torch.allclose(got, want, atol=1e-5)
    with torch.no_grad():  # the no-grad path gives the same numbers
        lp2, _ = linear_log_softmax(hidden, weight, labels, tau, False, bias=bias, rows=5)
    assert torch.allclose(lp2, lp.detach(), atol=1e-6)


def test_packed_micro_batches_fit_the_budget_of_n_padded_rows(tiny_dir: str) -> None:
    batch = make_batch(b=8, p=12, r=9)
    micro, order = make_micro_batches(batch, 2, False, None, "k", packed=True)
    assert sorted(order) == list(range(8))
    budget = 2 * (12 + 9)
    assert all(int(mb["attention_mask"].sum()) <= budget for mb in micro)
    assert sum(len(mb) for mb in micro) == 8
    # Fewer micro-batches than fixed rows of 2 (4): the rows are short, so several share a budget.
    assert len(micro) < 4
    assert packed_token_groups([5, 4, 3, 3, 1], 8) == [[0, 2], [1, 3, 4]]
    assert packed_token_groups([5, 3, 1], 4) == [[0], [1, 2]]  # over the budget: alone


def test_compute_weights_accumulate_float32_grads_into_masters(tiny_dir: str) -> None:
    """float64 copies stand in for bf16 ones on the CPU: same gradients as computing on the masters."""
    reference = load_causal_lm(tiny_dir, CPU)
    model = load_causal_lm(tiny_dir, CPU)
    enable_packed_attention(model)
    compute = ComputeWeights(model, dtype=torch.float64)
    batch = rl_batch(seed=5, b=8)
    mask = batch["response_mask"].float()
    for mb in batch.split(3):  # gradient accumulation over micro-batches
        logp, _ = log_probs_of(reference, mb, 1.0, False, CPU)
        ppo_loss(mb["old_log_probs"], logp, mb["advantages"], mb["response_mask"].float())[0].backward()
    compute.refresh()
    with compute.swapped_in():
        assert model.get_output_embeddings().weight.dtype == torch.float64
        for mb in batch.split(3):
            logp, _ = log_probs_of(model, mb, 1.0, False, CPU, packed=True)
            ppo_loss(mb["old_log_probs"], logp, mb["advantages"], mb["response_mask"].float())[0].backward()
            compute.accumulate_grads()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    want, got = grads(reference), grads(model)
    assert want.keys() == got.keys() and mask.sum() > 0
    for name in want:
        assert got[name].dtype == torch.float32
        assert torch.allclose(got[name], want[name], atol=TOL, rtol=1e-4), name


def test_compute_weights_gradients_live_in_one_buffer_that_the_optimiser_release_frees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Accumulation into one float32 buffer, added in chunks (here of 10 elements, so the 3 × 4 weight
    is a chunk alone and the others share one): two micro-batches give twice one micro-batch's
    gradient; once the optimiser drops the gradients (`zero_grad`, set to None) the next accumulation
    starts afresh; a micro-batch that reaches only part of the model adds to that part only."""
    monkeypatch.setattr(precision, "FLAT_CHUNK", 10)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    compute = ComputeWeights(model, dtype=torch.float64)
    compute.refresh()
    x = torch.randn(5, 3, dtype=torch.float64)

    def micro_batch(inputs: torch.Tensor, module: nn.Module = model) -> None:
        with compute.swapped_in():
            module(inputs).square().sum().backward()
        compute.accumulate_grads()

    micro_batch(x)
    once = {name: p.grad.clone() for name, p in model.named_parameters()}

    def per_parameter(grads: list) -> None:
        raise AssertionError("a whole-model micro-batch took the per-parameter path")

    monkeypatch.setattr(compute, "_add_each", per_parameter)
    micro_batch(x)
    monkeypatch.undo()
    assert len({p.grad.untyped_storage().data_ptr() for p in model.parameters()}) == 1
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32
        assert torch.allclose(p.grad, 2 * once[name], rtol=1e-6), name
    torch.optim.SGD(model.parameters(), lr=0.0).zero_grad(set_to_none=True)
    assert compute._flat_grad() is None  # nothing holds the buffer any more
    micro_batch(x)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, once[name], rtol=1e-6), name
    monkeypatch.setattr(precision, "FLAT_CHUNK", 10)
    hidden = torch.randn(5, 4, dtype=torch.float64)
    micro_batch(hidden, model[1])  # the first layer's copies get no gradient: per-parameter path
    assert torch.equal(model[0].weight.grad, once["0.weight"].float())
    assert not torch.allclose(model[1].weight.grad, once["1.weight"])


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from fulcrum.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2", seed=0))


@pytest.mark.parametrize(
    ("layers_per_region", "save_attention", "save_mlp"),
    [(1, False, False), (2, False, False), (1, True, False), (1, True, True), (1, False, True)],
)
def test_compiled_layer_twins_match_and_leave_the_model_alone(
    qwen2_dir: str,
    layers_per_region: int,
    save_attention: bool,
    save_mlp: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """compile_decoder_layers (dynamo's eager backend here: the CPU has no inductor toolchain in CI)
    takes over gradient checkpointing, gives the same log-probs and gradients as HF's own checkpointed
    layers, and registers nothing: same state-dict keys, the layers themselves uncompiled. Regions of
    one layer (the default) and of two (the size `bench/train_step.py --layers-per-region` compares),
    and the checkpoint keeping the attention kernel's outputs (`SAVE_ATTENTION_OUTPUTS`: the CPU's
    SDPA kernel is one of `ATTENTION_OPS`, so the selective policy does save here), and the outputs of
    the MLP's expanding projections (`SAVE_MLP_PROJECTIONS`: two matmuls a layer)."""
    from fulcrum.models import checkpoint_policy, packed
    from fulcrum.models.packed import compile_decoder_layers

    monkeypatch.setattr(packed, "SAVE_ATTENTION_OUTPUTS", save_attention)
    monkeypatch.setattr(packed, "SAVE_MLP_PROJECTIONS", save_mlp)
    saved: list[object] = []
    keep = checkpoint_policy.selective_checkpoint_policy

    def recording_policy(
        attention: bool, mlp: bool, ctx: object, op: object, *args: object, **kwargs: object
    ) -> object:
        decision = keep(attention, mlp, ctx, op, *args, **kwargs)
        if decision == torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE:
            saved.append(op)
        return decision

    monkeypatch.setattr(checkpoint_policy, "selective_checkpoint_policy", recording_policy)

    results = []
    for compiled in (False, True):
        model = load_causal_lm(qwen2_dir, CPU, gradient_checkpointing=True).train()
        keys = list(model.state_dict())
        enable_packed_attention(model)
        if compiled:
            compile_decoder_layers(model.model, backend="eager", layers_per_region=layers_per_region)
            assert len(model.model.fulcrum_regions[0]) == layers_per_region
            assert model.model.fulcrum_checkpoint and not any(
                layer.gradient_checkpointing for layer in model.model.layers
            )
        assert list(model.state_dict()) == keys
        batch = rl_batch(seed=7, b=5)
        logp, _ = log_probs_of(model, batch, 1.0, False, CPU, packed=True)
        ppo_loss(batch["old_log_probs"], logp, batch["advantages"], batch["response_mask"].float())[
            0
        ].backward()
        results.append((logp.detach(), grads(model)))
    (lp_a, g_a), (lp_b, g_b) = results
    # the policy ran, and saved the attention kernel's outputs and the expanding projections' as asked
    assert any(op in checkpoint_policy.ATTENTION_OPS for op in saved) == save_attention
    matmuls = [op for op in saved if op in checkpoint_policy.MATMUL_OPS]
    layers = len(model.model.layers)
    assert len(matmuls) == (2 * layers if save_mlp else 0)  # gate and up, once in the forward
    assert torch.allclose(lp_a, lp_b, atol=TOL, rtol=0)
    for name in g_a:
        assert torch.allclose(g_a[name], g_b[name], atol=TOL, rtol=1e-4), name


def per_sequence_causal_attention(
    q: torch.Tensor,  # (N, Hq, D)
    k: torch.Tensor,  # (N, Hkv, D)
    v: torch.Tensor,  # (N, Hkv, D)
    cu_seqlens: torch.Tensor,  # (S + 1,)
    scale: float | None,
) -> torch.Tensor:
    """The reference varlen attention: causal SDPA on each sequence alone (GQA by repeating K/V heads)."""
    groups = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    out = torch.empty_like(q)
    for start, end in itertools.pairwise(bounds):
        qs = q[start:end].transpose(0, 1)  # (Hq, L, D)
        ks = k[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        vs = v[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale
        ).transpose(0, 1)
    return out


def test_right_padded_attention_equals_one_sdpa_per_sequence() -> None:
    """The CPU's one-call packed attention (sequences right-padded side by side) gives the per-sequence
    reference's outputs and gradients, grouped-query heads included, lengths 1 to 9."""
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    n = int(cu[-1])
    q = torch.randn(n, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(n, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(n, 2, 8, generator=g, requires_grad=True)
    weight = torch.randn(n, 4, 8, generator=g)
    outs, grads_ = [], []
    for attention in (per_sequence_causal_attention, right_padded_causal_attention):
        out = attention(q, k, v, cu, 0.3)
        (out * weight).sum().backward()
        outs.append(out.detach())
        grads_.append([x.grad.clone() for x in (q, k, v)])
        for x in (q, k, v):
            x.grad = None
    assert torch.allclose(outs[0], outs[1], atol=1e-6)
    for want, got in zip(grads_[0], grads_[1], strict=True):
        assert torch.allclose(want, got, atol=1e-5)


@pytest.mark.parametrize("native_gqa", [False, True])
def test_bucketed_dense_attention_equals_one_sdpa_per_sequence(native_gqa: bool) -> None:
    """The cuDNN prefill's grouping, run under SDPA's math kernel on the CPU: prompts batched by padded
    length (two equal consecutive ones read as a view, the others zero-padded copies, one alone in its
    bucket) give each prompt's own causal attention, grouped-query heads repeated or handed over."""
    from torch.nn.attention import SDPBackend

    lengths = [70, 64, 64, 3, 130, 65]  # buckets 128, 64, 64, 64, 192, 128
    assert [cudnn_bucket(n) for n in lengths] == [128, 64, 64, 64, 192, 128]
    g = torch.Generator().manual_seed(0)
    n = sum(lengths)
    q, k, v = (torch.randn(n, h, 8, generator=g) for h in (6, 2, 2))
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    want = per_sequence_causal_attention(q, k, v, cu, 0.3)
    got = cudnn_causal_attention(q, k, v, lengths, 0.3, native_gqa=native_gqa, backend=SDPBackend.MATH)
    assert torch.allclose(got, want, atol=1e-6)
    # the same from views of one QKV row, as the engine holds them (`strided_rows`)
    q, k, v = (
        x.view(n, -1, 8)
        for x in torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1).split([48, 16, 16], 1)
    )
    assert not q.is_contiguous()
    views = cudnn_causal_attention(
        q, k, v, lengths, 0.3, native_gqa=native_gqa, backend=SDPBackend.MATH, strided_rows=True
    )
    assert torch.allclose(views, want, atol=1e-6)


def test_cudnn_buckets_hold_each_length_within_a_sixteenth_of_an_octave() -> None:
    """Every length runs at a bucket no shorter than itself and at most max(64, 2^(⌊log2 n⌋ − 4)) − 1
    tokens longer (≤ 13 % more causal FLOPs from 1,024 tokens up), sixteen buckets an octave."""
    for n in range(1, 40_000, 7):
        bucket = cudnn_bucket(n)
        assert n <= bucket < n + max(64, 2 ** (n.bit_length() - 5))
        if n >= 1024:
            assert (bucket / n) ** 2 - 1 <= 0.13
    assert len({cudnn_bucket(n) for n in range(8193, 16385)}) == 16  # 8,704 … 16,384
    assert cudnn_bucket(8192) == 8192 and cudnn_bucket(8193) == 8704


def test_the_cpp_wrapper_only_where_it_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's C++ wrapper (the compiled regions' default on CUDA) only with the attention outputs
    kept by the checkpoint: without them the regions hold an RNG-replay op the wrapper refuses. Other
    backends get their defaults; actor_rollout_ref.actor.inductor_cpp_wrapper=false the Python wrapper,
    without inductor's mix-order reduction, whose size guard recompiles an update when micro-batches
    cross it (the C++ wrapper does not fuse so)."""
    from torch._inductor import config as inductor_config

    from fulcrum.models import packed

    monkeypatch.setattr(packed, "cpp_compiler_found", lambda: True)
    assert packed.SAVE_ATTENTION_OUTPUTS and packed.compile_options(device="cpu") == {"cpp_wrapper": True}
    assert packed.compile_options() == {"cpp_wrapper": True, **packed.GPU_HOST_OPTIONS}  # CUDA's
    assert packed.compile_options("eager") is None
    python_wrapper = packed.compile_options(cpp_wrapper=False)
    assert not packed.uses_cpp_wrapper(python_wrapper)
    with inductor_config.patch(python_wrapper):  # each option names one of inductor's settings
        if hasattr(inductor_config.triton, "mix_order_reduction"):  # torch >= 2.10
            assert not inductor_config.triton.mix_order_reduction
    monkeypatch.setattr(packed, "SAVE_ATTENTION_OUTPUTS", False)
    assert packed.compile_options() == python_wrapper


def test_cuda_passes_skip_inductors_check_of_the_hosts_vector_instructions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The compiled CUDA passes' options tell inductor that no CPU vector instruction set is usable, so a
    process compiling them builds and loads no test library per candidate set; CPU passes keep the check."""
    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa

    from fulcrum.models import packed

    checked: list[object] = []
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", lambda isa, code: checked.append(isa) or True)
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    try:
        for cpp_wrapper in (True, False):
            with inductor_config.patch(packed.compile_options(cpp_wrapper=cpp_wrapper)):
                assert not cpu_vec_isa.pick_vec_isa() and checked == []
            cpu_vec_isa.valid_vec_isa_list.cache_clear()
        assert "cpp.vec_isa_ok" not in packed.compile_options(device="cpu")
    finally:
        cpu_vec_isa.valid_vec_isa_list.cache_clear()


def test_no_cpp_compiler_keeps_the_python_wrapper(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A machine without a C++ compiler (inductor's search finds none) compiles with inductor's Python
    wrapper and says so, instead of failing at the first compiled call."""
    from torch._inductor import config as inductor_config

    from fulcrum.models import packed

    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "/nonexistent/g++"))
    packed.cpp_compiler_found.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="fulcrum.models.inductor_toolchain"):
            assert not packed.uses_cpp_wrapper(packed.compile_options())
        assert "no C++ compiler for inductor's C++ wrapper" in caplog.text
    finally:
        packed.cpp_compiler_found.cache_clear()


def test_layers_calling_an_op_the_c_shim_lacks_keep_the_python_wrapper(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Qwen3-MoE's experts call aten's `_grouped_mm`, which torch 2.11's C shim lacks (the C++ wrapper's
    code then fails to build; 2.13's declares it): its compiled layers get inductor's Python wrapper
    where the shim lacks the op, the C++ wrapper where it declares it. Both ways of compiling the layers
    hand that choice to `torch.compile`, asking the shim of the device the weights are on. A dense
    model, and a Qwen3-MoE whose layers are all dense, keep the C++ wrapper without asking."""
    from transformers import AutoConfig

    from fulcrum.models import packed

    asked: list[tuple[str, str]] = []
    chosen: list[object] = []

    def compile_spy(fn: object, **kwargs: object) -> object:
        chosen.append(kwargs["options"])
        return fn

    monkeypatch.setattr(packed, "cpp_compiler_found", lambda: True)
    monkeypatch.setattr(torch, "compile", compile_spy)
    moe = random_causal_lm("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    for declared in (False, True):
        monkeypatch.setattr(
            packed, "c_shim_declares", lambda op, device, d=declared: asked.append((op, device)) or d
        )
        assert packed.uses_cpp_wrapper(packed.compile_options("inductor", moe.config, "cuda")) == declared
        want = packed.compile_options(device="cpu", cpp_wrapper=declared)  # the weights are on the CPU
        packed.compile_decoder_layers(moe.model)
        packed.compile_inside_layers(moe.model)
        assert chosen[-2:] == [want, want]
    assert asked == [("_grouped_mm", "cuda"), ("_grouped_mm", "cpu"), ("_grouped_mm", "cpu")] * 2
    asked.clear()
    all_dense = AutoConfig.for_model("qwen3_moe", num_hidden_layers=2, mlp_only_layers=[0, 1])
    for config in (random_causal_lm("qwen3").config, all_dense):
        assert packed.uses_cpp_wrapper(packed.compile_options("inductor", config, "cuda"))
    assert not asked


def test_c_shim_declares_reads_the_installed_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whether torch's generated c_shim_<device>.h declares an op's function: the installed torch's
    header (it declares `_scaled_mm`, as 2.11's and 2.13's do), one without the op (torch 2.11's CUDA shim
    has `_scaled_grouped_mm`, not `_grouped_mm`), and no header at all, taken as the op missing."""
    from fulcrum.models import inductor_toolchain as toolchain

    toolchain.c_shim_declares.cache_clear()
    try:
        assert toolchain.c_shim_declares("_scaled_mm", "cuda")
        declaration = "AOTI_TORCH_EXPORT AOTITorchError aoti_torch_{}(AtenTensorHandle self);\n"
        (tmp_path / "c_shim_cuda.h").write_text(declaration.format("cuda__scaled_grouped_mm"))
        (tmp_path / "c_shim_cpu.h").write_text(declaration.format("cpu__grouped_mm"))
        monkeypatch.setattr(toolchain, "SHIM_HEADERS", tmp_path)
        toolchain.c_shim_declares.cache_clear()
        with caplog.at_level("WARNING", logger="fulcrum.models.inductor_toolchain"):
            assert toolchain.c_shim_declares("_grouped_mm", "cpu")
            assert not toolchain.c_shim_declares("_grouped_mm", "cuda")
            assert not toolchain.c_shim_declares("_grouped_mm", "xpu")
        assert "has no aoti_torch_cuda__grouped_mm" in caplog.text
        assert "has no aoti_torch_xpu__grouped_mm" in caplog.text
    finally:
        toolchain.c_shim_declares.cache_clear()


def test_compute_weights_backward_leaves_the_gradients_loss_backward_leaves() -> None:
    """`ComputeWeights.backward` (gradients handed back by autograd, none stored on the copies) ends in
    the same float32 gradients, bit for bit, as `loss.backward()`: the copied masters', a parameter kept
    out of the copies (its own dtype, as the critic's value head), over micro-batches of which one
    reaches part of the model only."""
    torch.manual_seed(0)
    inputs = [torch.randn(5, 3, dtype=torch.float64) for _ in range(3)]

    def gradients(through_compute: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        compute = ComputeWeights(model, dtype=torch.float64, keep=("1",))
        compute.refresh()
        for i, x in enumerate(inputs):
            with compute.swapped_in():
                hidden = model[0](x) if i < 2 else x[:, :1].expand(5, 4)  # the last: model[1] only
                loss = model[1](hidden.float()).square().sum()
                compute.backward(loss) if through_compute else loss.backward()
            compute.accumulate_grads()
        return {name: p.grad for name, p in model.named_parameters()}

    want, got = gradients(False), gradients(True)
    assert want.keys() == got.keys() == {"0.weight", "0.bias", "1.weight", "1.bias"}
    for name in want:
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want[name]), name
