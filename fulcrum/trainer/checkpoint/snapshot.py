"""What a checkpoint writes of one role, taken between two steps: the state a writer thread can put on
disk while training goes on.

Training changes weights, optimiser moments and the tokenizer's backend settings in place, so a write
that runs beside it must read copies taken while nothing moves: `snapshot_role(role, copy=True)` copies
every tensor to the host (device → host for CUDA, a clone on the CPU) and reads the tokenizer's files
into memory. Tensors that share memory in the model (tied embeddings) share one copy, so the Hugging
Face writer still sees them as tied. With `copy=False` the snapshot refers to the live tensors, for a
write that finishes before the next step (no second host copy).

The copies go into `HostBuffers` kept from one save to the next: fresh host memory costs a page fault
per page at its first write, which makes copying into it several times slower than into memory
already touched, from the device most of all (docs/checkpoints.md). Saves never overlap (the next waits for the previous write), so one set of
buffers serves them all; the price is one checkpoint's size of host RAM held for the run instead of
during each write. `plan_role_buffers` and `HostBuffers.allocate` let the first save's buffers be mapped
beside training before it (`HostBuffers.prepare`). They are pageable memory, not pinned: torch's pinned
allocator rounds each tensor up to a power of two (up to 1.8× the state's size, page-locked).
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fulcrum.trainer.checkpoint.adapters import trained_outside_adapters
from fulcrum.trainer.checkpoint.sharded import GatheredModel

logger = logging.getLogger(__name__)


@dataclass
class RoleSnapshot:
    """One role as a checkpoint writes it: weights (or LoRA adapters), optimiser and schedule state,
    and the tokenizer's files. `model` keeps the live module for its config and `save_pretrained`;
    its `state_dict()` is the snapshot's."""

    model: GatheredModel
    optimizer_state: dict[str, Any] | None = None
    scheduler_state: dict[str, Any] | None = None
    tokenizer_files: dict[str, bytes] = field(default_factory=dict)
    adapters: Any = None  # fulcrum.models.lora.Adapters of a LoRA role
    adapter_state: dict[str, torch.Tensor] | None = None
    trained_weights: dict[str, torch.Tensor] | None = (
        None  # a LoRA role's trained tensors outside the adapters
    )

    def host_bytes(self) -> int:
        """Bytes of tensor data this snapshot holds (copies or references, as it was taken)."""
        parts = (self.model.state_dict(), self.optimizer_state, self.adapter_state, self.trained_weights)
        return sum(tensor_bytes(part) for part in parts)


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a nest of dicts, lists and tuples (each tensor counted where it appears)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def storage_ptr(tensor: torch.Tensor) -> int:
    """Where a tensor's memory starts (a DTensor's local shard): tensors that share it share memory."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.untyped_storage().data_ptr()


TensorKey = tuple[Any, ...]
Slot = tuple[str, int]  # a role's name and a tensor's place in the order its snapshot copies them


def tensor_key(tensor: torch.Tensor) -> TensorKey:
    """Where a tensor lives and how it is laid out: equal for views of one memory with one layout."""
    return (storage_ptr(tensor), tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype)


@dataclass(frozen=True)
class BufferPlan:
    """A host buffer a save will copy into: its slot (`HostBuffers`), the tensor's shape and dtype."""

    slot: Slot
    shape: torch.Size
    dtype: torch.dtype


