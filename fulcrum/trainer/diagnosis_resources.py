"""The diagnosis rules about where a step's time and memory go: which phase bounds the step, memory that
grows every step, a host whose CPUs are saturated, a long tail the decode spends at a small batch, what
partial rollouts cost by themselves, a prefill that takes a share of the step. Pure functions over metrics
rows (`fulcrum.trainer.metric_rows`); `fulcrum.trainer.diagnosis` runs them with the rules about learning.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Sequence

from fulcrum.config.finding import Finding
from fulcrum.trainer.metric_rows import Row, as_float, finite_series, step_of, training_rows

# Step phases (timing_s/<phase>) and the lever for each when it bounds the step.
PHASE_LEVERS: dict[str, str] = {
    "gen": "actor_rollout_ref.rollout.name=native, a larger rollout.max_num_seqs, rollout.gpu_memory_utilization "
    "(more KV cache, fewer preemptions), or a shorter data.max_response_length",
    "gen_max": "ReMax's greedy baseline generation: as for gen",
    "reward": "a faster custom reward function (it runs on the CPU, one response at a time)",
    "old_log_prob": "a larger rollout.log_prob_micro_batch_size_per_gpu, or use_dynamic_bsz=True",
    "ref": "a larger ref.log_prob_micro_batch_size_per_gpu, or use_dynamic_bsz=True",
    "values": "a larger critic.forward_micro_batch_size_per_gpu, or critic.use_dynamic_bsz=True",
    "adv": "advantage estimation should be cheap; report it as a bug",
    "update_critic": "a larger critic.ppo_micro_batch_size_per_gpu, critic.use_dynamic_bsz=True, or "
    "critic.model.enable_gradient_checkpointing=False if memory allows (`fulcrum tune` measures them)",
    "update_actor": "a larger actor.ppo_micro_batch_size_per_gpu, actor.use_dynamic_bsz=True, or "
    "model.enable_gradient_checkpointing=False if memory allows (`fulcrum tune` measures them)",
    "update_weights": "weight sync to the engine should be milliseconds; report it as a bug",
    "testing": "a larger trainer.test_freq (validation runs inside the step that does it)",
    "save_checkpoint": "a larger trainer.save_freq (the step waits for the host copy of the state, and for "
    "the previous checkpoint's write when it is still running; with trainer.save_in_background=False, for all of it)",
}
MEMORY_KEYS = ("perf/max_memory_reserved_gb", "perf/max_memory_allocated_gb", "perf/cpu_memory_peak_rss_gb")
MEMORY_MIN_STEPS = 6  # warm steps needed before calling memory growth a creep
# Runnable tasks per CPU (perf/cpu_load, median of HOST_LOAD_STEPS steps) at which the host is saturated.
# The trainer itself keeps a few threads busy (its main thread, one torch CPU thread on CUDA, fulcrum.config.device),
# well under one task per CPU; at one or more, the passes that launch kernels from the host wait for a core.
HOST_LOAD_LIMIT = 1.0
HOST_LOAD_STEPS = 3
# The phases that launch their kernels one by one from the host (generation replays CUDA graphs).
HOST_BOUND_PHASES = ("old_log_prob", "ref", "values", "update_critic", "update_actor", "reward")
# The decode's memory floor over its time (rollout/decode_roofline_share) that the engine's kernels reach
# at long contexts with full batches (0.70-0.77 of an H100's roofline, BENCHMARKS.md "Long contexts").
DECODE_REACHABLE_SHARE = 0.7
# Synchronous steps whose decode runs at this share of its floor or less have a tail to take back: at
# Qwen2.5-0.5B's shape the decode read 0.46 and partial rollouts that keep their K/V gave 1.27x the trained
# tokens a second; at Qwen3-0.6B's it holds ~0.7 at long contexts (a bulk bound by its K/V reads) and partial
# rollouts gave 0.83x (BENCHMARKS.md).
DECODE_TAIL_SHARE = 0.55
TAIL_STEPS = 3  # warm steps the long-tail rule reads (medians)
# Under partial rollouts: the share of a step their own costs (the held samples prefilled again, the
# decoupled loss's old-log-prob pass) may take before the rule names the keys that remove them; at
# Qwen2.5-0.5B's shape they took 18-20 % and partial rollouts broke even (BENCHMARKS.md).
PARTIAL_COST_SHARE = 0.1
PARTIAL_PART_SHARE = 0.03  # a part below this share of the step is not worth its key
# Synchronous steps whose engine prefill (rollout/prefill_s) takes this share of the step: long prompts, or
# turns of tool output. FlashAttention-4's prefill ran the 8k prefill 1.27-1.43x flash's (H100, BENCHMARKS.md
# "Long contexts"), so at this share it takes back 3-5 % of the step.
PREFILL_STEP_SHARE = 0.15
# Tokens the engine prefilled over those it sampled, with preemptions, at which the sequences in flight are
# outgrowing the KV cache and being recomputed: partial rollouts with two batches over a 434k-token cache
# prefilled 1.02 M tokens for 0.92 M sampled (BENCHMARKS.md, "Qwen3-0.6B's shape at the least cost"); a
# step's own prompts are a few percent of its samples at GRPO's n.
RECOMPUTE_SHARE = 0.25
# ... and preemptions at least this share of the step's sequences, so that tool outputs prefilled into
# multi-turn conversations, beside a few preemptions, are not taken for recomputation.
PREEMPTED_SHARE = 0.05


def phase_shares(rows: Sequence[Row]) -> dict[str, float]:
    """Share of step time per phase: Σ timing_s/<phase> ÷ Σ timing_s/step over the warm training steps
    (the first step, which compiles and allocates, is left out when there are others)."""
    train = training_rows(rows)
    warm = train[1:] if len(train) > 1 else train
    total = sum(as_float(r["timing_s/step"]) or 0.0 for r in warm)
    if total <= 0:
        return {}
    shares = {}
    for phase in PHASE_LEVERS:
        spent = sum(v for r in warm if (v := as_float(r.get(f"timing_s/{phase}"))) is not None and v == v)
        if spent > 0:
            shares[phase] = spent / total
    return dict(sorted(shares.items(), key=lambda kv: -kv[1]))


def bottleneck(rows: Sequence[Row]) -> list[Finding]:
    """The phase with the largest share of the warm steps' time, and the lever that shortens it."""
    shares = phase_shares(rows)
    if not shares:
        return []
    phase, share = next(iter(shares.items()))
    train = training_rows(rows)
    first = step_of(train[1] if len(train) > 1 else train[0], 1)
    others = ", ".join(f"{p} {s:.0%}" for p, s in list(shares.items())[1:4])
    return [
        Finding(
            (),
            f"the bottleneck is {phase}: {share:.0%} of step time" + (f" (then {others})" if others else ""),
            "info",
            fix=PHASE_LEVERS[phase],
            rule="bottleneck",
            step=first,
        )
    ]


