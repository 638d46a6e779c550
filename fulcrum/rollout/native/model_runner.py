"""The owner of the paged KV cache (and a hybrid model's recurrent states) and of the decode CUDA graphs
that point into them.

`ModelRunner` sizes the cache, takes it (`allocate_cache`, at every wake-up) and gives it back
(`free_cache`, at every sleep), copies blocks for forks, and runs one decode step over its static inputs
(`input_ids`, `positions`, `context_lens`, `block_tables`, and a hybrid model's `state_slots` and
`state_writes`, which `launcher.Launcher` fills): by replaying the CUDA graph captured for the smallest
batch-size bucket that holds the batch (padded rows write into the scratch block 0 and the scratch state
slot 0 and are ignored), else eagerly.
"""

from __future__ import annotations

import os
import time

import torch

from fulcrum.batch import host_to_device
from fulcrum.config.keys import ConfigError
from fulcrum.rollout.native import ops
from fulcrum.rollout.native.attention import AttentionMetadata
from fulcrum.rollout.native.config import EngineConfig
from fulcrum.rollout.native.decode_grid import decode_order
from fulcrum.rollout.native.kernels import HAVE_TRITON, IndirectCache
from fulcrum.rollout.native.memory import engine_workspace_bytes, kv_cache_budget
from fulcrum.rollout.native.models import moe
from fulcrum.rollout.native.models.decoder import DecoderLM
from fulcrum.rollout.native.models.linear_attention import RecurrentStates

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


def graph_obstacle(model: DecoderLM) -> str | None:
    """Why a CUDA graph cannot capture `model`'s decode step (it would read a value on the host), or None:
    expert products in a dtype torch's grouped GEMM does not take (`moe.grouped_mm_runs`)."""
    if not any("router" in layer for layer in model.layers):
        return None
    width = model.expert_range[1] - model.expert_range[0]
    for row in (min(model.hidden, 2 * width), min(width, model.hidden)):  # gate_up's product, down's
        if not moe.grouped_mm_runs(model.device.type, model.dtype, row):
            return (
                f"the experts' products in {model.dtype} read each expert's row count on the host "
                "(torch's grouped GEMM takes bf16 on CUDA, rows a multiple of 16 bytes)"
            )
    return None


