"""The random-weight model shapes the GPU benchmarks measure, by name (`--shape` of bench/rollout.py and
`bench/train_step.py make-model`).

    python bench/rollout.py --shape qwen3-0.6b --skip-hf --json rollout_qwen3.json
    python bench/train_step.py make-model --shape qwen3-moe-small --out .bench/qwen3-moe-small

qwen2.5-0.5b    the reference shape of every GPU figure (hidden 896, 24 layers, 14 heads / 2 KV heads,
                intermediate 4864, vocabulary 151,936, tied embeddings)
qwen3-0.6b      Qwen3-0.6B's: QK-norm, 16 heads of 128 over a hidden size of 1024, 28 layers, 8 KV
                heads, intermediate 3072, tied embeddings
qwen3-moe-small a small Qwen3-MoE: Qwen3-30B-A3B's layout (128-wide heads, top-8 of 128 experts of 768)
                scaled down to hidden 1024, 16 layers, 32 experts of 384, top 4 (1.0B parameters; 0.47B
                active a token, 0.16B of them outside the embedding and the LM head), so that a step fits
                beside the others in one call
qwen3.5-0.8b    Qwen3.5-0.8B's text model (its `text_config`; the vision tower left out): 24 layers, three
                Gated DeltaNet layers of four (16 key and 16 value heads of 128, a conv of 4 taps) and 6
                attention layers (8 heads / 2 KV heads of 256, an output gate, RoPE on a quarter of each
                head, base 1e7), hidden 1024, intermediate 3584, vocabulary 248,320, tied embeddings:
                0.75B parameters, 18.6 MiB of recurrent state a sequence
smollm2-135m    SmolLM2-135M-Instruct's (Llama: hidden 576, 30 layers, 9 heads / 3 KV heads of 64,
                intermediate 1536, vocabulary 49,152, tied embeddings) with random weights: the real
                model's speed without its GGUF (the engine's time does not depend on the weights, only the
                responses' lengths do: random weights run every response to its limit)
"""

from __future__ import annotations

from typing import Any

from fulcrum.rollout.testing import QWEN25_05B_SHAPE

COMMON = dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6)

# name -> (model_type, config fields)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-0.5b": ("qwen2", dict(QWEN25_05B_SHAPE)),
    "qwen3-0.6b": (
        "qwen3",
        dict(
            COMMON,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3.5-0.8b": (
        "qwen3_5_text",
        dict(
            vocab_size=248320,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
            hidden_size=1024,
            intermediate_size=3584,
            num_hidden_layers=24,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=16,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-moe-small": (
        "qwen3_moe",
        dict(
            COMMON,
            hidden_size=1024,
            intermediate_size=3072,
            moe_intermediate_size=384,
            num_experts=32,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
            tie_word_embeddings=False,
        ),
    ),
    "smollm2-135m": (
        "llama",
        dict(
            vocab_size=49152,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            tie_word_embeddings=True,
        ),
    ),
}


# A shape's family at a size the CPU trains in seconds (`tiny=True`: the smoke runs of the GPU parts): the
# same model_type and features (QK-norm, head_dim != hidden / heads, experts and top-k, tied or not), small
# numbers, and one embedding row per token of the tiny tokenizer.
TINY_FIELDS = dict(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
)
TINY_MOE_FIELDS = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
# A hybrid's: four layers, so that one of them attends (every fourth does).
TINY_LINEAR_FIELDS = dict(
    num_hidden_layers=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)


def shape_of(name: str, tiny: bool = False) -> tuple[str, dict[str, Any]]:
    """(model_type, config fields) of a named shape, or with `tiny` its family at TINY_FIELDS' size; a
    clear error naming the known ones."""
    if name not in SHAPES:
        raise SystemExit(f"--shape {name!r}: one of {', '.join(SHAPES)}")
    model_type, fields = SHAPES[name]
    if tiny:
        fields = {**fields, **TINY_FIELDS, **(TINY_MOE_FIELDS if "num_experts" in fields else {})}
        fields |= TINY_LINEAR_FIELDS if "linear_num_key_heads" in fields else {}
    return model_type, dict(fields)
