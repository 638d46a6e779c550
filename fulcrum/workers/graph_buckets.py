"""Micro-batches padded to fixed shapes (`Bucket`s), so that one CUDA graph serves every micro-batch of a
bucket (`fulcrum.workers.cuda_graphs`).

Each packed micro-batch is padded to its bucket: its stream to a multiple of `TOKEN_STEP` tokens (the
padding is one or more extra sequences), its response positions to a multiple of `RESPONSE_STEP` (extra
positions in padding rows, whose response mask is 0), its rows and sequences to multiples of `ROW_STEP`
(empty rows, sequences of length 0). Every loss and metric reduces under the response mask, so the
padding changes none of them (tests/test_cuda_graphs.py). A micro-batch may also be padded to a larger
bucket (`fits`), at the cost `extra_work` counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fulcrum.batch import Batch
from fulcrum.models.packed import PackedMicroBatch, pack_micro_batch

# Bucket steps: tokens of the packed stream, response positions, rows and sequences.
TOKEN_STEP = 128
RESPONSE_STEP = 128
ROW_STEP = 8
# A response position's work against a stream token's: its LM-head row and loss (fwd + bwd ~0.8 GFLOP at
# the 0.5B shape) against a token through every decoder layer with recomputation (~2.9 GFLOP).
RESPONSE_WORK = 0.25


@dataclass(frozen=True)
class Bucket:
    """The padded sizes of a micro-batch: stream tokens N, response positions M, rows B, sequences S, and
    what the batch fixes: the bound on a sequence's length the attention is given (`max_seqlen`, a
    constant of the graph) and the response width R of the (B, R) grid."""

    tokens: int
    responses: int
    rows: int
    sequences: int
    width: int
    columns: int


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def bucket_for(packed: PackedMicroBatch) -> Bucket:
    """The bucket a packed micro-batch pads to: N + 1 tokens at least (a padding sequence always
    exists, for the padding positions to point at), rounded up; room in the rows for the padding
    positions (R a row) and in the sequences for the padding sequences (each at most `max_seqlen`)."""
    n, m = packed.input_ids.numel(), packed.labels.numel()
    b, r = packed.shape
    tokens = round_up(n + 1, TOKEN_STEP)
    responses = round_up(m, RESPONSE_STEP)
    extra_rows = -(-(responses - m) // r)
    extra_sequences = -(-(tokens - n) // packed.max_seqlen)
    sequences = packed.cu_seqlens.numel() - 1 + extra_sequences
    return Bucket(
        tokens,
        responses,
        round_up(b + extra_rows, ROW_STEP),
        round_up(sequences, ROW_STEP),
        packed.max_seqlen,
        r,
    )


def fits(packed: PackedMicroBatch, bucket: Bucket) -> bool:
    """Whether `packed` can be padded to `bucket` (a bucket captured for a larger micro-batch): room for a
    padding token, its response positions, the rows the padding positions take and the padding sequences."""
    n, m = packed.input_ids.numel(), packed.labels.numel()
    b, r = packed.shape
    if bucket.tokens <= n or bucket.responses < m or (bucket.width, bucket.columns) != (packed.max_seqlen, r):
        return False
    extra_rows = -(-(bucket.responses - m) // r)
    extra_sequences = -(-(bucket.tokens - n) // packed.max_seqlen)
    return (
        bucket.rows >= b + extra_rows and bucket.sequences >= packed.cu_seqlens.numel() - 1 + extra_sequences
    )


def extra_work(bucket: Bucket, own: Bucket) -> float:
    """The work of a micro-batch of bucket `own` replayed in the larger `bucket`, beyond its own, in
    stream tokens: the extra tokens and `RESPONSE_WORK` of each extra response position (padding rows
    and empty sequences cost next to nothing)."""
    return bucket.tokens - own.tokens + RESPONSE_WORK * (bucket.responses - own.responses)


def pad_packed(packed: PackedMicroBatch, bucket: Bucket) -> PackedMicroBatch:
    """`packed` (on the host) padded to `bucket`:

    - tokens N..N_b-1: token 0 at positions 0, 1, ... in sequences of at most `max_seqlen`;
    - sequences: those, then sequences of length 0 up to S_b (cu_seqlens repeats N_b);
    - response positions M..M_b-1: predicted from stream position N (a padding token), label 0, in the
      padding rows B, B+1, ... of the (B_b, R) grid, column after column; the rows' mask is 0.
    """
    n, m = packed.input_ids.numel(), packed.labels.numel()
    b, r = packed.shape
    extra, width = bucket.tokens - n, packed.max_seqlen
    lengths = [width] * (extra // width) + ([extra % width] if extra % width else [])
    ends = n + torch.tensor(lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    empty = bucket.sequences + 1 - packed.cu_seqlens.numel() - len(lengths)
    k = torch.arange(bucket.responses - m)
    return PackedMicroBatch(
        input_ids=torch.cat([packed.input_ids, packed.input_ids.new_zeros(extra)]),
        position_ids=torch.cat([packed.position_ids, *(torch.arange(x) for x in lengths)]),
        cu_seqlens=torch.cat(
            [packed.cu_seqlens, ends, torch.full((empty,), bucket.tokens, dtype=torch.int32)]
        ),
        max_seqlen=width,
        predictor=torch.cat([packed.predictor, torch.full((len(k),), n, dtype=torch.long)]),
        labels=torch.cat([packed.labels, packed.labels.new_zeros(len(k))]),
        rows=torch.cat([packed.rows, b + k // r]),
        cols=torch.cat([packed.cols, k % r]),
        shape=(bucket.rows, r),
    )


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """(B, ...) → (rows, ...) with zero rows after."""
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, rows - x.shape[0]))


def padded_inputs(
    mb: Batch, keys: list[str], choose: Callable[[PackedMicroBatch, Bucket], Bucket] | None = None
) -> tuple[Bucket, PackedMicroBatch, dict[str, torch.Tensor]]:
    """The micro-batch packed and padded to its bucket (or to the one `choose` picks given the packed
    micro-batch and its own bucket), and its (B, R) columns `keys` padded alike; on the host."""
    packed = pack_micro_batch(mb["input_ids"], mb["attention_mask"], mb["position_ids"], mb.prompt_length)
    bucket = bucket_for(packed)
    if choose is not None:
        bucket = choose(packed, bucket)
    return bucket, pad_packed(packed, bucket), {k: pad_rows(mb[k], bucket.rows) for k in keys}
