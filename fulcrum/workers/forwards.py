"""How a worker runs its model on a micro-batch: hidden states, then a head given as an argument.

A forward is `forward(model, inputs, head)`: the decoder over the micro-batch's tokens (`MicroInputs`,
packed or padded), then the head on the positions that predict response tokens, each result a (B, R)
tensor zero outside the response mask. The heads: `LogProbHead` (log π of the response tokens, and the
entropy; actor, reference), `ValueHead` (V of the state before each; critic), `PiSquaredHead`
(sum_v π_v², padded only). Packed, the LM head and log-softmax run fused and chunked on the M predicting
positions only (`fulcrum.models.linear_logprob`); padded, the model's own head under autocast.

One `ModelForwards` per model (actor, reference, critic) owns what the layout needs: packing or
trimming (`inputs`), bf16 compute weights on CUDA (`fulcrum.models.precision`), sequence parallelism,
and how each micro-batch's function runs (`run`): eagerly, or replayed as a CUDA graph where the role's
`cuda_graphs` key allows it (`fulcrum.workers.cuda_graphs`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from fulcrum.batch import Batch, host_to_device
from fulcrum.config.keys import ConfigError
from fulcrum.config.sections import ForwardSizes
from fulcrum.models.linear_logprob import linear_log_softmax, use_compiled_chunks
from fulcrum.models.load import autocast_for
from fulcrum.models.logprob import logprob_and_entropy, response_logits, sum_pi_squared, trim_padding
from fulcrum.models.packed import (
    compile_decoder_layers,
    compile_inside_layers,
    compile_options,
    enable_packed_attention,
    pack_micro_batch,
    packed_hidden_states,
    packing_unsupported_reason,
)
from fulcrum.models.packed_recurrent import padded_training_refusal
from fulcrum.models.precision import ComputeWeights, compute_dtype
from fulcrum.models.stream_shard import StreamShard, real_tokens, shard_stream
from fulcrum.parallel.fsdp import is_sharded, run_in_root
from fulcrum.parallel.ulysses import SequenceParallel, check_heads, gather_rows, sequence_parallel_group
from fulcrum.workers.cuda_graphs import CudaGraphs, graphs_refused, resident_bytes
from fulcrum.workers.micro_batch import MicroInputs, PaddedTokens, make_micro_batches, restore_order

logger = logging.getLogger(__name__)

T = TypeVar("T")
# The key that switches each role's graphs (the reference's and the critic's follow the actor's).
GRAPH_KEYS = {
    "actor": "actor_rollout_ref.actor.cuda_graphs",
    "critic": "critic.cuda_graphs",
    "reference": "actor_rollout_ref.ref.cuda_graphs",
}


@dataclass(frozen=True)
class LogProbHead:
    """log π(y_t) = log softmax(z_t / τ)[y_t] of each response token, z the LM head's logits and τ the
    rollout temperature (verl), float32; with `entropy`, H_t = logsumexp(z_t/τ) − Σ_v π_v z_t,v/τ too.
    `fp32_logits` (packed only): the LM head's product kept in float32 (`fulcrum.models.head_logits`)."""

    temperature: float
    entropy: bool = False
    fp32_logits: bool = False

    def from_hidden(
        self, model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        head = model.get_output_embeddings()
        logp, ent = linear_log_softmax(
            hidden,
            head.weight,
            labels,
            self.temperature,
            self.entropy,
            head.bias,
            fp32_logits=self.fp32_logits,
        )  # (M,)
        return (logp,) if ent is None else (logp, ent)

    def padded(self, model: nn.Module, tokens: PaddedTokens) -> tuple[torch.Tensor, ...]:
        # The padded path's head is the Hugging Face model's own module, which rounds to its dtype.
        assert not self.fp32_logits, (
            "fp32 LM-head logits need the packed path (ModelForwards refuses the padded one)"
        )
        with autocast_for(tokens.input_ids.device):
            logits = response_logits(model, *tokens[:3], tokens.r_kept)  # (B, R', V)
        logp, ent = logprob_and_entropy(logits, tokens.labels, self.temperature, self.entropy)
        return (logp,) if ent is None else (logp, ent)


@dataclass(frozen=True)
class ValueHead:
    """V(state before each response token), float32, from the critic's scalar head."""

    def from_hidden(
        self, model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        return (model.value_from_hidden(hidden),)  # (M,) float32

    def padded(self, model: nn.Module, tokens: PaddedTokens) -> tuple[torch.Tensor, ...]:
        with autocast_for(tokens.input_ids.device):
            values = model(
                input_ids=tokens.input_ids,
                attention_mask=tokens.attention_mask,
                position_ids=tokens.position_ids,
            )
        return (values[:, -tokens.r_kept - 1 : -1].float(),)  # (B, R'), as verl's critic slices


@dataclass(frozen=True)
class PiSquaredHead:
    """sum_v π_v² at each response position (optimal_token_baseline), π = softmax(z / τ); padded only."""

    temperature: float

    def padded(self, model: nn.Module, tokens: PaddedTokens) -> tuple[torch.Tensor, ...]:
        with autocast_for(tokens.input_ids.device):
            logits = response_logits(model, *tokens[:3], tokens.r_kept)
        return (sum_pi_squared(logits, self.temperature),)


Head = LogProbHead | ValueHead | PiSquaredHead


def forward(
    model: nn.Module, inputs: MicroInputs, head: Head, sp: SequenceParallel | None = None
) -> tuple[torch.Tensor, ...]:
    """`head`'s outputs (each (B, R), zero outside the response mask) on the micro-batch. Packed, the
    decoder runs over the stream (with `sp`, this rank's slice; the head's results are gathered from the
    group) and the head on the M response-predicting positions only; only device work, which a CUDA
    graph can capture."""
    mask = inputs.rows["response_mask"]
    if inputs.padded is not None:
        width = mask.shape[1]
        return tuple(
            torch.nn.functional.pad(o, (0, width - o.shape[1])) * mask
            for o in head.padded(model, inputs.padded)
        )
    # Reaches embeddings and LM head directly: under FSDP, inside the root unit's forward.
    return run_in_root(model, packed_forward, model, inputs, head, sp)


def packed_forward(
    model: nn.Module, inputs: MicroInputs, head: Head, sp: SequenceParallel | None
) -> tuple[torch.Tensor, ...]:
    """`forward` of a packed micro-batch, called inside the model's root FSDP unit."""
    stream, packed = inputs.stream, inputs.packed
    assert stream is not None and packed is not None and not isinstance(head, PiSquaredHead)
    hidden = packed_hidden_states(model.model, stream, sp).index_select(0, stream.predictor)  # (M or M_r, H)
    outs = head.from_hidden(model, hidden, stream.labels)
    if isinstance(stream, StreamShard) and sp is not None:
        outs = tuple(gather_rows(o, stream.counts, sp) for o in outs)  # (M,)
    return tuple(packed.scatter(o) * inputs.rows["response_mask"] for o in outs)


def micro_inputs(
    mb: Batch,
    keys: list[str],
    device: torch.device,
    packed: bool,
    sp: SequenceParallel | None = None,
    agg: Mapping[str, float | torch.Tensor] | None = None,
) -> MicroInputs:
    """The micro-batch `mb` (on the host) on `device`: its (B, R) columns `keys` and the response mask,
    its tokens packed (with `sp`, this rank's slice too) or trimmed of all-padding columns. The index work
    is done on the host, where the batch is: on the device it would make the host wait for the GPU."""
    rows = {k: host_to_device(mb[k], device) for k in dict.fromkeys(["response_mask", *keys])}
    if packed:
        whole = pack_micro_batch(mb["input_ids"], mb["attention_mask"], mb["position_ids"], mb.prompt_length)
        stream = whole if sp is None else shard_stream(whole, sp.size, sp.rank)
        whole = whole.to(device)
        return MicroInputs(rows, agg or {}, whole, whole if sp is None else stream.to(device))
    ids, mask, pos, r_kept = trim_padding(
        mb["input_ids"], mb["attention_mask"], mb["position_ids"], mb.prompt_length
    )
    labels = mb["responses"][:, :r_kept]
    tokens = PaddedTokens(
        *(host_to_device(t, device) for t in (ids, mask, pos)), r_kept, host_to_device(labels, device)
    )
    return MicroInputs(rows, agg or {}, padded=tokens)


def forward_batch(
    model: nn.Module,
    mb: Batch,
    head: Head,
    device: torch.device,
    packed: bool = False,
    sp: SequenceParallel | None = None,
) -> tuple[torch.Tensor, ...]:
    """`forward` of a micro-batch as the host holds it."""
    return forward(model, micro_inputs(mb, [], device, packed, sp), head, sp)


# The key that chooses padded micro-batches for each role that takes gradients.
PADDING_KEYS = {
    "actor": "actor_rollout_ref.model.use_remove_padding",
    "critic": "critic.model.use_remove_padding",
}


class ModelForwards:
    """`model` on `device`: padding-free when `use_remove_padding` and the architecture allows it;
    on CUDA, bf16 copies of the float32 weights for compute (`fulcrum.models.precision`), except
    the parameters under `keep` (e.g. the critic's value head), and with `use_torch_compile` the
    packed decoder layers and log-softmax chunks compiled (`compile_decoder_layers`).

    `lm_head_fp32` (actor_rollout_ref.model.lm_head_fp32): log-probs from float32 LM-head logits
    (`fulcrum.models.head_logits`), as the native engine samples with the key on; packed path only.

    `sp_size` > 1 (the role's `ulysses_sequence_parallel_size`, named by `sp_key`): each micro-batch's
    packed stream is split over a group of `sp_size` ranks (`fulcrum.parallel.ulysses`), which share
    the micro-batch; the data is split over the world / `sp_size` groups.

    `cuda_graphs` (the role's `cuda_graphs` key): its micro-batches replayed as CUDA graphs where they
    can be (`graphs_off` says why not); `cpp_wrapper` (actor_rollout_ref.actor.inductor_cpp_wrapper):
    the compiled code under inductor's C++ wrapper."""

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
        reason = packing_unsupported_reason(model.config) if use_remove_padding else None
        if reason is not None:
            logger.warning("%s: use_remove_padding=True but %s; using padded micro-batches", role, reason)
        self.packed = use_remove_padding and reason is None
        refusal = None if self.packed or role not in PADDING_KEYS else padded_training_refusal(model, device)
        if refusal is not None:
            raise ConfigError(
                f"{PADDING_KEYS[role]}=False: padded micro-batches run the model's own forward, which sends "
                f"its linear-attention layers to flash-linear-attention, and {refusal}; set it to True (the "
                "packed path trains them with the torch reference here)",
                PADDING_KEYS[role],
            )
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
        self.graphs_off = graphs_refused(
            model, device, enabled=cuda_graphs, packed=self.packed, compute=self.compute, sp=self.sp
        )
        self.graphs = CudaGraphs(device, self.compute) if self.graphs_off is None and self.compute else None

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

    def inputs(
        self, mb: Batch, keys: list[str], agg: Mapping[str, float | torch.Tensor] | None = None
    ) -> MicroInputs:
        """`micro_inputs` in this model's layout."""
        return micro_inputs(mb, keys, self.device, self.packed, self.sp, agg)

    def forward(self, inputs: MicroInputs, head: Head) -> tuple[torch.Tensor, ...]:
        """`forward` of this model (`head` with this model's LM-head precision)."""
        if isinstance(head, LogProbHead) and self.lm_head_fp32:
            head = LogProbHead(head.temperature, head.entropy, fp32_logits=True)
        return forward(self.model, inputs, head, self.sp)

    def run(
        self,
        mb: Batch,
        keys: list[str],
        fn: Callable[..., T],
        static: tuple[object, ...] = (),
        agg: Mapping[str, float] | None = None,
        train: bool = False,
        device_only: bool = True,
    ) -> T:
        """`fn(inputs, *static)` on the micro-batch `mb` (its columns `keys`): `fn` reads only its inputs
        (`static`, hashable, are what else shapes its work; `agg`, the mini-batch's counts, come in the
        inputs), and returns tensors and floats in tuples and dicts, per-row tensors (B, ...) first
        dimension. Replayed as a CUDA graph where this model has them and `fn` is `device_only` (it
        reads no value on the host), else run eagerly. `train`: `fn` ends with `backward`."""
        if self.graphs is not None and device_only:
            out = self.graphs(mb, keys, fn, static, agg or {}, train)
            if out is not None:
                return out
        return fn(self.inputs(mb, keys, agg), *static)

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
        self, batch: Batch, sizes: ForwardSizes, head: Head, padded: bool = False
    ) -> list[torch.Tensor]:
        """`head`'s outputs over the whole batch in eval mode without gradients, (B, R) each in the batch's
        row order, on the CPU. `padded`: padded micro-batches over the float32 masters (no compute
        weights), whatever this model's layout.

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
        was_training = self.model.training
        self.model.eval()  # no dropout: log-probs must match what the update's ratio starts from
        try:
            with torch.no_grad(), contextlib.nullcontext() if padded else self.active():
                if padded:
                    outputs = [
                        forward(self.model, micro_inputs(mb, [], self.device, False), head) for mb in micro
                    ]
                else:
                    outputs = [self.run(mb, [], self.forward, (head,)) for mb in micro]
        finally:
            self.model.train(was_training)
        return [restore_order(list(parts), order).cpu() for parts in zip(*outputs, strict=True)]

    def token_mask(self, inputs: MicroInputs) -> torch.Tensor | None:
        """Which rows of a forward's per-token tensors (e.g. router logits) are real tokens: the padded
        forward runs the trimmed (B, T') grid, flattened; the packed stream holds only real tokens (None);
        with sequence parallelism this rank's slice of it, padded at the stream's end (`real_tokens`)."""
        if inputs.padded is not None:
            return inputs.padded.attention_mask.reshape(-1)
        if self.sp is None:
            return None
        assert inputs.packed is not None
        return real_tokens(inputs.packed.input_ids.numel(), self.sp.size, self.sp.rank).to(self.device)


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


def graphs_line(forwards: dict[str, ModelForwards]) -> str | None:
    """`startup_line` of these roles' forwards (None when none runs on CUDA)."""
    if not any(f.device.type == "cuda" for f in forwards.values()):
        return None
    parts = []
    for role, f in forwards.items():
        if f.graphs_off is None and f.compute is not None:
            parts.append(f"{role} on ({resident_bytes(f.compute) / 2**30:.1f} GiB kept resident)")
        else:
            parts.append(f"{role} off ({f.graphs_off})")
    keys = ", ".join(GRAPH_KEYS[role] for role in forwards)
    return "CUDA graphs of the micro-batches: " + ", ".join(parts) + f" [{keys}]"
