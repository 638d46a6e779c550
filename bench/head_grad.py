"""Benchmark: the LM head's log-prob pass and its backward (`linear_log_softmax`), with the weight
gradient's chunks added into the float32 accumulator by one cuBLAS call (`add_product_`, the default)
or by a product in bf16 and a separate add (the unfused form), in one process.

    python bench/head_grad.py [--rows 8192] [--json out.json]      # CUDA

The shape is a GRPO micro-batch of the Qwen2.5-0.5B shape: --rows response positions (32 responses of
256 tokens), hidden 896, vocabulary 151,936, bf16 hidden states and weights, the chunk functions
compiled as the workers compile them. Each variant: 3 warm-up calls, then the median of --repeats
forward + backward calls timed with CUDA events. Prints both medians, their ratio, and the largest
difference between the two weight gradients relative to the gradient's largest entry.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from fulcrum.models import linear_logprob
from fulcrum.models.linear_logprob import linear_log_softmax, use_compiled_chunks

HIDDEN, VOCAB = 896, 151936


def unfused_add_product_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    acc += a @ b


def time_pass(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, repeats: int
) -> tuple[float, torch.Tensor]:
    """Median milliseconds of one forward + backward, and the weight gradient of the last call."""
    times = []
    for i in range(3 + repeats):
        h = hidden.detach().requires_grad_(True)
        w = weight.detach().requires_grad_(True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        logp, _ = linear_log_softmax(h, w, labels, 1.0, False)
        logp.sum().backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times), w.grad


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.rows, HIDDEN, generator=g).to(torch.bfloat16).cuda()
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.02).to(torch.bfloat16).cuda()
    labels = torch.randint(0, VOCAB, (args.rows,), generator=g).cuda()
    use_compiled_chunks(True)
    fused = linear_logprob.add_product_
    results = {}
    grads = {}
    for name, add in (
        ("unfused", unfused_add_product_),
        ("fused", fused),
        ("unfused_again", unfused_add_product_),
    ):
        linear_logprob.add_product_ = add
        try:
            results[name], grads[name] = time_pass(hidden, weight, labels, args.repeats)
        finally:
            linear_logprob.add_product_ = fused
    scale = grads["fused"].float().abs().max().item()
    summary = {
        "rows": args.rows,
        "ms": {k: round(v, 3) for k, v in results.items()},
        # unfused, fused, unfused again: the mean of the two unfused runs brackets a drifting device
        "fused_over_unfused": round(
            (results["unfused"] + results["unfused_again"]) / 2 / results["fused"], 3
        ),
        "grad_max_rel_diff": (grads["fused"].float() - grads["unfused"].float()).abs().max().item() / scale,
        "chunks": -(-args.rows // linear_logprob.chunk_rows(VOCAB)),
    }
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