def memory_creep(rows: Sequence[Row]) -> list[Finding]:
    """Peak memory still rising after warm-up: past the first 2 steps, at least MEMORY_MIN_STEPS steps, a
    rise in >= 75% of step pairs, and a total rise above max(5%, 0.25 GiB). Steps that captured training
    CUDA graphs (`perf/graph_captures` > 0) are left out: each capture adds to the graphs' pool by design,
    up to a bounded number of graphs, and real responses of varying length keep capturing for tens of steps."""
    train = [r for r in training_rows(rows) if not _captured_graphs(r)]
    for key in MEMORY_KEYS:
        points = [(s, v) for s, v in finite_series(train, key) if v > 0][2:]
        if len(points) < MEMORY_MIN_STEPS:
            continue
        rises = sum(1 for (_, a), (_, b) in itertools.pairwise(points) if b > a)
        growth = points[-1][1] - points[0][1]
        if rises >= 0.75 * (len(points) - 1) and growth > max(0.05 * points[0][1], 0.25):
            return [
                Finding(
                    (),
                    f"{key} rose in {rises} of {len(points) - 1} warm steps, {points[0][1]:.2f} -> "
                    f"{points[-1][1]:.2f} GiB: something grows every step",
                    "warning",
                    fix="look for tensors kept across steps (metrics holding graphs, growing caches); for "
                    "fragmentation, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                    rule="memory_creep",
                    step=points[-1][0],
                )
            ]
    return []


