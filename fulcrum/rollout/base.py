"""The rollout protocol: the one seam every generation backend (`native`, `hf`) implements.

A backend takes prompt token ids and sampling parameters and returns, per sample, the response
token ids, the log-probability of each sampled token under the sampling distribution, and why the
sample stopped. Samples are ordered prompt-major: sample j of prompt i is at index i * n + j.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

# "abort": cut off by `suspend` before it ended, held to be continued (partial rollouts)
FinishReason = Literal["stop", "length", "abort"]


@dataclass
class SamplingParams:
    """How to sample. `temperature == 0` means greedy; `top_k <= 0` and `top_p == 1` mean no filter."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's EOS
    ignore_eos: bool = False  # benchmarks: always generate max_tokens
    seed: int | None = None

    def __post_init__(self) -> None:
        assert self.n >= 1, f"n must be >= 1, got {self.n}"
        assert self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"
        assert 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"
        assert self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RolloutOutput:
    """Per sample (prompt-major, len = num_prompts * n): response ids, their log-probs, finish reason.

    A response that stopped on EOS or a stop id includes that token (its log-prob too), as vLLM and
    verl do, so the reward and the loss see the end of the answer.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[FinishReason]
    prompt_index: list[int]


@dataclass
class SequenceOutput:
    """One finished turn of one sample of a request (the request API: `RequestEngine`).

    `token_ids` is the whole response so far, every turn of it: the tokens the policy sampled and the
    ones appended between turns (a tool's answer). `logprobs` has one entry per response token (0.0
    for appended ones, which were not sampled) and `loss_mask` is 1 where the policy sampled the
    token: `fulcrum.batch.assemble_batch(loss_masks=...)` takes it as it is. `turn_start` is where
    this turn's sampled tokens begin in `token_ids` (`last_turn`), for a parser of tool calls.
    `seq_id` names this sample for `resume` / `release`; `request_id` is the id `add_request`
    returned (sample j of a request with n samples has seq_id = request_id + j).
    """

    seq_id: int
    request_id: int
    token_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    finish_reason: FinishReason
    turn_start: int
    held: bool  # its KV blocks are kept for a next turn (until `resume` or `release`)

    @property
    def last_turn(self) -> list[int]:
        """The tokens sampled in this turn."""
        return self.token_ids[self.turn_start :]


class RequestEngine(Protocol):
    """Requests one by one, continued over turns: what an agent loop needs of a backend.

    Temperature, top-p and top-k are shared by everything in flight (one sampler runs over the whole
    batch); each request has its own `n`, `max_tokens`, stop ids and `ignore_eos`.
    """

    def add_request(self, prompt: list[int], params: SamplingParams, keep: bool = False) -> int:
        """Queue `params.n` samples of `prompt`; returns the request id. `keep`: hold each sample's KV
        blocks when it finishes, for `resume`."""
        ...

    def resume(self, seq_id: int, tokens: list[int], params: SamplingParams, keep: bool = False) -> None:
        """Append `tokens` to held sample `seq_id` (not sampled: loss mask 0) and sample up to
        `params.max_tokens` more; only the tokens not yet in the KV cache are prefilled."""
        ...

    def step(self) -> list[SequenceOutput]:
        """Run one scheduler round (a prefill step or a decode window); the turns it finished."""
        ...

    def release(self, seq_id: int) -> None:
        """Forget held sample `seq_id` and free its KV blocks."""
        ...

    def has_unfinished_requests(self) -> bool:
        """Whether a queued or running turn remains (held samples do not count)."""
        ...


class RolloutEngine(Protocol):
    """What the trainer needs of a generation backend."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """Sample `params.n` responses for every prompt (token ids without padding).

        The backend owns its KV cache: it takes it for the call and, with `rollout.free_cache_engine`,
        releases it before returning, so callers never wake or sleep it around generation.
        """
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the actor's current weights (Hugging Face names) in place, without touching disk."""
        ...

    def wake_up(self) -> None:
        """Take the KV cache (again) ahead of generation (`generate` does it when needed)."""
        ...

    def sleep(self) -> None:
        """Release the KV cache now (`generate` does it itself under `free_cache_engine`)."""
        ...

    def close(self) -> None:
        """Release what the backend holds on the device (cache, CUDA graphs) at the end of a run, before
        the process group is left: graphs that captured collectives would block its teardown."""
        ...
