"""Training micro-batches replayed as CUDA graphs: an update whose pace the host does not set.

Why: at the seed command's micro-batches of 8 (about 6k tokens) the host launches each micro-batch's
~2,000 kernels one by one, and only just keeps ahead of the GPU (a micro-batch's host time 1.72 s an
update against 1.74 s of GPU span, BENCHMARKS.md "The update's parts"): a host slowed by other processes
slowed the update 1.7-4x ("A host under load"). A CUDA graph launches a micro-batch's forward, loss,
backward and gradient accumulation as one call.

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
All graphs of the process share one memory pool (they run one at a time). A step that cannot be captured
(a loss that reads a value on the host) turns graphs off for that model with a warning, and the update
goes on eagerly.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

import torch

from fulcrum.batch import Batch, host_to_device
from fulcrum.models.lora import hf_name
from fulcrum.models.packed import PackedMicroBatch
from fulcrum.parallel.fsdp import several_processes
from fulcrum.workers.graph_buckets import Bucket, extra_work, fits, padded_inputs
from fulcrum.workers.micro_batch import DeviceInputs, HostInputs, MicroInputs

if TYPE_CHECKING:
    from fulcrum.models.precision import ComputeWeights


class Forwards(Protocol):
    """What graphs read of `fulcrum.workers.forwards.ModelForwards` (which holds them)."""

    model: torch.nn.Module
    device: torch.device
    cuda_graphs: bool  # the role's `cuda_graphs` key
    packed: bool
    compute: ComputeWeights | None
    sp: object | None


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
# the small models whose micro-batches the host bounds (0.5B on an H200: 2 %); a larger model, or a
# smaller device, keeps that memory for activations and the KV cache, and runs eagerly.
MAX_RESIDENT_SHARE = 0.05

# The key that switches each role's graphs (the reference's and the critic's follow the actor's).
GRAPH_KEYS = {
    "actor": "actor_rollout_ref.actor.cuda_graphs",
    "critic": "critic.cuda_graphs",
    "reference": "actor_rollout_ref.ref.cuda_graphs",
}

Metrics = dict[str, torch.Tensor | float]
StepFn = Callable[[MicroInputs, dict[str, float | torch.Tensor]], Metrics]


def graphs_for(forwards: Forwards) -> StepGraphs | None:
    """A `StepGraphs` for the model behind `forwards` when its micro-batches can be graphed
    (`graphs_refused` says why not), else None."""
    return None if graphs_refused(forwards) is not None else StepGraphs(forwards)


def graphs_refused(forwards: Forwards) -> str | None:
    """Why the model behind `forwards` runs its micro-batches eagerly, or None when they can be graphed:
    its `cuda_graphs` key on, on CUDA, packed, with compute weights of its own (not FSDP-sharded), in
    one process, without sequence parallelism or LoRA adapters, when what it keeps resident fits
    `MAX_RESIDENT_SHARE` of the device. (Each of these is a reason the key is ignored, not refused: the
    key is on by default, and CPU, multi-process, LoRA and Ulysses runs train the same eagerly.)"""
    if not forwards.cuda_graphs:
        return "its cuda_graphs key is false"
    if forwards.device.type != "cuda":
        return "not on CUDA"
    if not forwards.packed:
        return "padded micro-batches (use_remove_padding=False or an architecture without packing)"
    if forwards.compute is None:
        return "no compute copies of its own (FSDP-sharded)"
    if forwards.sp is not None:
        return "sequence parallelism"
    if several_processes():
        return "several processes (graphs are measured in one process only)"
    if any(hf_name(name) is None for name, _ in forwards.model.named_parameters()):  # adapter tensors
        return "LoRA adapters (the reference runs the same model with them switched off on the host)"
    kept, device = (
        resident_bytes(forwards.compute),
        torch.cuda.get_device_properties(forwards.device).total_memory,
    )
    if kept > MAX_RESIDENT_SHARE * device:
        return f"it would keep {kept / 2**30:.1f} GiB resident, over {MAX_RESIDENT_SHARE:.0%} of the device"
    return None


def startup_line(trainer: Any) -> str | None:
    """One line for the run's start on CUDA: which of the trainer's models (its `actor`, `critic` and
    `ref`, those it has) replay their micro-batches as CUDA graphs, what that keeps resident, and why
    the others do not."""
    forwards = {"actor": trainer.actor.forwards}
    if trainer.critic is not None:
        forwards["critic"] = trainer.critic.forwards
    if trainer.ref is not None and trainer.ref.forwards is not trainer.actor.forwards:  # LoRA's: the actor's
        forwards["reference"] = trainer.ref.forwards
    return graphs_line(forwards)


def graphs_line(forwards: dict[str, Forwards]) -> str | None:
    """`startup_line` of these roles' forwards (None when none runs on CUDA)."""
    if not any(f.device.type == "cuda" for f in forwards.values()):
        return None
    parts = []
    for role, f in forwards.items():
        reason = graphs_refused(f)
        if reason is None:
            assert f.compute is not None
            parts.append(f"{role} on ({resident_bytes(f.compute) / 2**30:.1f} GiB kept resident)")
        else:
            parts.append(f"{role} off ({reason})")
    keys = ", ".join(GRAPH_KEYS[role] for role in forwards)
    return "CUDA graphs of the micro-batches: " + ", ".join(parts) + f" [{keys}]"


