"""The native engine's decoder: a Llama-style causal LM over the paged KV cache, read top to bottom.

One decoder serves every family whose `ModelSpec` (fulcrum.models.arch) it has the features of:
Llama, Mistral (a sliding window), Qwen2 (q/k/v biases), Qwen3 (an RMSNorm over each head's q and
k), Gemma 3 (norms on the attention and MLP outputs, (1 + w) norms, scaled embeddings, local and
global layers with their own window and RoPE table, GELU), Qwen3-MoE (expert MLPs, `moe.py`),
Qwen3.5 and Qwen3-Next (Gated DeltaNet layers, `linear_attention.py`; Qwen3-Next's shared expert),
SmolLM3 (layers without RoPE), OLMo 3 (norms only on the attention and MLP outputs, a QK-norm over
all heads, local and global layers). The spec says which features a config has and which Hugging
Face names fill which slot; the decoder fuses q/k/v and gate/up and knows how each slot splits over
tensor-parallel ranks. Weights are the engine's own tensors (in the engine dtype), filled by
`load_weights`, always in place, so CUDA graphs captured over them stay valid across weight syncs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from fulcrum.models.arch import ModelSpec
from fulcrum.models.gated_delta import use_fla
from fulcrum.models.head_logits import head_logits
from fulcrum.parallel.tensor_parallel import TensorParallel, shard_heads, shard_range
from fulcrum.rollout.native import ops
from fulcrum.rollout.native.attention import AttentionMetadata, QKNorm, paged_attention, rotate_and_store
from fulcrum.rollout.native.models import moe
from fulcrum.rollout.native.models.linear_attention import (
    LinearAttentionShape,
    RecurrentStates,
    StateStep,
    fused_projection_targets,
    linear_attention,
)

Shard = tuple[int, int, int]  # (dim, start, length) of an HF tensor that one tensor-parallel rank holds
Target = tuple[torch.Tensor, Shard | None]  # (the (view of the) engine tensor, this rank's slice or None)
Rotary = tuple[torch.Tensor, float]  # (inv_freq (D/2,), attention scaling) of one RoPE table
# The table of layers without positions (NoPE): inv_freq 0 makes cos 1 and sin 0, so RoPE (the torch
# twin and the Triton kernel alike) leaves q and k exactly as they are.
NOPE = "no_rope"
# Wrappers that prefix parameter names: torch.compile, DDP/FSDP1, activation checkpointing.
_WRAPPER_PREFIXES = re.compile(r"(_orig_mod\.|module\.|_fsdp_wrapped_module\.|_checkpoint_wrapped_module\.)")


class DecoderLM:
    """A causal LM of `spec`'s family over the paged KV cache. Weights are plain tensors on `device`.

    With tensor parallelism (`tp.size > 1`, fulcrum.parallel.tensor_parallel) this rank holds its
    query heads, the K/V heads they read and its slice of the MLP columns; `num_heads`,
    `num_kv_heads` and the sizes below are this rank's; embedding, norms and LM head are whole. Every
    expert is on every rank, with its slice of the expert's intermediate columns (as the dense MLP):
    the router and each token's routing are the same on all ranks, one all-reduce sums the slices.

    `rotaries`: the RoPE tables by layer type ({"": ...} when every layer shares one).
    """

    def __init__(
        self,
        spec: ModelSpec,
        config,
        rotaries: dict[str, Rotary],
        dtype: torch.dtype,
        device,
        tp: TensorParallel | None = None,
    ):
        self.spec = spec
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.tp = tp or TensorParallel()
        self.hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // total_heads
        self.heads = shard_heads(total_heads, total_kv_heads, self.tp.rank, self.tp.size)
        self.inter_range = shard_range(
            config.intermediate_size, self.tp.rank, self.tp.size, "intermediate_size"
        )
        self.num_heads = self.heads.q_stop - self.heads.q_start
        self.num_kv_heads = self.heads.kv_stop - self.heads.kv_start
        self.num_layers = config.num_hidden_layers
        self.eps = config.rms_norm_eps
        self.scale = spec.attention_scale(config) or self.head_dim**-0.5
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.use_triton = False
        self.fp32_logits = False  # the LM head's product kept in float32 (EngineConfig.lm_head_fp32)
        self.norm_offset = spec.norm_offset
        self.windows = spec.layer_windows(config)
        self.act_and_mul = ops.gelu_tanh_and_mul if spec.activation(config) == "gelu_tanh" else None
        inter = self.inter_range[1] - self.inter_range[0]
        qkv_bias, o_bias = spec.qkv_bias(config), spec.o_bias(config)
        self.qk_norm = spec.qk_norm
        self.qk_norm_over_heads = spec.qk_norm_over_heads
        moe_layers = spec.moe_layers(config) or [False] * self.num_layers
        # Hybrid families (Qwen3.5): Gated DeltaNet layers with a recurrent state per sequence instead of
        # K/V; the attention layers' q projection also yields a sigmoid output gate per head.
        self.linear = spec.linear_layers(config) or [False] * self.num_layers
        shape = spec.shape(config)
        self.output_gate = bool(shape.attention_output_gate)
        self.linear_shape: LinearAttentionShape | None = None
        if any(self.linear):
            if self.tp.size > 1:
                raise ValueError(
                    "native engine: tensor parallelism does not shard linear-attention layers yet; set "
                    "actor_rollout_ref.rollout.tensor_model_parallel_size=1 for this model"
                )
            self.linear_shape = LinearAttentionShape(
                shape.linear_key_heads,
                shape.linear_value_heads,
                shape.linear_key_dim,
                shape.linear_value_dim,
                shape.linear_conv_kernel,
            )
        # The layer's index among the linear-attention layers (its slice of RecurrentStates), or -1.
        self.state_index = [sum(self.linear[:i]) if lin else -1 for i, lin in enumerate(self.linear)]
        # The layer's index in the KV cache, which holds the attention layers only.
        self.kv_index = [i - sum(self.linear[:i]) for i in range(self.num_layers)]
        self.num_kv_layers = self.num_layers - sum(self.linear)
        self.q_width = self.q_size * (2 if self.output_gate else 1)  # [q | gate] per head when gated
        if any(moe_layers):
            self.expert_range = shard_range(
                config.moe_intermediate_size, self.tp.rank, self.tp.size, "moe_intermediate_size"
            )
            # Qwen3.5-MoE's config has no norm_topk_prob: its router always renormalises.
            self.top_k, self.norm_topk = (
                config.num_experts_per_tok,
                bool(getattr(config, "norm_topk_prob", True)),
            )
        # Qwen3-Next: a shared expert beside the routed ones, sharded by its columns as a dense MLP.
        self.shared_range = (0, 0)
        if any(moe_layers) and shape.shared_expert_intermediate:
            self.shared_range = shard_range(
                shape.shared_expert_intermediate,
                self.tp.rank,
                self.tp.size,
                "shared_expert_intermediate_size",
            )

        def empty(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=self.device)

        # Hugging Face rounds the scale sqrt(hidden) to the embedding dtype before multiplying.
        scale = spec.embed_scale(config)
        self.embed_scale = None if scale == 1.0 else torch.tensor(scale, dtype=dtype, device=self.device)
        self.embed = empty(config.vocab_size, self.hidden)
        self.lm_head = self.embed if self.tied else empty(config.vocab_size, self.hidden)
        self.final_norm = empty(self.hidden)
        self.layers: list[dict[str, torch.Tensor]] = []
        for is_moe, is_linear in zip(moe_layers, self.linear, strict=True):
            layer: dict[str, torch.Tensor] = {}
            if spec.pre_norms:
                layer |= {"input_norm": empty(self.hidden), "post_norm": empty(self.hidden)}
            if is_linear:
                lin = self.linear_shape
                value = lin.value_heads * lin.value_dim
                layer |= {
                    "lin_qkv": empty(lin.channels, self.hidden),
                    "lin_z": empty(value, self.hidden),
                    "lin_b": empty(lin.value_heads, self.hidden),
                    "lin_a": empty(lin.value_heads, self.hidden),
                    "lin_conv": empty(lin.channels, 1, lin.kernel),
                    "lin_dt_bias": empty(lin.value_heads),
                    "lin_a_log": empty(lin.value_heads),
                    "lin_norm": empty(lin.value_dim),
                    "lin_out": empty(self.hidden, value),
                }
            else:
                layer |= {
                    "qkv": empty(self.q_width + 2 * self.kv_size, self.hidden),
                    "o": empty(self.hidden, self.q_size),
                }
            if is_moe:  # router (E, H) whole; experts (E, 2I, H) and (E, H, I) over this rank's columns
                experts, width = config.num_experts, self.expert_range[1] - self.expert_range[0]
                layer |= {
                    "router": empty(experts, self.hidden),
                    "experts_gate_up": empty(experts, 2 * width, self.hidden),
                }
                layer["experts_down"] = empty(experts, self.hidden, width)
                shared = self.shared_range[1] - self.shared_range[0]
                if shared:  # its SwiGLU over this rank's columns; its gate (1, H) whole
                    layer |= {
                        "shared_gate_up": empty(2 * shared, self.hidden),
                        "shared_down": empty(self.hidden, shared),
                        "shared_expert_gate": empty(1, self.hidden),
                    }
            else:
                layer |= {"gate_up": empty(2 * inter, self.hidden), "down": empty(self.hidden, inter)}
            if qkv_bias and not is_linear:
                layer["qkv_bias"] = empty(self.q_size + 2 * self.kv_size)
            if o_bias and not is_linear:
                layer["o_bias"] = empty(self.hidden)
            if self.qk_norm and not is_linear:  # one head's width, or (OLMo) this rank's heads together
                layer["q_norm"] = empty(self.q_size if self.qk_norm_over_heads else self.head_dim)
                layer["k_norm"] = empty(self.kv_size if self.qk_norm_over_heads else self.head_dim)
            if spec.sandwich_norms or not spec.pre_norms:
                layer["attn_out_norm"] = empty(self.hidden)
                layer["mlp_out_norm"] = empty(self.hidden)
            self.layers.append(layer)
        # Kept to grow the tables when prompt + response run past max_position_embeddings (ensure_positions).
        self.rotaries = {
            kind: (inv_freq.to(self.device), scaling) for kind, (inv_freq, scaling) in rotaries.items()
        }
        kinds = getattr(config, "layer_types", None) or [""] * self.num_layers
        self.rope_kind = [kind if kind in rotaries else next(iter(rotaries)) for kind in kinds]
        rotary_layers = spec.rotary_layers(config)
        if not all(rotary_layers):
            self.rotaries[NOPE] = (torch.zeros_like(next(iter(self.rotaries.values()))[0]), 1.0)
            self.rope_kind = [
                kind if rotates else NOPE
                for kind, rotates in zip(self.rope_kind, rotary_layers, strict=False)
            ]
        self.cos_sin: dict[str, torch.Tensor] = {}
        self.ensure_positions(config.max_position_embeddings)
        self._targets = self._weight_targets()

    # ------------------------------------------------------------------------------ weights
    def _layer_slots(self, layer: dict[str, torch.Tensor]) -> dict[str, list[Target]]:
        """The slots of one layer that the spec's HF names fill: (engine view, this rank's slice of the
        HF tensor), one or more per name. Column-parallel q/k/v and gate/up take the output rows of
        the local heads and columns; row-parallel o and down take the matching input columns; the rest
        is whole."""
        q, kv, d = self.q_size, self.kv_size, self.head_dim
        q_rows: Shard = (0, self.heads.q_start * d, q)
        kv_rows: Shard = (0, self.heads.kv_start * d, kv)
        slots: dict[str, Target] = {}
        if "qkv" in layer:
            qw = self.q_width
            slots |= {
                "q": (layer["qkv"][:qw], (0, self.heads.q_start * d, qw)),
                "k": (layer["qkv"][qw : qw + kv], kv_rows),
                "v": (layer["qkv"][qw + kv :], kv_rows),
                "o": (layer["o"], (1, self.heads.q_start * d, q)),
            }
        for name in [name for name in layer if name.startswith("lin_")]:  # whole (no tensor parallelism)
            slots[name] = (layer[name], None)
        if "gate_up" in layer:
            start, stop = self.inter_range
            mlp_rows: Shard = (0, start, stop - start)
            slots |= {"gate": (layer["gate_up"][: stop - start], mlp_rows)}
            slots |= {"up": (layer["gate_up"][stop - start :], mlp_rows)}
            slots["down"] = (layer["down"], (1, start, stop - start))
        if "shared_gate_up" in layer:
            start, stop = self.shared_range
            rows: Shard = (0, start, stop - start)
            slots |= {"shared_gate": (layer["shared_gate_up"][: stop - start], rows)}
            slots |= {"shared_up": (layer["shared_gate_up"][stop - start :], rows)}
            slots["shared_down"] = (layer["shared_down"], (1, start, stop - start))
        whole = ("input_norm", "post_norm", "attn_out_norm", "mlp_out_norm", "router", "o_bias")
        whole += ("shared_expert_gate",)
        for name in whole + (() if self.qk_norm_over_heads else ("q_norm", "k_norm")):
            if name in layer:  # whole on every rank (o_bias: added once, after the all-reduce)
                slots[name] = (layer[name], None)
        if self.qk_norm_over_heads and "q_norm" in layer:  # the weights of this rank's heads
            slots |= {"q_norm": (layer["q_norm"], q_rows), "k_norm": (layer["k_norm"], kv_rows)}
        if "qkv_bias" in layer:
            bias = layer["qkv_bias"]
            slots |= {"q_bias": (bias[:q], q_rows), "k_bias": (bias[q : q + kv], kv_rows)}
            slots["v_bias"] = (bias[q + kv :], kv_rows)
        targets = {slot: [target] for slot, target in slots.items()}
        if "experts_gate_up" in layer:  # HF (E, [gate I | up I], H): this rank's rows of each half
            (start, stop), total = self.expert_range, self.config.moe_intermediate_size
            width, fused = stop - start, layer["experts_gate_up"]
            gate, up = (fused[:, :width], (1, start, width)), (fused[:, width:], (1, total + start, width))
            targets["experts_gate_up"] = [gate, up]
            targets["experts_down"] = [(layer["experts_down"], (2, start, width))]
        if "lin_qkv" in layer:  # Qwen3-Next's fused projections, split into the separate ones
            targets |= fused_projection_targets(layer, self.linear_shape)
        return targets

    def _weight_targets(self) -> dict[str, list[Target]]:
        """HF parameter name -> the engine tensors it is copied into, each with the slice this rank takes."""
        top = {"embed": (self.embed, None), "final_norm": (self.final_norm, None)}
        top["lm_head"] = (self.lm_head, None)
        targets = {name: [top[slot]] for name, slot in self.spec.model_weights.items()}
        for i, layer in enumerate(self.layers):
            slots = self._layer_slots(layer)
            for name, slot in self.spec.layer_weights.items():
                if slot in slots:
                    targets[f"model.layers.{i}.{name}"] = slots[slot]
        return targets

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the engine's weights in place; returns the names it loaded.

        The tensors are whole (the HF model's shapes); under tensor parallelism each rank copies its
        slice. Unknown names (rotary buffers, a value head) are skipped; a known name with the wrong
        shape is an error naming it.
        """
        loaded: set[str] = set()
        with torch.no_grad():
            for raw_name, whole in named_tensors:
                name = _WRAPPER_PREFIXES.sub("", raw_name)
                entries = self._targets.get(name, [])
                for target, shard in entries:
                    tensor = whole
                    # One rank's slice; or one part of a tensor the engine keeps in several views.
                    if shard is not None and (self.tp.size > 1 or len(entries) > 1):
                        dim, start, length = shard
                        if tensor.dim() > dim and tensor.shape[dim] >= start + length:
                            tensor = tensor.narrow(dim, start, length)
                    if tuple(target.shape) != tuple(tensor.shape):
                        raise ValueError(
                            f"update_weights: {raw_name} has shape {tuple(whole.shape)}, the engine expects "
                            f"{tuple(target.shape)}"
                        )
                    target.copy_(tensor.detach(), non_blocking=True)
                    loaded.add(name)
        return loaded

    def ensure_positions(self, num_positions: int) -> None:
        """Grow the RoPE tables to cover positions 0..num_positions-1 (call before capturing graphs)."""
        for kind, (inv_freq, scaling) in self.rotaries.items():
            if kind not in self.cos_sin or num_positions > self.cos_sin[kind].shape[0]:
                self.cos_sin[kind] = ops.rope_cos_sin(inv_freq, num_positions, scaling)

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every distinct weight tensor (the tied head counted once)."""
        tensors = [self.embed, self.final_norm] + ([] if self.tied else [self.lm_head])
        return tensors + [t for layer in self.layers for t in layer.values()]

    def required_weight_names(self) -> set[str]:
        if not self.tied:
            return set(self._targets)
        head = {name for name, slot in self.spec.model_weights.items() if slot == "lm_head"}
        return set(self._targets) - head  # the embedding is the head

    # ------------------------------------------------------------------------------ forward
    def _norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor):
        """(rms_norm(x [+ residual]), new residual)."""
        if self.use_triton:
            from fulcrum.rollout.native import kernels

            offset = self.norm_offset  # (1 + w) norms: Gemma, Qwen3.5
            if residual is None:
                return kernels.add_rms_norm(x, None, weight, self.eps, offset), x
            return kernels.add_rms_norm(x, residual, weight, self.eps, offset), residual  # residual += x
        if residual is None:
            return ops.rms_norm(x, weight, self.eps, self.norm_offset), x
        return ops.add_rms_norm(x, residual, weight, self.eps, self.norm_offset)

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head: x (N, H, D) -> (N, H, D), contiguous (RoPE then rotates it in place)."""
        if self.use_triton:
            rows = x.reshape(-1, x.shape[-1]).contiguous()  # (N·H, D)
            return self._norm(rows, None, weight)[0].view(x.shape)
        return ops.rms_norm(x, weight, self.eps, self.norm_offset)

    def _attention(
        self,
        i: int,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Layer i's attention of the normed input x (N, hidden) -> (N, hidden), summed over ranks."""
        layer, tokens = self.layers[i], x.shape[0]
        qkv = F.linear(x, layer["qkv"], layer.get("qkv_bias"))  # (N, q [+ gate] + 2 kv)
        gate = None
        if self.output_gate:  # per head [q (D) | gate (D)]
            q_gate = qkv[:, : 2 * self.q_size].view(tokens, self.num_heads, 2 * self.head_dim)
            q, gate = q_gate[..., : self.head_dim].contiguous(), q_gate[..., self.head_dim :]
            qkv = qkv[:, self.q_size :]  # k and v follow at offset q_size, as ungated
        else:
            q = qkv[:, : self.q_size].view(tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        cos_sin = self.cos_sin[self.rope_kind[i]]
        fused_norm = None
        if self.qk_norm_over_heads:
            q = ops.rms_norm_over_heads(q, layer["q_norm"], self.eps, self.tp)
            k = ops.rms_norm_over_heads(k, layer["k_norm"], self.eps, self.tp)
        elif self.qk_norm and self.use_triton and cos_sin.shape[-1] == self.head_dim:
            fused_norm = QKNorm(layer["q_norm"], layer["k_norm"], self.eps, self.norm_offset)
        elif self.qk_norm:
            q, k = self._head_norm(q, layer["q_norm"]), self._head_norm(k, layer["k_norm"])
        q, k = rotate_and_store(
            q, k, v, positions, cos_sin, kv_cache, self.kv_index[i], meta, self.use_triton, fused_norm
        )
        attn = paged_attention(q, k, v, kv_cache, self.kv_index[i], meta, self.scale, self.windows[i])
        if gate is not None:
            attn = attn * torch.sigmoid(gate)
        if self.tp.size == 1:
            return F.linear(attn.reshape(tokens, self.q_size), layer["o"], layer.get("o_bias"))
        # row-parallel: sum the ranks' partial products, then the bias once
        out = self.tp.all_reduce(F.linear(attn.reshape(tokens, self.q_size), layer["o"]))
        return out + layer["o_bias"] if "o_bias" in layer else out

    def _act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up: (N, 2I) -> (N, I); SiLU (the fused Triton kernel on CUDA) or GELU-tanh."""
        if self.act_and_mul is not None:
            return self.act_and_mul(gate_up)
        if self.use_triton:
            from fulcrum.rollout.native import kernels

            return kernels.silu_and_mul(gate_up)
        return ops.silu_and_mul(gate_up)

    def _mlp(self, layer: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The dense or expert MLP of the normed input x (N, hidden) -> (N, hidden), summed over ranks."""
        if "router" in layer:
            weights, experts = moe.route(F.linear(x, layer["router"]), self.top_k, self.norm_topk)
            out = moe.experts_forward(
                x, weights, experts, layer["experts_gate_up"], layer["experts_down"], self._act_and_mul
            )
            if "shared_gate_up" in layer:  # x whole on every rank, so the gate is too
                out = out + moe.shared_expert_forward(
                    x,
                    layer["shared_gate_up"],
                    layer["shared_down"],
                    layer["shared_expert_gate"],
                    self._act_and_mul,
                )
            return self.tp.all_reduce(out)
        return self.tp.all_reduce(F.linear(self._act_and_mul(F.linear(x, layer["gate_up"])), layer["down"]))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        states: RecurrentStates | None = None,
    ) -> torch.Tensor:
        """Final hidden states (N, hidden) for N packed tokens; writes their K/V into `kv_cache` and
        steps their sequences' recurrent `states` (linear-attention layers, slots `meta.state_slots`).

        input_ids, positions: (N,); kv_cache: (attention layers, 2, slots, Hkv, D).
        """
        hidden = F.embedding(input_ids, self.embed)  # (N, hidden)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        if not self.spec.pre_norms:
            return self._forward_output_norms(hidden, positions, kv_cache, meta)
        residual: torch.Tensor | None = None
        step = self._state_step(meta) if states is not None else None
        for i, layer in enumerate(self.layers):
            # The fused Triton norm adds into `residual` in place; the first one is the embedding output.
            x, residual = self._norm(hidden, residual, layer["input_norm"])
            if self.linear[i]:
                j = self.state_index[i]
                hidden = linear_attention(
                    layer, x, self.linear_shape, states.conv[j], states.delta[j], step, self.eps
                )
            else:
                hidden = self._attention(i, x, positions, kv_cache, meta)
            if "attn_out_norm" in layer:  # Gemma: the output is normed before the residual sum
                hidden = self._norm(hidden, None, layer["attn_out_norm"])[0]
            x, residual = self._norm(hidden, residual, layer["post_norm"])
            hidden = self._mlp(layer, x)
            if "mlp_out_norm" in layer:
                hidden = self._norm(hidden, None, layer["mlp_out_norm"])[0]
        out, _ = self._norm(hidden, residual, self.final_norm)
        return out

    def _state_step(self, meta: AttentionMetadata) -> StateStep:
        """The linear-attention layers' slots for this forward: a prefill's sequences (lengths, fresh
        starts) or a decode step's rows; flash-linear-attention's kernels where they run."""
        fla = use_fla(self.device)
        if meta.is_prefill:
            return StateStep.prefill(meta.state_slots, meta.q_lens, meta.state_fresh, meta.cu_seqlens_q, fla)
        return StateStep.decode(meta.state_slots, meta.state_writes, fla)

    def _forward_output_norms(
        self, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """`forward`'s layers for a family without input norms (OLMo 2/3): each sublayer reads the
        residual stream as it is, its output normed before the sum: h += norm(attn(h)); h += norm(mlp(h))."""
        for i, layer in enumerate(self.layers):
            attn = self._attention(i, hidden, positions, kv_cache, meta)
            hidden = hidden + self._norm(attn, None, layer["attn_out_norm"])[0]
            hidden = hidden + self._norm(self._mlp(layer, hidden), None, layer["mlp_out_norm"])[0]
        return self._norm(hidden, None, self.final_norm)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab): in the engine dtype, or float32 with `fp32_logits` (the head is
        whole on every rank, so no gather; the stored head, tied or not, keeps the engine dtype)."""
        if self.fp32_logits:
            return head_logits(hidden, self.lm_head, None, fp32=True)
        return F.linear(hidden, self.lm_head)
