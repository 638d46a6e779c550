"""Checkpoints across world sizes: 2 FSDP ranks write the one-process checkpoint (a Hugging Face folder
and a whole optimiser state, from rank 0), and it resumes on 2 ranks or on 1 process; a one-process
checkpoint resumes on 2 ranks."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers_dist import run_ranks
from test_checkpoint import OPTIM, TINY, make_roles, train_step
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from fulcrum.models.tiny import build_tiny_model
from fulcrum.models.value_head import CriticModel
from fulcrum.parallel.fsdp import name_keyed_optimizer_state
from fulcrum.trainer.checkpoint import CheckpointManager
from fulcrum.workers.optim import build_lr_scheduler, build_optimizer

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, intermediate_size=64, **TINY)


def sharded_roles(model_dir: Path, seed: int) -> dict[str, SimpleNamespace]:
    """make_roles' actor and critic, sharded by FSDP before their optimisers are built."""
    from fulcrum.parallel.fsdp import shard_model

    torch.manual_seed(seed)
    actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    critic = CriticModel(AutoModel.from_pretrained(model_dir, dtype=torch.float32))
    roles = {}
    for name, model in (("actor", actor), ("critic", critic)):
        shard_model(model, CPU)
        optimizer = build_optimizer(model.parameters(), OPTIM, CPU)
        scheduler = build_lr_scheduler(optimizer, OPTIM, total_steps=10, key=f"{name}.optim")
        roles[name] = SimpleNamespace(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            tokenizer=AutoTokenizer.from_pretrained(model_dir),
        )
    return roles


def whole_state(roles: dict) -> dict:
    """Every role's whole weights and name-keyed optimiser state (rank 0; collectives on every rank)."""
    from fulcrum.parallel.fsdp import full_optimizer_state_dict, full_state_dict, is_sharded

    out = {}
    for name, role in roles.items():
        if is_sharded(role.model):
            weights, optim = (
                full_state_dict(role.model),
                full_optimizer_state_dict(role.model, role.optimizer),
            )
        else:
            weights = role.model.state_dict()
            optim = name_keyed_optimizer_state(role.optimizer.state_dict(), role.model)
        out[name] = {"weights": weights, "optim": optim, "schedule": role.lr_scheduler.state_dict()}
    return out


def _two_ranks(rank: int, world: int, model_dir: Path, run_dir: Path, one_process_ckpt: Path) -> dict:
    import copy

    from fulcrum.parallel import on_main
    from fulcrum.trainer.checkpoint.sharded import gather_roles

    torch.set_num_threads(1)
    roles = sharded_roles(model_dir, seed=0)
    train_step(roles)
    saved = copy.deepcopy(whole_state(roles))
    manager = CheckpointManager(run_dir)
    gathered = gather_roles(roles)
    path = on_main(lambda: manager.save(2, gathered, {"epoch": 0}))
    resumed = sharded_roles(model_dir, seed=1)
    manager.load(path, resumed)
    from_one = sharded_roles(model_dir, seed=2)
    CheckpointManager(one_process_ckpt.parent).load(one_process_ckpt, from_one)
    return {"saved": saved, "resumed": whole_state(resumed), "from_one": whole_state(from_one), "path": path}


def assert_same(a: dict, b: dict) -> None:
    for role in ("actor", "critic"):
        for name, tensor in a[role]["weights"].items():
            torch.testing.assert_close(b[role]["weights"][name], tensor, atol=0, rtol=0, msg=name)
        for name, moments in a[role]["optim"]["state"].items():
            for key, value in moments.items():
                torch.testing.assert_close(b[role]["optim"]["state"][name][key], value, atol=0, rtol=0)
        assert b[role]["schedule"] == a[role]["schedule"]


def test_checkpoints_move_between_one_and_two_ranks(model_dir: Path, tmp_path: Path) -> None:
    torch.manual_seed(3)
    single = make_roles(model_dir, seed=3)
    train_step(single)
    one_process_ckpt = CheckpointManager(tmp_path / "one").save(1, single, {"epoch": 0})
    rank0, _ = run_ranks(_two_ranks, 2, model_dir, tmp_path / "two", one_process_ckpt)
    assert_same(rank0["saved"], rank0["resumed"])  # 2 ranks -> 2 ranks
    assert_same(whole_state(single), rank0["from_one"])  # 1 process -> 2 ranks
    resumed = make_roles(model_dir, seed=4)
    CheckpointManager(tmp_path / "two").load(rank0["path"], resumed)
    assert_same(rank0["saved"], whole_state(resumed))  # 2 ranks -> 1 process
    # the actor folder is a plain Hugging Face model (what `fulcrum export` copies)
    exported = AutoModelForCausalLM.from_pretrained(rank0["path"] / "actor", dtype=torch.float32)
    for name, tensor in exported.state_dict().items():
        torch.testing.assert_close(tensor, rank0["saved"]["actor"]["weights"][name], atol=0, rtol=0)
