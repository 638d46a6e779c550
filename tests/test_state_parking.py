"""The optimiser state of the model not being updated waits in host memory: the updates give the same
weights and moments as with everything resident, the update's memory is lower by the parked moments,
and a checkpoint taken between updates holds the real state."""

from __future__ import annotations

import copy
import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers import make_assets, short_run_overrides
from torch import nn

from fulcrum.config import load_config
from fulcrum.config.keys import ConfigError
from fulcrum.rollout.native.kernels import next_pow2
from fulcrum.trainer.ppo_trainer import PPOTrainer
from fulcrum.workers import state_parking
from fulcrum.workers.state_parking import OptimizerStateParking, park_between_updates


class Worker:
    """What `park_between_updates` reads of a worker: its optimiser (and it sets `parking`)."""

    def __init__(self, width: int, seed: int, device: str) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1)).to(device)
        fused = {"fused": True} if device == "cuda" else {}
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, **fused)
        self.parking: OptimizerStateParking | None = None

    def update(self, x: torch.Tensor, steps: int = 2) -> None:
        """A few micro-batches then a step, as `ppo_update` walks them: `activate` first, `before_step`
        before each step."""
        if self.parking is not None:
            self.parking.activate(self.optimizer)
        for _ in range(steps):
            for part in x.chunk(4):
                self.model(part).square().mean().backward()
            if self.parking is not None:
                self.parking.before_step(self.optimizer)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def test_on_unless_the_key_turns_it_off() -> None:
    assert load_config([]).trainer.park_optimizer_state is True
    off = load_config(["trainer.park_optimizer_state=false"]).trainer.park_optimizer_state
    assert off is False
    two = [Worker(8, 0, "cpu"), Worker(8, 1, "cpu")]
    assert park_between_updates(two, torch.device("cuda"), False, None, enabled=off) is None
    assert all(w.parking is None for w in two)
    with pytest.raises(ConfigError, match=r"trainer\.park_optimizer_state: expected bool, got 'maybe'"):
        load_config(["trainer.park_optimizer_state=maybe"])


def test_one_model_or_a_host_without_room_parks_nothing() -> None:
    cuda = torch.device("cuda")
    assert (
        park_between_updates(
            [Worker(8, 0, "cpu")], cuda, distributed=False, host_available=None, enabled=True
        )
        is None
    )
    two = [Worker(8, 0, "cpu"), Worker(8, 1, "cpu")]
    assert (
        park_between_updates(two, torch.device("cpu"), distributed=False, host_available=None, enabled=True)
        is None
    )
    assert park_between_updates(two, cuda, distributed=True, host_available=None, enabled=True) is None
    # a pinned block takes the next power of two of its bytes
    assert [next_pow2(n) for n in (1, 4, 5, 1000, 1024)] == [1, 4, 8, 1024, 1024]
    # two float32 moments of (8·8, 8, 8, 1) parameters a model, each copy 64-byte aligned: 2 × (256 + 3 × 64)
    # = 896 B, a block of 1,024; a host with 4 kB available has room for 25 % of it (1,024 B), less
    # than the 2,048 B of both.
    assert [state_parking.moment_bytes(w.optimizer) for w in two] == [896, 896]
    assert park_between_updates(two, cuda, distributed=False, host_available=4096, enabled=True) is None
    assert all(w.parking is None for w in two)


