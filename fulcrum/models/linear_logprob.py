"""Log-probabilities and entropies straight from hidden states, the LM head applied chunk by chunk.

For M response positions with hidden states h (M, H), LM head W (V, H) and temperature τ:

    z = h Wᵀ / τ                       (M, V), float32, one chunk of rows at a time
    log p_m = z_m[y_m] - lse(z_m)      lse = logsumexp over the vocabulary
    H_m = lse(z_m) - Σ_v p_m,v z_m,v   p = softmax(z)

Only a (chunk, V) block of logits exists at any time, in the forward and in the backward (which
recomputes its block from h and W rather than keeping the logits), so at V = 152k the float32
logits of a micro-batch are never held whole. Gradients, per row (g_lp, g_H the incoming ones):

    ∂log p / ∂z_v = [v = y] - p_v        ∂H / ∂z_v = -p_v (z_v - Σ_u p_u z_u)
    ∂L/∂h = (∂L/∂z / τ) W                ∂L/∂W = (∂L/∂z / τ)ᵀ h
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fulcrum.models.head_logits import head_logits

_HALF = (torch.bfloat16, torch.float16)

# Float32 logits elements per chunk: 2^27 (512 MiB); at V = 151,936 that is 883 rows. The backward
# holds about four such blocks (z, p, ∂z and a temporary).
CHUNK_ELEMENTS = 1 << 27


def chunk_rows(vocab: int, elements: int = CHUNK_ELEMENTS) -> int:
    """Rows per chunk so that one float32 (rows, vocab) block holds at most `elements` values."""
    return max(1, elements // max(1, vocab))


def _block(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, inv_temp: float, fp32: bool
) -> torch.Tensor:
    """z = (h Wᵀ + b) / τ for one chunk: (c, H) → (c, V), at least float32; the product rounded to the
    weights' dtype first, or with `fp32` kept in float32 (`fulcrum.models.head_logits`)."""
    logits = head_logits(hidden, weight, bias, fp32)
    return logits.to(_softmax_dtype(logits.dtype)) * inv_temp


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision inputs, the input's own dtype otherwise (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_forward(
    hidden: torch.Tensor,  # (c, H)
    weight: torch.Tensor,  # (V, H)
    bias: torch.Tensor | None,
    labels: torch.Tensor,  # (c,)
    inv_temp: float,
    with_entropy: bool,
    fp32: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk: (log p (c,), lse (c,), entropy (c,) or None)."""
    z = _block(hidden, weight, bias, inv_temp, fp32)  # (c, V)
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(1, labels[:, None]).squeeze(1) - lse
    entropy = lse - (torch.exp(z - lse[:, None]) * z).sum(-1) if with_entropy else None
    return logp, lse, entropy


def _chunk_logit_grad(
    hidden: torch.Tensor,  # (c, H)
    weight: torch.Tensor,  # (V, H)
    bias: torch.Tensor | None,
    labels: torch.Tensor,  # (c,)
    lse: torch.Tensor,  # (c,)
    grad_logp: torch.Tensor,  # (c,)
    grad_entropy: torch.Tensor | None,  # (c,)
    inv_temp: float,
    fp32: bool,
) -> torch.Tensor:
    """∂L/∂(h Wᵀ + b) for one chunk, recomputed from h and W as the forward did: (c, V) in the
    weights' dtype."""
    z = _block(hidden, weight, bias, inv_temp, fp32)  # (c, V)
    p = torch.exp(z - lse[:, None])
    dz = (-p * grad_logp[:, None]).scatter_add(1, labels[:, None], grad_logp[:, None].to(p.dtype))
    if grad_entropy is not None:
        mean_z = (p * z).sum(-1, keepdim=True)
        dz = dz - p * (z - mean_z) * grad_entropy[:, None]
    return (dz * inv_temp).to(weight.dtype)


# The chunk functions, compiled once `use_compiled_chunks(True)` is called (the GPU workers do):
# inductor fuses the float32 cast, scaling, exp and reductions over each (c, V) block into a few
# kernels instead of one pass over the block per operation.
_CHUNK_FNS = {"forward": _chunk_forward, "grad": _chunk_logit_grad}


def use_compiled_chunks(
    enabled: bool, options: dict[str, object] | None = None, backend: str | Callable[..., object] = "inductor"
) -> None:
    """Switch the per-chunk functions to `torch.compile`d ones (dynamic chunk sizes, `backend` with
    inductor `options`) or back."""
    if enabled:
        _CHUNK_FNS["forward"] = torch.compile(_chunk_forward, dynamic=True, backend=backend, options=options)
        _CHUNK_FNS["grad"] = torch.compile(_chunk_logit_grad, dynamic=True, backend=backend, options=options)
    else:
        _CHUNK_FNS.update(forward=_chunk_forward, grad=_chunk_logit_grad)


