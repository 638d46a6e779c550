"""Mistral: `model_type` mistral. Llama's layout without biases, and a sliding window on every layer
(a token sees the `sliding_window` latest positions, itself included).

The engine's attention kernels have no window, so it runs a config whose window covers every
sequence it serves (null, or at least `rollout.max_model_len`; Mistral-7B v0.2 and later have none),
where windowed and full attention are the same function. The training paths apply the window: the
padded one in its mask (`fulcrum.models.logprob.no_empty_rows_mask`), the packed one in its
attention (`fulcrum.models.packed.packed_attention`).
"""

from __future__ import annotations

from typing import Any

from fulcrum.models.arch.spec import COMMON, ModelSpec, Runs, config_value, never


def window_covers(window: Any, config: Any, max_model_len: int | None) -> bool:
    """Whether no sequence the engine runs is longer than the window (when the engine's longest is
    not known: the model's max_position_embeddings)."""
    longest = max_model_len or config_value(config, "max_position_embeddings")
    return window is None or (longest is not None and int(window) >= int(longest))


SPEC = ModelSpec(
    model_type="mistral",
    fields={
        **COMMON,
        "sliding_window": Runs(window_covers, "a window of at least rollout.max_model_len, or none"),
    },
    qkv_bias=never,
    window=lambda config: config_value(config, "sliding_window"),
)
