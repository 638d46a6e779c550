"""Ulysses sequence parallelism over 2 gloo processes: the actor's log-probs, entropies and policy
gradients, and the critic's values and value gradients, equal one process's (fp32, 1e-5), including a
stream whose token count is odd and a model with fewer key/value heads than ranks; and a whole PPO run
with SP 2 takes the steps of one process."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import log_probs_of, make_assets, ppo_loss, values_of
from helpers_dist import run_ranks
from safetensors.torch import load_file
from test_packed import rl_batch as packed_rl_batch
from test_workers_units import make_batch

from fulcrum.algo.losses import compute_value_loss
from fulcrum.batch import Batch
from fulcrum.models.packed import compile_decoder_layers, enable_packed_attention, pack_micro_batch
from fulcrum.models.stream_shard import shard_stream
from fulcrum.models.value_head import CriticModel
from fulcrum.parallel.ulysses import check_heads, kv_repeats, sequence_parallel_group
from fulcrum.rollout.testing import random_causal_lm
from fulcrum.trainer.main_ppo import main

CPU = torch.device("cpu")
TOL = 1e-5


def rl_batch() -> Batch:
    return packed_rl_batch(b=5, p=6, r=6)  # 39 tokens: the stream is padded to split over 2 ranks


def summed_grads(model: torch.nn.Module, group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """Each parameter's gradient summed over the group (what the data-parallel reduction adds up)."""
    out = {}
    for name, p in model.named_parameters():
        grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        if group is not None:
            dist.all_reduce(grad, group=group)
        out[name] = grad
    return out


def _actor(rank: int, world: int, kv_heads: int, compiled: bool) -> dict[str, object]:
    sp = sequence_parallel_group(world, "actor_rollout_ref.actor.ulysses_sequence_parallel_size")
    model = random_causal_lm("qwen2", num_key_value_heads=kv_heads, vocab_size=1024).train()
    enable_packed_attention(model)
    batch = rl_batch()
    mask = batch["response_mask"].float()
    results = {}
    for name, group in (("one", None), ("sp", sp)):
        replica = copy.deepcopy(model)
        if compiled and group is not None:  # as on CUDA: layers checkpointed inside compiled regions
            for layer in replica.model.layers:
                layer.gradient_checkpointing = True
            compile_decoder_layers(replica.model, backend="aot_eager")
        logp, ent = log_probs_of(replica, batch, 0.7, True, CPU, packed=True, sp=group)
        loss, *_ = ppo_loss(batch["old_log_probs"], logp, batch["advantages"], mask)
        assert ent is not None
        (loss - 0.01 * (ent * mask).sum() / mask.sum()).backward()
        grads = summed_grads(replica, None if group is None else group.group)
        results[name] = (logp.detach(), ent.detach(), grads)
    return results


