"""Micro-batches replayed as CUDA graphs: one wrapper, `CudaGraphs`, around a function that reads only its
static inputs (`fwd_bwd(inputs) -> metrics`, or a no-grad forward), so that the host does not set the
update's pace: it launches a micro-batch's forward, loss, backward and gradient staging as one call
instead of ~2,000 kernels one by one. The functions it wraps do not know it exists
(`fulcrum.workers.forwards.ModelForwards.run` applies it, by the role's `cuda_graphs` key).

A graph has fixed shapes and fixed addresses.
- Shapes: each micro-batch is padded to a `Bucket` (`fulcrum.workers.graph_buckets`): tokens and response
  positions rounded up to 128, rows and sequences to 8, the padding masked out of every loss and metric;
  it costs at most 128 tokens of compute a micro-batch (2 % at the seed command's 6k).
- Addresses: each bucket's inputs are static device buffers the micro-batch is copied into; the bf16
  compute weights and a bf16 buffer the gradients are staged in stay resident
  (`ComputeWeights.keep_resident`: +2 GB a 0.5B model), the staged gradients added into the float32 ones
  by one kernel after each replay; the losses' mini-batch counts are 0-d device tensors filled before
  each replay.

The first micro-batch of a bucket runs eagerly on the capture stream (its result counts), then the same
step is captured; later micro-batches of the bucket replay it. A micro-batch whose bucket has no graph
replays a captured larger bucket instead when that costs at most `NEAR_SHARE` more work (`extra_work`):
micro-batches cut to a token budget spread over many buckets, and captures would go on for many steps.
All graphs of a device share one memory pool (they run one at a time), captured on one stream (`capture_stream`:
the allocator reuses a segment only on its own stream). A step that cannot be captured
turns graphs off for that model with a warning, and it goes on eagerly.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from fulcrum.batch import Batch, host_to_device
from fulcrum.models.lora import hf_name
from fulcrum.models.packed import PackedMicroBatch
from fulcrum.models.packed_recurrent import is_recurrent_mixer
from fulcrum.models.precision import ComputeWeights
from fulcrum.parallel.fsdp import several_processes
from fulcrum.workers.graph_buckets import Bucket, extra_work, fits, padded_inputs
from fulcrum.workers.micro_batch import MicroInputs

logger = logging.getLogger(__name__)

# A micro-batch whose bucket has no graph replays a captured larger one instead of capturing its own while
# the extra work is within this share of its own (`extra_work`): a capture costs the host about what an
# eager micro-batch does, and micro-batches cut to a token budget spread over many (tokens, responses)
# buckets, so that captures went on for steps (9-10 a step at the seed command's step 7).
NEAR_SHARE = 1 / 32
# Graphs kept per model; beyond that a micro-batch whose bucket has none replays the captured bucket it
# fits (`fits`) with the least extra work, however much, else runs eagerly, unpadded.
MAX_GRAPHS = 128
# Graphs keep a model's bf16 compute weights and a bf16 gradient buffer resident (4 B a trained parameter,
# 2 B a frozen one: `resident_bytes`) and a memory pool as large as an update micro-batch's work. A model
# graphs only while those bytes stay within this share of the device:
# the small models whose micro-batches the host bounds (a 0.5B model takes a few % of a data-centre
# GPU); a larger model, or a smaller device, keeps that memory for activations and the KV cache, and runs
# eagerly.
MAX_RESIDENT_SHARE = 0.05


def graphs_refused(
    model: torch.nn.Module,
    device: torch.device,
    enabled: bool,
    packed: bool,
    compute: ComputeWeights | None,
    sp: object | None,
) -> str | None:
    """Why `model` runs its micro-batches eagerly, or None when they can be graphed: its `cuda_graphs` key
    on (`enabled`), on CUDA, `packed`, with `compute` weights of its own (not FSDP-sharded), in one
    process, without sequence parallelism (`sp`), linear-attention layers or LoRA adapters, when what it keeps resident fits
    `MAX_RESIDENT_SHARE` of the device. (Each of these is a reason the key is ignored, not refused: the
    key is on by default, and CPU, multi-process, LoRA and Ulysses runs train the same eagerly.)"""
    if not enabled:
        return "its cuda_graphs key is false"
    if device.type != "cuda":
        return "not on CUDA"
    if not packed:
        return "padded micro-batches (use_remove_padding=False or an architecture without packing)"
    if compute is None:
        return "no compute copies of its own (FSDP-sharded)"
    if sp is not None:
        return "sequence parallelism"
    if any(is_recurrent_mixer(module) for module in model.modules()):
        # flash-linear-attention's varlen kernels size their grids on the host from each micro-batch's
        # sequence lengths (cached by the offsets tensor): a replay would keep the captured ones.
        return "linear-attention layers (their kernels are sized from each micro-batch's sequence lengths)"
    if several_processes():
        return "several processes (graphs are measured in one process only)"
    if any(hf_name(name) is None for name, _ in model.named_parameters()):  # adapter tensors
        return "LoRA adapters (the reference runs the same model with them switched off on the host)"
    kept, total = resident_bytes(compute), torch.cuda.get_device_properties(device).total_memory
    if kept > MAX_RESIDENT_SHARE * total:
        return f"it would keep {kept / 2**30:.1f} GiB resident, over {MAX_RESIDENT_SHARE:.0%} of the device"
    return None


def resident_bytes(compute: ComputeWeights) -> int:
    """What graphs keep resident for a model: its compute copies, and for the trained ones a staging buffer
    of their gradients (bf16: 2 + 2 B a trained parameter, 2 B a frozen one, e.g. a reference's)."""
    size = compute.dtype.itemsize
    return sum(size * m.numel() * (2 if m.requires_grad else 1) for m in compute.masters)


class Outputs(NamedTuple):
    """How a function's outputs (tensors and floats in tuples and dicts) are rebuilt from a graph's static
    outputs: the 0-d device tensors (metrics) stacked into one float32 tensor, so one copy takes them all
    out of the graph; the other device tensors (per row) each an output; the rest constants of the step
    (a graph would not recompute a host value)."""

    spec: TreeSpec
    scalars: list[int]
    rows: list[int]
    consts: dict[int, object]

    @staticmethod
    def of(out: object) -> tuple[tuple[torch.Tensor, ...], Outputs]:
        leaves, spec = tree_flatten(out)
        on_device = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.is_cuda]
        scalars = [i for i in on_device if leaves[i].dim() == 0]
        rows = [i for i in on_device if leaves[i].dim() > 0]
        consts = {
            i: float(x) if isinstance(x, torch.Tensor) else x
            for i, x in enumerate(leaves)
            if i not in on_device
        }
        stacked = torch.stack([leaves[i].detach().float() for i in scalars]) if scalars else torch.zeros(0)
        return (stacked, *(leaves[i].detach() for i in rows)), Outputs(spec, scalars, rows, consts)

    def rebuild(self, outs: tuple[torch.Tensor, ...], n_rows: int) -> Any:
        """The function's outputs from `outs`, copied out (each per-row tensor's first `n_rows` rows)."""
        leaves: list[object] = [None] * self.spec.num_leaves
        for i, value in self.consts.items():
            leaves[i] = value
        for i, value in zip(self.scalars, outs[0].clone().unbind(), strict=True):
            leaves[i] = value
        for i, value in zip(self.rows, outs[1:], strict=True):
            leaves[i] = value[:n_rows].clone()
        return tree_unflatten(leaves, self.spec)


