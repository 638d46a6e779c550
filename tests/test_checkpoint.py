"""CheckpointManager on its own: layout, exact round trip, atomicity, full disk, retention, resume modes."""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from fulcrum.models.tiny import build_tiny_model
from fulcrum.models.value_head import CriticModel
from fulcrum.trainer.checkpoint import (
    LATEST_FILE,
    CheckpointError,
    CheckpointManager,
    DiskFullError,
    read_latest_step,
)
from fulcrum.trainer.checkpoint import manager as ckpt_mod
from fulcrum.trainer.checkpoint.rng import capture_rng_state, restore_rng_state
from fulcrum.trainer.run_dir import trim_metrics_log
from fulcrum.workers.optim import build_lr_scheduler, build_optimizer

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}
OPTIM = SimpleNamespace(lr=1e-3, lr_warmup_steps=2, warmup_style="cosine", min_lr_ratio=0.1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, intermediate_size=64, **TINY)


def make_roles(model_dir: Path, seed: int) -> dict[str, SimpleNamespace]:
    """An actor (causal LM) and a critic (backbone + value head), each with AdamW and a warm-up schedule."""
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    critic = CriticModel(AutoModel.from_pretrained(model_dir, dtype=torch.float32))
    roles = {}
    for name, model in (("actor", actor), ("critic", critic)):
        optimizer = build_optimizer(model.parameters(), OPTIM, torch.device("cpu"))
        scheduler = build_lr_scheduler(optimizer, OPTIM, total_steps=10, key=f"{name}.optim")
        roles[name] = SimpleNamespace(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, tokenizer=tokenizer
        )
    return roles


def train_step(roles: dict[str, SimpleNamespace]) -> list[float]:
    """One update of both roles on random tokens drawn from the global RNG; returns the two losses."""
    ids = torch.randint(0, 200, (2, 8))
    dropout_like = float(np.random.rand()) + random.random()  # numpy and python RNG must be restored too
    losses = []
    for name, role in roles.items():
        out = role.model(input_ids=ids)
        pred = out.logits if name == "actor" else out
        loss = pred.float().pow(2).mean() * (1 + dropout_like)
        role.optimizer.zero_grad()
        loss.backward()
        role.optimizer.step()
        role.lr_scheduler.step()
        losses.append(loss.item())
    return losses


def test_save_writes_layout_loadable_without_pickle(tmp_path: Path, model_dir: Path) -> None:
    roles = make_roles(model_dir, seed=1)
    train_step(roles)
    state = {"epoch": 0, "dataloader": {"epoch": 0, "position": 1, "seed": 1}, "kl_ctrl": {"value": 0.001}}
    path = CheckpointManager(tmp_path, {"resume_mode": "auto"}).save(1, roles, state)
    assert path == tmp_path / "global_step_1"
    assert read_latest_step(tmp_path) == 1 and (tmp_path / LATEST_FILE).read_text().strip() == "1"
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
    for role in ("actor", "critic"):
        assert (path / role / "config.json").is_file() and list((path / role).glob("*.safetensors"))
        assert (path / role / "tokenizer_config.json").is_file()
        for name in ("optimizer.pt", "lr_scheduler.pt"):
            torch.load(path / role / name, weights_only=True)  # raises if anything needs unpickling
    torch.load(path / "rng_state.pt", weights_only=True)
    saved = json.loads((path / "trainer_state.json").read_text())
    assert (
        saved["global_step"] == 1
        and saved["dataloader"] == state["dataloader"]
        and saved["kl_ctrl"]["value"] == 0.001
    )


def test_resume_continues_bit_identically(tmp_path: Path, model_dir: Path) -> None:
    roles = make_roles(model_dir, seed=1)
    for _ in range(2):
        train_step(roles)
    manager = CheckpointManager(tmp_path, {"resume_mode": "auto"})
    manager.save(2, roles, {"epoch": 0})
    expected = [train_step(roles) for _ in range(2)]
    expected_lr = roles["actor"].lr_scheduler.get_last_lr()

    fresh = make_roles(model_dir, seed=99)  # other init, other RNG: all of it must come from the checkpoint
    torch.manual_seed(1234)
    np.random.seed(5)
    random.seed(5)
    state = manager.resume(fresh)
    assert state is not None and state["global_step"] == 2 and state["epoch"] == 0
    got = [train_step(fresh) for _ in range(2)]
    assert got == expected  # bit-identical on the CPU
    assert fresh["actor"].lr_scheduler.get_last_lr() == expected_lr
    for name in roles:
        for (k, a), (_, b) in zip(
            roles[name].model.state_dict().items(), fresh[name].model.state_dict().items(), strict=True
        ):
            assert torch.equal(a, b), f"{name}.{k} differs after resume"


