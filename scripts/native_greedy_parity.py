"""Native engine greedy = Hugging Face greedy on a real checkpoint, over GSM8K questions.

    python scripts/native_greedy_parity.py MODEL_DIR GSM8K.jsonl [--prompts 16] [--tokens 64]

Each question, as "Question: ...\\nAnswer:", is decoded greedily by transformers' `generate` and by
the native engine (one batch, the engine's continuous batching), both in fp32 on the CPU and both
stopping at the tokenizer's EOS; prints the share of identical sequences and, for any that differ,
where they part.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fulcrum.rollout.base import SamplingParams
from fulcrum.rollout.native import EngineConfig, NativeEngine


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the two token lists differ (a length mismatch counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("data", type=Path)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--shots", type=int, default=0)
    parser.add_argument("--shots-from", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    rows = [json.loads(line) for line in args.data.read_text().splitlines()[: args.prompts]]
    shots = (
        [json.loads(line) for line in args.shots_from.read_text().splitlines()[: args.shots]]
        if args.shots
        else []
    )
    prefix = "".join(f"Question: {row['question']}\nAnswer: {row['answer']}\n\n" for row in shots)
    prompts = [tokenizer(f"{prefix}Question: {row['question']}\nAnswer:")["input_ids"] for row in rows]
    eos = tokenizer.eos_token_id

    start = time.perf_counter()
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=args.tokens,
                eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id,
            )
            expected.append(out[0, len(prompt) :].tolist())
    hf_s = time.perf_counter() - start

    longest = max(map(len, prompts)) + args.tokens
    config = EngineConfig(max_num_seqs=len(prompts), max_num_batched_tokens=2048, max_model_len=longest)
    engine = NativeEngine(model, [eos], tokenizer.pad_token_id, config, torch.device("cpu"))
    start = time.perf_counter()
    got = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=args.tokens)).token_ids
    native_s = time.perf_counter() - start

    same = 0
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        where = first_difference(a, b)
        same += where is None
        if where is not None:
            print(
                f"prompt {i}: differs at token {where} of {len(b)} (native {a[where : where + 3]}, hf {b[where : where + 3]})"
            )
    lengths = sorted(len(p) for p in prompts)
    print(
        f"identical: {same}/{len(prompts)} sequences; prompts {lengths[0]}-{lengths[-1]} tokens, up to "
        f"{args.tokens} new; hf {hf_s:.0f} s, native {native_s:.0f} s"
    )


if __name__ == "__main__":
    main()
