"""One sequence in the engine: its tokens, how many of them are in the KV cache, its blocks, its output."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from fulcrum.rollout.base import FinishReason


class Status(Enum):
    WAITING = "waiting"  # needs (re)prefill
    RUNNING = "running"  # decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A prompt (and, once sampling starts, one response to it), over one or more turns.

    A new prompt is one Sequence with `num_samples = n`: it is prefilled once and then forked into n
    sequences that share the prompt's full KV blocks. `output_index` is its id (for `generate`, its
    place in the result: prompt i, sample j -> base + i * n + j); the forks get consecutive ids.

    The response is every token after the first `num_prompt_tokens`: the turns the policy sampled and
    the tokens appended between them (a tool's answer). `appended` holds the spans of the latter, in
    response positions, so that the loss mask is built once per output, not once per token;
    `turn_start` is where the current turn's sampled tokens begin (its `max_tokens` counts from there).
    """

    token_ids: list[int]
    num_prompt_tokens: int
    output_index: int
    max_tokens: int
    num_samples: int = 1
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    logprobs: list[float] = field(default_factory=list)  # one per response token; 0.0 where appended
    finish_reason: FinishReason | None = None
    stop_ids: frozenset[int] = frozenset()
    keep: bool = False  # on finishing, hold the blocks so that a next turn prefills only its new tokens
    request_id: int = -1  # the output_index of sample 0 of the request (-1: this sequence's own)
    turn_start: int = -1  # -1: num_prompt_tokens
    appended: list[tuple[int, int]] = field(default_factory=list)
    state_slot: int = -1  # hybrid models: its recurrent-state slot (with its blocks), -1 while it has none

    def __post_init__(self) -> None:
        if self.turn_start < 0:
            self.turn_start = self.num_prompt_tokens
        if self.request_id < 0:
            self.request_id = self.output_index

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        """Tokens sampled in the current turn."""
        return len(self.token_ids) - self.turn_start

    @property
    def response(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def loss_mask(self) -> list[int]:
        """One 0/1 per response token: 1 where the policy sampled it, 0 where it was appended."""
        mask = [1] * (len(self.token_ids) - self.num_prompt_tokens)
        for start, end in self.appended:
            mask[start:end] = [0] * (end - start)
        return mask

    def extend(self, tokens: list[int], max_tokens: int, stop_ids: frozenset[int], keep: bool) -> None:
        """Append `tokens` (not sampled: log-prob 0.0, loss mask 0) and open a new turn of up to
        `max_tokens` sampled tokens. The K/V already computed stay; only the rest is prefilled."""
        start = len(self.token_ids) - self.num_prompt_tokens
        self.token_ids.extend(tokens)
        self.logprobs.extend([0.0] * len(tokens))
        if tokens:
            self.appended.append((start, start + len(tokens)))
        self.turn_start = len(self.token_ids)
        self.max_tokens = max_tokens
        self.stop_ids = stop_ids
        self.keep = keep
        self.finish_reason = None
        self.status = Status.WAITING

    def fork(self, output_index: int) -> Sequence:
        """A sibling with the same tokens so far (the caller gives it its blocks)."""
        return Sequence(
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            output_index=output_index,
            max_tokens=self.max_tokens,
            num_computed=self.num_computed,
            status=self.status,
            logprobs=list(self.logprobs),
            stop_ids=self.stop_ids,
            keep=self.keep,
            request_id=self.request_id,
            turn_start=self.turn_start,
            appended=list(self.appended),
        )
