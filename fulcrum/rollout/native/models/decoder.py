"""The native engine's decoder: a Llama-style causal LM over the paged KV cache, read top to bottom.

One decoder serves every family whose `ModelSpec` (fulcrum.models.arch) it has the features of:
Llama, Mistral, Qwen2 (q/k/v biases), Qwen3 (an RMSNorm over each head's q and k). The spec says
which features a config has and which Hugging Face names fill which slot; the decoder fuses q/k/v
and gate/up and knows how each slot splits over tensor-parallel ranks. Weights are the engine's own
tensors (in the engine dtype), filled by `load_weights`, always in place, so CUDA graphs captured over
them stay valid across weight syncs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from fulcrum.models.arch import ModelSpec
from fulcrum.parallel.tensor_parallel import TensorParallel, shard_heads, shard_range
from fulcrum.rollout.native import ops
from fulcrum.rollout.native.attention import AttentionMetadata, paged_attention

Shard = tuple[int, int, int]  # (dim, start, length) of an HF tensor that one tensor-parallel rank holds
Target = tuple[torch.Tensor, Shard | None]  # (the (view of the) engine tensor, this rank's slice or None)
# Wrappers that prefix parameter names: torch.compile, DDP/FSDP1, activation checkpointing.
_WRAPPER_PREFIXES = re.compile(r"(_orig_mod\.|module\.|_fsdp_wrapped_module\.|_checkpoint_wrapped_module\.)")


class DecoderLM:
    """A causal LM of `spec`'s family over the paged KV cache. Weights are plain tensors on `device`.

    With tensor parallelism (`tp.size > 1`, fulcrum.parallel.tensor_parallel) this rank holds its
    query heads, the K/V heads they read and its slice of the MLP columns; `num_heads`,
    `num_kv_heads` and the sizes below are this rank's; embedding, norms and LM head are whole.
    """

    def __init__(
        self,
        spec: ModelSpec,
        config,
        inv_freq: torch.Tensor,
        rope_scaling: float,
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
        self.scale = self.head_dim**-0.5
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.use_triton = False
        inter = self.inter_range[1] - self.inter_range[0]
        qkv_bias, o_bias = spec.qkv_bias(config), spec.o_bias(config)
        self.qk_norm = spec.qk_norm

        def empty(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=self.device)

        self.embed = empty(config.vocab_size, self.hidden)
        self.lm_head = self.embed if self.tied else empty(config.vocab_size, self.hidden)
        self.final_norm = empty(self.hidden)
        self.layers: list[dict[str, torch.Tensor]] = []
        for _ in range(self.num_layers):
            layer = {
                "input_norm": empty(self.hidden),
                "qkv": empty(self.q_size + 2 * self.kv_size, self.hidden),
                "o": empty(self.hidden, self.q_size),
                "post_norm": empty(self.hidden),
                "gate_up": empty(2 * inter, self.hidden),
                "down": empty(self.hidden, inter),
            }
            if qkv_bias:
                layer["qkv_bias"] = empty(self.q_size + 2 * self.kv_size)
            if o_bias:
                layer["o_bias"] = empty(self.hidden)
            if self.qk_norm:
                layer["q_norm"] = empty(self.head_dim)
                layer["k_norm"] = empty(self.head_dim)
            self.layers.append(layer)
        # Kept to grow the table when prompt + response run past max_position_embeddings (ensure_positions).
        self.inv_freq = inv_freq.to(self.device)
        self.rope_scaling = rope_scaling
        self.cos_sin = ops.rope_cos_sin(self.inv_freq, config.max_position_embeddings, rope_scaling)
        self._targets = self._weight_targets()

    # ------------------------------------------------------------------------------ weights
    def _layer_slots(self, layer: dict[str, torch.Tensor]) -> dict[str, Target]:
        """The slots of one layer that the spec's HF names fill: (engine view, this rank's slice of the
        HF tensor). Column-parallel q/k/v and gate/up take the output rows of the local heads and
        columns; row-parallel o and down take the matching input columns; the rest is whole."""
        q, kv, d = self.q_size, self.kv_size, self.head_dim
        inter = self.inter_range[1] - self.inter_range[0]
        q_rows: Shard = (0, self.heads.q_start * d, q)
        kv_rows: Shard = (0, self.heads.kv_start * d, kv)
        mlp_rows: Shard = (0, self.inter_range[0], inter)
        slots: dict[str, Target] = {
            "input_norm": (layer["input_norm"], None),
            "post_norm": (layer["post_norm"], None),
            "q": (layer["qkv"][:q], q_rows),
            "k": (layer["qkv"][q : q + kv], kv_rows),
            "v": (layer["qkv"][q + kv :], kv_rows),
            "o": (layer["o"], (1, self.heads.q_start * d, q)),
            "gate": (layer["gate_up"][:inter], mlp_rows),
            "up": (layer["gate_up"][inter:], mlp_rows),
            "down": (layer["down"], (1, self.inter_range[0], inter)),
        }
        if "qkv_bias" in layer:
            bias = layer["qkv_bias"]
            slots |= {"q_bias": (bias[:q], q_rows), "k_bias": (bias[q : q + kv], kv_rows)}
            slots["v_bias"] = (bias[q + kv :], kv_rows)
        if "o_bias" in layer:  # added once, after the all-reduce
            slots["o_bias"] = (layer["o_bias"], None)
        if "q_norm" in layer:  # one weight for every head
            slots |= {"q_norm": (layer["q_norm"], None), "k_norm": (layer["k_norm"], None)}
        return slots

    def _weight_targets(self) -> dict[str, Target]:
        """HF parameter name -> (the engine tensor it is copied into, the slice this rank takes)."""
        top = {"embed": (self.embed, None), "final_norm": (self.final_norm, None)}
        top["lm_head"] = (self.lm_head, None)
        targets = {name: top[slot] for name, slot in self.spec.model_weights.items()}
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
            for raw_name, tensor in named_tensors:
                name = _WRAPPER_PREFIXES.sub("", raw_name)
                entry = self._targets.get(name)
                if entry is None:
                    continue
                target, shard = entry
                if shard is not None and self.tp.size > 1:
                    dim, start, length = shard
                    if tensor.dim() > dim and tensor.shape[dim] >= start + length:
                        tensor = tensor.narrow(dim, start, length)
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"update_weights: {raw_name} has shape {tuple(tensor.shape)}, the engine expects "
                        f"{tuple(target.shape)}"
                    )
                target.copy_(tensor.detach(), non_blocking=True)
                loaded.add(name)
        return loaded

    def ensure_positions(self, num_positions: int) -> None:
        """Grow the RoPE table to cover positions 0..num_positions-1 (call before capturing graphs)."""
        if num_positions > self.cos_sin.shape[0]:
            self.cos_sin = ops.rope_cos_sin(self.inv_freq, num_positions, self.rope_scaling)

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

            if residual is None:
                return kernels.add_rms_norm(x, None, weight, self.eps), x
            return kernels.add_rms_norm(x, residual, weight, self.eps), residual  # residual += x in place
        if residual is None:
            return ops.rms_norm(x, weight, self.eps), x
        return ops.add_rms_norm(x, residual, weight, self.eps)

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head: x (N, H, D) -> (N, H, D), contiguous (RoPE then rotates it in place)."""
        if self.use_triton:
            from fulcrum.rollout.native import kernels

            rows = x.reshape(-1, x.shape[-1]).contiguous()  # (N·H, D)
            return kernels.add_rms_norm(rows, None, weight, self.eps).view(x.shape)
        return ops.rms_norm(x, weight, self.eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states (N, hidden) for N packed tokens; writes their K/V into `kv_cache`.

        input_ids, positions: (N,); kv_cache: (layers, 2, slots, Hkv, D).
        """
        tokens = input_ids.shape[0]
        hidden = F.embedding(input_ids, self.embed)  # (N, hidden)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            # The fused Triton norm adds into `residual` in place; the first one is the embedding output.
            x, residual = self._norm(hidden, residual, layer["input_norm"])
            qkv = F.linear(x, layer["qkv"], layer.get("qkv_bias"))  # (N, q + 2 kv)
            q = qkv[:, : self.q_size].view(tokens, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
                tokens, self.num_kv_heads, self.head_dim
            )
            v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
            if self.qk_norm:
                q, k = self._head_norm(q, layer["q_norm"]), self._head_norm(k, layer["k_norm"])
            if self.use_triton:
                from fulcrum.rollout.native import kernels

                kernels.rope_inplace(q, k, positions, self.cos_sin)
            else:
                q = ops.apply_rope(q, positions, self.cos_sin)
                k = ops.apply_rope(k, positions, self.cos_sin)
            attn = paged_attention(q, k, v, kv_cache, i, meta, self.scale)
            if self.tp.size == 1:
                hidden = F.linear(attn.reshape(tokens, self.q_size), layer["o"], layer.get("o_bias"))
            else:  # row-parallel: sum the ranks' partial products, then the bias once
                hidden = self.tp.all_reduce(F.linear(attn.reshape(tokens, self.q_size), layer["o"]))
                if "o_bias" in layer:
                    hidden = hidden + layer["o_bias"]
            x, residual = self._norm(hidden, residual, layer["post_norm"])
            gate_up = F.linear(x, layer["gate_up"])
            if self.use_triton:
                from fulcrum.rollout.native import kernels

                act = kernels.silu_and_mul(gate_up)
            else:
                act = ops.silu_and_mul(gate_up)
            hidden = self.tp.all_reduce(F.linear(act, layer["down"]))
        out, _ = self._norm(hidden, residual, self.final_norm)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) in the engine dtype."""
        return F.linear(hidden, self.lm_head)
