"""The seed's experiment on a real model of its own shape: Qwen2.5-Coder-0.5B-Instruct on GSM8K, PPO with the
seed's final command and GRPO with verl's GSM8K example, each for a fixed wall-clock on one GPU.

    python bench/seed_real.py run ppo  --model DIR --data DIR --seed 1 --budget-s 540 --work /tmp/w --out $OUT
    python bench/seed_real.py run grpo --model DIR --data DIR --seed 1 --budget-s 540 --work /tmp/w --out $OUT
    python bench/seed_real.py run original --model DIR ...   # the seed's starting configuration (its table)
    python bench/seed_real.py run grpo-per-gpu --model DIR ...  # verl's example at one GPU's share of its batch
    python bench/seed_real.py summarise RUN_DIR [RUN_DIR ...]  # the curves and the table from finished runs
    python bench/seed_real.py commands --model DIR --data DIR   # print the fulcrum train command lines
    python bench/seed_real.py eval ppo --model DIR --data DIR --out DIR  # `fulcrum eval` with the run's keys
    python bench/seed_real.py tune ppo --model DIR --data DIR --work /tmp/w --time-budget 300 --out $OUT
    python bench/seed_real.py run ppo --label tuned --set $(cat $OUT/tune-ppo.txt) ...  # what tune picked

Each run is `fulcrum train` with the command as the seed (or verl's example) writes it, for one GPU
(`trainer.n_gpus_per_node=1`, `actor_rollout_ref.rollout.tensor_model_parallel_size=1`), and only these
keys added: validation on all 1,319 test problems before the first step too (`val_before_train=True`;
every `test_freq` steps as written), `trainer.wall_clock_budget_s` (the run ends, last validation and
checkpoint included, within the budget of its start), the seed, the run and generations folders, and one
checkpoint kept of each role (`max_*_ckpt_to_keep=1`: the device's disk holds two 12 GB checkpoints, not
ten). `total_training_steps` is left to the epochs: the budget ends the run. `--hard-limit-s S` stops a run
still going S seconds after its launch (and a SIGINT to this script, a device call's `timeout`, does the
same), and what it did is summarised and packed all the same.

Every validation's generations are scored again here from `trainer.validation_data_dir`:
strict (`#### N`, the training reward), flexible (the last number), format (a `#### N` present),
truncation (no EOS within the response length) and response length; against the step and against the
wall-clock seconds since the trainer started (`perf/elapsed_s`, model loading and validations included).
KL and entropy come from the step rows. `summary.json` and `summary.md` hold it all; `--out` gets
metrics.jsonl, the summary and the generations (xz-compressed) of each run.
"""

from __future__ import annotations

import argparse
import json
import lzma
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from learning_warm import answer_stats  # noqa: E402  bench/ is on sys.path when a script of it runs
from train_step import seed_command  # noqa: E402  bench/ is on sys.path when a script of it runs


def seed_final(model: Path, data: Path) -> list[str]:
    """The seed's final command on one GPU (bench/train_step.py keeps it)."""
    return seed_command(data, model)


def seed_original(model: Path, data: Path) -> list[str]:
    """The seed's starting ("original") configuration: the values its table begins from."""
    changed = {
        "data.train_batch_size": "256",
        "actor_rollout_ref.actor.optim.lr": "1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size": "64",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "4",
        "actor_rollout_ref.actor.grad_clip": "1.0",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "8",
        "actor_rollout_ref.rollout.gpu_memory_utilization": "0.4",
        "actor_rollout_ref.rollout.max_num_seqs": "1024",
        "actor_rollout_ref.rollout.max_num_batched_tokens": "8192",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "8",
        "critic.ppo_micro_batch_size_per_gpu": "4",
        "critic.forward_micro_batch_size_per_gpu": "4",
        "algorithm.kl_ctrl.kl_coef": "0.001",
        "algorithm.kl_ctrl.target_kl": "0.1",
    }
    return replace_keys(seed_final(model, data), changed)


