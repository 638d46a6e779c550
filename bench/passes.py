"""Benchmark: each training-side pass alone, on one GPU, with a Qwen2.5-0.5B-shaped random model.

    python bench/passes.py --model .bench/qwen05 [--rows 512] [--mini 128] [--repeat 3] \
        [--json out.json] [KEY=VALUE ...]

Passes, each timed after warm-up calls (at least --warmup-s seconds after the first, until two agree
within 10%; median of --repeat, CUDA synchronised around each call):
old log-probs with entropy (`ActorWorker.compute_log_prob`), values (`CriticWorker.compute_values`),
the actor update and the critic update (`update_policy` / `update_critic`, one PPO epoch). The batch
is --rows synthetic samples: prompts of the GSM8K-like lengths `bench/rollout.py` uses (70–239
tokens, mean 110) and --response response tokens, all real. Defaults are the seed command's sizes
(actor and critic micro-batches 8, log-prob micro-batches 16, mini-batch 128, gradient
checkpointing on); KEY=VALUE overrides go to the configuration (e.g.
`actor_rollout_ref.model.use_remove_padding=False` for the padded path).

Per pass: seconds, tokens/s (all real tokens), MFU for updates (the trainer's `perf/mfu/*` formula:
`fulcrum.trainer.metrics.estimate_train_flops` over 989 TFLOP/s) and the pass's peak allocated memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from packed_knobs import add_packed_knobs, apply_packed_knobs, knob_summary

from fulcrum.batch import Batch
from fulcrum.config import load_config
from fulcrum.trainer.metrics import estimate_train_flops

H200_BF16_FLOPS = 989e12
GiB = 1024**3
# --ab's choices: the flags of fulcrum.models.packed an A/B can switch between calls.
AB_KNOBS = {"save_attention": "SAVE_ATTENTION_OUTPUTS", "save_mlp": "SAVE_MLP_PROJECTIONS"}


def prompt_lengths(count: int, seed: int = 0) -> list[int]:
    """bench/rollout.py's synthetic GSM8K-like prompt lengths: 50 template tokens + lognormal(4.005, 0.379).

    Not imported from there: that script puts its own tree first on sys.path, and this one must
    measure whichever tree PYTHONPATH names (e.g. an older commit, for before/after).
    """
    generator = torch.Generator().manual_seed(seed)
    question = torch.empty(count).log_normal_(4.005, 0.379, generator=generator)
    return (50 + question.ceil()).clamp(60, 300).long().tolist()


def synthetic_batch(rows: int, prompt_width: int, response: int, vocab: int, seed: int = 0) -> Batch:
    """verl layout: prompts left-padded to `prompt_width`, responses of `response` real tokens."""
    lengths = prompt_lengths(rows, seed)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.zeros(rows, prompt_width, dtype=torch.long)
    prompt_mask = torch.zeros(rows, prompt_width, dtype=torch.long)
    for i, n in enumerate(lengths):
        prompts[i, prompt_width - n :] = torch.randint(3, vocab, (n,), generator=g)
        prompt_mask[i, prompt_width - n :] = 1
    responses = torch.randint(3, vocab, (rows, response), generator=g)
    response_mask = torch.ones(rows, response, dtype=torch.long)
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    shape = (rows, response)
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "response_mask": response_mask,
            "advantages": torch.randn(shape, generator=g),
            "returns": torch.randn(shape, generator=g),
            "values": torch.randn(shape, generator=g),
        }
    )


def seed_sizes_config(
    model: str | Path, prompt_width: int, response: int, mini: int, overrides: list[str], micro: int = 8
):
    """The configuration of the passes at the seed command's sizes: actor and critic micro-batches of
    `micro` (8), log-prob micro-batches of 16, mini-batches of `mini`; `overrides` last."""
    return load_config(
        [
            f"actor_rollout_ref.model.path={model}",
            f"critic.model.path={model}",
            f"data.max_prompt_length={prompt_width}",
            f"data.max_response_length={response}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
            f"critic.ppo_micro_batch_size_per_gpu={micro}",
            f"critic.forward_micro_batch_size_per_gpu={micro}",
            "actor_rollout_ref.actor.optim.lr=1e-7",
            "critic.optim.lr=1e-7",
            *overrides,
        ]
    )


def add_seed_batch_args(parser: argparse.ArgumentParser) -> None:
    """The model, device, synthetic batch and seed sizes that the single-pass benchmarks share."""
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--mini", type=int, default=128)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--prompt-width", type=int, default=512)
    parser.add_argument("--response", type=int, default=256)


def _section(cfg, role: str):
    """The worker's typed section (fulcrum.config.sections); older trees take the whole configuration."""
    try:
        from fulcrum.config import sections
    except ImportError:
        return cfg
    return getattr(sections, f"{role}_section")(cfg)


