"""`fulcrum doctor [--config FILE] [KEY=VALUE ...]`: check a configuration before spending GPU time.

Exit 0 with a short summary (resolved batch sizes, device, keys without effect) when the run can go;
exit 1 with each problem named when it would fail or waste compute. The checks are small functions
in CHECKS, each returning findings; add a function to add a rule. Over 400 lines because every
set-up check that needs no weights (model folders, data files, vocabularies, devices) sits here, one
small function each; the lever rules are in doctor_rules.py, the checks that read a model's config.json
or a multi-turn run's files in doctor_model.py, and the memory estimate in memory_estimate.py.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import importlib.util
import logging
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fulcrum.config import (
    ConfigError,
    FulcrumConfig,
    advise,
    format_keys,
    is_no_effect,
    load_config,
    load_yaml,
    to_dict,
    unresolve,
    uses_critic,
    uses_reference,
    world_size,
)
from fulcrum.config.compat import ROLLOUT_NAME_ALIASES, UNSUPPORTED
from fulcrum.config.device import cuda_device_count
from fulcrum.config.finding import Finding
from fulcrum.config.keys import flatten
from fulcrum.config.schema_data import DataConfig
from fulcrum.models.folder import (
    looks_like_path,
    model_folder_problems,
    models_reading_actor_ids,
    models_to_check,
    vocab_problems,
)
from fulcrum.models.lora import adapter_folder_problems
from fulcrum.tools.doctor_model import MODEL_CHECKS
from fulcrum.tools.doctor_rules import LEVER_CHECKS, memory_lines
from fulcrum.trainer.old_log_probs import old_log_prob_pass_runs, update_can_give_old_log_probs

USAGE = """usage: fulcrum doctor [--config FILE] [--device-memory-gib GIB] [KEY=VALUE ...]
       fulcrum doctor --keys        list every configuration key with its default and meaning

