"""Splitting a batch into micro-batches (fixed count or packed by a token budget) and the forwards
that every worker runs on one micro-batch: response log-probs (actor, reference) and values (critic).

Two layouts. Padded (`use_remove_padding=False`): rows of (B, P + R) with all-padding columns
trimmed, autocast on CUDA. Packed (`use_remove_padding=True`): only the real tokens, one stream per
micro-batch (`fulcrum.models.packed`), the LM head and log-softmax fused and chunked
(`fulcrum.models.linear_logprob`); packed micro-batches are cut by tokens, not rows: a fixed size of
n rows becomes a budget of n × (P + R) tokens, the most that n padded rows could hold, so a packed
micro-batch never needs more activation memory than the padded one the user sized.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from fulcrum.batch import Batch, host_to_device
from fulcrum.models.linear_logprob import linear_log_softmax
from fulcrum.models.load import autocast_for
from fulcrum.models.logprob import logprob_and_entropy, response_logits, trim_padding
from fulcrum.models.packed import PackedMicroBatch, pack_micro_batch, packed_hidden_states
from fulcrum.models.stream_shard import StreamShard, shard_stream
from fulcrum.parallel import max_over_ranks
from fulcrum.parallel.fsdp import is_sharded, run_in_root
from fulcrum.parallel.ulysses import SequenceParallel, gather_rows


def sequence_lengths(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt tokens, response tokens) per sample, from the attention mask: two (B,) long tensors."""
    p = batch.prompt_length
    mask = batch["attention_mask"]
    return mask[:, :p].sum(-1).long(), mask[:, p:].sum(-1).long()


def token_budget_groups(
    prompt_len: list[int], response_len: list[int], max_token_len: int, key: str
) -> list[list[int]]:
    """Pack sample indices into groups whose padded cost fits the token budget.

    A group's cost is `len(group) × (max prompt + max response)`: what the padded path's trimmed
    forward really processes (every row is as wide as the group's widest), so the budget bounds
    memory honestly. (Packed micro-batches are cut by `packed_token_groups` instead.) Samples
    are taken longest first, which keeps the padding inside each group small.
    """
    order = sorted(range(len(prompt_len)), key=lambda i: prompt_len[i] + response_len[i], reverse=True)
    groups: list[list[int]] = []
    current: list[int] = []
    max_p = max_r = 0
    for i in order:
        p, r = max(max_p, prompt_len[i]), max(max_r, response_len[i])
        if prompt_len[i] + response_len[i] > max_token_len:
            raise ValueError(
                f"{key}={max_token_len} is smaller than one sequence ({prompt_len[i] + response_len[i]} tokens); "
                "raise it to at least max_prompt_length + max_response_length"
            )
        if current and (len(current) + 1) * (p + r) > max_token_len:
            groups.append(current)
            current, p, r = [], prompt_len[i], response_len[i]
        current.append(i)
        max_p, max_r = p, r
    if current:
        groups.append(current)
    return groups


def packed_token_groups(lengths: list[int], max_token_len: int, key: str) -> list[list[int]]:
    """Sample indices in groups of at most `max_token_len` real tokens (first-fit decreasing).

    Longest first, each into the first group with room: few groups (close to Σ lengths / budget),
    hence few micro-batches.
    """
    groups: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > max_token_len:
            raise ValueError(
                f"{key}: a token budget of {max_token_len} is smaller than one sequence ({lengths[i]} tokens); "
                "raise it to at least max_prompt_length + max_response_length"
            )
        for g, free in enumerate(room):
            if lengths[i] <= free:
                groups[g].append(i)
                room[g] -= lengths[i]
                break
        else:
            groups.append([i])
            room.append(max_token_len - lengths[i])
    return groups


def packed_budget(
    batch: Batch, size: int | None, use_dynamic_bsz: bool, max_token_len: int | None, key: str
) -> int:
    """Tokens per packed micro-batch: the dynamic budget, or `size` rows of the batch's padded width."""
    if use_dynamic_bsz:
        if not max_token_len or max_token_len <= 0:
            raise ValueError(f"{key}: use_dynamic_bsz=True needs a positive max token length")
        return int(max_token_len)
    if not size or size <= 0:
        raise ValueError(f"{key}: micro-batch size must be a positive integer, got {size}")
    return int(size) * (batch.prompt_length + batch.response_length)


