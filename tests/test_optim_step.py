"""The optimiser step of an update (`clip_and_step`): clipped, skipped on a non-finite gradient norm, and,
with an optimiser that steps on the device (fused AdamW, as on CUDA), skipped without the host reading
the norm. Fused AdamW runs on the CPU too, so both paths are tested here."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from test_workers_update import cfg_for, rl_batch  # tests/ is on sys.path under pytest

from fulcrum.config.sections import actor_section
from fulcrum.workers.actor import ActorWorker
from fulcrum.workers.optim import clip_and_step, steps_on_device

CPU = torch.device("cpu")


def linear_and_optimizer(fused: bool) -> tuple[torch.nn.Linear, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.clone() for s in optimizer.state.values() for t in s.values()]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_a_finite_norm_is_clipped_and_stepped_and_returned(fused: bool) -> None:
    model, optimizer = linear_and_optimizer(fused)
    assert steps_on_device(optimizer) == fused
    before = [p.detach().clone() for p in model.parameters()]
    (model(torch.ones(2, 4)).sum() * 100).backward()
    expected = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    norm = clip_and_step(model, optimizer, grad_clip=1.0)
    assert float(norm) == pytest.approx(float(expected), rel=1e-6)
    if fused:  # the device's value: nothing made the host wait for it
        assert isinstance(norm, torch.Tensor) and norm.device == before[0].device
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters()) and "found_inf" not in optimizer.__dict__


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_a_non_finite_norm_leaves_weights_and_optimiser_state_as_they_were(fused: bool) -> None:
    """After one good step (so the state exists), a NaN gradient: weights, both moments and the step
    count unchanged, and the next good step continues from them as if the bad one had not happened."""
    model, optimizer = linear_and_optimizer(fused)
    model(torch.ones(2, 4)).sum().backward()
    clip_and_step(model, optimizer, grad_clip=1.0)
    weights = [p.detach().clone() for p in model.parameters()]
    state = optimizer_state(optimizer)
    (model(torch.ones(2, 4)).sum() * float("nan")).backward()
    norm = clip_and_step(model, optimizer, grad_clip=1.0)
    assert math.isnan(float(norm))
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(state, optimizer_state(optimizer), strict=True))
    assert all(p.grad is None for p in model.parameters())

    reference, reference_optimizer = linear_and_optimizer(fused)  # the same two good steps, no bad one
    for _ in range(2):
        reference(torch.ones(2, 4)).sum().backward()
        clip_and_step(reference, reference_optimizer, grad_clip=1.0)
    model(torch.ones(2, 4)).sum().backward()
    clip_and_step(model, optimizer, grad_clip=1.0)
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters(), strict=True))


def test_an_update_with_a_fused_optimiser_skips_a_nan_step_and_says_so(tiny_dir: str, caplog) -> None:
    """Through the actor's update: NaN advantages make every mini-batch's norm NaN; the weights stay, the
    logged grad_norm is NaN (what the trainer's NaN guard counts) and a warning names each skipped step."""
    actor = ActorWorker(actor_section(cfg_for(tiny_dir)), CPU, total_training_steps=10)
    actor.optimizer = torch.optim.AdamW(actor.model.parameters(), lr=1e-3, fused=True)
    actor.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(actor.optimizer, lambda _: 1.0)
    batch = rl_batch()
    batch["old_log_probs"], _ = actor.compute_log_prob(batch)
    batch["advantages"] = torch.full_like(batch["advantages"], float("nan"))
    before = [p.detach().clone() for p in actor.model.parameters()]
    with caplog.at_level(logging.WARNING, logger="fulcrum.workers.optim"):
        metrics, _ = actor.update_policy(batch, global_step=1)
    assert math.isnan(metrics["actor/grad_norm"])
    assert all(torch.equal(b, p) for b, p in zip(before, actor.model.parameters(), strict=True))
    assert "actor: grad_norm is nan in mini-batch 0, its optimiser step was skipped" in caplog.text