def test_interrupted_save_is_ignored_and_cleaned(tmp_path: Path, model_dir: Path, monkeypatch) -> None:
    roles = make_roles(model_dir, seed=1)
    manager = CheckpointManager(tmp_path, {"resume_mode": "auto"})
    manager.save(1, roles, {"epoch": 0})
    train_step(roles)

    def crash(obj, path):  # the process dies after part of the new checkpoint is on disk
        path.write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_mod, "_save_torch", crash)
    with pytest.raises(KeyboardInterrupt):
        manager.save(2, roles, {"epoch": 0})
    monkeypatch.undo()
    assert not (tmp_path / "global_step_2").exists() and read_latest_step(tmp_path) == 1
    # A SIGKILLed writer cannot clean up: its temp folder stays behind with a dead pid.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"global_step_3.tmp-{dead.pid}"
    (stale / "actor").mkdir(parents=True)
    state = CheckpointManager(tmp_path, {"resume_mode": "auto"}).resume(make_roles(model_dir, seed=2))
    assert state is not None and state["global_step"] == 1
    assert not stale.exists()


def test_full_disk_fails_clearly_and_keeps_previous(tmp_path: Path, model_dir: Path, monkeypatch) -> None:
    roles = make_roles(model_dir, seed=1)
    manager = CheckpointManager(tmp_path, {"resume_mode": "auto"})
    manager.save(1, roles, {"epoch": 0})
    before = {
        p.relative_to(tmp_path): p.read_bytes()
        for p in (tmp_path / "global_step_1").rglob("*")
        if p.is_file()
    }
    train_step(roles)

    def no_space(obj, path):
        path.write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(ckpt_mod, "_save_torch", no_space)
    with pytest.raises(DiskFullError) as info:
        manager.save(2, roles, {"epoch": 0})
    message = str(info.value)
    assert "global_step_2" in message and str(tmp_path) in message and "MiB free" in message
    assert "global_step_1" in message  # says which checkpoint is still good
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", LATEST_FILE]
    after = {
        p.relative_to(tmp_path): p.read_bytes()
        for p in (tmp_path / "global_step_1").rglob("*")
        if p.is_file()
    }
    assert after == before and read_latest_step(tmp_path) == 1


def test_retention_keeps_newest_per_role(tmp_path: Path, model_dir: Path) -> None:
    roles = make_roles(model_dir, seed=1)
    manager = CheckpointManager(tmp_path, {"max_actor_ckpt_to_keep": 2, "max_critic_ckpt_to_keep": 1})
    for step in range(1, 5):
        manager.save(step, roles, {"epoch": 0})
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_3", "global_step_4"]
    assert (tmp_path / "global_step_3" / "actor").is_dir() and not (
        tmp_path / "global_step_3" / "critic"
    ).exists()
    assert (tmp_path / "global_step_4" / "critic").is_dir()
    # auto resume wants both roles: only step 4 has them.
    assert manager.resume(make_roles(model_dir, seed=2))["global_step"] == 4
    # an actor-only resume (e.g. GRPO) may use step 3
    path = CheckpointManager(
        tmp_path, {"resume_mode": "resume_path", "resume_from_path": str(tmp_path / "global_step_3")}
    )
    assert path.resume({"actor": make_roles(model_dir, seed=2)["actor"]})["global_step"] == 3


def test_resume_modes_and_their_errors(tmp_path: Path, model_dir: Path) -> None:
    roles = make_roles(model_dir, seed=1)
    assert (
        CheckpointManager(tmp_path, {"resume_mode": "auto"}).resume(roles) is None
    )  # nothing yet: fresh start
    CheckpointManager(tmp_path, None).save(3, roles, {"epoch": 1})
    assert CheckpointManager(tmp_path, {"resume_mode": "disable"}).resume(roles) is None
    by_path = {"resume_mode": "resume_path", "resume_from_path": str(tmp_path / "global_step_3")}
    actor_only = tmp_path / "grpo"
    CheckpointManager(actor_only, None).save(1, {"actor": roles["actor"]}, {})
    with pytest.raises(CheckpointError, match="none with critic"):  # not a silent fresh start over them
        CheckpointManager(actor_only, {"resume_mode": "auto"}).resume(roles)
    assert CheckpointManager(tmp_path / "other", by_path).resume(roles)["global_step"] == 3

    missing = tmp_path / "global_step_7"
    with pytest.raises(CheckpointError, match=str(missing)):
        CheckpointManager(tmp_path, {"resume_mode": "resume_path", "resume_from_path": str(missing)}).resume(
            roles
        )
    incomplete = tmp_path / "global_step_8"
    (incomplete / "actor").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="incomplete"):
        CheckpointManager(
            tmp_path, {"resume_mode": "resume_path", "resume_from_path": str(incomplete)}
        ).resume(roles)
    with pytest.raises(CheckpointError, match="resume_from_path"):
        CheckpointManager(tmp_path, {"resume_mode": "resume_path"})
    with pytest.raises(CheckpointError, match="resume_mode"):
        CheckpointManager(tmp_path, {"resume_mode": "latest"})
    truncated = tmp_path / "global_step_3" / "actor" / "optimizer.pt"
    truncated.write_bytes(truncated.read_bytes()[:10])
    with pytest.raises(CheckpointError, match="truncated"):
        CheckpointManager(tmp_path, by_path).resume(roles)


