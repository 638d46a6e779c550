"""Gated DeltaNet's sequence kernels on the GPU: flash-linear-attention (`fla`, the `linear-attention`
extra) for the causal depthwise conv and the gated delta rule, over many sequences in one varlen call.

`use_fla(device)` decides: fla's Triton kernels on CUDA where the package imports; elsewhere (the CPU,
or fla not installed) the callers run their torch reference (transformers' `torch_chunk_gated_delta_rule` and
`torch_recurrent_gated_delta_rule` as `torch_delta_rules` gives them, F.conv1d), which the kernels are
tested against. The trainer asks `fla_trains(device)`: also where fla takes the delta rule's gradients,
which it refuses on Hopper GPUs with Triton 3.4.0-3.7.0 (`fla_backward_refused`).

Layouts are fla's, as transformers' Qwen3.5 calls it: a stream of N tokens of S sequences laid end to
end, `cu_seqlens` (S + 1,) their offsets; q, k (N, Hk, Dk) and v (N, Hv, Dv) with Hv a multiple of Hk
(value head h reads key head h // (Hv / Hk), transformers' `repeat_interleave`); g the log-decay (N, Hv)
float32; β in (0, 1); q and k L2-normed inside the kernel (eps 1e-6) and q scaled by Dk^-1/2; the
delta-rule state (Hv, Dk, Dv) float32. fla's conv state holds the last K inputs, the engine's the last
K - 1 (the oldest is never read): the wrappers pad and trim.

The decode step's kernels (`conv_step`, `delta_rule_step`) size their launches from the tensors' shapes
alone and read no value on the host, so the engine's decode CUDA graphs capture them; the conv's kernel
autotunes on its first call for each (C, K), which a capture's warm-up run makes. The varlen kernels
(prefill, training) size theirs from the sequence lengths on the host.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def runs_fla(device_type: str, importable: bool) -> bool:
    """fla's kernels run on CUDA only (Triton), and only where the package imports."""
    return device_type == "cuda" and importable


@functools.cache
def fla_importable() -> bool:
    """Whether flash-linear-attention's kernels import here. Not installed: no. Installed but broken (a part
    missing, as `flash-linear-attention` without its `fla-core`, or a Triton it does not match): no, and it
    says why, once."""
    try:
        import fla.modules.causal_conv1d
        import fla.ops.gated_delta_rule
        import fla.ops.kda.fused_recurrent  # noqa: F401
    except Exception as error:
        if not (isinstance(error, ModuleNotFoundError) and error.name == "fla"):
            logger.warning(
                "flash-linear-attention is installed but does not load (%r): linear attention runs its "
                "torch path",
                error,
            )
        return False
    return True


def use_fla(device: torch.device) -> bool:
    """Whether Gated DeltaNet layers on `device` run fla's kernels (else the torch reference)."""
    return runs_fla(device.type, device.type == "cuda" and fla_importable())


def fla_backward_refused(compute_capability_major: int, triton_version: str, tilelang: bool) -> bool:
    """Whether fla refuses the gated delta rule's chunked backward: on Hopper (compute capability 9),
    Triton 3.4.0 <= version < 3.7.1 gives wrong gradients in its `chunk_bwd_dqkwg` kernel (fla #640), and
    fla raises there unless its TileLang backend (`tilelang` installed) takes the kernel instead."""
    from packaging.version import Version

    return (
        compute_capability_major == 9
        and Version("3.4.0") <= Version(triton_version) < Version("3.7.1")
        and not tilelang
    )


@functools.cache
def fla_training_refusal(device_index: int) -> str | None:
    """Why the trainer cannot take fla's gradients on CUDA device `device_index` (`fla_backward_refused`
    with this machine's GPU, Triton and TileLang), with the fix; None where it can."""
    import importlib.util

    import triton

    major = torch.cuda.get_device_capability(device_index)[0]
    if not fla_backward_refused(major, triton.__version__, importlib.util.find_spec("tilelang") is not None):
        return None
    return (
        f"flash-linear-attention refuses the gated delta rule's backward on "
        f"{torch.cuda.get_device_name(device_index)} with Triton {triton.__version__} (wrong gradients on "
        "Hopper GPUs with Triton 3.4.0-3.7.0, fla #640): the trainer's Gated DeltaNet passes run the torch "
        "reference, slower; Triton 3.7.1 or later (or `pip install tilelang`) gives them fla's kernels"
    )


@functools.cache
def _warn_once(text: str) -> None:
    logger.warning(text)


def fla_refusal(device: torch.device) -> str | None:
    """Why fla, running on `device` (`use_fla`), refuses the delta rule's gradients there
    (`fla_training_refusal`); None where fla does not run or takes them."""
    if not use_fla(device):
        return None
    return fla_training_refusal(torch.cuda.current_device() if device.index is None else device.index)


def fla_trains(device: torch.device) -> bool:
    """Whether the trainer's Gated DeltaNet passes on `device` run fla's kernels: `use_fla`, and fla takes
    their gradients there (`fla_refusal`, said once as a warning where it does not). The no-grad passes
    follow the gradient passes, so an update's first ratio compares one kernel's log-probs with
    themselves. (The engine's prefill and decode take no gradients: `use_fla`.)"""
    refusal = fla_refusal(device)
    if refusal is None:
        return use_fla(device)
    _warn_once(refusal)
    return False


def decay(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """The delta rule's log-decay per token and value head: g = -exp(A_log) · softplus(a + dt_bias),
    float32 (a (..., Hv) in the model dtype; as transformers computes it, so that fp16 keeps A finite)."""
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias)


