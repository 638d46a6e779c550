"""Random-weight models of the native engine's families built from a config alone, for parity tests and benchmarks.

No tokenizer and no files: the rollout engines work on token ids, so a model is all they need.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from fulcrum.batch import Batch

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


def scoring_batch(prompts: list[list[int]], responses: list[list[int]]) -> Batch:
    """Rollouts as the trainer scores them: left-padded prompts, right-padded responses (verl's layout),
    every response token in the response mask; an empty response is a row of padding."""
    p, r = max(map(len, prompts)), max(max(map(len, responses)), 1)
    rows = len(responses)
    prompt_ids, prompt_mask = torch.zeros(rows, p, dtype=torch.long), torch.zeros(rows, p, dtype=torch.long)
    response_ids, response_mask = (
        torch.zeros(rows, r, dtype=torch.long),
        torch.zeros(rows, r, dtype=torch.long),
    )
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        prompt_ids[i, p - len(prompt) :], prompt_mask[i, p - len(prompt) :] = torch.tensor(prompt), 1
        if response:
            response_ids[i, : len(response)], response_mask[i, : len(response)] = torch.tensor(response), 1
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    tensors = {"prompts": prompt_ids, "responses": response_ids, "response_mask": response_mask}
    tensors |= {"input_ids": torch.cat([prompt_ids, response_ids], 1), "attention_mask": attention_mask}
    return Batch(tensors | {"position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0)})
