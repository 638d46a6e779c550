"""Multi-turn rollout throughput: conversations with a tool against single-turn generation of the same
total tokens, on the native engine through the asyncio driver the tool agent loop uses.

Workload: the Qwen2.5-0.5B shape (random weights, bf16) and bench/rollout.py's GSM8K-like prompts.
A random-weight model never writes a tool call, so the conversations are driven at the token level:
each of N conversations samples K tokens a turn (EOS ignored), then a synthetic tool (a coroutine that
sleeps its latency) answers with M fixed tokens appended by `resume` (loss mask 0), for T assistant
turns; KV blocks are kept between turns and released at the end, as `fulcrum.agent.loop` does. That
is the engine and driver machinery of a tool rollout without the parsing.

- multi-turn: N x T turns of K tokens, tools answering in L ms; generated tok/s (policy tokens) and
  total tok/s (with the appended tool tokens), the engine's prefill counters and evictions;
- single-turn: the same N prompts x T*K tokens in one `generate`; the ratio multi / single (the
  issue's floor is 0.75);
- slow tool: the multi-turn run with one conversation's tool taking 200 ms: the batch's time against
  the fast run's, and that conversation's finish against the others' (it should delay only itself);
- for both kinds, where the time went: `prefill_s`, `decode_s` and the rest, `host_s` (the driver, the
  request calls, scheduling, tool waits; `host_us_per_turn` for multi-turn), of which the cyclic
  garbage collector ran `gc_s` (`gc_full` full collections, each a scan of every object the
  collector tracks: the objects made before the timed runs are frozen first, as the trainer freezes
  its own before the first step; `--no-gc-freeze` leaves them in).

    python bench/multi_turn.py                        # on one GPU: prints a JSON summary
    python bench/multi_turn.py --small --device cpu   # a smoke run of the same code on a tiny model

GPU timing as bench/rollout.py's: CUDA events after a warm-up run of each kind, median of the repeats
(the kinds interleaved within each repeat, so drift of the host touches all of them alike). K=85 does
not fill the last decode window of a turn (`--decode-steps` 16): the surplus steps are part of what
a turn costs and are counted against the multi-turn figure.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# bench/rollout.py as a module (it puts this tree first on the path for `fulcrum`)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout import build_model, prompt_lengths, random_prompts, timed

from fulcrum.rollout import SamplingParams
from fulcrum.rollout.driver import AsyncRollout
from fulcrum.rollout.native import EngineConfig, NativeEngine

FLOOR = 0.75  # the bar: multi-turn generated tok/s at least 75 % of single-turn
# The smoke's sizes for every size left unset under --small.
SMALL_SIZES = dict(conversations=8, turn_tokens=8, tool_tokens=4, repeats=1)
LARGE_SIZES = dict(conversations=512, turn_tokens=85, tool_tokens=32, repeats=3)
# The engine's settings, at bench/rollout.py's values so that both benches measure the same engine.
ENGINE_FLAGS = {
    "--max-num-seqs": 512,
    "--max-num-batched-tokens": 16384,
    "--decode-steps": 16,
    "--gpu-memory-utilization": 0.5,
}


@dataclass(frozen=True)
class Workload:
    """N conversations of T assistant turns of K sampled tokens, M tool tokens between two turns."""

    conversations: int
    turns: int
    turn_tokens: int
    tool_tokens: int
    tool_latency_s: float
    slow_latency_s: float
    slow_index: int = 0  # the conversation whose tool is slow in the slow-tool run

    @property
    def generated(self) -> int:
        """Policy tokens of the whole batch."""
        return self.conversations * self.turns * self.turn_tokens

    @property
    def appended(self) -> int:
        """Tool tokens appended over the whole batch."""
        return self.conversations * (self.turns - 1) * self.tool_tokens


@dataclass
class Finish:
    """When one conversation's tool answers came back and when its last turn finished (seconds from
    the batch's start), and the tokens it holds."""

    answers_s: list[float]
    finish_s: float
    generated: int
    appended: int


@dataclass
class BatchRun:
    """One timed batch: its seconds, each conversation's `Finish` (none for single-turn) and the
    engine's counters over it."""

    seconds: float
    finishes: list[Finish]
    counters: dict[str, float]