def split_qkv(
    conv: torch.Tensor, key_heads: int, key_dim: int, value_heads: int, value_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv's output (N, C), channels [q | k | v], as q, k (N, Hk, Dk) and v (N, Hv, Dv)."""
    rows, key = conv.shape[0], key_heads * key_dim
    q, k, v = conv.split([key, key, value_heads * value_dim], dim=-1)
    return (
        q.reshape(rows, key_heads, key_dim),
        k.reshape(rows, key_heads, key_dim),
        v.reshape(rows, value_heads, value_dim),
    )


@functools.cache
def torch_delta_rules() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """transformers' torch references of the gated delta rule, (`torch_chunk_gated_delta_rule`,
    `torch_recurrent_gated_delta_rule`), each taking q, k (..., Hk, Dk) with fewer heads than v
    (`grouped`). transformers routes those names to fla's kernels wherever fla imports, whatever the
    device of the tensors they are given (a CPU tensor then fails inside Triton); the torch functions are
    the ones its wrappers wrap."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

    chunked = inspect.unwrap(qwen3_5.torch_chunk_gated_delta_rule)
    recurrent = inspect.unwrap(qwen3_5.torch_recurrent_gated_delta_rule)
    return grouped(chunked), grouped(recurrent)


def grouped(rule: Callable[..., Any]) -> Callable[..., Any]:
    """`rule(q, k, v, **kwargs)` for q, k (..., Hk, Dk) and v (..., Hv, Dv), Hv a multiple of Hk: each key
    head serves Hv / Hk consecutive value heads, so q and k are repeated head by head first, as
    transformers' Qwen3.5 forward does (its torch rules before 5.2x take equal head counts only; fla's
    kernels take the groups as they are)."""

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
        repeats = v.shape[-2] // q.shape[-2]
        if repeats > 1:
            q, k = q.repeat_interleave(repeats, dim=-2), k.repeat_interleave(repeats, dim=-2)
        return rule(q, k, v, **kwargs)

    return call


def conv_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SiLU of the causal depthwise conv of each sequence of the stream x (N, C), weight (C, K):
    y_t = silu(Σ_j w[:, j] · u_{t + j}), u = [window | x_seq] (the window of K - 1 inputs before the
    sequence: zeros, or `initial` (S, C, K - 1)). Returns (y (N, C), each sequence's last K - 1 inputs
    (S, C, K - 1), or None without `initial`). Differentiable in x and weight."""
    from fla.modules.causal_conv1d import causal_conv1d

    state = None if initial is None else F.pad(initial.to(x.dtype), (1, 0))  # fla's (S, C, K)
    y, final = causal_conv1d(
        x[None],
        weight,
        activation="silu",
        initial_state=state,
        output_final_state=initial is not None,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
    return y[0], None if final is None else final[..., 1:]


def conv_step(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token a row: y = silu(Σ_j w[:, j] · [window | x]_j) for x (B, C) after `window` (B, C, K - 1);
    returns (y (B, C), the new window (B, C, K - 1): the last K - 1 of [window | x])."""
    from fla.modules.causal_conv1d import causal_conv1d_update

    cache = F.pad(window.to(x.dtype), (1, 0)).contiguous()  # fla's (B, C, K), stepped in place
    y, cache = causal_conv1d_update(x, cache, weight=weight, activation="silu")
    return y, cache[..., 1:]


def delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial: torch.Tensor | None = None,
    output_final: bool = False,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over each sequence of the stream, chunked (fla's `chunk_gated_delta_rule`):
    S_t = exp(g_t) S_{t-1} + k_t β_t (v_t - exp(g_t) S_{t-1}ᵀ k_t)ᵀ, o_t = S_tᵀ q_t / sqrt(Dk), q and k
    L2-normed, S_0 zeros or `initial` (S, Hv, Dk, Dv). Returns (o (N, Hv, Dv) in v's dtype, the final
    states (S, Hv, Dk, Dv) float32 with `output_final`). Differentiable (fla's own backward)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out, final = chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g=g[None],
        beta=beta[None],
        initial_state=initial,
        output_final_state=output_final,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
    return out[0], final


def delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    reads: torch.Tensor,
    writes: torch.Tensor,
) -> torch.Tensor:
    """One delta-rule step a row, in place in the slot pool `states` (slots, Hv, Dk, Dv) float32: row b
    starts from slot `reads[b]` and leaves its new state in slot `writes[b]`; returns o (B, Hv, Dv).

    q, k (B, Hk, Dk), v (B, Hv, Dv), g, β (B, Hv). The kernel is fla's fused recurrent KDA decode
    (vLLM's continuous-batching kernel), whose per-key-channel decay the scalar g fills along Dk: with
    exp(g) on every channel its step is the gated delta rule's. Its state indices are (read, write) by
    way of its speculative-decoding form: each row lists two slots and `num_accepted_tokens` = 2 makes
    it start from the second and write its one token's state to the first."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    rows, heads, key_dim = q.shape[0], v.shape[1], k.shape[-1]
    indices = torch.stack([writes, reads], dim=1)  # (B, 2)
    accepted = torch.full((rows,), 2, dtype=torch.int32, device=q.device)
    gate = g.float()[:, None, :, None].expand(rows, 1, heads, key_dim).contiguous()  # (B, 1, Hv, Dk)
    out, _ = fused_recurrent_kda_fwd(
        q[:, None].contiguous(),
        k[:, None].contiguous(),
        v[:, None].contiguous(),
        g=gate,
        beta=beta[:, None].contiguous(),
        initial_state=states,
        inplace_final_state=True,
        ssm_state_indices=indices,
        num_accepted_tokens=accepted,
        use_qk_l2norm_in_kernel=True,
    )
    return out[:, 0]
