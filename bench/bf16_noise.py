"""How far do two equally valid bf16 forwards of one model disagree? The yardstick for the rollout-vs-training
log-prob gap (`rollout/logprob_diff_mean`) on real weights.

    python bench/bf16_noise.py --model MODEL_DIR --data ../shared/data/gsm8k/train.jsonl [--rows 8] [--json OUT]
    python bench/bf16_noise.py --model MODEL_DIR --random-init ...   # the same architecture, random weights

GSM8K training problems with their worked solutions, rendered by the model's chat template (question as the
user turn, solution as the assistant turn), are scored by the Hugging Face model (a Llama-family checkpoint,
e.g. SmolLM2 from `fulcrum pretrained`) in float32 and in bf16; then the bf16 forward again with one rounding
convention changed at a time, each as valid as HF's own:
- `rope_fp32`: rotary embedding computed in float32 and rounded once (HF rounds cos/sin to bf16 and each
  product);
- `mlp_fp32`: silu(gate) * up in float32, rounded once (HF rounds silu's output, then the product);
- `eager_attention`: HF's eager attention in place of SDPA.
Printed (and written with `--json`): per variant, the mean |log-prob difference| over every scored token
against HF's bf16 forward and against float32. When such one-op changes move the log-probs as much as the
engine-vs-training gap, that gap is bf16 rounding at this model's level, not a mismatch: a model whose
next-token distributions are peaked (a trained one) turns rounding into larger log-prob differences than a
random one, whose distributions are near-uniform: `--random-init` measures the same architecture with
random weights (seed 0, the config's initializer) to show it. CPU is enough (two threads, about a minute).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers.models.llama.modeling_llama as llama
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def scored_sequences(model_dir: Path, data: Path, rows: int) -> list[torch.Tensor]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for line in data.read_text().splitlines()[:rows]:
        row = json.loads(line)
        chat = [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}]
        text = tokenizer.apply_chat_template(chat, tokenize=False)
        out.append(torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


@torch.no_grad()
def token_log_probs(model: torch.nn.Module, sequences: list[torch.Tensor]) -> torch.Tensor:
    """log p(token_t | tokens_<t) for every t >= 1 of every sequence, concatenated, in float32."""
    out = []
    for ids in sequences:
        logits = model(ids[None]).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0])
    return torch.cat(out)


def rope_fp32(q, k, cos, sin, unsqueeze_dim: int = 1, **_: object):
    """HF's apply_rotary_pos_emb computed in float32 and rounded once."""
    cos, sin = cos.float().unsqueeze(unsqueeze_dim), sin.float().unsqueeze(unsqueeze_dim)
    qf, kf = q.float(), k.float()
    rotate = llama.rotate_half
    return (qf * cos + rotate(qf) * sin).to(q.dtype), (kf * cos + rotate(kf) * sin).to(k.dtype)


def mlp_fp32(self, x: torch.Tensor) -> torch.Tensor:
    """LlamaMLP with silu(gate) * up in float32, rounded once."""
    return self.down_proj((F.silu(self.gate_proj(x).float()) * self.up_proj(x).float()).to(x.dtype))


@contextmanager
def patched(owner: object, name: str, value: Callable) -> Iterator[None]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="GSM8K's train.jsonl")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--random-init", action="store_true", help="the model's architecture, random weights")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sequences = scored_sequences(args.model, args.data, args.rows)
    weights = args.model
    if args.random_init:
        torch.manual_seed(0)
        weights = Path(tempfile.mkdtemp(prefix="bf16_noise_"))
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model)).save_pretrained(weights)

    def load(dtype: torch.dtype) -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(weights, dtype=dtype, attn_implementation="sdpa").eval()

    reference = token_log_probs(load(torch.float32), sequences)
    model = load(torch.bfloat16)
    variants = {"hf_bf16": token_log_probs(model, sequences)}
    with patched(llama, "apply_rotary_pos_emb", rope_fp32):
        variants["rope_fp32"] = token_log_probs(model, sequences)
    with patched(llama.LlamaMLP, "forward", mlp_fp32):
        variants["mlp_fp32"] = token_log_probs(model, sequences)
    model.config._attn_implementation = "eager"
    variants["eager_attention"] = token_log_probs(model, sequences)
    base = variants["hf_bf16"]
    summary = {
        "model": str(args.model),
        "weights": "random (seed 0)" if args.random_init else "the model's",
        "tokens": int(base.numel()),
        "variants": {
            name: {
                "vs_hf_bf16_mean": round(float((lp - base).abs().mean()), 5),
                "vs_fp32_mean": round(float((lp - reference).abs().mean()), 5),
            }
            for name, lp in variants.items()
        },
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
