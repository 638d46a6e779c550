"""Per-device memory of a run, estimated before it starts, from the model's config.json and the sizes.

fulcrum keeps on each device, for the whole run: the actor (fp32 weights + AdamW's two fp32 moments;
fp32 gradients while it updates), the critic likewise (GAE only), the reference policy (fp32 weights,
only when a KL uses it) and the rollout engine. The native engine takes `gpu_memory_utilization` of
the device for its bf16 weights, a workspace and the KV cache (filling the rest); the KV cache is
released while the models train (`free_cache_engine`). So the step peaks either while generating
(every model's resident state + the engine's share) or while training (+ gradients, activations of
the largest micro-batch and its logits). `estimate()` returns both phases, itemised.

Shapes: P parameters, h hidden, L layers, H / K query / KV heads of dim d, I intermediate, V vocab; a
micro-batch of m rows of at most T = prompt + response tokens, R of them response tokens (the LM head
only runs on those). The per-token activation bytes of a layer are counted tensor by tensor under bf16
autocast with an fp32 residual stream (see `layer_activation_bytes`). docs/levers.md compares the
estimate with the measured peak of the seed run.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GiB = 1024**3
# The H200 the benchmarks ran on (about 140 GiB as torch reports it): the device assumed when none is
# visible and none is named (`fulcrum doctor --device-memory-gib`).
DEFAULT_DEVICE_GIB = 140.0
CUDA_CONTEXT_BYTES = 512 * 1024**2  # CUDA context, cuBLAS workspaces, allocator slack (rough)
# fulcrum.models.linear_logprob.CHUNK_ELEMENTS (a test keeps them equal; not imported, to keep torch out
# of `fulcrum doctor`): the LM head and log-softmax run on float32 (chunk, V) blocks of at most this many.
LOGIT_CHUNK_ELEMENTS = 1 << 27


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """From a Hugging Face config.json (llama/qwen2/mistral-style decoder); KeyError names a missing key."""
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        return cls(
            hidden=hidden,
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate=int(config.get("intermediate_size") or 4 * hidden),
            vocab=int(config["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=config.get("model_type") == "qwen2" or bool(config.get("attention_bias", False)),
        )


def read_model_shape(path: str | None) -> ModelShape | None:
    """The shape from `<path>/config.json`; None when it is not a readable local model folder."""
    if not path:
        return None
    config_file = Path(os.path.expanduser(path)) / "config.json"
    try:
        return ModelShape.from_config(json.loads(config_file.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def param_count(shape: ModelShape, lm_head: bool = True) -> int:
    """P = embeddings + L·(attention + SwiGLU MLP + 2 norms) + final norm (+ an untied LM head)."""
    h, d = shape.hidden, shape.head_dim
    q, kv = shape.heads * d, shape.kv_heads * d
    attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if shape.qkv_bias else 0)
    mlp = 3 * h * shape.intermediate
    per_layer = attention + mlp + 2 * h
    head = shape.vocab * h if lm_head and not shape.tied_embeddings else 0
    return shape.vocab * h + shape.layers * per_layer + h + head


def layer_activation_bytes(shape: ModelShape) -> int:
    """Bytes one token keeps for the backward of one decoder layer under bf16 autocast:
    fp32 residual inputs of the two norms (2·4h), bf16 normed inputs (2·2h), q, k, v and the attention
    output (2·(2q + 2kv)), the MLP's gate, up, activation and product (4·2I), plus fp32 norm statistics."""
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return 2 * 4 * h + 2 * 2 * h + 2 * (2 * q + 2 * kv) + 4 * 2 * i + 16


@dataclass
class Phase:
    """One phase's resident items (name -> bytes); `total` is their sum."""

    name: str
    items: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.items.values())


@dataclass
class Estimate:
    device_bytes: float
    device_known: bool  # a visible device or --device-memory-gib; else the default is assumed
    phases: list[Phase]
    kv_cache_bytes: float
    kv_tokens: int

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)


@dataclass(frozen=True)
class Sizes:
    """The sizes that set memory, read from a resolved configuration (worst case: full-length rows)."""

    seq_len: int  # prompt + response
    response_len: int
    update_rows: dict[str, int]  # role -> rows of the largest training micro-batch
    forward_rows: dict[str, int]  # role -> rows of the largest no-grad forward micro-batch
    checkpointing: dict[str, bool]  # role -> gradient checkpointing
    with_entropy: bool  # the actor's update also needs the softmax (entropy_coeff != 0)


