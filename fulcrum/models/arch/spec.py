"""What fulcrum knows of an architecture family: `ModelSpec`, and the shape arithmetic every family shares.

A family module (llama.py, qwen2.py, ...) builds one `ModelSpec`: the Hugging Face config fields the
native decoder honours, the decoder's features (biases, QK-norm), the HF parameter names it loads,
and whether the packed training path replays its base model. Shapes, FLOPs and bytes come from
`ModelShape`, which the spec fills from a config. This module is torch-free: `fulcrum doctor` reads it.

Every field of a family's config class is classified, so that a model is never sampled by a function
other than the one the trainer differentiates:

- HONOURED: the decoder reads the field and computes what Hugging Face computes with it;
- HARMLESS: the field does not change what Hugging Face computes at inference (names, token ids,
  dtype, training-only dropout, output switches);
- `Runs(...)`: the decoder does not implement the field, and runs only the values for which Hugging
  Face computes what the decoder does (usually the default); any other value is refused.

Fields that the config class does not declare (a checkpoint's own extras such as SmolLM2's
`rope_interleaved`) are ignored by Hugging Face's model too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

HONOURED = "honoured"
HARMLESS = "harmless"

# RoPE variants whose frequencies are fixed: the decoder takes inv_freq and the attention scaling from
# the Hugging Face rotary module, so these match (Llama 3.x's `llama3` included). `dynamic` and
# `longrope` change with the sequence length, `proportional` rotates part of a head: the decoder's one
# fixed table cannot follow them.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def config_value(config: Any, name: str, default: Any = None) -> Any:
    """A field of a Hugging Face config object or of its config.json dict."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


@dataclass(frozen=True)
class Runs:
    """A field the decoder does not implement: `accepts(value, config, max_model_len)` is True for the
    values it runs as Hugging Face does (`max_model_len`: the longest sequence the engine runs, None
    when unknown); `supported` says which, for the message."""

    accepts: Callable[[Any, Any, int | None], bool]
    supported: str


def _static_rope(value: Any, _config: Any = None, _max_len: int | None = None) -> bool:
    """rope_parameters (or the older rope_scaling): null, one variant's dict, or a dict per layer type."""
    if not value:
        return True
    if not isinstance(value, dict):
        return False
    if all(isinstance(v, dict) for v in value.values()):
        return all(_static_rope(v) for v in value.values())
    return value.get("rope_type", value.get("type", "default")) in STATIC_ROPE_TYPES


def _local_and_global(layer_types: Any, _config: Any = None, _max_len: int | None = None) -> bool:
    return layer_types is None or set(layer_types) <= {"sliding_attention", "full_attention"}


# `layer_types` of a family whose layers are local (a sliding window) or global (Gemma 3, Qwen2/Qwen3).
LOCAL_AND_GLOBAL_LAYERS = Runs(_local_and_global, "sliding_attention and full_attention layers")


def windows_by_layer_type(config: Any) -> dict[str, int | None]:
    """Local layers slide `sliding_window` tokens (a token sees the window latest, itself included);
    global layers see everything. Qwen2/Qwen3's config leaves `sliding_window` None unless
    `use_sliding_window`, and then marks the layers from `max_window_layers` on as local."""
    return {"sliding_attention": config_value(config, "sliding_window"), "full_attention": None}


def _false(value: Any, _config: Any, _max_len: int | None) -> bool:
    return not value