Checks a training configuration (verl's keys and override spelling) without starting a run.
Exit status: 0 = can run, 1 = will fail or waste compute (each problem is named)."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class Context:
    cfg: FulcrumConfig
    device: str  # "cuda" or "cpu", after resolving trainer.device
    n_visible: int  # CUDA devices visible
    overrides: list[str] = field(default_factory=list)
    device_memory_gib: float | None = (
        None  # --device-memory-gib: the card to compare the memory estimate with
    )


def _error(text: str) -> Finding:
    return Finding((), text)


def _warning(text: str) -> Finding:
    return Finding((), text, "warning")


# ------------------------------------------------------------------------------------------ checks
def check_rules(ctx: Context) -> list[Finding]:
    """The rules shared with the trainer (fulcrum.trainer.checks): key domains, cross-key rules, the
    algorithms' names, the actor's context length; `fulcrum train` runs the same function before any
    model loads."""
    from fulcrum.trainer.checks import configuration_findings  # the algorithm package imports torch

    n_devices = ctx.n_visible if ctx.device == "cuda" else None
    # A rule that explains itself (why, fix) keeps its block; the others print as one line, keys first.
    return [
        p if p.why or p.fix else dataclasses.replace(p, keys=(), message=str(p))
        for p in configuration_findings(ctx.cfg, n_devices) + advise(ctx.cfg)
    ]


def _as_list(files: str | list[str]) -> list[str]:
    return [files] if isinstance(files, str) else list(files)


def _parquet_columns(key: str, name: str, data: DataConfig) -> list[Finding]:
    """The file is a parquet file with the columns the prompt data set reads (schema only, no rows)."""
    import pyarrow.parquet as pq

    from fulcrum.data.dataset import REQUIRED_COLUMNS

    try:
        schema = pq.read_schema(os.path.expanduser(name))
    except Exception as exc:  # pyarrow raises several types for a file that is not parquet
        return [_error(f"{key}: {name} is not a readable parquet file ({str(exc).splitlines()[0]})")]
    missing = [c for c in (data.prompt_key, *REQUIRED_COLUMNS) if c not in schema.names]
    if missing:
        hint = f" (set {data.key('prompt_key')})" if data.prompt_key in missing else ""
        return [_error(f"{key}: {name} has no column(s) {missing}{hint}; columns: {schema.names}")]
    return []


def check_data_files(ctx: Context) -> list[Finding]:
    findings, data = [], ctx.cfg.data
    for attr in ("train_files", "val_files"):
        key, files = data.key(attr), _as_list(getattr(data, attr))
        if not files:
            findings.append(_error(f"{key}: no file given"))
        for name in files:
            path = Path(os.path.expanduser(name))
            if not path.is_file():
                findings.append(
                    _error(f"{key}: {name} does not exist" + (" (it is a folder)" if path.is_dir() else ""))
                )
            else:
                findings += _parquet_columns(key, name, data)
    return findings


def _model_folder(key: str, name: str | None, needs_tokenizer: bool = False) -> list[Finding]:
    """A local folder is checked as the run would load it (config, weight headers, tokenizer), no weights read."""
    if not name:
        return [_error(f"{key}: not set")]
    path = Path(os.path.expanduser(name))
    if path.is_dir():
        return [_error(p) for p in model_folder_problems(name, key, needs_tokenizer=needs_tokenizer)]
    if _HUB_ID.match(name) and not looks_like_path(name):
        return [
            _warning(
                f"{key}: {name} is not a local folder; the run will try it once as a Hugging Face Hub id "
                "(it needs the network or the local Hub cache)"
            )
        ]
    return [_error(f"{key}: {name} does not exist")]


def check_model_paths(ctx: Context) -> list[Finding]:
    """The folders the run checks at its start (`models_to_check`), as findings."""
    findings: list[Finding] = []
    for key, (name, needs_tokenizer) in models_to_check(ctx.cfg).items():
        findings += _model_folder(key, name, needs_tokenizer=needs_tokenizer)
    model = ctx.cfg.actor_rollout_ref.model
    if model.lora_adapter_path:
        findings += [_error(p) for p in adapter_folder_problems(model.lora_adapter_path, model.PATH)]
    return findings


def _models_reading_actor_ids(cfg: FulcrumConfig) -> dict[str, str]:
    """`models_reading_actor_ids` that are local folders (a Hub id is checked by the run, online)."""
    models = models_reading_actor_ids(cfg)
    return {k: v for k, v in models.items() if v and Path(os.path.expanduser(v)).is_dir()}


def check_vocabularies(ctx: Context) -> list[Finding]:
    """Every model that reads the actor's token ids has an embedding row for each (loads the tokenizer only)."""
    actor, key = ctx.cfg.actor_rollout_ref.model.path, ctx.cfg.actor_rollout_ref.model.key("path")
    if not actor or not Path(os.path.expanduser(actor)).is_dir():
        return []
    if model_folder_problems(actor, key, needs_tokenizer=True, needs_weights=False):
        return []  # check_model_paths names what is missing
    from transformers import AutoTokenizer

    try:
        token_count = len(AutoTokenizer.from_pretrained(os.path.expanduser(actor)))
    except Exception as exc:  # a tokenizer that does not load: say so instead of a traceback
        return [_error(f"{key}: the tokenizer of {actor} does not load ({exc})")]
    problems = vocab_problems(token_count, key, _models_reading_actor_ids(ctx.cfg))
    return [_error(p) for p in problems]


def _parquet_rows(names: list[str]) -> int | None:
    """Rows of the files, from their footers (None when one does not read: check_data_files names it)."""
    import pyarrow.parquet as pq

    try:
        return sum(pq.ParquetFile(os.path.expanduser(n)).metadata.num_rows for n in names)
    except Exception:  # pyarrow raises several types for a file that is not parquet
        return None


def check_data_rows(ctx: Context) -> list[Finding]:
    """An empty validation set, or fewer training rows than one batch, stops the run: say so now."""
    data = ctx.cfg.data
    findings = []
    train = _as_list(data.train_files)
    rows = (
        _parquet_rows(train) if train and all(Path(os.path.expanduser(n)).is_file() for n in train) else None
    )
    if rows is not None and rows < data.train_batch_size:
        findings.append(
            _error(
                f"{data.key('train_files')}: {', '.join(train)} hold(s) {rows} row(s), fewer than "
                f"{data.key('train_batch_size')}={data.train_batch_size}: not one full batch"
            )
        )
    val = _as_list(data.val_files)
    val_rows = _parquet_rows(val) if val and all(Path(os.path.expanduser(n)).is_file() for n in val) else None
    if val_rows == 0:
        findings.append(
            _error(f"{data.key('val_files')}: {', '.join(val)} hold(s) no rows; give a file with rows")
        )
    return findings


def check_custom_reward(ctx: Context) -> list[Finding]:
    """The file exists and defines the function (read with ast: doctor never runs user code)."""
    spec = ctx.cfg.custom_reward_function
    if not spec.path:
        return []
    path, path_key = Path(os.path.expanduser(spec.path)), spec.key("path")
    if not path.is_file():
        return [_error(f"{path_key}: {spec.path} does not exist")]
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as exc:
        return [_error(f"{path_key}: {spec.path} line {exc.lineno}: syntax error: {exc.msg}")]
    defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    defined |= {
        t.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    if spec.name not in defined:
        return [_error(f"{spec.key('name')}: {spec.path} defines no function {spec.name!r}")]
    return []


def check_resume(ctx: Context) -> list[Finding]:
    trainer = ctx.cfg.trainer
    if trainer.resume_mode == "resume_path" and trainer.resume_from_path:
        if not Path(os.path.expanduser(trainer.resume_from_path)).is_dir():
            return [_error(f"{trainer.key('resume_from_path')}: {trainer.resume_from_path} does not exist")]
    return []


def check_logger_packages(ctx: Context) -> list[Finding]:
    findings, key = [], ctx.cfg.trainer.key("logger")
    for name in ("wandb", "mlflow"):
        if name in ctx.cfg.trainer.logger and importlib.util.find_spec(name) is None:
            findings.append(_error(f"{key}: lists {name} but the package {name!r} is not installed"))
    return findings


def check_rollout_alias(ctx: Context) -> list[Finding]:
    name_key = ctx.cfg.actor_rollout_ref.rollout.key("name")
    for text in ctx.overrides:
        key, _, value = text.lstrip("+").partition("=")
        if key.strip() == name_key and value.strip("'\" ") in ROLLOUT_NAME_ALIASES:
            name = value.strip("'\" ")
            return [
                _warning(f"{name_key}: fulcrum has no {name} backend; {ROLLOUT_NAME_ALIASES[name]} is used")
            ]
    return []


CHECKS: list[Callable[[Context], list[Finding]]] = [
    check_rules,
    check_data_files,
    check_model_paths,
    check_vocabularies,
    check_data_rows,
    check_custom_reward,
    check_resume,
    check_logger_packages,
    check_rollout_alias,
    *MODEL_CHECKS,  # fulcrum/tools/doctor_model.py: the model's config, the engine, multi-turn files
    *LEVER_CHECKS,  # fulcrum/tools/doctor_rules.py: data, generation and memory levers
]


# ------------------------------------------------------------------------------------------ summary
def keys_without_effect(cfg: FulcrumConfig) -> list[str]:
    """'key=value' for every key accepted for compatibility that this configuration sets.

    Compared unresolved, so a key that merely follows another (critic.model.tokenizer_path) is not listed.
    """
    defaults = flatten(to_dict(FulcrumConfig()))
    missing = object()
    return [
        f"{key}={value}"
        for key, value in flatten(to_dict(unresolve(copy.deepcopy(cfg)))).items()
        if is_no_effect(key) and key not in UNSUPPORTED and defaults.get(key, missing) != value
    ]


def old_log_prob_summary(cfg: FulcrumConfig) -> str:
    """Where the old log-probs come from: their own pass (its micro-batch), the on-policy update, or the
    rollout under bypass mode."""
    if update_can_give_old_log_probs(cfg):
        return "old log-probs from the update (one epoch, one mini-batch: no old-log-prob pass)"
    if not old_log_prob_pass_runs(cfg):
        return "old log-probs from the rollout (bypass mode: no old-log-prob pass)"
    return f"log-prob micro-batch {cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu}"


def summary(ctx: Context) -> list[str]:
    cfg = ctx.cfg
    arr = cfg.actor_rollout_ref
    n, n_gpus = arr.rollout.n, world_size(cfg)
    train = cfg.data.train_batch_size
    device = f"cuda x{n_gpus} ({ctx.n_visible} visible)" if ctx.device == "cuda" else "cpu"
    lines = [
        f"device      {device}",
        f"step        {train} prompts x n={n} = {train * n} responses, "
        f"prompt <= {arr.rollout.prompt_length} + response <= {arr.rollout.response_length} tokens",
        f"rollout     {arr.rollout.name}, tensor parallel {arr.rollout.tensor_model_parallel_size}, "
        f"temperature {arr.rollout.temperature}, " + old_log_prob_summary(cfg),
    ]
    roles = [("actor", arr.actor)] + ([("critic", cfg.critic)] if uses_critic(cfg) else [])
    for name, role in roles:
        if role.use_dynamic_bsz:
            lines.append(
                f"{name:<11} dynamic micro-batches of <= {role.ppo_max_token_len_per_gpu} tokens per device"
            )
            continue
        role_mini = role.ppo_mini_batch_size
        per_device = role_mini * n // max(n_gpus, 1)
        micro = role.ppo_micro_batch_size_per_gpu
        micro_count = per_device // micro if micro else "?"
        lines.append(
            f"{name:<11} {train // role_mini} mini-batch(es) of {role_mini} prompts ({per_device} responses per device) "
            f"x {role.ppo_epochs} epoch(s) = {train // role_mini * role.ppo_epochs} optimiser steps per step; "
            f"{micro_count} micro-batch(es) of {micro} per mini-batch"
        )
    if not uses_critic(cfg):
        lines.append(f"critic      off ({cfg.algorithm.key('adv_estimator')}={cfg.algorithm.adv_estimator})")
    lines.append(f"reference   {'on' if uses_reference(cfg) else 'off (no KL loss or KL in reward)'}")
    lines.append(f"run dir     {cfg.trainer.default_local_dir}")
    no_effect = keys_without_effect(cfg)
    if no_effect:
        lines.append("accepted for compatibility, no effect:")
        lines += [f"  {item}" for item in no_effect]
    return lines


# --------------------------------------------------------------------------------------------- main
def diagnose(
    cfg: FulcrumConfig, overrides: list[str] | None = None, device_memory_gib: float | None = None
) -> tuple[Context, list[Finding]]:
    """Run every check on a resolved configuration."""
    # As the trainer does: only trainer.device=cpu runs on the CPU; auto and cuda need the CUDA devices asked for.
    device = "cpu" if cfg.trainer.device == "cpu" else "cuda"
    n_visible = cuda_device_count() if device == "cuda" else 0
    ctx = Context(
        cfg=cfg,
        device=device,
        n_visible=n_visible,
        overrides=list(overrides or []),
        device_memory_gib=device_memory_gib,
    )
    findings: list[Finding] = []
    for check in CHECKS:
        findings.extend(check(ctx))
    return ctx, findings


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return 0
    if "--keys" in args:
        print(format_keys())
        return 0
    base = None
    if "--config" in args:
        i = args.index("--config")
        if i + 1 >= len(args):
            print("fulcrum doctor: --config needs a file", file=sys.stderr)
            return 1
        config_path = args[i + 1]
        del args[i : i + 2]
    else:
        config_path = None
    device_memory_gib = None
    if "--device-memory-gib" in args:
        i = args.index("--device-memory-gib")
        try:
            device_memory_gib = float(args[i + 1])
        except (IndexError, ValueError):
            print("fulcrum doctor: --device-memory-gib needs a number of GiB (e.g. 80)", file=sys.stderr)
            return 1
        del args[i : i + 2]
    config_log = logging.getLogger("fulcrum.config")
    level = config_log.level
    config_log.setLevel(logging.ERROR)  # check_rollout_alias reports the backend mapping instead
    try:
        if config_path:
            base = load_yaml(config_path)
        cfg = load_config(args, base=base)
    except ConfigError as exc:
        print(f"fulcrum doctor: error: {exc}")
        return 1
    finally:
        config_log.setLevel(level)
    ctx, findings = diagnose(cfg, args, device_memory_gib)
    errors = [f for f in findings if f.severity == "error"]
    warnings = [f for f in findings if f.severity == "warning"]
    if errors:
        print(f"fulcrum doctor: {len(errors)} problem(s); the run would fail or waste compute:")
        print("\n".join(f"  {line}" for f in errors for line in f.lines()))
    else:
        print("fulcrum doctor: the configuration can run")
        print("\n".join(f"  {line}" for line in summary(ctx)))
    if warnings:
        print("\n".join(f"  {line}" for f in warnings for line in f.lines()))
    print("\n".join(f"  {line}" for line in memory_lines(ctx)))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
