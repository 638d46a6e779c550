"""The router's load-balancing loss under Ulysses sequence parallelism over 2 gloo processes: the
actor's micro-step on a tiny Qwen3-MoE reports the whole micro-batch's loss on every rank, and the
gradients summed over the group equal one process's (fp32, 1e-5), whether or not the stream's length
divides by 2 (pad tokens at its end, which do not count)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from arch_checks import arch_model
from helpers_dist import run_ranks
from test_ulysses import summed_grads
from test_workers_units import make_batch
from test_workers_update import cfg_for

from fulcrum.batch import Batch
from fulcrum.config.sections import actor_section
from fulcrum.models.packed import pack_micro_batch
from fulcrum.models.stream_shard import real_tokens, shard_stream
from fulcrum.workers.actor import ActorWorker
from fulcrum.workers.update import global_agg_kwargs

CPU = torch.device("cpu")
TOL = 1e-5
COEF = 1.0  # large, so that the router's part of the gradient is not lost beside the policy loss's
SHAPE = dict(
    num_hidden_layers=3,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    mlp_only_layers=[1],
    norm_topk_prob=True,
    head_dim=24,
    output_router_logits=True,
    router_aux_loss_coef=COEF,
)
SP_KEY = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
# (rows, prompt length, response length): 87 tokens (a pad token on the second rank), 40 (none)
BATCHES = {"odd": (8, 10, 7), "even": (5, 12, 9)}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = Path(tmp_path_factory.mktemp("moe_sp"))
    arch_model("qwen3_moe", SHAPE).save_pretrained(folder)
    return str(folder)


def rl_batch(b: int, p: int, r: int) -> Batch:
    batch = make_batch(b=b, p=p, r=r)
    g = torch.Generator().manual_seed(1)
    mask = batch["response_mask"].float()
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=g) * mask
    batch["old_log_probs"] = torch.randn(batch["responses"].shape, generator=g) * 0.1 * mask - 6.0 * mask
    return batch


def _micro_step(rank: int, world: int, folder: str, shape: tuple[int, int, int]) -> dict[str, object]:
    batch = rl_batch(*shape)
    agg = global_agg_kwargs(batch["response_mask"])
    results = {}
    for name, sp_size in (("one", 1), ("sp", world)):
        cfg = cfg_for(folder, f"{SP_KEY}={sp_size}", "actor_rollout_ref.actor.fsdp_config.fsdp_size=1")
        actor = ActorWorker(actor_section(cfg), CPU, total_training_steps=1)
        assert actor.loss.router == (COEF, 2)
        with actor.forwards.active():
            inputs = actor.forwards.inputs(batch, actor.loss.keys(False, False), agg)
            out, _ = actor.fwd_bwd(inputs, False, False)
            actor.forwards.accumulate_grads()
        sp = actor.forwards.sp
        grads = summed_grads(actor.model, None if sp is None else sp.group)
        results[name] = (float(out["actor/load_balancing_loss"]), float(out["actor/pg_loss"]), grads)
    return results


@pytest.mark.parametrize("stream", list(BATCHES))
def test_router_loss_and_gradients_with_sp_2_equal_one_process(moe_dir: str, stream: str) -> None:
    tokens = int(rl_batch(*BATCHES[stream])["attention_mask"].sum())
    assert tokens % 2 == (stream == "odd")
    results = run_ranks(_micro_step, 2, moe_dir, BATCHES[stream])
    for result in results:
        (loss_a, pg_a, g_a), (loss_b, pg_b, g_b) = result["one"], result["sp"]
        assert loss_b == pytest.approx(loss_a, rel=TOL, abs=TOL)
        assert pg_b == pytest.approx(pg_a, rel=TOL, abs=TOL)
        assert g_a["model.layers.0.mlp.gate.weight"].abs().sum() > 0  # the router loss reaches the router
        for name in g_a:
            torch.testing.assert_close(g_b[name], g_a[name], atol=TOL, rtol=TOL, msg=name)


def test_real_tokens_mark_the_pads_at_the_stream_end() -> None:
    batch = make_batch(b=3, p=5, r=4)
    packed = pack_micro_batch(batch["input_ids"], batch["attention_mask"], batch["position_ids"], 5)
    n_real = packed.input_ids.numel()
    for sp_size in (1, 2, 3, 4, 5):
        shards = [shard_stream(packed, sp_size, r) for r in range(sp_size)]
        real = torch.cat([real_tokens(n_real, sp_size, r) for r in range(sp_size)])
        assert [len(s.input_ids) for s in shards] == [len(real) // sp_size] * sp_size
        assert int(real.sum()) == n_real and bool(real[:n_real].all())
        assert (torch.cat([s.input_ids for s in shards])[~real] == 0).all()
