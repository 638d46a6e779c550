"""The built-in demo: `fulcrum train` with no data and no model.

In a few minutes on a laptop CPU (faster on a GPU) it runs the whole pipeline on a task the project
generates, and its last line compares validation accuracy after the supervised warm start and after
PPO (GRPO advantages):

1. data: GSM8K-format arithmetic word problems (`fulcrum.data.synthetic`), one addition or
   subtraction on numbers up to 9, with the GSM8K instruction; the GSM8K scorer grades them;
2. a tiny random-initialised model (`fulcrum.models.tiny`, ~1.3 M parameters);
3. a short supervised warm start (`fulcrum.trainer.sft`) on demonstrations of mixed style, as pooled
   SFT data often is: most stories of one kind end in `#### N`, most of the other in `The answer is N.`.
   Imitation learns some arithmetic and both habits;
4. PPO (GRPO advantages, 8 samples a prompt, temperature 1) with the strict GSM8K reward, which only
   accepts `#### N`: from the reward alone the policy learns to use the scored style everywhere and
   gets more sums right. Validation is greedy (verl's `val_kwargs`) on 200 held-out problems.

Overrides given to `fulcrum train` act on the PPO stage, on top of the demo's own settings (e.g.
`trainer.default_local_dir=DIR`, `trainer.total_training_steps=10`, `trainer.seed=2`,
`trainer.device=cpu`). The run directory (`trainer.default_local_dir`, else a fresh temporary folder)
holds the PPO run (`config.yaml`, `metrics.jsonl`) and, under `demo/`, the data, the base model and
the warm-start model. `docs/demo.md` says what to expect and the figures measured.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from fulcrum.config import ConfigError, FulcrumConfig, load_structured, resolve
from fulcrum.config.device import select_device
from fulcrum.data.synthetic import ArithmeticTask, write_splits
from fulcrum.trainer.sft import SFTConfig, SFTDataConfig, SFTModelConfig, SFTOptimConfig, SFTTrainerConfig

# One operation on numbers up to 9, answer only ("#### 7": no worked line the reward cannot check, which
# RL would otherwise reward when wrong but ending in the right number). Demonstrations of mixed style:
# most "owner" stories end in "#### N", most "container" stories in "The answer is N.".
DEMO_TASK = ArithmeticTask(max_operand=9, show_work=False, marked_fraction=(0.8, 0.2))


def demo_ppo_config() -> FulcrumConfig:
    """The PPO stage's own settings, in verl's keys (unresolved: keys that follow others still follow)."""
    cfg = FulcrumConfig()
    cfg.algorithm.adv_estimator = "grpo"
    data, actor, rollout = cfg.data, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    data.train_batch_size, data.max_prompt_length, data.max_response_length = 32, 80, 10
    rollout.n, rollout.temperature, rollout.name = 8, 1.0, "hf"
    rollout.tensor_model_parallel_size = 1
    rollout.log_prob_micro_batch_size_per_gpu = 128
    actor.optim.lr, actor.optim.lr_scheduler_type = 3e-4, "cosine"
    actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu = 32, 64
    trainer = cfg.trainer
    trainer.total_training_steps, trainer.val_before_train, trainer.test_freq, trainer.save_freq = (
        40,
        True,
        10,
        -1,
    )
    trainer.logger, trainer.n_gpus_per_node, trainer.nnodes = ["console"], 1, 1
    trainer.project_name, trainer.experiment_name = "fulcrum-demo", "arithmetic"
    return cfg


@dataclass(frozen=True)
class DemoPlan:
    """Every setting of the demo; `run_demo` takes the defaults (tests shrink them)."""

    task: ArithmeticTask = DEMO_TASK
    num_train: int = 4000
    num_test: int = 200
    sft_steps: int = 250
    sft_batch_size: int = 32
    sft_lr: float = 2e-3
    ppo: FulcrumConfig = field(default_factory=demo_ppo_config)  # the user's overrides go on top


def sft_config(
    plan: DemoPlan, data_dir: Path, base_model: Path, out_dir: Path, seed: int, device: str
) -> SFTConfig:
    """The warm start: the same chat-message prompts the PPO stage sees, answers from extra_info."""
    return SFTConfig(
        data=SFTDataConfig(
            train_files=str(data_dir / "train.parquet"),
            val_files=str(data_dir / "test.parquet"),
            prompt_key="prompt",
            response_key="extra_info",
            response_dict_keys=["answer"],
            train_batch_size=plan.sft_batch_size,
            micro_batch_size_per_gpu=plan.sft_batch_size,
            max_length=128,
        ),
        model=SFTModelConfig(partial_pretrain=str(base_model)),
        optim=SFTOptimConfig(lr=plan.sft_lr, weight_decay=0.0),
        trainer=SFTTrainerConfig(
            total_training_steps=plan.sft_steps, default_local_dir=str(out_dir), seed=seed, device=device
        ),
    )


def validation_accuracies(metrics_file: Path) -> list[tuple[int, float]]:
    """(step, val-core score) for every validation row of a run's metrics.jsonl, in order.

    With several data sources the score is their mean; the demo has one.
    """
    rows = []
    for line in metrics_file.read_text().splitlines():
        record = json.loads(line)
        scores = [v for k, v in record.items() if k.startswith("val-core/") and k.endswith("/reward/mean@1")]
        if scores:
            step = int(record.get("training/global_step", record.get("step", 0)))
            rows.append((step, sum(scores) / len(scores)))
    return rows


def run_demo(overrides: list[str] | None = None, plan: DemoPlan | None = None) -> int:
    """Data, tiny model, warm start, PPO; the last line printed compares validation accuracies.

    `overrides` (verl's `KEY=VALUE`) act on the PPO stage; they are checked before anything runs.
    """
    from fulcrum.models.tiny import build_tiny_model
    from fulcrum.trainer.run import train
    from fulcrum.trainer.run_dir import move_old_run_aside, other_run_contents
    from fulcrum.trainer.sft import run_sft

    plan = plan or DemoPlan()
    started = time.perf_counter()
    try:
        asked = load_structured(plan.ppo, list(overrides or []))  # unresolved: a null run dir stays null
        device = select_device(asked.trainer.device, cpu_when_no_cuda=True).type
    except ConfigError as err:
        print(f"fulcrum train (demo): {err}", file=sys.stderr)
        return 1
    run_dir = Path(asked.trainer.default_local_dir or tempfile.mkdtemp(prefix="fulcrum-demo-"))
    seed = asked.trainer.seed
    work = run_dir / "demo"
    # One run directory, one run: decided before minutes of warm start, not after.
    there = other_run_contents(run_dir) + other_run_contents(work / "sft")
    if there and asked.trainer.overwrite_run:
        print(f"note: moved the previous run to {move_old_run_aside(run_dir)}", flush=True)
    elif there:
        print(
            f"fulcrum train (demo): trainer.default_local_dir={run_dir} holds another run ({'; '.join(there)}); "
            "use another trainer.default_local_dir, or trainer.overwrite_run=True to move the old run into "
            f"{run_dir / 'old_runs'}/<time>/ (nothing is deleted)",
            file=sys.stderr,
        )
        return 1
    print(f"fulcrum demo: run directory {run_dir}, device {device}, seed {seed}", flush=True)

    data_dir = work / "data"
    write_splits(data_dir, plan.num_train, plan.num_test, seed=seed, task=plan.task)
    print(
        f"[1/4] data: {plan.num_train} train / {plan.num_test} test arithmetic word problems in {data_dir}",
        flush=True,
    )
    base_model = build_tiny_model(work / "base_model", seed=seed)
    print(f"[2/4] tiny model: {base_model}", flush=True)

    print(f"[3/4] supervised warm start: {plan.sft_steps} steps of {plan.sft_batch_size}", flush=True)
    sft = run_sft(sft_config(plan, data_dir, base_model, work / "sft", seed, device))

    asked.data.train_files = str(data_dir / "train.parquet")
    asked.data.val_files = str(data_dir / "test.parquet")
    asked.actor_rollout_ref.model.path = str(sft.model_dir)
    asked.trainer.device = device  # type: ignore[assignment]  # "cpu" | "cuda"
    asked.trainer.default_local_dir = str(run_dir)
    cfg = resolve(asked)
    print(
        f"[4/4] PPO: {cfg.algorithm.adv_estimator} advantages, {cfg.data.train_batch_size} prompts x "
        f"{cfg.actor_rollout_ref.rollout.n} samples, {cfg.trainer.total_training_steps} steps",
        flush=True,
    )
    code = train(cfg)
    if code != 0:
        print(f"fulcrum demo: the PPO stage failed (exit {code}); see the messages above", file=sys.stderr)
        return code

    accuracies = validation_accuracies(run_dir / "metrics.jsonl")
    sys.stderr.flush()
    if len(accuracies) < 2:
        print(
            "fulcrum demo: done, but validation ran fewer than twice (trainer.val_before_train / test_freq "
            f"overridden?); metrics in {run_dir / 'metrics.jsonl'}",
            flush=True,
        )
        return 0
    (_, before), (last_step, after) = accuracies[0], accuracies[-1]
    minutes = (time.perf_counter() - started) / 60
    print(
        f"fulcrum demo ({minutes:.1f} min): validation accuracy on {plan.num_test} held-out problems, greedy: "
        f"after warm start {before:.3f} -> after PPO ({last_step} steps) {after:.3f}",
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_demo(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    raise SystemExit(main())
