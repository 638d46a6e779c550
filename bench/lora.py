"""Benchmark: LoRA (rank 32, all-linear) against full fine-tuning on the 0.5B GRPO shape, one device,
the same call: throughput and peak memory of each, from `bench/train_step.py run`.

    fulcrum data gsm8k --src ../shared/data/gsm8k --out .bench/data
    python bench/train_step.py make-model --out .bench/qwen05
    python bench/lora.py --data .bench/data --model .bench/qwen05 --out /tmp/lora_bench [--steps 3] [KEY=VALUE ...]

Each variant writes `<out>/<variant>.json` (train_step.py's summary); this prints one JSON line per
variant with its throughput and memory figures, and the LoRA/full ratios. The learning rate differs
as verl advises (3e-5 with LoRA, 1.5e-6 without); it does not change the time of a step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

GRPO = [
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.actor.use_kl_loss=True",
]
VARIANTS: dict[str, list[str]] = {
    "full": [],
    "lora": [
        "actor_rollout_ref.model.lora_rank=32",
        "actor_rollout_ref.model.lora_alpha=32",
        "actor_rollout_ref.model.target_modules=all-linear",
        "actor_rollout_ref.actor.optim.lr=3e-5",
    ],
}


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
    args, extra = parser.parse_known_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, float]] = {}
    for name, keys in VARIANTS.items():
        summary = args.out / f"{name}.json"
        command = [
            sys.executable, str(Path(__file__).with_name("train_step.py")), "run",
            "--data", str(args.data), "--model", str(args.model), "--run", str(args.out / f"run_{name}"),
            "--steps", str(args.steps), "--summary", str(summary), *GRPO, *keys, *extra,
        ]  # fmt: skip
        subprocess.run(command, check=True)
        results[name] = figures(json.loads(summary.read_text()))
        print(json.dumps({"variant": name, **results[name]}), flush=True)
    ratios = {k: results["lora"][k] / v for k, v in results["full"].items() if v and k in results["lora"]}
    print(json.dumps({"variant": "lora/full", **ratios}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
