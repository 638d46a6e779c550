"""Benchmark: does RL learn? PPO (GAE, with a critic) and GRPO from one supervised warm start, side by side.

    python bench/learning.py --out /tmp/learning --results $OUT    # one H200, one call of < 10 min
    python bench/learning.py --out /tmp/learning-smoke --smoke     # the whole pipeline, tiny, CPU, ~2 min
    python bench/learning.py --plot .bench/learning/summary.json   # PNG curves from a summary (needs matplotlib)
    python bench/learning.py --out /tmp/learning --results $OUT --variants levers   # lever variants, one call

Stages, each through the public commands (so it tests what users run), each skipped when its output
is already there (a second call resumes):

1. data: `python -m fulcrum.data.multistep` — GSM8K-format word problems of 2–4 operations with worked
   solutions, 20,000 training, 500 held-out validation and 200 dev problems (no two splits share a
   question or an equation chain);
2. model: `fulcrum tiny-model --size medium` (27 M parameters, random);
3. warm start: `fulcrum sft` on the worked solutions (cosine schedule over 1,500 steps), a checkpoint
   every 25 steps, each checked greedy on the dev set here while SFT trains on; SFT stops at the first
   checkpoint with format accuracy (a strict `#### N` present) >= 95 % and dev accuracy >= 0.3 (or the
   one before it if that one overshoots 0.6: `choose_warm_start`). Run to the end (2026-11-30), SFT
   alone reached 0.996 on this task and RL had nothing left to gain: the benchmark measures what RL
   adds to a model that has the format but not yet the answers. The chosen checkpoint is then checked
   on the 500 validation problems; below 95 % format the RL stage does not start;
4. RL: `fulcrum train` with `algorithm.adv_estimator=gae` (critic from the warm start, fresh value head)
   and `=grpo`, for each seed, as separate processes started together, each stopped (SIGTERM) after
   `--budget-min` minutes of training (counted from its first, step-0 validation; 6.5 by default) and
   all of them `--deadline-min` minutes after the script started (9 by default: the whole benchmark
   fits one 10-minute device call); greedy validation every `--test-freq` steps, GSM8K strict reward;
5. summary: `summary.json` (warm start, per algorithm and seed the step-0 / final / best validation
   accuracy, mean ± std and range over seeds, every run's curves) and `summary.md`; `--plot` draws
   reward, validation accuracy, KL, entropy, response length and critic explained variance per run;
6. with `--results DIR` (a device call's $OUT): at most 6 files copied there (`pack`).

`--variants NAME=KEY=VALUE[,KEY=VALUE...] ...` (or `--variants levers`, a built-in set) replaces stage
4's grid: one run per variant (its own `trainer.seed`, else the first of `--seeds`; the algorithm the
variant names), all started together from the same warm start under the same budget and deadline, at
most six (MEMORY); the summary, its table and the curves name each run by its variant, with its KL at
the end and at its peak; variants that differ only in `trainer.seed` are averaged as seeds of one
setting (mean ± std and range). The variants, and why the built-in set is what it is:
`learning_variants.py`.

MEMORY (six processes on one 140 GiB card; `fulcrum doctor` with the runs' overrides itemises it): per
process the engine's fixed 0.03 x 140 = 4.2 GiB (KV cache 3.4 GiB), actor + reference (+ critic)
weights, gradients and AdamW state < 1 GiB, the CUDA context 0.5 GiB, and the activations of one
128-response micro-batch without checkpointing, 5.9 GiB (+ 0.4 GiB logits): estimated peaks 11.1 GiB
(PPO) and 10.8 GiB (GRPO). On 2026-11-30 (micro-batch 256, engine 0.05) the estimate was 20.2 / 19.9
GiB and the processes held 20.8–26.4 / 20.6–22.8 GiB (allocator cache on top, up to +6.2 GiB): six of
them plus this script's 2 GiB filled the card and one run died of out-of-memory at step 3. Now, even
with that +6.2 / +2.9 GiB on top: 3 x 17.3 + 3 x 13.7 + this script's context 1 = 94 GiB <= 100,
so about 45 GiB stay free. The warm-start checks release their model before RL starts, and SFT has
ended by then.

The warm start's code is in `learning_warm.py`, the summary's in `learning_report.py`, the variants'
in `learning_variants.py`; this file, over 400 lines, keeps the plan and the stages' order in one place.

Every RL run is a normal run directory (`rl/<algo>-s<seed>/` or `rl/<variant>/`: `metrics.jsonl`,
`config.yaml`, `train.log`), so `fulcrum report` works on it. Extra `KEY=VALUE` arguments go to every
`fulcrum train` run (after a variant's own, so they win).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from learning_report import RunResult, curves_of, markdown, plot, summarise, val_key_of
from learning_variants import Variant, check_overrides, merge_overrides, parse_variants, variant_seed
from learning_warm import _env, _step, dump_stats, fulcrum, sft_and_choose, warm_start_check


@dataclass(frozen=True)
class Plan:
    """Every setting; `--smoke` replaces them with SMOKE's.

    Sized for ONE device call of at most 10 minutes on one H200 (`deadline_s`, counted from the script's
    start, stops everything in time to write the summary): data + model + SFT + check about 2 minutes,
    then the six RL runs side by side for `budget_s` each."""

    size: str = "medium"
    task: str = "multistep"  # or "gsm8k": the real GSM8K (`--gsm8k-src`), dev = 200 training problems
    base_model: str = ""  # a Hugging Face folder to start from (e.g. SmolLM2) instead of `tiny-model --size`
    gsm8k_src: str = ""  # GSM8K's train.jsonl / test.jsonl folder (task gsm8k)
    gsm8k_num_test: int = 0  # the first this many of GSM8K's 1,319 test problems (0: all; the smoke: a few)
    num_train: int = 20000
    num_test: int = 500
    num_dev: int = 200  # problems in neither split, for choosing the warm-start checkpoint
    sft_steps: int = 1500  # the cosine schedule's length and the most steps; SFT stops at the choice
    sft_check_every: int = 25  # a checkpoint every this many steps, each checked greedy on the dev set
    sft_batch_size: int = 64
    sft_micro_batch: int = 64
    sft_lr: float = 5e-4
    min_format_accuracy: float = 0.95
    # The warm start: the first checkpoint with format >= min_format_accuracy and dev accuracy >=
    # warm_min_accuracy, or the one before it when that one overshoots warm_max_accuracy (see
    # choose_warm_start). On 2026-11-30 the full 1,500 steps reached 0.996: nothing left for RL.
    warm_min_accuracy: float = 0.3
    warm_max_accuracy: float = 0.6
    seeds: tuple[int, ...] = (1, 2, 3)
    algos: tuple[str, ...] = ("gae", "grpo")
    budget_s: float = 390.0  # RL wall time per run, from its step-0 validation
    deadline_s: float = 540.0  # the whole script, from its start: runs still going are stopped then
    summary_reserve_s: float = 25.0  # kept free before the deadline for the summary, plot and pack
    test_freq: int = 5
    max_response_length: int = 96  # worked solutions are 20-58 tokens (tiny tokenizer)
    max_prompt_length: int = 192
    gradient_checkpointing: bool = (
        False  # a 27 M model's activations fit; a 135 M model's at micro 128 do not
    )
    prompts_per_step: int = 128  # GRPO: this many prompts x n; PPO: the same number of responses, n = 1
    grpo_n: int = 8
    actor_lr: float = 1e-4  # a 27 M model warm-started at 5e-4 (cosine to 0); few steps fit the budget
    critic_lr: float = 1e-4  # verl's default is 1e-5 (a pretrained critic); the value head here is fresh
    critic_warmup: int = 3  # steps that train only the critic (trainer.critic_warmup)
    kl_loss_coef: float = 0.001
    micro_batch: int = 128  # see MEMORY in the module docstring: 256 ran the card out of memory
    rollout: str = "native"
    # Each engine keeps a fixed 0.03 x 140 = 4.2 GiB (weights, workspace, a KV cache of ~430k tokens
    # against the 1,024 x 288 = 295k a step can need) and never releases it (free_cache_engine=False), so
    # its CUDA graphs are captured once rather than after every step.
    gpu_memory_utilization: float = 0.03
    # torch.compile per run: six processes compiling at once on 16 cores costs minutes of the budget,
    # and a 27 M model's step is small; eager it is.
    use_torch_compile: bool = False
    device: str = "cuda"
    threads_per_run: int = 2  # CPU threads per process: six runs share the H200 machine's 16 cores
    # Each run saves a checkpoint when its budget stops it, and a later call with --continue-runs resumes
    # every finished run for another budget: RL longer than one 10-minute device call (the machine and its
    # /tmp are kept while calls follow each other).
    save_at_stop: bool = False


SMOKE = Plan(
    size="tiny",
    num_train=300,
    num_test=24,
    num_dev=16,
    sft_steps=60,
    sft_check_every=10,
    sft_batch_size=16,
    sft_micro_batch=16,
    sft_lr=2e-3,
    warm_min_accuracy=0.0,  # a 1.3 M model on 300 problems learns the format, not the sums
    seeds=(1,),
    budget_s=30.0,
    deadline_s=900.0,
    test_freq=1,
    max_response_length=48,
    prompts_per_step=8,
    grpo_n=4,
    actor_lr=1e-4,
    critic_warmup=1,
    micro_batch=64,
    rollout="hf",
    device="cpu",
    threads_per_run=1,
)


def _run(cmd: list[str], log: Path, plan: Plan, stop_at: float) -> None:
    """Run a preparation step; stopped when `stop_at` (time.monotonic()) comes first."""
    print(f"$ {' '.join(cmd)}", flush=True)
    with log.open("w") as out:
        env = _env(plan.threads_per_run)
        code: int | str
        try:
            timeout = max(stop_at - time.monotonic(), 1.0)
            code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            code = "stopped: out of time"
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise SystemExit(f"failed (exit {code}): {' '.join(cmd)}\n--- {log} (last lines) ---\n{tail}")


def prepare(out: Path, plan: Plan, stop_at: float) -> Path:
    """Data (with a dev set) and the base model; returns the base model folder."""
    data, base = out / "data", out / "base_model"
    if plan.task == "gsm8k" and not (data / "dev.parquet").exists():
        _run(
            fulcrum("data", "gsm8k", "--src", plan.gsm8k_src, "--out", str(data)),
            out / "data.log",
            plan,
            stop_at,
        )
        gsm8k_dev_split(data, plan.num_dev, plan.gsm8k_num_test)
    elif not (data / "dev.parquet").exists():
        args = ["--out", str(data), "--train", str(plan.num_train), "--test", str(plan.num_test)]
        args += ["--dev", str(plan.num_dev)]
        _run([sys.executable, "-m", "fulcrum.data.multistep", *args], out / "data.log", plan, stop_at)
    if plan.base_model:
        return Path(plan.base_model)
    if not (base / "config.json").exists():
        _run(fulcrum("tiny-model", "--out", str(base), "--size", plan.size), out / "model.log", plan, stop_at)
    return base


def gsm8k_dev_split(data: Path, size: int, num_test: int) -> None:
    """`dev.parquet`: the last `size` GSM8K training problems, held out of `train.parquet` (the SFT and RL
    data), for choosing the warm-start checkpoint without looking at the test set; the test set cut to
    its first `num_test` problems when that is > 0."""
    import pyarrow.parquet as pq

    if num_test > 0:
        pq.write_table(pq.read_table(data / "test.parquet").slice(0, num_test), data / "test.parquet")
    train = pq.read_table(data / "train.parquet")
    pq.write_table(train.slice(train.num_rows - size), data / "dev.parquet")
    pq.write_table(train.slice(0, train.num_rows - size), data / "train.parquet")


def rl_overrides(algo: str, seed: int, model: Path, data: Path, run: Path, plan: Plan) -> list[str]:
    """`fulcrum train` overrides for one run; PPO and GRPO see the same number of responses a step."""
    n = plan.grpo_n if algo == "grpo" else 1
    prompts = plan.prompts_per_step if algo == "grpo" else plan.prompts_per_step * plan.grpo_n
    mini = max(prompts // 2, 1)  # two actor updates a step
    mb = min(plan.micro_batch, mini * n)  # a micro-batch must divide the mini-batch's responses
    overrides = [
        f"algorithm.adv_estimator={algo}",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        f"data.train_batch_size={prompts}",
        f"data.max_prompt_length={plan.max_prompt_length}",
        f"data.max_response_length={plan.max_response_length}",
        f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={plan.gradient_checkpointing}",
        f"actor_rollout_ref.actor.use_torch_compile={plan.use_torch_compile}",  # the critic follows it
        f"actor_rollout_ref.actor.optim.lr={plan.actor_lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={mb}",
        "actor_rollout_ref.actor.use_kl_loss=True",
        f"actor_rollout_ref.actor.kl_loss_coef={plan.kl_loss_coef}",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        f"actor_rollout_ref.rollout.name={plan.rollout}",
        f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={plan.gpu_memory_utilization}",
        "actor_rollout_ref.rollout.free_cache_engine=False",  # see Plan.gpu_memory_utilization
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={mb}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={mb}",
        "trainer.total_training_steps=100000",  # the wall-time budget stops the run
        "trainer.total_epochs=1000",
        "trainer.val_before_train=True",
        f"trainer.test_freq={plan.test_freq}",
        "trainer.save_freq=-1",
        # SIGTERM at the budget ends the run at once, or (save_at_stop) after the step and its checkpoint
        f"trainer.save_on_interrupt={plan.save_at_stop}",
        f"trainer.resume_mode={'auto' if plan.save_at_stop else 'disable'}",
        "trainer.logger=[console]",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.device={plan.device}",
        f"trainer.seed={seed}",
        "trainer.project_name=fulcrum-learning",
        f"trainer.experiment_name={algo}-s{seed}",
        f"trainer.default_local_dir={run}",
        f"trainer.validation_data_dir={run / 'generations'}",  # strict/flexible/format of each validation
    ]
    if algo == "gae":
        overrides += [
            f"critic.model.path={model}",
            f"critic.model.enable_gradient_checkpointing={plan.gradient_checkpointing}",
            f"critic.optim.lr={plan.critic_lr}",
            f"critic.ppo_micro_batch_size_per_gpu={mb}",
            f"critic.forward_micro_batch_size_per_gpu={mb}",
            f"trainer.critic_warmup={plan.critic_warmup}",
        ]
    return overrides


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written when the run was stopped
            break
    return rows


def _progress(run: Path) -> str:
    rows = read_metrics(run)
    if not rows:
        return "starting"
    val = [r[k] for r in rows if (k := val_key_of(r))]
    step = int(rows[-1].get("training/global_step", 0))
    return f"step {step}, val {val[-1]:.3f}" if val else f"step {step}"


def planned_runs(plan: Plan, variants: list[Variant]) -> list[tuple[str, int, Variant | None]]:
    """(algorithm, seed, variant) of each RL run: the algorithms x seeds grid, or one run per variant
    with its own trainer.seed (the plan's first seed when it sets none)."""
    if variants:
        return [(v.algo, variant_seed(v, plan.seeds[0]), v) for v in variants]
    return [(algo, seed, None) for algo in plan.algos for seed in plan.seeds]


def run_all(
    model: Path,
    out: Path,
    plan: Plan,
    extra: list[str],
    stop_at: float,
    variants: Sequence[Variant] = (),
    continue_runs: bool = False,
) -> list[RunResult]:
    """Start every run at once (`planned_runs`); stop each `budget_s` after its step-0 validation (a
    continued run: after its first new metrics row), and every one still going at `stop_at`
    (time.monotonic()); SIGKILL what SIGTERM has not ended within the grace (20 s, or 90 s when each run
    saves a checkpoint at its stop). `continue_runs`: resume the finished runs (save_at_stop) too."""
    procs: dict[str, tuple[subprocess.Popen, Path, RunResult]] = {}  # by the run's label
    rows_at_start: dict[str, int] = {}  # metrics rows a continued run already had
    grace_s = 90.0 if plan.save_at_stop else 20.0
    results = []
    for algo, seed, variant in planned_runs(plan, list(variants)):
        pending = RunResult(algo, seed, None, False, variant=variant.name if variant else "")
        run = out / "rl" / pending.label
        overrides = rl_overrides(algo, seed, model, out / "data", run, plan)
        if variant:
            overrides = merge_overrides(
                overrides, [*variant.overrides, f"trainer.experiment_name={variant.name}"]
            )
        cmd = fulcrum("train", *overrides, *extra)
        rows_before = len(read_metrics(run))
        if continue_runs and (run / "result.json").exists():
            if not plan.save_at_stop or (run / "command.txt").read_text() != " ".join(cmd) + "\n":
                raise SystemExit(
                    f"{run}: only a run started with save_at_stop and the same command continues"
                )
            (run / "result.json").unlink()  # unfinished again until this call's budget stops it
        elif (run / "result.json").exists():  # finished by an earlier call
            if variant and (run / "command.txt").read_text() != " ".join(cmd) + "\n":
                raise SystemExit(
                    f"{run} finished with other overrides than variant {variant.name}: move it away"
                )
            results.append(RunResult(**json.loads((run / "result.json").read_text())))
            continue
        if run.exists() and not rows_before:
            raise SystemExit(f"{run} holds an unfinished run: move it away to run it again")
        run.mkdir(parents=True, exist_ok=True)
        (run / "command.txt").write_text(" ".join(cmd) + "\n")
        log = (run / "train.log").open("a")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(plan.threads_per_run))
        procs[pending.label] = (proc, run, pending)
        rows_at_start[pending.label] = rows_before
    left = stop_at - time.monotonic()
    print(
        f"started {len(procs)} runs; budget {plan.budget_s / 60:.1f} min each, all stopped within "
        f"{left / 60:.1f} min",
        flush=True,
    )
    started_training: dict[str, float] = {}
    stopped: dict[str, float] = {}
    last_report = time.monotonic()
    while any(p.poll() is None for p, _, _ in procs.values()):
        time.sleep(2)
        now = time.monotonic()
        for key, (proc, run, pending) in procs.items():
            if proc.poll() is not None:
                continue
            if key in stopped:
                if now - stopped[key] > grace_s:
                    proc.kill()
                continue
            if key not in started_training and len(read_metrics(run)) > rows_at_start[key]:
                started_training[key] = now
                print(f"{_who(pending)}: step-0 validation done, budget starts", flush=True)
            over_budget = key in started_training and now - started_training[key] > plan.budget_s
            if over_budget or now > stop_at:
                proc.send_signal(signal.SIGTERM)
                stopped[key] = now
        if now - last_report > 60:
            last_report = now
            print(
                "  " + "; ".join(f"{key}: {_progress(run)}" for key, (_, run, _) in procs.items()), flush=True
            )
    for key, (proc, run, pending) in procs.items():
        rows = read_metrics(run)
        curves, val = curves_of(rows)
        last_step = int(rows[-1].get("training/global_step", 0)) if rows else 0
        result = replace(
            pending,
            exit_code=proc.returncode,
            stopped_by_budget=key in stopped,
            curves=curves,
            val=val,
            last_step=last_step,
            generations=dump_stats(run / "generations"),
        )
        if result.failed:
            log_lines = (run / "train.log").read_text().splitlines()
            result.error = next(
                (x for x in reversed(log_lines) if x.startswith("fulcrum train:")), "see train.log"
            )
            tail = "\n".join(log_lines[-20:])
            print(f"{_who(result)} failed (exit {proc.returncode}):\n{tail}", file=sys.stderr, flush=True)
        else:  # a finished run is kept by a later call; a failed one is not taken as finished
            record = asdict(result)
            if not result.variant:  # the grid's result.json as before
                del record["variant"]
            (run / "result.json").write_text(json.dumps(record))
        results.append(result)
    return results


