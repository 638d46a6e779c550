"""`Batch`: the samples of one step, as padded tensors plus per-sample Python values (verl's DataProto).

Layout (verl's): `prompts` (B, P) left-padded, `responses` (B, R) right-padded, `input_ids` =
cat(prompts, responses) (B, P + R) with its `attention_mask` and `position_ids`, and
`response_mask` (B, R). Two masks, two meanings (verl's): `attention_mask` marks the tokens in the
sequence for every forward pass (a response is one contiguous run from column P); `response_mask` is
the loss mask, 1 = a token the policy generated (EOS included) that counts in every loss, advantage,
KL and entropy, 0 for tokens inside the response the policy did not generate (a tool's answer, a user
turn) and for padding. They coincide for single-turn batches. A response's length and last token come
from the attention mask (`response_lengths`), never from the loss mask; its score goes on its last policy
token (`reward_positions`). Stages add tensors in place:
`old_log_probs`, `ref_log_prob`, `values`, `token_level_scores`, `token_level_rewards`,
`advantages`, `returns`, `rollout_log_probs`, `entropys`. `assemble_batch` builds one from the rollout
engine's output. This module sits below `workers/` and `trainer/`, which both pass it around.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; a CPU tensor bound for CUDA goes as an asynchronous copy from pinned memory.

    Why: a plain `.to("cuda")` of ordinary (pageable) memory ends in `cudaStreamSynchronize`, so the
    host waits until the GPU has run everything queued before it. The updates moved four small tensors
    per micro-batch that way (133 synchronisations in one seed-size actor update, profiled): each
    emptied the GPU's queue, which then idled while the host launched the next layers. The pinned
    staging buffer is kept by torch's host allocator until the copy has run, so the caller may drop
    `tensor` at once.
    """
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor]
    non_tensors: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        sizes.update({k: len(v) for k, v in self.non_tensors.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on the number of samples: {sizes}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return int(v.shape[0])
        for v in self.non_tensors.values():
            return len(v)
        return 0

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if len(self) and value.shape[0] != len(self):
            raise ValueError(f"tensor {key!r} has {value.shape[0]} rows, the batch has {len(self)}")
        self.tensors[key] = value

    @property
    def response_length(self) -> int:
        return int(self.tensors["responses"].shape[1])

    @property
    def prompt_length(self) -> int:
        return int(self.tensors["prompts"].shape[1])

    def select(self, index: torch.Tensor | list[int]) -> Batch:
        """The samples at `index` (in that order).

        `index_select` rather than `v[idx]`: the same rows, several times faster on the CPU for a
        (512, 768) int64 tensor, and an update cuts every mini-batch into micro-batches this way."""
        idx = torch.as_tensor(index, dtype=torch.long)
        idx_list = idx.tolist()
        return Batch(
            {k: v.index_select(0, idx.to(v.device)) for k, v in self.tensors.items()},
            {k: [v[i] for i in idx_list] for k, v in self.non_tensors.items()},
        )

    def split(self, size: int) -> list[Batch]:
        """Consecutive chunks of `size` samples (the last may be smaller)."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        n = len(self)
        return [self.select(list(range(s, min(s + size, n)))) for s in range(0, n, size)]

    def to(self, device: torch.device) -> Batch:
        return Batch({k: host_to_device(v, device) for k, v in self.tensors.items()}, dict(self.non_tensors))

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    @staticmethod
    def concat(batches: list[Batch]) -> Batch:
        keys = batches[0].tensors.keys()
        nkeys = batches[0].non_tensors.keys()
        return Batch(
            {k: torch.cat([b.tensors[k] for b in batches]) for k in keys},
            {k: [x for b in batches for x in b.non_tensors[k]] for k in nkeys},
        )


def response_lengths(batch: Batch) -> torch.Tensor:
    """(B,) long: the tokens of each response that are in the sequence (the attention mask over the
    response part), so `responses[i, : n_i]` is response i and `n_i - 1` its last token.

    Not `response_mask.sum`: the loss mask leaves out tool answers and user turns inside a response, and
    rollout rejection zeroes whole rows of it, yet those tokens are still part of the response.
    """
    return batch["attention_mask"][:, batch.prompt_length :].sum(-1).long()


def reward_positions(batch: Batch) -> torch.Tensor:
    """(B,) long: where each response's score goes, the last token the policy wrote (the last 1 of the
    loss mask `response_mask`); a row without one (a rejected row, whose loss mask is zeroed) takes its
    last token, `response_lengths - 1` (-1 for an empty response: no score is placed).

    A multi-turn response can end in tokens the policy did not write (an Interaction's last reply, cut
    at the response budget). A score there would be lost: GAE passes over masked tokens and GRPO sums
    the row under the mask. It rewards the policy's last action, so it sits on that action's token.
    """
    mask = batch["response_mask"].bool()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last_policy = torch.where(mask, positions, -1).max(-1).values
    return torch.where(last_policy >= 0, last_policy, response_lengths(batch) - 1).long()


def assemble_batch(
    items: list[dict[str, Any]],
    token_ids: list[list[int]],
    logprobs: list[list[float]],
    prompt_index: list[int],
    max_prompt_length: int,
    response_length: int,
    pad_id: int,
    uid_prefix: str,
    loss_masks: list[list[int]] | None = None,
) -> Batch:
    """verl's layout: prompts left-padded to max_prompt_length, responses right-padded to response_length.

    `loss_masks[i]` (one 0/1 per token of `token_ids[i]`) marks the tokens the policy generated; None
    means all of them (single-turn). The attention mask covers every response token either way.
    """
    if loss_masks is not None and [len(m) for m in loss_masks] != [len(t) for t in token_ids]:
        raise ValueError("loss_masks must give one 0/1 per response token of every sample")
    prompt_rows = [items[i]["input_ids"][-max_prompt_length:] for i in prompt_index]
    response_rows = [ids[:response_length] for ids in token_ids]
    kept = [len(r) for r in response_rows]
    prompts, prompt_mask = padded_rows(prompt_rows, max_prompt_length, pad_id, torch.long, left=True)
    responses, response_attention = padded_rows(response_rows, response_length, pad_id, torch.long)
    response_mask = response_attention.clone()  # the loss mask: every response token, unless told
    if loss_masks is not None:
        masks = [m[:k] for m, k in zip(loss_masks, kept, strict=True)]
        response_mask = padded_rows(masks, response_length, 0, torch.long)[0]
    lps = [lp[:k] for lp, k in zip(logprobs, kept, strict=True)]
    if [len(lp) for lp in lps] != kept:
        raise ValueError("logprobs must give one log-prob per response token of every sample")
    rollout_lp = padded_rows(lps, response_length, 0.0, torch.float32)[0]
    attention_mask = torch.cat([prompt_mask, response_attention], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    non_tensors = {
        "data_source": [items[i].get("data_source", "") for i in prompt_index],
        "ground_truth": [items[i].get("ground_truth", "") for i in prompt_index],
        "extra_info": [items[i].get("extra_info") or {} for i in prompt_index],
        "uid": [f"{uid_prefix}-{i}" for i in prompt_index],
        "raw_prompt": [
            items[i].get("raw_prompt") for i in prompt_index
        ],  # chat messages (a reward model's template)
    }
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask,
            "rollout_log_probs": rollout_lp,
        },
        non_tensors,
    )


def padded_rows(
    rows: list[Sequence[Any]], width: int, pad: float, dtype: torch.dtype, left: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of at most `width` values as one (len(rows), width) tensor padded with `pad` on the right (on
    the left with `left`), and its 0/1 mask (long) of the real entries.

    One flat copy through numpy instead of a tensor a row: a step assembles its prompts, responses and
    log-probs this way inside its `gen` time, with the device idle, so the host's time is the step's."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    cols = np.arange(width)
    real = cols >= width - lengths[:, None] if left else cols < lengths[:, None]
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    out = np.full((len(rows), width), pad, dtype=np_dtype)
    out[real] = np.fromiter(itertools.chain.from_iterable(rows), dtype=np_dtype, count=int(lengths.sum()))
    return torch.from_numpy(out), torch.from_numpy(real.astype(np.int64))
