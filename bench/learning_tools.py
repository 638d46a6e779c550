"""Benchmark: does a model learn to use a tool? GRPO with a calculator against GRPO without, 3 seeds each.

    python bench/learning_tools.py --out /tmp/tools --results $OUT --set base_model=$SMOL   # one H200 call
    python bench/learning_tools.py --out /tmp/tools-smoke --smoke                          # tiny, CPU

Stages (each through the public commands, each skipped when its output is there):

1. data: the multi-step task (`python -m fulcrum.data.multistep`, as bench/learning.py writes it) and the
   same problems for the tool agent (`python -m fulcrum.agent.multistep_tools`): RL rows with the
   calculator's system message and `tools_kwargs`, and `sft.parquet`, a conversation per training
   problem that calls the calculator once per worked line and ends with `#### N`;
2. two warm starts with the same SFT budget (`sft_steps` steps of `sft_batch_size`, run side by side):
   `fulcrum sft` on the worked solutions (the without-tools arm) and `fulcrum sft
   data.multiturn.enable=true` on the traces, loss on the assistant turns only (the with-tools arm).
   No checkpoint choice: each arm starts RL from its last SFT step, and the runs' step-0 validation
   is each warm start's accuracy;
3. RL: six GRPO runs started together, `tools-s<seed>` (the agent loop with the calculator,
   `actor_rollout_ref.rollout.multi_turn.*`, fulcrum/agent/configs/calculator_tool_config.yaml) and
   `plain-s<seed>` (one turn), seeds 1-3, same prompts a step, samples, learning rate, response budget
   (every turn's tokens and the tool answers count against it) and wall-time budget, both on the native
   engine; greedy validation every `test_freq` steps (the tools arm's validation runs the agent loop);
4. summary (`tools_summary.json`, `tools_summary.md`): per arm the final validation accuracy, mean ± std
   over seeds, and per run its step-0 and final accuracy, the tool-call rate, tool calls and errors
   per conversation, turns per conversation and response length (last training step). The same
   quantities are plotted per run by `fulcrum report rl/tools-s1 --compare rl/plain-s1`.

The plan (sizes, budgets, learning rates) is bench/learning.py's `Plan`, set with `--set FIELD=VALUE`;
`TOOLS` and `TOOLS_SMOKE` below are this benchmark's defaults over it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from learning import Plan, pack, prepare, read_metrics, run_all, with_settings
from learning_report import RunResult
from learning_variants import Variant, merge_overrides
from learning_warm import _env, sft_command

REPO = Path(__file__).resolve().parent.parent
TOOL_CONFIG = REPO / "fulcrum" / "agent" / "configs" / "calculator_tool_config.yaml"
ARMS = ("tools", "plain")

# SmolLM2 on one H200 (bench/real_model.sh's settings): a trace is ~190 response tokens for four
# operations (calls, tool answers and `#### N`), its prompt ~150 with the calculator's system message.
TOOLS = replace(
    Plan(),
    num_test=300,
    max_prompt_length=256,
    max_response_length=256,
    gradient_checkpointing=True,
    sft_batch_size=64,
    sft_micro_batch=32,
    sft_lr=5e-5,
    sft_steps=150,
    prompts_per_step=64,
    grpo_n=8,
    micro_batch=64,
    actor_lr=5e-6,
    gpu_memory_utilization=0.06,
    budget_s=270.0,
    deadline_s=560.0,
    algos=("grpo",),
)
TOOLS_SMOKE = replace(
    TOOLS,
    size="tiny",
    num_train=64,
    num_test=8,
    num_dev=4,
    sft_steps=4,
    sft_batch_size=8,
    sft_micro_batch=8,
    sft_lr=2e-3,
    gradient_checkpointing=False,
    prompts_per_step=4,
    grpo_n=2,
    micro_batch=8,
    actor_lr=1e-4,
    seeds=(1,),
    budget_s=20.0,
    deadline_s=900.0,
    test_freq=2,
    max_response_length=96,
    device="cpu",
    threads_per_run=1,
)


def tool_sft_command(out: Path, base: Path, plan: Plan) -> list[str]:
    """`fulcrum sft` on the calculator traces: the plain arm's command with verl's multi-turn keys, the
    traces as data, and a run folder of its own."""
    changes = [
        f"data.train_files={out / 'data-tools' / 'sft.parquet'}",
        "data.multiturn.enable=true",
        "data.multiturn.messages_key=messages",
        "data.multiturn.tools_key=tools",
        f"trainer.default_local_dir={out / 'sft-tools'}",
    ]
    plain = sft_command(out, base, plan)
    return [*plain[:3], *merge_overrides(plain[3:], changes)]


def warm_starts(out: Path, base: Path, plan: Plan) -> dict[str, Path]:
    """Both arms' SFT, side by side, each to its last step (saved only there); the model folders."""
    plan_one_save = replace(plan, sft_check_every=-1)
    commands = {
        "plain": sft_command(out, base, plan_one_save),
        "tools": tool_sft_command(out, base, plan_one_save),
    }
    folders = {"plain": out / "sft", "tools": out / "sft-tools"}
    models = {arm: folders[arm] / f"global_step_{plan.sft_steps}" for arm in ARMS}
    procs = {}
    for arm in ARMS:
        if models[arm].is_dir():
            continue
        print(f"$ {' '.join(commands[arm])}", flush=True)
        log = (out / f"sft-{arm}.log").open("w")
        procs[arm] = subprocess.Popen(
            commands[arm], stdout=log, stderr=subprocess.STDOUT, env=_env(plan.threads_per_run)
        )
    for arm, proc in procs.items():
        if proc.wait() != 0:
            tail = "\n".join((out / f"sft-{arm}.log").read_text().splitlines()[-30:])
            raise SystemExit(f"fulcrum sft ({arm}) failed (exit {proc.returncode}):\n{tail}")
    return models


