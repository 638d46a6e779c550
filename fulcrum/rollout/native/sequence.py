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
    """A prompt (and, once sampling starts, one response to it).

    A new prompt is one Sequence with `num_samples = n`: it is prefilled once and then forked into n
    sequences that share the prompt's full KV blocks. `output_index` is its place in the result
    (prompt-major: prompt i, sample j -> i * n + j); the forks get consecutive indices.
    """

    token_ids: list[int]
    num_prompt_tokens: int
    output_index: int
    max_tokens: int
    num_samples: int = 1
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def response(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

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
        )
