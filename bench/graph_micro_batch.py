"""Benchmark: one training micro-batch replayed as a CUDA graph against the compiled regions' calls.

    python bench/graph_micro_batch.py --model .bench/qwen05 [--budgets 6144,24576] [--log-prob] [--json out.json]
    python bench/graph_micro_batch.py --model TINY --device cpu --budgets 1024 --prompt-width 320 \
        --response 32 --warmup-s 0   # the script's path on the CPU: uncompiled, no graph

At the seed command's micro-batches of 8 the actor's update looked host-bound under the profiler
(`bench/passes.py --profile`: 2.50 s with 1.65 s of GPU work, about 1,850 kernels a micro-batch, each
compiled region's call holding the host for about a millisecond), at 32 GPU-bound. A CUDA graph replays
a micro-batch's kernels with no host work between them, so a graphed path would run at the GPU's pace
whatever the host. This measures what such a path could gain before it is built, and whether the
training pass captures at all (inductor's own `reduce-overhead` mode crashed on it).

The actor of `fulcrum train` as the workers build it (`ActorWorker`: packed attention, compiled decoder
layers with checkpointing inside, bf16 compute copies of the float32 masters, compiled log-softmax
chunks). One packed micro-batch per budget (`n × (prompt width + response)` tokens, filled with whole
synthetic sequences as `bench/passes.py` makes them), on the device before timing; the step is its
forward, the response tokens' log-probs (`linear_log_softmax`), a policy-gradient-shaped loss, its
gradients (`torch.autograd.grad`, as `ComputeWeights.backward`) added into one float32 buffer. Timed per
budget, median of --repeat rounds of --calls steps each (wall clock, the GPU synchronised at each round's
ends):
- `compiled`: the step as the workers run it;
- `graphed`: the same step captured once (after warm-up on a side stream) and replayed.
With --log-prob, the no-grad pass of old log-probs (the layers in eval mode, log-probs and entropies)
the same way. One replay's output (the summed gradients; the log-probs and entropies) is compared with
one call's. Fixed shapes only: a graphed path for the trainer would pad each micro-batch to one of a few
token counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from passes import _section, seed_sizes_config, synthetic_batch

from fulcrum.models.linear_logprob import linear_log_softmax
from fulcrum.models.packed import PackedMicroBatch, pack_micro_batch, packed_hidden_states


def micro_batch(
    budget: int, prompt_width: int, response: int, vocab: int, device: torch.device
) -> PackedMicroBatch:
    """Whole synthetic sequences, in order, while their tokens fit `budget`; packed and on `device`."""
    batch = synthetic_batch(max(1, budget // (60 + response)) + 1, prompt_width, response, vocab)
    lengths = batch["attention_mask"].sum(-1).tolist()
    rows, total = [], 0
    for row, n in enumerate(lengths):
        if total + n > budget:
            break
        rows.append(row)
        total += n
    part = batch.select(rows)
    packed = pack_micro_batch(part["input_ids"], part["attention_mask"], part["position_ids"], prompt_width)
    return packed.to(device)


def rounds(fn: Callable[[], object], calls: int, repeat: int, sync: Callable[[], None]) -> list[float]:
    """Seconds per call of `repeat` rounds of `calls` calls each."""
    out = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        out.append((time.perf_counter() - start) / calls)
    return out


def compiled_and_graphed(
    name: str, step: Callable[[], torch.Tensor], args: argparse.Namespace, device: torch.device
) -> dict[str, object]:
    """`step` timed as called and, on CUDA, captured once and replayed; `step` returns a static tensor (a
    buffer it fills), compared between one replay and one call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    row: dict[str, object] = {}
    step()  # compiles
    deadline = time.perf_counter() + args.warmup_s  # clocks and caches settle after a compilation
    while time.perf_counter() < deadline:
        step()
    times = rounds(step, args.calls, args.repeat, sync)
    row["compiled_s"] = statistics.median(times)
    row["compiled_rounds_s"] = times
    print(f"{name}: compiled {1e3 * row['compiled_s']:.2f} ms a micro-batch", flush=True)
    if device.type != "cuda":
        return row
    expected = step().clone()
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        start = time.perf_counter()
        with torch.cuda.graph(graph):
            out = step()
        row["capture_s"] = time.perf_counter() - start
        graph.replay()
        sync()
        worst = float((out - expected).abs().max())
        scale = float(expected.abs().max())
        row["graphed_max_abs_diff"] = worst
        row["max_abs"] = scale
        times = rounds(graph.replay, args.calls, args.repeat, sync)
        row["graphed_s"] = statistics.median(times)
        row["graphed_rounds_s"] = times
        row["compiled_over_graphed"] = row["compiled_s"] / row["graphed_s"]
        print(
            f"{name}: graphed {1e3 * row['graphed_s']:.2f} ms a micro-batch "
            f"({row['compiled_over_graphed']:.2f}x), capture {row['capture_s']:.2f} s, "
            f"largest difference {worst:.3g} (largest entry {scale:.3g})",
            flush=True,
        )
        del graph
    except Exception as err:  # the point is to learn whether it captures: report and go on
        row["graphed_error"] = f"{type(err).__name__}: {err}"
        print(f"{name}: graph capture failed", flush=True)
        traceback.print_exc()
    return row


