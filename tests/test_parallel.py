"""fulcrum.parallel: torchrun's environment, shares of a batch, and exchanges between gloo processes."""

from __future__ import annotations

import pytest
from helpers_dist import run_ranks

from fulcrum.parallel import DistInfo, WorldSizeError, check_world_size, rank_share, share_bounds
from fulcrum.parallel.group import info_from_env, launched_by_torchrun
from fulcrum.parallel.shard import reduction_of


def test_shares_cover_the_batch_in_rank_order():
    # 10 items over 4 ranks: sizes 3, 3, 2, 2
    assert [share_bounds(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    items = list(range(7))
    assert [x for r in range(3) for x in rank_share(items, r, 3)] == items
    assert rank_share(items) == items  # a single process holds everything
    with pytest.raises(ValueError, match="rank 2 is not in a world of size 2"):
        share_bounds(4, 2, 2)


def test_torchrun_environment_is_read():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert not launched_by_torchrun(env)  # no rendezvous address: not torchrun's
    env |= {"MASTER_ADDR": "h", "MASTER_PORT": "1"}
    info = info_from_env(env)
    assert launched_by_torchrun(env)
    assert (info.rank, info.world_size, info.local_rank, info.nnodes, info.is_main) == (3, 4, 1, 2, False)
    assert DistInfo().is_main and not DistInfo().distributed


def test_world_size_mismatch_names_both_keys():
    check_world_size(2, 1, 2)
    with pytest.raises(WorldSizeError) as err:
        check_world_size(1, 1, 2)
    assert "trainer.n_gpus_per_node=1" in str(err.value) and "trainer.nnodes=1" in str(err.value)
    assert "world size of 2" in str(err.value)


def test_metric_reductions_follow_the_name():
    assert reduction_of("response_length/max") == "max"
    assert reduction_of("response_length/min") == "min"
    assert reduction_of("perf/max_memory_allocated_gb") == "max"
    assert reduction_of("actor/pg_loss") == "mean"


def _exchange(rank: int, world: int) -> dict:
    from fulcrum.parallel import (
        all_gather_objects,
        broadcast_object,
        current,
        max_over_ranks,
        rank_rows,
        reduce_metrics,
    )

    info = current()
    metrics = {
        "actor/pg_loss": float(rank),
        "response_length/max": 10.0 + rank,
        "response_length/min": 5.0 - rank,
    }
    shares = {"actor/pg_loss": 1.0 + rank, "actor/lr": 0.1}
    return {
        "info": (info.rank, info.world_size, info.backend),
        "gathered": all_gather_objects({"rank": rank, "tokens": [rank] * (rank + 1)}),
        "broadcast": broadcast_object(f"from {rank}"),
        "metrics": reduce_metrics(metrics),
        "summed": reduce_metrics(shares, sums=frozenset({"actor/pg_loss"})),
        "rows": rank_rows(5),
        "max": max_over_ranks(3 - rank),
    }


def test_two_gloo_processes_exchange_objects_and_metrics():
    results = run_ranks(_exchange, 2)
    for rank, out in enumerate(results):
        assert out["info"] == (rank, 2, "gloo")
        assert out["gathered"] == [{"rank": 0, "tokens": [0]}, {"rank": 1, "tokens": [1, 1]}]
        assert out["broadcast"] == "from 0"
        assert out["metrics"] == {
            "actor/pg_loss": 0.5,
            "response_length/max": 11.0,
            "response_length/min": 4.0,
        }
