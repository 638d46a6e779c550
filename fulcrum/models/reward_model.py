"""Model-based rewards (`reward_model.enable=True`): a Hugging Face classification model scores each
(prompt, response), with verl's semantics (its RewardModelWorker):

- the checkpoint (`reward_model.model.path`) is a sequence- or token-classification model with one label;
  it is loaded as a token classifier (the same `score` head), so every position has a score, and the
  reward is the score at the last token of the response;
- when the reward model's tokenizer is not the policy's (another vocabulary or chat template), the
  conversation is re-rendered with the reward model's own chat template: the prompt's chat messages,
  then the decoded response as the assistant turn (the policy's EOS text removed), tokenised with
  the reward model's tokenizer and cut to `reward_model.max_length` from the right (verl's default);
  with the same tokenizer the policy's tokens are scored as they are (the last max_length of them);
- forwards run in micro-batches of `reward_model.micro_batch_size_per_gpu` rows, without gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fulcrum.models.load import NO_HUB_KERNELS, _check_model_dir, autocast_for, load_tokenizer

KEY = "reward_model.model.path"


def load_reward_model(path: str, device: torch.device) -> nn.Module:
    """The checkpoint as `AutoModelForTokenClassification` with one label, float32, eval mode, on `device`."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    _check_model_dir(path, KEY)
    config = AutoConfig.from_pretrained(path)
    labels = getattr(config, "num_labels", 1)
    if labels != 1:
        raise ValueError(f"{KEY}: {path} has {labels} labels; a reward model has one (a scalar score)")
    config.num_labels = 1
    model = AutoModelForTokenClassification.from_pretrained(
        path, config=config, dtype=torch.float32, **NO_HUB_KERNELS
    )
    return model.to(device).eval()


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers produce the same ids and render chats alike (then no re-templating)."""
    return a.get_vocab() == b.get_vocab() and getattr(a, "chat_template", None) == getattr(
        b, "chat_template", None
    )


class RewardModel:
    """Scores (prompt, response) pairs: `score(...)` returns (B,) float32 on the CPU."""

    def __init__(
        self,
        path: str,
        policy_tokenizer: Any,
        device: torch.device,
        micro_batch_size: int | None = None,
        max_length: int | None = None,
    ) -> None:
        self.model = load_reward_model(path, device)
        self.tokenizer = load_tokenizer(path, key=KEY)
        self.policy_tokenizer = policy_tokenizer
        self.device = device
        self.micro_batch_size = micro_batch_size or 8
        self.max_length = max_length
        self.switch_template = not same_tokenizer(self.tokenizer, policy_tokenizer)

    def reward_inputs(
        self,
        prompt_ids: Sequence[Sequence[int]],
        response_ids: Sequence[Sequence[int]],
        chats: Sequence[Sequence[dict[str, str]]] | None = None,
    ) -> list[list[int]]:
        """The token ids the reward model reads for each row (see the module docstring)."""
        if not self.switch_template:
            rows = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
            return [row[-self.max_length :] if self.max_length else row for row in rows]
        if chats is None:
            raise ValueError(
                f"{KEY}: the reward model's tokenizer differs from the policy's, so its chat template is applied "
                "to the prompt's messages; the batch carries none"
            )
        eos = self.policy_tokenizer.eos_token or ""
        rows = []
        for chat, response in zip(chats, response_ids, strict=True):
            text = self.policy_tokenizer.decode(list(response))
            if eos:
                text = text.replace(eos, "")
            conversation = [*list(chat), {"role": "assistant", "content": text}]
            rendered = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=False, tokenize=False
            )
            ids = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
            rows.append(ids[: self.max_length] if self.max_length else ids)
        return rows

    @torch.no_grad()
    def score_ids(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Score at the last token of each row of ids: (B,) float32 on the CPU."""
        pad = int(self.tokenizer.pad_token_id)
        scores = []
        for start in range(0, len(rows), self.micro_batch_size):
            chunk = rows[start : start + self.micro_batch_size]
            lengths = torch.tensor([len(r) for r in chunk])
            if (lengths == 0).any():
                raise ValueError(f"{KEY}: an empty input row (rows {start}..{start + len(chunk) - 1})")
            input_ids = torch.full((len(chunk), int(lengths.max())), pad, dtype=torch.long)
            attention_mask = torch.zeros_like(input_ids)
            for i, row in enumerate(chunk):  # right-padded: the last token sits at length - 1
                input_ids[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
                attention_mask[i, : len(row)] = 1
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            with autocast_for(self.device):
                logits = self.model(
                    input_ids=input_ids.to(self.device),
                    attention_mask=attention_mask.to(self.device),
                    position_ids=position_ids.to(self.device),
                ).logits  # (b, L, 1)
            last = (lengths - 1).to(self.device)
            scores.append(logits[torch.arange(len(chunk), device=self.device), last, 0].float().cpu())
        return torch.cat(scores) if scores else torch.zeros(0)

    def score(
        self,
        prompt_ids: Sequence[Sequence[int]],
        response_ids: Sequence[Sequence[int]],
        chats: Sequence[Sequence[dict[str, str]]] | None = None,
    ) -> torch.Tensor:
        return self.score_ids(self.reward_inputs(prompt_ids, response_ids, chats))
