"""Continuous batching: which sequences run next, prefill or decode, and what happens to their tokens.

Each round is either a prefill step (new or preempted sequences, up to `max_num_batched_tokens`
prompt tokens, the last one possibly a chunk of a longer prompt) or a decode window of up to
`decode_steps` steps over every running sequence. Prefill goes first whenever a waiting sequence
fits (in seats and in blocks), so the decode batch stays as full as `max_num_seqs` allows.

A decode window reserves, before it starts, the blocks its sequences will write during it. When
the cache cannot hold them, the most recently admitted sequences are preempted: their blocks are
released and they go back to the front of the queue, to be recomputed from their tokens (vLLM's
"recompute" preemption). A finished sequence's surplus tokens of the window are dropped. A prompt (or
a preempted sequence) is admitted only into the blocks left once every running sequence, and every one
the same prefill step admitted before it, has room for its next `headroom_tokens` tokens (or the rest of
its max_tokens): admitted into the blocks a finished
sequence gave back, it would be the first preempted as the others grow, and recomputed again when the
next one finishes (partial rollouts over a full cache re-prefilled as many tokens as they sampled so:
`bench/tools/partial_schedule.py`).

A sequence that finishes with `keep` set is *held*: it keeps its blocks (and a hybrid model's
recurrent-state slot) so that a next turn (a tool's answer appended, then more sampling) prefills only
the new tokens. Held blocks are a cache, never a
reservation: when a prefill or a decode window needs blocks that are not free, the sequence held
longest gives its blocks back first (an *eviction*; its next turn recomputes its tokens), before any
running sequence is preempted. So conversations waiting on their tools can never starve the running
batch or deadlock the engine, and memory that is free is used to skip recomputation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fulcrum.rollout.base import FinishReason, SamplingParams
from fulcrum.rollout.native.block_manager import BlockManager, blocks_for
from fulcrum.rollout.native.config import EngineConfig
from fulcrum.rollout.native.sequence import Sequence, Status


@dataclass
class PrefillWork:
    """Prefill `lengths[i]` tokens of `seqs[i]` from position `starts[i]`; `completes[i]`: last chunk.
    `families`: each completed prompt with its forks, one list per prompt in order, and `state_copies`:
    the (prompt's state slot, fork's slot) pairs they are owed (hybrid models) (`commit_prefill`)."""

    seqs: list[Sequence]
    starts: list[int]
    lengths: list[int]
    completes: list[bool]
    families: list[list[Sequence]] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class DecodeWork:
    """`steps` decode steps over `seqs`. `rows`: launched right after another window (`schedule_ahead`),
    each sequence's row in that window, whose state on the device it continues, and `unread` that
    window's steps (tokens the device has sampled past what the host knows); None, 0: from the host."""

    seqs: list[Sequence]
    steps: int
    rows: list[int] | None = None
    unread: int = 0


