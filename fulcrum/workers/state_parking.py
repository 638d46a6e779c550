"""The optimiser state of the model that is not being updated, parked in pinned host memory.

PPO updates two models one after the other (the critic, then the actor). Adam's two moments are read
only by each model's own optimiser steps, so while one model trains, the other's moments (8 B a
parameter: 3.7 GiB for a 0.5B model) can wait in host memory. At the start of a model's update the
other models' moments are copied out and their device memory released, then its own copied back, all
on a copy stream: the copies run beside the update's first micro-batches (its first optimiser step
comes after a whole mini-batch of forwards and backwards), and the step waits for them on the device,
never on the host. The update's peak falls by the other model's moments.

The host copies of a model's moments are views of one pinned block, pinned on a thread when the
optimiser is registered (the run's start): pinning gigabytes takes seconds, which an update would
otherwise pay on the step that first parks a model's moments.

On by default (`trainer.park_optimizer_state=false` turns it off; BENCHMARKS.md has its figures), and a
GPU run that checkpoints every step writes the live state and resumes from it
(tests/test_state_parking.py). (The moments come back at new device
addresses; a background save's host buffers are kept by the tensor's place in the snapshot, not by its
address, so each save still copies into mapped memory.)
One process, CUDA, and at least two optimisers with state: with one model (GRPO) nothing is parked.
The tensors stay the optimiser's own (their storage is released and re-allocated in place, as FSDP2
does with unsharded parameters), so the fused step's tensor lists and `state_dict()` see the same
objects; anything that reads the state outside an update calls `restore_all` first (the trainer makes
it the checkpoints' `before_reading_state`; a resume loads before any update has parked anything).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fulcrum.rollout.native.kernels import next_pow2

logger = logging.getLogger(__name__)

# The share of the host's available memory the parked moments may pin: pinned pages cannot be swapped,
# and the host also holds the batch, the data set and a background checkpoint's snapshot.
HOST_SHARE = 0.25
# Each host copy starts on a multiple of this many bytes in its block: any dtype can view it.
ALIGN = 64


@dataclass
class ParkedState:
    """One optimiser and its moments: the device tensors and their pinned host copies, position by position."""

    optimizer: torch.optim.Optimizer
    tensors: list[torch.Tensor] = field(default_factory=list)
    host: list[torch.Tensor] = field(default_factory=list)
    parked: bool = False
    arrived: torch.cuda.Event | None = None  # recorded on the copy stream after the last copy back
    block: torch.Tensor | None = None  # pinned bytes that `host` are views of
    pinning: threading.Thread | None = None  # `pin`'s thread, joined by the first park

    def pin(self, nbytes: int) -> None:
        """Pin `nbytes` of host memory as `block` (on a thread: torch releases the GIL meanwhile)."""
        try:
            self.block = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as err:  # the park then pins each copy itself, on the step
            logger.warning("optimiser state parking: could not pin %.1f GB ahead (%s)", nbytes / 1e9, err)

    def host_copies(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Pinned host tensors shaped as `tensors`: views of `block` when it holds them all (it was
        sized for the optimiser's moments), else pinned one by one."""
        if self.pinning is not None:
            self.pinning.join()
            self.pinning = None
        views = carve(self.block, tensors) if self.block is not None else None
        if views is None:
            return [torch.empty_like(t, device="cpu", pin_memory=True) for t in tensors]
        return views