def _captured_graphs(row: Row) -> bool:
    captures = row.get("perf/graph_captures")
    return isinstance(captures, (int, float)) and captures > 0


def host_loaded(rows: Sequence[Row]) -> list[Finding]:
    """The host's CPUs saturated (perf/cpu_load, median of the last HOST_LOAD_STEPS training steps, at or
    above HOST_LOAD_LIMIT) while the step's time goes mostly to phases the host drives.

    Not for a run whose training micro-batches replay as CUDA graphs (it logs perf/graph_captures): a graph
    replay launches its kernels without the host, so freeing the CPUs would buy nothing."""
    points = finite_series(rows, "perf/cpu_load")
    if len(points) < HOST_LOAD_STEPS or any("perf/graph_captures" in row for row in rows):
        return []
    load = statistics.median(v for _, v in points[-HOST_LOAD_STEPS:])
    shares = phase_shares(rows)
    host_share = sum(shares.get(phase, 0.0) for phase in HOST_BOUND_PHASES)
    if load < HOST_LOAD_LIMIT or host_share < 0.5:
        return []
    return [
        Finding(
            (),
            f"the host's CPUs are saturated: {load:.2f} runnable tasks per CPU (perf/cpu_load, median of the "
            f"last {HOST_LOAD_STEPS} steps) while {host_share:.0%} of the step is spent in phases whose kernels "
            "the CPU launches one by one, so each waits its turn for a core",
            "warning",
            fix="free the host's CPUs (other jobs, data loading, a reward server on this machine), or give each "
            "launch more work: larger micro-batch sizes or use_dynamic_bsz=True (`fulcrum tune` measures them)",
            rule="host_loaded",
            step=points[-1][0],
        )
    ]


def is_partial_step(row: Row) -> bool:
    """A step under partial rollouts: it logs the share of its trained tokens carried from earlier steps."""
    return "training/off_policy/carried_token_share" in row


def recent_steps(rows: Sequence[Row], keep: Callable[[Row], bool]) -> tuple[list[Row], list[Row]]:
    """(the training rows after the first, the last TAIL_STEPS of them that `keep` accepts); the second is
    empty when fewer than TAIL_STEPS are: the tail rules read medians of that many warm steps."""
    train = training_rows(rows)[1:]
    recent = [r for r in train if keep(r)][-TAIL_STEPS:]
    return train, recent if len(recent) == TAIL_STEPS else []


def logs(key: str) -> Callable[[Row], bool]:
    """A step that logs `key` (a number)."""
    return lambda row: as_float(row.get(key)) is not None


def medians(recent: list[Row], *keys: str) -> list[float]:
    """Each key's median over `recent` (a step that does not log it counts 0)."""
    return [statistics.median(as_float(r.get(key)) or 0.0 for r in recent) for key in keys]


def tail_finding(rule: str, message: str, fix: str, train: list[Row], recent: list[Row]) -> list[Finding]:
    """One info finding of a tail rule, at the last of its `recent` steps."""
    return [Finding((), message, "info", fix=fix, rule=rule, step=step_of(recent[-1], len(train)))]


