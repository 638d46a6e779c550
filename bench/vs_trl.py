"""Benchmark: end-to-end GRPO throughput, TRL's `GRPOTrainer` against `fulcrum train`, same model, data, shapes.

    # once: GSM8K parquet and the Qwen2.5-0.5B-shaped random model (as bench/train_step.py)
    fulcrum data gsm8k --src ../shared/data/gsm8k --out .bench/gsm8k
    python bench/train_step.py make-model --out .bench/qwen05
    # needs `pip install -e .[bench]` (trl, datasets); on one H200, ~5 min
    python bench/vs_trl.py --model .bench/qwen05 --data .bench/gsm8k --out .bench/vs_trl
    python bench/vs_trl.py --model M --data D --out /tmp/vs_trl_smoke --smoke   # tiny, CPU

Both sides: the same GSM8K training prompts (verl's parquet, chat template applied), group size 8,
64 prompts a step (512 completions), up to 256 new tokens sampled at temperature 1, one optimiser
step per batch (one mini-batch, one epoch), micro-batches of 32, gradient checkpointing, fp32 master
weights with bf16 autocast, no KL term (TRL `beta=0`, no reference model), the GSM8K strict reward.
TRL uses its Hugging Face `generate` path (vLLM does not run there); fulcrum its native engine.
With random weights the completions run to the full 256 tokens on both sides: a fixed load.

The figure: prompt + completion tokens of a step over that step's wall time (generation, scoring,
log-probs, update), the median over warm steps (all but the first). Each side runs in its own
process, one after the other, each stopped after `--timeout-s` seconds if given (a side that fails or
is stopped is reported as such and the other side still runs). Output: `--out`/vs_trl.json (with
`failed` per side and `ratio_fulcrum_over_trl`, null unless both sides ran) and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Shape:
    prompts: int = 64
    group: int = 8
    new_tokens: int = 256
    micro: int = 32
    steps: int = 3
    lr: float = 1e-6
    device: str = "cuda"


SMOKE = Shape(prompts=2, group=4, new_tokens=16, micro=4, steps=2, device="cpu")


def gsm8k_rows(data: Path, count: int) -> list[dict]:
    import pyarrow.parquet as pq

    path = data / "train.parquet"
    if not path.exists():
        raise SystemExit(
            f"no {path}: make it with `fulcrum data gsm8k --src ../shared/data/gsm8k --out {data}`"
        )
    return pq.read_table(path).slice(0, count).to_pylist()


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def run_trl(model: Path, data: Path, out: Path, shape: Shape) -> dict:
    """TRL GRPOTrainer for `shape.steps` optimiser steps; per step: wall seconds and tokens."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from fulcrum.reward.gsm8k import compute_score

    rows = gsm8k_rows(data, shape.prompts * shape.steps)
    dataset = Dataset.from_list(
        [{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]} for r in rows]
    )

    def gsm8k_strict(completions: list, ground_truth: list[str], **_: object) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [compute_score(t, g, method="strict") for t, g in zip(texts, ground_truth, strict=True)]

    steps: list[dict] = []

    class StepTimer(TrainerCallback):
        """Wall time and tokens (TRL's num_input_tokens_seen: prompt + completion) of each optimiser step."""

        def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            _sync(shape.device)
            self.started, self.tokens = time.perf_counter(), state.num_input_tokens_seen

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            _sync(shape.device)
            seconds = time.perf_counter() - self.started
            steps.append({"seconds": seconds, "tokens": state.num_input_tokens_seen - self.tokens})

    completions = shape.prompts * shape.group
    config = GRPOConfig(
        output_dir=str(out / "trl_run"),
        max_steps=shape.steps,
        learning_rate=shape.lr,
        per_device_train_batch_size=shape.micro,
        gradient_accumulation_steps=completions // shape.micro,  # one optimiser step per batch
        num_generations=shape.group,
        max_completion_length=shape.new_tokens,
        temperature=1.0,
        num_iterations=1,
        beta=0.0,
        gradient_checkpointing=True,
        bf16=shape.device == "cuda",
        use_cpu=shape.device == "cpu",
        use_vllm=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=1,
        model_init_kwargs={"dtype": torch.float32},  # fp32 master weights, bf16 autocast (as fulcrum)
    )
    trainer = GRPOTrainer(
        model=str(model),
        reward_funcs=gsm8k_strict,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model, padding_side="left"),
        callbacks=[StepTimer()],
    )
    trainer.train()
    import trl

    return {"steps": steps, "version": trl.__version__}


