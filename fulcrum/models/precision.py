"""bf16 compute weights over float32 master weights, without autocast.

The model keeps its float32 parameters: the optimiser, checkpoints and the rollout's weight sync see
them unchanged. `ComputeWeights` makes one bf16 copy of each, from the masters, once per optimiser
step (one batched copy, `refresh`), swaps the copies into the module for the forward and backward
(`swapped_in`), and drops them afterwards (`release`), so generation does not carry them. Gradients
are taken with respect to the bf16 copies (`backward`); `accumulate_grads` adds them into the masters'
float32 `.grad` (views of one buffer) after each micro-batch, so accumulation over micro-batches is in
float32, as with autocast or FSDP's `reduce_dtype=float32`. A micro-batch's host work for this does
not grow with the number of parameters: a few foreach and flat ops move every gradient.

Why not autocast: it re-casts every float32 weight in every micro-batch, and again in each
gradient-checkpoint recomputation (one `copy_` kernel per weight each time), and
keeps the residual stream in float32. With bf16 copies the whole decoder runs in bf16, as verl's
FSDP workers do (`param_dtype=bf16`); float32 remains where the model asks for it (RMSNorm's
variance, the softmax of the log-probs, a value head left out of the copies).

A frozen parameter already in the compute dtype gets no copy: a LoRA model's base sits once, in the
compute dtype (`fulcrum.models.lora.freeze_base`), and only its adapters have float32 masters.
`compute_dtype` is the one place that says which dtype a device computes in.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

# The dtype the passes compute in, by device type; float32 elsewhere (the CPU: exact tests). Tests
# set "cpu" to bfloat16 to see a CUDA run's dtypes and memory on the CPU.
COMPUTE_DTYPES: dict[str, torch.dtype] = {"cuda": torch.bfloat16}

# Gradient elements concatenated at a time by `accumulate_grads` (128 MiB in bf16): bounds the
# transient copy, a few kernels for a 0.5B model.
FLAT_CHUNK = 1 << 26


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype forwards and backwards run in on `device` (`COMPUTE_DTYPES`, else float32)."""
    return COMPUTE_DTYPES.get(torch.device(device).type, torch.float32)