def long_tail(rows: Sequence[Row]) -> list[Finding]:
    """Whether carrying the tail over (partial rollouts) can shorten synchronous steps, from the decode's
    memory roofline (`rollout/decode_roofline_share`, logged on a card of known bandwidth), medians of the
    last TAIL_STEPS steps after the first: generation at least half the step, the longest response at least
    twice the mean, and the decode at most DECODE_TAIL_SHARE of its floor: much of its time is steps that
    read little (the tail at a few sequences), and partial rollouts can take back up to
    1 - share / DECODE_REACHABLE_SHARE of it. Silent under partial rollouts
    (`training/off_policy/carried_token_share` logged): their decode's share is what they made of the tail,
    and says nothing of what a synchronous step would take (0.52-0.61 in a run 1.27x faster than its
    synchronous steps; `partial_rollout_costs` reads what they add)."""
    train, recent = recent_steps(rows, logs("rollout/decode_roofline_share"))
    if not recent or any(map(is_partial_step, recent)):
        return []
    share = statistics.median(as_float(r["rollout/decode_roofline_share"]) or 0.0 for r in recent)
    gen = statistics.median(
        (as_float(r.get("timing_s/gen")) or 0.0) / (as_float(r["timing_s/step"]) or 1.0) for r in recent
    )
    spread = statistics.median(
        (as_float(r.get("response_length/max")) or 0.0)
        / max(as_float(r.get("response_length/mean")) or 0.0, 1.0)
        for r in recent
    )
    if gen < 0.5 or spread < 2.0 or share > DECODE_TAIL_SHARE:
        return []
    return tail_finding(
        "long_tail",
        f"generation is {gen:.0%} of the step and its decode runs at {share:.0%} of its memory floor "
        f"(rollout/decode_roofline_share) while the longest response is {spread:.1f}x the mean: the tail "
        "decodes a few sequences at a time; carrying it over to the next step could take back up to "
        f"{1 - share / DECODE_REACHABLE_SHARE:.0%} of the generation",
        "partial rollouts: trainer.use_v1=True trainer.v1.trainer_mode=colocate_async, keeping the held "
        "samples' K/V through training (actor_rollout_ref.rollout.free_cache_engine=False, where doctor's "
        "estimate fits the cache) and taking the engine's log-probs as the old ones "
        "(algorithm.rollout_correction.bypass_mode=True; rollout_is=token for the decoupled loss costs an "
        'old-log-prob pass) (docs/levers.md, "Long responses")',
        train,
        recent,
    )


def partial_rollout_costs(rows: Sequence[Row]) -> list[Finding]:
    """Under partial rollouts (`training/off_policy/carried_token_share` logged), what they cost a step by
    themselves, medians of the last TAIL_STEPS steps after the first: the engine's prefill
    (`rollout/prefill_s`: with `rollout.free_cache_engine` the held samples lose their K/V to training and
    are prefilled again; new prompts are a small part of it) and the old-log-prob pass the decoupled loss
    needs (`timing_s/old_log_prob`). At PARTIAL_COST_SHARE of the step or more, the keys that remove each
    part of at least PARTIAL_PART_SHARE."""
    train, recent = recent_steps(rows, is_partial_step)
    if not recent:
        return []

    step_s, prefill_s, old_s, tokens = medians(
        recent, "timing_s/step", "rollout/prefill_s", "timing_s/old_log_prob", "rollout/prefill_tokens"
    )
    if step_s <= 0 or (prefill_s + old_s) / step_s < PARTIAL_COST_SHARE:
        return []
    parts, fixes = [], []
    if prefill_s / step_s >= PARTIAL_PART_SHARE:
        parts.append(f"the engine's prefill {prefill_s:.1f} s ({tokens:,.0f} tokens)")
        fixes.append(
            "actor_rollout_ref.rollout.free_cache_engine=False keeps the held samples' K/V through training, "
            "where doctor's estimate fits the cache beside the training passes"
        )
    if old_s / step_s >= PARTIAL_PART_SHARE:
        parts.append(f"the old-log-prob pass {old_s:.1f} s")
        fixes.append(
            "algorithm.rollout_correction.bypass_mode=True drops the pass (the ratio is then taken against the "
            "rollout's own log-probs, clipped)"
        )
    return tail_finding(
        "partial_rollout_costs",
        f"partial rollouts spend {(prefill_s + old_s) / step_s:.0%} of the step ({step_s:.1f} s) on their own "
        f"costs: {' and '.join(parts)}",
        "; ".join(fixes)
        + ' (bench/long_tail.py --modes partial-kept measures both; docs/levers.md, "Long responses")',
        train,
        recent,
    )


