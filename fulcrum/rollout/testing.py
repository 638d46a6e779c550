"""Random-weight models of the native engine's families built from a config alone, for parity tests and benchmarks.

No tokenizer and no files: the rollout engines work on token ids, so a model is all they need.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

QWEN25_05B_SHAPE = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)

TINY_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def random_causal_lm(
    arch: str = "qwen2", seed: int = 0, dtype: torch.dtype = torch.float32, init_std: float = 0.02, **shape
) -> nn.Module:
    """A randomly initialised `arch` (a `model_type`: "qwen2", "llama", "qwen3", "mistral") causal LM
    with TINY_SHAPE overridden by `shape` (any field of the config class, e.g. `head_dim`, `rope_scaling`).

    `init_std` scales the random weights; a larger value gives peakier next-token distributions, so
    that greedy parity tests are not decided by near-ties.
    """
    sizes = {**TINY_SHAPE, **shape}
    try:
        config = AutoConfig.for_model(arch, **sizes, initializer_range=init_std)
    except ValueError as err:
        raise ValueError(f"random_causal_lm: unknown arch {arch!r} (a transformers model_type)") from err
    config.eos_token_id = 1
    config.pad_token_id = 0
    config.bos_token_id = 2
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.eval()