class ModelRunner:
    """The KV cache (num_layers, 2, slots, Hkv, D), the decode graphs over it and the inputs they read."""

    def __init__(self, model: DecoderLM, config: EngineConfig, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.block_size = config.block_size
        hybrid = model.linear_shape is not None
        self.use_triton = use_triton_on(device, config.triton_kernels)
        # Each decode step orders its rows for the Triton decode kernel (AttentionMetadata.decode_order).
        self.order_rows = self.use_triton and config.decode_order == "longest_first"
        model.use_triton = self.use_triton
        model.fp32_logits = config.lm_head_fp32
        # A hybrid model's decode graphs also hold the recurrent states' address: recaptured after a
        # wake-up that moved them (`allocate_cache`); their slot inputs below are static.
        self.graphs_off_reason = graph_obstacle(model) if device.type == "cuda" else None
        self.use_graphs = device.type == "cuda" and not config.enforce_eager and not self.graphs_off_reason
        # Recurrent-state slots (hybrid models): every decoding sequence, one prompt part-way through a
        # chunked prefill, and the scratch slot 0; a held sequence keeps its slot as it keeps its blocks
        # (a cache: evicted, slot and blocks, when a prompt needs them).
        self.num_state_slots = config.max_num_seqs + 2 if hybrid else 0
        self.states: RecurrentStates | None = None
        # Decode rows' slots, read and written (`AttentionMetadata.state_writes`); and every row on the
        # scratch slot, for a capture's warm-up run (`_capture`).
        self.state_slots = torch.zeros(config.max_num_seqs, dtype=torch.long, device=device)
        self.state_writes = torch.zeros(config.max_num_seqs, dtype=torch.long, device=device)
        self.scratch_slots = torch.zeros(config.max_num_seqs, dtype=torch.long, device=device)
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
        self._graphs_addresses: tuple[int, ...] = ()  # what the captured graphs hold (`graph_addresses`)
        self.capture_sizes = config.capture_sizes()
        self.graph_capture_s = 0.0
        max_bs = config.max_num_seqs
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.context_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, device=device)
        self.slot_mapping = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.row_index = torch.arange(max_bs, device=device)

    # ------------------------------------------------------------------------------ memory
    def bytes_per_block(self) -> int:
        m = self.model
        element = torch.empty((), dtype=m.dtype).element_size()
        return m.num_kv_layers * 2 * self.block_size * m.num_kv_heads * m.head_dim * element

    def state_bytes(self) -> int:
        """The recurrent-state slots' bytes (0 for a model without linear-attention layers)."""
        lin = self.model.linear_shape
        if lin is None:
            return 0
        return RecurrentStates.nbytes(sum(self.model.linear), self.num_state_slots, lin, self.model.dtype)

    def cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block()

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
        # The recurrent-state slots come out of the same budget, ahead of the blocks.
        budget = kv_cache_budget(total, cfg.gpu_memory_utilization, weights, workspace, free_now)
        budget -= self.state_bytes()
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
        return (m.num_kv_layers, 2, self.num_blocks * self.block_size, m.num_kv_heads, m.head_dim)

    def allocate_cache(self) -> None:
        if self.kv_cache is not None:
            return
        # The Triton decode kernel masks its loads to each row's context, and prefill reads back only a
        # context's own slots: on that path no slot is read before it is written, and the cache (most of
        # the card) is not zero-filled at every wake-up. The torch twins read whole blocks and mask the
        # scores, where a never-written slot must hold a finite value (0 x NaN is NaN): zeros there.
        new = torch.empty if self.use_triton else torch.zeros
        self.kv_cache = new(self._cache_shape(), dtype=self.model.dtype, device=self.device)
        lin = self.model.linear_shape
        if lin is not None:
            self.states = RecurrentStates.empty(
                sum(self.model.linear), self.num_state_slots, lin, self.model.dtype, self.device
            )
        if self.indirect is not None:
            self.indirect.point_to(self.kv_cache)
        addresses = self.graph_addresses()
        if self.graphs and self.model.tp.agree_any(addresses != self._graphs_addresses, self.device):
            # The graphs hold the old cache's or states' address: drop them, the next decodes recapture
            # (every tensor-parallel rank at once: the capture's warm-up forward all-reduces).
            self.release_graphs()
        self._graphs_addresses = addresses

    def graph_addresses(self) -> tuple[int, ...]:
        """The device addresses a decode graph captured now would hold: the KV cache's (unless the
        kernels read it through `indirect`) and the recurrent states' (flash-linear-attention's kernels
        and the torch path take them as pointers: no indirect form)."""
        held = () if self.indirect is not None else (self.kv_cache.data_ptr(),)
        if self.states is not None:
            held += (self.states.conv.data_ptr(), self.states.delta.data_ptr())
        return held

    def free_cache(self) -> None:
        """Drop the KV cache and the recurrent states. The graphs stay (with their activation pool) until
        we know whether the next ones land at the same addresses (then they are still valid) or not."""
        self.kv_cache = None
        self.states = None
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
        self._graphs_addresses = ()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """KV data of block src -> block dst for each (src, dst) (forks' private partial blocks)."""
        if not pairs:
            return
        src = host_to_device(torch.tensor([p[0] for p in pairs]), self.device)
        dst = host_to_device(torch.tensor([p[1] for p in pairs]), self.device)
        m = self.model
        blocks = self.kv_cache.view(
            m.num_kv_layers, 2, self.num_blocks, self.block_size, m.num_kv_heads, m.head_dim
        )
        blocks[:, :, dst] = blocks[:, :, src]

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Recurrent state of slot src -> slot dst for each (src, dst) (a prompt's forks)."""
        if self.states is not None:
            self.states.copy(pairs)

    # ------------------------------------------------------------------------------ decode
    def padded_batch(self, batch: int) -> int:
        """The rows a decode step of `batch` sequences runs: its graph's bucket, or `batch` when eager."""
        return next(size for size in self.capture_sizes if size >= batch) if self.use_graphs else batch

    def decode_logits(self, batch: int, max_context: int) -> torch.Tensor:
        """One decode step over the static inputs' first `batch` rows (a `padded_batch`) -> logits
        (batch, V); `max_context` bounds the CPU gather path's width."""
        if not self.use_graphs:
            return self._decode_forward(batch, max_context)
        if batch not in self.graphs:
            self._capture(batch)
        graph, logits = self.graphs[batch]
        graph.replay()
        return logits

    def _decode_forward(self, batch: int, max_context: int, scratch_states: bool = False) -> torch.Tensor:
        """The decode step eagerly; with `scratch_states` every row reads and writes the scratch state
        slot 0 instead of its own (`_capture`'s warm-up)."""
        slots = ops.block_slots(
            self.block_tables, self.row_index[:batch], self.positions[:batch], self.block_size
        )
        self.slot_mapping[:batch] = slots
        context_lens = self.context_lens[:batch]
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.slot_mapping[:batch],
            block_size=self.block_size,
            block_tables=self.block_tables[:batch],
            context_lens=context_lens,
            decode_order=decode_order(context_lens) if self.order_rows else None,
            max_context=max_context,
            use_triton=self.use_triton,
            indirect_cache=self.indirect,
            state_slots=(self.scratch_slots if scratch_states else self.state_slots)[:batch],
            state_writes=(self.scratch_slots if scratch_states else self.state_writes)[:batch],
        )
        hidden = self.model.forward(
            self.input_ids[:batch], self.positions[:batch], self.kv_cache, meta, self.states
        )
        return self.model.logits(hidden)

    def _capture(self, batch: int) -> None:
        start = time.perf_counter()
        full_width = self.max_blocks_per_seq * self.block_size  # the gather path's static width
        # The warm-up runs the step (compiling the Triton kernels, tuning fla's, settling the allocator),
        # where nothing it writes may change what the replay computes: a recurrent step is not idempotent,
        # so its rows step the scratch state slot; it writes each row's K/V at the row's current slot,
        # which the replay writes again before any read (the warm-up's K/V may differ from the replay's
        # when a linear layer ran on the scratch state).
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._decode_forward(batch, full_width, scratch_states=True)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            logits = self._decode_forward(batch, full_width)
        self.graph_pool = graph.pool()
        self.graphs[batch] = (graph, logits)
        self.graph_capture_s += time.perf_counter() - start

    def capture_all(self) -> None:
        """Capture every bucket now (so that the first decode after start-up does not capture)."""
        if not self.use_graphs:
            return
        for size in sorted(self.capture_sizes, reverse=True):
            if size not in self.graphs:
                self.input_ids[:size].zero_()
                self.positions[:size].zero_()
                self.context_lens[:size].fill_(1)
                self.block_tables[:size].zero_()
                self._capture(size)
