"""Paged KV-cache bookkeeping: which blocks are free, who holds which, and how many holders each has.

Block 0 is scratch: never handed out, it absorbs the writes of padded rows in a captured decode
batch. A block can have several holders after a fork (the n samples of one prompt share its full
blocks); it returns to the free list when its last holder lets go. Only full blocks are ever
shared, so no write ever lands in a shared block and no copy-on-write is needed after the fork.

A hybrid model's sequence also holds a recurrent-state slot (`num_state_slots` > 0): taken with its
first blocks, given back with its blocks, never shared (a fork gets its own slot, a copy of the
prompt's state). Slot 0 is scratch, as block 0.
"""

from __future__ import annotations

from collections import deque

from fulcrum.rollout.native.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int = 0) -> None:
        assert num_blocks >= 2, f"the KV cache needs at least 2 blocks, got {num_blocks}"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free: deque[int] = deque(range(1, num_blocks))  # 0 is scratch
        self.has_states = num_state_slots > 0
        self.free_states: deque[int] = deque(range(1, num_state_slots))  # 0 is scratch

    def states_needed(self, seq: Sequence, forks: int = 0) -> int:
        """State slots `seq` and `forks` new forks of it would take (0 for a model without states)."""
        return (int(seq.state_slot < 0) + forks) if self.has_states else 0

    def fits(self, num_blocks: int, num_states: int) -> bool:
        return num_blocks <= len(self.free) and num_states <= len(self.free_states)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def take(self) -> int:
        block = self.free.popleft()
        self.ref_counts[block] = 1
        return block

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` enough blocks for `num_tokens` tokens, and its state slot (the caller checked `fits`)."""
        if self.has_states and seq.state_slot < 0:
            seq.state_slot = self.free_states.popleft()
        for _ in range(blocks_for(num_tokens, self.block_size) - len(seq.block_table)):
            seq.block_table.append(self.take())

    def extra_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """How many more blocks `seq` needs to hold `num_tokens` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its blocks (freed when no other sequence holds them)."""
        for block in seq.block_table:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free.append(block)
        seq.block_table = []
        if seq.state_slot >= 0:
            self.free_states.append(seq.state_slot)
            seq.state_slot = -1

    def fork_blocks(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Share the parent's full blocks with `child`; give it a fresh copy target for the partial one.

        Returns (source block, destination block) when the last block is partial and must be copied
        by the caller (the KV data), else None. The caller checked `fits` for that block and the state slot.
        """
        if self.has_states:
            child.state_slot = self.free_states.popleft()
        num_full = parent.num_computed // self.block_size
        child.block_table = list(parent.block_table[:num_full])
        for block in child.block_table:
            self.ref_counts[block] += 1
        if num_full < len(parent.block_table):
            fresh = self.take()
            child.block_table.append(fresh)
            return parent.block_table[num_full], fresh
        return None