def verl_grpo_example(model: Path, data: Path) -> list[str]:
    """verl's examples/grpo_trainer/run_qwen2-7b.sh (its GSM8K GRPO example), on one GPU."""
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={data}/train.parquet",
        f"data.val_files={data}/test.parquet",
        "data.train_batch_size=1024",
        "data.max_prompt_length=512",
        "data.max_response_length=1024",
        "data.filter_overlong_prompts=True",
        "data.truncation=error",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=256",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.n=5",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0",
        "trainer.logger=[console]",
        "trainer.project_name=verl_grpo_example_gsm8k",
        "trainer.experiment_name=qwen2_5_coder_0_5b_function_rm",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.save_freq=20",
        "trainer.test_freq=5",
        "trainer.total_epochs=15",
    ]


VERL_EXAMPLE_GPUS = 8  # run_qwen2-7b.sh's trainer.n_gpus_per_node


def verl_grpo_example_per_gpu(model: Path, data: Path) -> list[str]:
    """verl's GSM8K GRPO example at one GPU's share of its 8-GPU batch: `data.train_batch_size` and
    `actor.ppo_mini_batch_size` are global in verl (a rank takes 1/8 of each: 128 prompts a step, 32 a
    mini-batch), the micro-batches per GPU already; every other key as written. One GPU does what each of
    the example's eight does a step, with the same 4 optimiser steps a step, but each of them averages the
    gradient over 32 prompts, not 256."""
    example = verl_grpo_example(model, data)
    keys = dict(o.split("=", 1) for o in example)
    share = {
        key: str(int(keys[key]) // VERL_EXAMPLE_GPUS)
        for key in ("data.train_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size")
    }
    return replace_keys(example, share)


COMMANDS = {
    "ppo": seed_final,
    "original": seed_original,
    "grpo": verl_grpo_example,
    "grpo-per-gpu": verl_grpo_example_per_gpu,
}


def replace_keys(overrides: list[str], changed: dict[str, str]) -> list[str]:
    """`overrides` with each key of `changed` set to its value (appended when absent)."""
    out = [f"{k}={changed[k]}" if (k := o.split("=", 1)[0]) in changed else o for o in overrides]
    present = {o.split("=", 1)[0] for o in out}
    return out + [f"{k}={v}" for k, v in changed.items() if k not in present]


def run_overrides(name: str, model: Path, data: Path, seed: int, budget_s: float, run_dir: Path) -> list[str]:
    added = {
        "trainer.val_before_train": "True",
        "trainer.seed": str(seed),
        "trainer.wall_clock_budget_s": f"{budget_s:g}",
        "trainer.default_local_dir": str(run_dir),
        "trainer.validation_data_dir": str(run_dir / "generations"),
        "trainer.max_actor_ckpt_to_keep": "1",
        "trainer.max_critic_ckpt_to_keep": "1",
        "trainer.resume_mode": "disable",
    }
    return replace_keys(COMMANDS[name](model, data), added)


# ------------------------------------------------------------------------------------------ scoring
def score_generations(path: Path) -> dict[str, float]:
    """One validation's generations (`<step>.jsonl`): strict, flexible and format rates and mean length as
    `bench/learning_warm.answer_stats` scores them, the truncation rate and the count."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    stats = answer_stats(
        [r["output"] for r in rows], [str(r["gts"]) for r in rows], [r["response_length"] for r in rows]
    )
    truncated = sum(not r["finished"] for r in rows) / max(len(rows), 1)
    return {"n": len(rows), **stats, "truncated": truncated}


STEP_KEYS = (
    "perf/elapsed_s",
    "perf/throughput",
    "timing_s/step",
    "timing_s/gen",
    "timing_s/testing",
    "critic/score/mean",
    "response_length/mean",
    "response_length/clip_ratio",
    "actor/entropy",
    "actor/ppo_kl",
    "actor/kl_loss",
    "actor/pg_loss",
    "critic/vf_explained_var",
)


def summarise_run(run_dir: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    elapsed = {int(r.get("training/global_step", r.get("step", 0))): r.get("perf/elapsed_s") for r in rows}
    validations = []
    for path in sorted((run_dir / "generations").glob("*.jsonl"), key=lambda p: int(p.stem)):
        step = int(path.stem)
        validations.append({"step": step, "elapsed_s": elapsed.get(step), **score_generations(path)})
    steps = [
        {k: r[k] for k in ("training/global_step", *STEP_KEYS) if k in r}
        for r in rows
        if "timing_s/step" in r
    ]
    warm = [s for s in steps[3:] if not s.get("timing_s/testing")]
    best = max(validations, key=lambda v: v["strict"]) if validations else None
    reach = None
    if best is not None and best["strict"] > 0:
        reach = next(v for v in validations if v["strict"] >= 0.9 * best["strict"])
    return {
        "run": run_dir.name,
        "validations": validations,
        "steps": steps,
        "base": validations[0] if validations else None,
        "final": validations[-1] if validations else None,
        "best": best,
        "time_to_90pct_of_best_s": reach["elapsed_s"] if reach else None,
        "steps_to_90pct_of_best": reach["step"] if reach else None,
        "validation_s": [s["timing_s/testing"] for s in steps if s.get("timing_s/testing")],
        "warm_step_s": median([s["timing_s/step"] for s in warm]),
        "warm_throughput": median([s["perf/throughput"] for s in warm]),
        "warm_gen_s": median([s["timing_s/gen"] for s in warm]),
    }


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def markdown(summary: dict[str, Any]) -> str:
    lines = [f"## {summary['run']}", ""]
    lines.append("| step | elapsed s | strict | flexible | format | truncated | length |")
    lines.append("|---:|---:|---:|---:|---:|---:|---:|")
    for v in summary["validations"]:
        el = f"{v['elapsed_s']:.0f}" if v["elapsed_s"] is not None else "—"
        lines.append(
            f"| {v['step']} | {el} | {v['strict']:.3f} | {v['flexible']:.3f} | {v['format']:.3f} "
            f"| {v['truncated']:.3f} | {v['response_length']:.0f} |"
        )
    lines.append("")
    for key in ("warm_step_s", "warm_throughput", "warm_gen_s", "time_to_90pct_of_best_s", "validation_s"):
        lines.append(f"- {key}: {summary[key]}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ stages
def run(args: argparse.Namespace) -> int:
    args.work.mkdir(parents=True, exist_ok=True)
    run_dir = args.work.resolve() / f"{args.label or args.name}-s{args.seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    overrides = run_overrides(
        args.name, args.model.resolve(), args.data.resolve(), args.seed, args.budget_s, run_dir
    )
    overrides = replace_keys(overrides, dict(kv.split("=", 1) for kv in args.set))
    print("fulcrum train " + " ".join(overrides), flush=True)
    started = time.monotonic()
    log = args.work / f"{run_dir.name}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fulcrum.cli", "train", *overrides],
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        exit_code = wait_or_stop(proc, args.hard_limit_s)
    wall = time.monotonic() - started
    print(f"{run_dir.name}: exit {exit_code}, {wall:.1f} s from launch", flush=True)
    summary = summarise_run(run_dir) if (run_dir / "metrics.jsonl").exists() else {"run": run_dir.name}
    summary.update(command=overrides, wall_s_from_launch=wall, exit_code=exit_code)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    if "validations" in summary:
        print(markdown(summary), flush=True)
    if args.out is not None:
        pack(run_dir, log, args.out)
    return exit_code


STOP_GRACE_S = 3.0  # after each stop signal: a device call's timeout leaves ~10 s to pack what was done


def wait_or_stop(proc: subprocess.Popen, limit_s: float | None) -> int:
    """The run's exit code. Past `limit_s` seconds, or when this script is interrupted (the SIGINT of a
    device call's `timeout`), the run is stopped, so that what it did is still summarised and packed: a
    first SIGINT (it finishes its step and saves), a second after STOP_GRACE_S (it stops at once, a
    checkpoint write cancelled), then SIGKILL."""
    try:
        return proc.wait(timeout=limit_s)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        for sig in (signal.SIGINT, signal.SIGINT, signal.SIGKILL):
            if proc.poll() is not None:
                break
            proc.send_signal(sig)
            try:
                return proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                continue
        return proc.wait()


def pack(run_dir: Path, log: Path, out: Path) -> None:
    """metrics.jsonl, summary.json, the log's tail and every validation's generations (one .xz) into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    name = run_dir.name
    for src, dst in (
        (run_dir / "metrics.jsonl", f"{name}.metrics.jsonl"),
        (run_dir / "summary.json", f"{name}.summary.json"),
    ):
        if src.exists():
            shutil.copy(src, out / dst)
    (out / f"{name}.log").write_text("\n".join(log.read_text(errors="replace").splitlines()[-400:]) + "\n")
    gens = sorted((run_dir / "generations").glob("*.jsonl"), key=lambda p: int(p.stem))
    if gens:  # xz's fastest preset: a run ends ~30 s before its device call does, and ~20 MB are to pack
        with lzma.open(out / f"{name}.generations.jsonl.xz", "wt", preset=1) as f:
            for path in gens:
                f.write(path.read_text())


def summarise(args: argparse.Namespace) -> int:
    for run_dir in args.runs:
        print(markdown(summarise_run(run_dir)))
    return 0


def commands(args: argparse.Namespace) -> int:
    for name, build in COMMANDS.items():
        print(f"# {name}\nfulcrum train " + " \\\n  ".join(build(args.model, args.data)) + "\n")
    return 0


def evaluate(args: argparse.Namespace) -> int:
    """`fulcrum eval` of the model on the test file with the run's own keys: its metrics must equal the run's
    validation before the first step (same engine, same sampling, same scorer)."""
    keys = COMMANDS[args.name](args.model.resolve(), args.data.resolve())
    out = args.out / f"eval-{args.name}"
    cmd = [
        sys.executable,
        "-m",
        "fulcrum.cli",
        "eval",
        str(args.model),
        "--data",
        str(args.data / "test.parquet"),
    ]
    proc = subprocess.run([*cmd, "--out", str(out), *keys], cwd=ROOT)
    if proc.returncode == 0:
        scores = score_generations(out / "generations.jsonl")
        (out / "scores.json").write_text(json.dumps(scores, indent=1))
        print(json.dumps(scores), flush=True)
    return proc.returncode


def tune(args: argparse.Namespace) -> int:
    """`fulcrum tune` on the run's own command (validation and the budget left out: tune's trials are a few
    steps each); writes the overrides it picks to OUT/tune-NAME.txt (empty when it keeps the command)."""
    keys = replace_keys(
        COMMANDS[args.name](args.model.resolve(), args.data.resolve()),
        dict(kv.split("=", 1) for kv in args.set),
    )
    work = args.work.resolve() / f"tune-{args.name}"
    cmd = [sys.executable, "-m", "fulcrum.cli", "tune", "--work-dir", str(work)]
    cmd += ["--time-budget", f"{args.time_budget:g}", *keys]
    print(" ".join(cmd[2:]), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    print(proc.stdout, flush=True)
    lines = proc.stdout.splitlines()
    marker = [i for i, line in enumerate(lines) if line.endswith("add these overrides:")]
    picked = lines[marker[-1] + 1].strip() if marker and marker[-1] + 1 < len(lines) else ""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"tune-{args.name}.txt").write_text(picked + "\n")
    if (work / "trials.json").exists():
        shutil.copy(work / "trials.json", args.out / f"tune-{args.name}.trials.json")
    print(f"tune picked: {picked or '(the command as it is)'}", flush=True)
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="stage", required=True)
    r = sub.add_parser("run")
    r.add_argument("name", choices=tuple(COMMANDS))
    r.add_argument("--model", type=Path, required=True)
    r.add_argument("--data", type=Path, required=True)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--budget-s", type=float, default=540.0)
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--out", type=Path)
    r.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="keys replaced or added (tune's picks)"
    )
    r.add_argument("--label", help="the run folder's name instead of NAME (e.g. tuned)")
    r.add_argument(
        "--hard-limit-s",
        type=float,
        help="stop the run this many seconds after its launch if it has not ended (then summarise it)",
    )
    s = sub.add_parser("summarise")
    s.add_argument("runs", type=Path, nargs="+")
    c = sub.add_parser("commands")
    c.add_argument("--model", type=Path, default=Path("MODEL"))
    c.add_argument("--data", type=Path, default=Path("DATA"))
    e = sub.add_parser("eval")
    e.add_argument("name", choices=tuple(COMMANDS))
    e.add_argument("--model", type=Path, required=True)
    e.add_argument("--data", type=Path, required=True)
    e.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("tune")
    t.add_argument("name", choices=tuple(COMMANDS))
    t.add_argument("--model", type=Path, required=True)
    t.add_argument("--data", type=Path, required=True)
    t.add_argument("--work", type=Path, required=True)
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--time-budget", type=float, default=300.0)
    t.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    stages = {"run": run, "summarise": summarise, "commands": commands, "eval": evaluate, "tune": tune}
    return stages[args.stage](args)


if __name__ == "__main__":
    sys.exit(main())
