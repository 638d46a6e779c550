"""Train with a configuration object: `train(cfg)`, the one entry that `fulcrum train` (main_ppo), each
process torchrun starts, and the built-in demo call.

It checks the resolved configuration (device count, the cross-key rules of `fulcrum
doctor`, the model folders) before the trainer is even imported, takes the run directory's lock
(fulcrum.trainer.run_lock: rank 0 alone under torchrun), prints the advice notes, trains, and turns
the failures a user can act on into one paragraph and exit code 1. An error before the first step
prints no traceback; set FULCRUM_DEBUG=1 to see it. Ctrl-C that stops the run at once (during
set-up, or a second one during training) ends it with one line and exit 130.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from fulcrum.config import ConfigError, FulcrumConfig, advise
from fulcrum.config.device import cap_host_threads, select_device
from fulcrum.models.folder import (
    ModelPathError,
    model_folder_problems,
    models_reading_actor_ids,
    models_to_check,
    resolve_model_path,
    vocab_problems,
)
from fulcrum.parallel import DistInfo, check_world_size, init_distributed
from fulcrum.parallel.group import info_from_env, run_then_leave
from fulcrum.parallel.shard import on_main
from fulcrum.trainer import run_lock
from fulcrum.trainer.checkpoint import read_latest_step
from fulcrum.trainer.checks import check
from fulcrum.trainer.run_dir import RunDirError

if TYPE_CHECKING:
    import torch

    from fulcrum.trainer.ppo_trainer import PPOTrainer

ACTOR_KEY = "actor_rollout_ref.model.path"
DEBUG_ENV = "FULCRUM_DEBUG"  # =1: set-up errors come with their traceback


def check_model_paths(cfg: FulcrumConfig) -> None:
    """Resolve and check the model folders (`models_to_check`, as doctor does) before the heavy imports,
    so a typo fails in seconds."""
    models = models_to_check(cfg)
    problems = []
    for key, (name, needs_tokenizer) in models.items():
        try:
            resolved = resolve_model_path(str(name), key)
        except ModelPathError as err:
            problems.append(str(err))
            continue
        problems += model_folder_problems(resolved, key, needs_tokenizer=needs_tokenizer)
    if not problems:
        # Every model fed the actor's token ids needs an embedding row for each, else an index error
        # deep in a forward after minutes of set-up. Reads the tokenizer and config.json files only.
        from transformers import AutoTokenizer

        tokens = len(AutoTokenizer.from_pretrained(resolve_model_path(str(models[ACTOR_KEY][0]), ACTOR_KEY)))
        problems = vocab_problems(tokens, ACTOR_KEY, models_reading_actor_ids(cfg))
    if problems:
        raise ModelPathError("\n".join(problems))


def debug_requested() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def setup_error_message(err: BaseException) -> str:
    """One paragraph for an error raised while the trainer is built: our errors already name the key and
    file; anything else also gets its type, since its message may not say what kind of failure it was."""
    text = " ".join(str(err).split()) if "\n" not in str(err).strip() else str(err).strip()
    if type(err).__module__.startswith("fulcrum.") or isinstance(err, FileNotFoundError | ImportError):
        body = text
    else:
        body = f"{type(err).__name__}: {text}"
    return f"fulcrum train: set-up failed: {body}\n(set {DEBUG_ENV}=1 to see the traceback)"


def quiet_other_ranks(info: DistInfo) -> None:
    """Ranks other than 0 print nothing to stdout and log only warnings: one console, rank 0's.
    Their errors (stderr) still show, so a failing rank says why."""
    if info.is_main:
        return
    sys.stdout = open(os.devnull, "w")
    logging.getLogger().setLevel(logging.WARNING)


def interrupted_line(run_dir: Path) -> str:
    """The one line for a run stopped at once by Ctrl-C: what is on disk to resume from. A checkpoint
        being written when it came was removed by the save (CheckpointManager.save), or by the background
    writer the trainer cancelled (PPOTrainer.end_checkpoint_write), never published."""
    step = read_latest_step(run_dir)
    kept = (
        f"the last complete checkpoint is {run_dir / f'global_step_{step}'}"
        if step
        else "no checkpoint saved"
    )
    return f"fulcrum train: stopped at once by Ctrl-C; no partial checkpoint is left; {kept}"


def train(cfg: FulcrumConfig) -> int:
    """Train as `cfg` (resolved: `load_config`) says: checks -> run lock -> trainer -> fit. 0 when done, 1
    with a message on stderr, or 128 + the signal number when Ctrl-C / SIGTERM stopped the run. Under
    torchrun every process calls this; they join one process group and train one run (fulcrum.parallel),
    and leave it within a bound (`run_then_leave`): a finished run never hangs at exit."""
    return run_then_leave(functools.partial(_train, cfg))


def _train(cfg: FulcrumConfig) -> int:
    trainer_cfg, env = cfg.trainer, info_from_env()
    try:  # 1. checks, before any model loads: devices, the cross-key rules of `fulcrum doctor`, model folders
        if env.distributed:
            check_world_size(trainer_cfg.n_gpus_per_node, trainer_cfg.nnodes, env.world_size)
        device = select_device(
            trainer_cfg.device, trainer_cfg.n_gpus_per_node, trainer_cfg.nnodes, local_rank=env.local_rank
        )
        check(cfg, n_devices=None)  # the device count was checked just above
        check_model_paths(cfg)
    except (ConfigError, ModelPathError) as err:
        print(f"fulcrum train: {err}", file=sys.stderr)
        if debug_requested():
            raise
        return 1
    cap_host_threads(device)
    info = init_distributed(device.type)
    quiet_other_ranks(info)
    run_dir = Path(trainer_cfg.default_local_dir).expanduser()
    try:  # 2. the run lock: one process per run directory, rank 0 holding it for the group
        on_main(lambda: run_lock.acquire(run_dir, "fulcrum train"))
    except (run_lock.RunDirBusyError, OSError) as err:
        if info.is_main:  # every rank gets rank 0's error; one of them says it
            print(f"fulcrum train: {err}", file=sys.stderr)
        return 1
    try:
        for note in advise(cfg):
            print(f"note: {note}")
        from fulcrum.reward.scoring import RewardError  # the heavy imports once the checks passed
        from fulcrum.trainer.checkpoint import CheckpointError
        from fulcrum.trainer.faults import NonFiniteTrainingError, OutOfMemoryHelp
        from fulcrum.trainer.loggers import MetricsWriteError

        stops = (CheckpointError, NonFiniteTrainingError, OutOfMemoryHelp, RewardError, MetricsWriteError)
        trainer = _trainer(cfg, device, info)  # 3. the trainer
        if trainer is None:
            return 1
        try:  # 4. fit
            trainer.fit()
        except stops as err:  # failures the user acts on from one paragraph
            print(f"fulcrum train: {err}", file=sys.stderr)
            return 1
        finally:
            trainer.close()  # before the process group goes (run_then_leave): see PPOTrainer.close
        return trainer.exit_code
    except KeyboardInterrupt:
        print(interrupted_line(run_dir), file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        run_lock.release(run_dir)


def _trainer(cfg: FulcrumConfig, device: torch.device, info: DistInfo) -> PPOTrainer | None:
    """The trainer, or None after printing why it could not be built (one paragraph)."""
    from fulcrum.trainer.ppo_trainer import PPOTrainer

    try:
        return PPOTrainer(cfg, device, n_devices=info.world_size, dist=info)
    except (RunDirError, run_lock.RunDirBusyError) as err:  # our one paragraph, whole already
        print(f"fulcrum train: {err}", file=sys.stderr)
    except Exception as err:
        print(setup_error_message(err), file=sys.stderr)
        if debug_requested():
            raise
    return None