def _who(result: RunResult) -> str:
    """How the progress lines name a run."""
    return result.variant or f"{result.algo} seed {result.seed}"


def pack(out: Path, results_dir: Path) -> None:
    """At most 8 files into `results_dir` (a device call's $OUT): the summary, the warm-start check, the
    curves and one tar.gz of every run's metrics, config, command and log (no weights, no data)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    for name in ("summary.json", "summary.md", "warm_start.json", "base_check.json", "learning_curves.png"):
        if (out / name).exists():
            shutil.copy(out / name, results_dir / name)
    keep = {"metrics.jsonl", "config.yaml", "command.txt", "train.log", "result.json"}
    with tarfile.open(results_dir / "learning_runs.tar.gz", "w:gz") as tar:
        for path in sorted(out.rglob("*")):
            top_log = path.parent == out and path.suffix == ".log"
            if path.is_file() and (path.name in keep or top_log) and "global_step_" not in str(path):
                tar.add(path, arcname=str(path.relative_to(out)))
        for folder in sorted(out.glob("rl/*/generations")):  # each run's first and last validation
            dumps = sorted(folder.glob("*.jsonl"), key=lambda p: int(p.stem))
            for path in {dumps[0], dumps[-1]} if dumps else ():
                tar.add(path, arcname=str(path.relative_to(out)))
    print(f"packed results into {results_dir}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="working folder (resumable)")
    parser.add_argument("--results", type=Path, help="also copy the results (<= 8 files) here, e.g. $OUT")
    parser.add_argument("--smoke", action="store_true", help="everything tiny, on the CPU")
    parser.add_argument("--plot", type=Path, help="draw the curves of this summary.json and exit")
    parser.add_argument("--seeds", type=int, nargs="+")
    parser.add_argument("--algos", nargs="+", choices=("gae", "grpo"))
    parser.add_argument("--budget-min", type=float, help="minutes of RL training per run")
    parser.add_argument("--deadline-min", type=float, help="minutes for the whole script (runs stopped)")
    parser.add_argument("--size", choices=("tiny", "small", "medium", "large"))
    parser.add_argument("--device", choices=("cuda", "cpu"))
    parser.add_argument("--actor-lr", type=float)
    parser.add_argument("--critic-lr", type=float)
    parser.add_argument("--critic-warmup", type=int)
    parser.add_argument("--sft-steps", type=int, help="the most SFT steps (and the cosine schedule's length)")
    parser.add_argument("--warm-min-accuracy", type=float, help="warm start: first checkpoint at least this")
    parser.add_argument("--warm-max-accuracy", type=float, help="warm start: ... unless above this")
    parser.add_argument("--allow-low-format", action="store_true", help="run RL even below 95%% format")
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="FIELD=VALUE",
        help="any Plan field, e.g. --set task=gsm8k base_model=/tmp/smol sft_lr=5e-5 (after the flags above)",
    )
    parser.add_argument(
        "--continue-runs",
        action="store_true",
        help="resume every finished RL run (started with --set save_at_stop=true) for another budget",
    )
    parser.add_argument(
        "--stop-after-warm", action="store_true", help="end after the warm start (and base check); resumable"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        metavar="NAME=KEY=VALUE[,KEY=VALUE...]",
        help="one run per variant (or `levers`, a built-in set; learning_variants.py) instead of the grid",
    )
    args, extra = parser.parse_known_args(argv)
    if args.plot:
        print(f"wrote {plot(args.plot)}")
        return 0
    if args.out is None:
        parser.error("--out is required (or --plot)")
    args.variants = variants_of(args, parser)
    started = time.perf_counter()
    plan = SMOKE if args.smoke else Plan()
    chosen = {
        "seeds": tuple(args.seeds) if args.seeds else None,
        "algos": tuple(args.algos) if args.algos else None,
        "budget_s": args.budget_min * 60 if args.budget_min else None,
        "deadline_s": args.deadline_min * 60 if args.deadline_min else None,
        "size": args.size,
        "device": args.device,
        "actor_lr": args.actor_lr,
        "critic_lr": args.critic_lr,
        "critic_warmup": args.critic_warmup,
        "sft_steps": args.sft_steps,
        "warm_min_accuracy": args.warm_min_accuracy,
        "warm_max_accuracy": args.warm_max_accuracy,
    }
    plan = replace(plan, **{k: v for k, v in chosen.items() if v is not None})
    try:
        plan = with_settings(plan, args.set)
    except ValueError as err:
        parser.error(f"--set: {err}")
    if plan.device == "cpu" and plan.rollout == "native" and not args.smoke:
        plan = replace(plan, rollout="hf")
    # a run that saves at its stop may take the 90 s grace to end: stop it that much sooner
    save_grace_s = 70.0 if plan.save_at_stop else 0.0
    stop_at = time.monotonic() + plan.deadline_s - plan.summary_reserve_s - save_grace_s
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        code = learn(args, plan, extra, started, stop_at)
    finally:
        if args.results:
            pack(args.out, args.results)
    return code


def with_settings(plan: Plan, settings: Sequence[str]) -> Plan:
    """`plan` with each FIELD=VALUE applied, VALUE parsed as the field's current type (a tuple of ints for
    `seeds`: `1,2,3`)."""
    changes: dict[str, object] = {}
    for item in settings:
        name, sep, text = item.partition("=")
        if not sep or not hasattr(plan, name):
            raise ValueError(f"{item!r}: expected FIELD=VALUE with a Plan field ({', '.join(asdict(plan))})")
        current = getattr(plan, name)
        if isinstance(current, bool):
            if text.lower() not in ("true", "false"):
                raise ValueError(f"{name}: expected true or false, got {text!r}")
            changes[name] = text.lower() == "true"
        elif isinstance(current, tuple):
            changes[name] = tuple(type(current[0])(v) for v in text.split(",")) if current else (text,)
        else:
            changes[name] = type(current)(text)
    return replace(plan, **changes)


def variants_of(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[Variant]:
    """The checked `--variants` ([] without them); a bad one stops here, before any stage runs."""
    if not args.variants:
        return []
    if args.algos:
        parser.error("--algos: each of --variants names its own algorithm")
    if args.seeds and len(args.seeds) > 1:
        parser.error("--seeds: one run per variant, so one seed with --variants")
    try:
        variants = parse_variants(args.variants)
        check_overrides(variants)
    except ValueError as err:
        parser.error(str(err))
    return variants


def _check_line(check: dict) -> str:
    return (
        f"strict {check['accuracy']:.4f}, flexible {check.get('flexible_accuracy', float('nan')):.4f}, "
        f"format {check['format_accuracy']:.3f}, {check.get('response_length', float('nan')):.0f} tokens "
        f"on {check['num_problems']} problems"
    )


def _elapsed(started: float) -> str:
    return f"{time.perf_counter() - started:.0f} s so far"


def learn(args: argparse.Namespace, plan: Plan, extra: list[str], started: float, stop_at: float) -> int:
    warm_file, base_file = args.out / "warm_start.json", args.out / "base_check.json"
    if plan.base_model and not base_file.exists():  # a pretrained model's own accuracy, before SFT
        base = prepare(args.out, plan, stop_at)
        check = warm_start_check(base, args.out / "data" / "test.parquet", plan)
        base_file.write_text(json.dumps(check))
        print(f"base model {base}: {_check_line(check)} ({_elapsed(started)})", flush=True)
    if not warm_file.exists():
        base = prepare(args.out, plan, stop_at)
        model, checks = sft_and_choose(args.out, base, plan, stop_at)
        warm = warm_start_check(model, args.out / "data" / "test.parquet", plan)
        warm["model"] = str(model.relative_to(args.out))
        warm["sft_step"] = _step(model)
        warm["dev_checks"] = [{k: c[k] for k in ("step", "accuracy", "format_accuracy")} for c in checks]
        warm_file.write_text(json.dumps(warm))
    warm = json.loads(warm_file.read_text())
    model = args.out / warm["model"]
    print(f"warm start {model}: {_check_line(warm)} ({_elapsed(started)})", flush=True)
    if args.stop_after_warm:
        return 0
    if warm["format_accuracy"] < plan.min_format_accuracy:
        message = (
            f"format accuracy {warm['format_accuracy']:.3f} < {plan.min_format_accuracy} after the warm start"
        )
        if not (args.smoke or args.allow_low_format):
            print(f"{message}: more SFT steps (--sft-steps) before RL", file=sys.stderr)
            return 1
        print(f"note: {message} (allowed here)", flush=True)

    results = run_all(model, args.out, plan, extra, stop_at, args.variants, args.continue_runs)
    print(f"RL done ({_elapsed(started)})", flush=True)
    summary = summarise(warm, results, plan, {v.name: list(v.overrides) for v in args.variants} or None)
    if base_file.exists():
        summary["base_model_check"] = json.loads(base_file.read_text())
    (args.out / "summary.json").write_text(json.dumps(summary))
    text = markdown(summary)
    (args.out / "summary.md").write_text(text)
    print(text)
    try:
        print(f"wrote {plot(args.out / 'summary.json')}")
    except ImportError:
        print(
            f"no matplotlib here: draw the curves with `python bench/learning.py --plot {args.out}/summary.json`"
        )
    print(f"total {(time.perf_counter() - started) / 60:.1f} min", flush=True)
    failed = [r for r in results if not r.stopped_by_budget and r.exit_code != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