def micro_step(
    graphs: StepGraphs | None,
    mb: Batch,
    agg: dict[str, float],
    keys: list[str],
    flags: tuple[object, ...],
    loss_step: StepFn,
    device: torch.device,
) -> Metrics:
    """A worker's update micro-batch: `loss_step` replayed from `graphs` (reading `mb`'s (B, R) columns
    `keys`) where they can take it, else run eagerly on the micro-batch as the host holds it."""
    out = None if graphs is None else graphs.step(mb, agg, keys, flags, loss_step)
    return out if out is not None else loss_step(HostInputs(mb, device), agg)


def forward_micro(
    graphs: StepGraphs | None,
    mb: Batch,
    flags: tuple[object, ...],
    forward: Callable[[MicroInputs], tuple[torch.Tensor, ...]],
    device: torch.device,
) -> tuple[torch.Tensor, ...]:
    """A no-grad pass's micro-batch, as `micro_step` an update's: `forward` (reading the response mask
    and the stream) replayed from `graphs` where they can take it, else eager."""
    out = None if graphs is None else graphs.forward(mb, ["response_mask"], flags, forward)
    return out if out is not None else forward(HostInputs(mb, device))


def resident_bytes(compute: ComputeWeights) -> int:
    """What graphs keep resident for a model: its compute copies, and for the trained ones a staging buffer
    of their gradients (bf16: 2 + 2 B a trained parameter, 2 B a frozen one, e.g. a reference's)."""
    size = compute.dtype.itemsize
    return sum(size * m.numel() * (2 if m.requires_grad else 1) for m in compute.masters)


class Captured:
    """One bucket's graph: its static inputs and outputs, and what its step said besides (`extra`)."""

    def __init__(
        self, graph: torch.cuda.CUDAGraph, inputs: DeviceInputs, outs: tuple[torch.Tensor, ...], extra: object
    ) -> None:
        self.graph, self.inputs, self.outs, self.extra = graph, inputs, outs, extra

    def replay(self, packed: PackedMicroBatch, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Copy a padded micro-batch into the static inputs (asynchronously, from pinned memory) and
        replay; the caller takes what it keeps out of the outputs before another graph of the pool runs."""
        static = self.inputs.packed
        for field in fields(static):
            target = getattr(static, field.name)
            if isinstance(target, torch.Tensor):
                target.copy_(getattr(packed, field.name).pin_memory(), non_blocking=True)
        for key, value in rows.items():
            self.inputs.rows[key].copy_(value.pin_memory(), non_blocking=True)
        self.graph.replay()
        return self.outs


def split_metrics(out: Metrics) -> tuple[list[str], Metrics, torch.Tensor]:
    """A step's metrics as (names of the device tensors, the rest as constants, the device tensors
    stacked as float32). A host tensor is a constant of the step (a graph would not recompute it)."""
    names = [k for k, v in out.items() if isinstance(v, torch.Tensor) and v.is_cuda]
    consts = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in out.items() if k not in names}
    stacked = torch.stack([out[k].detach().float().reshape(()) for k in names])  # type: ignore[union-attr]
    return names, consts, stacked


def named_metrics(names: list[str], consts: Metrics, values: torch.Tensor) -> Metrics:
    return {**consts, **dict(zip(names, values.unbind(), strict=True))}


_POOLS: dict[torch.device, tuple[object, weakref.WeakSet[StepGraphs]]] = {}


def shared_pool(owner: StepGraphs) -> object:
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


GraphedFn = Callable[[DeviceInputs], tuple[tuple[torch.Tensor, ...], object]]


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


TALLY = CaptureTally()


def capture_metrics() -> dict[str, float]:
    """perf/graph_captures and perf/graph_capture_s: graphs captured since the last step's metrics and the
    seconds their captures took (each bucket's first micro-batch runs eagerly besides, counted in its
    phase as any micro-batch). Captures are the early steps' cost; nothing when no model has graphs."""
    if not TALLY.built:
        return {}
    out = {"perf/graph_captures": float(TALLY.graphs), "perf/graph_capture_s": TALLY.seconds}
    TALLY.graphs, TALLY.seconds = 0, 0.0
    return out