def long_prefill(rows: Sequence[Row]) -> list[Finding]:
    """Synchronous steps (partial rollouts' own prefill is `partial_rollout_costs`') whose engine prefill
    (`rollout/prefill_s`, the native engine's) is PREFILL_STEP_SHARE of the step or more, medians of the last
    TAIL_STEPS steps after the first: the prefill attention kernels that run long prompts faster."""
    train, recent = recent_steps(rows, logs("rollout/prefill_s"))
    if not recent or any(map(is_partial_step, recent)):
        return []
    step_s, prefill_s, tokens = medians(
        recent, "timing_s/step", "rollout/prefill_s", "rollout/prefill_tokens"
    )
    if step_s <= 0 or prefill_s / step_s < PREFILL_STEP_SHARE:
        return []
    return tail_finding(
        "long_prefill",
        f"the engine's prefill takes {prefill_s / step_s:.0%} of the step ({prefill_s:.1f} s of {step_s:.1f} s "
        f"for {tokens:,.0f} tokens, {tokens / max(prefill_s, 1e-9):,.0f} a second): long prompts or tool turns",
        "where the run keeps the default prefill kernel (flash): "
        "+actor_rollout_ref.rollout.engine_kwargs.native.prefill_attention=fa4 (pip install 'fulcrum[fa4]', "
        "a Hopper or Blackwell card: an 8k prefill 1.27-1.43x flash's on an H100) or =cudnn (steps of fresh "
        "prompts: 1.18-1.34x); else a shorter data.max_prompt_length "
        '(bench/long_context.py times each kernel; docs/levers.md, "Long responses")',
        train,
        recent,
    )


def kv_recompute(rows: Sequence[Row]) -> list[Finding]:
    """The native engine preempting and recomputing, medians of the last TAIL_STEPS steps after the first:
    `rollout/prefill_tokens` RECOMPUTE_SHARE of `rollout/generated_tokens` or more, and `rollout/preemptions`
    PREEMPTED_SHARE or more of the step's sequences (generated tokens over `response_length/mean`): the
    sequences in flight outgrow the KV cache, and what it preempts is prefilled again."""
    train, recent = recent_steps(rows, logs("rollout/preemptions"))
    if not recent:
        return []

    preemptions, prefilled, sampled, length = medians(
        recent,
        "rollout/preemptions",
        "rollout/prefill_tokens",
        "rollout/generated_tokens",
        "response_length/mean",
    )
    if length <= 0 or sampled <= 0 or prefilled / sampled < RECOMPUTE_SHARE:
        return []
    if preemptions < PREEMPTED_SHARE * sampled / length:
        return []
    return tail_finding(
        "kv_recompute",
        f"the engine preempts {preemptions:,.0f} sequences a step and prefills {prefilled:,.0f} tokens, "
        f"{prefilled / sampled:.0%} of the {sampled:,.0f} it samples: the sequences in flight outgrow the KV "
        "cache, and the preempted ones are computed again",
        "fewer sequences in flight or more cache: a lower actor_rollout_ref.rollout.max_num_seqs, under "
        "partial rollouts fewer trainer.v1.colocate_async.num_warmup_batches, or a larger "
        "rollout.gpu_memory_utilization (fulcrum doctor says what fits); "
        "+actor_rollout_ref.rollout.engine_kwargs.native.headroom_tokens (256) keeps room for the running "
        'sequences before more are admitted (docs/rollout.md, "Preemption")',
        train,
        recent,
    )
