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

import torch

from fulcrum.data.synthetic import ArithmeticTask, write_splits

# One operation on numbers up to 9, answer only ("#### 7": no worked line the reward cannot check, which
# RL would otherwise reward when wrong but ending in the right number). Demonstrations of mixed style:
# most "owner" stories end in "#### N", most "container" stories in "The answer is N.".
DEMO_TASK = ArithmeticTask(max_operand=9, show_work=False, marked_fraction=(0.8, 0.2))


@dataclass(frozen=True)
class DemoPlan:
    """Every setting of the demo; `run_demo` takes the defaults (tests shrink them)."""

    task: ArithmeticTask = DEMO_TASK
    num_train: int = 4000
    num_test: int = 200
    sft_steps: int = 250
    sft_batch_size: int = 32
    sft_lr: float = 2e-3
    # PPO stage, in verl's keys; the user's overrides are applied on top.
    ppo: dict[str, str] = field(
        default_factory=lambda: {
            "algorithm.adv_estimator": "grpo",
            "data.train_batch_size": "32",
            "data.max_prompt_length": "80",
            "data.max_response_length": "10",
            "actor_rollout_ref.rollout.n": "8",
            "actor_rollout_ref.rollout.temperature": "1.0",
            "actor_rollout_ref.rollout.name": "hf",
            "actor_rollout_ref.rollout.tensor_model_parallel_size": "1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "128",
            "actor_rollout_ref.actor.optim.lr": "3e-4",
            "actor_rollout_ref.actor.optim.lr_scheduler_type": "cosine",
            "actor_rollout_ref.actor.ppo_mini_batch_size": "32",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "64",
            "trainer.total_training_steps": "40",
            "trainer.val_before_train": "True",
            "trainer.test_freq": "10",
            "trainer.save_freq": "-1",
            "trainer.logger": "[console]",
            "trainer.n_gpus_per_node": "1",
            "trainer.nnodes": "1",
            "trainer.project_name": "fulcrum-demo",
            "trainer.experiment_name": "arithmetic",
        }
    )


def _split_overrides(overrides: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not KEY=VALUE")
        key, value = item.split("=", 1)
        out[key.lstrip("+")] = value
    return out


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
    """Data, tiny model, warm start, PPO; the last line printed compares validation accuracies."""
    from fulcrum.models.tiny import build_tiny_model
    from fulcrum.trainer import main_ppo
    from fulcrum.trainer.run_dir import move_old_run_aside, other_run_contents
    from fulcrum.trainer.sft import load_sft_config, run_sft

    plan = plan or DemoPlan()
    started = time.perf_counter()
    try:
        user = _split_overrides(list(overrides or []))
    except ValueError as err:
        print(f"fulcrum train (demo): {err}", file=sys.stderr)
        return 1
    run_dir = Path(user.get("trainer.default_local_dir") or tempfile.mkdtemp(prefix="fulcrum-demo-"))
    seed = int(user.get("trainer.seed", 1))
    device = user.get("trainer.device") or ("cuda" if torch.cuda.is_available() else "cpu")
    work = run_dir / "demo"
    # One run directory, one run: decided before minutes of warm start, not after.
    there = other_run_contents(run_dir) + other_run_contents(work / "sft")
    if there and str(user.get("trainer.overwrite_run", "")).strip().lower() in ("true", "1", "yes", "on"):
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

    sft_cfg = load_sft_config(
        [
            f"data.train_files={data_dir / 'train.parquet'}",
            f"data.val_files={data_dir / 'test.parquet'}",
            "data.prompt_key=prompt",  # the same chat messages the PPO stage sees
            "data.response_key=extra_info",
            "data.response_dict_keys=[answer]",
            f"data.train_batch_size={plan.sft_batch_size}",
            f"data.micro_batch_size_per_gpu={plan.sft_batch_size}",
            "data.max_length=128",
            f"model.partial_pretrain={base_model}",
            f"optim.lr={plan.sft_lr}",
            "optim.weight_decay=0.0",
            f"trainer.total_training_steps={plan.sft_steps}",
            f"trainer.default_local_dir={work / 'sft'}",
            f"trainer.seed={seed}",
            f"trainer.device={device}",
        ]
    )
    print(f"[3/4] supervised warm start: {plan.sft_steps} steps of {plan.sft_batch_size}", flush=True)
    sft = run_sft(sft_cfg)

    ppo = {
        **plan.ppo,
        "data.train_files": str(data_dir / "train.parquet"),
        "data.val_files": str(data_dir / "test.parquet"),
        "actor_rollout_ref.model.path": str(sft.model_dir),
        "trainer.device": device,
        "trainer.seed": str(seed),
        "trainer.default_local_dir": str(run_dir),
    }
    ppo.update(user)
    print(
        f"[4/4] PPO: {ppo['algorithm.adv_estimator']} advantages, {ppo['data.train_batch_size']} prompts x "
        f"{ppo['actor_rollout_ref.rollout.n']} samples, {ppo['trainer.total_training_steps']} steps",
        flush=True,
    )
    code = main_ppo.main([f"{k}={v}" for k, v in ppo.items()])
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