def arm_variants(models: dict[str, Path], out: Path, plan: Plan) -> list[Variant]:
    """The six runs: per arm and seed, the overrides laid over bench/learning.py's GRPO run."""
    variants = []
    for arm in ARMS:
        data = out / ("data-tools" if arm == "tools" else "data")
        overrides = [
            "algorithm.adv_estimator=grpo",
            f"actor_rollout_ref.model.path={models[arm]}",
            f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'test.parquet'}",
            "actor_rollout_ref.rollout.name=native",  # the agent loop runs on the native engine; both arms do
        ]
        if arm == "tools":
            overrides += [
                "actor_rollout_ref.rollout.multi_turn.enable=True",
                f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOL_CONFIG}",
                "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=6",  # 4 calls + the answer, 1 spare
                "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=64",
            ]
        for seed in plan.seeds:
            variants.append(Variant(f"{arm}-s{seed}", "grpo", (*overrides, f"trainer.seed={seed}")))
    return variants


def last_value(rows: list[dict], key: str) -> float | None:
    """The metric's last logged value in a run's rows, or None."""
    values = [row[key] for row in rows if key in row]
    return float(values[-1]) if values else None


def run_summary(result: RunResult, out: Path) -> dict:
    """One run's row: step-0 and final greedy accuracy, and its conversations at the last step."""
    rows = read_metrics(out / "rl" / result.label)
    keys = {
        "tool_call_rate": "tools/call_rate",
        "tool_calls": "tools/calls",
        "tool_errors": "tools/errors",
        "turns": "num_turns/mean",
        "response_length": "response_length/mean",
    }
    return {
        "run": result.label,
        "steps": result.last_step,
        "failed": result.failed,
        "error": result.error,
        "start_accuracy": result.val[0][2] if result.val else None,
        "final_accuracy": result.val[-1][2] if result.val else None,
        **{name: last_value(rows, key) for name, key in keys.items()},
    }


