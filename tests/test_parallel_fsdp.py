"""FSDP2 over 2 gloo processes takes the one-process optimiser step, and its whole state (weights and
optimiser, gathered to rank 0) resumes on 2 ranks or on 1 process alike."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers_dist import run_ranks
from torch.distributed.fsdp import FSDPModule

from fulcrum.parallel.fsdp import load_full_optimizer_state_dict
from fulcrum.rollout.testing import random_causal_lm

ROWS, LENGTH, LR = 4, 12, 1e-2
CPU = torch.device("cpu")


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (ROWS, LENGTH), generator=generator) for _ in range(2)]


def loss_share(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """This share's summed next-token NLL over the whole batch's token count (ROWS × (LENGTH - 1))."""
    logits = model(input_ids=rows).logits[:, :-1].float()
    nll = -logits.log_softmax(-1).gather(-1, rows[:, 1:, None]).sum()
    return nll / (ROWS * (LENGTH - 1))


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rows: torch.Tensor) -> float:
    from fulcrum.parallel.fsdp import whole_norm

    optimizer.zero_grad(set_to_none=True)
    loss_share(model, rows).backward()
    norm = float(whole_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
    optimizer.step()
    return norm


def _fsdp(rank: int, world: int) -> dict:
    from fulcrum.parallel import rank_share
    from fulcrum.parallel.fsdp import (
        full_optimizer_state_dict,
        full_state_dict,
        load_full_optimizer_state_dict,
        load_full_state_dict,
        shard_model,
    )

    first, second = batches()
    cpu = torch.device("cpu")
    model = shard_model(random_causal_lm("qwen2").train(), cpu)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    norm = step(model, optimizer, torch.stack(rank_share(list(first))))
    # A snapshot: unsharded entries (Adam's step count) alias the live state.
    weights, optim_state = full_state_dict(model), copy.deepcopy(full_optimizer_state_dict(model, optimizer))
    # Resume on 2 ranks: a differently initialised model takes rank 0's whole state.
    restored = shard_model(random_causal_lm("qwen2", seed=5).train(), cpu)
    restored_optimizer = torch.optim.AdamW(restored.parameters(), lr=LR)
    load_full_state_dict(restored, copy.deepcopy(weights) if rank == 0 else {})
    load_full_optimizer_state_dict(
        restored, restored_optimizer, copy.deepcopy(optim_state) if rank == 0 else {}
    )
    norm2 = step(restored, restored_optimizer, torch.stack(rank_share(list(second))))
    return {
        "norm": norm,
        "norm2": norm2,
        "weights": weights,
        "optim": optim_state,
        "after": full_state_dict(restored),
    }


# AdamW's first step moves each weight by about lr * g / |g|: where a gradient is near zero, the few-ulp
# difference that summing two ranks' shares makes in g moves the update by up to ~1e-5 (seen 1.6e-5 with
# torch 2.13's CPU kernels, against steps of 1e-2). A wrong shard or a lost gradient moves it by ~lr.
WEIGHT_ATOL = 1e-4


def test_fsdp_step_equals_one_process_and_resumes_on_any_world_size():
    torch.set_num_threads(1)
    first, second = batches()
    model = random_causal_lm("qwen2").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    norm = step(model, optimizer, first)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    norm2 = step(model, optimizer, second)

    rank0, rank1 = run_ranks(_fsdp, 2)
    assert rank1["weights"] == {} and rank1["optim"] == {}  # gathered to rank 0 only
    assert abs(rank0["norm"] - norm) < 1e-5 and abs(rank0["norm2"] - norm2) < 1e-5
    for name, weight in weights.items():
        torch.testing.assert_close(rank0["weights"][name], weight, atol=WEIGHT_ATOL, rtol=1e-5, msg=name)
    for name, weight in model.state_dict().items():
        torch.testing.assert_close(rank0["after"][name], weight, atol=WEIGHT_ATOL, rtol=1e-5, msg=name)

    # Resume on 1 process from the 2-rank state: the same second step.
    single = random_causal_lm("qwen2", seed=5).train()
    single.load_state_dict(rank0["weights"])
    single_optimizer = torch.optim.AdamW(single.parameters(), lr=LR)
    load_full_optimizer_state_dict(single, single_optimizer, rank0["optim"])
    assert abs(step(single, single_optimizer, second) - norm2) < 1e-5
    for name, weight in model.state_dict().items():
        torch.testing.assert_close(single.state_dict()[name], weight, atol=WEIGHT_ATOL, rtol=1e-5, msg=name)


def packed_like_loss(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """Reaches the root's parameters directly, as the packed forward does: the decoder, then the LM
    head's weight outside any module call."""
    hidden = model.model(input_ids=rows).last_hidden_state[:, :-1]
    logits = torch.nn.functional.linear(hidden, model.lm_head.weight).float()
    nll = -logits.log_softmax(-1).gather(-1, rows[:, 1:, None]).sum()
    return nll / (ROWS * (LENGTH - 1))