def compilations() -> int:
    """Graphs dynamo has compiled so far in this process (its `unique_graphs` counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def timed_call(fn: Callable[[], object]) -> float:
    """Seconds of one call, the GPU (where there is one) synchronised before and after."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def warm_up(
    fn: Callable[[], object], warmup_s: float = 15.0, max_warmup: int = 12, steady: float = 0.1
) -> None:
    """Calls `fn` until warm (see `measure`) and prints the calls' seconds.

    Warm-up: after the first call (which compiles), calls go on for at least `warmup_s` seconds and until
    two in a row agree within `steady` (at most `max_warmup` calls). On the H200, for several seconds
    after a compilation the same pass ran up to 4x slower with nothing compiled in it (2026-12-01: 5.2,
    1.9, 1.8, 1.3, then 0.43 s for one log-prob pass on tree 9f62fba; 1.88, 1.84, 1.79, then 0.51,
    0.42 s on tree f06f231), while the trainer's own pass ran at the steady figure; two slow calls can
    agree, so agreement alone is not enough."""
    warmup: list[float] = []
    settled_from: float | None = None
    while len(warmup) < max_warmup:
        warmup.append(timed_call(fn))
        settled_from = settled_from or time.perf_counter()  # the end of the compiling call
        agree = len(warmup) >= 3 and abs(warmup[-1] - warmup[-2]) <= steady * warmup[-2]
        if agree and time.perf_counter() - settled_from >= warmup_s:
            break
    print(f"  warm-up calls (compilation in the first) {', '.join(f'{t:.2f}' for t in warmup)} s", flush=True)


def measure(fn: Callable[[], object], repeat: int, warmup_s: float = 15.0) -> tuple[float, float]:
    """(median seconds over `repeat` calls after `warm_up`, peak allocated GiB during those calls).

    Prints every call and how many graphs were compiled during the timed ones: a timed call that still
    compiles (a new shape, or dynamo's cache limit) is not a warm figure."""
    warm_up(fn, warmup_s)
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    compiled_before = compilations()
    times = [timed_call(fn) for _ in range(repeat)]
    calls = ", ".join(f"{t:.3f}" for t in times)
    print(
        f"  timed calls {calls} s; graphs compiled during them: {compilations() - compiled_before}",
        flush=True,
    )
    return statistics.median(times), (torch.cuda.max_memory_allocated() / GiB if gpu else 0.0)


def measure_ab(
    fn: Callable[[], object], switch: Callable[[bool], None], repeat: int, warmup_s: float
) -> dict[bool, tuple[float, float]]:
    """`measure` of `fn` with `switch(False)` and `switch(True)`, the timed calls interleaved (off, on,
    off, on, ...) so that the host's drift, which moved host-bound passes 1.6-2.2x within an hour on
    2026-12-01, falls on both alike. {setting: (median seconds, peak allocated GiB)}."""
    for setting in (False, True):
        switch(setting)
        warm_up(fn, warmup_s)
    times: dict[bool, list[float]] = {False: [], True: []}
    peaks = dict.fromkeys(times, 0.0)
    compiled_before = compilations()
    for _ in range(repeat):
        for setting in (False, True):
            switch(setting)
            torch.cuda.reset_peak_memory_stats()
            times[setting].append(timed_call(fn))
            peaks[setting] = max(peaks[setting], torch.cuda.max_memory_allocated() / GiB)
    for setting, calls in times.items():
        print(f"  {setting}: timed calls {', '.join(f'{t:.3f}' for t in calls)} s", flush=True)
    print(f"  graphs compiled during the timed calls: {compilations() - compiled_before}", flush=True)
    return {setting: (statistics.median(calls), peaks[setting]) for setting, calls in times.items()}


def timed_pass(
    fn: Callable[[], object],
    args: argparse.Namespace,
    results: dict,
    name: str,
    tokens: int,
    flops: float | None = None,
) -> None:
    """Time one pass and record it; with --ab KNOB, the A/B of that flag of `fulcrum.models.packed`
    (recorded as `name` and `name+KNOB`)."""
    if args.ab is None:
        record(results, args.label, name, tokens, *measure(fn, args.repeat, args.warmup_s), flops)
        return
    from fulcrum.models import packed

    flag = AB_KNOBS[args.ab]

    def switch(on: bool) -> None:
        setattr(packed, flag, on)  # dynamo guards on the global: one compiled graph for each setting

    ab = measure_ab(fn, switch, args.repeat, args.warmup_s)
    switch(False)
    for setting, suffix in ((False, ""), (True, f"+{args.ab}")):
        record(results, args.label, name + suffix, tokens, *ab[setting], flops)


def record(
    results: dict, label: str, name: str, tokens: int, seconds: float, peak: float, flops: float | None = None
) -> None:
    row = {"seconds": seconds, "tokens_per_s": tokens / seconds, "peak_allocated_gib": peak}
    if flops is not None:
        row["mfu"] = flops / seconds / H200_BF16_FLOPS
    results[name] = row
    print(f"{label} {name}: {json.dumps(row)}", flush=True)