def make_micro_batches(
    batch: Batch,
    size: int | None,
    use_dynamic_bsz: bool,
    max_token_len: int | None,
    key: str,
    sort_by_length: bool = False,
    packed: bool = False,
    model: nn.Module | None = None,
) -> tuple[list[Batch], list[int] | None]:
    """Micro-batches and, when samples were reordered, the order they hold (to undo it).

    `sort_by_length` (for no-grad passes, where grouping cannot change the result) puts samples of
    similar length together so each trimmed micro-batch carries little padding. `packed` cuts by
    real tokens (`packed_budget`, `packed_token_groups`) for the padding-free forwards. When FSDP
    shards `model`, the micro-batches are cut further (`split_to_count`) to the largest count of any
    rank: each forward gathers the layers' shards, a collective every rank must join.
    """
    groups: list[list[int]] | None = None  # None: consecutive rows, in the batch's order
    if packed:
        budget = packed_budget(batch, size, use_dynamic_bsz, max_token_len, key)
        groups = packed_token_groups(batch["attention_mask"].sum(-1).tolist(), budget, key)
    elif use_dynamic_bsz:
        if not max_token_len or max_token_len <= 0:
            raise ValueError(f"{key}: use_dynamic_bsz=True needs a positive max token length")
        p, r = sequence_lengths(batch)
        groups = token_budget_groups(p.tolist(), r.tolist(), int(max_token_len), key)
    elif not size or size <= 0:
        raise ValueError(f"{key}: micro-batch size must be a positive integer, got {size}")
    elif sort_by_length and len(batch) > size:
        p, r = sequence_lengths(batch)
        ranked = sorted(range(len(batch)), key=lambda i: (int(p[i]) + int(r[i]), i), reverse=True)
        groups = [ranked[i : i + size] for i in range(0, len(batch), size)]
    micro = batch.split(int(size or 0)) if groups is None else [batch.select(g) for g in groups]
    order = None if groups is None else [i for g in groups for i in g]
    if model is not None and is_sharded(model):
        micro = split_to_count(micro, max_over_ranks(len(micro)))
    return micro, order