COMMON: dict[str, str | Runs] = {
    # the decoder's shapes and arithmetic
    "model_type": HONOURED,  # checked first: one of the registry's
    "vocab_size": HONOURED,
    "hidden_size": HONOURED,
    "intermediate_size": HONOURED,
    "num_hidden_layers": HONOURED,
    "num_attention_heads": HONOURED,
    "num_key_value_heads": HONOURED,
    "head_dim": HONOURED,
    "rms_norm_eps": HONOURED,
    "max_position_embeddings": HONOURED,  # the RoPE table's first size (it grows past it as HF's does)
    "tie_word_embeddings": HONOURED,  # the head is the embedding
    "rope_theta": HONOURED,  # older transformers' spelling, inside inv_freq
    "hidden_act": Runs(lambda value, _c, _m: value in ("silu", "swish"), "silu"),
    "rope_parameters": Runs(_static_rope, f"rope_type one of {list(STATIC_ROPE_TYPES)}"),
    "rope_scaling": Runs(_static_rope, f"rope_type one of {list(STATIC_ROPE_TYPES)}"),  # older name
    "quantization_config": Runs(_false, "no quantization"),
    # what does not change the function sampled
    "_name_or_path": HARMLESS,
    "architectures": HARMLESS,
    "transformers_version": HARMLESS,
    "dtype": HARMLESS,  # the engine has its own (rollout.dtype)
    "torch_dtype": HARMLESS,
    "id2label": HARMLESS,
    "label2id": HARMLESS,
    "problem_type": HARMLESS,
    "return_dict": HARMLESS,
    "output_attentions": HARMLESS,
    "output_hidden_states": HARMLESS,
    "chunk_size_feed_forward": HARMLESS,  # not read by these decoders' modules
    "is_encoder_decoder": HARMLESS,  # never true for these decoders
    "use_cache": HARMLESS,
    "initializer_range": HARMLESS,  # initialisation only
    "attention_dropout": HARMLESS,  # training mode only; sampling never drops
    "pad_token_id": HARMLESS,
    "bos_token_id": HARMLESS,
    "eos_token_id": HARMLESS,  # stop ids come from the tokenizer and generation_config
}

# Qwen2 and Qwen3 declare a sliding window that acts only on the layers `layer_types` marks.
QWEN_WINDOW_FIELDS: dict[str, str | Runs] = {
    "layer_types": LOCAL_AND_GLOBAL_LAYERS,
    "use_sliding_window": HONOURED,  # through sliding_window and layer_types, which it decides
    "sliding_window": HONOURED,
    "max_window_layers": HARMLESS,  # it only decides layer_types
}

# Hugging Face parameter names of one decoder layer (under `model.layers.{i}.`) -> the decoder's slot.
# The decoder fuses q/k/v and gate/up and knows how each slot splits over tensor-parallel ranks; a
# slot the decoder does not have for a config (a bias, QK-norm) is skipped.
LLAMA_LAYER_WEIGHTS: dict[str, str] = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "self_attn.o_proj.weight": "o",
    "self_attn.o_proj.bias": "o_bias",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
}
# The names outside the layers -> slot.
LLAMA_MODEL_WEIGHTS: dict[str, str] = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
}


def never(_config: Any) -> bool:
    return False


def attention_bias(config: Any) -> bool:
    return bool(config_value(config, "attention_bias", False))


@dataclass(frozen=True)
class ModelShape:
    """The sizes FLOPs and bytes are computed from: h hidden, L layers, H / K query / KV heads of dim d,
    I intermediate, V vocab."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool
    o_bias: bool = False
    qk_norm: bool = False
    qk_norm_over_heads: bool = False  # OLMo: one q norm H·d wide and one k norm K·d wide, not d each
    norms_per_layer: int = 2  # 4 with Gemma's norms around attention and MLP outputs
    moe_layers: int = 0  # layers whose MLP is `experts` experts of width `expert_intermediate`
    experts: int = 0
    active_experts: int = 0  # top-k: the experts each token runs
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0  # Qwen3-Next: a SwiGLU every token runs beside the experts
    # Hybrid models (Qwen3.5): layers whose token mixer is Gated DeltaNet (no KV cache; a recurrent state
    # per sequence), with Hk key heads of Dk and Hv value heads of Dv and a conv of K taps; the other
    # layers attend, their q projection twice as wide with `attention_output_gate`.
    linear_layers: int = 0
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    attention_output_gate: int = 0
    linear_layer_ids: tuple[int, ...] = ()  # which layers are Gated DeltaNet
    # Qwen3-Next: the input projections fused per key-head group (in_proj_qkvz, in_proj_ba), Qwen3.5's
    # separate (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a): the Linears LoRA adapts.
    linear_projections_fused: bool = False

    @property
    def attention_layers(self) -> int:
        """Layers that attend over a KV cache."""
        return self.layers - self.linear_layers

    @property
    def linear_conv_channels(self) -> int:
        """The Gated DeltaNet conv's channels, q, k and v: 2·Hk·Dk + Hv·Dv."""
        return (
            2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim
        )