class StepGraphs:
    """The graphs of one model's micro-batches — its updates' steps (`step`) and its no-grad passes'
    forwards (`forward`) — by (bucket, the columns they read, what else shapes them)."""

    def __init__(self, forwards: Forwards, limit: int = MAX_GRAPHS) -> None:
        assert forwards.compute is not None
        self.device = forwards.device
        self.compute = forwards.compute
        self.compute.keep_resident()
        self.limit = limit
        self.graphs: dict[tuple[object, ...], Captured] = {}
        self.failed: str | None = None  # why capturing stopped (then every micro-batch runs eagerly)
        self.counts: dict[str, torch.Tensor] = {}  # the losses' mini-batch counts, as 0-d device tensors
        self.replays = 0
        self._filled: dict[str, float] = {}
        self._stream: torch.cuda.Stream | None = None

    def step(
        self, mb: Batch, agg: dict[str, float], keys: list[str], flags: tuple[object, ...], loss_step: StepFn
    ) -> Metrics | None:
        """An update's `loss_step` on `mb` (its (B, R) columns `keys`), its gradients staged for the
        update's `accumulate_grads`; the metrics. None: not graphed (see `graphed`), the caller runs it its own way."""
        self.fill_counts(agg)

        def fn(inputs: DeviceInputs) -> tuple[tuple[torch.Tensor, ...], object]:
            out = loss_step(inputs, dict(self.counts))
            self.compute.stage_pending_grads()
            names, consts, stacked = split_metrics(out)
            return (stacked,), (names, consts)

        got = self.graphed(mb, keys, ("update", flags, tuple(sorted(agg))), fn)
        if got is None:
            return None
        self.compute.mark_staged()  # the update's `accumulate_grads` adds them into the float32 ones
        (stacked,), (names, consts) = got  # type: ignore[misc]
        return named_metrics(names, consts, stacked.clone())

    def forward(
        self,
        mb: Batch,
        keys: list[str],
        flags: tuple[object, ...],
        fn: Callable[[DeviceInputs], tuple[torch.Tensor, ...]],
    ) -> tuple[torch.Tensor, ...] | None:
        """A no-grad pass's `fn` on `mb` (outputs (B, ...) per row): each output's rows of `mb`, copied out
        of the padded ones. None: not graphed."""
        got = self.graphed(mb, keys, ("forward", flags), lambda inputs: (fn(inputs), None))
        if got is None:
            return None
        return tuple(out[: len(mb)].clone() for out in got[0])

    def graphed(
        self, mb: Batch, keys: list[str], shape: tuple[object, ...], fn: GraphedFn
    ) -> tuple[tuple[torch.Tensor, ...], object] | None:
        """`fn` on `mb` padded to its bucket: replayed when the bucket has a graph, else run eagerly and
        captured. None when capturing failed once, or `limit` graphs exist and the bucket has none."""
        if self.failed is not None:
            return None

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

        bucket, packed, rows = padded_inputs(mb, keys, choose)
        key = (bucket, tuple(keys), shape)
        captured = self.graphs.get(key)
        if captured is not None:
            self.replays += 1
            return captured.replay(packed, rows), captured.extra
        if len(self.graphs) >= self.limit:
            return None
        return self.capture(key, packed, rows, fn)

    def fill_counts(self, agg: dict[str, float]) -> None:
        """The mini-batch's counts into their device tensors (a launch each, when they change)."""
        if agg == self._filled:
            return
        self._filled = dict(agg)
        for name, value in agg.items():
            if name not in self.counts:
                self.counts[name] = torch.zeros((), dtype=torch.float32, device=self.device)
            self.counts[name].fill_(value)

    def capture(
        self, key: tuple[object, ...], packed: PackedMicroBatch, rows: dict[str, torch.Tensor], fn: GraphedFn
    ) -> tuple[tuple[torch.Tensor, ...], object]:
        device = self.device
        inputs = DeviceInputs(packed.to(device), {k: host_to_device(v, device) for k, v in rows.items()})
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        stream, current = self._stream, torch.cuda.current_stream(device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):  # this micro-batch, eagerly, on the stream the capture uses
            outs, extra = fn(inputs)
            outs = tuple(out.clone() for out in outs)
        current.wait_stream(stream)
        started = time.perf_counter()
        try:
            graph, static = capture_graph(lambda: fn(inputs)[0], shared_pool(self), stream)
        except Exception as err:  # any capture failure: go on eagerly, say why once
            self.compute.discard_pending()
            self.failed = f"{type(err).__name__}: {err}"
            logger.warning(
                "CUDA graphs for this model's micro-batches are off (one could not be captured: %s); its "
                "passes run eagerly. Its role's cuda_graphs=false (e.g. actor_rollout_ref.actor.cuda_graphs) "
                "turns them off.",
                self.failed,
            )
            return outs, extra
        self.graphs[key] = Captured(graph, inputs, static, extra)
        took = time.perf_counter() - started
        TALLY.graphs, TALLY.seconds, TALLY.built = TALLY.graphs + 1, TALLY.seconds + took, True
        logger.info(
            "captured a micro-batch of %s (%s) in %.2f s (%d graphs, %d replays so far)",
            key[0],
            key[2][0],
            took,
            len(self.graphs),
            self.replays,
        )
        return outs, extra
