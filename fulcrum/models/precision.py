"""bf16 compute weights over float32 master weights, without autocast.

The model keeps its float32 parameters: the optimiser, checkpoints and the rollout's weight sync see
them unchanged. `ComputeWeights` makes one bf16 copy of each, from the masters, once per optimiser
step (one batched copy, `refresh`), swaps the copies into the module for the forward and backward
(`swapped_in`), and drops them afterwards (`release`), so generation does not carry them. Gradients
then land on the bf16 copies; `accumulate_grads` adds them into the masters' float32 `.grad` (views
of one buffer) after each micro-batch, so accumulation over micro-batches is in float32, as with
autocast or FSDP's `reduce_dtype=float32`.

Why not autocast: it re-casts every float32 weight in every micro-batch, and again in each
gradient-checkpoint recomputation (27k `copy_` kernels in one seed-command update, measured), and
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
        self._flat_ref: weakref.ref[torch.Tensor] | None = None

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the masters into the compute weights (made if released): after each optimiser step."""
        if not self.copies:
            self.copies = [
                torch.empty_like(p, dtype=self.dtype).requires_grad_(p.requires_grad) for p in self.masters
            ]
        torch._foreach_copy_(self.copies, [p.detach() for p in self.masters])

    def release(self) -> None:
        """Drop the copies (their memory returns to the allocator's cache); `refresh` makes new ones."""
        self.copies = []

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The module computes with the copies inside; backward (and checkpoint recomputation) must run inside too."""
        if self.masters and not self.copies:
            raise RuntimeError("ComputeWeights.swapped_in before refresh(): no compute copies to swap in")
        with _reparametrize_module(
            self.module, dict(zip(self.names, self.copies, strict=True)), tie_weights=True
        ):
            yield

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """masters.grad (float32) += copies.grad, in a few kernels for the whole model; the copies'
        gradients are cleared.

        The first accumulation after the optimiser dropped the masters' gradients makes them views
        into one float32 buffer; the copies' gradients are then concatenated, at most `FLAT_CHUNK`
        elements at a time, and added chunk by chunk. Per parameter, a float32 += bf16 add takes
        PyTorch's one-kernel-per-tensor path even through `_foreach_add_`: 290 kernels and launches a
        micro-batch on Qwen2.5-0.5B, 9.6% of an actor update's GPU time (measured). The buffer is held
        only through the masters' `.grad`, so the optimiser's release of the gradients frees it. A
        micro-batch that leaves a copy without gradient, or masters holding gradients of their own,
        take the per-parameter path.
        """
        if not self.masters:
            return
        grads = [copy.grad for copy in self.copies]
        for copy in self.copies:
            copy.grad = None
        flat = self._flat_grad()
        fresh = flat is None and all(m.grad is None for m in self.masters)
        if any(g is None for g in grads) or (flat is None and not fresh):
            self._add_each(grads)
            return
        if flat is None:
            flat = torch.empty(
                sum(m.numel() for m in self.masters), dtype=torch.float32, device=grads[0].device
            )
            offset = 0
            for master in self.masters:
                master.grad = flat[offset : offset + master.numel()].view_as(master)
                offset += master.numel()
            self._flat_ref = weakref.ref(flat)
        start = 0
        for group in groups_of_at_most(grads, FLAT_CHUNK):
            joined = torch.cat([g.reshape(-1) for g in group])  # (n,) in the copies' dtype
            target = flat[start : start + joined.numel()]
            if fresh:
                target.copy_(joined)
            else:
                target.add_(joined)
            start += joined.numel()

    def _flat_grad(self) -> torch.Tensor | None:
        """The float32 buffer behind every master's `.grad`, or None when they are not (all) its views."""
        flat = self._flat_ref() if self._flat_ref is not None else None
        if flat is None or any(m.grad is None or m.grad._base is not flat for m in self.masters):
            return None
        return flat

    def _add_each(self, grads: list[torch.Tensor | None]) -> None:
        masters, present = [], []
        for master, grad in zip(self.masters, grads, strict=True):
            if grad is None:
                continue
            if master.grad is None:
                master.grad = torch.zeros_like(master)
            masters.append(master.grad)
            present.append(grad)
        if masters:
            torch._foreach_add_(masters, present)


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
