"""Graphed update micro-batches on CUDA (`fulcrum.workers.cuda_graphs`): a replay gives exactly what
the captured micro-batch's eager run gave, and whole updates with graphs follow the eager ones (bf16
compute: the padding changes the products' shapes, so not bit for bit)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_cuda_graphs import rl_batch
from test_workers_update import cfg_for

from fulcrum.config.sections import actor_section, critic_section, reference_section
from fulcrum.workers import cuda_graphs
from fulcrum.workers.actor import ActorWorker, ReferenceWorker
from fulcrum.workers.critic import CriticWorker
from fulcrum.workers.update import global_agg_kwargs

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
SETTINGS = (
    "actor_rollout_ref.model.use_remove_padding=True",
    "critic.model.use_remove_padding=True",
    "actor_rollout_ref.actor.use_torch_compile=False",  # the capture does not depend on it; the test's time would
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.entropy_coeff=0.01",
)


def eager_then_graphed(tiny_dir: str) -> Iterator[tuple[bool, Any]]:
    """Graphs off, then on (the actor's `cuda_graphs` key, which the critic's follows), each with the
    configuration its workers are built from, from the same initial weights."""
    for graphs in (False, True):
        cfg = cfg_for(tiny_dir, *SETTINGS, f"actor_rollout_ref.actor.cuda_graphs={graphs}")
        torch.manual_seed(0)
        yield graphs, cfg


def flat_grads(worker: ActorWorker) -> torch.Tensor:
    """The float32 masters' gradients (inside `active()` the module's parameters are the compute copies)."""
    masters = worker.forwards.compute.masters
    return torch.cat([p.grad.flatten() for p in masters if p.grad is not None]).clone()


def test_a_replay_gives_exactly_what_the_captured_micro_batch_gave(tiny_dir: str) -> None:
    actor = ActorWorker(actor_section(cfg_for(tiny_dir, *SETTINGS)), CUDA, total_training_steps=1)
    assert actor.forwards.graphs is not None
    batch = rl_batch(b=6)
    agg = global_agg_kwargs(batch["response_mask"])
    keys = actor.loss.keys(False, False)
    outs, grads = [], []
    with actor.forwards.active():
        for _ in range(2):  # captured (and run eagerly), then replayed
            actor.optimizer.zero_grad(set_to_none=True)  # as each mini-batch starts
            actor.forwards.start_accumulation()
            metrics, _ = actor.forwards.run(batch, keys, actor.fwd_bwd, (False, False), agg, train=True)
            outs.append({k: float(v) for k, v in metrics.items()})
            actor.forwards.accumulate_grads()
            grads.append(flat_grads(actor))
    assert actor.forwards.graphs.failed is None, actor.forwards.graphs.failed
    assert len(actor.forwards.graphs.graphs) == 1 and actor.forwards.graphs.replays == 1
    assert outs[0] == outs[1]
    assert torch.equal(grads[0], grads[1]) and float(grads[0].abs().max()) > 0


def updated(
    worker: ActorWorker | CriticWorker, batch, steps: int
) -> tuple[torch.Tensor, list[dict[str, float]]]:
    before = torch.cat([p.detach().flatten() for p in worker.model.parameters()]).clone()
    if isinstance(worker, ActorWorker):
        metrics = [worker.update_policy(batch, step)[0] for step in range(steps)]
    else:
        metrics = [worker.update_critic(batch, step) for step in range(steps)]
    after = torch.cat([p.detach().flatten() for p in worker.model.parameters()])
    return after - before, metrics


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_updates_with_graphs_follow_the_eager_ones(tiny_dir: str, role: str) -> None:
    batch = rl_batch(b=16)
    runs = {}
    for graphs, cfg in eager_then_graphed(tiny_dir):
        worker = (
            ActorWorker(actor_section(cfg), CUDA, total_training_steps=4)
            if role == "actor"
            else CriticWorker(critic_section(cfg), CUDA, total_training_steps=4)
        )
        assert (worker.forwards.graphs is not None) == graphs
        runs[graphs] = updated(worker, batch, 2)
        if worker.forwards.graphs is not None:
            assert worker.forwards.graphs.failed is None, worker.forwards.graphs.failed
            assert worker.forwards.graphs.graphs and worker.forwards.graphs.replays > 0
    (eager, eager_metrics), (graphed, graphed_metrics) = runs[False], runs[True]
    cosine = torch.nn.functional.cosine_similarity(eager.double(), graphed.double(), dim=0)
    assert float(cosine) > 0.99
    assert float(graphed.norm()) == pytest.approx(float(eager.norm()), rel=0.05)
    for before, after in zip(eager_metrics, graphed_metrics, strict=True):
        assert before.keys() == after.keys()
        loss = f"{role}/{'pg_loss' if role == 'actor' else 'vf_loss'}"
        assert after[loss] == pytest.approx(before[loss], rel=0.05, abs=1e-3)


def test_old_log_probs_and_values_from_graphs_follow_the_eager_ones(tiny_dir: str) -> None:
    batch = rl_batch(b=16)
    runs = {}
    for graphs, cfg in eager_then_graphed(tiny_dir):
        actor = ActorWorker(actor_section(cfg), CUDA, total_training_steps=1)
        critic = CriticWorker(critic_section(cfg), CUDA, total_training_steps=1)
        passes = [(*actor.compute_log_prob(batch), critic.compute_values(batch)) for _ in range(2)]
        if graphs:
            for worker in (actor, critic):
                assert worker.forwards.graphs is not None and worker.forwards.graphs.failed is None
                assert worker.forwards.graphs.replays > 0  # the second pass replayed the first one's graphs
            for first, second in zip(*passes, strict=True):
                assert torch.equal(first, second)
        runs[graphs] = passes[0]
    mask = batch["response_mask"].bool()
    for eager, graphed in zip(runs[False], runs[True], strict=True):
        assert eager.shape == graphed.shape == mask.shape
        assert bool((graphed[~mask] == 0).all())
        difference = (eager - graphed)[mask].abs()
        assert (
            float(difference.mean()) < 0.02 and float(difference.max()) < 0.2
        )  # bf16 products of other shapes


def graphs_pool_reserved() -> int:
    """Bytes the graphs' shared pool reserves."""
    return cuda_graphs.pool_reserved_bytes()


def test_a_second_models_captures_reuse_the_pool_the_first_one_made(tiny_dir: str) -> None:
    """Every model's graphs are captured on one stream (`capture_stream`), so the reference's captures reuse
    the pool segments the actor's captures freed: the same forward on the same batch grows the pool by much
    less than its own work (on a stream of its own it would double it)."""
    forwards = (
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
    )
    gc.collect()  # earlier tests' graphs gone, their pool freed: these captures start a pool of their own
    torch.cuda.empty_cache()
    cfg = cfg_for(tiny_dir, *SETTINGS, "actor_rollout_ref.actor.cuda_graphs=True", *forwards)
    batch = rl_batch(b=16, p=256, r=1024)
    actor = ActorWorker(actor_section(cfg), CUDA, total_training_steps=1)
    ref = ReferenceWorker(reference_section(cfg), CUDA)
    before = graphs_pool_reserved()
    actor.compute_log_prob(batch)
    first = graphs_pool_reserved() - before
    ref.compute_ref_log_prob(batch)
    both = graphs_pool_reserved() - before
    for worker in (actor, ref):
        assert worker.forwards.graphs is not None and worker.forwards.graphs.failed is None
        assert worker.forwards.graphs.graphs  # each captured its micro-batch
    assert first > 0
    assert both < 1.5 * first, (first, both)
