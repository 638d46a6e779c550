"""The LM head's product z = h Wᵀ (+ b), optionally with float32 output from half-precision operands.

In bf16, h Wᵀ is accumulated in float32 and then rounded to bf16: a logit near 20 keeps 8 bits of
mantissa, a step of 0.0625, so log-probs carry that rounding. When the rollout engine and the
training forward compute their hidden states differently (kernels, fusion, summation order), the two
roundings can land on different grid points and the engine's log-probs drift from the trainer's.
`fp32=True` keeps the float32 accumulator as the output (bf16 operands, fp32 accumulate, fp32
output; ScaleRL, MiniMax-M1, vLLM's `head_dtype`, TRL's `cast_lm_head_to_fp32`); both sides must use
it (`actor_rollout_ref.model.lm_head_fp32`), else one rounds and the other does not and the gap grows.
The stored weight is never converted: a tied head shares it with the embedding.
"""

from __future__ import annotations

import torch

_HALF = (torch.bfloat16, torch.float16)


def head_logits(
    hidden: torch.Tensor,  # (N, H)
    weight: torch.Tensor,  # (V, H)
    bias: torch.Tensor | None = None,  # (V,)
    fp32: bool = False,
) -> torch.Tensor:
    """z = h Wᵀ + b: (N, H) → (N, V).

    fp32=False: in the operands' dtype (bf16 logits from bf16 weights, the bias added after rounding).
    fp32=True: at least float32 output, z = fp32(h) fp32(W)ᵀ + fp32(b); a bf16 or fp16 value is exact
    in float32, so this is the float32 accumulator of the half-precision product, never rounded. On
    CUDA that is one `mm` with `out_dtype=float32` (no float32 copy of W); elsewhere the operands
    are converted (CPU `mm` has no `out_dtype`).
    """
    if not fp32:
        logits = hidden @ weight.T
    elif hidden.is_cuda and hidden.dtype in _HALF and weight.dtype == hidden.dtype:
        logits = _mm_fp32_out(hidden, weight)
    else:
        acc = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        logits = hidden.to(acc) @ weight.to(acc).T
    return logits if bias is None else logits + bias  # a half bias promotes to the float32 logits


# Kept out of torch.compile'd callers' graphs (a graph break around one extern GEMM, which inductor
# would hand to cuBLAS anyway): inductor's lowering of `mm` with `out_dtype` is recent, and the
# cast-free product is the point of this op.
@torch.compiler.disable
def _mm_fp32_out(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(N, H) half × (V, H)ᵀ half → (N, V) float32, accumulated and written in float32."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    logits = torch.mm(flat, weight.t(), out_dtype=torch.float32)
    return logits.view(*hidden.shape[:-1], weight.shape[0])
