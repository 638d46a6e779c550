"""Many processes with PyTorch's own distributed stack: torchrun's environment, the process group (NCCL on
CUDA, gloo on the CPU), each rank's share of a batch, and what the ranks exchange.

This package sits beside `fulcrum.config` at the bottom of the layers: it imports only torch and
`fulcrum.config`, so rollout, workers and trainer may all use it.
"""

from fulcrum.parallel.group import (
    DistInfo,
    WorldSizeError,
    check_world_size,
    current,
    init_distributed,
    launched_by_torchrun,
    shutdown,
)
from fulcrum.parallel.shard import (
    all_gather_objects,
    all_gather_rows,
    broadcast_object,
    max_over_ranks,
    on_main,
    rank_rows,
    rank_share,
    reduce_metrics,
    share_bounds,
)

__all__ = [
    "DistInfo",
    "WorldSizeError",
    "all_gather_objects",
    "all_gather_rows",
    "broadcast_object",
    "check_world_size",
    "current",
    "init_distributed",
    "launched_by_torchrun",
    "max_over_ranks",
    "on_main",
    "rank_rows",
    "rank_share",
    "reduce_metrics",
    "share_bounds",
    "shutdown",
]
