"""On a CUDA device: the packed bf16 path (varlen attention, bf16 compute weights, chunked LM head)
against the padded float32 path on the CPU. Tolerances are bf16's: log-probs within 0.02 on average
(max 0.25), values within 2% of their spread, gradients pointing the same way (cosine > 0.99)."""

from __future__ import annotations

import pytest
import torch
from helpers import log_probs_of, ppo_loss, values_of
from test_workers_units import make_batch  # tests/ is on sys.path under pytest

from fulcrum.batch import Batch
from fulcrum.models.value_head import CriticModel
from fulcrum.rollout.testing import random_causal_lm
from fulcrum.workers.forwards import LogProbHead, ModelForwards, ValueHead
from fulcrum.workers.micro_batch import make_micro_batches

pytestmark = pytest.mark.gpu
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
SHAPE = dict(
    vocab_size=32000, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8
)
# Qwen3-MoE at that size: 8 experts (2 a token) on every layer but one dense one.
MOE_SHAPE = dict(
    SHAPE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, mlp_only_layers=[1], head_dim=32
)


def batch_for(vocab: int):
    batch = make_batch(b=12, p=40, r=30, seed=1)
    g = torch.Generator().manual_seed(2)
    batch.tensors["input_ids"] = torch.randint(3, vocab, batch["input_ids"].shape, generator=g)
    batch.tensors["responses"] = batch["input_ids"][:, 40:].clone()
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=g)
    batch["old_log_probs"] = torch.full(batch["responses"].shape, -10.0)
    return batch


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.float().flatten().cpu() for p in model.parameters() if p.grad is not None])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_bf16_log_probs_and_gradients_match_padded_fp32() -> None:
    cpu_model = random_causal_lm("qwen2", seed=0, init_std=0.05, **SHAPE).train()
    gpu_model = random_causal_lm("qwen2", seed=0, init_std=0.05, **SHAPE).to(CUDA).train()
    batch = batch_for(SHAPE["vocab_size"])
    mask = batch["response_mask"]

    logp_ref, _ = log_probs_of(cpu_model, batch, 0.9, False, CPU)
    ppo_loss(batch["old_log_probs"], logp_ref, batch["advantages"], mask.float())[0].backward()

    forwards = ModelForwards(gpu_model, CUDA, use_remove_padding=True, role="actor")
    assert forwards.packed and forwards.compute is not None
    with forwards.active():
        (logp,) = forwards.forward(forwards.inputs(batch, []), LogProbHead(0.9))
        forwards.backward(
            ppo_loss(
                batch["old_log_probs"].to(CUDA), logp, batch["advantages"].to(CUDA), mask.float().to(CUDA)
            )[0]
        )
        forwards.accumulate_grads()
    diff = (logp.cpu() - logp_ref.detach()).abs()[mask.bool()]
    assert diff.mean() < 0.02 and diff.max() < 0.25, (diff.mean(), diff.max())
    g_ref, g = flat_grad(cpu_model), flat_grad(gpu_model)
    assert torch.nn.functional.cosine_similarity(g_ref, g, dim=0) > 0.99


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_bf16_values_match_padded_fp32() -> None:
    torch.manual_seed(0)
    cpu_model = CriticModel(random_causal_lm("qwen2", seed=0, init_std=0.05, **SHAPE).model).eval()
    gpu_model = CriticModel(random_causal_lm("qwen2", seed=0, init_std=0.05, **SHAPE).model.to(CUDA)).eval()
    gpu_model.load_state_dict(cpu_model.state_dict())
    batch = batch_for(SHAPE["vocab_size"])
    forwards = ModelForwards(gpu_model, CUDA, use_remove_padding=True, role="critic", keep=("score",))
    with torch.no_grad(), forwards.active():
        values = forwards.forward(forwards.inputs(batch, []), ValueHead())[0].cpu()
        ref = values_of(cpu_model, batch, CPU)
    mask = batch["response_mask"].bool()
    spread = ref[mask].std()
    assert ((values - ref).abs()[mask].max() / spread) < 0.02 * 10 and (
        (values - ref).abs()[mask].mean() / spread
    ) < 0.02


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("arch", "save_attention", "cpp_wrapper"),
    [("qwen2", True, True), ("qwen2", False, False), ("qwen3_moe", True, True)],
    ids=["default", "recompute-attention", "qwen3-moe"],
)
def test_compiled_checkpointed_layers_match_eager_on_cuda(
    arch: str, save_attention: bool, cpp_wrapper: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's default on CUDA (decoder layers compiled, each checkpointed inside its compiled
    call, the flash kernel's outputs kept by the checkpoint, inductor's C++ wrapper) against the same
    bf16 packed path uncompiled and without checkpointing: the same log-probs and gradients up to bf16
    rounding, over two micro-batches of different token counts (dynamic sizes). Also with attention
    recomputed in the backward (`SAVE_ATTENTION_OUTPUTS` off) under inductor's Python wrapper, and a
    Qwen3-MoE, whose experts call aten's `_grouped_mm`: the C++ wrapper where the installed torch's C
    shim declares it, else the Python wrapper (torch 2.11's lacks it, and its C++ failed to build)."""
    from fulcrum.models import packed

    monkeypatch.setattr(packed, "SAVE_ATTENTION_OUTPUTS", save_attention)
    assert packed.uses_cpp_wrapper(packed.compile_options(cpp_wrapper=cpp_wrapper)) == cpp_wrapper
    torch._dynamo.reset()  # the setting is read while tracing
    shape = MOE_SHAPE if arch == "qwen3_moe" else SHAPE
    results = []
    for compiled in (False, True):
        model = random_causal_lm(arch, seed=0, init_std=0.05, **shape).to(CUDA).train()
        if compiled:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        forwards = ModelForwards(
            model,
            CUDA,
            use_remove_padding=True,
            role="actor",
            use_torch_compile=compiled,
            cpp_wrapper=cpp_wrapper,
        )
        assert getattr(model.model, "fulcrum_checkpoint", False) == compiled
        if arch == "qwen3_moe":  # transformers' experts run F.grouped_mm on bf16 weights under compile
            assert model.config._experts_implementation == "grouped_mm"
            wrapper = packed.c_shim_declares("_grouped_mm", "cuda")
            assert packed.uses_cpp_wrapper(packed.layer_compile_options(model.model, "inductor")) == wrapper
        logps = []
        with forwards.active():
            for b in (12, 7):
                batch = batch_for(SHAPE["vocab_size"]).select(list(range(b)))
                (logp,) = forwards.forward(forwards.inputs(batch, []), LogProbHead(0.9))
                mask = batch["response_mask"].float().to(CUDA)
                forwards.backward(
                    ppo_loss(batch["old_log_probs"].to(CUDA), logp, batch["advantages"].to(CUDA), mask)[0]
                )
                forwards.accumulate_grads()
                logps.append(logp.detach().float().cpu())
        results.append((logps, flat_grad(model)))
    (lp_eager, g_eager), (lp_compiled, g_compiled) = results
    for a, b in zip(lp_eager, lp_compiled, strict=True):
        assert (a - b).abs().mean() < 0.01 and (a - b).abs().max() < 0.1, (
            (a - b).abs().mean(),
            (a - b).abs().max(),
        )
    assert torch.nn.functional.cosine_similarity(g_eager, g_compiled, dim=0) > 0.999


def full_batch(b: int, p: int, r: int, vocab: int):
    """`b` rows of `p` prompt and `r` response tokens, none padded: b × (p + r) packed tokens."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (b, p + r), generator=g)
    return Batch(
        {
            "prompts": ids[:, :p].clone(),
            "responses": ids[:, p:].clone(),
            "input_ids": ids,
            "attention_mask": torch.ones(b, p + r, dtype=torch.long),
            "position_ids": torch.arange(p + r).expand(b, -1).clone(),
            "response_mask": torch.ones(b, r, dtype=torch.long),
            "advantages": torch.randn(b, r, generator=g),
            "old_log_probs": torch.full((b, r), -10.0),
        }
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_python_wrapper_compiles_an_update_once_across_micro_batch_sizes() -> None:
    """With actor_rollout_ref.actor.inductor_cpp_wrapper=false, a checkpointed update's compiled layers
    serve micro-batches on both sides of the size at which inductor's mix-order reduction would fuse
    (5,242,880 elements: 20,480 tokens at hidden 256) without compiling again: that fusion guards on
    the size, and on an H100 it compiled the seed command's critic update twice in its first step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = random_causal_lm("qwen2", seed=0, init_std=0.05, **SHAPE).to(CUDA).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    forwards = ModelForwards(
        model, CUDA, use_remove_padding=True, role="actor", use_torch_compile=True, cpp_wrapper=False
    )
    graphs = []
    with forwards.active():
        for b, r in ((32, 700), (8, 60), (32, 700)):  # 23,680 packed tokens, then 800, then 23,680
            batch = full_batch(b, 40, r, SHAPE["vocab_size"])
            (logp,) = forwards.forward(forwards.inputs(batch, []), LogProbHead(0.9))
            mask = batch["response_mask"].float().to(CUDA)
            forwards.backward(
                ppo_loss(batch["old_log_probs"].to(CUDA), logp, batch["advantages"].to(CUDA), mask)[0]
            )
            forwards.accumulate_grads()
            assert torch.isfinite(logp).all()
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1] == graphs[0] and graphs[2] == graphs[0], graphs