@pytest.mark.parametrize("kv_heads, compiled", [(2, False), (1, False), (1, True)])
def test_actor_log_probs_and_gradients_with_sp_2_equal_one_process(kv_heads: int, compiled: bool) -> None:
    batch = rl_batch()
    tokens = int(batch["attention_mask"].sum())
    assert tokens % 2 == 1  # the stream is padded to split over 2 ranks
    for result in run_ranks(_actor, 2, kv_heads, compiled):
        (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = result["one"], result["sp"]
        assert torch.allclose(lp_a, lp_b, atol=TOL, rtol=0)
        assert torch.allclose(ent_a, ent_b, atol=TOL, rtol=0)
        assert (lp_b[~batch["response_mask"].bool()] == 0).all()
        assert any(g.abs().sum() > 0 for g in g_a.values())
        for name in g_a:
            assert torch.allclose(g_a[name], g_b[name], atol=TOL, rtol=1e-4), name


def _critic(rank: int, world: int) -> dict[str, object]:
    sp = sequence_parallel_group(world, "critic.ulysses_sequence_parallel_size")
    backbone = random_causal_lm("llama", vocab_size=1024).model
    model = CriticModel(backbone).train()
    enable_packed_attention(model.model)
    batch = rl_batch()
    mask = batch["response_mask"].float()
    results = {}
    for name, group in (("one", None), ("sp", sp)):
        replica = copy.deepcopy(model)
        values = values_of(replica, batch, CPU, packed=True, sp=group)
        loss, _ = compute_value_loss(values, batch["returns"], batch["values"], mask, cliprange_value=0.5)
        loss.backward()
        results[name] = (values.detach(), summed_grads(replica, None if group is None else group.group))
    return results


def test_critic_values_and_gradients_with_sp_2_equal_one_process() -> None:
    for result in run_ranks(_critic, 2):
        (v_a, g_a), (v_b, g_b) = result["one"], result["sp"]
        assert torch.allclose(v_a, v_b, atol=TOL, rtol=0)
        for name in g_a:
            assert torch.allclose(g_a[name], g_b[name], atol=TOL, rtol=1e-4), name


def test_stream_shards_cover_the_stream_once_in_order() -> None:
    batch = make_batch(b=3, p=5, r=4)
    packed = pack_micro_batch(batch["input_ids"], batch["attention_mask"], batch["position_ids"], 5)
    n_real = packed.input_ids.numel()
    for sp_size in (2, 3, 4, 5):
        shards = [shard_stream(packed, sp_size, r) for r in range(sp_size)]
        ids = torch.cat([s.input_ids for s in shards])
        assert len(ids) % sp_size == 0 and torch.equal(ids[:n_real], packed.input_ids)
        assert shards[0].counts == [len(s.predictor) for s in shards]
        assert torch.equal(torch.cat([s.labels for s in shards]), packed.labels)
        # The padding (if any) is a sequence of its own, after every real one.
        ends = shards[0].cu_seqlens.tolist()
        assert ends[-1] == len(ids) and (len(ids) == n_real or ends[-2] == n_real)


def test_heads_that_do_not_divide_are_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"critic\.ulysses_sequence_parallel_size=2 must divide"):
        check_heads(3, 2, "critic.ulysses_sequence_parallel_size")
    assert kv_repeats(num_attention_heads=4, num_key_value_heads=2, sp_size=2) == 1
    assert kv_repeats(num_attention_heads=4, num_key_value_heads=1, sp_size=2) == 2
    assert kv_repeats(num_attention_heads=8, num_key_value_heads=2, sp_size=8) == 4


SP_KEYS = {
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2,
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": 2,
    "critic.ulysses_sequence_parallel_size": 2,
}


@pytest.mark.parametrize("layout", ["sharded", "replicated"])
def test_a_run_with_sp_2_on_two_processes_takes_the_same_steps_as_one(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, layout: str
) -> None:
    """PPO with a critic and a reference, every model's micro-batches split over 2 ranks (the tiny model's
    single key/value head repeated), against one process: losses, grad norms and saved weights."""
    from test_data_parallel_e2e import COMPARED, REPLICATED, overrides, rows

    torch.set_num_threads(1)
    assets = make_assets(tmp_path_factory.mktemp("sp"), num_train=4, num_test=2)
    engine = {"actor_rollout_ref.rollout.name": "hf", **(REPLICATED if layout == "replicated" else {})}
    assert main(overrides(assets, tmp_path / "one", engine)) == 0
    assert run_ranks(_train, 2, overrides(assets, tmp_path / "two", {**engine, **SP_KEYS})) == [0, 0]
    one, two = rows(tmp_path / "one"), rows(tmp_path / "two")
    assert [r["training/global_step"] for r in two] == [1, 2]
    for a, b in zip(one, two, strict=True):
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], abs=1e-5, rel=1e-5), key
    saved = [load_file(tmp_path / run / "global_step_2/actor/model.safetensors") for run in ("one", "two")]
    for name, weight in saved[0].items():
        torch.testing.assert_close(saved[1][name], weight, atol=1e-5, rtol=1e-5, msg=name)


def _train(rank: int, world: int, args: list[str]) -> int:
    return main(args)


def test_the_start_up_summary_names_the_sequence_parallel_groups() -> None:
    from fulcrum.config import load_config
    from fulcrum.parallel import DistInfo
    from fulcrum.trainer.data_parallel import startup_line

    cfg = load_config([f"{key}={sp}" for key, sp in SP_KEYS.items()])
    line = startup_line(DistInfo(0, 4, 0, 4, "nccl"), cfg)
    assert line is not None
    assert "sequence parallelism: actor in 2 group(s) of 2, critic in 2 group(s) of 2 ranks" in line
