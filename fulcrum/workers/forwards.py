"""How a worker runs its model: packed or padded forwards, bf16 compute weights on CUDA
(`fulcrum.models.precision.compute_dtype`).

One `ModelForwards` per model (actor, reference, critic): its no-grad passes (`no_grad_pass`,
`sum_pi_squared`), its
forwards on one micro-batch, and, for the update loop (fulcrum.workers.update), `active()` around
the micro-batches, `backward(loss)` and `accumulate_grads()` for each.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fulcrum.batch import Batch, host_to_device
from fulcrum.config.keys import ConfigError
from fulcrum.config.sections import ForwardSizes
from fulcrum.models.linear_logprob import use_compiled_chunks
from fulcrum.models.load import autocast_for
from fulcrum.models.logprob import response_logits, sum_pi_squared
from fulcrum.models.packed import (
    PackedMicroBatch,
    compile_decoder_layers,
    compile_inside_layers,
    compile_options,
    enable_packed_attention,
    packing_unsupported_reason,
)
from fulcrum.models.precision import ComputeWeights, compute_dtype
from fulcrum.models.stream_shard import real_tokens
from fulcrum.parallel.fsdp import is_sharded, run_in_root
from fulcrum.parallel.ulysses import SequenceParallel, check_heads, sequence_parallel_group
from fulcrum.workers.micro_batch import (
    HostInputs,
    MicroInputs,
    forward_log_prob,
    forward_values,
    make_micro_batches,
    pad_right,
    restore_order,
    stream_log_prob,
    stream_values,
    trimmed_inputs,
)
from fulcrum.workers.step_graphs import forward_micro, graphs_for

logger = logging.getLogger(__name__)


class ModelForwards:
    """`model` on `device`: padding-free when `use_remove_padding` and the architecture allows it;
    on CUDA, bf16 copies of the float32 weights for compute (`fulcrum.models.precision`), except
    the parameters under `keep` (e.g. the critic's value head), and with `use_torch_compile` the
    packed decoder layers and log-softmax chunks compiled (`compile_decoder_layers`).

    `lm_head_fp32` (actor_rollout_ref.model.lm_head_fp32): log-probs from float32 LM-head logits
    (`fulcrum.models.head_logits`), as the native engine samples with the key on; packed path only.

    `sp_size` > 1 (the role's `ulysses_sequence_parallel_size`, named by `sp_key`): each micro-batch's
    packed stream is split over a group of `sp_size` ranks (`fulcrum.parallel.ulysses`), which share
    the micro-batch; the data is split over the world / `sp_size` groups (`dp_rank`, `dp_size`).

    `cuda_graphs` (the role's `cuda_graphs` key): its micro-batches replayed as CUDA graphs where they
    can be (`fulcrum.workers.step_graphs.graphs_refused`); `cpp_wrapper`
    (actor_rollout_ref.actor.inductor_cpp_wrapper): the compiled code under inductor's C++ wrapper."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        use_remove_padding: bool,
        role: str,
        keep: tuple[str, ...] = (),
        use_torch_compile: bool = False,
        sp_size: int = 1,
        sp_key: str = "ulysses_sequence_parallel_size",
        lm_head_fp32: bool = False,
        cuda_graphs: bool = True,
        cpp_wrapper: bool = True,
    ) -> None:
        self.model = model
        self.device = device
        self.cuda_graphs = cuda_graphs
        reason = packing_unsupported_reason(model.config) if use_remove_padding else None
        if reason is not None:
            logger.warning("%s: use_remove_padding=True but %s; using padded micro-batches", role, reason)
        self.packed = use_remove_padding and reason is None
        if lm_head_fp32 and not self.packed:
            raise ConfigError(
                "actor_rollout_ref.model.lm_head_fp32=True needs the packed path (use_remove_padding=True on "
                f"a packed architecture; here {reason or 'use_remove_padding=False'}): the padded forward "
                "runs the model's own LM head, in its dtype",
                "actor_rollout_ref.model.lm_head_fp32",
            )
        self.lm_head_fp32 = lm_head_fp32
        self.sp = self.sequence_parallel(sp_size, sp_key, reason)
        if self.packed:
            enable_packed_attention(model)
        sharded = is_sharded(model)  # FSDP2's mixed precision makes the bf16 compute weights
        if self.packed and use_torch_compile and device.type == "cuda":
            # Actor, reference and critic layers, train and eval, grad and no-grad: more variants
            # of one compiled layer than dynamo's default cache of 8 holds.
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            if sharded:  # each layer an FSDP unit: compile inside its hooks (torchtitan's order)
                compile_inside_layers(model.model, cpp_wrapper=cpp_wrapper)
            else:
                compile_decoder_layers(model.model, cpp_wrapper=cpp_wrapper)
            use_compiled_chunks(True, compile_options(cpp_wrapper=cpp_wrapper))
        dtype = compute_dtype(device)
        mixed = dtype != torch.float32 and not sharded
        self.compute = ComputeWeights(model, dtype, keep=keep) if mixed else None
        # Its micro-batches (update steps, no-grad forwards) replayed as CUDA graphs, where they can be.
        self.graphs = graphs_for(self)

    def sequence_parallel(self, sp_size: int, key: str, reason: str | None) -> SequenceParallel | None:
        """The sequence-parallel group of `sp_size` (None for 1), after checking that this model can
        split: SP runs on the packed path only, and splits the attention heads evenly."""
        if sp_size == 1:
            return None
        if not self.packed:
            why = reason or "use_remove_padding=False"
            raise ConfigError(
                f"{key}={sp_size} needs the packed path (use_remove_padding=True on a packed architecture), "
                f"but here {why}",
                key,
            )
        try:
            check_heads(int(self.model.config.num_attention_heads), sp_size, key)
            return sequence_parallel_group(sp_size, key)
        except ValueError as err:
            raise ConfigError(str(err), key) from err

    @property
    def sp_size(self) -> int:
        """Ranks that share one micro-batch (1 without sequence parallelism)."""
        return 1 if self.sp is None else self.sp.size

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

    def start_accumulation(self) -> None:
        """At a mini-batch's start, inside `active()`: resident compute weights (`keep_resident`, for
        graphed micro-batches) attach their resident gradient buffers."""
        if self.compute is not None and self.compute.resident:
            self.compute.attach_resident_grads()

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()` of a micro-batch inside `active()`; with compute weights, their gradients are
        held for `accumulate_grads` (`ComputeWeights.backward`)."""
        if self.compute is None:
            loss.backward()
        else:
            self.compute.backward(loss)

    def accumulate_grads(self) -> None:
        """After each micro-batch's backward: compute-weight gradients into the float32 masters."""
        if self.compute is not None:
            self.compute.accumulate_grads()

    def no_grad_pass(
        self,
        batch: Batch,
        sizes: ForwardSizes,
        forward: Callable[[MicroInputs], tuple[torch.Tensor, ...]],
        padded: bool = False,
        graph_key: tuple[object, ...] | None = None,
    ) -> list[torch.Tensor]:
        """`forward` on every micro-batch in eval mode without gradients: each of its outputs over the
        whole batch, (B, ...) in the batch's row order, on the CPU. `padded`: padded micro-batches over
        the float32 masters (no compute weights), whatever this model's layout. `graph_key` (what besides
        the micro-batch decides `forward`'s work, e.g. its temperature): its micro-batches replayed as CUDA
        graphs where this model has them (`fulcrum.workers.step_graphs`); `forward` then reads only the
        micro-batch's response mask and stream.

        Micro-batches hold rows of similar length (less padding; no-grad results do not depend on the
        grouping). Results stay on the device until the pass ends: one host copy, no sync per micro-batch.
        """
        micro, order = make_micro_batches(
            batch,
            sizes.micro_batch_size,
            sizes.use_dynamic_bsz,
            sizes.max_token_len,
            sizes.key,
            sort_by_length=True,
            packed=self.packed and not padded,
            model=self.model,
        )
        graphs = self.graphs if graph_key is not None and not padded else None
        was_training = self.model.training
        self.model.eval()  # no dropout: log-probs must match what the update's ratio starts from
        try:
            with torch.no_grad(), contextlib.nullcontext() if padded else self.active():
                outputs = [forward_micro(graphs, mb, graph_key or (), forward, self.device) for mb in micro]
        finally:
            self.model.train(was_training)
        return [restore_order(list(parts), order).cpu() for parts in zip(*outputs, strict=True)]

    def log_prob(
        self, mb: Batch, temperature: float, with_entropy: bool, response_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return forward_log_prob(
            self.model,
            mb,
            temperature,
            with_entropy,
            self.device,
            self.packed,
            response_mask,
            self.sp,
            self.lm_head_fp32,
        )

    def packed_log_prob(
        self, packed: PackedMicroBatch, temperature: float, with_entropy: bool, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`log_prob` of a micro-batch packed on the device already (no sequence parallelism): device
        work only, which a CUDA graph can capture."""
        return run_in_root(
            self.model,
            stream_log_prob,
            self.model,
            packed,
            packed,
            temperature,
            with_entropy,
            mask,
            None,
            self.lm_head_fp32,
        )

    def packed_values(self, packed: PackedMicroBatch, mask: torch.Tensor) -> torch.Tensor:
        """`values` of a micro-batch packed on the device already (as `packed_log_prob`)."""
        return run_in_root(self.model, stream_values, self.model, packed, packed, mask)

    def token_mask(self, mb: Batch) -> torch.Tensor | None:
        """Which rows of a forward's per-token tensors (e.g. router logits) are real tokens: the padded
        forward runs the trimmed (B, T') grid, flattened; the packed stream holds only real tokens (None);
        with sequence parallelism this rank's slice of it, padded at the stream's end (`real_tokens`)."""
        if not self.packed:
            return trimmed_inputs(mb, self.device)[1].reshape(-1)
        if self.sp is None:
            return None
        n_real = int(mb["attention_mask"].sum())  # the packed stream's tokens (`pack_micro_batch`)
        return real_tokens(n_real, self.sp.size, self.sp.rank).to(self.device)

    def values(self, mb: Batch, response_mask: torch.Tensor | None = None) -> torch.Tensor:
        return forward_values(self.model, mb, self.device, self.packed, response_mask, self.sp)

    def sum_pi_squared(self, batch: Batch, sizes: ForwardSizes, temperature: float) -> torch.Tensor:
        """sum_v pi_v^2 at every response position (B, R), float32 on the CPU, 0 outside the response
        mask (actor.calculate_sum_pi_squared, for the optimal-token-baseline estimator); padded
        micro-batches under autocast. One extra forward per step, only when the estimator needs it (verl
        computes it in the old-log-prob pass)."""

        def forward(inputs: MicroInputs) -> tuple[torch.Tensor]:
            assert isinstance(inputs, HostInputs)
            mb = inputs.batch
            ids, mask, pos, r_kept = trimmed_inputs(mb, self.device)
            with autocast_for(self.device):
                logits = response_logits(self.model, ids, mask, pos, r_kept)
            values = pad_right(sum_pi_squared(logits, temperature), mb.response_length)
            return (values * host_to_device(mb["response_mask"], self.device),)

        return self.no_grad_pass(batch, sizes, forward, padded=True)[0]