def stream_syncs(fn) -> int:
    """How many times `fn()` made the host wait for the GPU's stream (cudaStreamSynchronize calls)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
    return sum(1 for event in prof.events() if event.name == "cudaStreamSynchronize")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_micro_batches_do_not_make_the_host_wait_for_the_gpu(tiny_dir: str) -> None:
    """Each blocking host-to-device copy waits for the GPU's queue to drain, which leaves it idle while
    the host launches the next micro-batch: the update may wait once per mini-batch (its grad norm),
    not per micro-batch."""
    from test_workers_update import cfg_for, rl_batch

    from fulcrum.config.sections import actor_section
    from fulcrum.workers.actor import ActorWorker

    cfg = cfg_for(
        tiny_dir,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    )
    actor = ActorWorker(actor_section(cfg), CUDA, total_training_steps=10)
    batch = rl_batch()  # 8 rows: one mini-batch, micro-batches of one padded row's token budget
    batch["old_log_probs"] = actor.compute_log_prob(batch)[0]
    actor.update_policy(batch, global_step=1)  # warm-up: allocator and pinned-memory caches
    micro, _ = make_micro_batches(batch, 1, False, None, "micro", packed=actor.forwards.packed)
    assert len(micro) >= 4  # four blocking copies each made 16+ waits before (133 in a seed-size update)
    syncs = stream_syncs(lambda: actor.update_policy(batch, global_step=2))
    assert syncs <= 4, (
        f"{syncs} stream synchronisations in an update of one mini-batch, {len(micro)} micro-batches"
    )
    assert stream_syncs(lambda: actor.compute_log_prob(batch)) <= 2
