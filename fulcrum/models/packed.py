"""Padding-free (packed) forwards over a Hugging Face decoder (`use_remove_padding=True`).

A micro-batch of padded rows (B, P + R) becomes one stream of its N real tokens, each sequence's
positions restarting at 0, with `cu_seqlens` (S + 1,) marking where sequences start. The decoder's
own layers run over the stream (Hugging Face modules and weights, nothing re-implemented but the
outer loop); attention goes through `fulcrum.models.packed_attention.packed_attention`, registered with
transformers under `PACKED_ATTENTION`: flash-style varlen attention on CUDA, one causal SDPA over the
sequences side by side elsewhere. Calls without packing metadata fall through to transformers' SDPA, so a
model switched to packed attention still runs padded batches as before.

Only the positions that predict a response token are then read (`PackedMicroBatch.predictor`), so
the LM head or value head runs on M ≤ N rows, and padding costs no compute anywhere.

The packing and the compiled regions (plain, and inside FSDP units) depend on the stream's layout
(`cu_seqlens`, `max_seqlen`), which this module defines; the attention over it is its own module.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fulcrum.batch import host_to_device
from fulcrum.models.arch import SPECS, spec_for
from fulcrum.models.checkpoint_policy import CHECKPOINT_CONTEXTS
from fulcrum.models.inductor_toolchain import c_shim_declares, cpp_compiler_found
from fulcrum.models.packed_attention import packed_attention
from fulcrum.models.packed_recurrent import enable_packed_recurrence
from fulcrum.parallel.ulysses import SequenceParallel

logger = logging.getLogger(__name__)

# The name under which `packed_attention` is registered with transformers' attention interfaces.
PACKED_ATTENTION = "fulcrum_packed"


class PackedStream(Protocol):
    """What the decoder runs over: a `PackedMicroBatch`, or one rank's `StreamShard` of it."""

    input_ids: torch.Tensor  # (N,) long
    position_ids: torch.Tensor  # (N,) long
    cu_seqlens: torch.Tensor  # (S + 1,) int32
    max_seqlen: int


@dataclass
class PackedMicroBatch:
    """A micro-batch without padding. N tokens in S sequences; M response tokens of a (B, R) grid."""

    input_ids: torch.Tensor  # (N,) long
    position_ids: torch.Tensor  # (N,) long, restarting at 0 in each sequence
    cu_seqlens: torch.Tensor  # (S + 1,) int32, start offsets of the sequences in the stream
    max_seqlen: (
        int  # a bound on the longest sequence: the padded width P + R (constant, so compiled code is reused)
    )
    predictor: torch.Tensor  # (M,) long: stream index of the position that predicts response token m
    labels: torch.Tensor  # (M,) long: response token m
    rows: torch.Tensor  # (M,) long: its row in the (B, R) grid
    cols: torch.Tensor  # (M,) long: its column in the (B, R) grid
    shape: tuple[int, int]  # (B, R)

    def to(self, device: torch.device) -> PackedMicroBatch:
        return PackedMicroBatch(**fields_on(self, device))

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """(M,) per-response-token values → (B, R) float32, zero where no response token is."""
        out = torch.zeros(self.shape, dtype=torch.float32, device=values.device)
        return out.index_put_((self.rows, self.cols), values.float())


def pack_micro_batch(
    input_ids: torch.Tensor,  # (B, P + R): left-padded prompt, right-padded response
    attention_mask: torch.Tensor,  # (B, P + R), 1 = real token
    position_ids: torch.Tensor,  # (B, P + R)
    prompt_length: int,
) -> PackedMicroBatch:
    """Drop every padding token and index the response tokens in the packed stream (pure index work).

    Stream index of real token (b, t): cu[b] + (number of real tokens in row b up to t) - 1; response
    token (b, j) is predicted by the stream position just before it, which must be in the same
    sequence (every row needs at least one prompt token).
    """
    real = attention_mask.bool()  # (B, T)
    lengths = real.sum(-1)  # (B,)
    starts = lengths.cumsum(0) - lengths  # (B,) where each row's tokens start in the stream
    stream_index = real.long().cumsum(-1) - 1 + starts[:, None]  # (B, T), valid where real
    response_real = real[:, prompt_length:]  # (B, R)
    no_prompt = (real[:, :prompt_length].sum(-1) == 0) & response_real.any(-1)
    if bool(no_prompt.any()):
        row = int(no_prompt.nonzero()[0, 0])
        raise ValueError(
            f"row {row} has response tokens but no prompt token: nothing predicts its first token"
        )
    rows, cols = response_real.nonzero(as_tuple=True)  # (M,), (M,)
    predictor = stream_index[:, prompt_length:][rows, cols] - 1  # (M,)
    nonempty = lengths[lengths > 0]
    cu_seqlens = torch.zeros(len(nonempty) + 1, dtype=torch.int32)
    cu_seqlens[1:] = nonempty.cumsum(0)
    return PackedMicroBatch(
        input_ids=input_ids[real],
        position_ids=position_ids[real],
        cu_seqlens=cu_seqlens,
        max_seqlen=int(input_ids.shape[1]),
        predictor=predictor,
        labels=input_ids[:, prompt_length:][rows, cols],
        rows=rows,
        cols=cols,
        shape=(input_ids.shape[0], input_ids.shape[1] - prompt_length),
    )