async def converse(
    rollout: AsyncRollout,
    prompt: list[int],
    answer: list[int],
    latency_s: float,
    params: SamplingParams,
    turns: int,
    start: float,
) -> Finish:
    """One conversation: a turn, then (tool sleeps, its answer appended, next turn) until `turns`."""
    [out] = await rollout.generate(prompt, params, keep=True)
    answers = []
    for _ in range(turns - 1):
        await asyncio.sleep(latency_s)  # the tool: other conversations decode meanwhile
        answers.append(time.perf_counter() - start)
        out = await rollout.resume(out.seq_id, answer, params, keep=True)
    rollout.release(out.seq_id)
    finish = time.perf_counter() - start
    sampled = sum(out.loss_mask)
    return Finish(answers, finish, sampled, len(out.token_ids) - sampled)


async def conversations(
    engine: NativeEngine,
    prompts: list[list[int]],
    answers: list[list[int]],
    latencies: list[float],
    params: SamplingParams,
    turns: int,
    step_in_thread: bool,
) -> list[Finish]:
    """Every conversation at once on one `AsyncRollout`, as `fulcrum.agent.conversations` runs them."""
    rollout = AsyncRollout(engine, step_in_thread=step_in_thread)
    start = time.perf_counter()
    try:
        jobs = zip(prompts, answers, latencies, strict=True)
        return list(
            await asyncio.gather(*(converse(rollout, p, a, s, params, turns, start) for p, a, s in jobs))
        )
    finally:
        rollout.close()


def counted(
    engine: NativeEngine, run: Callable[[], object], device: torch.device
) -> tuple[float, dict[str, float]]:
    """Seconds of `run()` (bench/rollout.py's `timed`) and the engine's counters it moved, with the
    seconds the cyclic garbage collector ran meanwhile (`gc_s`) and its full collections."""
    clock = {"gc_s": 0.0, "gc_full": 0}
    started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        clock["gc_s"] += time.perf_counter() - started[0]
        clock["gc_full"] += info["generation"] == 2

    before = engine.counters
    gc.callbacks.append(on_gc)
    try:
        seconds = timed(run, device)
    finally:
        gc.callbacks.remove(on_gc)
    after = engine.counters
    return seconds, {**{key: after[key] - before[key] for key in after}, **clock}


def multi_turn_run(
    engine: NativeEngine,
    prompts: list[list[int]],
    answers: list[list[int]],
    latencies: list[float],
    work: Workload,
    args: argparse.Namespace,
) -> BatchRun:
    """One timed batch of conversations under a fixed seed."""
    params = SamplingParams(temperature=1.0, max_tokens=work.turn_tokens, ignore_eos=True, seed=0)
    engine.seed_requests(params)
    box: list[Finish] = []

    def run() -> None:
        box[:] = asyncio.run(
            conversations(engine, prompts, answers, latencies, params, work.turns, args.step_in_thread)
        )

    seconds, counters = counted(engine, run, torch.device(args.device))
    assert sum(f.generated for f in box) == work.generated and sum(f.appended for f in box) == work.appended
    return BatchRun(seconds, box, counters)


def single_turn_run(
    engine: NativeEngine, prompts: list[list[int]], work: Workload, device: torch.device
) -> BatchRun:
    """The same prompts and total policy tokens in one `generate`."""
    total = work.turns * work.turn_tokens
    params = SamplingParams(temperature=1.0, max_tokens=total, ignore_eos=True, seed=0)
    seconds, counters = counted(engine, lambda: engine.generate(prompts, params), device)
    return BatchRun(seconds, [], counters)


