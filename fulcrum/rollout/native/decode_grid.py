"""The paged decode kernel's launch (`kernels.paged_decode_attention`): how many programs a (sequence, KV
head) pair gets (flash-decoding's split count) and Triton's warps a program, from the batch, its K/V heads,
the longest context its block table holds and the card's SMs. Pure arithmetic: no Triton needed.
"""

from __future__ import annotations

import torch

# The paged decode kernel's launch: TILE positions a loop iteration, SPLITS programs a (sequence, KV head)
# (flash-decoding; 1: the kernel writes the output itself; 0: chosen per launch by `decode_splits`), and
# Triton's num_warps and num_stages (absent: Triton's defaults). A tuned value, one launch for every model
# shape: `bench/tools/attention_sweep.py` times the alternatives on a GPU.
DECODE_LAUNCH: dict[str, int] = {"TILE": 64, "SPLITS": 0, "num_warps": 1, "num_stages": 4}
# `decode_splits`' rule. Programs wanted in a launch, per SM: a one-warp program holding a few K/V tiles in
# flight (num_stages) leaves room for one or two such programs on an SM, and a launch of a few waves of
# long programs idles every SM but a few in its last wave, so the grid is made several waves deep.
SPLIT_PROGRAMS_PER_SM = 8
# The fewest context positions a split reads when the context fills the block table: below this the
# partial outputs and the combine kernel cost more than the programs they add (a wide batch of short
# contexts never splits).
SPLIT_MIN_POSITIONS = 1024
MAX_SPLITS = 16
# A batch of fewer (sequence, KV head) pairs than SMs (a rollout's last long answers, a validation's tail)
# leaves most SMs idle under one program a pair whatever its context, and each program's latency is the
# step's: such a batch is split until it holds TAIL_PROGRAMS_PER_SM programs an SM, each reading at least
# TAIL_MIN_POSITIONS positions (two of the kernel's tiles), at most TAIL_MAX_SPLITS ways, with
# TAIL_NUM_WARPS warps a program (bench/tools/attention_sweep.py --tail: 16 sequences of Qwen2.5-0.5B's
# and Qwen3-0.6B's shapes fastest at 8 and 4 splits of 4 warps, 2.4-4.3x one one-warp program a pair).
TAIL_PROGRAMS_PER_SM = 2
TAIL_MIN_POSITIONS = 128
TAIL_MAX_SPLITS = 8
TAIL_NUM_WARPS = 4
# The SM count assumed off CUDA (Triton's interpreter), an H100's.
DEFAULT_SM_COUNT = 132


def doubled_splits(pairs: int, programs: int, cap: int) -> int:
    """The smallest power of two s with pairs · s ≥ programs, at most `cap` rounded down to a power of two
    (at least 1): SPLITS is a compile-time constant of the kernel, so the counts stay few."""
    cap = 1 << (max(1, cap).bit_length() - 1)
    splits = 1
    while splits < cap and pairs * splits < programs:
        splits *= 2
    return splits


def wide_splits(batch: int, kv_heads: int, max_context: int, sm_count: int) -> int:
    """The split count for a batch of any width:

    s = the smallest power of two with batch · kv_heads · s ≥ SPLIT_PROGRAMS_PER_SM · sm_count,
        at most max(1, max_context // SPLIT_MIN_POSITIONS) and MAX_SPLITS"""
    pairs = max(1, batch * kv_heads)
    cap = min(MAX_SPLITS, max_context // SPLIT_MIN_POSITIONS)
    return doubled_splits(pairs, SPLIT_PROGRAMS_PER_SM * sm_count, cap)


def tail_splits(batch: int, kv_heads: int, max_context: int, sm_count: int) -> int:
    """The split count for a batch of fewer (sequence, KV head) pairs than SMs, 1 for a wider one:

    s = the smallest power of two with batch · kv_heads · s ≥ TAIL_PROGRAMS_PER_SM · sm_count,
        at most max(1, max_context // TAIL_MIN_POSITIONS) and TAIL_MAX_SPLITS"""
    pairs = max(1, batch * kv_heads)
    if pairs >= sm_count:
        return 1
    cap = min(TAIL_MAX_SPLITS, max_context // TAIL_MIN_POSITIONS)
    return doubled_splits(pairs, TAIL_PROGRAMS_PER_SM * sm_count, cap)


def decode_splits(batch: int, kv_heads: int, max_context: int, sm_count: int) -> int:
    """Programs a (sequence, KV head) for the paged decode kernel (flash-decoding's split count): the more
    of `wide_splits` and `tail_splits`.

    `max_context`: the longest context a row can hold (the block table's width in positions, or a sliding
    window's). Fixed when a CUDA graph is captured, so it is a bound, not the step's context: the kernel
    shares each row's tiles out over the splits by the row's own length. A decode batch of many sequences
    keeps one program a pair (the sweeps found splits slower at 512 sequences of a few hundred tokens);
    few sequences of long contexts get more programs, each reading a share, and a batch too narrow to
    fill the SMs is split at any context."""
    return max(
        wide_splits(batch, kv_heads, max_context, sm_count),
        tail_splits(batch, kv_heads, max_context, sm_count),
    )


def decode_order(context_lens: torch.Tensor) -> torch.Tensor:
    """The rows by context length, longest first (int32): the order the paged decode kernel's programs
    take them in when given it (`engine_kwargs.native.decode_order=longest_first`). A GPU starts a launch's programs in grid order and a
    program's time grows with its row's context, so a batch of uneven contexts taken in its own order can
    end on a few long programs with the other SMs idle; longest first, the last programs to start are the
    shortest (longest-processing-time-first scheduling)."""
    return torch.argsort(context_lens, descending=True).to(torch.int32)


_SM_COUNTS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """The device's SM count (DEFAULT_SM_COUNT off CUDA), read once a device."""
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def decode_launch(
    batch: int,
    kv_heads: int,
    max_context: int,
    device: torch.device,
    launch: dict[str, int] | None = None,
) -> dict[str, int]:
    """The paged decode kernel's launch for a batch: DECODE_LAUNCH with `launch`'s keys over it, SPLITS 0
    resolved by `decode_splits` on `device`'s SMs; where the tail rule split the batch further than the
    wide rule would, TAIL_NUM_WARPS warps a program unless `launch` names num_warps."""
    params = {**DECODE_LAUNCH, **(launch or {})}
    if params["SPLITS"] == 0:
        sms = sm_count(device)
        wide = wide_splits(batch, kv_heads, max_context, sms)
        tail = tail_splits(batch, kv_heads, max_context, sms)
        params["SPLITS"] = max(wide, tail)
        if tail > wide and "num_warps" not in (launch or {}):
            params["num_warps"] = TAIL_NUM_WARPS
    return params
