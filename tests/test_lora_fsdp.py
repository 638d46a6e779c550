"""A LoRA actor sharded by FSDP2 over 2 gloo processes trains as one process does, and its checkpoint
(the adapters and their optimiser state, gathered to rank 0) resumes in one process."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers_dist import run_ranks
from test_lora import CPU, cfg_for, rl_batch

from fulcrum.config.sections import actor_section
from fulcrum.trainer.checkpoint import CheckpointManager
from fulcrum.workers.actor import ActorWorker

STEPS = 3  # updates before the checkpoint; one more after it
# Summing two ranks' gradient shares changes them by a few ulps; Adam's first steps turn that into
# ~1e-6 on the adapters (see test_parallel_fsdp.WEIGHT_ATOL); a lost or wrong shard moves them by ~lr.
ATOL = 1e-4


def new_actor(model_dir: str) -> ActorWorker:
    """The LoRA actor with seeded adapters (peft draws A at random; every rank draws the same)."""
    torch.manual_seed(0)
    return ActorWorker(actor_section(cfg_for(model_dir)), CPU, total_training_steps=STEPS + 1)


def train(actor: ActorWorker, steps: range) -> list[float]:
    """PPO updates on fixed batches (old log-probs from the actor itself); each step's pg_loss."""
    losses = []
    for step in steps:
        batch = rl_batch(seed=step)
        batch["old_log_probs"], _ = actor.compute_log_prob(batch)
        losses.append(actor.update_policy(batch, global_step=step)[0]["actor/pg_loss"])
    return losses


def after(actor: ActorWorker) -> dict:
    """The adapters (whole) and the log-probs of a held-out batch."""
    logp, _ = actor.compute_log_prob(rl_batch(seed=99))
    return {"adapters": actor.adapters.state_dict(), "logp": logp}


def _sharded(rank: int, world: int, model_dir: str, run_dir: Path) -> dict:
    from fulcrum.parallel import on_main
    from fulcrum.parallel.fsdp import is_sharded
    from fulcrum.trainer.checkpoint.sharded import gather_roles

    torch.set_num_threads(1)
    actor = new_actor(model_dir)
    assert is_sharded(actor.model)
    losses = train(actor, range(1, STEPS + 1))
    saved = after(actor)
    gathered = gather_roles({"actor": actor})
    path = on_main(lambda: CheckpointManager(run_dir).save(STEPS, gathered, {"epoch": 0}))
    losses += train(actor, range(STEPS + 1, STEPS + 2))
    return {"losses": losses, "saved": saved, "final": after(actor), "path": path}


def assert_close(a: dict, b: dict) -> None:
    assert set(a["adapters"]) == set(b["adapters"])
    for name, tensor in a["adapters"].items():
        torch.testing.assert_close(b["adapters"][name], tensor, atol=ATOL, rtol=1e-4, msg=name)
    torch.testing.assert_close(b["logp"], a["logp"], atol=ATOL, rtol=1e-4)


def test_sharded_lora_trains_as_one_process_and_resumes_in_one(tiny_dir: str, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    single = new_actor(tiny_dir)
    losses = train(single, range(1, STEPS + 1))
    saved = after(single)
    losses += train(single, range(STEPS + 1, STEPS + 2))
    final = after(single)

    rank0, rank1 = run_ranks(_sharded, 2, tiny_dir, tmp_path / "two")
    torch.testing.assert_close(torch.tensor(rank0["losses"]), torch.tensor(losses), atol=1e-5, rtol=0)
    assert_close(saved, rank0["saved"])
    assert_close(final, rank0["final"])
    assert_close(rank0["final"], rank1["final"])  # the ranks agree
    assert any((t.abs() > 0).any() for n, t in saved["adapters"].items() if "lora_B" in n)  # B moved

    # The 2-rank checkpoint holds the adapters only, and resumes in one process: the same next step.
    actor_dir = rank0["path"] / "actor"
    assert (actor_dir / "adapter_model.safetensors").is_file() and not list(actor_dir.glob("model*"))
    resumed = new_actor(tiny_dir)
    CheckpointManager(tmp_path / "two").load(rank0["path"], {"actor": resumed})
    assert_close(rank0["saved"], after(resumed))
    torch.testing.assert_close(
        torch.tensor(train(resumed, range(STEPS + 1, STEPS + 2))),
        torch.tensor(losses[-1:]),
        atol=1e-5,
        rtol=0,
    )
    assert_close(rank0["final"], after(resumed))