def summarise_arms(results: list[RunResult], out: Path) -> dict:
    """Per run rows, per arm mean ± std of the final accuracy, and tools minus plain."""
    runs = [run_summary(r, out) for r in results]
    arms = {}
    for arm in ARMS:
        finals = [
            r["final_accuracy"] for r in runs if r["run"].startswith(arm) and r["final_accuracy"] is not None
        ]
        if finals:
            std = statistics.stdev(finals) if len(finals) > 1 else 0.0
            arms[arm] = {"mean": statistics.fmean(finals), "std": std, "seeds": len(finals)}
    gap = arms["tools"]["mean"] - arms["plain"]["mean"] if len(arms) == 2 else None
    return {"runs": runs, "arms": arms, "tools_minus_plain": gap}


def _cell(value: float | None, spec: str = ".3f") -> str:
    return "—" if value is None else format(value, spec)


def markdown(summary: dict) -> str:
    """The summary as two tables: the arms, then every run."""
    lines = ["| arm | seeds | final accuracy, mean ± std |", "| --- | --- | --- |"]
    for arm, a in summary["arms"].items():
        lines.append(f"| {arm} | {a['seeds']} | {a['mean']:.3f} ± {a['std']:.3f} |")
    lines.append(f"\ntools − plain: {_cell(summary['tools_minus_plain'])}\n")
    lines += [
        "| run | steps | step-0 acc | final acc | call rate | calls | errors | turns | response length |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in summary["runs"]:
        cells = [
            r["start_accuracy"],
            r["final_accuracy"],
            r["tool_call_rate"],
            r["tool_calls"],
            r["tool_errors"],
        ]
        numbers = " | ".join(_cell(v) for v in cells)
        lines.append(
            f"| {r['run']}{' (failed)' if r['failed'] else ''} | {r['steps']} | {numbers} | "
            f"{_cell(r['turns'], '.2f')} | {_cell(r['response_length'], '.0f')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="working folder (resumable)")
    parser.add_argument("--results", type=Path, help="also copy the results here, e.g. $OUT")
    parser.add_argument("--smoke", action="store_true", help="everything tiny, on the CPU")
    parser.add_argument("--set", nargs="+", default=[], metavar="FIELD=VALUE", help="any Plan field")
    args, extra = parser.parse_known_args(argv)
    try:
        plan = with_settings(TOOLS_SMOKE if args.smoke else TOOLS, args.set)
    except ValueError as err:
        parser.error(f"--set: {err}")
    started = time.monotonic()
    stop_at = started + plan.deadline_s - plan.summary_reserve_s
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    try:
        base = prepare(out, plan, stop_at)
        if not (out / "data-tools" / "sft.parquet").exists():
            cmd = [sys.executable, "-m", "fulcrum.agent.multistep_tools", "--src", str(out / "data")]
            subprocess.run([*cmd, "--out", str(out / "data-tools")], check=True, env=_env(1))
        models = warm_starts(out, base, plan)
        print(f"warm starts done ({time.monotonic() - started:.0f} s)", flush=True)
        results = run_all(models["plain"], out, plan, extra, stop_at, arm_variants(models, out, plan))
        summary = summarise_arms(results, out)
        summary["plan"] = {k: str(v) for k, v in vars(plan).items()}
        summary["seconds"] = time.monotonic() - started
        (out / "tools_summary.json").write_text(json.dumps(summary, indent=1))
        (out / "tools_summary.md").write_text(markdown(summary))
        print(markdown(summary))
        print(f"total {summary['seconds'] / 60:.1f} min", flush=True)
    finally:
        if args.results:
            pack(out, args.results)
            for name in ("tools_summary.json", "tools_summary.md"):
                if (out / name).exists():
                    (args.results / name).write_bytes((out / name).read_bytes())
    return 1 if any(r["failed"] for r in summary["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