def _root_access(rank: int, world: int) -> float:
    from fulcrum.parallel import rank_share
    from fulcrum.parallel.fsdp import run_in_root, shard_model, whole_norm

    model = shard_model(random_causal_lm("qwen2").train(), torch.device("cpu"))
    rows = torch.stack(rank_share(list(batches()[0])))
    run_in_root(model, packed_like_loss, model, rows).backward()
    return float(whole_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))


def test_code_reaching_root_parameters_runs_on_a_sharded_model():
    from fulcrum.parallel.fsdp import run_in_root

    model = random_causal_lm("qwen2").train()
    run_in_root(model, packed_like_loss, model, batches()[0]).backward()  # a plain call without FSDP
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    assert [abs(n - norm) < 1e-5 for n in run_ranks(_root_access, 2)] == [True, True]


def _layer_gathered_after_forward(rank: int, world: int) -> list[bool]:
    from torch.distributed.tensor import DTensor

    from fulcrum.parallel.fsdp import FSDPSettings, shard_model

    gathered = []
    for reshard in (True, False):
        settings = FSDPSettings(reshard_after_forward=reshard)
        model = shard_model(random_causal_lm("qwen2").train(), CPU, settings)
        model(input_ids=batches()[0][:2])
        gathered.append(not isinstance(model.model.layers[0].mlp.up_proj.weight, DTensor))
    return gathered


def test_reshard_after_forward_false_keeps_the_layers_gathered_until_backward():
    """verl's fsdp_config.reshard_after_forward: true frees a layer's gathered weights after its forward
    (the parameter is the DTensor shard again), false keeps them gathered for the backward."""
    assert run_ranks(_layer_gathered_after_forward, 2) == [[False, True], [False, True]]