def test_refuses_corrupt_weights_and_non_json_state(tmp_path: Path, model_dir: Path) -> None:
    roles = make_roles(model_dir, seed=1)
    manager = CheckpointManager(tmp_path, None)
    with pytest.raises(CheckpointError, match=r"trainer_state\.loader\.gen"):
        manager.save(1, roles, {"loader": {"gen": object()}})
    with torch.no_grad():
        next(roles["critic"].model.score.parameters()).fill_(float("nan"))
    with pytest.raises(CheckpointError, match=r"score\.weight.*NaN"):
        manager.save(1, roles, {})
    assert not list(tmp_path.glob("global_step_*"))


def test_trim_metrics_log_drops_steps_after_the_checkpoint_in_place(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "val-core/x/reward/mean@1": 0.1}] + [
        {"step": s, "training/global_step": s, "actor/pg_loss": 0.5} for s in (1, 2, 3)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "training/glo')
    appender = path.open("a")  # the logger's handle, opened before the resume
    assert trim_metrics_log(path, 2) == 2
    appender.write(json.dumps({"step": 3, "training/global_step": 3}) + "\n")
    appender.close()
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [0, 1, 2, 3]
    assert trim_metrics_log(tmp_path / "absent.jsonl", 2) == 0


@pytest.mark.gpu
def test_cuda_rng_state_is_captured_and_restored() -> None:
    torch.cuda.manual_seed_all(3)
    state = capture_rng_state()
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed_all(4)
    restore_rng_state(state)
    assert torch.equal(torch.rand(4, device="cuda"), expected)


def test_auto_skips_damaged_checkpoints_naming_why_and_resume_path_says_what_is_wrong(
    tmp_path: Path, model_dir: Path
) -> None:
    roles = make_roles(model_dir, seed=1)
    manager = CheckpointManager(tmp_path, {"resume_mode": "auto"})
    for step in (1, 2, 3, 4):
        manager.save(step, roles, {"epoch": 0})
    manifest = json.loads((tmp_path / "global_step_1" / "checkpoint.json").read_text())
    entry = manifest["files"]["actor/model.safetensors"]
    assert len(entry["sha256"]) == 64 and entry["bytes"] > 0
    (tmp_path / "global_step_4" / "checkpoint.json").unlink()
    (tmp_path / "global_step_3" / "critic" / "model.safetensors").unlink()
    optimizer = tmp_path / "global_step_2" / "actor" / "optimizer.pt"
    data = bytearray(optimizer.read_bytes())
    data[len(data) // 2] ^= 0x01
    optimizer.write_bytes(bytes(data))

    choice = manager.choose_resume(["actor", "critic"])
    assert choice.path == tmp_path / "global_step_1"
    reasons = {path.name: " ".join(problems) for path, problems in choice.skipped}
    assert "no checkpoint.json" in reasons["global_step_4"]
    assert "critic/model.safetensors: missing" in reasons["global_step_3"]
    assert "optimizer.pt: content differs" in reasons["global_step_2"]
    # An actor-only run does not load the critic: step 3 is intact for it.
    assert manager.choose_resume(["actor"]).path == tmp_path / "global_step_3"

    by_path = {"resume_mode": "resume_path", "resume_from_path": str(tmp_path / "global_step_2")}
    with pytest.raises(CheckpointError, match=r"damaged:\n.*optimizer.pt: content differs"):
        CheckpointManager(tmp_path, by_path).choose_resume(["actor", "critic"])
    (tmp_path / "global_step_1" / "rng_state.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="none is intact") as info:
        manager.choose_resume(["actor", "critic"])
    assert "global_step_1" in str(info.value) and "resume_path" in str(info.value)


def test_set_aside_keeps_newer_checkpoints_and_points_latest_at_the_resumed_one(
    tmp_path: Path, model_dir: Path
) -> None:
    roles = {"actor": make_roles(model_dir, seed=1)["actor"]}
    manager = CheckpointManager(tmp_path, None)
    for step in (1, 2, 3):
        manager.save(step, roles, {})
    moved = manager.set_aside_newer(1)
    assert [p.name.split(".")[0] for p in moved] == ["global_step_2", "global_step_3"]
    assert all(p.is_dir() and (p / "checkpoint.json").is_file() for p in moved)  # renamed, not deleted
    assert read_latest_step(tmp_path) == 1
    assert manager.choose_resume(["actor"]).path == tmp_path / "global_step_1"