def median_run(runs: list[BatchRun]) -> BatchRun:
    """The run of median seconds (the lower middle one of an even count)."""
    ordered = sorted(runs, key=lambda r: r.seconds)
    return ordered[(len(ordered) - 1) // 2]


def engine_figures(run: BatchRun) -> dict[str, float]:
    """The counters a reader checks: prefilled tokens and steps, decode steps, evictions, preemptions;
    the seconds in prefill and decode, and the rest (`host_s`: the driver, the request calls, the
    scheduler, tool waits, the garbage collector's `gc_s` among them)."""
    keys = ("prefill_tokens", "prefill_steps", "decode_steps", "evictions", "preemptions", "gc_full")
    figures = {key: int(run.counters[key]) for key in keys}
    for key in ("prefill_s", "decode_s", "gc_s"):
        figures[key] = round(run.counters[key], 4)
    figures["host_s"] = round(run.seconds - run.counters["prefill_s"] - run.counters["decode_s"], 4)
    return figures


def multi_turn_summary(runs: list[BatchRun], work: Workload, prompt_tokens: int) -> dict[str, Any]:
    """Generated and total tok/s of the median run, and what the engine prefilled beyond the prompts
    and the tool answers (each resume also feeds the turn's last sampled token, which has no KV yet;
    anything past that is recomputation)."""
    run = median_run(runs)
    figures = engine_figures(run)
    resumes = work.conversations * (work.turns - 1)
    expected = prompt_tokens + work.appended + resumes
    return {
        "s": [round(r.seconds, 4) for r in runs],
        "tok_per_s": round(work.generated / run.seconds),
        "total_tok_per_s": round((work.generated + work.appended) / run.seconds),
        "generated_tokens": work.generated,
        "appended_tokens": work.appended,
        "prompt_tokens": prompt_tokens,
        "expected_prefill_tokens": expected,
        "recomputed_tokens": figures["prefill_tokens"] - expected,
        **figures,
        "host_us_per_turn": round(figures["host_s"] / (work.conversations * work.turns) * 1e6, 1),
    }


def slow_tool_summary(fast: BatchRun, slow: BatchRun, work: Workload) -> dict[str, Any]:
    """The slow conversation's finish against the others', and the batch's time against the fast run."""
    mine = slow.finishes[work.slow_index]
    others = [f.finish_s for i, f in enumerate(slow.finishes) if i != work.slow_index]
    fast_last = max(f.finish_s for f in fast.finishes)
    return {
        "slow_index": work.slow_index,
        "slow_latency_ms": round(work.slow_latency_s * 1000, 3),
        "fast_batch_s": round(fast.seconds, 4),
        "slow_batch_s": round(slow.seconds, 4),
        "batch_delay_s": round(slow.seconds - fast.seconds, 4),
        # the slow tool alone adds this to its own conversation; a tool run in the way of every
        # conversation would add N times as much
        "own_delay_bound_s": round(work.slow_latency_s * (work.turns - 1), 4),
        "serial_delay_s": round(work.slow_latency_s * (work.turns - 1) * work.conversations, 4),
        "slow_finish_s": round(mine.finish_s, 4),
        # its own last turn, decoded alone once the others are done: part of its delay, not the tool's
        "slow_last_turn_s": round(mine.finish_s - mine.answers_s[-1], 4),
        "others_finish_max_s": round(max(others), 4),
        "others_finish_median_s": round(statistics.median(others), 4),
        "fast_finish_max_s": round(fast_last, 4),
        "others_delay_s": round(max(others) - fast_last, 4),
        "slow_finished_last": mine.finish_s > max(others),
        "others_done_before_slow_last_answer": max(others) < mine.answers_s[-1],
    }


def build_engine(
    args: argparse.Namespace, model: torch.nn.Module, prompts: list[list[int]], work: Workload
) -> NativeEngine:
    """The engine at bench/rollout.py's settings, long enough for a whole conversation."""
    longest = (
        max(len(p) for p in prompts) + work.turns * work.turn_tokens + (work.turns - 1) * work.tool_tokens
    )
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=longest + 64,
        gpu_memory_utilization=args.gpu_memory_utilization,
        decode_steps=args.decode_steps,
        enforce_eager=args.enforce_eager,
        free_cache_engine=False,  # timed generates back to back: the cache (and its graphs) stay
    )
    engine = NativeEngine(model, [1], 0, config, torch.device(args.device))
    engine.runner.capture_all()
    return engine


def measure(args: argparse.Namespace, work: Workload, summary: dict[str, Any]) -> None:
    """Warm-up runs, then per repeat: single-turn, multi-turn (fast tools), multi-turn with one slow tool."""
    device = torch.device(args.device)
    model = build_model(args, device)
    prompts = random_prompts(prompt_lengths(work.conversations, args.lengths), model.config.vocab_size)
    answers = random_prompts([work.tool_tokens] * work.conversations, model.config.vocab_size, seed=1)
    fast = [work.tool_latency_s] * work.conversations
    slow = list(fast)
    slow[work.slow_index] = work.slow_latency_s
    engine = build_engine(args, model, prompts, work)
    single_turn_run(engine, prompts, work, device)  # warm-up: Triton compiles, allocator settles
    multi_turn_run(engine, prompts, answers, fast, work, args)
    if not args.no_gc_freeze:  # as the trainer does before its first step (PPOTrainer.fit)
        gc.collect()
        gc.freeze()
    singles, multis, slows = [], [], []
    for _ in range(args.repeats):
        singles.append(single_turn_run(engine, prompts, work, device))
        multis.append(multi_turn_run(engine, prompts, answers, fast, work, args))
        slows.append(multi_turn_run(engine, prompts, answers, slow, work, args))
    single = median_run(singles)
    summary["single_turn"] = {
        "s": [round(r.seconds, 4) for r in singles],
        "tok_per_s": round(work.generated / single.seconds),
        **engine_figures(single),
    }
    summary["multi_turn"] = multi_turn_summary(multis, work, sum(len(p) for p in prompts))
    summary["ratio_multi_over_single"] = round(
        summary["multi_turn"]["tok_per_s"] / summary["single_turn"]["tok_per_s"], 3
    )
    summary["meets_floor"] = summary["ratio_multi_over_single"] >= FLOOR
    summary["slow_tool"] = slow_tool_summary(median_run(multis), median_run(slows), work)


