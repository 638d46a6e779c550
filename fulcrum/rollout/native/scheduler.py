"""Continuous batching: which sequences run next, prefill or decode, and what happens to their tokens.

Each round is either a prefill step (new or preempted sequences, up to `max_num_batched_tokens`
prompt tokens, the last one possibly a chunk of a longer prompt) or a decode window of up to
`decode_steps` steps over every running sequence. Prefill goes first whenever a waiting sequence
fits (in seats and in blocks), so the decode batch stays as full as `max_num_seqs` allows.

A decode window reserves, before it starts, the blocks its sequences will write during it. When
the cache cannot hold them, the most recently admitted sequences are preempted: their blocks are
released and they go back to the front of the queue, to be recomputed from their tokens (vLLM's
"recompute" preemption). A finished sequence's surplus tokens of the window are dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from fulcrum.rollout.native.block_manager import BlockManager, blocks_for
from fulcrum.rollout.native.config import EngineConfig
from fulcrum.rollout.native.sequence import Sequence, Status


@dataclass
class PrefillWork:
    """Prefill `lengths[i]` tokens of `seqs[i]` from position `starts[i]`; `completes[i]`: last chunk."""

    seqs: list[Sequence]
    starts: list[int]
    lengths: list[int]
    completes: list[bool]


@dataclass
class DecodeWork:
    seqs: list[Sequence]
    steps: int


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.stop_ids: set[int] = set()
        # (source block, destination block) KV copies owed to forks; the runner does them first.
        self.pending_copies: list[tuple[int, int]] = []
        self.num_preemptions = 0
        self.peak_blocks = 0  # most blocks in use at once (the KV memory a generate really needed)

    def add(self, seq: Sequence) -> None:
        need = blocks_for(seq.num_tokens, self.blocks.block_size) + seq.num_samples - 1
        if need > self.blocks.num_usable:
            raise RuntimeError(
                f"the KV cache ({self.blocks.num_usable} blocks of {self.blocks.block_size} tokens) cannot hold a "
                f"prompt of {seq.num_tokens} tokens with n={seq.num_samples}: raise "
                "actor_rollout_ref.rollout.gpu_memory_utilization (or engine_kwargs.native.num_kv_blocks)"
            )
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------------------ scheduling
    def schedule(self) -> PrefillWork | DecodeWork:
        work = self._schedule()
        self.peak_blocks = max(self.peak_blocks, self.blocks.num_usable - self.blocks.num_free)
        return work

    def _schedule(self) -> PrefillWork | DecodeWork:
        prefill = self._schedule_prefill()
        if prefill is not None:
            return prefill
        if not self.running:
            raise RuntimeError(
                "the native engine is stuck: nothing is running and the next prompt does not fit in the KV cache"
            )
        return self._schedule_decode()

    def _schedule_prefill(self) -> PrefillWork | None:
        work = PrefillWork([], [], [], [])
        budget = self.config.max_num_batched_tokens
        seats = self.config.max_num_seqs - len(self.running)
        fork_reserve = 0  # blocks the step's forks take after it (held back from later prompts)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            remaining = seq.num_tokens - seq.num_computed
            chunk = min(remaining, budget)
            completes = chunk == remaining
            if completes and seq.num_samples > seats:
                break
            forks = 0
            if seq.num_tokens % self.blocks.block_size:
                forks = seq.num_samples - 1  # the forks' private copies of the partial last block
            # Start (or go on with) a prompt only if all of it fits now, so a chunked prefill does not
            # hold blocks it cannot complete.
            need = self.blocks.extra_blocks(seq, seq.num_tokens)
            if not self.blocks.can_allocate(need + forks + fork_reserve):
                break
            if completes:
                fork_reserve += forks
            self.blocks.grow(seq, seq.num_computed + chunk)
            work.seqs.append(seq)
            work.starts.append(seq.num_computed)
            work.lengths.append(chunk)
            work.completes.append(completes)
            budget -= chunk
            if not completes:
                break  # the rest of this prompt comes in the next prefill step
            seats -= seq.num_samples
            self.waiting.popleft()
        return work if work.seqs else None

    def _schedule_decode(self) -> DecodeWork:
        left = max(seq.max_tokens - seq.num_generated for seq in self.running)
        steps = max(1, min(self.config.decode_steps, left))
        if self._blocks_needed(steps) > self.blocks.num_free:
            steps = 1
        while self._blocks_needed(steps) > self.blocks.num_free:
            held = [seq for seq in self.waiting if seq.block_table]
            if held:  # a prompt part-way through a chunked prefill gives its blocks back first
                self.blocks.release(held[-1])
                held[-1].num_computed = 0
                continue
            self._preempt(self.running.pop())
            if not self.running:
                raise RuntimeError("the KV cache cannot hold a single decoding sequence: raise its size")
        for seq in self.running:
            self.blocks.grow(seq, seq.num_tokens + steps - 1)
        return DecodeWork(list(self.running), steps)

    def _blocks_needed(self, steps: int) -> int:
        return sum(self.blocks.extra_blocks(seq, seq.num_tokens + steps - 1) for seq in self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ------------------------------------------------------------------------------ results
    def after_prefill(self, work: PrefillWork, tokens: list[list[int]], logprobs: list[list[float]]) -> None:
        """`tokens[j]` / `logprobs[j]`: the num_samples first tokens of the j-th completed sequence."""
        done = 0
        for seq, length, completes in zip(work.seqs, work.lengths, work.completes, strict=True):
            seq.num_computed += length
            if not completes:
                continue
            family = [seq]
            for j in range(1, seq.num_samples):
                child = seq.fork(seq.output_index + j)
                copy = self.blocks.fork_blocks(seq, child)
                if copy is not None:
                    self.pending_copies.append(copy)
                family.append(child)
            seq.num_samples = 1
            for member, token, logprob in zip(family, tokens[done], logprobs[done], strict=True):
                member.status = Status.RUNNING
                self.running.append(member)
                self._append(member, token, logprob)
            done += 1
        self.running = [s for s in self.running if s.status is Status.RUNNING]

    def after_decode(self, work: DecodeWork, tokens: list[list[int]], logprobs: list[list[float]]) -> None:
        """`tokens[k][b]`: the token sampled at step k for `work.seqs[b]`."""
        for b, seq in enumerate(work.seqs):
            for k in range(work.steps):
                if seq.status is not Status.RUNNING:
                    break  # surplus tokens after a stop or max_tokens
                seq.num_computed = seq.num_tokens
                self._append(seq, tokens[k][b], logprobs[k][b])
        self.running = [s for s in self.running if s.status is Status.RUNNING]

    def _append(self, seq: Sequence, token: int, logprob: float) -> None:
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        if token in self.stop_ids:
            seq.finish_reason = "stop"
        elif seq.num_generated >= seq.max_tokens:
            seq.finish_reason = "length"
        else:
            return
        seq.status = Status.FINISHED
        self.blocks.release(seq)
        self.finished.append(seq)