class HostBuffers:
    """Host tensors that snapshots copy into, reused by every save (see the module docstring).

    A buffer belongs to a slot: the role being taken (`begin_role`) and the tensor's place in the order
    its snapshot copies them, which every save of a run repeats. Not to the tensor's device address:
    a tensor may move between saves (`fulcrum.workers.state_parking` re-allocates Adam's moments at
    every update), and two roles' temporaries (LoRA adapters' `state_dict` makes copies) can take each
    other's freed memory within one save. A save copies each tensor into its slot's buffer (allocated
    when new or of another shape) and, once every role is taken, `finish` drops the buffers it did not
    use, so a tensor the model replaced does not hold memory.
    """

    def __init__(self) -> None:
        self.buffers: dict[Slot, torch.Tensor] = {}
        self.used: set[Slot] = set()
        # While a walk plans (`plan_role_buffers`): the buffers `copy` was asked for; nothing is copied.
        self.planned: list[BufferPlan] | None = None
        self._preparing: threading.Thread | None = None  # `prepare`'s allocation, joined by the save
        self._role, self._next = "", 0  # the role being taken and its next tensor's place

    @property
    def prepared(self) -> bool:
        """Whether `prepare` ran (its allocation may still be under way)."""
        return self._preparing is not None

    def begin_role(self, name: str) -> None:
        """The tensors copied from now on are role `name`'s, numbered from 0 in the order they come."""
        self._role, self._next = name, 0

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of `tensor`, in the buffer kept for its slot (while planning: `tensor`, noted)."""
        source = tensor.detach()
        if type(source) is not torch.Tensor or not source.is_contiguous():
            # A DTensor or a strided view: a copy of its own, nothing to keep.
            return source if self.planned is not None else source.to("cpu", copy=True)
        slot = (self._role, self._next)
        self._next += 1
        if self.planned is not None:
            self.planned.append(BufferPlan(slot, source.shape, source.dtype))
            return source
        buffer = self.buffers.get(slot)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = self.buffers[slot] = torch.empty(source.shape, dtype=source.dtype)
        self.used.add(slot)
        return buffer.copy_(source)

    def allocate(self, plans: list[BufferPlan]) -> None:
        """The buffers of `plans` that are missing, allocated and zeroed: every page mapped, so that the
        save that copies into them pays no page faults. Safe on another thread until that save starts."""
        for plan in plans:
            if plan.slot not in self.buffers:
                self.buffers[plan.slot] = torch.empty(plan.shape, dtype=plan.dtype).zero_()

    def prepare(self, roles: dict[str, Any]) -> None:
        """Map the buffers the first save of `roles` copies into: planned here (`plan_role_buffers`, so
        call between two steps, after the optimisers' first step: their moments exist from then on),
        allocated on a thread beside the next steps, which `wait_prepared` (the save's first act) joins.
        That save's stall is then a copy into touched memory, without the page faults that dominate a
        copy into fresh host memory. Once per set of buffers: the caller asks `prepared` first (`CheckpointManager`, which also
        brings parked state back before the plan reads it). Roles whose snapshot copies tensors made for
        it (LoRA adapters, gathered shards: a plan would make those copies for nothing) are left to the
        save."""
        assert self._preparing is None, "HostBuffers.prepare runs once; ask `prepared` first"
        plans = [
            plan
            for name, role in roles.items()
            if getattr(role, "adapters", None) is None and getattr(role, "live_model", None) is None
            for plan in plan_role_buffers(role, self, name)
        ]
        self._preparing = threading.Thread(
            target=self._allocate_beside, args=(plans,), name="fulcrum-checkpoint-prepare"
        )
        self._preparing.start()

    def _allocate_beside(self, plans: list[BufferPlan]) -> None:
        try:
            self.allocate(plans)
        except Exception as exc:  # the save allocates what is missing; nothing is lost
            logger.warning("checkpoint host buffers not prepared ahead of the first save: %s", exc)

    def wait_prepared(self) -> None:
        """Block until `prepare`'s thread (if any) has allocated its buffers."""
        if self._preparing is not None:
            self._preparing.join()

    def finish(self) -> None:
        """Free the buffers this save left unused."""
        for slot in set(self.buffers) - self.used:
            del self.buffers[slot]
        self.used.clear()
        self.begin_role("")


def host_copies(
    obj: Any,
    needs_copy: Callable[[torch.Tensor], bool] = lambda _: True,
    buffers: HostBuffers | None = None,
) -> Any:
    """`obj` (dicts, lists, tuples, tensors, immutable leaves) rebuilt with every tensor that
    `needs_copy` picks replaced by a host copy (in `buffers`' memory when given); the containers are
    new, so later changes to the live ones (a scheduler's lists) do not reach it. Views of the same
    memory with the same layout (tied weights) become one copy, so the writer still sees one tensor
    under two names."""
    copies: dict[TensorKey, torch.Tensor] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if not needs_copy(value):
                return value
            key = tensor_key(value)
            if key not in copies:
                if buffers is not None:
                    copies[key] = buffers.copy(value)
                else:
                    copies[key] = value.detach().to("cpu", copy=True)
            return copies[key]
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, tuple):
            return tuple(walk(v) for v in value)
        return value

    return walk(obj)


def live_storages(tensors: Iterable[Any]) -> set[int]:
    """The memory of the live tensors in `tensors` (nests walked as in `host_copies`)."""
    found: set[int] = set()

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            found.add(storage_ptr(value))
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v)

    for item in tensors:
        walk(item)
    return found


