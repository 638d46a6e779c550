"""Checkpoints written beside training: the snapshot is what the step had, the files are the ones a
save in the step writes, a failure comes back as the same error, and a cancelled write leaves nothing."""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path

import pytest
import torch
from helpers import make_assets, short_run_overrides
from test_checkpoint import TINY, make_roles, train_step

from fulcrum.models.tiny import build_tiny_model
from fulcrum.trainer.checkpoint import LATEST_FILE, CheckpointManager, DiskFullError, read_latest_step
from fulcrum.trainer.checkpoint import manager as ckpt_mod
from fulcrum.trainer.checkpoint.snapshot import HostBuffers, host_copies
from fulcrum.trainer.main_ppo import main as train_main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, intermediate_size=64, **TINY)


def hold_role_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make every role write wait for the returned event: the test acts while the write is under way."""
    release = threading.Event()
    write_role = ckpt_mod.CheckpointManager._write_role

    def held(role_dir: Path, snap: object) -> None:
        assert release.wait(60), "the test never released the write"
        write_role(role_dir, snap)

    monkeypatch.setattr(ckpt_mod.CheckpointManager, "_write_role", staticmethod(held))
    return release


def weights_of(roles: dict) -> dict[str, dict[str, torch.Tensor]]:
    """Each role's weights now, copied."""
    return {n: {k: v.clone() for k, v in r.model.state_dict().items()} for n, r in roles.items()}


def assert_loads_back(manager: CheckpointManager, path: Path, model_dir: Path, expected: dict) -> None:
    """`path` loaded into fresh roles gives the weights `expected` (from `weights_of`)."""
    fresh = make_roles(model_dir, seed=2)
    manager.load(path, fresh)
    for name, role in fresh.items():
        for key, tensor in role.model.state_dict().items():
            assert torch.equal(tensor, expected[name][key]), f"{path.name}: {name}.{key} is not the saved one"


def file_hashes(ckpt: Path) -> dict[str, str]:
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    return {name: entry["sha256"] for name, entry in manifest["files"].items()}


