"""Launches a scheduled round on the device: its inputs, the forward, the sampling of its tokens and their
copy to the host, without waiting for the device (`Launched.read` waits).

A prefill step runs eagerly. A decode window runs `steps` decode steps back to back
(`ModelRunner.decode_logits`: CUDA graphs where captured): each step feeds the previous step's sampled
tokens, advances positions and context lengths in place, and never waits for the host; the host reads
all the window's tokens once at its end. The blocks the window writes were reserved by the scheduler
beforehand, so the slot of each new token is computed on the device from the block table.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from fulcrum.batch import host_to_device
from fulcrum.rollout.native import ops
from fulcrum.rollout.native.attention import AttentionMetadata
from fulcrum.rollout.native.config import EngineConfig
from fulcrum.rollout.native.model_runner import ModelRunner
from fulcrum.rollout.native.models.linear_attention import turn_ended
from fulcrum.rollout.native.sample_kernels import DecodeState
from fulcrum.rollout.native.sampler import DeviceSampler
from fulcrum.rollout.native.scheduler import DecodeWork, PrefillWork, Work
from fulcrum.rollout.native.sequence import Sequence


@dataclass
class HostCopy:
    """Sampled tokens and their log-probs on their way to the host: the host tensors they are copied
    into and the event that marks the copy done (None on the CPU, where it ran already)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    done: torch.cuda.Event | None

    @classmethod
    def start(
        cls,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        host_tokens: torch.Tensor,
        host_logprobs: torch.Tensor,
    ) -> HostCopy:
        """Queue the copy of device `tokens` / `logprobs` into the (pinned, contiguous) host tensors: it
        stays asynchronous, so the host goes on launching while the device runs."""
        host_tokens.copy_(tokens, non_blocking=True)
        host_logprobs.copy_(logprobs, non_blocking=True)
        done = torch.cuda.Event() if tokens.is_cuda else None
        if done is not None:
            done.record()
        return cls(host_tokens, host_logprobs, done)

    def read(self) -> tuple[list, list]:
        """The copied tokens and log-probs as lists, once the copy is done."""
        if self.done is not None:
            self.done.synchronize()
        return self.tokens.tolist(), self.logprobs.tolist()


def padded_tables(tables: list[list[int]], rows: int, width: int) -> torch.Tensor:
    """Block tables as one (rows, width) int32 host tensor, zero-padded (block 0 is scratch).

    This runs before every decode window, while the device may wait for it, so it is built with numpy
    from one flat iterator, without a Python object per entry or a torch call per row."""
    lengths = np.zeros(rows, dtype=np.int64)
    lengths[: len(tables)] = np.fromiter((len(table) for table in tables), dtype=np.int64, count=len(tables))
    out = np.zeros((rows, width), dtype=np.int32)
    flat = itertools.chain.from_iterable(tables)
    out[np.arange(width) < lengths[:, None]] = np.fromiter(flat, dtype=np.int32, count=int(lengths.sum()))
    return torch.from_numpy(out)


