"""How a worker runs its model: packed or padded forwards, bf16 compute weights on CUDA.

One `ModelRunner` per model (actor, reference, critic). The workers' loops stay as they were: they
ask the runner for micro-batches and forwards, run the update's micro-batches inside `active()` and
call `accumulate_grads()` after each backward.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fulcrum.batch import Batch
from fulcrum.models.linear_logprob import use_compiled_chunks
from fulcrum.models.packed import (
    compile_decoder_layers,
    compile_inside_layers,
    compile_options,
    enable_packed_attention,
    packing_unsupported_reason,
)
from fulcrum.models.precision import ComputeWeights
from fulcrum.parallel.fsdp import is_sharded
from fulcrum.workers.micro_batch import (
    as_many_as_other_ranks,
    forward_log_prob,
    forward_values,
    make_micro_batches,
)

logger = logging.getLogger(__name__)


class ModelRunner:
    """`model` on `device`: padding-free when `use_remove_padding` and the architecture allows it;
    on CUDA, bf16 copies of the float32 weights for compute (`fulcrum.models.precision`), except
    the parameters under `keep` (e.g. the critic's value head), and with `use_torch_compile` the
    packed decoder layers and log-softmax chunks compiled (`compile_decoder_layers`)."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        use_remove_padding: bool,
        role: str,
        keep: tuple[str, ...] = (),
        use_torch_compile: bool = False,
    ) -> None:
        self.model = model
        self.device = device
        reason = packing_unsupported_reason(model.config) if use_remove_padding else None
        if reason is not None:
            logger.warning("%s: use_remove_padding=True but %s; using padded micro-batches", role, reason)
        self.packed = use_remove_padding and reason is None
        if self.packed:
            enable_packed_attention(model)
        sharded = is_sharded(model)  # FSDP2's mixed precision makes the bf16 compute weights
        if self.packed and use_torch_compile and device.type == "cuda":
            # Actor, reference and critic layers, train and eval, grad and no-grad: more variants
            # of one compiled layer than dynamo's default cache of 8 holds.
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            if sharded:  # each layer an FSDP unit: compile inside its hooks (torchtitan's order)
                compile_inside_layers(model.model)
            else:
                compile_decoder_layers(model.model)
            use_compiled_chunks(True, compile_options())
        self.compute = ComputeWeights(model, keep=keep) if device.type == "cuda" and not sharded else None

    @contextmanager
    def active(self) -> Iterator[None]:
        """Compute weights made from the masters and swapped in; run forward and backward inside.

        They are dropped on exit, so between passes (generation) only the float32 masters are resident.
        """
        if self.compute is None:
            yield
            return
        self.compute.refresh()
        try:
            with self.compute.swapped_in():
                yield
        finally:
            self.compute.release()

    def accumulate_grads(self) -> None:
        """After each micro-batch's backward: compute-weight gradients into the float32 masters."""
        if self.compute is not None:
            self.compute.accumulate_grads()

    def micro_batches(
        self,
        batch: Batch,
        size: int | None,
        use_dynamic_bsz: bool,
        max_token_len: int | None,
        key: str,
        sort_by_length: bool = False,
    ) -> tuple[list[Batch], list[int] | None]:
        micro, order = make_micro_batches(
            batch,
            size,
            use_dynamic_bsz,
            max_token_len,
            key,
            sort_by_length=sort_by_length,
            packed=self.packed,
        )
        return as_many_as_other_ranks(self.model, micro), order

    def log_prob(
        self, mb: Batch, temperature: float, with_entropy: bool, response_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return forward_log_prob(
            self.model, mb, temperature, with_entropy, self.device, self.packed, response_mask
        )

    def values(self, mb: Batch, response_mask: torch.Tensor | None = None) -> torch.Tensor:
        return forward_values(self.model, mb, self.device, self.packed, response_mask)