class OptimizerStateParking:
    """Parks the moments of every registered optimiser but the one whose update runs (`activate`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)
        self.states: dict[int, ParkedState] = {}  # by id(optimizer)

    def register(self, optimizer: torch.optim.Optimizer) -> None:
        """Park `optimizer`'s moments whenever another registered optimiser's update runs; their host
        block is pinned from now on, on a thread."""
        state = self.states[id(optimizer)] = ParkedState(optimizer)
        state.pinning = threading.Thread(
            target=state.pin, args=(moment_bytes(optimizer),), name="fulcrum-park-pin", daemon=True
        )
        state.pinning.start()

    def activate(self, optimizer: torch.optim.Optimizer) -> None:
        """At the start of `optimizer`'s update: every other optimiser's moments to the host, then its
        own back to the device, on the copy stream; `before_step` makes the step wait for them."""
        if id(optimizer) not in self.states:
            return
        compute = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_stream(compute)  # the other models' last steps wrote their moments
        with torch.cuda.stream(self.copy_stream):
            for key, state in self.states.items():
                if key != id(optimizer):
                    self._park(state)
            self._bring_back(self.states[id(optimizer)])

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The compute stream waits (on the device) for `optimizer`'s moments to be back."""
        state = self.states.get(id(optimizer))
        if state is not None and state.arrived is not None:
            torch.cuda.current_stream(self.device).wait_event(state.arrived)
            state.arrived = None

    def restore_all(self) -> None:
        """Every optimiser's moments back on the device, the compute stream ordered after the copies:
        before anything reads an optimiser's state outside its update (a checkpoint)."""
        with torch.cuda.stream(self.copy_stream):
            for state in self.states.values():
                self._bring_back(state)
        torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        for state in self.states.values():
            state.arrived = None

    def _park(self, state: ParkedState) -> None:
        """On the copy stream: the moments into their host copies, then their device memory released
        (`record_stream`: the allocator reuses it only once the copy out has run)."""
        if state.parked:
            return
        tensors = moment_tensors(state.optimizer)
        if not tensors:
            return
        if not _same_tensors(state.tensors, tensors):  # first park, or the state was replaced (a load)
            state.tensors = tensors
            state.host = state.host_copies(tensors)
        for tensor, host in zip(state.tensors, state.host, strict=True):
            host.copy_(tensor, non_blocking=True)
        for tensor in state.tensors:
            tensor.record_stream(self.copy_stream)
            tensor.untyped_storage().resize_(0)
        state.parked = True

    def _bring_back(self, state: ParkedState) -> None:
        """On the copy stream: device memory for the moments again, filled from the host copies."""
        if not state.parked:
            return
        for tensor, host in zip(state.tensors, state.host, strict=True):
            # The tensor's own bytes (it owns its storage whole), not the host view's storage: the block.
            tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
            tensor.copy_(host, non_blocking=True)
        state.arrived = torch.cuda.Event()
        state.arrived.record(self.copy_stream)
        state.parked = False


def park_between_updates(
    workers: Sequence[Any], device: torch.device, distributed: bool, host_available: int | None, enabled: bool
) -> OptimizerStateParking | None:
    """A parking for the optimisers of `workers` (each gets it as `.parking`) when it is on (`enabled`:
    trainer.park_optimizer_state) and can help: one process on CUDA (FSDP's `optimizer_offload` is the
    several-rank tool), two or more optimisers, and their moments' pinned copies within `HOST_SHARE` of
    `host_available` bytes of host memory (None: not known, not checked). Elsewhere the key is ignored:
    the state stays on the device."""
    trained = [w for w in workers if getattr(w, "optimizer", None) is not None]
    if not enabled or device.type != "cuda" or distributed or len(trained) < 2:
        return None
    # torch's pinned allocator rounds each block up to a power of two: one block an optimiser.
    moments = sum(next_pow2(moment_bytes(w.optimizer)) for w in trained)
    if host_available is not None and moments > HOST_SHARE * host_available:
        logger.info(
            "optimiser state kept on the GPU between updates: its %.1f GB would pin more than %d%% of the "
            "host's %.1f GB available",
            moments / 1e9,
            HOST_SHARE * 100,
            host_available / 1e9,
        )
        return None
    parking = OptimizerStateParking(device)
    for worker in trained:
        parking.register(worker.optimizer)
        worker.parking = parking
    return parking


def moment_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimiser's per-parameter state tensors on CUDA but the step counts (Adam's `exp_avg`,
    `exp_avg_sq`, `max_exp_avg_sq`), in the optimiser's parameter order."""
    tensors = [
        value
        for group in optimizer.param_groups
        for param in group["params"]
        for key, value in optimizer.state.get(param, {}).items()
        if key != "step" and isinstance(value, torch.Tensor) and value.is_cuda
    ]
    # Releasing a storage releases every tensor on it: only moments that own theirs whole are parked.
    owned = all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)
    return tensors if owned else []


def moment_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Host bytes for `optimizer`'s moments once it has stepped, each copy `ALIGN`-ed: Adam keeps two a
    parameter in the parameter's dtype (three with amsgrad)."""
    return sum(
        (3 if group.get("amsgrad") else 2) * aligned(p.numel() * p.element_size())
        for group in optimizer.param_groups
        for p in group["params"]
    )


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def carve(block: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Views of the bytes `block` shaped and typed as `tensors`, one after the other at `ALIGN`-ed
    offsets; None if they do not fit."""
    views, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if offset + nbytes > block.numel():
            return None
        views.append(block[offset : offset + nbytes].view(t.dtype).view(t.shape))
        offset += aligned(nbytes)
    return views


def _same_tensors(kept: list[torch.Tensor], current: list[torch.Tensor]) -> bool:
    return len(kept) == len(current) and all(a is b for a, b in zip(kept, current, strict=True))
