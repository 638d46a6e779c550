"""Benchmark: whether two CUDA streams hide a long prefill's memory-bound passes behind its attention.

    python bench/tools/prefill_overlap.py --json overlap.json      # one GPU: Qwen2.5-0.5B's shape, 2 prompts of 8k
    python bench/tools/prefill_overlap.py --kernel fa4 --json J    # FlashAttention-4's prefill (the fa4 extra)
    python bench/tools/prefill_overlap.py --small                  # the mechanics on the CPU (one stream, untimed)

At Qwen2.5-0.5B's shape an 8k prefill step under FA4 spends ~0.13 s of 0.29 in the projections (at 73 % of the
bf16 peak), ~0.11 s in attention and ~0.05 s in SiLU·mul, the norms and rotary, which run at the memory's
bandwidth (BENCHMARKS.md, "Long contexts"): 48.6 % of the peak, where the target is 50 %. A step's
prompts are independent of each other, so its layers could run as two halves on two streams, and the GPU
could run one half's memory-bound passes beside the other half's compute-bound kernels. This times the
decoder layers of one prefill step both ways: the engine's (one stream, every prompt packed) against two
streams of half the prompts each, their layers launched alternately. The layers are the engine's kernels
(cuBLAS products, the Triton norm and SiLU·mul, flash or FA4 varlen attention) over random weights of the
shape shared by every layer; the embedding, rotary and the K/V store are left out (both forms would run them
alike). CUDA events, median of `--repeats` after one warm-up; the two forms' outputs are checked to agree.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefill_attention import attention_flops
from shapes import shape_of
from transformers import AutoConfig

from fulcrum.device_facts import device_peak_flops
from fulcrum.models.arch import model_shape
from fulcrum.models.arch.spec import ModelShape, decoder_matmul_params
from fulcrum.models.packed_attention import varlen_causal_attention
from fulcrum.rollout.native import kernels, ops

EPS = 1e-6
Weights = dict[str, torch.Tensor]


def layer_weights(fields: dict[str, Any], dtype: torch.dtype, device: torch.device) -> Weights:
    """One decoder layer's weights at the shape's sizes (q/k/v with biases, as Qwen2), random, scaled so
    activations stay of order one through many layers."""
    hidden, heads = fields["hidden_size"], fields["num_attention_heads"]
    head_dim = fields.get("head_dim") or hidden // heads
    qkv_rows = (heads + 2 * fields["num_key_value_heads"]) * head_dim
    inter = fields["intermediate_size"]
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int, fan_in: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / fan_in**0.5).to(device=device, dtype=dtype)

    return {
        "input_norm": torch.ones(hidden, device=device, dtype=dtype),
        "post_norm": torch.ones(hidden, device=device, dtype=dtype),
        "qkv": randn(qkv_rows, hidden, fan_in=hidden),
        "qkv_bias": randn(qkv_rows, fan_in=1) * 0.02,
        "o": randn(hidden, heads * head_dim, fan_in=heads * head_dim),
        "gate_up": randn(2 * inter, hidden, fan_in=hidden),
        "down": randn(hidden, inter, fan_in=inter),
    }


def layer_flops(shape: ModelShape, lengths: list[int]) -> float:
    """One layer's dense FLOPs over prompts of `lengths`: its products, 2 · tokens · the layer's share of
    `decoder_matmul_params`, and causal attention (`prefill_attention.attention_flops`)."""
    products = decoder_matmul_params(shape) / shape.layers
    return 2 * sum(lengths) * products + sum(
        attention_flops(1, c, shape.heads, shape.head_dim) for c in lengths
    )


@dataclass(frozen=True)
class Prompts:
    """Packed prompts: their hidden states (N, hidden), lengths, and cumulative lengths on the device (made
    once: a copy from the host inside the layers would make the host wait for each stream)."""

    x: torch.Tensor
    lengths: list[int]
    cu: torch.Tensor

    @staticmethod
    def of(x: torch.Tensor, lengths: list[int]) -> Prompts:
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=x.device)
        return Prompts(x, lengths, cu)


class Layers:
    """The decoder layers of a prefill over packed prompts, as the native engine runs them on its Triton path
    (`DecoderLM.forward`), one layer at a time so that two streams can take turns."""

    def __init__(self, fields: dict[str, Any], weights: Weights, kernel: str, triton: bool) -> None:
        self.heads, self.kv_heads = fields["num_attention_heads"], fields["num_key_value_heads"]
        self.head_dim = fields.get("head_dim") or fields["hidden_size"] // self.heads
        self.weights, self.kernel, self.triton = weights, kernel, triton

    def norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """rms_norm(x + residual); `residual` becomes x + residual, in place."""
        if self.triton:
            return kernels.add_rms_norm(x, residual, weight, EPS)
        out, total = ops.add_rms_norm(x, residual, weight, EPS)
        residual.copy_(total)
        return out

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prompts: Prompts) -> torch.Tensor:
        scale = self.head_dim**-0.5
        if q.device.type != "cuda":
            return ops.prefill_attention_sdpa(q, k, v, prompts.lengths, prompts.lengths, scale)
        return varlen_causal_attention(
            q, k, v, prompts.cu, max(prompts.lengths), scale, strided_rows=True, kernel=self.kernel
        )

    def layer(self, x: torch.Tensor, residual: torch.Tensor, prompts: Prompts) -> torch.Tensor:
        """One layer: x (N, hidden) the previous layer's output, `residual` the stream it adds to (in place)."""
        w, tokens = self.weights, x.shape[0]
        h = self.norm(x, residual, w["input_norm"])
        qkv = F.linear(h, w["qkv"], w["qkv_bias"])
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q = qkv[:, :q_size].view(tokens, self.heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(tokens, self.kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].view(tokens, self.kv_heads, self.head_dim)
        attn = self.attention(q, k, v, prompts)
        x = F.linear(attn.reshape(tokens, q_size), w["o"])
        h = self.norm(x, residual, w["post_norm"])
        gate_up = F.linear(h, w["gate_up"])
        act = kernels.silu_and_mul(gate_up) if self.triton else ops.silu_and_mul(gate_up)
        return F.linear(act, w["down"])


def run_streams(
    layers: Layers, parts: list[Prompts], count: int, streams: list[Any] | None
) -> list[torch.Tensor]:
    """`count` layers over each part of a step's prompts, the parts' layers launched in turn, each part on its
    own stream (`streams`, joined to the current one at both ends; None: the current one); each part's
    residual stream at the end."""
    states = [(part.x.clone(), torch.zeros_like(part.x)) for part in parts]
    current = torch.cuda.current_stream() if streams is not None else None
    for stream in streams or []:  # the parts' inputs, made on the current stream, before their layers
        stream.wait_stream(current)
    for _ in range(count):
        for index, (part, (x, residual)) in enumerate(zip(parts, states, strict=True)):
            if streams is None:
                states[index] = (layers.layer(x, residual, part), residual)
                continue
            with torch.cuda.stream(streams[index]):
                states[index] = (layers.layer(x, residual, part), residual)
    for stream in streams or []:  # every layer done before the sum is read on the current stream
        current.wait_stream(stream)
    return [residual + x for x, residual in states]


def timed_ms(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Milliseconds of `fn()` by CUDA events on the current stream (`run_streams` joins its side streams to
    it at both ends)."""
    current = torch.cuda.current_stream()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(current)
        fn()
        end.record(current)
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", help="a bench/shapes.py shape")
    parser.add_argument("--context", type=int, default=8192, help="tokens a prompt")
    parser.add_argument("--prompts", type=int, default=2, help="prompts a prefill step (split in two halves)")
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's")
    parser.add_argument("--kernel", default="flash", choices=("flash", "fa4"), help="the prefill attention")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="a tiny shape on the CPU: the mechanics only")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    model_type, fields = shape_of(args.shape, tiny=args.small)
    if args.small:
        args.context, args.prompts = 24, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    count = args.layers or fields["num_hidden_layers"]
    layers = Layers(
        fields,
        layer_weights(fields, dtype, device),
        args.kernel,
        kernels.HAVE_TRITON and device.type == "cuda",
    )
    lengths = [args.context] * args.prompts
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(sum(lengths), fields["hidden_size"], generator=gen).to(device=device, dtype=dtype)
    split = len(lengths) // 2
    cut = sum(lengths[:split])
    packed = [Prompts.of(x, lengths)]
    halves = [Prompts.of(x[:cut], lengths[:split]), Prompts.of(x[cut:], lengths[split:])]
    one = run_streams(layers, packed, count, None)[0]
    summary: dict[str, Any] = {
        "shape": args.shape,
        "kernel": args.kernel,
        "prompts": args.prompts,
        "context": args.context,
        "layers": count,
    }
    if device.type == "cuda":
        side = [torch.cuda.Stream(device), torch.cuda.Stream(device)]
        two = run_streams(layers, halves, count, side)
        torch.cuda.synchronize(device)
        one_ms = timed_ms(lambda: run_streams(layers, packed, count, None), args.repeats)
        two_ms = timed_ms(lambda: run_streams(layers, halves, count, side), args.repeats)
        flops = layer_flops(model_shape(AutoConfig.for_model(model_type, **fields)), lengths) * count
        peak = device_peak_flops(device)
        one_s, two_s = statistics.median(one_ms) / 1e3, statistics.median(two_ms) / 1e3
        summary |= {
            "one_stream_ms": [round(t, 2) for t in one_ms],
            "two_streams_ms": [round(t, 2) for t in two_ms],
            "two_over_one": round(one_s / two_s, 3),
            "tflop_per_s": {"one": round(flops / one_s / 1e12, 1), "two": round(flops / two_s / 1e12, 1)},
            "peak_fraction": {"one": round(flops / one_s / peak, 3), "two": round(flops / two_s / peak, 3)}
            if peak
            else None,
        }
    else:
        two = run_streams(layers, halves, count, None)
    joined = torch.cat(two)
    summary["max_abs_diff"] = round(float((joined.float() - one.float()).abs().max()), 5)
    summary["max_abs"] = round(float(one.float().abs().max()), 3)
    print(json.dumps(summary, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