Work = PrefillWork | DecodeWork


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager, context_budget: int | None = None) -> None:
        self.config = config
        self.blocks = blocks
        # Most tokens a prefill step reads back from the cache (memory.prefill_context_tokens); None: any.
        self.context_budget = context_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []
        # Finished sequences kept for a next turn, by id, oldest first (the eviction order).
        self.held: dict[int, Sequence] = {}
        self.num_preemptions = 0
        self.num_sampled = 0  # tokens appended to sequences (a window's surplus past a stop not counted)
        self.num_evictions = 0  # held sequences whose blocks were taken back under memory pressure
        self.peak_blocks = 0  # most blocks in use at once (the KV memory a generate really needed)

    def admit(self, num_tokens: int, params: SamplingParams) -> None:
        """Refuse a turn that can never run, before anything of it is queued (every prompt and next turn
        passes here once): no tokens, longer than max_model_len with its max_tokens, n above max_num_seqs,
        or more blocks than the whole cache (its prompt and a partial last block for each fork)."""
        if num_tokens == 0:
            raise ValueError("a prompt needs at least one token")
        if num_tokens + params.max_tokens > self.config.max_model_len:
            raise ValueError(
                f"{num_tokens} tokens with max_tokens={params.max_tokens} exceed "
                f"actor_rollout_ref.rollout.max_model_len={self.config.max_model_len}"
            )
        if params.n > self.config.max_num_seqs:
            raise ValueError(
                f"n={params.n} samples per prompt exceed actor_rollout_ref.rollout.max_num_seqs="
                f"{self.config.max_num_seqs}"
            )
        if blocks_for(num_tokens, self.blocks.block_size) + params.n - 1 > self.blocks.num_usable:
            raise RuntimeError(
                f"the KV cache ({self.blocks.num_usable} blocks of {self.blocks.block_size} tokens) cannot hold "
                f"a prompt of {num_tokens} tokens with n={params.n}: raise "
                "actor_rollout_ref.rollout.gpu_memory_utilization (or engine_kwargs.native.num_kv_blocks)"
            )

    def add(self, seq: Sequence) -> None:
        """Queue a new prompt (`admit` passed)."""
        self.waiting.append(seq)

    def resume(
        self, seq_id: int, tokens: list[int], max_tokens: int, stop_ids: frozenset[int], keep: bool
    ) -> None:
        """Queue the next turn of held sequence `seq_id` (`admit` passed): `tokens` appended, then up to
        `max_tokens` sampled."""
        seq = self.held.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"sequence {seq_id} is not held: it was released, not kept, or has not finished")
        seq.extend(tokens, max_tokens, stop_ids, keep)
        self.waiting.append(seq)

    def release(self, seq_id: int) -> None:
        """Forget held sequence `seq_id` and free its blocks (no-op when it is not held)."""
        seq = self.held.pop(seq_id, None)
        if seq is not None:
            self.blocks.release(seq)

    def drop_held_blocks(self) -> None:
        """Every held sequence gives its blocks back (the cache is about to be freed); they stay
        resumable and recompute their tokens on their next turn."""
        if self.has_work():
            raise RuntimeError("the native engine cannot free its KV cache while requests are in flight")
        for seq in self.held.values():
            self.blocks.release(seq)
            seq.num_computed = 0

    def abort(self) -> None:
        """Drop every queued and running sequence and free their blocks (held ones stay)."""
        for seq in [*self.waiting, *self.running]:
            self.blocks.release(seq)
        self.waiting.clear()
        self.running.clear()
        self.finished.clear()

    def suspend(self) -> tuple[list[Sequence], list[int]]:
        """Stop every queued and running turn where it stands, to be continued by `resume` (partial
        rollouts): a turn with sampled tokens is held as it is (finish reason "abort"), its blocks a
        cache as any held sequence's; a prompt with nothing sampled yet is dropped, blocks freed.
        Returns (the held turns, the ids of the dropped requests)."""
        held: list[Sequence] = []
        dropped: list[int] = []
        for seq in [*self.running, *self.waiting]:
            if seq.num_tokens == seq.num_prompt_tokens:
                self.blocks.release(seq)
                dropped.append(seq.output_index)
                continue
            seq.finish_reason = "abort"
            seq.status = Status.FINISHED
            seq.keep = True
            self.held[seq.output_index] = seq
            held.append(seq)
        self.waiting.clear()
        self.running.clear()
        return held, dropped

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def evict_held(self) -> bool:
        """Take back the blocks of the sequence held longest that still has some; False if none has.

        Its K/V are gone (num_computed = 0): its next turn is prefilled from its first token."""
        for seq in self.held.values():
            if seq.block_table:
                self.blocks.release(seq)
                seq.num_computed = 0
                self.num_evictions += 1
                return True
        return False

    # ------------------------------------------------------------------------------ scheduling
    def schedule(self) -> Work:
        work = self._schedule()
        self._note_peak()
        return work

    def _note_peak(self) -> None:
        self.peak_blocks = max(self.peak_blocks, self.blocks.num_usable - self.blocks.num_free)

    def _schedule(self) -> Work:
        prefill = self._schedule_prefill()
        # With nothing decoding, no block comes free by waiting: sequences queued behind with blocks
        # of their own (next turns over kept prefixes) give them back until the first one fits.
        while prefill is None and not self.running and self._release_parked():
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
        state_reserve = 0  # state slots they take (hybrid models)
        context = 0  # the step's keys: its sequences' cached and new tokens
        reads_cache = False  # whether attention reads every sequence's context back from the cache
        # Headroom blocks: the running sequences' (counted once a sequence with nothing cached asks; most
        # rounds none does) and those this step admits, which run beside them once it is read.
        running_growth: int | None = None
        admitted_growth = 0
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            remaining = seq.num_tokens - seq.num_computed
            chunk = min(remaining, budget)
            completes = chunk == remaining
            if completes and seq.num_samples > seats:
                break
            keys, reads = context + seq.num_computed + chunk, reads_cache or seq.num_computed > 0
            if self._over_context(work, keys, reads):
                break
            forks = 0
            if seq.num_tokens % self.blocks.block_size:
                forks = seq.num_samples - 1  # the forks' private copies of the partial last block
            # Start (or go on with) a prompt only if all of it fits now, so a chunked prefill does not
            # hold blocks it cannot complete.
            need = self.blocks.extra_blocks(seq, seq.num_tokens)
            states = self.blocks.states_needed(seq, seq.num_samples - 1 if completes else 0) + state_reserve
            # A sequence with K/V cached (a next turn over its kept prefix, a chunked prompt under way)
            # already holds most of its blocks: only one with nothing cached waits for the headroom.
            reserve = 0
            if seq.num_computed == 0:
                if running_growth is None:
                    running_growth = sum(self._headroom_blocks(s) for s in self.running)
                reserve = running_growth + admitted_growth
            while not self.blocks.fits(need + forks + fork_reserve + reserve, states) and self.evict_held():
                pass
            if not self.blocks.fits(need + forks + fork_reserve + reserve, states):
                break
            if completes:
                fork_reserve += forks
                state_reserve += seq.num_samples - 1 if self.blocks.has_states else 0
            self.blocks.grow(seq, seq.num_computed + chunk)
            if completes:  # each of its samples grows from its prompt's blocks
                admitted_growth += seq.num_samples * self._headroom_blocks(seq)
            work.seqs.append(seq)
            work.starts.append(seq.num_computed)
            work.lengths.append(chunk)
            work.completes.append(completes)
            budget -= chunk
            context, reads_cache = keys, reads
            if not completes:
                break  # the rest of this prompt comes in the next prefill step
            seats -= seq.num_samples
            self.waiting.popleft()
        return work if work.seqs else None

    def _over_context(self, work: PrefillWork, context: int, reads_cache: bool) -> bool:
        """Whether a prefill step with these keys would read back more than `context_budget` tokens (a
        step's first sequence always runs: its context fits the cache, so its copy is bounded)."""
        return (
            bool(work.seqs)
            and reads_cache
            and self.context_budget is not None
            and context > self.context_budget
        )

    def _schedule_decode(self) -> DecodeWork:
        left = max(seq.max_tokens - seq.num_generated for seq in self.running)
        steps = max(1, min(self.config.decode_steps, left))
        if self._blocks_needed(self.running, steps - 1) > self.blocks.num_free:
            steps = 1
            while self._blocks_needed(self.running, 0) > self.blocks.num_free:
                if self.evict_held():
                    continue
                # A waiting sequence with blocks (a prompt part-way through a chunked prefill, a next
                # turn over its kept prefix) gives them back before a running one is preempted.
                if self._release_parked():
                    continue
                self._preempt(self.running.pop())
                if not self.running:
                    raise RuntimeError("the KV cache cannot hold a single decoding sequence: raise its size")
        self._grow(self.running, steps - 1)
        return DecodeWork(list(self.running), steps)

    def _headroom_blocks(self, seq: Sequence) -> int:
        """Blocks `seq` lacks to grow by `headroom_tokens` (by what its max_tokens leaves, where that is
        less): summed over the running sequences and those admitted beside them, what a prompt's admission
        must leave free."""
        room = min(self.config.headroom_tokens, seq.max_tokens - seq.num_generated)
        return self.blocks.extra_blocks(seq, seq.num_tokens + room) if room > 0 else 0

    def _release_parked(self) -> bool:
        """The last waiting sequence that holds blocks gives them back (its tokens are recomputed)."""
        for seq in reversed(self.waiting):
            if seq.block_table:
                self.blocks.release(seq)
                seq.num_computed = 0
                return True
        return False

    def _blocks_needed(self, seqs: list[Sequence], ahead: int) -> int:
        """Blocks `seqs` lack to hold num_tokens + `ahead` tokens each (a window of `steps` steps needs
        ahead = steps - 1: it writes the K/V of the last known token and of all but its last sampled one)."""
        return sum(self.blocks.extra_blocks(seq, seq.num_tokens + ahead) for seq in seqs)

    def _grow(self, seqs: list[Sequence], ahead: int) -> None:
        """Give `seqs` the blocks `_blocks_needed(seqs, ahead)` counted."""
        for seq in seqs:
            self.blocks.grow(seq, seq.num_tokens + ahead)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ------------------------------------------------------------------------------ results
    def commit_prefill(self, work: PrefillWork) -> list[tuple[int, int]]:
        """What a launched prefill step changes before its first tokens are known: the chunks count as
        computed, and each completed prompt runs with its n - 1 forks (`work.families`), which share its
        full blocks and are owed a copy of its recurrent state (`work.state_copies`). The (source,
        destination) block copies of its partial last block that the forks are owed, to run on the
        device after the step's forward."""
        copies = []
        for seq, length, completes in zip(work.seqs, work.lengths, work.completes, strict=True):
            seq.num_computed += length
            if not completes:
                continue
            family = [seq]
            for j in range(1, seq.num_samples):
                child = seq.fork(seq.output_index + j)
                copy = self.blocks.fork_blocks(seq, child)
                if copy is not None:
                    copies.append(copy)
                if child.state_slot >= 0:
                    work.state_copies.append((seq.state_slot, child.state_slot))
                family.append(child)
            seq.num_samples = 1
            for member in family:
                member.status = Status.RUNNING
                self.running.append(member)
            work.families.append(family)
        return copies

    def postprocess(self, work: Work, tokens: list[list[int]], logprobs: list[list[float]]) -> None:
        """The sampled tokens of a launched round into its sequences. A prefill step: `tokens[j]` the first
        token of each member of `work.families[j]`. A decode window: `tokens[b]` the `work.steps` tokens
        of `work.seqs[b]`, in step order; rows of sequences no longer running (stopped in the window
        before: `schedule_ahead`) are skipped."""
        if isinstance(work, PrefillWork):
            for family, family_tokens, family_logprobs in zip(work.families, tokens, logprobs, strict=True):
                for member, token, logprob in zip(family, family_tokens, family_logprobs, strict=True):
                    self._take(member, [token], [logprob])
        else:
            for seq, seq_tokens, seq_logprobs in zip(work.seqs, tokens, logprobs, strict=True):
                if seq.status is Status.RUNNING:
                    self._take(seq, seq_tokens, seq_logprobs)
        self.running = [s for s in self.running if s.status is Status.RUNNING]

    def schedule_ahead(self, work: Work) -> Work | None:
        """The round after `work` (launched, its tokens not read yet), to launch before reading it; None
        when the next round needs those tokens (it is then scheduled after the read).

        After a prefill step, the next prefill step when a waiting prompt fits now: the sequences of the
        step in flight hold their seats and blocks as running ones do; one that its first token ends
        frees them only after the read, so this step may admit less than a step scheduled after the read
        would have (the same requests then share their steps otherwise).

        After a decode window, the next window: its rows are those of `work` whose sequences still run as the host knows them (a window
        behind) and do not reach max_tokens within `work`; their blocks cover both windows. A row whose
        sequence stops in `work` decodes for nothing in it (`postprocess` skips it): at most one
        window past its end (`EngineConfig.windows_in_flight`). None when the next round may be something
        else: a sequence waits for its prefill, no row goes on past `work`, or the free blocks do not
        cover both windows (no preemption or eviction here)."""
        if isinstance(work, PrefillWork):
            if not self.waiting:
                return None
            ahead = self._schedule_prefill()
            self._note_peak()
            return ahead
        if self.waiting:
            return None
        rows = [
            row
            for row, seq in enumerate(work.seqs)
            if seq.status is Status.RUNNING and seq.max_tokens - seq.num_generated > work.steps
        ]
        if not rows:
            return None
        seqs = [work.seqs[row] for row in rows]
        steps = min(self.config.decode_steps, max(s.max_tokens - s.num_generated for s in seqs) - work.steps)
        ahead = work.steps + steps - 1  # both windows, past the tokens the host knows
        if self._blocks_needed(seqs, ahead) > self.blocks.num_free:
            return None
        self._grow(seqs, ahead)
        self._note_peak()
        return DecodeWork(seqs, steps, rows, work.steps)

    def _take(self, seq: Sequence, tokens: list[int], logprobs: list[float]) -> None:
        """Append a running sequence's sampled `tokens` up to the first that ends its turn (a stop id,
        or its max_tokens-th token); the window's surplus tokens after it are dropped.

        One slice per sequence, not one call per token: this runs between two decode windows, while
        the device waits for the next one."""
        room = max(1, seq.max_tokens - seq.num_generated)  # the running sequence takes one at least
        taken = tokens[:room]
        reason: FinishReason | None = "length" if len(taken) == room else None
        if not seq.stop_ids.isdisjoint(taken):
            end = next(k for k, token in enumerate(taken) if token in seq.stop_ids) + 1
            taken, reason = taken[:end], "stop"
        seq.token_ids += taken
        seq.logprobs += logprobs[: len(taken)]
        self.num_sampled += len(taken)
        seq.num_computed = seq.num_tokens - 1  # the last token's K/V are written by the next step
        if reason is None:
            return
        seq.finish_reason = reason
        seq.status = Status.FINISHED
        if seq.keep:
            self.held[seq.output_index] = seq
        else:
            self.blocks.release(seq)
        self.finished.append(seq)