def test_background_write_holds_the_step_state_and_writes_the_same_files(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    roles = make_roles(model_dir, seed=1)
    train_step(roles)
    now = CheckpointManager(tmp_path / "now", None)
    rng = torch.get_rng_state()
    now.save(1, roles, {"epoch": 0})
    torch.set_rng_state(rng)  # the same generator state for both saves

    release = hold_role_writes(monkeypatch)
    later = CheckpointManager(tmp_path / "later", None)
    path = later.save(1, roles, {"epoch": 0}, background=True)
    assert later.writer.busy and not path.exists()  # the step goes on while the write runs
    expected = weights_of(roles)
    train_step(roles)  # the next step changes weights, moments and generators in place
    release.set()
    later.wait()
    assert read_latest_step(tmp_path / "later") == 1
    assert file_hashes(path) == file_hashes(tmp_path / "now" / "global_step_1")  # byte for byte
    assert_loads_back(later, path, model_dir, expected)


def test_later_saves_copy_into_the_first_saves_host_memory_and_each_holds_its_own_step(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot's host buffers are kept from one save to the next (no new memory to fault in), and
    reusing them never mixes steps: each checkpoint loads back to the weights of the step it was taken
    at, also when the next step trains while its write is held."""
    roles = make_roles(model_dir, seed=1)
    manager = CheckpointManager(tmp_path, None)
    expected = {}
    pointers = []
    for step in (1, 2, 3):
        train_step(roles)
        release = hold_role_writes(monkeypatch)
        manager.save(step, roles, {"epoch": 0}, background=True)
        expected[step] = weights_of(roles)
        pointers.append(sorted(b.data_ptr() for b in manager.host_buffers.buffers.values()))
        train_step(roles)  # changes the live tensors while the write waits
        release.set()
        manager.wait()
        monkeypatch.undo()
    live = {t.data_ptr(): t.nbytes for r in roles.values() for t in r.model.state_dict().values()}
    for role in roles.values():
        for moments in role.optimizer.state.values():
            live |= {moments[k].data_ptr(): moments[k].nbytes for k in ("exp_avg", "exp_avg_sq")}
    assert pointers[0] == pointers[1] == pointers[2]  # the same host memory at every save
    held = sum(b.nbytes for b in manager.host_buffers.buffers.values())
    assert held >= sum(live.values())  # weights and moments, each once
    for step, weights in expected.items():
        assert_loads_back(manager, tmp_path / f"global_step_{step}", model_dir, weights)


def test_the_first_save_copies_into_memory_prepared_beside_the_steps_before_it(
    tmp_path: Path, model_dir: Path
) -> None:
    """`prepare_host_buffers` (called by the trainer after the first step) maps every buffer the first
    background save needs, on a thread: that save allocates nothing, and what it writes is the state of
    its own step, not the zeros of the prepared memory nor the step the plan was made at."""
    roles = make_roles(model_dir, seed=1)
    train_step(roles)  # the optimisers' moments exist from here on
    manager = CheckpointManager(tmp_path, None)
    manager.prepare_host_buffers(roles)
    manager.prepare_host_buffers(roles)  # once per manager: a second call does nothing
    train_step(roles)  # the step after the plan changes every tensor in place
    manager.host_buffers.wait_prepared()
    prepared = {key: buffer.data_ptr() for key, buffer in manager.host_buffers.buffers.items()}
    live = [t for r in roles.values() for t in r.model.state_dict().values()]
    assert len(prepared) >= len({t.data_ptr() for t in live})  # weights (and moments) mapped ahead
    assert all(not buffer.any() for buffer in manager.host_buffers.buffers.values())  # zeroed, not copied
    expected = weights_of(roles)
    path = manager.save(2, roles, {"epoch": 0}, background=True)
    manager.wait()
    assert {k: b.data_ptr() for k, b in manager.host_buffers.buffers.items()} == prepared
    assert_loads_back(manager, path, model_dir, expected)


def test_trainer_prepares_the_first_saves_host_memory_after_its_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[set[str]] = []
    prepare = CheckpointManager.prepare_host_buffers

    def recorded(self: CheckpointManager, roles: dict) -> None:
        calls.append(set(roles))
        prepare(self, roles)

    monkeypatch.setattr(CheckpointManager, "prepare_host_buffers", recorded)
    assets = make_assets(tmp_path)
    run = tmp_path / "run"
    train_main(
        short_run_overrides(assets, run, **{"trainer.total_training_steps": 3, "trainer.save_freq": 3})
    )
    assert calls and calls[0] == {"actor", "critic"}  # asked on the steps without a save, before it
    assert read_latest_step(run) == 3


def test_temporaries_of_two_roles_never_share_a_host_buffer() -> None:
    """A LoRA role's adapter state is made of copies that die after its snapshot; the next role's copies
    of the same shapes often get their memory. Each snapshot must still hold its own role's values."""
    live = {role: [torch.randn(4, 32) for _ in range(16)] for role in ("actor", "critic")}
    buffers = HostBuffers()
    for _ in range(100):
        snaps = {
            role: host_copies({i: t.to("cpu", copy=True) for i, t in enumerate(tensors)}, buffers=buffers)
            for role, tensors in live.items()
        }
        buffers.finish()
        for role, tensors in live.items():
            assert all(torch.equal(snaps[role][i], t) for i, t in enumerate(tensors)), role


def test_a_save_and_its_plan_read_the_state_after_before_reading_state(
    tmp_path: Path, model_dir: Path
) -> None:
    """The hook a trainer that parks optimiser state sets: called before the plan of the first save's
    buffers and before every save reads the roles, whose state it may change (here: zeroes a moment)."""
    roles = make_roles(model_dir, seed=1)
    train_step(roles)  # the optimisers' moments exist from their first step
    manager = CheckpointManager(tmp_path, None)
    calls = []

    def bring_back() -> None:
        calls.append(len(calls))
        for state in roles["actor"].optimizer.state.values():
            state["exp_avg"].zero_()

    manager.before_reading_state = bring_back
    manager.prepare_host_buffers(roles)
    manager.prepare_host_buffers(roles)  # once only
    assert calls == [0]
    manager.save(1, roles, {"epoch": 0}, background=True)
    manager.wait()
    assert calls == [0, 1]
    saved = torch.load(tmp_path / "global_step_1" / "actor" / "optimizer.pt", weights_only=True)["state"]
    assert saved and all(not entry["exp_avg"].any() for entry in saved.values())


def test_a_tensor_that_moves_between_saves_keeps_its_host_buffer() -> None:
    """A save copies into the memory the previous save used, mapped already, even when the tensor was
    re-allocated in between (optimiser state parked off the device and brought back)."""
    buffers = HostBuffers()
    state = {"exp_avg": torch.randn(64, 64), "exp_avg_sq": torch.rand(64, 64)}
    places = []
    for _ in range(3):
        buffers.begin_role("critic")
        snap = host_copies(state, buffers=buffers)
        buffers.finish()
        assert all(torch.equal(snap[k], v) for k, v in state.items())
        places.append({k: t.data_ptr() for k, t in snap.items()})
        state = {k: v * 2 for k, v in state.items()}  # the same tensors at new addresses
    assert places[0] == places[1] == places[2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_snapshot_of_cuda_tensors_holds_their_values_while_training_changes_them() -> None:
    """The copy into a kept host buffer is complete when the snapshot returns: a step launched right
    after (in place, on the same stream) does not reach it, at the first save or a later one."""
    live = {"w": torch.randn(4096, 1024, device="cuda"), "b": torch.randn(1024, device="cuda")}
    buffers = HostBuffers()
    for _ in range(2):
        expected = {k: v.cpu() for k, v in live.items()}
        snap = host_copies(live, buffers=buffers)
        buffers.finish()
        for v in live.values():
            v.mul_(2.0).add_(1.0)  # the next step
        torch.cuda.synchronize()
        assert all(torch.equal(snap[k], expected[k]) for k in live)


def test_a_full_disk_in_the_background_is_the_same_error_at_the_next_save_and_publishes_nothing(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    roles = make_roles(model_dir, seed=1)
    manager = CheckpointManager(tmp_path, None)
    manager.save(1, roles, {"epoch": 0}, background=True)
    manager.wait()

    def no_space(obj: object, path: Path) -> None:
        path.write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(ckpt_mod, "_save_torch", no_space)
    manager.save(2, roles, {"epoch": 0}, background=True)  # returns: the failure comes later
    with pytest.raises(DiskFullError) as info:
        manager.save(3, roles, {"epoch": 0}, background=True)
    message = str(info.value)
    assert "global_step_2" in message and "MiB free" in message and "global_step_1 is intact" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", LATEST_FILE]
    assert read_latest_step(tmp_path) == 1
    manager.save(3, roles, {"epoch": 0}, background=True)  # the end of the run: wait() raises it
    with pytest.raises(DiskFullError, match="global_step_3"):
        manager.wait()
    manager.wait()  # raised once
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", LATEST_FILE]


def test_a_cancelled_write_removes_its_folder_and_the_previous_checkpoint_stays_newest(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    roles = make_roles(model_dir, seed=1)
    manager = CheckpointManager(tmp_path, {"max_actor_ckpt_to_keep": 1, "max_critic_ckpt_to_keep": 1})
    manager.save(1, roles, {"epoch": 0}, background=True)
    manager.wait()
    release = hold_role_writes(monkeypatch)
    manager.save(2, roles, {"epoch": 0}, background=True)  # the writer waits inside the first role
    threading.Timer(0.2, release.set).start()
    assert manager.writer.cancel() is None  # stops at the next file, removes its folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", LATEST_FILE]
    assert read_latest_step(tmp_path) == 1
    monkeypatch.undo()
    manager.save(3, roles, {"epoch": 0}, background=True)  # retention runs after the write it follows
    manager.wait()
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_3"]


def test_a_full_disk_in_the_last_background_write_ends_the_run_with_the_usual_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Step 2's checkpoint fails on the writer thread after the loop is done: the run waits for it and
    ends as a full disk during a save in the step ends, exit 1 and one paragraph, step 1 kept."""
    assets = make_assets(tmp_path / "assets")
    run_dir = tmp_path / "run"
    save_torch = ckpt_mod._save_torch

    def full_on_step_2(obj: object, path: Path) -> None:
        if path.parent.name.startswith("global_step_2.tmp-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        save_torch(obj, path)

    monkeypatch.setattr(ckpt_mod, "_save_torch", full_on_step_2)
    assert train_main(short_run_overrides(assets, run_dir)) == 1
    err = capsys.readouterr().err
    assert f"fulcrum train: disk full while saving checkpoint {run_dir / 'global_step_2'}" in err
    assert "Traceback" not in err and "global_step_1 is intact" in err
    assert sorted(p.name for p in run_dir.glob("global_step_*")) == ["global_step_1"]
    assert read_latest_step(run_dir) == 1 and not list(run_dir.glob("*.tmp-*"))


def test_a_runs_end_waits_for_its_write_or_cancels_it_on_a_second_ctrl_c(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """BackgroundWriter.finish: a normal end waits and says how long the write took, and raises its failure;
    an end on another error waits and warns of a failure instead; a second Ctrl-C stops the write."""
    from fulcrum.trainer.checkpoint.background import BackgroundWriter

    writer = BackgroundWriter()
    writer.submit("global_step_3", lambda: None)
    line = writer.finish(None)
    assert line is not None and line.startswith("checkpoint global_step_3 written in ")

    def full_disk() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    writer.submit("global_step_4", full_disk)
    with pytest.raises(OSError, match="No space left"):
        writer.finish(None)
    writer.submit("global_step_5", full_disk)
    assert writer.finish(RuntimeError("the step failed")) is None  # the run's own error stays the one raised
    assert "the background checkpoint write failed too: [Errno 28]" in capsys.readouterr().err

    files_written = []
    started = threading.Event()

    def many_files() -> None:
        for index in range(1000):
            started.set()
            writer.check_cancelled()  # between files, as CheckpointManager's writes call it
            files_written.append(index)
            threading.Event().wait(0.01)

    writer.submit("global_step_6", many_files)
    assert started.wait(10)
    assert writer.finish(KeyboardInterrupt()) is None
    assert not writer.busy and len(files_written) < 1000
    assert capsys.readouterr().err == ""  # a cancelled write is no failure
