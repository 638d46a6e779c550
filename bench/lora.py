"""Benchmark: LoRA (rank 32, all-linear) against full fine-tuning on the 0.5B GRPO shape
(`bench/train_step.py run --grpo`: 64 prompts x 8 through the native engine, with a KL loss so that the
reference pass runs), one device, the same call: throughput and peak memory of each; and a 7B shape
that only LoRA fits on one H200 (`--shape 7b`).

    fulcrum data gsm8k --src ../shared/data/gsm8k --out .bench/data
    python bench/train_step.py make-model --out .bench/qwen05
    python bench/lora.py --data .bench/data --model .bench/qwen05 --out /tmp/lora_bench [--steps 3] [KEY=VALUE ...]
    # Qwen2.5-7B's shape, random, bf16 (15 GB on disk; written on the first call when --model is empty)
    python bench/lora.py --shape 7b --data .bench/data --model .bench/qwen7b --out /tmp/lora7b --steps 2

Each variant writes `<out>/<variant>.json` (train_step.py's summary); this prints one JSON line per
variant with its throughput and memory figures (`peak_allocated_gb`: the run's largest
perf/max_memory_allocated_gb, the frozen base held once in bf16), and the LoRA/full ratios. The
learning rate differs as verl advises (3e-5 with LoRA, 1.5e-6 without); it does not change the time
of a step. The 7B shape runs LoRA only, 64 prompts x 5 in micro-batches of 4; full fine-tuning there
is `fulcrum doctor`'s predicted out-of-memory, printed beside it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from fulcrum.rollout.testing import QWEN25_05B_SHAPE

KL_LOSS = ["actor_rollout_ref.actor.use_kl_loss=True"]
GRPO_7B = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=5", *KL_LOSS]
LORA = [
    "actor_rollout_ref.model.lora_rank=32",
    "actor_rollout_ref.model.lora_alpha=32",
    "actor_rollout_ref.model.target_modules=all-linear",
    "actor_rollout_ref.actor.optim.lr=3e-5",
]
VARIANTS: dict[str, list[str]] = {"full": [], "lora": LORA}
# Qwen2.5-7B (7.6B parameters, an untied head): the 0.5B shape's rope and norm, its own sizes.
QWEN25_7B_SHAPE = {**QWEN25_05B_SHAPE, "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944}
QWEN25_7B_SHAPE |= {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4}
QWEN25_7B_SHAPE["tie_word_embeddings"] = False
# The 7B step: 64 prompts x 5 through the native engine, the update in micro-batches of 4.
SMALL_STEP = [
    "actor_rollout_ref.rollout.name=native",
    "data.train_batch_size=64",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.max_num_seqs=320",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
]


def make_7b(out: Path) -> Path:
    """A random Qwen2.5-7B-shaped model in bf16 (built on the GPU: minutes less than on the host), with
    the tiny tokenizer of bench/train_step.py's model."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from fulcrum.models.tiny import IM_END, PAD_TOKEN, build_tokenizer

    tokenizer = build_tokenizer()
    eos, pad = tokenizer.convert_tokens_to_ids([IM_END, PAD_TOKEN])
    config = Qwen2Config(**QWEN25_7B_SHAPE, eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def peaks(summary: dict) -> dict[str, float]:
    """The run's largest allocated and reserved CUDA memory over its steps (GiB)."""
    steps = summary.get("steps", [])
    return {
        "peak_allocated_gb": max((s.get("perf/max_memory_allocated_gb", 0.0) for s in steps), default=0.0),
        "peak_reserved_gb": max((s.get("perf/max_memory_reserved_gb", 0.0) for s in steps), default=0.0),
    }


def doctor_peak(data: Path, model: Path, keys: list[str]) -> str:
    """`fulcrum doctor`'s memory line for these keys (the estimate's peak, or its out-of-memory)."""
    command = [sys.executable, "-m", "fulcrum.tools.doctor", *doctor_keys(data, model), *keys]
    out = subprocess.run(command, capture_output=True, text=True).stdout
    lines = [
        line.strip() for line in out.splitlines() if "memory" in line and ("peak" in line or "out of" in line)
    ]
    return " | ".join(lines)


def doctor_keys(data: Path, model: Path) -> list[str]:
    from train_step import seed_overrides  # bench/ is on the path: this script's folder

    return seed_overrides(data, model, Path("/tmp/doctor_run"), 1) + GRPO_7B + SMALL_STEP


def figures(summary: dict) -> dict[str, float]:
    """The throughput and memory figures of a train_step.py summary, flattened."""
    out: dict[str, float] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}{key}/" if prefix or key else key, item)
        elif isinstance(value, int | float) and any(w in prefix for w in ("throughput", "memory", "tok")):
            out[prefix.rstrip("/")] = float(value)

    walk("", summary)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--shape", choices=("0.5b", "7b"), default="0.5b")
    parser.add_argument(
        "--order", default="full,lora", help="the variants of the 0.5B shape, in the order they run"
    )
    args, extra = parser.parse_known_args()
    args.out.mkdir(parents=True, exist_ok=True)
    preset = ["--grpo", *KL_LOSS]
    variants = {name: VARIANTS[name] for name in args.order.split(",")}
    if args.shape == "7b":
        if not (args.model / "config.json").is_file():
            print(f"wrote {make_7b(args.model)}", flush=True)
        preset, variants = GRPO_7B, {"lora": LORA + SMALL_STEP}
        for name, keys in (("full", []), ("lora", LORA)):
            print(
                json.dumps({"doctor": name, "estimate": doctor_peak(args.data, args.model, keys)}), flush=True
            )
    results: dict[str, dict[str, float]] = {}
    for name, keys in variants.items():
        summary = args.out / f"{name}.json"
        command = [
            sys.executable, str(Path(__file__).with_name("train_step.py")), "run",
            "--data", str(args.data), "--model", str(args.model), "--run", str(args.out / f"run_{name}"),
            "--steps", str(args.steps), "--summary", str(summary), *preset, *keys, *extra,
        ]  # fmt: skip
        subprocess.run(command, check=True)
        data = json.loads(summary.read_text())
        results[name] = {**peaks(data), **figures(data)}
        print(json.dumps({"variant": name, **results[name]}), flush=True)
    if "full" not in results:
        return 0
    ratios = {k: results["lora"][k] / v for k, v in results["full"].items() if v and k in results["lora"]}
    print(json.dumps({"variant": "lora/full", **ratios}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