def report(summary: dict[str, Any]) -> None:
    """The figures in four lines before the JSON."""
    single, multi, slow = summary["single_turn"], summary["multi_turn"], summary["slow_tool"]
    print(f"single-turn: {single['tok_per_s']:,} tok/s; multi-turn: {multi['tok_per_s']:,} generated tok/s "
          f"({multi['total_tok_per_s']:,} with tool tokens), ratio {summary['ratio_multi_over_single']} "
          f"(floor {FLOOR})", flush=True)  # fmt: skip
    print(f"multi-turn prefill: {multi['prefill_tokens']:,} tokens (expected {multi['expected_prefill_tokens']:,}), "
          f"evictions {multi['evictions']}, preemptions {multi['preemptions']}", flush=True)  # fmt: skip
    print(f"outside prefill and decode: single-turn {single['host_s']} s, multi-turn {multi['host_s']} s "
          f"({multi['host_us_per_turn']} us a turn; garbage collector {multi['gc_s']} s)", flush=True)  # fmt: skip
    print(f"slow tool ({slow['slow_latency_ms']} ms): batch {slow['fast_batch_s']} -> {slow['slow_batch_s']} s; "
          f"slow conversation done at {slow['slow_finish_s']} s, the others by {slow['others_finish_max_s']} s "
          f"(fast run: {slow['fast_finish_max_s']} s)", flush=True)  # fmt: skip


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Workload]:
    """The arguments, with the sizes left unset taken from --small's or the full workload's."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--small", action="store_true", help="a tiny model and batch (smoke test of the script)"
    )
    parser.add_argument("--conversations", type=int, default=None, help="N (512; --small: 8)")
    parser.add_argument("--turns", type=int, default=3, help="T assistant turns a conversation")
    parser.add_argument(
        "--turn-tokens", type=int, default=None, help="K sampled tokens a turn (85; --small: 8)"
    )
    parser.add_argument(
        "--tool-tokens", type=int, default=None, help="M tokens a tool answer (32; --small: 4)"
    )
    parser.add_argument("--tool-latency-ms", type=float, default=1.0)
    parser.add_argument("--slow-latency-ms", type=float, default=200.0)
    parser.add_argument(
        "--lengths", default=None, help="a JSON file: a list of prompt lengths, repeated to the conversations"
    )
    for flag, default in ENGINE_FLAGS.items():
        parser.add_argument(flag, type=type(default), default=default)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--step-in-thread", action="store_true", help="AsyncRollout(step_in_thread=True)")
    parser.add_argument(
        "--no-gc-freeze", action="store_true", help="leave the setup's objects to the cycle collector"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (3; --small: 1)")
    parser.add_argument("--json", default=None, help="also write the summary here")
    args = parser.parse_args(argv)
    for key, value in (SMALL_SIZES if args.small else LARGE_SIZES).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    assert args.turns >= 2, "a multi-turn conversation needs at least two turns"
    work = Workload(
        conversations=args.conversations,
        turns=args.turns,
        turn_tokens=args.turn_tokens,
        tool_tokens=args.tool_tokens,
        tool_latency_s=args.tool_latency_ms / 1000,
        slow_latency_s=args.slow_latency_ms / 1000,
    )
    return args, work


def main(argv: list[str] | None = None) -> int:
    args, work = parse(argv)
    torch.set_num_threads(min(torch.get_num_threads(), 8))
    summary: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "argv": sys.argv[1:] if argv is None else argv,
    }
    summary["torch"] = torch.__version__
    if args.device.startswith("cuda"):
        summary["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    summary["workload"] = {key: getattr(work, key) for key in Workload.__dataclass_fields__}
    measure(args, work, summary)
    if args.device.startswith("cuda"):
        summary["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    report(summary)
    write(summary, args.json)
    return 0


def write(summary: dict[str, Any], path: str | None) -> None:
    """The summary as JSON on stdout, and in `path` when given."""
    text = json.dumps(summary, indent=1)
    print(text)
    if path:
        Path(path).write_text(text)


if __name__ == "__main__":
    raise SystemExit(main())