class Captured:
    """One bucket's graph: its static inputs and outputs, and how the function's outputs are rebuilt."""

    def __init__(
        self,
        graph: torch.cuda.CUDAGraph,
        inputs: MicroInputs,
        outs: tuple[torch.Tensor, ...],
        layout: Outputs,
    ) -> None:
        self.graph, self.inputs, self.outs, self.layout = graph, inputs, outs, layout

    def replay(self, packed: PackedMicroBatch, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Copy a padded micro-batch into the static inputs (asynchronously, from pinned memory) and
        replay; the caller takes what it keeps out of the outputs before another graph of the pool runs."""
        static = self.inputs.packed
        assert static is not None
        for field in fields(static):
            target = getattr(static, field.name)
            if isinstance(target, torch.Tensor):
                target.copy_(getattr(packed, field.name).pin_memory(), non_blocking=True)
        for key, value in rows.items():
            self.inputs.rows[key].copy_(value.pin_memory(), non_blocking=True)
        self.graph.replay()
        return self.outs


_POOLS: dict[torch.device, tuple[object, weakref.WeakSet[CudaGraphs]]] = {}


def shared_pool(owner: CudaGraphs) -> object:
    """One graph memory pool per device, shared by the models' graphs (they never run one beside another),
    while one of them holds a graph. Once every graph of a pool is gone (its models' graphs dropped, or
    its first capture failed), torch frees the pool at its next cache flush and refuses captures into
    it (an allocator assertion): the next capture takes a new pool."""
    handle, owners = _POOLS.get(owner.device, (None, weakref.WeakSet()))
    if handle is None or not any(o.graphs for o in owners):
        handle, owners = torch.cuda.graph_pool_handle(), weakref.WeakSet()
        _POOLS[owner.device] = (handle, owners)
    owners.add(owner)
    return handle


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One capture stream per device, for every model's captures and their eager first runs. The caching
    allocator hands a segment only to allocations on the stream it was made for: captures on a stream of
    each model's would grow the shared pool by each model's work (the pool the sum of the models' largest
    micro-batches, not the largest), and each eager run's cached blocks would serve its own model only."""
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def capture_graph(
    fn: Callable[[], tuple[torch.Tensor, ...]], pool: object, stream: torch.cuda.Stream
) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
    """`fn`'s kernels captured on `stream` into `pool`; the graph and `fn`'s outputs (its static
    outputs). Not `torch.cuda.graph`: that context waits for the whole device and empties the device and
    pinned-memory caches at every capture, so a capture in the middle of an update drained the queue of
    launched micro-batches (the GPU idle until the host launched again), and the allocations after it,
    device and pinned, were made anew. The stream has run `fn` once eagerly (its workspaces exist) and
    waits for the current stream; the graph's memory comes from the pool, never from those caches."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(pool, capture_error_mode="thread_local")
        try:
            outs = fn()
        finally:
            graph.capture_end()
    return graph, outs


@dataclass
class CaptureTally:
    """Graphs captured (and the host seconds their captures took) since the step's metrics last read them,
    over every model of the process (`capture_metrics`)."""

    graphs: int = 0
    seconds: float = 0.0
    # A graph was captured: the metrics are logged from then on (0 once every bucket has one).
    built: bool = False
    pool_gib: float = 0.0  # what the shared pools reserved after the last capture


TALLY = CaptureTally()


def pool_reserved_bytes(field: str = "total_size") -> int:
    """Bytes the graphs' shared pools (one a device, `shared_pool`) reserve now, from the allocator's
    snapshot of each pool that a live graph holds; `field="allocated_size"`: the bytes of the tensors
    alive in them (the graphs' outputs and static inputs; the rest is the captured passes' work)."""
    return sum(
        segment.get(field, 0)
        for handle, owners in _POOLS.values()
        if any(o.graphs for o in owners)
        for segment in torch.cuda.memory_snapshot(mempool_id=handle)
    )


def note_capture(seconds: float) -> None:
    """A graph was captured in `seconds`: counted for `capture_metrics`, and the shared pools read once
    (only a capture grows them)."""
    TALLY.graphs, TALLY.seconds, TALLY.built = TALLY.graphs + 1, TALLY.seconds + seconds, True
    TALLY.pool_gib = pool_reserved_bytes() / 2**30


def capture_metrics() -> dict[str, float]:
    """perf/graph_captures and perf/graph_capture_s: graphs captured since the last step's metrics and the
    seconds their captures took (each bucket's first micro-batch runs eagerly besides, counted in its
    phase as any micro-batch); perf/cuda_graph_pool_reserved_gb: what the shared pools reserve (memory
    `perf/max_memory_allocated_gb` does not show), read again only after a step that captured, as only a
    capture grows a pool. Captures are the early steps' cost; nothing when no model has graphs."""
    if not TALLY.built:
        return {}
    out = {
        "perf/graph_captures": float(TALLY.graphs),
        "perf/graph_capture_s": TALLY.seconds,
        "perf/cuda_graph_pool_reserved_gb": TALLY.pool_gib,
    }
    TALLY.graphs, TALLY.seconds = 0, 0.0
    return out


class CudaGraphs:
    """The graphs of one model's micro-batches (its updates' steps and its no-grad forwards), by (bucket,
    the columns they read, the function, what else shapes it). Calling it runs a function on a
    micro-batch as a graph: replayed when its bucket has one, else run eagerly and captured."""

    def __init__(self, device: torch.device, compute: ComputeWeights, limit: int = MAX_GRAPHS) -> None:
        self.device = device
        self.compute = compute
        self.compute.keep_resident()
        self.limit = limit
        self.graphs: dict[tuple[object, ...], Captured] = {}
        self.failed: str | None = None  # why capturing stopped (then every micro-batch runs eagerly)
        self.counts: dict[str, torch.Tensor] = {}  # the losses' mini-batch counts, as 0-d device tensors
        self.replays = 0
        self._filled: dict[str, float] = {}

    def __call__(
        self,
        mb: Batch,
        keys: list[str],
        fn: Callable[..., Any],
        static: tuple[object, ...],
        agg: Mapping[str, float],
        train: bool,
    ) -> Any:
        """`fn(inputs, *static)` on `mb` padded to its bucket (its (B, R) columns `keys`, the counts `agg`
        in 0-d device tensors), its outputs copied out (per-row ones cut to `mb`'s rows); `train`: its
        gradients staged for the update's `accumulate_grads`. None when not graphed: capturing failed
        once, or `limit` graphs exist and none fits; the caller runs `fn` eagerly."""
        if self.failed is not None:
            return None
        if agg:  # an update's (a no-grad forward has none)
            self.fill_counts(agg)
        shape = (fn, static, tuple(sorted(agg)), train)
        keys = list(dict.fromkeys(["response_mask", *keys]))

        def choose(packed: PackedMicroBatch, own: Bucket) -> Bucket:
            """Its own bucket when captured; else the captured bucket it fits with the least extra work,
            when that is within `NEAR_SHARE` of its own (or `limit` graphs exist); else its own."""
            if (own, tuple(keys), shape) in self.graphs:
                return own
            larger = [k[0] for k in self.graphs if k[1:] == (tuple(keys), shape) and fits(packed, k[0])]
            best = min(larger, key=lambda b: extra_work(b, own), default=own)
            if len(self.graphs) >= self.limit or extra_work(best, own) <= NEAR_SHARE * own.tokens:
                return best
            return own

        def body(inputs: MicroInputs) -> Any:
            out = fn(inputs, *static)
            if train:
                self.compute.stage_pending_grads()
            return out

        bucket, packed, rows = padded_inputs(mb, keys, choose)
        key = (bucket, tuple(keys), shape)
        captured = self.graphs.get(key)
        if captured is not None:
            self.replays += 1
            out = captured.layout.rebuild(captured.replay(packed, rows), len(mb))
        elif len(self.graphs) >= self.limit:
            return None
        else:
            counts = {name: self.counts[name] for name in agg}
            out = self.capture(key, MicroInputs(rows, counts, packed, packed), body, len(mb))
        if train:
            self.compute.mark_staged()  # the update's `accumulate_grads` adds them into the float32 ones
        return out

    def fill_counts(self, agg: Mapping[str, float]) -> None:
        """The mini-batch's counts into their device tensors (a launch each, when they change)."""
        if agg == self._filled:
            return
        self._filled = dict(agg)
        for name, value in agg.items():
            if name not in self.counts:
                self.counts[name] = torch.zeros((), dtype=torch.float32, device=self.device)
            self.counts[name].fill_(value)

    def capture(
        self, key: tuple[object, ...], padded: MicroInputs, body: Callable[[MicroInputs], Any], n_rows: int
    ) -> Any:
        """`body` on the micro-batch `padded` (on the host; its counts on the device), run eagerly and
        captured on the graphs' stream; its outputs (per-row ones cut to `n_rows`)."""
        device = self.device
        assert padded.packed is not None
        static = padded.packed.to(device)
        rows = {k: host_to_device(v, device) for k, v in padded.rows.items()}
        inputs = MicroInputs(rows, padded.agg, static, static)
        stream, current = capture_stream(device), torch.cuda.current_stream(device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):  # this micro-batch, eagerly, on the stream the capture uses
            outs, layout = Outputs.of(body(inputs))
            out = layout.rebuild(outs, n_rows)
        current.wait_stream(stream)
        started = time.perf_counter()
        try:
            graph, static = capture_graph(lambda: Outputs.of(body(inputs))[0], shared_pool(self), stream)
        except Exception as err:  # any capture failure: go on eagerly, say why once
            self.compute.discard_pending()
            self.failed = f"{type(err).__name__}: {err}"
            logger.warning(
                "CUDA graphs for this model's micro-batches are off (one could not be captured: %s); its "
                "passes run eagerly. Its role's cuda_graphs=false (e.g. actor_rollout_ref.actor.cuda_graphs) "
                "turns them off.",
                self.failed,
            )
            return out
        self.graphs[key] = Captured(graph, inputs, static, layout)
        took = time.perf_counter() - started
        note_capture(took)
        logger.info(
            "captured a micro-batch of %s (%s) in %.2f s (%d graphs, %d replays so far; the graphs' pool "
            "%.2f GiB)",
            key[0],
            "update" if key[2][3] else "forward",
            took,
            len(self.graphs),
            self.replays,
            TALLY.pool_gib,
        )
        return out