def test_the_block_pinned_ahead_holds_the_moments_an_optimiser_makes() -> None:
    """The bytes pinned at registration (`moment_bytes`) hold every moment the optimiser then makes, each
    a view of the block with the moment's shape and dtype, none overlapping; a block too small is refused."""
    for amsgrad in (False, True):
        worker = Worker(24, 0, "cpu")
        worker.optimizer = torch.optim.AdamW(worker.model.parameters(), lr=1e-2, amsgrad=amsgrad)
        nbytes = state_parking.moment_bytes(worker.optimizer)
        worker.update(torch.randn(16, 24), steps=1)
        moments = [v for st in worker.optimizer.state.values() for k, v in st.items() if k != "step"]
        assert len(moments) == (3 if amsgrad else 2) * 4
        block = torch.zeros(nbytes, dtype=torch.uint8)
        views = state_parking.carve(block, moments)
        assert views is not None
        for view, moment in zip(views, moments, strict=True):
            assert view.shape == moment.shape and view.dtype == moment.dtype
            assert view.untyped_storage().data_ptr() == block.untyped_storage().data_ptr()
            view.copy_(moment)
        for view, moment in zip(views, moments, strict=True):  # no copy overwrote another's bytes
            assert torch.equal(view, moment)
        assert state_parking.carve(torch.zeros(nbytes // 2, dtype=torch.uint8), moments) is None


@pytest.mark.gpu
def test_parked_updates_give_the_same_weights_and_moments_as_resident_ones_in_less_memory() -> None:
    width = 1024  # 2 × 4 B × (1024² + 2·1024 + 1) ≈ 8.4 MB of moments a model
    x = torch.randn(64, width, device="cuda")
    resident = [Worker(width, 0, "cuda"), Worker(width, 1, "cuda")]
    for w in resident:
        w.update(x)
    base = torch.cuda.memory_allocated()
    parked = [Worker(width, 0, "cuda"), Worker(width, 1, "cuda")]
    weights = sum(p.numel() * 4 for w in parked for p in w.model.parameters())
    moments = sum(2 * p.numel() * 4 for p in parked[0].model.parameters())
    parking = park_between_updates(
        parked, torch.device("cuda"), distributed=False, host_available=None, enabled=True
    )
    assert parking is not None and all(w.parking is parking for w in parked)
    for step in range(3):  # critic, then actor, each step
        for a, b in zip(resident, parked, strict=True):
            if step:
                a.update(x)
            b.update(x)
        torch.cuda.synchronize()
        torch.empty(
            1, device="cuda"
        )  # an allocation: the allocator takes back memory freed beside the copies
        # the weights and one model's moments (the last updated): the other's wait in host memory
        held = torch.cuda.memory_allocated() - base
        assert weights + moments <= held < weights + moments + 2**20, (step, held, weights, moments)
    parking.restore_all()
    assert torch.cuda.memory_allocated() - base >= weights + 2 * moments
    for a, b in zip(resident, parked, strict=True):
        for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
            assert torch.equal(pa, pb)
            sa, sb = a.optimizer.state[pa], b.optimizer.state[pb]
            assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(
                sa["exp_avg_sq"], sb["exp_avg_sq"]
            )


@pytest.mark.gpu
def test_a_state_loaded_between_updates_is_the_one_the_next_update_uses() -> None:
    """A checkpoint is read after `restore_all` and loaded into the optimiser (new state tensors): the
    next updates use the loaded state, not the host copies of the tensors it replaced."""
    width = 256
    x = torch.randn(32, width, device="cuda")
    workers = [Worker(width, 0, "cuda"), Worker(width, 1, "cuda")]
    parking = park_between_updates(
        workers, torch.device("cuda"), distributed=False, host_available=None, enabled=True
    )
    assert parking is not None
    for w in workers:
        w.update(x)
    parking.restore_all()
    saved = [copy.deepcopy(w.optimizer.state_dict()) for w in workers]
    weights = [[p.detach().clone() for p in w.model.parameters()] for w in workers]
    for w in workers:  # training goes on, then the run resumes from the saved state
        w.update(x)
    parking.restore_all()
    for w, state, ws in zip(workers, saved, weights, strict=True):
        w.optimizer.load_state_dict(copy.deepcopy(state))  # a load makes tensors of its own, as from a file
        with torch.no_grad():
            for p, v in zip(w.model.parameters(), ws, strict=True):
                p.copy_(v)
    reference = [Worker(width, 0, "cuda"), Worker(width, 1, "cuda")]
    for r, state, ws in zip(reference, saved, weights, strict=True):
        r.optimizer.load_state_dict(copy.deepcopy(state))
        with torch.no_grad():
            for p, v in zip(r.model.parameters(), ws, strict=True):
                p.copy_(v)
    for _ in range(2):
        for w, r in zip(workers, reference, strict=True):
            w.update(x)
            r.update(x)
    parking.restore_all()
    for w, r in zip(workers, reference, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(w.model.parameters(), r.model.parameters(), strict=True))


@pytest.mark.gpu
def test_a_ppo_run_with_a_critic_parks_its_state_and_checkpoints_the_real_one(tmp_path: Path) -> None:
    """Two steps with a critic on the GPU, a checkpoint each step (the step's updates parked each model's
    moments in turn): each role's written optimiser state is the live one, and a run resumed from the
    first checkpoint trains its second step."""
    assets = make_assets(tmp_path / "assets")
    gpu = {  # uncompiled: parking does not depend on it, and the test's time is then not the compiler's
        "trainer.device": "cuda",
        "actor_rollout_ref.rollout.name": "native",
        "actor_rollout_ref.actor.use_torch_compile": False,
    }  # checkpoints written in the background (the default): snapshots into kept host buffers
    run = tmp_path / "run"
    trainer = PPOTrainer(load_config(short_run_overrides(assets, run, **gpu)), torch.device("cuda"))
    assert trainer.parking is not None
    trainer.fit()
    trainer.parking.restore_all()
    for role, worker in trainer.roles().items():
        saved = torch.load(run / "global_step_2" / role / "optimizer.pt", weights_only=True)["state"]
        live = worker.optimizer.state_dict()["state"]
        assert saved.keys() == live.keys() and saved
        for key, entry in live.items():
            for name, value in entry.items():
                assert torch.equal(value.cpu(), saved[key][name]), (role, key, name)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(run / "global_step_1", resumed / "global_step_1")
    again = PPOTrainer(load_config(short_run_overrides(assets, resumed, **gpu)), torch.device("cuda"))
    metrics = again.fit()
    assert again.global_step == 2 and math.isfinite(metrics["critic/vf_loss"])
