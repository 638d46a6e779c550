"""A Triton kernel of the native engine's dense SwiGLU MLP: the gate / up product and SiLU(gate) · up in one.

    act = silu(x · W_gateᵀ) · (x · W_upᵀ),   W = [W_gate | W_up] (2I, H) as the engine stores `gate_up`

The cuBLAS path (`F.linear`, then `kernels.silu_and_mul`) writes the (N, 2I) product to memory and reads it
back, 3 · 2I bytes a token in bf16 beside the GEMM's own traffic; at Qwen2.5-0.5B's shape (I = 4,864) that
is most of the elementwise time of a long prefill, which runs at the memory's bandwidth. Here each program
computes a (BLOCK_M, BLOCK_N) tile of the gate's product and the matching tile of the up's (two
accumulators over the same x tile) and writes only act. Both products are rounded to the weights' dtype
before the SiLU, as the two-kernel path and the training model compute it, so the kernels differ only by
the GEMMs' summation order. `EngineConfig.prefill_mlp="fused"` runs it in prefill steps;
`bench/tools/mlp_sweep.py` times it against the cuBLAS path and picks the launch. Importing this module needs
`triton` (see `kernels.HAVE_TRITON`).
"""

from __future__ import annotations

import torch

from fulcrum.rollout.native.kernels import HAVE_TRITON

# BLOCK_M × BLOCK_N of act a program (two fp32 accumulators: a 128 × 256 GEMM tile's registers), BLOCK_K
# of the hidden size a step, GROUP_M row tiles walked together (the weight tiles stay in L2 across them).
MLP_LAUNCH: dict[str, int] = {
    "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3,
}  # fmt: skip

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources

    @triton.jit
    def _gate_up_silu_kernel(
        x_ptr, w_ptr, out_ptr, rows, inter, hidden, stride_x, stride_w, stride_out,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        # Programs in groups of GROUP_M row tiles by every column tile (the grouped order of Triton's
        # matmul tutorial), so consecutive programs share weight tiles in L2.
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(rows, BLOCK_M)
        tiles_n = tl.cdiv(inter, BLOCK_N)
        in_group = GROUP_M * tiles_n
        first_m = (pid // in_group) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (pid % in_group) % group_rows
        tile_n = (pid % in_group) // group_rows
        offs_m = (tile_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = (tile_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < rows
        n_ok = offs_n < inter
        x_tile = x_ptr + offs_m[:, None] * stride_x + offs_k[None, :]
        gate_tile = w_ptr + offs_n[None, :] * stride_w + offs_k[:, None]  # (BLOCK_K, BLOCK_N) of W_gateᵀ
        up_tile = gate_tile + inter * stride_w
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, hidden, BLOCK_K):
            k_ok = offs_k < hidden - k
            a = tl.load(x_tile, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b_ok = k_ok[:, None] & n_ok[None, :]
            acc_gate = tl.dot(
                a, tl.load(gate_tile, mask=b_ok, other=0.0), acc_gate, input_precision=PRECISION
            )
            acc_up = tl.dot(a, tl.load(up_tile, mask=b_ok, other=0.0), acc_up, input_precision=PRECISION)
            x_tile += BLOCK_K
            gate_tile += BLOCK_K
            up_tile += BLOCK_K
        dtype = out_ptr.dtype.element_ty
        gate = acc_gate.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        act = gate / (1.0 + tl.exp(-gate)) * up
        out = out_ptr + offs_m[:, None] * stride_out + offs_n[None, :]
        tl.store(out, act.to(dtype), mask=m_ok[:, None] & n_ok[None, :])


def gate_up_silu(
    x: torch.Tensor, gate_up: torch.Tensor, launch: dict[str, int] | None = None
) -> torch.Tensor:
    """silu(x · W_gateᵀ) · (x · W_upᵀ) for x (N, H) and gate_up (2I, H) = [W_gate | W_up]: (N, I), in one
    kernel (module docstring); the twin of `ops.silu_and_mul(F.linear(x, gate_up))`. `launch`: block sizes,
    num_warps and num_stages in place of MLP_LAUNCH (the sweep's)."""
    rows, hidden = x.shape
    double, w_hidden = gate_up.shape
    assert w_hidden == hidden and double % 2 == 0, (
        f"gate_up {tuple(gate_up.shape)} against x {tuple(x.shape)}"
    )
    assert x.stride(1) == 1 and gate_up.stride(1) == 1 and x.dtype == gate_up.dtype
    inter = double // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    config = {**MLP_LAUNCH, **(launch or {})}
    grid = (triton.cdiv(rows, config["BLOCK_M"]) * triton.cdiv(inter, config["BLOCK_N"]),)
    # float32 products in full precision, as F.linear's (tl.dot would take TF32 on Ampere and later)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    try:
        _gate_up_silu_kernel[grid](
            x, gate_up, out, rows, inter, hidden, x.stride(0), gate_up.stride(0), out.stride(0),
            PRECISION=precision, **config,
        )  # fmt: skip
    except OutOfResources as exc:  # at its first call, where the launch needs more than this card has
        raise RuntimeError(
            f"actor_rollout_ref.rollout.engine_kwargs.native.prefill_mlp=fused: the kernel's launch {config} "
            f"does not fit this GPU ({exc}); set prefill_mlp=matmul, or pick a launch with "
            "bench/tools/mlp_sweep.py"
        ) from exc
    return out
