"""Tiny random-initialised causal LMs with a tokenizer and chat template, for trying things and tests.

`fulcrum tiny-model --out DIR [--arch qwen2|llama]` writes a Hugging Face model folder
(safetensors weights, `config.json`, `generation_config.json`, tokenizer files, chat template) that
`AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` load offline.
The default size (hidden 128, 4 layers, 4 query / 2 KV heads, vocab 2,048) has about 1.3 M
parameters: a PPO step on the CPU takes seconds, while the shapes still exercise grouped-query
attention, rotary embeddings and (qwen2) attention biases as the real models do. `--size
small|medium|large` gives about 11 M, 27 M and 47 M parameters (`SIZES`), big enough to learn
multi-step arithmetic on a GPU (`bench/learning.py`); explicit `--hidden-size` etc. override a preset.

The same seed gives the same weights, byte for byte; the tokenizer is the shipped byte-level BPE of
`fulcrum.models.tiny_tokenizer`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from fulcrum.models.tiny_tokenizer import CHAT_TEMPLATE, IM_END, PAD_TOKEN, load_tokenizer

ARCHS = ("qwen2", "llama")

# Defaults of every size option; `build_tiny_model(..., **size)` overrides any of them.
DEFAULT_SIZE: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 352,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}


# Named presets (`--size`); each is DEFAULT_SIZE with these keys replaced. Parameter counts (qwen2,
# vocab 2,048, untied): tiny 1.3 M, small 11 M, medium 27 M, large 47 M (`count_parameters_of`).
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "small": {
        "hidden_size": 384,
        "num_hidden_layers": 6,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "intermediate_size": 1024,
    },
    "medium": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 1536,
    },
    "large": {
        "hidden_size": 640,
        "num_hidden_layers": 10,
        "num_attention_heads": 10,
        "num_key_value_heads": 2,
        "intermediate_size": 1792,
    },
}


def build_tokenizer() -> Any:
    """The tiny models' tokenizer as a `transformers` fast tokenizer, eos `<|im_end|>`, pad `<|endoftext|>`."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=load_tokenizer(),
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        # Cleaning up spaces before punctuation on decode would break `decode(encode(s)) == s`.
        clean_up_tokenization_spaces=False,
        model_max_length=DEFAULT_SIZE["max_position_embeddings"],
    )


def _model_config(arch: str, vocab_size: int, eos_id: int, pad_id: int, size: dict[str, Any]) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}: expected one of {', '.join(ARCHS)}")
    unknown = sorted(set(size) - set(DEFAULT_SIZE))
    if unknown:
        raise ValueError(f"unknown size option(s) {unknown}: expected some of {sorted(DEFAULT_SIZE)}")
    dims = {**DEFAULT_SIZE, **size}
    if dims["hidden_size"] % dims["num_attention_heads"]:
        raise ValueError(
            f"hidden_size={dims['hidden_size']} is not a multiple of num_attention_heads={dims['num_attention_heads']}"
        )
    if dims["num_attention_heads"] % dims["num_key_value_heads"]:
        raise ValueError(
            f"num_attention_heads={dims['num_attention_heads']} is not a multiple of "
            f"num_key_value_heads={dims['num_key_value_heads']}"
        )
    config_class = Qwen2Config if arch == "qwen2" else LlamaConfig
    return config_class(
        vocab_size=vocab_size,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        **dims,
    )


