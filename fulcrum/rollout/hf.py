"""The `hf` rollout backend: a decode loop over any Hugging Face causal LM, the reference backend.

It wraps the actor's own module (hybrid engine: no copy, so `update_weights` has nothing to do),
left-pads the prompts, repeats each one `n` times (prompt-major, sample j of prompt i at i * n + j),
and decodes with the model's own KV cache in chunks of at most `max_num_seqs` sequences (its layers
pre-allocated for the chunk's whole length where the model allows, `preallocated_cache`). Sampling
and log-probs come from `fulcrum.rollout.sampling` (shared with the native engine), so both backends
sample from exactly the same distribution with the same log-prob convention.

We drive the model's forward ourselves instead of calling `model.generate` because we need the
sampled tokens' log-probs under our convention, a seeded generator of our own, and stop ids that
end one row without padding tokens after it; `generate`'s logits processors would get in the way.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from tqdm import tqdm
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from fulcrum.config.schema_rollout import RolloutConfig
from fulcrum.data.dataset import left_pad
from fulcrum.models.load import autocast_for
from fulcrum.rollout.base import FinishReason, RolloutOutput, SamplingParams
from fulcrum.rollout.sampling import sample_next


class PreallocatedLayer(DynamicLayer):
    """A `DynamicLayer` that writes into buffers of `capacity` positions instead of growing by `torch.cat`.

    transformers' dynamic layer concatenates its keys and values with each new token, copying the
    whole cache every decode step: O(B · L²) copies over a generation, 31% of a 1,319-prompt CPU
    validation (profiled). Here each step writes one position; `keys`/`values` are views of the
    filled part, so the rest of the cache machinery (sequence length, masks) reads them as before.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.filled = 0
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        new = key_states.shape[-2]
        if self.key_buffer is None:
            batch, heads, _, dim = key_states.shape
            self.key_buffer = key_states.new_empty(batch, heads, self.capacity, dim)
            self.value_buffer = value_states.new_empty(batch, value_states.shape[1], self.capacity, dim)
            self.device = key_states.device
        assert self.value_buffer is not None
        if self.filled + new > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} positions is full ({self.filled} + {new})")
        self.key_buffer[:, :, self.filled : self.filled + new].copy_(key_states)
        self.value_buffer[:, :, self.filled : self.filled + new].copy_(value_states)
        self.filled += new
        self.keys = self.key_buffer[:, :, : self.filled]
        self.values = self.value_buffer[:, :, : self.filled]
        self.is_initialized = True
        return self.keys, self.values


def preallocated_cache(model: nn.Module, capacity: int) -> DynamicCache | None:
    """A `DynamicCache` for `model` whose layers are `PreallocatedLayer`s of `capacity` positions, or
    None (the model then makes its own cache) when its layers are not all plain dynamic ones
    (sliding-window or other special layers) or this transformers version builds caches otherwise."""
    config = getattr(model, "config", None)
    try:
        cache = DynamicCache(config=config)
    except (TypeError, ValueError, AttributeError):
        return None
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    cache.layers = [PreallocatedLayer(capacity) for _ in layers]
    return cache


