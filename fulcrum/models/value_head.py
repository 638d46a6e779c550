"""The critic: a Hugging Face backbone (`AutoModel`) plus a scalar value head, Linear(hidden, 1).

Attribute names follow `AutoModelForTokenClassification` (`model` = backbone, `score` = head), the
model class verl uses for its critic, so a saved critic state dict loads into
`AutoModelForTokenClassification.from_pretrained(..., num_labels=1)` unchanged. A backbone that is the
text model of a multimodal folder (Qwen3.5's `qwen3_5`) has no token classifier of its own in
transformers: its folder is the multimodal model's (`folder_config`, the backbone's weights under
`model.language_model.`, `folder_name`), whose vision tower a text critic never runs.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from fulcrum.models.load import enable_gradient_checkpointing
from fulcrum.models.logprob import no_empty_rows_mask

BACKBONE = "model"  # the backbone's attribute, as in XxxForTokenClassification
TEXT_MODEL = "model.language_model"  # where a multimodal token classifier holds its text model


class CriticModel(nn.Module):
    """values = score(backbone(input_ids).last_hidden_state).squeeze(-1): (B, T) from (B, T)."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.model = backbone
        self.config = backbone.config
        hidden = int(backbone.config.hidden_size)
        self.score = nn.Linear(hidden, 1)
        std = float(getattr(backbone.config, "initializer_range", 0.02))
        # Small weights, zero bias: initial values near 0 so the first value loss is the return's scale.
        nn.init.normal_(self.score.weight, mean=0.0, std=std)
        nn.init.zeros_(self.score.bias)
        self.score.to(next(backbone.parameters()).device)
        # The multimodal folder's config when the backbone is its text model (`load_backbone`), else None.
        self.multimodal_config: Any = getattr(backbone, "fulcrum_multimodal_config", None)

    def folder_config(self) -> Any:
        """The config of the Hugging Face folder this critic is written as: the backbone's, or the
        multimodal folder's with the backbone's as its `text_config`."""
        if self.multimodal_config is None:
            return self.config
        out = copy.deepcopy(self.multimodal_config)
        out.text_config = copy.deepcopy(self.config)
        return out

    def folder_name(self, name: str) -> str:
        """A parameter's name in the folder: as here, or the backbone's under `model.language_model.`
        (the multimodal model's base holds its text model there)."""
        if self.multimodal_config is not None and name.startswith(f"{BACKBONE}."):
            return f"{TEXT_MODEL}.{name[len(BACKBONE) + 1 :]}"
        return name

    def own_name(self, name: str) -> str:
        """`folder_name`'s inverse: a folder's parameter name -> its name here."""
        if self.multimodal_config is not None and name.startswith(f"{TEXT_MODEL}."):
            return f"{BACKBONE}.{name[len(TEXT_MODEL) + 1 :]}"
        return name

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        enable_gradient_checkpointing(self.model)

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T)
        attention_mask: torch.Tensor | None = None,  # (B, T)
        position_ids: torch.Tensor | None = None,  # (B, T)
    ) -> torch.Tensor:
        if attention_mask is not None:
            attention_mask = no_empty_rows_mask(self.model, attention_mask)
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        return self.value_from_hidden(out.last_hidden_state)  # (B, T)

    def value_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """score(hidden) in float32: (..., H) → (...), so the value is not rounded to bf16."""
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            return self.score(hidden.float()).squeeze(-1)