def build_tiny_model(out_dir: str | Path, arch: str = "qwen2", seed: int = 0, **size: Any) -> Path:
    """Write a random-initialised `arch` model and its tokenizer to `out_dir`; return the folder.

    size: any of DEFAULT_SIZE's keys (hidden_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, intermediate_size, max_position_embeddings, tie_word_embeddings).
    The global torch RNG is left as it was.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    tokenizer = build_tokenizer()
    eos_id, pad_id = tokenizer.convert_tokens_to_ids([IM_END, PAD_TOKEN])
    # The embedding has exactly one row per token, so sampling can never produce an id the
    # tokenizer cannot decode.
    config = _model_config(arch, len(tokenizer), eos_id, pad_id, size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _portable_tokenizer_config(out / "tokenizer_config.json")
    return out


def build_tiny_reward_model(
    out_dir: str | Path, arch: str = "qwen2", seed: int = 0, chat_template: str | None = None, **size: Any
) -> Path:
    """Write a random-initialised sequence-classification model (one label: a reward model) and its
    tokenizer to `out_dir`. `chat_template` replaces the tiny chat template (a reward model whose
    template differs from the policy's). The global torch RNG is left as it was."""
    from transformers import AutoModelForSequenceClassification

    out = Path(out_dir)
    tokenizer = build_tokenizer()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    eos_id, pad_id = tokenizer.convert_tokens_to_ids([IM_END, PAD_TOKEN])
    config = _model_config(arch, len(tokenizer), eos_id, pad_id, size)
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _portable_tokenizer_config(out / "tokenizer_config.json")
    return out


def _portable_tokenizer_config(path: Path) -> None:
    """Name the class every transformers release knows (4.x has no `TokenizersBackend`).

    `<|im_start|>` needs no entry: it is a special token of tokenizer.json itself, so decoding with
    `skip_special_tokens=True` drops it. With transformers 5, AutoTokenizer still picks
    `Qwen2Tokenizer` for model_type qwen2 whatever this says; that class rebuilds the same BPE (the
    same split pattern) but adds an NFC normaliser, so it is lossless on NFC text (all of GSM8K).
    """
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2) + "\n")


def existing_model_files(folder: Path) -> list[str]:
    """Files of a model folder (config, weights, tokenizer) already in `folder`: tiny-model will not overwrite them."""
    if not folder.is_dir():
        return []
    patterns = ("config.json", "generation_config.json", "*.safetensors", "tokenizer*", "*.bin")
    return sorted({p.name for pattern in patterns for p in folder.glob(pattern)})


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())


def count_parameters_of(arch: str = "qwen2", **size: Any) -> int:
    """Parameters of the model `build_tiny_model(arch=arch, **size)` would write, without allocating it."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    eos_id, pad_id = tokenizer.convert_tokens_to_ids([IM_END, PAD_TOKEN])
    config = _model_config(arch, len(tokenizer), eos_id, pad_id, size)
    with torch.device("meta"):
        return count_parameters(AutoModelForCausalLM.from_config(config))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fulcrum tiny-model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder to write the model into (created if missing)")
    parser.add_argument("--arch", choices=ARCHS, default="qwen2")
    parser.add_argument("--seed", type=int, default=0, help="weights are a function of the seed")
    parser.add_argument(
        "--size",
        choices=tuple(SIZES),
        default="tiny",
        help="preset: tiny ~1.3M, small ~11M, medium ~27M, large ~47M parameters; the options below override it",
    )
    parser.add_argument("--hidden-size", type=int, default=None)
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--num-heads", type=int, default=None)
    parser.add_argument("--num-kv-heads", type=int, default=None)
    parser.add_argument("--intermediate-size", type=int, default=None)
    parser.add_argument("--max-position-embeddings", type=int, default=None)
    parser.add_argument(
        "--tie-word-embeddings", action="store_true", help="share the input embedding and LM head"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    taken = existing_model_files(Path(args.out))
    if taken:  # never overwrite a model folder: --out may be a user's real checkpoint
        print(
            f"fulcrum tiny-model: --out {args.out} already holds {', '.join(taken)}; choose a new or empty folder",
            file=sys.stderr,
        )
        return 1
    try:
        explicit = {
            "hidden_size": args.hidden_size,
            "num_hidden_layers": args.num_layers,
            "num_attention_heads": args.num_heads,
            "num_key_value_heads": args.num_kv_heads,
            "intermediate_size": args.intermediate_size,
            "max_position_embeddings": args.max_position_embeddings,
            "tie_word_embeddings": args.tie_word_embeddings or None,
        }
        size = {**SIZES[args.size], **{k: v for k, v in explicit.items() if v is not None}}
        out = build_tiny_model(args.out, arch=args.arch, seed=args.seed, **size)
        millions = count_parameters_of(args.arch, **size) / 1e6
    except ValueError as err:
        print(f"fulcrum tiny-model: {err}", file=sys.stderr)
        return 2
    print(f"wrote a {args.size} {args.arch} model ({millions:.1f} M parameters) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