def _rows(micro: int | None, dynamic: bool, token_limit: int | None, seq_len: int) -> int:
    """Rows of the largest micro-batch: the size, or with dynamic batching what the token budget holds."""
    if dynamic and token_limit:
        return max(1, token_limit // seq_len)
    return max(1, int(micro or 1))


def sizes_from(cfg: Any) -> Sizes:
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    seq = int(arr.rollout.prompt_length) + int(arr.rollout.response_length)
    update = {
        "actor": _rows(
            arr.actor.ppo_micro_batch_size_per_gpu,
            arr.actor.use_dynamic_bsz,
            arr.actor.ppo_max_token_len_per_gpu,
            seq,
        ),
        "critic": _rows(
            critic.ppo_micro_batch_size_per_gpu,
            bool(critic.use_dynamic_bsz),
            critic.ppo_max_token_len_per_gpu,
            seq,
        ),
    }
    forward = {
        "actor": _rows(
            arr.rollout.log_prob_micro_batch_size_per_gpu,
            bool(arr.rollout.log_prob_use_dynamic_bsz),
            arr.rollout.log_prob_max_token_len_per_gpu,
            seq,
        ),
        "reference": _rows(
            arr.ref.log_prob_micro_batch_size_per_gpu,
            bool(arr.ref.log_prob_use_dynamic_bsz),
            arr.ref.log_prob_max_token_len_per_gpu,
            seq,
        ),
        "critic": _rows(
            critic.forward_micro_batch_size_per_gpu,
            bool(critic.use_dynamic_bsz),
            critic.forward_max_token_len_per_gpu,
            seq,
        ),
    }
    return Sizes(
        seq_len=seq,
        response_len=int(arr.rollout.response_length),
        update_rows=update,
        forward_rows=forward,
        checkpointing={
            "actor": bool(arr.model.enable_gradient_checkpointing),
            "critic": bool(critic.model.enable_gradient_checkpointing),
        },
        with_entropy=float(arr.actor.entropy_coeff) != 0.0,
    )


def update_activation_bytes(shape: ModelShape, rows: int, seq_len: int, checkpointing: bool) -> float:
    """Activations of one training micro-batch: with checkpointing, each layer's fp32 input (4h per
    token) plus one layer recomputed in full; without, every layer in full."""
    tokens = rows * seq_len
    full_layer = layer_activation_bytes(shape) * tokens
    if checkpointing:
        return shape.layers * 4 * shape.hidden * tokens + full_layer
    return shape.layers * full_layer


def update_logits_bytes(shape: ModelShape, rows: int, response_len: int, with_entropy: bool) -> float:
    """The LM head on the response positions while training, chunk by chunk (fulcrum.models.linear_logprob):
    one float32 block of min(rows · R · V, LOGIT_CHUNK_ELEMENTS) elements, about four of them alive in the
    backward (logits, probabilities, their gradient, a temporary), one more for an entropy bonus."""
    elements = min(rows * response_len * shape.vocab, LOGIT_CHUNK_ELEMENTS)
    return elements * 4 * (4 + (1 if with_entropy else 0))


def forward_logits_bytes(shape: ModelShape, rows: int, response_len: int) -> float:
    """No-grad log-probs and entropy, chunk by chunk: the logits and probabilities of one float32 block."""
    return min(rows * response_len * shape.vocab, LOGIT_CHUNK_ELEMENTS) * 4 * 2


def engine_workspace_bytes(shape: ModelShape, max_num_batched_tokens: int, max_num_seqs: int) -> float:
    """The native engine's reserve beside the cache (its model_runner): one prefill step's widest tensors
    and the logits of a full decode batch, plus 512 MiB."""
    prefill = max_num_batched_tokens * (8 * shape.hidden + 6 * shape.intermediate) * 2
    return prefill + max_num_seqs * shape.vocab * 10 + 512 * 1024**2


def kv_bytes_per_token(shape: ModelShape) -> int:
    """K and V of every layer in bf16: L · 2 · K · d · 2 bytes."""
    return shape.layers * 2 * shape.kv_heads * shape.head_dim * 2


def update_phase(role: str, n_params: int, base: dict[str, float], shape: ModelShape, sizes: Sizes) -> Phase:
    """`role`'s ("actor" or "critic") update phase: `base` (what stays resident, name -> bytes), then
    its fp32 gradients (4 B x n_params), its bf16 compute weights (2 B x n_params) and the activations
    of its largest training micro-batch (sizes.update_rows[role] x sizes.seq_len tokens)."""
    rows, checkpointing = sizes.update_rows[role], sizes.checkpointing[role]
    phase = Phase(f"{role} update", dict(base))
    phase.items[f"{role} gradients (fp32)"] = 4 * n_params
    phase.items["bf16 compute weights"] = 2 * n_params
    phase.items[
        f"activations, micro-batch of {rows} x {sizes.seq_len} tokens "
        f"(checkpointing {'on' if checkpointing else 'off'})"
    ] = update_activation_bytes(shape, rows, sizes.seq_len, checkpointing)
    return phase


def estimate(
    cfg: Any,
    shape: ModelShape,
    device_bytes: float,
    device_known: bool,
    uses_critic: bool,
    uses_reference: bool,
    responses_per_device: int,
) -> Estimate:
    """The generation and training phases of one step on one device (see the module docstring)."""
    arr = cfg.actor_rollout_ref
    sizes = sizes_from(cfg)
    p_actor = param_count(shape)
    p_critic = param_count(shape, lm_head=False) + shape.hidden + 1  # trunk + value head
    resident = {"actor weights (fp32)": 4 * p_actor, "actor AdamW state (fp32)": 8 * p_actor}
    if uses_critic:
        resident["critic weights (fp32)"] = 4 * p_critic
        resident["critic AdamW state (fp32)"] = 8 * p_critic
    if uses_reference:
        resident["reference weights (fp32)"] = 4 * p_actor
    resident["CUDA context and workspaces"] = CUDA_CONTEXT_BYTES

    rollout = arr.rollout
    generation = Phase("generation", dict(resident))
    training_extra: dict[str, float] = {}
    if rollout.name == "native":
        engine_weights = 2 * p_actor
        workspace = engine_workspace_bytes(
            shape, int(rollout.max_num_batched_tokens), int(rollout.max_num_seqs)
        )
        budget = device_bytes * float(rollout.gpu_memory_utilization) - engine_weights - workspace
        # The engine also leaves 1 GiB of what is free when it wakes up.
        free_now = device_bytes - generation.total - engine_weights
        kv = max(0.0, min(budget, free_now - GiB))
        generation.items["engine weights (bf16)"] = engine_weights
        generation.items["engine workspace"] = workspace
        generation.items[f"KV cache (gpu_memory_utilization={rollout.gpu_memory_utilization})"] = kv
        training_extra["engine weights (bf16)"] = engine_weights
        if not rollout.free_cache_engine:
            training_extra["KV cache (free_cache_engine=False)"] = kv
    else:  # hf generate shares the actor's module; its cache holds the decoding batch
        batch = min(int(rollout.max_num_seqs), responses_per_device)
        kv = batch * sizes.seq_len * kv_bytes_per_token(shape)
        generation.items["KV cache of generate (bf16)"] = kv
        generation.items["decode logits (fp32)"] = batch * shape.vocab * 4 * 2
    kv_tokens = int(kv // kv_bytes_per_token(shape))

    phases = [generation]
    actor_update = update_phase("actor", p_actor, {**resident, **training_extra}, shape, sizes)
    actor_update.items["logits of the response tokens"] = update_logits_bytes(
        shape, sizes.update_rows["actor"], sizes.response_len, sizes.with_entropy
    )
    phases.append(actor_update)
    if uses_critic:
        phases.append(update_phase("critic", p_critic, {**resident, **training_extra}, shape, sizes))
    forward_rows = sizes.forward_rows["actor"]
    log_prob = Phase("old log-prob forward", {**resident, **training_extra})
    log_prob.items[f"logits, micro-batch of {forward_rows}"] = forward_logits_bytes(
        shape, forward_rows, sizes.response_len
    )
    log_prob.items["hidden states of one layer"] = (
        layer_activation_bytes(shape) * forward_rows * sizes.seq_len
    )
    phases.append(log_prob)
    return Estimate(device_bytes, device_known, phases, kv, kv_tokens)


def format_estimate(est: Estimate) -> list[str]:
    """Lines for `fulcrum doctor`: the peak phase itemised, the other phases' totals, against the device."""
    device = f"{est.device_bytes / GiB:.1f} GiB" + ("" if est.device_known else " (assumed: an H200)")
    peak = est.peak
    lines = [
        f"memory estimate per device (device {device}): peak {peak.total / GiB:.1f} GiB while in {peak.name}"
    ]
    for name, size in sorted(peak.items.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {size / GiB:8.2f} GiB  {name}")
    for phase in est.phases:
        if phase is not peak:
            lines.append(f"  other phase: {phase.name} {phase.total / GiB:.1f} GiB")
    if est.kv_cache_bytes > 0:
        lines.append(f"  KV cache holds {est.kv_tokens:,} tokens")
    return lines