def split_to_count(micro: list[Batch], count: int) -> list[Batch]:
    """`micro` cut further, in order, until it holds `count` micro-batches: the one with the most rows is
    halved each time (so each still fits its size or token budget). Under FSDP every rank must run as
    many forwards as the others (each is a collective), whatever its rows' lengths."""
    micro = list(micro)
    while len(micro) < count:
        widest = max(range(len(micro)), key=lambda i: len(micro[i]))
        rows = len(micro[widest])
        if rows < 2:
            raise RuntimeError(f"cannot cut {len(micro)} micro-batches of one row into {count}")
        micro[widest : widest + 1] = [
            micro[widest].select(list(range(rows // 2))),
            micro[widest].select(list(range(rows // 2, rows))),
        ]
    return micro


def restore_order(parts: list[torch.Tensor], order: list[int] | None) -> torch.Tensor:
    """Concatenate per-micro-batch results and undo the token-budget permutation.

    The inverse permutation goes to the device as an asynchronous copy: a plain `.to(device)` would
    make the host wait for every queued micro-batch (`host_to_device`)."""
    out = torch.cat(parts)
    if order is None:
        return out
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.as_tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return out[host_to_device(inverse, out.device)]


def pad_right(x: torch.Tensor, length: int) -> torch.Tensor:
    """(B, R') → (B, R) with zeros on the right (those positions are outside the response mask)."""
    if x.shape[1] == length:
        return x
    return torch.nn.functional.pad(x, (0, length - x.shape[1]))


def trimmed_inputs(mb: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The micro-batch's (input_ids, attention_mask, position_ids) on `device` with all-padding columns
    trimmed (see trim_padding), and how many response columns remain.

    Trimmed on the host, where the batch lives: the columns to keep are read from the mask (`nonzero`,
    `.item()`), which on the device would make the host wait for the GPU six times a micro-batch."""
    ids, mask, pos, r_kept = trim_padding(
        mb["input_ids"], mb["attention_mask"], mb["position_ids"], mb.prompt_length
    )
    return host_to_device(ids, device), host_to_device(mask, device), host_to_device(pos, device), r_kept


def forward_log_prob(
    model: nn.Module,
    mb: Batch,
    temperature: float,
    with_entropy: bool,
    device: torch.device,
    packed: bool = False,
    response_mask: torch.Tensor | None = None,
    sp: SequenceParallel | None = None,
    fp32_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(response tokens) (B, R), float32, logits divided by the rollout temperature as verl; entropy too.

    `response_mask`: the micro-batch's mask already on `device` (an update has it for its loss), so it
    is not copied a second time; None copies `mb["response_mask"]`. `sp` (packed only): the
    sequence-parallel group that shares this micro-batch; every rank of it gets the whole result.
    `fp32_logits` (packed only): the LM head's product kept in float32 (`fulcrum.models.head_logits`)."""
    if packed:  # reaches embeddings and LM head directly: under FSDP, inside the root unit's forward
        return run_in_root(
            model,
            packed_log_prob,
            model,
            mb,
            temperature,
            with_entropy,
            device,
            response_mask,
            sp,
            fp32_logits,
        )
    # The padded path's head is the Hugging Face model's own module, which rounds to its dtype.
    assert not fp32_logits, "fp32 LM-head logits need the packed path (ModelForwards refuses the padded one)"
    r = mb.response_length
    ids, mask, pos, r_kept = trimmed_inputs(mb, device)
    with autocast_for(device):
        logits = response_logits(model, ids, mask, pos, r_kept)  # (B, R', V)
    labels = host_to_device(mb["responses"][:, :r_kept], device)
    logp, entropy = logprob_and_entropy(logits, labels, temperature, with_entropy)
    # Zero outside the response mask: padding positions carry no meaning and must not leak into sums.
    mask = response_mask_on(mb, device, response_mask)
    logp = pad_right(logp, r) * mask
    return logp, (pad_right(entropy, r) * mask if entropy is not None else None)


def forward_values(
    model: nn.Module,
    mb: Batch,
    device: torch.device,
    packed: bool = False,
    response_mask: torch.Tensor | None = None,
    sp: SequenceParallel | None = None,
) -> torch.Tensor:
    """V(state before each response token) (B, R), float32, zero outside the response mask
    (`response_mask` and `sp` as in `forward_log_prob`)."""
    if packed:
        return run_in_root(model, packed_values, model, mb, device, response_mask, sp)
    r = mb.response_length
    ids, mask, pos, r_kept = trimmed_inputs(mb, device)
    with autocast_for(device):
        values = model(input_ids=ids, attention_mask=mask, position_ids=pos)  # (B, T')
    values = values[:, -r_kept - 1 : -1].float()  # (B, R'), as verl's critic slices
    return pad_right(values, r) * response_mask_on(mb, device, response_mask)


def response_mask_on(mb: Batch, device: torch.device, given: torch.Tensor | None) -> torch.Tensor:
    """The micro-batch's response mask on `device`: `given` when the caller already moved it."""
    return given if given is not None else host_to_device(mb["response_mask"], device)


def packed_log_prob(
    model: nn.Module,
    mb: Batch,
    temperature: float,
    with_entropy: bool,
    device: torch.device,
    response_mask: torch.Tensor | None = None,
    sp: SequenceParallel | None = None,
    fp32_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`forward_log_prob` without padding: the decoder over the packed stream, then the LM head and
    log-softmax on the M response-predicting positions only, chunked (no (M, V) float32 tensor).
    With `sp`, each rank of the group runs its slice of the stream and the head on its M_r positions;
    the M results are gathered on every rank."""
    packed, stream = packed_stream(mb, device, sp)
    mask = response_mask_on(mb, device, response_mask)
    return stream_log_prob(model, packed, stream, temperature, with_entropy, mask, sp, fp32_logits)


def stream_log_prob(
    model: nn.Module,
    packed: PackedMicroBatch,
    stream: PackedMicroBatch | StreamShard,
    temperature: float,
    with_entropy: bool,
    mask: torch.Tensor,
    sp: SequenceParallel | None = None,
    fp32_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`packed_log_prob` of a micro-batch already packed on the device (`packed`, its (B, R) layout;
    `stream`, what this rank runs: `packed` itself without `sp`), `mask` its (B, R) response mask.
    Only device work: a CUDA graph can capture it (`fulcrum.workers.step_graphs`)."""
    hidden = packed_hidden_states(model.model, stream, sp)  # (N, H), or (n, H) with sp
    head = model.get_output_embeddings()
    logp, entropy = linear_log_softmax(
        hidden.index_select(0, stream.predictor),
        head.weight,
        stream.labels,
        temperature,
        with_entropy,
        head.bias,
        fp32_logits=fp32_logits,
    )  # (M,) or (M_r,) with sp
    if isinstance(stream, StreamShard) and sp is not None:
        logp = gather_rows(logp, stream.counts, sp)  # (M,)
        entropy = gather_rows(entropy, stream.counts, sp) if entropy is not None else None
    return packed.scatter(logp) * mask, (packed.scatter(entropy) * mask if entropy is not None else None)


def packed_values(
    model: nn.Module,
    mb: Batch,
    device: torch.device,
    response_mask: torch.Tensor | None = None,
    sp: SequenceParallel | None = None,
) -> torch.Tensor:
    """`forward_values` without padding: the value head on the M positions before response tokens
    (with `sp` as in `packed_log_prob`)."""
    packed, stream = packed_stream(mb, device, sp)
    return stream_values(model, packed, stream, response_mask_on(mb, device, response_mask), sp)


def stream_values(
    model: nn.Module,
    packed: PackedMicroBatch,
    stream: PackedMicroBatch | StreamShard,
    mask: torch.Tensor,
    sp: SequenceParallel | None = None,
) -> torch.Tensor:
    """`packed_values` of a micro-batch already packed on the device (as `stream_log_prob`)."""
    hidden = packed_hidden_states(model.model, stream, sp).index_select(0, stream.predictor)  # (M or M_r, H)
    values = model.value_from_hidden(hidden)  # (M,) or (M_r,) float32
    if isinstance(stream, StreamShard) and sp is not None:
        values = gather_rows(values, stream.counts, sp)  # (M,)
    return packed.scatter(values) * mask


def packed_stream(
    mb: Batch, device: torch.device, sp: SequenceParallel | None
) -> tuple[PackedMicroBatch, PackedMicroBatch | StreamShard]:
    """The micro-batch packed (its (B, R) layout, for `scatter`) and the stream this rank runs: the whole
    of it, or with `sp` this rank's `StreamShard`; both on `device` (the index work is done on the host)."""
    packed = pack_micro_batch(mb["input_ids"], mb["attention_mask"], mb["position_ids"], mb.prompt_length)
    if sp is None:
        packed = packed.to(device)
        return packed, packed
    return packed.to(device), shard_stream(packed, sp.size, sp.rank).to(device)


class HostInputs:
    """A micro-batch as the batch holds it (on the host): each input moved to `device` when a loss
    asks for it, the forwards packing it themselves (or running it padded)."""

    def __init__(self, batch: Batch, device: torch.device) -> None:
        self.batch = batch
        self.device = device

    def has(self, key: str) -> bool:
        return key in self.batch.tensors

    def row(self, key: str) -> torch.Tensor:
        """Its (B, R) column `key` on the device."""
        return host_to_device(self.batch[key], self.device)

    def log_prob(
        self, forwards: ModelForwardsLike, temperature: float, with_entropy: bool, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return forwards.log_prob(self.batch, temperature, with_entropy, mask)

    def values(self, forwards: ModelForwardsLike, mask: torch.Tensor) -> torch.Tensor:
        return forwards.values(self.batch, mask)


class DeviceInputs:
    """A micro-batch already on the device: its packed stream and its (B, R) columns (a CUDA graph's
    static inputs, `fulcrum.workers.step_graphs`)."""

    def __init__(self, packed: PackedMicroBatch, rows: dict[str, torch.Tensor]) -> None:
        self.packed = packed
        self.rows = rows

    def has(self, key: str) -> bool:
        return key in self.rows

    def row(self, key: str) -> torch.Tensor:
        return self.rows[key]

    def log_prob(
        self, forwards: ModelForwardsLike, temperature: float, with_entropy: bool, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return forwards.packed_log_prob(self.packed, temperature, with_entropy, mask)

    def values(self, forwards: ModelForwardsLike, mask: torch.Tensor) -> torch.Tensor:
        return forwards.packed_values(self.packed, mask)


MicroInputs = HostInputs | DeviceInputs


class ModelForwardsLike(Protocol):
    """What the inputs call on `fulcrum.workers.forwards.ModelForwards` (which imports this module)."""

    def log_prob(
        self, mb: Batch, temperature: float, with_entropy: bool, response_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def values(self, mb: Batch, response_mask: torch.Tensor | None = None) -> torch.Tensor: ...

    def packed_log_prob(
        self, packed: PackedMicroBatch, temperature: float, with_entropy: bool, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def packed_values(self, packed: PackedMicroBatch, mask: torch.Tensor) -> torch.Tensor: ...