def bench_budget(actor, budget: int, args: argparse.Namespace, device: torch.device) -> dict:
    """The update's micro-batch step and, with --log-prob, the no-grad log-prob pass's, at one budget."""
    model = actor.forwards.model
    base = model.get_base_model().model if hasattr(model, "get_base_model") else model.model
    packed = micro_batch(budget, args.prompt_width, args.response, model.config.vocab_size, device)
    m = packed.labels.numel()
    advantages = torch.randn(m, device=device, generator=torch.Generator(device).manual_seed(0))
    row: dict[str, object] = {"budget": budget, "tokens": packed.input_ids.numel(), "response_tokens": m}
    with actor.forwards.active():
        head = model.get_output_embeddings().weight
        params = [p for p in model.parameters() if p.requires_grad]
        # As the workers: the gradients handed back (`ComputeWeights.backward`), then added into one
        # float32 buffer (`accumulate_grads`); here a single flat buffer, zeroed before each step.
        flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=device)
        log_probs = torch.zeros(2, m, dtype=torch.float32, device=device)

        def update_step() -> torch.Tensor:
            flat.zero_()
            hidden = packed_hidden_states(base, packed)
            log_prob, _ = linear_log_softmax(hidden[packed.predictor], head, packed.labels)
            grads = torch.autograd.grad(-(log_prob * advantages).sum() / m, params)
            return flat.add_(torch.cat([g.reshape(-1) for g in grads]))

        @torch.no_grad()
        def log_prob_step() -> torch.Tensor:  # old log-probs with entropy (`compute_log_prob`)
            hidden = packed_hidden_states(base, packed)
            log_prob, entropy = linear_log_softmax(
                hidden[packed.predictor], head, packed.labels, with_entropy=True
            )
            log_probs[0].copy_(log_prob)
            return log_probs[1].copy_(entropy)

        model.train()
        row["update"] = compiled_and_graphed(f"budget {budget}, update", update_step, args, device)
        if args.log_prob:
            model.eval()
            row["log_prob"] = compiled_and_graphed(f"budget {budget}, log-probs", log_prob_step, args, device)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budgets", default="6144,24576", help="tokens a micro-batch (8 and 32 rows of 768)")
    parser.add_argument("--prompt-width", type=int, default=512)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup-s", type=float, default=15.0)
    parser.add_argument(
        "--log-prob", action="store_true", help="also the no-grad log-prob pass's micro-batch"
    )
    parser.add_argument("--json", type=Path, default=None)
    args, overrides = parser.parse_known_args(argv)
    from fulcrum.workers.actor import ActorWorker

    device = torch.device(args.device)
    cfg = seed_sizes_config(args.model, args.prompt_width, args.response, 128, overrides)
    actor = ActorWorker(_section(cfg, "actor"), device, total_training_steps=100)
    rows = [bench_budget(actor, int(b), args, device) for b in args.budgets.split(",")]
    summary = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "overrides": overrides,
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