def packed_step(
    model: torch.nn.Module, rows: list[int], device: torch.device = CPU
) -> tuple[float, dict[str, torch.Tensor]]:
    """A policy-gradient step over the packed path on `rows` of the batch (this rank's share); the loss
    is normalised by the whole batch's token count, so the ranks' gradients sum to one process's."""
    from helpers import log_probs_of
    from test_workers_units import make_batch

    from fulcrum.parallel.fsdp import full_state_dict, whole_norm

    batch = make_batch(b=6, p=10, r=7, seed=3)
    mask = batch["response_mask"].float()
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(4)) * mask
    # Adam's first step is ±lr wherever |grad| >> eps: 1e-3 keeps the sum-order noise of tiny gradients
    # (FSDP's reduction against one process's) within the tolerance.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logp, _ = log_probs_of(model, batch.select(rows), 1.0, False, device, packed=True)
    (-(logp * advantages[rows].to(device)).sum() / mask.sum()).backward()
    norm = float(whole_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
    optimizer.step()
    return norm, full_state_dict(model) if isinstance(model, FSDPModule) else model.state_dict()


def checkpointed_packed_lm() -> torch.nn.Module:
    from fulcrum.models.packed import enable_packed_attention

    model = random_causal_lm("qwen2", vocab_size=1024).train()
    model.gradient_checkpointing_enable({"use_reentrant": False})
    enable_packed_attention(model)
    return model


def _compiled_fsdp_step(rank: int, world: int) -> dict:
    from torch._dynamo.utils import counters

    from fulcrum.models.packed import compile_inside_layers
    from fulcrum.parallel import rank_rows
    from fulcrum.parallel.fsdp import shard_model

    torch._dynamo.reset()
    model = shard_model(checkpointed_packed_lm(), torch.device("cpu"))
    # aot_eager: dynamo and AOTAutograd as inductor sees them (saved tensors, checkpointing folded
    # into the backward graph), without a C++ toolchain's compile time.
    compile_inside_layers(model.model, backend="aot_eager")
    norm, weights = packed_step(model, rank_rows(6))
    return {
        "norm": norm,
        "weights": weights,
        "compiled_frames": counters["frames"]["ok"],
        "graph_breaks": list(counters["graph_break"]),
    }


def test_compiled_layers_under_fsdp_take_the_one_process_step():
    """torch.compile inside each FSDP2 unit (compile_inside_layers, checkpointing in the compiled
    body): 2 gloo ranks take the eager one-process step: grad norm and updated weights within 1e-5."""
    torch.set_num_threads(1)
    norm, weights = packed_step(checkpointed_packed_lm(), list(range(6)))
    rank0, rank1 = run_ranks(_compiled_fsdp_step, 2)
    for out in (rank0, rank1):
        # Compiled frames ran; the CPU attention's data-dependent shapes break the graph (CUDA's varlen
        # kernel does not), FSDP's hooks never do: they run outside the compiled body.
        assert out["compiled_frames"] >= 1
        assert not [reason for reason in out["graph_breaks"] if "FSDP" in reason or "fsdp" in reason]
        assert abs(out["norm"] - norm) < 1e-5
    assert rank0["weights"].keys() == weights.keys()
    for name, weight in weights.items():
        torch.testing.assert_close(rank0["weights"][name], weight, atol=1e-5, rtol=1e-5, msg=name)


def _compiled_fsdp_step_cuda(rank: int, world: int) -> dict:
    from torch._dynamo.utils import counters

    from fulcrum.models.packed import compile_inside_layers
    from fulcrum.parallel import rank_rows
    from fulcrum.parallel.fsdp import shard_model

    cuda = torch.device("cuda", rank)
    steps = []
    for compiled in (False, True):
        model = shard_model(checkpointed_packed_lm().to(cuda), cuda)  # bf16 compute, fp32 masters
        if compiled:
            compile_inside_layers(model.model)  # inductor
        norm, weights = packed_step(model, rank_rows(6), cuda)
        steps.append((norm, {name: w.float().cpu() for name, w in weights.items()}))
    return {"steps": steps, "graph_breaks": list(counters["graph_break"]), "frames": counters["frames"]["ok"]}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_compiled_layers_under_fsdp_on_two_gpus_match_eager_fsdp():
    """On CUDA (varlen attention, inductor) each layer's body compiles inside its FSDP unit (no graph
    break at FSDP's hooks), and the step equals eager FSDP's up to bf16 rounding."""
    for out in run_ranks(_compiled_fsdp_step_cuda, 2, device="cuda"):
        assert out["frames"] >= 1
        assert not [reason for reason in out["graph_breaks"] if "FSDP" in reason or "fsdp" in reason]
        (eager_norm, eager), (norm, weights) = out["steps"]
        assert norm == pytest.approx(eager_norm, rel=1e-2)
        for name, weight in eager.items():
            # Adam moves each weight by about ±lr (1e-3): a sign flipped by bf16 rounding on a tiny
            # gradient moves one element by 2e-3, wrong gradients would move most of them.
            assert (weights[name] - weight).abs().mean() < 1e-4, name


def _fused_skip(rank: int, world: int) -> dict:
    from fulcrum.parallel import rank_share
    from fulcrum.parallel.fsdp import shard_model
    from fulcrum.workers.optim import clip_and_step

    first, second = batches()
    model = shard_model(random_causal_lm("qwen2").train(), CPU)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    loss_share(model, torch.stack(rank_share(list(first)))).backward()
    clip_and_step(model, optimizer, 1.0)

    def shards() -> list[torch.Tensor]:  # this rank's shards of the weights and of Adam's state
        state = [t for s in optimizer.state.values() for t in s.values()]
        return [
            t.to_local().clone() if hasattr(t, "to_local") else t.clone()
            for t in [*model.parameters(), *state]
        ]

    before = shards()
    (loss_share(model, torch.stack(rank_share(list(second)))) * float("nan")).backward()
    norm = float(clip_and_step(model, optimizer, 1.0))
    return {"norm": norm, "same": all(torch.equal(a, b) for a, b in zip(before, shards(), strict=True))}


def test_fused_optimiser_skips_a_nan_step_on_sharded_weights() -> None:
    """The device-side skip (`found_inf`) with FSDP2's DTensor weights: a NaN step changes no rank's shard
    of the weights or of the optimiser's state."""
    for result in run_ranks(_fused_skip, 2):
        assert result["norm"] != result["norm"] and result["same"]  # NaN norm; weights as they were
