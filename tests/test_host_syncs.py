"""The host runs ahead of the GPU: an update or a no-grad pass waits for the device a fixed number of
times (a grad norm per mini-batch, one read of the metrics, one copy of each result), however many
micro-batches it runs. Counted on the CPU (`host_work`), in both layouts, with the compute weights a
CUDA run has."""

from __future__ import annotations

import functools

import pytest
import torch
from host_work import counting
from test_workers_update import cfg_for, rl_batch

from fulcrum.config.sections import actor_section, critic_section
from fulcrum.models import precision
from fulcrum.models.tiny import build_tiny_model
from fulcrum.workers.actor import ActorWorker
from fulcrum.workers.critic import CriticWorker
from fulcrum.workers.micro_batch import make_micro_batches

CPU = torch.device("cpu")
LAYOUTS = {"packed": [], "padded": ["actor_rollout_ref.model.use_remove_padding=False"]}


def sizes(size: int) -> list[str]:
    return [
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={size}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={size}",
        f"critic.ppo_micro_batch_size_per_gpu={size}",
        f"critic.forward_micro_batch_size_per_gpu={size}",
        "critic.model.use_remove_padding=${actor_rollout_ref.model.use_remove_padding}",
    ]


def syncs_of(worker: ActorWorker | CriticWorker, run: object) -> tuple[int, dict[str, int]]:
    with counting([worker.model], (worker.optimizer,), sites=True) as work:
        run()  # type: ignore[operator]
    return work.counts.syncs, dict(work.counts.sync_sites)


def actor_syncs(tiny_dir: str, layout: str, size: int) -> tuple[int, int, int]:
    """(micro-batches of the update, syncs of an update of one mini-batch, syncs of the log-prob pass)."""
    actor = ActorWorker(actor_section(cfg_for(tiny_dir, *LAYOUTS[layout], *sizes(size))), CPU, 10)
    batch = rl_batch()
    batch["old_log_probs"] = actor.compute_log_prob(batch)[0]
    micro, _ = make_micro_batches(batch, size, False, None, "micro", packed=actor.forwards.packed)
    update, where = syncs_of(actor, lambda: actor.update_policy(batch, global_step=1))
    forward, _ = syncs_of(actor, lambda: actor.compute_log_prob(batch))
    assert update <= 2, where
    return len(micro), update, forward


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_an_update_waits_for_the_device_a_fixed_number_of_times(
    tiny_dir: str, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(precision.COMPUTE_DTYPES, "cpu", torch.bfloat16)
    one_micro, update_one, forward_one = actor_syncs(tiny_dir, layout, 8)
    many_micro, update_many, forward_many = actor_syncs(tiny_dir, layout, 1)
    assert one_micro == 1 and many_micro >= 6
    # A grad norm for the step and one read of the metrics; log-probs and entropies copied once each.
    assert update_one == update_many == 2
    assert forward_one == forward_many == 2

    counts = []
    for size in (8, 1):
        critic = CriticWorker(critic_section(cfg_for(tiny_dir, *LAYOUTS[layout], *sizes(size))), CPU, 10)
        batch = rl_batch()
        batch["values"] = critic.compute_values(batch)
        update, where = syncs_of(critic, lambda: critic.update_critic(batch, global_step=1))  # noqa: B023
        values, _ = syncs_of(critic, lambda: critic.compute_values(batch))  # noqa: B023
        counts.append((update, values))
        assert update == 2, where
    assert counts == [(2, 1), (2, 1)]


def test_the_counter_sees_device_syncs_and_not_host_ones(tiny_dir: str) -> None:
    """What the GPU would wait for: a scalar read of device data, boolean indexing and a copy to the
    host; the batch's own tensors are on the host already."""
    actor = ActorWorker(actor_section(cfg_for(tiny_dir)), CPU, 10)
    weight = next(actor.model.parameters())
    host = torch.ones(3)
    with counting([actor.model]) as work, torch.no_grad():
        float(host.sum())
        host[host > 0].tolist()
        assert work.counts.syncs == 0
        float(weight.sum())
        weight[weight > 0]
        (weight * 2).cpu()
    assert work.counts.syncs == 3


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model's family, 12 narrow layers: 147 parameter tensors against the tiny model's 51."""
    size = {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64}
    folder = tmp_path_factory.mktemp("deep_qwen2")
    return str(build_tiny_model(folder, arch="qwen2", seed=0, num_hidden_layers=12, **size))


def update_ops_per_micro_batch(model_dir: str, role: str) -> float:
    """Eager device ops a packed update (one mini-batch of `rl_batch`) adds per micro-batch: the update
    cut into micro-batches of one row against the same update in one micro-batch."""
    ops, micro_batches = [], []
    for size in (8, 1):
        cfg = cfg_for(model_dir, *sizes(size))
        batch = rl_batch()
        worker: ActorWorker | CriticWorker
        if role == "actor":
            worker = ActorWorker(actor_section(cfg), CPU, 10)
            batch["old_log_probs"] = worker.compute_log_prob(batch)[0]
            run = functools.partial(worker.update_policy, batch, global_step=1)
        else:
            worker = CriticWorker(critic_section(cfg), CPU, 10)
            batch["values"] = worker.compute_values(batch)
            run = functools.partial(worker.update_critic, batch, global_step=1)
        micro_batches.append(len(make_micro_batches(batch, size, False, None, "micro", packed=True)[0]))
        with counting([worker.model], (worker.optimizer,)) as work:
            run()
        ops.append(work.counts.device_ops)
    assert micro_batches[0] == 1 and micro_batches[1] >= 6
    return (ops[1] - ops[0]) / (micro_batches[1] - micro_batches[0])


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_an_updates_host_work_per_micro_batch_does_not_grow_with_the_parameter_count(
    tiny_dir: str, deep_dir: str, role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A micro-batch's gradients reach the float32 masters in a few ops whatever the number of parameter
    tensors, as its forward and loss do: on a GPU each eager op is host time the device may wait for,
    and a small model's many small tensors made that time grow with depth (SmolLM2-135M: 273 tensors)."""
    monkeypatch.setitem(precision.COMPUTE_DTYPES, "cpu", torch.bfloat16)
    shallow, deep = (update_ops_per_micro_batch(d, role) for d in (tiny_dir, deep_dir))
    assert abs(deep - shallow) <= 2, (shallow, deep)