def packed_positions(
    starts: list[int], lengths: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Sequences packed one after another, `lengths[i]` tokens of sequence i from position `starts[i]`:
    each token's sequence index (N,) and position (N,) on `device`, and the offsets [0, l0, ..., N].

    A few ops on the device whatever the number of sequences, and only per-sequence lists copied to
    it: a prefill step of next turns has hundreds of sequences, each a few new tokens over a long
    cached context whose slots are indexed too."""
    offsets = [0, *itertools.accumulate(lengths)]
    shift = host_to_device(torch.tensor([s - o for s, o in zip(starts, offsets, strict=False)]), device)
    counts = host_to_device(torch.tensor(lengths), device)
    index = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), counts, output_size=offsets[-1]
    )
    return index, torch.arange(offsets[-1], device=device) + shift[index], offsets


@dataclass
class Launched:
    """A round on the device: its work, and its sampled tokens on their way to the host (`copy`; None
    for a prefill step that completes no prompt, only a chunk of a longer one). `counts`: a prefill
    step's first tokens per completed prompt (its n); None for a decode window (`steps` tokens a row)."""

    work: Work
    copy: HostCopy | None
    counts: list[int] | None = None

    def read(self) -> tuple[list[list[int]], list[list[float]]]:
        """The round's tokens and log-probs once on the host: a prefill step's one list per completed
        prompt, a decode window's one list per row (`Scheduler.postprocess` takes either)."""
        if self.copy is None:
            return [], []
        tokens, logprobs = self.copy.read()
        if self.counts is None:
            return tokens, logprobs
        offsets = [0, *itertools.accumulate(self.counts)]
        return (
            [tokens[a:b] for a, b in itertools.pairwise(offsets)],
            [logprobs[a:b] for a, b in itertools.pairwise(offsets)],
        )


class Launcher:
    """Launches prefill steps and decode windows over the model and the `ModelRunner`'s cache and graphs."""

    def __init__(self, runner: ModelRunner, config: EngineConfig) -> None:
        self.model = runner.model
        self.runner = runner
        self.config = config
        self.device = runner.device
        max_bs = config.max_num_seqs
        # One output buffer per window in flight: the next window writes one while the host reads the
        # other (from pinned host copies on CUDA, so that reading one does not wait for the next).
        # Rows a multiple of 4 entries wide: every step's row starts 16-byte aligned, so the sampler that
        # writes into it compiles one variant whatever the step (Triton specialises on pointer alignment).
        slots, width = config.windows_in_flight, -(-max_bs // 4) * 4
        self.out_tokens = torch.zeros(slots, config.decode_steps, width, dtype=torch.long, device=self.device)
        self.out_logprobs = torch.zeros(
            slots, config.decode_steps, width, dtype=torch.float32, device=self.device
        )
        pinned = self.device.type == "cuda"
        size = max_bs * config.decode_steps
        self.host_tokens = torch.zeros(slots, size, dtype=torch.long, pin_memory=pinned)
        self.host_logprobs = torch.zeros(slots, size, dtype=torch.float32, pin_memory=pinned)

    def run(self, work: Work, sampler: DeviceSampler, slot: int) -> Launched:
        """Launch `work`; a decode window writes its tokens into output buffer `slot`."""
        if isinstance(work, PrefillWork):
            return self.launch_prefill(work, sampler)
        return self.launch_decode(work, sampler, slot)

    # ------------------------------------------------------------------------------ prefill
    def launch_prefill(self, work: PrefillWork, sampler: DeviceSampler) -> Launched:
        """Queue the prefill of `work` and the first token of each of the n samples of every prompt it
        completes, with the copy of those tokens to the host.

        Every host tensor goes over asynchronously (`host_to_device`: a plain `.to(device)` from
        pageable memory synchronizes the stream), so the host can build and launch the next step while
        the device runs this one."""
        counts = [seq.num_samples for seq, done in zip(work.seqs, work.completes, strict=True) if done]
        logits = self.prefill(work)
        if not counts:
            return Launched(work, None, counts)
        rows = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        tokens, logprobs = sampler(logits[host_to_device(rows, self.device)])
        pinned = self.device.type == "cuda"
        host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=pinned)
        host_logprobs = torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=pinned)
        return Launched(work, HostCopy.start(tokens, logprobs, host_tokens, host_logprobs), counts)

    def prefill(self, work: PrefillWork) -> torch.Tensor:
        """Run the chunks of `work`; logits (C, V) at the last token of each of the C completed prompts."""
        dev, bs = self.device, self.runner.block_size
        ids: list[int] = []
        for seq, start, length in zip(work.seqs, work.starts, work.lengths, strict=True):
            ids += seq.token_ids[start : start + length]
        q_lens = list(work.lengths)
        k_lens = [s + n for s, n in zip(work.starts, work.lengths, strict=True)]
        tables = self._table_tensor(work.seqs)
        seq_index, pos_t, cu_q = packed_positions(work.starts, q_lens, dev)
        context_slots = None
        if any(work.starts):
            k_index, k_pos, cu_k = packed_positions([0] * len(k_lens), k_lens, dev)
            context_slots = ops.block_slots(tables, k_index, k_pos, bs)
        else:
            cu_k = cu_q
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=ops.block_slots(tables, seq_index, pos_t, bs),
            block_size=bs,
            cu_seqlens_q=host_to_device(torch.tensor(cu_q, dtype=torch.int32), dev),
            cu_seqlens_k=host_to_device(torch.tensor(cu_k, dtype=torch.int32), dev),
            q_lens=q_lens,
            k_lens=k_lens,
            context_slots=context_slots,
            prefill_kernel=self.config.prefill_attention,
        )
        if self.runner.states is not None:
            meta.state_slots = host_to_device(torch.tensor([s.state_slot for s in work.seqs]), dev)
            meta.state_fresh = [start == 0 for start in work.starts]
        hidden = self.model.forward(
            host_to_device(torch.tensor(ids, dtype=torch.long), dev),
            pos_t,
            self.runner.kv_cache,
            meta,
            self.runner.states,
        )
        last = [cu_q[i + 1] - 1 for i, done in enumerate(work.completes) if done]
        return self.model.logits(hidden[host_to_device(torch.tensor(last, dtype=torch.long), dev)])

    def _table_tensor(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        return host_to_device(padded_tables([s.block_table for s in seqs], len(seqs), width), self.device)

    # ------------------------------------------------------------------------------ decode
    def launch_decode(self, work: DecodeWork, sampler: DeviceSampler, slot: int) -> Launched:
        """Queue `work.steps` decode steps over `work.seqs` and the copy of their tokens to the host.
        With `work.rows`, each sequence continues its row of the window launched just before, whose
        state the device already advanced (last token, position, context length): those rows are
        gathered on the device, and only the block tables come from the host, whose tokens lag that
        window by `work.unread` steps."""
        seqs, steps, runner = work.seqs, work.steps, self.runner
        batch = len(seqs)
        padded = runner.padded_batch(batch)
        host_tables = padded_tables([s.block_table for s in seqs], padded, runner.max_blocks_per_seq)
        hybrid = runner.states is not None
        if work.rows is not None:
            rows_state = (runner.input_ids, runner.positions, runner.context_lens)
            if hybrid:  # a row whose turn ended in that window goes on writing the scratch slot
                rows_state += (runner.state_slots, runner.state_writes)
            if work.rows != list(range(batch)):
                index = torch.tensor(work.rows, dtype=torch.long).to(self.device, non_blocking=True)
                for state in rows_state:
                    state[:batch] = state.index_select(0, index)
            if padded > batch:  # padding rows as a fresh window leaves them: position 0, in block 0
                runner.input_ids[batch:padded] = 0
                runner.positions[batch:padded] = 0
                runner.context_lens[batch:padded] = 1
                if hybrid:
                    runner.state_slots[batch:padded] = 0
                    runner.state_writes[batch:padded] = 0
            max_context = max(s.num_tokens for s in seqs) + work.unread
        else:
            last = torch.tensor([s.token_ids[-1] for s in seqs] + [0] * (padded - batch), dtype=torch.long)
            pos = torch.tensor([s.num_tokens - 1 for s in seqs] + [0] * (padded - batch), dtype=torch.long)
            runner.input_ids[:padded].copy_(last, non_blocking=True)
            runner.positions[:padded].copy_(pos, non_blocking=True)
            runner.context_lens[:padded].copy_((pos + 1).to(torch.int32), non_blocking=True)
            max_context = int(pos[:batch].max()) + 1
            if hybrid:  # padding rows step the scratch slot 0
                slots = torch.tensor([s.state_slot for s in seqs] + [0] * (padded - batch), dtype=torch.long)
                runner.state_slots[:padded].copy_(slots, non_blocking=True)
                runner.state_writes[:padded].copy_(slots, non_blocking=True)
        runner.block_tables[:padded].copy_(host_tables, non_blocking=True)
        ends = self._turn_ends(seqs, work.unread) if hybrid else None
        out_tokens, out_logprobs = self.out_tokens[slot], self.out_logprobs[slot]
        # Each step's sampling writes its tokens there and moves these rows on (next input, position + 1).
        state = DecodeState(runner.input_ids[:batch], runner.positions[:batch], runner.context_lens[:batch])
        for k in range(steps):
            logits = runner.decode_logits(padded, max_context + k)
            sampler.sample_step(logits[:batch], out_tokens[k, :batch], out_logprobs[k, :batch], state)
            if ends is not None:  # the recurrent state of a row whose turn ended stays as it is
                runner.state_writes[:batch].masked_fill_(turn_ended(out_tokens[k, :batch], *ends, k), 0)
        # One row per sequence: the scheduler takes each sequence's tokens as one slice.
        # Contiguous views: a copy into a strided host tensor would not stay asynchronous.
        host_tokens = self.host_tokens[slot, : batch * steps].view(batch, steps)
        host_logprobs = self.host_logprobs[slot, : batch * steps].view(batch, steps)
        copy = HostCopy.start(
            out_tokens[:steps, :batch].t(), out_logprobs[:steps, :batch].t(), host_tokens, host_logprobs
        )
        return Launched(work, copy)

    def _turn_ends(self, seqs: list[Sequence], unread: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What ends each row's turn in a window, on the device (`turn_ended`): its stop ids (B, S), -1
        padded, and the tokens it has left (B,), those of the `unread` steps before the window taken."""
        width = max(1, *(len(s.stop_ids) for s in seqs))
        stops = torch.tensor(
            [[*s.stop_ids, *[-1] * (width - len(s.stop_ids))] for s in seqs], dtype=torch.long
        )
        left = torch.tensor([max(1, s.max_tokens - s.num_generated) - unread for s in seqs])
        return host_to_device(stops, self.device), host_to_device(left, self.device)
