"""A LoRA critic sharded by FSDP2 over 2 gloo processes keeps its value head in its checkpoint: the
adapters and the value head (`score`, trained whole) gathered to rank 0, and nothing of the frozen
base; the checkpoint resumes in one process with the same value head."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers_dist import run_ranks
from test_lora import CPU, cfg_for, rl_batch

from fulcrum.config.sections import critic_section
from fulcrum.trainer.checkpoint import CheckpointManager
from fulcrum.workers.critic import CriticWorker

STEPS = 2
VALUE_HEAD = ("score.weight", "score.bias")


def new_critic(model_dir: str) -> CriticWorker:
    """The LoRA critic with seeded adapters and value head (every rank draws the same)."""
    torch.manual_seed(0)
    cfg = cfg_for(model_dir, "critic.model.lora_rank=4", "critic.model.lora_alpha=8", "critic.optim.lr=1e-2")
    return CriticWorker(critic_section(cfg), CPU, total_training_steps=STEPS)


def value_batch(seed: int):
    """A batch with old values and returns, for a value update."""
    batch = rl_batch(seed)
    g = torch.Generator().manual_seed(seed + 2)
    mask = batch["response_mask"].float()
    batch["values"] = torch.zeros(mask.shape)
    batch["returns"] = (torch.randn(mask.shape, generator=g) + 3.0) * mask
    return batch


def value_head(critic: CriticWorker) -> dict[str, torch.Tensor]:
    """The value head's whole tensors (gathered on every rank when sharded)."""
    out = {}
    for name, param in critic.model.named_parameters():
        if name in VALUE_HEAD:
            whole = param.full_tensor() if hasattr(param, "full_tensor") else param
            out[name] = whole.detach().cpu().clone()
    return out


def _sharded(rank: int, world: int, model_dir: str, run_dir: Path) -> dict:
    from fulcrum.parallel import on_main
    from fulcrum.parallel.fsdp import is_sharded
    from fulcrum.trainer.checkpoint.sharded import gather_roles

    torch.set_num_threads(1)
    critic = new_critic(model_dir)
    assert is_sharded(critic.model)
    initial = value_head(critic)
    for step in range(1, STEPS + 1):
        critic.update_critic(value_batch(step), global_step=step)
    gathered = gather_roles({"critic": critic})
    gathered_names = sorted(gathered["critic"].model.state_dict())
    path = on_main(lambda: CheckpointManager(run_dir).save(STEPS, gathered, {"epoch": 0}))
    resumed = new_critic(model_dir)  # and back into 2 ranks' shards
    CheckpointManager(run_dir).load(path, {"critic": resumed})
    return {
        "initial": initial,
        "saved": value_head(critic),
        "resumed": value_head(resumed),
        "path": path,
        "gathered": gathered_names,
    }


def test_sharded_lora_critic_checkpoint_keeps_the_value_head(tiny_dir: str, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    rank0, rank1 = run_ranks(_sharded, 2, tiny_dir, tmp_path / "run")
    assert not torch.equal(rank0["saved"]["score.bias"], rank0["initial"]["score.bias"])  # it trained
    for rank in (rank0, rank1):  # resumed in 2 processes
        for name, tensor in rank0["saved"].items():
            torch.testing.assert_close(rank["resumed"][name], tensor, atol=0, rtol=0, msg=name)

    critic_dir = rank0["path"] / "critic"
    assert (critic_dir / "trained_weights.safetensors").is_file()
    resumed = new_critic(tiny_dir)
    CheckpointManager(tmp_path / "run").load(rank0["path"], {"critic": resumed})
    for name, tensor in rank0["saved"].items():
        torch.testing.assert_close(value_head(resumed)[name], tensor, atol=0, rtol=0, msg=name)
    # Only what is written is gathered: no frozen base weight reaches rank 0.
    assert not any(
        ".base_layer." in name or name.endswith("embed_tokens.weight") for name in rank0["gathered"]
    )
