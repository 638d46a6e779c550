"""Each rank's share of a batch, and what the ranks exchange: Python objects and step metrics.

Shares are contiguous and as equal as possible: `total` items over `world` ranks give the first
`total mod world` ranks one item more, so concatenating the shares in rank order restores the batch.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def share_bounds(total: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous share of `total` items:

    size_r = total // world + (1 if r < total % world else 0),  start_r = sum_{q<r} size_q
    """
    if world <= 0 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of size {world}")
    base, extra = divmod(total, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def rank_share(items: Sequence[T], rank: int | None = None, world: int | None = None) -> list[T]:
    """This rank's contiguous share of `items` (all of them in a single process)."""
    if rank is None or world is None:
        rank, world = _world()
    start, stop = share_bounds(len(items), rank, world)
    return list(items[start:stop])


def all_gather_objects(obj: T) -> list[T]:
    """Every rank's `obj`, in rank order (picklable objects; `[obj]` in a single process)."""
    _, world = _world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank `src`'s `obj` on every rank."""
    _, world = _world()
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def reduction_of(name: str) -> str:
    """How a metric combines over ranks: `.../max` takes the max, `.../min` the min, the rest the mean."""
    if name.endswith("/max") or name.startswith("perf/max_memory"):
        return "max"
    if name.endswith("/min"):
        return "min"
    return "mean"


def reduce_metrics(
    metrics: dict[str, float], device: torch.device | None = None, sums: frozenset[str] = frozenset()
) -> dict[str, float]:
    """Each metric combined over the ranks (`reduction_of`; the names in `sums` are added up: each rank
    holds its share of them, e.g. of a loss); every rank gets the same dict.

    Ranks must log the same names: a name missing on some rank is an error naming it, since a
    collective over mismatched tensors would hang or mix values up.
    """
    _, world = _world()
    if world == 1 or not metrics:
        return dict(metrics)
    names = sorted(metrics)
    all_names = all_gather_objects(names)
    if any(n != names for n in all_names):
        differ = sorted(set().union(*map(set, all_names)) - set.intersection(*map(set, all_names)))
        raise RuntimeError(f"reduce_metrics: the ranks log different metrics (e.g. {differ[:5]})")
    device = device or collective_device()
    values = torch.tensor([float(metrics[n]) for n in names], dtype=torch.float64, device=device)
    out: dict[str, float] = {}
    ops = (
        ("mean", dist.ReduceOp.SUM),
        ("sum", dist.ReduceOp.SUM),
        ("max", dist.ReduceOp.MAX),
        ("min", dist.ReduceOp.MIN),
    )
    for how, op in ops:
        index = [i for i, n in enumerate(names) if (("sum" if n in sums else reduction_of(n)) == how)]
        if not index:
            continue
        part = values[index].clone()
        dist.all_reduce(part, op=op)
        if how == "mean":
            part /= world
        out.update({names[i]: float(v) for i, v in zip(index, part.tolist(), strict=True)})
    return {n: out[n] for n in names}


def on_main(fn: Callable[[], T]) -> T:
    """`fn()` on rank 0 only (writing shared files); every rank returns its result, or raises the error
    it raised, so that no rank waits in a later collective for a rank that has failed."""
    rank, world = _world()
    if world == 1:
        return fn()
    outcome: tuple[bool, Any] = (True, None)
    if rank == 0:
        try:
            outcome = (True, fn())
        except Exception as err:  # re-raised below, on every rank
            try:
                pickle.dumps(err)
            except Exception:
                err = RuntimeError(f"{type(err).__name__}: {err}")
            outcome = (False, err)
    ok, value = broadcast_object(outcome)
    if not ok:
        raise value
    return value


def all_gather_rows(rows: torch.Tensor, sp_size: int = 1) -> torch.Tensor:
    """Every rank's CPU tensor concatenated along dim 0 in rank order (shares may differ in length). With
    sequence parallelism of `sp_size`, the ranks of a group hold the same rows: only its first gives them."""
    rank, world = _world()
    if world == 1:
        return rows
    return torch.cat(all_gather_objects(rows.cpu() if rank % sp_size == 0 else rows[:0].cpu()))


def rank_rows(total: int, sp_size: int = 1) -> list[int]:
    """The row indices of this rank's share of `total` rows (all of them in a single process). With
    sequence parallelism of `sp_size`, the share of this rank's group: ranks g·sp … g·sp + sp - 1 share
    the rows of data-parallel rank g of world / sp."""
    rank, world = _world()
    return list(range(*share_bounds(total, rank // sp_size, world // sp_size)))


def max_over_ranks(value: int) -> int:
    """The largest `value` any rank holds (e.g. a count of micro-batches that every rank must match)."""
    return max(all_gather_objects(int(value)))


def collective_device() -> torch.device:
    """Where a tensor must live for a collective: the rank's GPU under NCCL, the CPU under gloo."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
