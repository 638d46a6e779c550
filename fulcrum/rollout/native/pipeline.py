"""The engine's rounds: schedule -> run -> postprocess, with the next round launched before this one is read.

Without `overlap_windows` a step schedules a round (a prefill step or a decode window), launches it and
reads its tokens into the scheduler, as nano-vllm's `LLMEngine.step` does. With it, the device need not
idle while the host reads: after launching a round, the step launches the one after it when the
scheduler can tell it without those tokens (`Scheduler.schedule_ahead`), then reads the first; the next
step reads the round launched ahead. So at most `EngineConfig.windows_in_flight` rounds are on the
device, each decode window in its own output buffer (`slot`), and a sequence may run one window past
its end (the KV slots `EngineConfig.max_tokens_per_seq` leaves for it).

The tokens do not depend on the overlap: every round samples from the one sampler in launch order, and
a round launched ahead is the one the scheduler would have chosen after the read.
"""

from __future__ import annotations

import time

from fulcrum.rollout.native.config import EngineConfig
from fulcrum.rollout.native.launcher import Launched, Launcher
from fulcrum.rollout.native.sampler import DeviceSampler
from fulcrum.rollout.native.scheduler import DecodeWork, PrefillWork, Scheduler, Work

COUNTERS = ("prefill_s", "decode_s", "prefill_steps", "prefill_tokens", "decode_steps", "kv_token_reads")


def window_kv_token_reads(contexts: list[int], steps: int) -> int:
    """Tokens whose K/V a decode window's attention reads: a sequence of c tokens when the window starts
    feeds its last token at step 1 (writing that token's K/V) and attends over all c; step j (1..steps)
    over c + j - 1; so Σ_seqs (steps · c + steps(steps-1)/2)."""
    return steps * sum(contexts) + len(contexts) * steps * (steps - 1) // 2


def decode_floor_s(
    responses: int, prompt_len: int, response_len: int, weight_bytes: float, kv_bytes: float, bandwidth: float
) -> float:
    """The memory floor of decoding `responses` sequences of `response_len` tokens after `prompt_len` each
    (seconds): the first token comes from the prefill, then R - 1 decode steps, each reading the weights
    once and the K/V of every context: ((R-1) · W + window_kv_token_reads([P+1] x responses, R-1) · kv)
    / bandwidth, whatever the batching."""
    steps = max(response_len - 1, 0)
    reads = window_kv_token_reads([prompt_len + 1] * responses, steps)
    return (steps * weight_bytes + reads * kv_bytes) / bandwidth


# The engine's running totals (`NativeEngine.counters`) whose differences over a call are its figures.
ENGINE_FIGURES = (*COUNTERS, "decode_floor_s", "generated_tokens", "preemptions", "evictions")


def figures_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The engine's work between two readings of its counters (`ENGINE_FIGURES` that both have), with the
    decode's roofline share (`with_roofline_share`)."""
    return with_roofline_share(
        {key: float(after[key] - before[key]) for key in ENGINE_FIGURES if key in after and key in before}
    )


def with_roofline_share(figures: dict[str, float]) -> dict[str, float]:
    """The engine's `figures` and, where they have a memory floor (`decode_floor_s`, a known card),
    `decode_roofline_share`: that floor over the decode's seconds (1.0 would be the card's bandwidth)."""
    floor, seconds = figures.get("decode_floor_s"), figures.get("decode_s")
    if not floor or not seconds:
        return figures
    return {**figures, "decode_roofline_share": floor / seconds}


class Pipeline:
    """Rounds of one scheduler through one launcher; `ahead`: the round launched and not read yet."""

    def __init__(self, scheduler: Scheduler, launcher: Launcher, config: EngineConfig) -> None:
        self.scheduler = scheduler
        self.launcher = launcher
        self.depth = config.windows_in_flight
        self.ahead: Launched | None = None
        self.slot = 0  # the output buffer of the next decode window
        # Running totals since the engine was built; `generate` reports its own share as differences.
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0)

    def step(self, sampler: DeviceSampler) -> None:
        """One round: the one launched ahead, else a new one (schedule, run); the next one launched
        ahead where it can be; this one's tokens into the scheduler (postprocess)."""
        if self.ahead is not None:
            current, self.ahead, tick = self.ahead, None, time.perf_counter()
        elif self.scheduler.has_work():
            work = self.scheduler.schedule()
            tick = time.perf_counter()
            current = self._run(work, sampler)
        else:
            return
        if self.depth > 1 and (work := self.scheduler.schedule_ahead(current.work)) is not None:
            self.ahead = self._run(work, sampler)
        self._postprocess(current, tick)

    def _run(self, work: Work, sampler: DeviceSampler) -> Launched:
        launched = self.launcher.run(work, sampler, self.slot)
        if isinstance(work, DecodeWork):  # the host's lengths lag the device by the unread steps
            contexts = [seq.num_tokens + work.unread for seq in work.seqs]
            self.counters["kv_token_reads"] += window_kv_token_reads(contexts, work.steps)
        if isinstance(work, PrefillWork):
            # Its prompts run (with their forks) from now on, so the round after it can be scheduled
            # before its first tokens are read; the forks' copies queue behind its forward.
            self.launcher.runner.copy_blocks(self.scheduler.commit_prefill(work))
            self.launcher.runner.copy_states(work.state_copies)
        else:
            self.slot = (self.slot + 1) % self.depth
        return launched

    def _postprocess(self, launched: Launched, tick: float) -> None:
        """The round's tokens into the scheduler; its seconds since `tick`, steps and tokens counted."""
        work, counters = launched.work, self.counters
        self.scheduler.postprocess(work, *launched.read())
        seconds = time.perf_counter() - tick
        if isinstance(work, DecodeWork):
            counters["decode_s"] += seconds
            counters["decode_steps"] += work.steps
        else:
            counters["prefill_s"] += seconds
            counters["prefill_steps"] += 1
            counters["prefill_tokens"] += sum(work.lengths)

    def drain(self) -> None:
        """Read the round launched ahead into the scheduler, launching none after it: the turns it
        finishes come out of the next step."""
        if self.ahead is not None:
            launched, self.ahead = self.ahead, None
            self._postprocess(launched, time.perf_counter())

    def drop(self) -> None:
        """Wait for the round launched ahead and forget its tokens (its sequences are being dropped)."""
        if self.ahead is not None:
            self.ahead.read()
            self.ahead = None
