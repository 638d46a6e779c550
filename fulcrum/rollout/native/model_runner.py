"""Runs the decoder over the paged KV cache: prefill steps (eager) and decode windows (CUDA graphs).

A decode window runs `steps` decode steps back to back on the device: each step feeds the previous
step's sampled tokens, advances positions and context lengths in place, and never waits for the
host; the host reads all the window's tokens once at its end. The blocks the window writes were
reserved by the scheduler beforehand, so the slot of each new token is computed on the device from
the block table. Decode steps replay a CUDA graph captured for the smallest batch-size bucket that
holds the batch (padded rows write into the scratch block 0 and are ignored).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from fulcrum.batch import host_to_device
from fulcrum.config.keys import ConfigError
from fulcrum.rollout.native import ops
from fulcrum.rollout.native.attention import AttentionMetadata
from fulcrum.rollout.native.config import EngineConfig
from fulcrum.rollout.native.kernels import HAVE_TRITON, IndirectCache
from fulcrum.rollout.native.memory import engine_workspace_bytes, kv_cache_budget
from fulcrum.rollout.native.models.decoder import DecoderLM
from fulcrum.rollout.native.sample_kernels import DecodeState
from fulcrum.rollout.native.sampler import DeviceSampler
from fulcrum.rollout.native.scheduler import PrefillWork
from fulcrum.rollout.native.sequence import Sequence

logger = logging.getLogger(__name__)

CPU_DEFAULT_CACHE_TOKENS = 65536  # the CPU cache when num_kv_blocks is not set


def use_triton_on(device: torch.device, wanted: bool | None) -> bool:
    """Whether the engine runs its Triton kernels on `device`, as `wanted`
    (engine_kwargs.native.triton_kernels, `EngineConfig.triton_kernels`): by default on CUDA only; asked
    for (True), also on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`, Triton's own switch),
    and refused where Triton cannot run them."""
    if wanted is False:
        return False
    runs = HAVE_TRITON and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
    if wanted and not runs:
        why = "triton is not installed" if not HAVE_TRITON else "on the CPU Triton needs TRITON_INTERPRET=1"
        raise ConfigError(
            f"actor_rollout_ref.rollout.engine_kwargs.native.triton_kernels=true, but {why}; leave it null "
            "(Triton on CUDA only) or set it false",
            "actor_rollout_ref.rollout.engine_kwargs.native.triton_kernels",
        )
    return runs if wanted else HAVE_TRITON and device.type == "cuda"


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


@dataclass
class PrefillLaunch:
    """A prefill step in flight: how many first tokens each completed prompt gets (its n), and their copy
    to the host (None when the step completes no prompt, only a chunk of a longer one)."""

    counts: list[int]
    copy: HostCopy | None


def padded_tables(tables: list[list[int]], rows: int, width: int) -> torch.Tensor:
    """Block tables as one (rows, width) int32 host tensor, zero-padded (block 0 is scratch).

    This runs before every decode window, while the device waits, so it is built with numpy from one
    flat iterator: 0.21 ms for 512 tables of 8-25 blocks on a CPU host, against 0.74 ms through torch
    from a flat list and about twice that from nested padded rows."""
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


class ModelRunner:
    def __init__(self, model: DecoderLM, config: EngineConfig, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.block_size = config.block_size
        self.use_triton = use_triton_on(device, config.triton_kernels)
        model.use_triton = self.use_triton
        model.fp32_logits = config.lm_head_fp32
        self.use_graphs = device.type == "cuda" and not config.enforce_eager
        self.max_blocks_per_seq = config.blocks_per_seq()
        model.ensure_positions(config.max_tokens_per_seq())
        self.num_blocks = model.tp.agree_min(self._cache_blocks(), device)
        self.kv_cache: torch.Tensor | None = None
        # Optionally the decode kernels read the cache through its device-held address: graphs survive sleep.
        self.indirect: IndirectCache | None = None
        if self.use_triton and self.use_graphs and config.indirect_kv_cache:
            self.indirect = IndirectCache(self._cache_shape(), model.dtype, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_pool = None
        self._graphs_cache_ptr = 0  # the cache address the captured graphs hold (direct mode)
        self.capture_sizes = config.capture_sizes()
        self.graph_capture_s = 0.0
        max_bs = config.max_num_seqs
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.context_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, device=device)
        self.slot_mapping = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.row_index = torch.arange(max_bs, device=device)
        # Two windows' outputs: with overlap_windows the next window writes one while the host reads the
        # other (from pinned host copies on CUDA, so that reading one does not wait for the next).
        # Rows a multiple of 4 entries wide: every step's row starts 16-byte aligned, so the sampler that
        # writes into it compiles one variant whatever the step (Triton specialises on pointer alignment).
        width = -(-max_bs // 4) * 4
        self.out_tokens = torch.zeros(2, config.decode_steps, width, dtype=torch.long, device=device)
        self.out_logprobs = torch.zeros(2, config.decode_steps, width, dtype=torch.float32, device=device)
        pinned = device.type == "cuda"
        size = max_bs * config.decode_steps
        self.host_tokens = torch.zeros(2, size, dtype=torch.long, pin_memory=pinned)
        self.host_logprobs = torch.zeros(2, size, dtype=torch.float32, pin_memory=pinned)
        self._slot = 0
        self._last_steps = 0  # steps of the window launched last

    # ------------------------------------------------------------------------------ KV cache
    def bytes_per_block(self) -> int:
        m = self.model
        element = torch.empty((), dtype=m.dtype).element_size()
        return m.num_layers * 2 * self.block_size * m.num_kv_heads * m.head_dim * element

    def _cache_blocks(self) -> int:
        """Blocks from num_kv_blocks, else (CUDA) gpu_memory_utilization of the device's memory, at most
        what a generate can use (`EngineConfig.usable_cache_blocks`)."""
        if self.config.num_kv_blocks is not None:
            return int(self.config.num_kv_blocks)
        if self.device.type != "cuda":
            return max(
                2, min(CPU_DEFAULT_CACHE_TOKENS // self.block_size + 1, self.config.usable_cache_blocks())
            )
        total = torch.cuda.get_device_properties(self.device).total_memory
        weights = sum(t.numel() * t.element_size() for t in self.model.weight_tensors())
        m, cfg = self.model, self.config
        workspace = engine_workspace_bytes(
            m.hidden,
            m.config.intermediate_size,
            m.config.vocab_size,
            cfg.max_num_batched_tokens,
            cfg.max_num_seqs,
            cfg.lm_head_fp32,
        )
        free_now, _ = torch.cuda.mem_get_info(self.device)
        budget = kv_cache_budget(total, cfg.gpu_memory_utilization, weights, workspace, free_now)
        blocks = min(int(budget // self.bytes_per_block()), cfg.usable_cache_blocks())
        if blocks < 2:
            raise RuntimeError(
                f"actor_rollout_ref.rollout.gpu_memory_utilization={cfg.gpu_memory_utilization} leaves no room for "
                f"the KV cache ({total / 2**30:.1f} GiB device, {weights / 2**30:.2f} GiB weights, "
                f"{free_now / 2**30:.1f} GiB free now)"
            )
        return blocks

    @property
    def awake(self) -> bool:
        return self.kv_cache is not None

    def _cache_shape(self) -> tuple[int, ...]:
        m = self.model
        return (m.num_layers, 2, self.num_blocks * self.block_size, m.num_kv_heads, m.head_dim)

    def allocate_cache(self) -> None:
        if self.kv_cache is not None:
            return
        # The Triton decode kernel masks its loads to each row's context, and prefill reads back only a
        # context's own slots: on that path no slot is read before it is written, and the cache (most of
        # the card) is not zero-filled at every wake-up. The torch twins read whole blocks and mask the
        # scores, where a never-written slot must hold a finite value (0 x NaN is NaN): zeros there.
        new = torch.empty if self.use_triton else torch.zeros
        self.kv_cache = new(self._cache_shape(), dtype=self.model.dtype, device=self.device)
        if self.indirect is not None:
            self.indirect.point_to(self.kv_cache)
        elif self.graphs and self.model.tp.agree_any(
            self.kv_cache.data_ptr() != self._graphs_cache_ptr, self.device
        ):
            # The graphs hold the old cache's address: drop them, the next decodes recapture (every
            # tensor-parallel rank at once: the capture's warm-up forward all-reduces).
            self.release_graphs()
        self._graphs_cache_ptr = self.kv_cache.data_ptr()

    def free_cache(self) -> None:
        """Drop the KV cache. The graphs stay (with their activation pool) until we know whether the
        next cache lands at the same address (then they are still valid) or not."""
        self.kv_cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def release_graphs(self) -> None:
        """Destroy the captured decode graphs and their memory pool now (the next decode recaptures).

        Under tensor parallelism the graphs captured NCCL all-reduces, and NCCL cannot destroy a
        communicator while a graph that captured its calls is alive (pytorch/pytorch#115388): leaving
        the process group with the graphs still held hangs every rank at the end of the run."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no replay still running
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.graph_pool = None
        self._graphs_cache_ptr = 0

    def cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """KV data of block src -> block dst for each (src, dst) (forks' private partial blocks)."""
        if not pairs:
            return
        src = host_to_device(torch.tensor([p[0] for p in pairs]), self.device)
        dst = host_to_device(torch.tensor([p[1] for p in pairs]), self.device)
        m = self.model
        blocks = self.kv_cache.view(
            m.num_layers, 2, self.num_blocks, self.block_size, m.num_kv_heads, m.head_dim
        )
        blocks[:, :, dst] = blocks[:, :, src]

    # ------------------------------------------------------------------------------ prefill
    def launch_prefill(self, work: PrefillWork, sampler) -> PrefillLaunch:
        """Queue the prefill of `work` and the first token of each of the n samples of every prompt it
        completes (with the copy of those tokens to the host); `read_prefill` waits for them.

        Nothing here waits for the device: every host tensor goes over asynchronously (`host_to_device`:
        a plain `.to(device)` from pageable memory synchronizes the stream), so the host can build and
        launch the next step while the device runs this one."""
        counts = [seq.num_samples for seq, done in zip(work.seqs, work.completes, strict=True) if done]
        logits = self.prefill(work)
        if not counts:
            return PrefillLaunch(counts, None)
        rows = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        tokens, logprobs = sampler(logits[host_to_device(rows, self.device)])
        pinned = self.device.type == "cuda"
        host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=pinned)
        host_logprobs = torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=pinned)
        return PrefillLaunch(counts, HostCopy.start(tokens, logprobs, host_tokens, host_logprobs))

    def read_prefill(self, launch: PrefillLaunch) -> tuple[list[list[int]], list[list[float]]]:
        """The first tokens and log-probs of a launched prefill, one list per completed prompt."""
        if launch.copy is None:
            return [], []
        flat_tokens, flat_logprobs = launch.copy.read()
        offsets = [0, *itertools.accumulate(launch.counts)]
        return (
            [flat_tokens[a:b] for a, b in itertools.pairwise(offsets)],
            [flat_logprobs[a:b] for a, b in itertools.pairwise(offsets)],
        )

    def prefill(self, work: PrefillWork) -> torch.Tensor:
        """Run the chunks of `work`; logits (C, V) at the last token of each of the C completed prompts."""
        dev, bs = self.device, self.block_size
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
        )
        hidden = self.model.forward(
            host_to_device(torch.tensor(ids, dtype=torch.long), dev), pos_t, self.kv_cache, meta
        )
        last = [cu_q[i + 1] - 1 for i, done in enumerate(work.completes) if done]
        return self.model.logits(hidden[host_to_device(torch.tensor(last, dtype=torch.long), dev)])

    def _table_tensor(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        return host_to_device(padded_tables([s.block_table for s in seqs], len(seqs), width), self.device)

    # ------------------------------------------------------------------------------ decode
    def launch_decode(
        self, seqs: list[Sequence], steps: int, sampler: DeviceSampler, rows: list[int] | None = None
    ) -> HostCopy:
        """Queue `steps` decode steps over `seqs` and the copy of their tokens to the host; `read_decode`
        waits for them. `rows`: each sequence's row in the window launched just before, whose state the
        device already advanced (last token, position, context length): those rows are gathered on the
        device, and only the block tables come from the host, whose tokens lag that window."""
        batch = len(seqs)
        padded = self._bucket(batch) if self.use_graphs else batch
        host_tables = padded_tables([s.block_table for s in seqs], padded, self.max_blocks_per_seq)
        if rows is not None:
            if rows != list(range(batch)):
                index = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
                for state in (self.input_ids, self.positions, self.context_lens):
                    state[:batch] = state.index_select(0, index)
            if padded > batch:  # padding rows as a fresh window leaves them: position 0, in block 0
                self.input_ids[batch:padded] = 0
                self.positions[batch:padded] = 0
                self.context_lens[batch:padded] = 1
            max_context = max(s.num_tokens for s in seqs) + self._last_steps
        else:
            last = torch.tensor([s.token_ids[-1] for s in seqs] + [0] * (padded - batch), dtype=torch.long)
            pos = torch.tensor([s.num_tokens - 1 for s in seqs] + [0] * (padded - batch), dtype=torch.long)
            self.input_ids[:padded].copy_(last, non_blocking=True)
            self.positions[:padded].copy_(pos, non_blocking=True)
            self.context_lens[:padded].copy_((pos + 1).to(torch.int32), non_blocking=True)
            max_context = int(pos[:batch].max()) + 1
        self.block_tables[:padded].copy_(host_tables, non_blocking=True)
        slot, self._slot, self._last_steps = self._slot, 1 - self._slot, steps
        out_tokens, out_logprobs = self.out_tokens[slot], self.out_logprobs[slot]
        # Each step's sampling writes its tokens there and moves these rows on (next input, position + 1).
        state = DecodeState(self.input_ids[:batch], self.positions[:batch], self.context_lens[:batch])
        for k in range(steps):
            if self.use_graphs:
                logits = self._graph_logits(padded)
            else:
                logits = self._decode_forward(padded, max_context + k)
            sampler.sample_step(logits[:batch], out_tokens[k, :batch], out_logprobs[k, :batch], state)
        # One row per sequence: the scheduler takes each sequence's tokens as one slice.
        # Contiguous views: a copy into a strided host tensor would not stay asynchronous.
        host_tokens = self.host_tokens[slot, : batch * steps].view(batch, steps)
        host_logprobs = self.host_logprobs[slot, : batch * steps].view(batch, steps)
        return HostCopy.start(
            out_tokens[:steps, :batch].t(), out_logprobs[:steps, :batch].t(), host_tokens, host_logprobs
        )

    def read_decode(self, launch: HostCopy) -> tuple[list[list[int]], list[list[float]]]:
        """The tokens and log-probs of a launched window, (tokens[b][k], logprobs[b][k])."""
        return launch.read()

    def _bucket(self, batch: int) -> int:
        return next(size for size in self.capture_sizes if size >= batch)

    def _decode_forward(self, batch: int, max_context: int) -> torch.Tensor:
        """One decode step over the static buffers' first `batch` rows -> logits (batch, V)."""
        slots = ops.block_slots(
            self.block_tables, self.row_index[:batch], self.positions[:batch], self.block_size
        )
        self.slot_mapping[:batch] = slots
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.slot_mapping[:batch],
            block_size=self.block_size,
            block_tables=self.block_tables[:batch],
            context_lens=self.context_lens[:batch],
            max_context=max_context,
            use_triton=self.use_triton,
            indirect_cache=self.indirect,
        )
        hidden = self.model.forward(self.input_ids[:batch], self.positions[:batch], self.kv_cache, meta)
        return self.model.logits(hidden)

    def _graph_logits(self, batch: int) -> torch.Tensor:
        if batch not in self.graphs:
            self._capture(batch)
        graph, logits = self.graphs[batch]
        graph.replay()
        return logits

    def _capture(self, batch: int) -> None:
        start = time.perf_counter()
        full_width = self.max_blocks_per_seq * self.block_size  # the gather path's static width
        # Warm-up runs write the rows' K/V at their current slots: the same values the replay writes.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._decode_forward(batch, full_width)  # compile Triton kernels, settle the allocator
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            logits = self._decode_forward(batch, full_width)
        self.graph_pool = graph.pool()
        self.graphs[batch] = (graph, logits)
        self.graph_capture_s += time.perf_counter() - start

    def capture_all(self) -> None:
        """Capture every bucket now (the engine does this at start-up so that the first decode is fast)."""
        if not self.use_graphs:
            return
        for size in sorted(self.capture_sizes, reverse=True):
            if size not in self.graphs:
                self._capture_with_dummy_rows(size)

    def _capture_with_dummy_rows(self, batch: int) -> None:
        self.input_ids[:batch].zero_()
        self.positions[:batch].zero_()
        self.context_lens[:batch].fill_(1)
        self.block_tables[:batch].zero_()
        self._capture(batch)