def bench_actor(
    cfg, device: torch.device, args: argparse.Namespace, passes: list[str], results: dict
) -> Batch:
    """Old log-probs and the actor update; returns the batch (with old_log_probs) for the critic."""
    from fulcrum.workers.actor import ActorWorker

    actor = ActorWorker(_section(cfg, "actor"), device, total_training_steps=100)
    batch = synthetic_batch(args.rows, args.prompt_width, args.response, actor.model.config.vocab_size)
    tokens = int(batch["attention_mask"].sum())
    lengths = batch["attention_mask"].sum(-1).tolist()
    batch["old_log_probs"], _ = actor.compute_log_prob(batch)
    if "log_prob" in passes:
        record(
            results,
            args.label,
            "log_prob",
            tokens,
            *measure(lambda: actor.compute_log_prob(batch), args.repeat, args.warmup_s),
        )
    if "update_actor" in passes:
        flops = estimate_train_flops(actor.model.config, lengths)
        timed_pass(lambda: actor.update_policy(batch), args, results, "update_actor", tokens, flops)
    if args.profile:
        profile_update(actor, batch, args.profile)
    return batch


def profile_update(actor, batch: Batch, out: Path) -> None:
    """One actor update under torch.profiler: GPU-busy share of the wall time, kernel count, top ops."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        actor.update_policy(batch)
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    # Kernels only: an operator's "self CUDA" time is its kernels' time again.
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    launches = sum(e.count for e in kernels)
    head = f"wall {wall:.3f} s (profiled), GPU busy {gpu_us / 1e6:.3f} s, {launches} kernels\n"
    print(head, flush=True)
    out.write_text(
        head
        + events.table(sort_by="self_device_time_total", row_limit=25)
        + events.table(sort_by="self_cpu_time_total", row_limit=25)
    )


def bench_critic(
    cfg, device: torch.device, batch: Batch, args: argparse.Namespace, passes: list[str], results: dict
) -> None:
    from fulcrum.workers.critic import CriticWorker

    critic = CriticWorker(_section(cfg, "critic"), device, total_training_steps=100)
    tokens = int(batch["attention_mask"].sum())
    if "values" in passes:
        record(
            results,
            args.label,
            "values",
            tokens,
            *measure(lambda: critic.compute_values(batch), args.repeat, args.warmup_s),
        )
    if "update_critic" in passes:
        config = critic.model.config
        lengths = batch["attention_mask"].sum(-1).tolist()
        # No LM head: the embedding counted once (as `estimate_train_flops(..., lm_head=False)`,
        # written out so that this script also runs on trees from before that argument).
        flops = estimate_train_flops(config, lengths) - 6.0 * config.vocab_size * config.hidden_size * tokens
        timed_pass(lambda: critic.update_critic(batch), args, results, "update_critic", tokens, flops)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--prompt-width", type=int, default=512)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--mini", type=int, default=128, help="ppo_mini_batch_size (prompts; n = 1)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--warmup-s", type=float, default=15.0, help="seconds of warm-up calls after the compiling one"
    )
    parser.add_argument("--passes", default="log_prob,values,update_actor,update_critic")
    parser.add_argument("--label", default="")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--profile", type=Path, default=None, help="write a torch.profiler table of one actor update"
    )
    add_packed_knobs(parser)
    parser.add_argument(
        "--ab",
        choices=sorted(AB_KNOBS),
        default=None,
        help="time the passes with that flag of fulcrum.models.packed off and on, calls interleaved",
    )
    parser.add_argument(
        "--ab-save-attention",
        dest="ab",
        action="store_const",
        const="save_attention",
        help="--ab save_attention",
    )
    args, overrides = parser.parse_known_args(argv)
    if args.ab == "save_attention":
        # The C++ wrapper refuses the checkpointed regions without the attention outputs kept: the A/B
        # compares the two under inductor's Python wrapper.
        overrides = [*overrides, "actor_rollout_ref.actor.inductor_cpp_wrapper=false"]
    apply_packed_knobs(args)
    device = torch.device("cuda")
    cfg = seed_sizes_config(args.model, args.prompt_width, args.response, args.mini, overrides)
    from host_speed import host_speed

    host = host_speed()
    print(f"host: {host}", flush=True)
    passes = args.passes.split(",")
    results: dict[str, dict[str, float]] = {}
    if "log_prob" in passes or "update_actor" in passes:
        batch = bench_actor(cfg, device, args, passes, results)
        torch.cuda.empty_cache()
    else:  # the critic alone: no actor to build and compile
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(args.model).vocab_size
        batch = synthetic_batch(args.rows, args.prompt_width, args.response, vocab)
    if "values" in passes or "update_critic" in passes:
        bench_critic(cfg, device, batch, args, passes, results)
    tokens = int(batch["attention_mask"].sum())
    summary = {
        "label": args.label,
        "rows": args.rows,
        "tokens": tokens,
        "overrides": overrides,
        **knob_summary(),
        "ab": args.ab,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "passes": results,
        "host": {"before": host, "after": host_speed()},
    }
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