def _forward_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    inv_temp: float,
    with_entropy: bool,
    rows: int,
    fp32: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log p (M,), lse (M,), entropy (M,) or None), at least float32.

    The chunks record no autograd (no-grad passes, or inside `_LinearLogSoftmax.forward`), so their
    inputs go detached: the compiled chunk guards on `requires_grad`, which differs between callers (an
    actor's weights and a frozen reference's, hidden states in an update), and would compile per caller."""
    hidden, weight = hidden.detach(), weight.detach()
    bias = bias.detach() if bias is not None else None
    parts = [
        _CHUNK_FNS["forward"](
            hidden[s : s + rows], weight, bias, labels[s : s + rows], inv_temp, with_entropy, fp32
        )
        for s in range(0, hidden.shape[0], rows)
    ]
    if not parts:
        empty = hidden.new_empty(0, dtype=_softmax_dtype(hidden.dtype))
        return empty, empty, (empty if with_entropy else None)
    logp = torch.cat([p[0] for p in parts])
    lse = torch.cat([p[1] for p in parts])
    entropy = torch.cat([p[2] for p in parts]) if with_entropy else None
    return logp, lse, entropy


def add_product_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b in place: acc (V, H) float32, a (V, c) and b (c, H) in the weights' dtype.

    On CUDA with half-precision operands, one cuBLAS call that accumulates a @ b in float32 and adds it
    into acc (beta = 1, `out_dtype`): the product is never rounded to half precision, nor written as a
    (V, H) half tensor and read back by a separate add (at V = 152k, 1.4 GB a chunk).
    Elsewhere (CPU `addmm` has no `out_dtype`) the product in the operands' dtype, then the add."""
    if acc.is_cuda and acc.dtype == torch.float32 and a.dtype in _HALF and b.dtype == a.dtype:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += a @ b


class _LinearLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        inv_temp: float,
        with_entropy: bool,
        rows: int,
        fp32: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logp, lse, entropy = _forward_chunks(hidden, weight, bias, labels, inv_temp, with_entropy, rows, fp32)
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.inv_temp, ctx.with_entropy, ctx.rows, ctx.fp32 = inv_temp, with_entropy, rows, fp32
        # autograd needs a tensor for every output; without entropy it is an empty one.
        return logp, (entropy if entropy is not None else logp.new_empty(0))

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        grad_logp: torch.Tensor | None,
        grad_entropy: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        inv_temp, rows = ctx.inv_temp, ctx.rows
        use_entropy = ctx.with_entropy and grad_entropy is not None and grad_entropy.numel() > 0
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        m = hidden.shape[0]
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        need_w, need_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        acc = _softmax_dtype(weight.dtype)  # gradients of W and b accumulate over chunks in this dtype
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_bias = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        for s in range(0, m, rows):
            e = min(s + rows, m)
            dz = _CHUNK_FNS["grad"](
                hidden[s:e],
                weight,
                bias,
                labels[s:e],
                lse[s:e],
                grad_logp[s:e],
                grad_entropy[s:e] if use_entropy else None,
                inv_temp,
                ctx.fp32,
            )  # (c, V)
            if grad_hidden is not None:
                grad_hidden[s:e] = dz @ weight
            if grad_weight is not None:
                add_product_(grad_weight, dz.T, hidden[s:e])
            if grad_bias is not None:
                grad_bias += dz.sum(0)
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            None,
            None,
            None,
            None,
            None,
        )


def linear_log_softmax(
    hidden: torch.Tensor,  # (M, H)
    weight: torch.Tensor,  # (V, H), the LM head
    labels: torch.Tensor,  # (M,) token ids
    temperature: float = 1.0,
    with_entropy: bool = False,
    bias: torch.Tensor | None = None,  # (V,)
    rows: int | None = None,
    fp32_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(h Wᵀ / τ)[y] and, optionally, the entropy: two (M,) tensors, float32 (float64 for float64 input).

    Differentiable in h, W and b when grad is enabled; chunks of `rows` rows (default: 512 MiB of
    float32 logits, `chunk_rows`). `fp32_logits`: h Wᵀ is not rounded to the weights' half
    precision before the softmax (`fulcrum.models.head_logits`; `actor_rollout_ref.model.lm_head_fp32`).
    """
    rows = rows or chunk_rows(weight.shape[0])
    inv_temp = 1.0 / float(temperature)
    if not torch.is_grad_enabled():
        logp, _, entropy = _forward_chunks(
            hidden, weight, bias, labels, inv_temp, with_entropy, rows, fp32_logits
        )
        return logp, entropy
    logp, entropy = _LinearLogSoftmax.apply(
        hidden, weight, bias, labels, inv_temp, with_entropy, rows, fp32_logits
    )
    return logp, (entropy if with_entropy else None)