def fulcrum_overrides(model: Path, data: Path, run: Path, shape: Shape) -> list[str]:
    return [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        f"data.train_batch_size={shape.prompts}",
        "data.max_prompt_length=512",
        f"data.max_response_length={shape.new_tokens}",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        f"actor_rollout_ref.actor.optim.lr={shape.lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={shape.prompts}",  # one optimiser step per batch
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={shape.micro}",
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.use_kl_loss=False",
        f"actor_rollout_ref.rollout.name={'native' if shape.device == 'cuda' else 'hf'}",
        f"actor_rollout_ref.rollout.n={shape.group}",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={shape.micro}",
        f"trainer.total_training_steps={shape.steps}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.logger=[console]",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.device={shape.device}",
        f"trainer.default_local_dir={run}",
    ]


def run_fulcrum(model: Path, data: Path, out: Path, shape: Shape) -> dict:
    """`fulcrum train` (the public entry point, in this process); per step from its metrics.jsonl."""
    from fulcrum.trainer.main_ppo import main as train_main

    run = out / "fulcrum_run"
    code = train_main(fulcrum_overrides(model, data, run, shape))
    if code != 0:
        raise SystemExit(f"fulcrum train failed (exit {code})")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [
        {"seconds": r["timing_s/step"], "tokens": r["perf/total_num_tokens"], "timing": _timings(r)}
        for r in rows
        if "timing_s/step" in r
    ]
    import fulcrum

    return {"steps": steps, "version": getattr(fulcrum, "__version__", "?")}


def _timings(row: dict) -> dict[str, float]:
    return {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("timing_s/")}


def warm_tokens_per_s(steps: list[dict]) -> float:
    """Median over the steps after the first of tokens / seconds."""
    warm = steps[1:] or steps
    return statistics.median(s["tokens"] / s["seconds"] for s in warm)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument(
        "--data", type=Path, required=True, help="folder with GSM8K train.parquet/test.parquet"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--side", choices=("both", "trl", "fulcrum"), default="both")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--steps", type=int)
    parser.add_argument(
        "--timeout-s", type=float, help="wall-clock limit per side (a side past it is stopped and reported)"
    )
    args = parser.parse_args(argv)
    shape = SMOKE if args.smoke else Shape()
    if args.steps:
        shape = replace(shape, steps=args.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.side != "both":
        result = (run_trl if args.side == "trl" else run_fulcrum)(args.model, args.data, args.out, shape)
        partial = args.out / f"{args.side}.json.partial"
        partial.write_text(json.dumps(result))
        partial.rename(args.out / f"{args.side}.json")  # whole or absent, should the side be stopped now
        return 0

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    results, failed = {}, {}
    for side in ("trl", "fulcrum"):
        cmd = [sys.executable, __file__, "--side", side, "--model", str(args.model), "--data", str(args.data)]
        cmd += ["--out", str(args.out), "--steps", str(shape.steps)] + (["--smoke"] if args.smoke else [])
        print(f"$ {' '.join(cmd)}", flush=True)
        (args.out / f"{side}.json").unlink(missing_ok=True)
        try:
            code = subprocess.call(cmd, env=env, timeout=args.timeout_s)
        except subprocess.TimeoutExpired:  # call() has killed it
            code = f"stopped after {args.timeout_s:.0f} s"
        if not (args.out / f"{side}.json").exists():  # written once every step has run, then the side exits
            failed[side] = f"failed ({code})"
            print(f"vs_trl: the {side} side {failed[side]}; see above", file=sys.stderr, flush=True)
            continue
        if code != 0:
            print(f"vs_trl: the {side} side wrote its steps, then its process was {code}", file=sys.stderr)
        results[side] = json.loads((args.out / f"{side}.json").read_text())
        results[side]["tokens_per_s"] = warm_tokens_per_s(results[side]["steps"])
    ratio = results["fulcrum"]["tokens_per_s"] / results["trl"]["tokens_per_s"] if len(results) == 2 else None
    summary = {"shape": asdict(shape), **results, "failed": failed, "ratio_fulcrum_over_trl": ratio}
    (args.out / "vs_trl.json").write_text(json.dumps(summary, indent=1))
    print(
        "| side | version | step seconds | tokens a step | tokens/s (warm median) |\n| --- | --- | --- | --- | --- |"
    )
    for name, key in (("TRL GRPOTrainer", "trl"), ("fulcrum GRPO", "fulcrum")):
        if key not in results:
            print(f"| {name} | | {failed[key]} | | |")
            continue
        side = results[key]
        secs = ", ".join(f"{s['seconds']:.2f}" for s in side["steps"])
        toks = ", ".join(str(int(s["tokens"])) for s in side["steps"])
        print(f"| {name} | {side['version']} | {secs} | {toks} | {side['tokens_per_s']:,.0f} |")
    if ratio is None:
        return 1
    print(f"fulcrum / TRL = {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