def dense_shape(
    config: Any, qkv_bias: bool, o_bias: bool = False, qk_norm: bool = False, **extra: Any
) -> ModelShape:
    """A Llama-style decoder's shape from its config (object or config.json dict); KeyError names a
    missing key. `extra`: ModelShape's norm and expert fields."""

    def required(name: str) -> int:
        value = config_value(config, name)
        if value is None:
            raise KeyError(name)
        return int(value)

    hidden, heads = required("hidden_size"), required("num_attention_heads")
    return ModelShape(
        hidden=hidden,
        layers=required("num_hidden_layers"),
        heads=heads,
        kv_heads=int(config_value(config, "num_key_value_heads") or heads),
        head_dim=int(config_value(config, "head_dim") or hidden // heads),
        intermediate=int(config_value(config, "intermediate_size") or 4 * hidden),
        vocab=required("vocab_size"),
        tied_embeddings=bool(config_value(config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=qk_norm,
        **extra,
    )


def _mlp_params(shape: ModelShape, active: bool) -> int:
    """SwiGLU / GeGLU weights of all layers: 3·h·I per dense layer; per expert layer the router (E·h)
    and 3·h·I_e per expert, all E of them, or (`active`) the top-k a token runs, and a shared expert's
    3·h·I_s with its gate (h) where there is one (every token runs it)."""
    h = shape.hidden
    experts = shape.active_experts if active else shape.experts
    moe = shape.experts * h + experts * 3 * h * shape.expert_intermediate
    if shape.shared_expert_intermediate:
        moe += 3 * h * shape.shared_expert_intermediate + h
    return (shape.layers - shape.moe_layers) * 3 * h * shape.intermediate + shape.moe_layers * moe


def _linear_mixer_params(shape: ModelShape) -> tuple[int, int]:
    """(matmul weights, other weights) of one Gated DeltaNet mixer: projections h·(2·Hk·Dk + 2·Hv·Dv +
    2·Hv) in and Hv·Dv·h out; the conv (2·Hk·Dk + Hv·Dv)·K, dt_bias and A_log (Hv each), the norm (Dv)."""
    h, key = shape.hidden, shape.linear_key_heads * shape.linear_key_dim
    value = shape.linear_value_heads * shape.linear_value_dim
    matmul = h * (2 * key + 2 * value + 2 * shape.linear_value_heads) + value * h
    other = (
        shape.linear_conv_channels * shape.linear_conv_kernel
        + 2 * shape.linear_value_heads
        + shape.linear_value_dim
    )
    return matmul, other


def param_count(shape: ModelShape, lm_head: bool = True) -> int:
    """P = embeddings + L_a·attention + L_lin·Gated DeltaNet + L·(SwiGLU MLP + norms) + final norm
    (+ an untied LM head); an output-gated attention's q projection is twice as wide; the QK-norm weights
    are 2·d a layer, or H·d + K·d over all heads together."""
    h, d = shape.hidden, shape.head_dim
    q, kv = shape.heads * d, shape.kv_heads * d
    attention = h * q * (2 if shape.attention_output_gate else 1) + 2 * h * kv + q * h
    attention += (q + 2 * kv if shape.qkv_bias else 0) + (h if shape.o_bias else 0)
    if shape.qk_norm:
        attention += q + kv if shape.qk_norm_over_heads else 2 * d
    linear = sum(_linear_mixer_params(shape)) if shape.linear_layers else 0
    mixers = shape.attention_layers * attention + shape.linear_layers * linear
    head = shape.vocab * h if lm_head and not shape.tied_embeddings else 0
    norms = shape.layers * shape.norms_per_layer * h
    return shape.vocab * h + mixers + norms + _mlp_params(shape, False) + h + head


def decoder_matmul_params(shape: ModelShape) -> int:
    """The decoder layers' linears: every layer's attention (or linear-attention) projections and MLP;
    of a mixture of experts the router and the experts a token runs. A token's forward through the layers
    is 2 · this many FLOPs, besides attention's own."""
    h, d = shape.hidden, shape.head_dim
    q = shape.heads * d * (2 if shape.attention_output_gate else 1)
    attention = h * (q + shape.heads * d + 2 * shape.kv_heads * d)
    linear = _linear_mixer_params(shape)[0] * shape.linear_layers if shape.linear_layers else 0
    return attention * shape.attention_layers + linear + _mlp_params(shape, True)


def matmul_param_count(shape: ModelShape, lm_head: bool = True) -> int:
    """verl's N for the MFU: `decoder_matmul_params`, plus the embedding and the LM head (`lm_head=False`,
    the critic with its scalar value head: the embedding once); biases and norms not counted, a tied
    head counted twice, as verl."""
    return decoder_matmul_params(shape) + (2 if lm_head else 1) * shape.vocab * shape.hidden


def train_flops(shape: ModelShape, seq_lengths: list[int], lm_head: bool = True) -> float:
    """FLOPs of one forward + backward over sequences of these lengths (verl's estimate):
    6·N·Σℓ + 12·Σℓ²·d·H·L_a, N = `matmul_param_count`, L_a the attention layers (a linear-attention
    layer's state update is linear in ℓ and not counted); recomputation is not counted."""
    tokens = sum(seq_lengths)
    square_sum = sum(s * s for s in seq_lengths)
    attention = 12.0 * square_sum * shape.head_dim * shape.heads * shape.attention_layers
    return 6.0 * matmul_param_count(shape, lm_head) * tokens + attention


def kv_bytes_per_token(shape: ModelShape, element_bytes: int = 2) -> int:
    """K and V of every attention layer: L_a · 2 · K · d · element bytes (bf16 by default)."""
    return shape.attention_layers * 2 * shape.kv_heads * shape.head_dim * element_bytes


def recurrent_state_bytes(shape: ModelShape, element_bytes: int = 2) -> int:
    """One sequence's state in the linear-attention layers, whatever its length: per layer the delta-rule
    state Hv · Dk · Dv in float32 and the conv window (2·Hk·Dk + Hv·Dv) · (K - 1) in the engine dtype."""
    if not shape.linear_layers:
        return 0
    delta = shape.linear_value_heads * shape.linear_key_dim * shape.linear_value_dim * 4
    conv = shape.linear_conv_channels * (shape.linear_conv_kernel - 1) * element_bytes
    return shape.linear_layers * (delta + conv)


def _shown(value: Any) -> str:
    """A value for a one-line message: a long per-layer list as counts ([28 x 'full_attention', ...])."""
    if isinstance(value, list) and len(value) > 4:
        counts = Counter(map(repr, value))
        return "[" + ", ".join(f"{n} x {item}" for item, n in counts.items()) + "]"
    return repr(value)


@dataclass(frozen=True)
class ModelSpec:
    """One architecture family, as the native engine, the packed path, the MFU and the memory estimate
    need it (see the module docstring)."""

    model_type: str
    fields: Mapping[str, str | Runs]  # every field of the family's config class, classified
    qkv_bias: Callable[[Any], bool]  # q/k/v projections carry biases
    o_bias: Callable[[Any], bool] = never  # the output projection carries a bias
    qk_norm: bool = False  # RMSNorm over each head's q and k (head_dim wide) before RoPE
    # OLMo 2/3: the QK-norm spans all heads of a token (q_norm H·d wide, k_norm K·d), not each head.
    qk_norm_over_heads: bool = False
    # `fulcrum.models.packed.packed_hidden_states` replays the base model's forward exactly
    # (embed -> rotary -> layers -> final norm); None, else why not for this config.
    packing_refused: Callable[[Any], str | None] = lambda _config: None
    # The sliding window every layer applies (a token sees the window latest positions), None for none:
    # the padded training forward's own mask (`fulcrum.models.logprob.no_empty_rows_mask`) applies it.
    window: Callable[[Any], int | None] = lambda _config: None
    # Families whose layers differ (Gemma 3's local and global layers): the window of each
    # `layer_types` entry; Hugging Face's model then takes one attention mask per layer type.
    windows_by_layer_type: Callable[[Any], dict[str, int | None]] | None = None
    layer_weights: Mapping[str, str] = field(default_factory=lambda: LLAMA_LAYER_WEIGHTS)
    model_weights: Mapping[str, str] = field(default_factory=lambda: LLAMA_MODEL_WEIGHTS)
    # Gemma's layer: RMSNorm weights stored as w - 1 (`norm_offset` 1), a norm on the attention and
    # on the MLP output too (`sandwich_norms`), embeddings scaled (`embed_scale`, sqrt(hidden)).
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    # OLMo 2/3: no norm on the layer's or the MLP's input; only the attention and MLP outputs are
    # normed (Hugging Face's post_attention_layernorm and post_feedforward_layernorm) before each
    # residual sum.
    pre_norms: bool = True
    # Which layers rotate q and k (SmolLM3's `no_rope_layers`: 0 marks a layer without positions,
    # NoPE); empty when every layer does.
    rotary_layers: Callable[[Any], list[bool]] = lambda _config: []
    embed_scale: Callable[[Any], float] = lambda _config: 1.0
    attention_scale: Callable[[Any], float | None] = lambda _config: None  # None: head_dim ** -0.5
    activation: Callable[[Any], str] = lambda _config: "silu"  # the MLP gate's: "silu" or "gelu_tanh"
    # Mixture of experts: which layers route to experts, and the experts' sizes for ModelShape
    # (moe_layers, experts, active_experts, expert_intermediate); empty for a dense family.
    moe_layers: Callable[[Any], list[bool]] = lambda _config: []
    moe_shape: Callable[[Any], dict[str, int]] = lambda _config: {}
    # The training path's layers call aten's `_grouped_mm` (Hugging Face's experts, whose default
    # `experts_implementation` is grouped_mm): `fulcrum.models.packed.compile_options` asks it.
    grouped_mm: Callable[[Any], bool] = never
    # Hybrid families: which layers are linear attention (a recurrent state per sequence, no KV), and
    # their sizes for ModelShape (`linear_layers`, ...); empty for a family that only attends.
    linear_layers: Callable[[Any], list[bool]] = lambda _config: []
    linear_shape: Callable[[Any], dict[str, Any]] = lambda _config: {}

    def shape(self, config: Any) -> ModelShape:
        norms = 4 if self.sandwich_norms else 2
        extra = {"norms_per_layer": norms, "qk_norm_over_heads": self.qk_norm_over_heads}
        extra |= self.moe_shape(config) | self.linear_shape(config)
        return dense_shape(config, self.qkv_bias(config), self.o_bias(config), self.qk_norm, **extra)

    def layer_windows(self, config: Any) -> list[int | None]:
        """The sliding window of each layer (None: full causal attention)."""
        layers = int(config_value(config, "num_hidden_layers"))
        if self.windows_by_layer_type is None:
            return [self.window(config)] * layers
        by_type = self.windows_by_layer_type(config)
        return [by_type[kind] for kind in config_value(config, "layer_types")[:layers]]

    def unsupported_reason(self, config: Any, max_model_len: int | None = None) -> str | None:
        """The first field whose value the decoder does not run, or fields the list does not classify."""
        missing = object()
        for name, rule in self.fields.items():
            if not isinstance(rule, Runs):
                continue
            value = getattr(config, name, missing)
            if value is not missing and not rule.accepts(value, config, max_model_len):
                return f"{name}={_shown(value)} (it runs {rule.supported})"
        unknown = sorted(set(type(config)().to_dict()) - set(self.fields))
        if unknown:
            return f"the {self.model_type} config field(s) {unknown}, which it does not know"
        return None
