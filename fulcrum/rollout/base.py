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

FinishReason = Literal["stop", "length"]


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