def parameter_bytes(module: nn.Module) -> dict[str, int]:
    """Resident bytes of `module`'s parameters: {"trained": ..., "frozen": ...} (tied tensors once)."""
    out = {"trained": 0, "frozen": 0}
    for p in module.parameters():
        out["trained" if p.requires_grad else "frozen"] += p.numel() * p.element_size()
    return out


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimiser's state tensors: Adam's moments (its per-parameter step counts, a few
    bytes each, are left out)."""
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for key, v in state.items()
        if isinstance(v, torch.Tensor) and key != "step"
    )


class ComputeWeights:
    """bf16 (or `dtype`) copies of `module`'s floating-point parameters, except names under `keep` and
    frozen parameters already in `dtype` (a copy would equal them)."""

    def __init__(
        self, module: nn.Module, dtype: torch.dtype = torch.bfloat16, keep: tuple[str, ...] = ()
    ) -> None:
        self.module = module
        named = [
            (name, p)
            for name, p in module.named_parameters()  # tied weights appear once; see swapped_in
            if p.is_floating_point()
            and not any(name == k or name.startswith(k + ".") for k in keep)
            and (p.requires_grad or p.dtype != dtype)
        ]
        self.names = [name for name, _ in named]
        self.masters = [p for _, p in named]
        self.dtype = dtype
        self.copies: list[torch.Tensor] = []
        # The copies and masters that get gradients (a frozen parameter outside `dtype` has a copy too),
        # as two aligned lists made with the copies, so a micro-batch builds no list of its own.
        self._trained_copies: list[torch.Tensor] = []
        self._trained_masters: list[torch.Tensor] = []
        copied = {id(p) for p in self.masters}
        # Trained parameters computed in their own dtype (under `keep`): `backward` fills their `.grad`.
        self.uncopied = [p for p in module.parameters() if p.requires_grad and id(p) not in copied]
        self._flat_ref: weakref.ref[torch.Tensor] | None = None
        self._pending: list[torch.Tensor | None] | None = None  # `backward`'s gradients of the trained copies
        self._staging: Staging | None = None
        # Resident (`keep_resident`): the copies and the gradients keep their memory, and so their
        # addresses, from one pass to the next, as a CUDA graph replaying the passes needs.
        self.resident = False
        self._resident_grads: ResidentGrads | None = None
        self._staged = False  # the staging buffer holds a graphed micro-batch's gradients to add

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the masters into the compute weights (made if released): after each optimiser step."""
        if not self.copies:
            self.copies = [
                torch.empty_like(p, dtype=self.dtype).requires_grad_(p.requires_grad) for p in self.masters
            ]
            trained = [(c, p) for c, p in zip(self.copies, self.masters, strict=True) if c.requires_grad]
            self._trained_copies = [c for c, _ in trained]
            self._trained_masters = [p for _, p in trained]
            shapes = [c.shape for c in self._trained_copies]
            if self._staging is not None and self._staging.shapes != shapes:
                self._staging = None  # made for other trained parameters
        torch._foreach_copy_(self.copies, self.masters)  # under no_grad the masters need no detach each

    def release(self) -> None:
        """Drop the copies (their memory returns to the allocator's cache); `refresh` makes new ones.
        Resident copies stay."""
        self._pending, self._staged = None, False
        if not self.resident:
            self.copies, self._trained_copies, self._trained_masters = [], [], []

    def keep_resident(self) -> None:
        """From now on the copies are not released between passes, and each micro-batch's gradients of
        them are staged in one bf16 buffer (and the uncopied trained parameters' `.grad` are tensors)
        that lives as long as this object: a CUDA graph of a micro-batch reads the copies and writes the
        gradients at the addresses it was captured with. Costs their memory (2 + 2 bytes a bf16-copied
        parameter) through generation and the other models' passes; the float32 gradients stay an
        update's own, as without."""
        self.resident = True

    @torch.no_grad()
    def attach_resident_grads(self) -> None:
        """Resident only, at the start of a mini-batch (the optimiser dropped the `.grad`s): the staging
        buffer made (the first time), and the uncopied trained parameters' `.grad` their zeroed resident
        tensors."""
        assert self.resident and self._trained_copies, "attach_resident_grads: resident copies, refreshed"
        if self._resident_grads is None:
            copies = self._trained_copies
            staged = torch.empty(sum(c.numel() for c in copies), dtype=self.dtype, device=copies[0].device)
            views = [
                v.view_as(c) for v, c in zip(staged.split([c.numel() for c in copies]), copies, strict=True)
            ]
            self._resident_grads = ResidentGrads(staged, views, [torch.empty_like(p) for p in self.uncopied])
        own = self._resident_grads.uncopied
        if own:
            torch._foreach_zero_(own)
        for param, grad in zip(self.uncopied, own, strict=True):
            param.grad = grad

    def discard_pending(self) -> None:
        """Forget `backward`'s gradients (a step abandoned before its accumulation)."""
        self._pending = None

    @torch.no_grad()
    def stage_pending_grads(self) -> None:
        """`backward`'s gradients of the copies into the resident staging buffer (a copy without one gets
        zeros): device work only, what a captured micro-batch ends with; after it (run or replayed),
        `mark_staged`, and `accumulate_grads` adds them into the float32 gradients outside the graph.
        Needs `attach_resident_grads` first."""
        pending, self._pending = self._pending, None
        assert pending is not None and self._resident_grads is not None, (
            "stage_pending_grads: attach, backward"
        )
        views = self._resident_grads.views
        pairs = [(v, g) for v, g in zip(views, pending, strict=True) if g is not None]
        torch._foreach_copy_([v for v, _ in pairs], [g for _, g in pairs])
        for view, grad in zip(views, pending, strict=True):
            if grad is None:
                view.zero_()

    def mark_staged(self) -> None:
        """A graphed micro-batch ran `stage_pending_grads`: `accumulate_grads` adds the staged gradients."""
        self._staged = True

    @torch.no_grad()
    def _add_staged_grads(self) -> None:
        """masters.grad (float32) += the staged gradients, one kernel (the float32 buffer made first when
        the optimiser dropped the gradients)."""
        assert self._resident_grads is not None
        staged = self._resident_grads.staged
        flat = self._flat_grad()
        if flat is None:
            self._new_flat_grad(staged.device).copy_(staged)
        else:
            flat.add_(staged)

    def _new_flat_grad(self, device: torch.device) -> torch.Tensor:
        """One float32 buffer for every trained master's gradient, its views made their `.grad`."""
        masters = self._trained_masters
        flat = torch.empty(sum(m.numel() for m in masters), dtype=torch.float32, device=device)
        for master, view in zip(masters, flat.split([m.numel() for m in masters]), strict=True):
            master.grad = view.view_as(master)
        self._flat_ref = weakref.ref(flat)
        return flat

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The module computes with the copies inside; backward (and checkpoint recomputation) must run inside too."""
        if self.masters and not self.copies:
            raise RuntimeError("ComputeWeights.swapped_in before refresh(): no compute copies to swap in")
        with _reparametrize_module(
            self.module, dict(zip(self.names, self.copies, strict=True)), tie_weights=True
        ):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()` inside `swapped_in`, once per micro-batch before `accumulate_grads`: the
        trained copies' gradients are held for it; the uncopied trained parameters' go into their `.grad`
        as `loss.backward()` would put them.

        `torch.autograd.grad` hands the gradients back, where `loss.backward()` would store each in its
        leaf's `.grad` through autograd's accumulation step, an op (a `detach`) per parameter.
        """
        if self._pending is not None:
            raise RuntimeError("ComputeWeights.backward twice without accumulate_grads in between")
        copies = self._trained_copies
        inputs = [*copies, *self.uncopied]
        if not inputs:
            loss.backward()
            return
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)
        self._pending = list(grads[: len(copies)])
        add_to_grads(self.uncopied, list(grads[len(copies) :]))

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """masters.grad (float32) += the trained copies' gradients (`backward`'s, else the copies' own
        `.grad`, which are cleared), in a few ops and kernels for the whole model; after a graphed
        micro-batch, the gradients it staged (`stage_pending_grads`, `mark_staged`), in one kernel.

        The first accumulation after the optimiser dropped the masters' gradients makes them views
        into one float32 buffer. The gradients are then copied, at most `FLAT_CHUNK` elements at a time,
        by one `_foreach_copy_` into views of a buffer in their dtype (`Staging`), which is added to the
        float32 buffer. Per parameter, a float32 += bf16 add takes PyTorch's one-kernel-per-tensor path
        even through `_foreach_add_`: one kernel and launch per parameter a micro-batch (290 on
        Qwen2.5-0.5B). The float32 buffer is held only through the masters'
        `.grad`, so the optimiser's release of the gradients frees it. A micro-batch that leaves a copy
        without gradient, or masters holding gradients of their own, take the per-parameter path.
        """
        if self._staged:  # a graphed micro-batch's, staged in bf16 (`stage_pending_grads`)
            self._staged = False
            self._add_staged_grads()
            return
        if not self._trained_copies:
            return
        if self._pending is not None:
            grads, self._pending = self._pending, None
        else:
            grads = [c.grad for c in self._trained_copies]
            for c in self._trained_copies:
                c.grad = None
        trained = self._trained_masters
        flat = self._flat_grad()
        fresh = flat is None and all(m.grad is None for m in trained)
        present = [g for g in grads if g is not None]
        if len(present) < len(grads) or (flat is None and not fresh):
            self._add_each(grads)
            return
        if flat is None:
            flat = self._new_flat_grad(present[0].device)
        staging = self._staging
        if staging is None or not staging.serves(present[0], FLAT_CHUNK):
            # The gradients' shapes and dtype are the copies': views made once serve every micro-batch.
            staging = self._staging = Staging(present, FLAT_CHUNK)
        staging.add_into(flat, present, fresh)

    def _flat_grad(self) -> torch.Tensor | None:
        """The float32 buffer behind every trained master's `.grad`, or None when they are not (all) its views."""
        flat = self._flat_ref() if self._flat_ref is not None else None
        if flat is None or any(m.grad is None or m.grad._base is not flat for m in self._trained_masters):
            return None
        return flat

    def _add_each(self, grads: list[torch.Tensor | None]) -> None:
        masters, present = [], []
        for master, grad in zip(self._trained_masters, grads, strict=True):
            if grad is None:
                continue
            if master.grad is None:
                master.grad = torch.zeros_like(master)
            masters.append(master.grad)
            present.append(grad)
        if masters:
            torch._foreach_add_(masters, present)


