"""The native decoder's mixture-of-experts MLP (Qwen3-MoE): top-k routing and a grouped expert matmul.

Shapes: N tokens, E experts, k experts per token, H hidden, I an expert's intermediate width (this
tensor-parallel rank's share). Expert weights keep Hugging Face's fused layout: gate_up (E, 2I, H),
down (E, H, I). The N·k (token, expert) pairs are sorted by expert, so each expert's rows are one
contiguous run and every expert's product is one call of `grouped_matmul`; no step waits for the host
(counts and offsets stay on the device), so CUDA graphs capture it, where torch's grouped GEMM takes the
dtype (`grouped_mm_runs`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing as Hugging Face's Qwen3MoeTopKRouter: p = softmax(logits) in fp32, the k largest,
    renormalised to sum 1 when `normalize` (norm_topk_prob).

    router_logits (N, E) -> (weights (N, k) in the logits' dtype, experts (N, k) long).
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


def grouped_mm_runs(device_type: str, dtype: torch.dtype, width: int) -> bool:
    """Whether `grouped_matmul` takes torch's grouped GEMM for a product whose rows and columns are at
    least `width` elements of `dtype`: rows aligned to 16 bytes and, on CUDA, bf16 (its kernels' type).
    Otherwise it loops over the experts with their row counts read on the host, which no CUDA graph
    can capture."""
    if not hasattr(F, "grouped_mm") or (width * dtype.itemsize) % 16:
        return False
    return device_type == "cpu" or dtype == torch.bfloat16


def _grouped_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return grouped_mm_runs(x.device.type, x.dtype, min(x.shape[-1], weight.shape[1]))


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Row block e of x times weight[e]ᵀ, for every expert: x (M, K) sorted by expert, weight (E, N, K)
    (Hugging Face's out × in), offsets (E,) int32 the end of each expert's rows -> (M, N).

    One grouped GEMM (`torch.nn.functional.grouped_mm`) where torch has one for the dtype; else one
    matmul per expert over its contiguous rows (reads the offsets on the host).
    """
    if _grouped_mm_applies(x, weight):
        return F.grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ weight[expert].T
        start = end
    return out


def experts_forward(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act_and_mul: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Σ_j weights[n, j] · down_e(act(gate_e(x_n)) · up_e(x_n)), e = experts[n, j]: x (N, H),
    weights and experts (N, k), gate_up (E, 2I, H), down (E, H, I) -> (N, H)."""
    top_k = experts.shape[1]
    flat = experts.reshape(-1)  # (N·k,)
    order = flat.argsort(stable=True)  # pairs grouped by expert
    token = order // top_k  # (N·k,) the token of each sorted pair
    ones = torch.ones_like(flat, dtype=torch.int32)
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=x.device).index_add_(0, flat, ones)
    offsets = counts.cumsum(0, dtype=torch.int32)  # (E,)
    hidden = act_and_mul(grouped_matmul(x[token], gate_up, offsets))  # (N·k, I)
    out = grouped_matmul(hidden, down, offsets) * weights.reshape(-1)[order, None]  # (N·k, H)
    return torch.zeros_like(x).index_add_(0, token, out.to(x.dtype))


def shared_expert_forward(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate: torch.Tensor,
    act_and_mul: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Qwen3-Next's shared expert, which every token runs beside the routed ones: σ(w_g · x) ·
    down(act(gate(x)) · up(x)); x (N, H), gate_up (2I_s, H), down (H, I_s), gate w_g (1, H) -> (N, H)."""
    shared = F.linear(act_and_mul(F.linear(x, gate_up)), down)
    return torch.sigmoid(F.linear(x, gate)) * shared