def cache_of(output: Any) -> Any:
    """The KV cache of a causal-LM output, under its new (`cache`) or old (`past_key_values`) name."""
    cache = output.get("cache")
    return cache if cache is not None else output.get("past_key_values")


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A generator seeded with `seed` on `device`, or None (torch's global RNG) when seed is None."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class HFRollout:
    """Generation with the wrapped Hugging Face module (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        eos_token_ids: list[int],
        pad_token_id: int,
        device: torch.device,
        max_num_seqs: int = RolloutConfig.max_num_seqs,  # the schema's default
        autocast: bool = True,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"rollout.max_num_seqs must be >= 1, got {max_num_seqs}")
        self.model = model
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        self.autocast = autocast  # bf16 autocast for an fp32 module on CUDA (the actor's master weights)
        # transformers >= 5.2x names the KV cache argument `cache`; earlier ones `past_key_values`.
        forward_params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to copy when this backend generates with the actor's own module (one process): the
        tensors are its own. A copy of the module (the actor is sharded over ranks) takes them in place.
        Every item is consumed: under FSDP each one is a collective."""
        own = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = own.get(name)
                if target is not None and target.data_ptr() != tensor.data_ptr():
                    target.copy_(tensor)

    def wake_up(self) -> None:
        """No persistent cache: the KV cache lives only inside one `generate` call."""

    def sleep(self) -> None:
        """No persistent cache to free."""

    def close(self) -> None:
        """Nothing held between calls: no cache, no CUDA graphs."""

    def _autocast(self) -> contextlib.AbstractContextManager:
        # The actor keeps fp32 master weights on GPU; generating in fp32 there would be needlessly slow.
        if self.autocast and next(self.model.parameters()).dtype == torch.float32:
            return autocast_for(self.device)
        return contextlib.nullcontext()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """Sample `params.n` responses per prompt; see `RolloutOutput` for the layout."""
        if not prompts:
            return RolloutOutput([], [], [], [])
        for index, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {index} is empty: every prompt needs at least one token")
        expanded = [prompt for prompt in prompts for _ in range(params.n)]
        prompt_index = [i for i in range(len(prompts)) for _ in range(params.n)]
        generator = make_generator(params.seed, self.device)
        stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)

        token_ids: list[list[int]] = []
        logprobs: list[list[float]] = []
        reasons: list[FinishReason] = []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self._autocast():
                starts = range(0, len(expanded), self.max_num_seqs)
                bar = tqdm(starts, desc="generation", unit="chunk", leave=False, disable=len(starts) <= 1)
                for start in bar:
                    chunk = expanded[start : start + self.max_num_seqs]
                    ids, lps, why = self._generate_chunk(chunk, params, stop_ids, generator)
                    token_ids += ids
                    logprobs += lps
                    reasons += why
        finally:
            self.model.train(was_training)
        return RolloutOutput(token_ids, logprobs, reasons, prompt_index)

    def _generate_chunk(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        stop_ids: list[int],
        generator: torch.Generator | None,
    ) -> tuple[list[list[int]], list[list[float]], list[FinishReason]]:
        input_ids, attention_mask = left_pad(prompts, self.pad_token_id)
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        batch = input_ids.shape[0]
        # Left padding shifts every row: positions count real tokens only, as in training.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        stop = torch.tensor(stop_ids, dtype=torch.long, device=self.device)
        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        steps_tokens: list[torch.Tensor] = []
        steps_logprobs: list[torch.Tensor] = []

        cache = preallocated_cache(self.model, input_ids.shape[1] + params.max_tokens)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **({self._cache_kwarg: cache} if cache is not None else {}),
        )
        past = cache_of(out)
        logits = out.logits[:, -1, :]
        next_position = position_ids[:, -1:] + 1
        for step in range(params.max_tokens):
            tokens, token_logprobs = sample_next(
                logits, params.temperature, params.top_p, params.top_k, generator
            )
            tokens = tokens.masked_fill(finished, self.pad_token_id)
            steps_tokens.append(tokens)
            steps_logprobs.append(token_logprobs)
            finished = finished | torch.isin(tokens, stop)
            if step == params.max_tokens - 1 or bool(finished.all()):
                break
            attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=-1)
            out = self.model(
                input_ids=tokens.view(-1, 1),
                attention_mask=attention_mask,
                position_ids=next_position,
                use_cache=True,
                **{self._cache_kwarg: past},
            )
            past = cache_of(out)
            logits = out.logits[:, -1, :]
            next_position = next_position + 1

        all_tokens = torch.stack(steps_tokens, dim=1).cpu().tolist()  # (B, T)
        all_logprobs = torch.stack(steps_logprobs, dim=1).float().cpu().tolist()
        stop_set = set(stop_ids)
        ids_out: list[list[int]] = []
        lps_out: list[list[float]] = []
        reasons: list[FinishReason] = []
        for row_tokens, row_logprobs in zip(all_tokens, all_logprobs, strict=True):
            end = next((i + 1 for i, tok in enumerate(row_tokens) if tok in stop_set), None)
            reasons.append("stop" if end is not None else "length")
            end = end if end is not None else len(row_tokens)
            ids_out.append(row_tokens[:end])
            lps_out.append(row_logprobs[:end])
        return ids_out, lps_out, reasons