def fields_on(obj: object, device: torch.device) -> dict[str, object]:
    """A dataclass's fields by name, its tensors copied to `device` (asynchronously from the host)."""
    return {
        f.name: (host_to_device(v, device) if isinstance(v, torch.Tensor) else v)
        for f in fields(obj)
        for v in [getattr(obj, f.name)]
    }


def packing_unsupported_reason(config: object) -> str | None:
    """Why `packed_hidden_states` cannot run this Hugging Face config, or None when it can.

    It replays a base model whose forward is exactly embed → rotary → layers → final norm: the
    families of `fulcrum.models.arch` (each spec may refuse a config); others keep the padded path.
    """
    spec = spec_for(config)
    if spec is None:
        model_type = getattr(config, "model_type", None)
        return f"model_type={model_type!r} (packed: {', '.join(sorted(SPECS))})"
    return spec.packing_refused(config)


def enable_packed_attention(model: nn.Module) -> None:
    """Route the model's attention through `packed_attention` (padded calls still get SDPA), and its
    linear-attention layers' packed calls through `enable_packed_recurrence` (a state per sequence)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)  # padded calls build SDPA's mask
    model.config._attn_implementation = PACKED_ATTENTION
    enable_packed_recurrence(model)


# Decoder layers per compiled region. Each region call pays dynamo's guards and AOTAutograd's runtime
# wrapper on the host; with the checkpoint inside the region and the C++ wrapper launching its kernels,
# one layer a region keeps a seed-size micro-batch (6k tokens) close to the same micro-batch replayed as
# a CUDA graph, and larger regions cost compile time.
LAYERS_PER_REGION = 1

# Checkpointing keeps each layer's input and recomputes the rest in the backward. It also keeps the
# attention kernel's outputs (selective checkpointing, as torchtitan does), for 1.8 kB a token a layer
# more (bf16 output and float32 log-sum-exp at Qwen2.5-0.5B's width; +0.25 GiB at the seed command's
# micro-batches): the backward skips recomputing attention, and the compiler has no random kernel to
# replay in the recomputation (it wraps the flash kernel, which takes an RNG state even at dropout 0, in
# GraphSafeRunWithRngState, which inductor's C++ wrapper refuses). The recomputation it saves outweighs
# the memory at seed-command sizes for both the actor's and the critic's update.
SAVE_ATTENTION_OUTPUTS = True

# Checkpointing may also keep the outputs of each layer's expanding projections (a matmul whose output is
# wider than its input: the MLP's gate and up projections), so that the backward recomputes only the
# attention projections and elementwise ops: about 87 % of a Qwen2.5-0.5B layer's recomputed matmul FLOPs
# go, for 2 x intermediate x 2 B a token a layer more (19.5 kB; +2.9 GB at the seed command's 6,144-token
# micro-batches). Off: at the seed command's sizes it speeds the actor's update and slows the critic's
# about as much, for more than 2 GiB at each update's peak, so the step gains nothing
# (`bench/passes.py --ab save_mlp` measures it). (`fulcrum doctor`'s memory estimate assumes it off.)
SAVE_MLP_PROJECTIONS = False


# Under the Python wrapper, inductor's mix-order reduction (torch >= 2.10; the C++ wrapper does not
# support it) fuses a backward's row-wise and column-wise reductions only above 5,242,880 elements, and
# guards on that size: with dynamic sizes, a micro-batch on the other side of 5,242,880 / hidden tokens
# (5,851 at Qwen2.5-0.5B's width, inside the seed command's range) compiles the update again. Off, the
# Python wrapper compiles the fusions the C++ wrapper does, with no size guard.
@functools.cache
def python_wrapper_options() -> dict[str, object]:
    """Inductor options for the Python wrapper: mix-order reduction off where the installed torch has it
    (imported here, not with the module: inductor's config takes a second to import)."""
    from torch._inductor import config as inductor_config

    return (
        {"triton.mix_order_reduction": False}
        if hasattr(inductor_config.triton, "mix_order_reduction")
        else {}
    )


# Inductor checks the host CPU's vector instruction set once a process, for the flags of the C++ it
# builds: a test library per candidate, each loaded by a new Python that imports torch (seconds of every
# run's first step, BENCHMARKS.md "A run's first step"). The kernels of CUDA passes run on the GPU, and
# the C++ wrapper has no vector loops: told no vector set is usable, inductor skips the check.
GPU_HOST_OPTIONS: dict[str, object] = {"cpp.vec_isa_ok": False}


# Inductor's C++ wrapper for the compiled regions on CUDA: their kernels are launched from compiled C++
# instead of generated Python, whose per-kernel host cost bounds micro-batches of the seed command's size.
# Needs SAVE_ATTENTION_OUTPUTS (above), and is left out for layers that call an op the installed
# torch's C shim lacks (`compile_options`). The key actor_rollout_ref.actor.inductor_cpp_wrapper=false
# turns it off (`compile_options(cpp_wrapper=False)`).
def compile_options(
    backend: str = "inductor", config: object | None = None, device: str = "cuda", cpp_wrapper: bool = True
) -> dict[str, object] | None:
    """`torch.compile` options for the training passes' compiled code (None: the backend's defaults):
    inductor's C++ wrapper when `cpp_wrapper` (actor_rollout_ref.actor.inductor_cpp_wrapper) and the
    attention outputs are kept (`SAVE_ATTENTION_OUTPUTS`; without them the checkpointed regions hold the
    RNG-replay op the wrapper refuses), else its Python wrapper with `python_wrapper_options()`. For the
    decoder layers of a model (its Hugging Face `config`, on `device`), the Python wrapper also where
    they call aten's `_grouped_mm` (`ModelSpec.grouped_mm`) and the installed torch's C shim for
    `device` lacks it (`c_shim_declares`). On CUDA, with `GPU_HOST_OPTIONS`."""
    if backend != "inductor":
        return None
    host = GPU_HOST_OPTIONS if device == "cuda" else {}
    python_wrapper = {**python_wrapper_options(), **host} or None
    if not (cpp_wrapper and SAVE_ATTENTION_OUTPUTS and cpp_compiler_found()):
        return python_wrapper
    spec = spec_for(config) if config is not None else None
    if spec is not None and spec.grouped_mm(config) and not c_shim_declares("_grouped_mm", device):
        return python_wrapper
    return {"cpp_wrapper": True, **host}


def uses_cpp_wrapper(options: dict[str, object] | None) -> bool:
    """Whether `compile_options`' result compiles with inductor's C++ wrapper."""
    return bool(options and options.get("cpp_wrapper"))


def layer_compile_options(
    base: nn.Module, backend: str, cpp_wrapper: bool = True
) -> dict[str, object] | None:
    """`compile_options` for the decoder layers of `base`, on the device its weights are on."""
    return compile_options(backend, base.config, next(base.parameters()).device.type, cpp_wrapper)


# Dynamo's switch that lets a checkpointed region's forward have side effects (not replayed by the
# recomputation). Transformers' kernels hub wrapper (the `kernels` package, a dependency of transformers
# 5.25) sets and resets a context variable around each attention module's forward: by default dynamo
# refuses that inside a checkpoint, the graph breaks in the regions' loop, and every checkpointed layer runs
# eagerly, with no warning. The set and its reset leave nothing behind for a recomputation to need.
CHECKPOINT_SIDE_EFFECTS = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def compile_region(
    fn: Callable[..., torch.Tensor], backend: str | Callable[..., object], options: dict[str, object] | None
) -> Callable[..., torch.Tensor]:
    """`torch.compile(fn)` with dynamic sizes, whose tracing lets a checkpointed layer's forward have
    side effects (`CHECKPOINT_SIDE_EFFECTS`, where the installed torch has the switch; set for its calls
    only)."""
    compiled = torch.compile(fn, dynamic=True, backend=backend, options=options)
    if not hasattr(torch._dynamo.config, CHECKPOINT_SIDE_EFFECTS):
        return compiled
    return torch._dynamo.config.patch({CHECKPOINT_SIDE_EFFECTS: True})(compiled)


def compile_decoder_layers(
    base: nn.Module,
    backend: str = "inductor",
    layers_per_region: int | None = None,
    cpp_wrapper: bool = True,
) -> None:
    """Compile `run_decoder_layers` for `packed_hidden_states`: the layers run in regions of
    `layers_per_region` (default `LAYERS_PER_REGION`), each region one compiled call, with gradient checkpointing (when the layers
    had it) applied to each layer inside the region, so the compiler folds the recomputation into the
    backward graph instead of replaying the forward from Python.

    Fusing RMSNorm, rotary embedding, SwiGLU and the residual adds cuts the layers' kernels several
    times over, and with them the Python and launch cost that bounds small micro-batches. Sizes are
    dynamic (every micro-batch has its own token count); every region shares one compiled graph. The
    regions are plain lists, not registered submodules (state dicts are unchanged), and the layers
    stay uncompiled, so padded calls (e.g. the hf rollout backend's `generate`, with its KV cache) run
    as before. Transformers' own checkpoint wrapper sits inside the layer's forward, where the
    compiler would have to trace it; it is switched off and applied by `run_decoder_layers` instead.
    `cpp_wrapper`: as `compile_options`.
    """
    checkpointed = take_over_checkpointing(base)
    layers = list(base.layers[: base.config.num_hidden_layers])
    layers_per_region = layers_per_region or LAYERS_PER_REGION
    base.fulcrum_checkpoint = checkpointed
    base.fulcrum_regions = [
        layers[i : i + layers_per_region] for i in range(0, len(layers), layers_per_region)
    ]
    base.fulcrum_compiled_run = compile_region(
        run_decoder_layers, backend, layer_compile_options(base, backend, cpp_wrapper)
    )


def compile_inside_layers(base: nn.Module, backend: str = "inductor", cpp_wrapper: bool = True) -> None:
    """`compile_decoder_layers` for layers that are FSDP2 units (`fully_shard`), as torchtitan orders
    them (checkpoint inside compile inside FSDP): each layer keeps its own call, so FSDP's hooks run
    eagerly around it (gather the layer's shards before, free them after, and their backward
    counterparts), and only the body of a packed call is compiled, checkpointed inside when the layers
    had gradient checkpointing, exactly as one region of `compile_decoder_layers`. FSDP keeps the
    gathered parameters' tensor objects across the free and the re-gather before the backward, so what
    the compiled graph saved stays valid for the recomputation.

    Every layer shares one compiled graph (the layer is an input). Calls without packing metadata
    (padded forwards) run the layer's own forward, uncompiled. State dicts are unchanged: the layers
    get an instance `forward`, nothing registered.
    """
    checkpointed = take_over_checkpointing(base)  # transformers' wrapper would sit outside FSDP's hooks
    options = layer_compile_options(base, backend, cpp_wrapper)
    compiled = compile_region(run_layer_body, backend, options)
    for layer in base.layers[: base.config.num_hidden_layers]:
        layer.forward = functools.partial(
            _packed_layer_call, compiled, layer, type(layer).forward, checkpointed
        )
    base.fulcrum_checkpoint = checkpointed


def _packed_layer_call(
    compiled: Callable[..., torch.Tensor],
    layer: nn.Module,
    forward: Callable[..., object],
    checkpointed: bool,
    hidden: torch.Tensor,
    **kwargs: object,
) -> object:
    if "fulcrum_cu_seqlens" not in kwargs:
        return forward(layer, hidden, **kwargs)
    recompute = checkpointed and layer.training and torch.is_grad_enabled()
    return compiled(forward, layer, hidden, recompute, kwargs)


def run_layer_body(
    forward: Callable[..., object],
    layer: nn.Module,
    hidden: torch.Tensor,
    recompute: bool,
    kwargs: dict[str, object],
) -> torch.Tensor:
    """`forward(layer, hidden, **kwargs)` (the layer class's own forward, below its hooks): (1, N, H);
    with `recompute`, under non-reentrant gradient checkpointing."""
    return call_layer(functools.partial(forward, layer), hidden, recompute, kwargs)


def call_layer(
    layer: Callable[..., object], hidden: torch.Tensor, recompute: bool, kwargs: dict[str, object]
) -> torch.Tensor:
    """`layer(hidden, **kwargs)`'s hidden states (1, N, H); with `recompute`, under non-reentrant
    gradient checkpointing (only its input is kept for the backward, and the attention kernel's
    outputs with `SAVE_ATTENTION_OUTPUTS`)."""
    if recompute:
        # The keyword only when selective: dynamo (torch 2.13) refused torch's default context_fn passed
        # explicitly ("checkpoint not implemented for ... LazyVariableTracker context_fn").
        # Both flags read (not `or`): dynamo guards on both, so a compiled region never outlives a
        # change of either (bench/passes.py --ab switches them), and each setting has its context
        # function with its own cache hash.
        flags = (SAVE_ATTENTION_OUTPUTS, SAVE_MLP_PROJECTIONS)
        selective = {"context_fn": CHECKPOINT_CONTEXTS[flags]} if any(flags) else {}
        out = checkpoint(layer, hidden, use_reentrant=False, **selective, **kwargs)
    else:
        out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def take_over_checkpointing(base: nn.Module) -> bool:
    """Whether the layers had transformers' gradient checkpointing, which is switched off: its wrapper
    sits inside each layer's forward, where the compiler would have to trace it; the compiled paths
    apply checkpointing themselves (`call_layer`)."""
    checkpointed = any(bool(getattr(layer, "gradient_checkpointing", False)) for layer in base.layers)
    for layer in base.layers:
        layer.gradient_checkpointing = False
    return checkpointed


def run_decoder_layers(
    layers: list[nn.Module], hidden: torch.Tensor, recompute: bool, kwargs: dict[str, object]
) -> torch.Tensor:
    """`hidden` (1, N, H) through `layers` in turn (`call_layer`). With one RoPE table per layer type
    (Gemma 3, OLMo 3), `position_embeddings` is a dict by type: each layer takes its attention's."""
    tables = kwargs["position_embeddings"]
    for layer in layers:
        if isinstance(tables, dict):
            kwargs = {**kwargs, "position_embeddings": tables[attention_type(layer)]}
        hidden = call_layer(layer, hidden, recompute, kwargs)
    return hidden


def attention_type(layer: nn.Module) -> str:
    """A decoder layer's `layer_types` entry, as its attention module keeps it (Gemma 3's `layer_type`,
    OLMo 3's `attention_type`)."""
    attention = layer.self_attn
    return getattr(attention, "layer_type", None) or attention.attention_type


def packed_hidden_states(
    base: nn.Module, packed: PackedStream, sp: SequenceParallel | None = None
) -> torch.Tensor:
    """The decoder's final-norm hidden states of the packed stream: (N, H); with `sp`, of this rank's
    `StreamShard` of it, (n, H), attention exchanging heads with the group's other ranks.

    `base` is the Hugging Face base model (`AutoModel`, or `model.model` of a causal LM) with
    `embed_tokens`, `rotary_emb`, `layers` and `norm`, switched to `PACKED_ATTENTION`. Each layer is
    called as the base model calls it, so gradient checkpointing set on the layers still applies;
    after `compile_decoder_layers` the layers run in compiled regions, checkpointed inside.
    """
    ids, positions = packed.input_ids[None], packed.position_ids[None]  # (1, N)
    hidden = base.embed_tokens(ids)  # (1, N, H)
    if not torch.is_grad_enabled():
        # Transformers' gradient checkpointing hooks the embedding to flag its output as requiring grad, a
        # flag no-grad work never reads but the compiled regions guard on: the first region's input alone
        # would carry it, and compile a graph of its own in every no-grad pass's process.
        hidden = hidden.detach()
    kinds = getattr(base.rotary_emb, "layer_types", None)  # Gemma 3, OLMo 3: a table per layer type
    if kinds is None:
        # Qwen3.5's M-RoPE: text positions on its three axes, as its text model passes them (transformers
        # before 5.2x takes only that (3, 1, N) form)
        rope_positions = (
            positions[None].expand(3, -1, -1) if hasattr(base.rotary_emb, "mrope_section") else positions
        )
        position_embeddings = base.rotary_emb(hidden, rope_positions)
    else:
        position_embeddings = {kind: base.rotary_emb(hidden, positions, kind) for kind in kinds}
    kwargs = {
        "attention_mask": None,
        "position_ids": positions,
        "position_embeddings": position_embeddings,
        "use_cache": False,
        "fulcrum_cu_seqlens": packed.cu_seqlens,
        "fulcrum_max_seqlen": packed.max_seqlen,
    }
    if sp is not None:
        kwargs["fulcrum_sp"] = sp
    compiled = getattr(base, "fulcrum_compiled_run", None)
    if compiled is None:  # uncompiled: the layers as the base model calls them (their own checkpointing)
        hidden = run_decoder_layers(base.layers[: base.config.num_hidden_layers], hidden, False, kwargs)
    else:
        recompute = base.fulcrum_checkpoint and base.training and torch.is_grad_enabled()
        for region in base.fulcrum_regions:
            hidden = compiled(region, hidden, recompute, kwargs)
    return base.norm(hidden)[0]  # (N, H)
