"""Replicated or sharded: the layout each fsdp_size (and a model's size) gives, and the gradients of a
replicated model summed over the ranks in as few collectives as their buffers allow."""

from __future__ import annotations

import torch
from helpers_dist import run_ranks

from fulcrum.config.compat import fsdp_size_note
from fulcrum.parallel.layout import TRAINING_STATE_BYTES, choose_layout, training_state_bytes

H200 = 141 * 10**9


def test_fsdp_size_chooses_the_layout() -> None:
    qwen_05b, qwen_15b = (TRAINING_STATE_BYTES * n for n in (494_032_768, 1_543_714_304))
    assert choose_layout(-1, qwen_05b, H200, False) == "replicated"  # 7.9 GB <= 1/16 of 141 GB
    assert choose_layout(-1, qwen_15b, H200, False) == "sharded"  # 24.7 GB
    assert choose_layout(-1, qwen_05b, None, False) == "sharded"  # the CPU: FSDP as before
    assert choose_layout(1, qwen_15b, H200, False) == "replicated"  # asked for
    assert choose_layout(2, qwen_05b, H200, False) == "sharded"  # asked for (the world size)
    assert choose_layout(32, qwen_05b, H200, False) == "sharded"  # above the world size: verl shards over all
    assert choose_layout(-1, qwen_05b, H200, True) == "sharded"  # param_offload is FSDP's


def test_a_lora_model_counts_its_frozen_base_once_in_its_own_dtype() -> None:
    """Trained parameters count 16 B, frozen ones their own size: a 1.5B LoRA model (a bf16 base, 3.1 GB,
    18 M adapter parameters, 0.3 GB of state) is replicated where its full fine-tuning (24.7 GB) is
    sharded; a 7B LoRA model (15.2 + 1.3 GB) is still above the replicated share (1/16 of 141 GB)."""
    base, adapters = torch.nn.Linear(1000, 1000, bias=False), torch.nn.Linear(100, 100, bias=False)
    base.weight.data = base.weight.data.to(torch.bfloat16)
    base.weight.requires_grad_(False)
    model = torch.nn.ModuleDict({"base": base, "adapters": adapters})
    assert training_state_bytes(model) == 2 * 1000 * 1000 + TRAINING_STATE_BYTES * 100 * 100
    lora_15b = 2 * 1_543_714_304 + TRAINING_STATE_BYTES * 18_000_000
    lora_7b = 2 * 7_615_616_512 + TRAINING_STATE_BYTES * 80_740_352
    assert choose_layout(-1, lora_15b, H200, False) == "replicated"
    assert choose_layout(-1, lora_7b, H200, False) == "sharded"


def test_hybrid_fsdp_size_is_a_note_not_an_error() -> None:
    """verl's recipes set fsdp_size for hybrid sharding (e.g. 32 over 4 nodes of 8); a pasted command
    must run: fulcrum shards over all ranks and says so at start."""
    assert fsdp_size_note(2, 4) == (
        "hybrid sharding over groups of 2 ranks is not supported: fulcrum shards over all 4 ranks "
        "(fsdp_size=1 replicates the model instead)"
    )
    assert [fsdp_size_note(size, 4) for size in (-1, 1, 4, 32)] == [None] * 4
    assert fsdp_size_note(2, 1) is None  # one process


def _reduced(rank: int, world: int) -> list[torch.Tensor]:
    from fulcrum.parallel.layout import all_reduce_gradients

    flat = torch.arange(7, dtype=torch.float32) * (rank + 1)  # two gradients viewing one buffer
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))
    a.grad, b.grad = flat[:3], flat[3:].view(2, 2)
    loose = torch.nn.Parameter(torch.zeros(2))  # a gradient of its own
    loose.grad = torch.full((2,), 10.0 * (rank + 1))
    unused = torch.nn.Parameter(torch.zeros(1))  # no gradient on rank 0, one on rank 1
    if rank == 1:
        unused.grad = torch.ones(1)
    frozen = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    all_reduce_gradients([a, b, loose, unused, frozen])
    assert a.grad._base is flat  # reduced in place, still views of the buffer
    return [a.grad, b.grad, loose.grad, unused.grad]


def test_replicated_gradients_are_summed_over_the_ranks() -> None:
    for got in run_ranks(_reduced, 2):
        assert torch.equal(got[0], torch.arange(3.0) * 3)
        assert torch.equal(got[1], torch.arange(3.0, 7.0).view(2, 2) * 3)
        assert torch.equal(got[2], torch.full((2,), 30.0))
        assert torch.equal(got[3], torch.ones(1))


def _worker_layouts(rank: int, world: int, model_dir: str) -> list[tuple[str | None, bool]]:
    from torch.distributed.tensor import DTensor

    from fulcrum.config import load_config
    from fulcrum.config.sections import actor_section
    from fulcrum.workers.actor import ActorWorker

    out = []
    for size in (1, 2):
        cfg = load_config(
            [
                f"actor_rollout_ref.model.path={model_dir}",
                f"critic.model.path={model_dir}",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                f"actor_rollout_ref.actor.fsdp_config.fsdp_size={size}",
                "trainer.n_gpus_per_node=2",
            ]
        )
        worker = ActorWorker(actor_section(cfg), torch.device("cpu"), total_training_steps=1)
        weight = worker.model.get_input_embeddings().weight
        out.append((worker.placement.layout, isinstance(weight, DTensor)))
    return out


def test_the_actor_worker_lays_its_model_out_as_fsdp_size_says(tmp_path) -> None:
    from fulcrum.models.tiny import build_tiny_model

    model_dir = str(build_tiny_model(tmp_path / "tiny", arch="qwen2", seed=0))
    for layouts in run_ranks(_worker_layouts, 2, model_dir):
        assert layouts == [("replicated", False), ("sharded", True)]