def tokenizer_files(tokenizer: Any) -> dict[str, bytes]:
    """The files `tokenizer.save_pretrained` writes, read into memory (name → bytes). Taken between
    steps: while a batch is encoded, a fast tokenizer's backend holds that call's padding and
    truncation, which its `tokenizer.json` would record."""
    if tokenizer is None:
        return {}
    with tempfile.TemporaryDirectory(prefix="fulcrum-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        return {
            str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()
        }


def copy_rule(role: Any, copy: bool) -> Callable[[torch.Tensor], bool]:
    """Which of `role`'s tensors a snapshot copies: none (`copy=False`), all of a worker's, or of a
    `sharded.GatheredRole` only those its gather returned as they are (on the device, or the live
    tensors themselves, like Adam's step counts): the rest are already private host copies."""
    if not copy:
        return lambda _: False
    live_model = getattr(role, "live_model", None)
    if live_model is None:
        return lambda _: True
    live_optimizer = getattr(role, "live_optimizer", None)
    live = live_storages(
        [live_model.state_dict(), live_optimizer.state if live_optimizer is not None else {}]
    )
    return lambda t: t.device.type != "cpu" or storage_ptr(t) in live


def plan_role_buffers(role: Any, buffers: HostBuffers, name: str = "") -> list[BufferPlan]:
    """The buffers a background snapshot of `role` copies into: `snapshot_role`'s own walk, with
    `buffers` noting each tensor instead of copying it. On the training thread, between two steps, as
    the snapshot itself (it also reads the tokenizer and the schedule, which a step may be using)."""
    buffers.planned = []
    try:
        snapshot_role(role, copy=True, buffers=buffers, name=name)
        return buffers.planned
    finally:
        buffers.planned = None
        buffers.begin_role("")


def snapshot_role(role: Any, copy: bool, buffers: HostBuffers | None = None, name: str = "") -> RoleSnapshot:
    """What the checkpoint writes of `role` (a worker, or `sharded.GatheredRole` on rank 0), with host
    copies of its tensors when `copy` (see the module docstring and `copy_rule`), in `buffers` when
    given, under the role's `name` (the caller then calls `buffers.finish()` once every role is taken)."""
    if buffers is not None:
        buffers.begin_role(name)
    needs_copy = copy_rule(role, copy)
    optimizer = getattr(role, "optimizer", None)
    scheduler = getattr(role, "lr_scheduler", None)
    adapters = getattr(role, "adapters", None)
    weights: dict[str, torch.Tensor] = {}
    adapter_state = trained = None
    if adapters is None:
        weights = host_copies(dict(role.model.state_dict()), needs_copy, buffers)
    else:  # the frozen base is not written: only the adapters and the other trained tensors
        state = getattr(role, "adapter_state", None)
        adapter_state = host_copies(
            state if state is not None else adapters.state_dict(), needs_copy, buffers
        )
        gathered = getattr(role, "trained_weights", None)  # a sharded role's, gathered by every rank
        trained = host_copies(
            gathered if gathered is not None else trained_outside_adapters(role.model, adapters),
            needs_copy,
            buffers,
        )
    return RoleSnapshot(
        model=GatheredModel(role.model, weights),
        optimizer_state=(
            host_copies(optimizer.state_dict(), needs_copy, buffers) if optimizer is not None else None
        ),
        scheduler_state=host_copies(scheduler.state_dict()) if scheduler is not None else None,
        tokenizer_files=tokenizer_files(getattr(role, "tokenizer", None)),
        adapters=adapters,
        adapter_state=adapter_state,
        trained_weights=trained,
    )