class ResidentGrads(NamedTuple):
    """A resident model's gradient buffers (`ComputeWeights.keep_resident`): the bf16 buffer a graphed
    micro-batch stages its copies' gradients in, its views shaped like the trained copies, and the
    uncopied trained parameters' `.grad` tensors."""

    staged: torch.Tensor
    views: list[torch.Tensor]
    uncopied: list[torch.Tensor]


class Staging:
    """A buffer in the gradients' dtype seen as runs of at most `elements` elements (a larger tensor
    alone, `groups_of_at_most`), each run also as views shaped like its gradients, so that one
    `_foreach_copy_` concatenates a run however many tensors it holds. The views are made once. The
    buffer's storage is allocated only inside `add_into` and emptied after (as FSDP2 empties its
    all-gather buffers under the parameters' views): like a concatenation's result, it takes memory
    only while the gradients it copies are alive."""

    def __init__(self, like: list[torch.Tensor], elements: int) -> None:
        self.elements = elements
        self.shapes = [g.shape for g in like]
        self.dtype, self.device = like[0].dtype, like[0].device
        groups = list(groups_of_at_most(like, elements))
        sizes = [sum(g.numel() for g in group) for group in groups]
        self.buffer = torch.empty(max(sizes), dtype=self.dtype, device=self.device)
        self.nbytes = self.buffer.untyped_storage().nbytes()
        self.runs: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        for group, size in zip(groups, sizes, strict=True):
            run = self.buffer[:size]
            pieces = run.split([g.numel() for g in group])
            self.runs.append((run, [piece.view(g.shape) for piece, g in zip(pieces, group, strict=True)]))
        self.buffer.untyped_storage().resize_(0)

    def serves(self, grad: torch.Tensor, elements: int) -> bool:
        """Whether these runs stage gradients like `grad` (dtype, device) in chunks of `elements`."""
        return (grad.dtype, grad.device, elements) == (self.dtype, self.device, self.elements)

    def add_into(self, flat: torch.Tensor, grads: list[torch.Tensor], fresh: bool) -> None:
        """flat += the concatenated `grads` (flat = them, when `fresh`), run by run."""
        storage = self.buffer.untyped_storage()
        storage.resize_(self.nbytes)
        try:
            start = first = 0
            for run, views in self.runs:
                torch._foreach_copy_(views, grads[first : first + len(views)])
                target = flat[start : start + run.numel()]
                if fresh:
                    target.copy_(run)
                else:
                    target.add_(run)
                start += run.numel()
                first += len(views)
        finally:
            storage.resize_(0)


@torch.no_grad()
def add_to_grads(params: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    """What `loss.backward()` does to leaves' `.grad`: a parameter's first gradient becomes its `.grad`
    (a tensor of its own), later ones are added in place (one foreach op); None leaves it alone."""
    targets, present = [], []
    for param, grad in zip(params, grads, strict=True):
        if grad is None:
            continue
        if param.grad is None:
            param.grad = grad.clone()
        else:
            targets.append(param.grad)
            present.append(grad)
    if targets:
        torch._foreach_add_(targets, present)


def groups_of_at_most(tensors: list[torch.Tensor], elements: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of `tensors` of at most `elements` elements together (a larger tensor alone)."""
    group: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        if group and size + t.numel() > elements:
            yield group
            group, size = [], 0
        group.append(t)
        size += t.numel()
    if group:
        yield group
