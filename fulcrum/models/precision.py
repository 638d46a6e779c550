"""bf16 compute weights over float32 master weights, without autocast.

The model keeps its float32 parameters: the optimiser, checkpoints and the rollout's weight sync see
them unchanged. `ComputeWeights` makes one bf16 copy of each, from the masters, once per optimiser
step (one batched copy, `refresh`), swaps the copies into the module for the forward and backward
(`swapped_in`), and drops them afterwards (`release`), so generation does not carry them. Gradients then land on the bf16 copies; `accumulate_grads` adds them into the
masters' float32 `.grad` after each micro-batch, so accumulation over micro-batches is in float32,
as with autocast or FSDP's `reduce_dtype=float32`.

Why not autocast: it re-casts every float32 weight in every micro-batch, and again in each
gradient-checkpoint recomputation (27k `copy_` kernels in one seed-command update, measured), and
keeps the residual stream in float32. With bf16 copies the whole decoder runs in bf16, as verl's
FSDP workers do (`param_dtype=bf16`); float32 remains where the model asks for it (RMSNorm's
variance, the softmax of the log-probs, a value head left out of the copies).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module


class ComputeWeights:
    """bf16 (or `dtype`) copies of `module`'s floating-point parameters, except names under `keep`."""

    def __init__(
        self, module: nn.Module, dtype: torch.dtype = torch.bfloat16, keep: tuple[str, ...] = ()
    ) -> None:
        self.module = module
        named = [
            (name, p)
            for name, p in module.named_parameters()  # tied weights appear once; see swapped_in
            if p.is_floating_point() and not any(name == k or name.startswith(k + ".") for k in keep)
        ]
        self.names = [name for name, _ in named]
        self.masters = [p for _, p in named]
        self.dtype = dtype
        self.copies: list[torch.Tensor] = []

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
        if not self.copies:
            raise RuntimeError("ComputeWeights.swapped_in before refresh(): no compute copies to swap in")
        with _reparametrize_module(
            self.module, dict(zip(self.names, self.copies, strict=True)), tie_weights=True
        ):
            yield

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """masters.grad (float32) += copies.grad; the copies' gradients are cleared."""
        masters, grads = [], []
        for master, copy in zip(self.masters, self.copies, strict=True):
            if copy.grad is None:
                continue
            if master.grad is None:
                master.grad = torch.zeros_like(master)
            masters.append(master.grad)
            grads.append(copy.grad)
            copy.grad = None
        if masters:
            torch._foreach_add_(masters, grads)
