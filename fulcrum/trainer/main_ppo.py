"""`fulcrum train KEY=VALUE ...` ≡ `python -m fulcrum.trainer.main_ppo KEY=VALUE ...` (verl's entry point).

With no data and no model given (no `data.train_files` and no `actor_rollout_ref.model.path`), it runs
the built-in demo (`fulcrum.trainer.demo.run_demo`) with the given overrides applied on top.

An error before the first step (configuration, devices, run directory, data, model, tokenizer,
reward function) prints one paragraph naming the key and file, without a traceback; set
FULCRUM_DEBUG=1 to see the traceback.
"""

from __future__ import annotations

import logging
import os
import sys

# OpenMP threads that spin while waiting burn the CPU that other threads (and other processes) need:
# on a busy 2-core machine a 2-thread actor update used 8x the CPU time and ran 7x slower with the
# default (spinning) policy than with passive waiting. Only acts if torch is not imported yet; a
# user's own OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from fulcrum.config import ConfigError, load_config
from fulcrum.config.validate import advise, check, uses_critic
from fulcrum.models.folder import ModelPathError, model_folder_problems, resolve_model_path, vocab_problems

DEMO_TRIGGER_KEYS = ("data.train_files", "actor_rollout_ref.model.path")
ACTOR_KEY = "actor_rollout_ref.model.path"
DEBUG_ENV = "FULCRUM_DEBUG"  # =1: set-up errors come with their traceback


class DeviceError(RuntimeError):
    """Fewer devices than the configuration asks for."""


def wants_demo(argv: list[str]) -> bool:
    keys = {a.split("=", 1)[0].lstrip("+") for a in argv}
    return not any(k in keys for k in DEMO_TRIGGER_KEYS)


def select_device(trainer_cfg: object) -> tuple[torch.device, int]:
    """The training device and how many devices the run uses (throughput is per device).

    `trainer.device=cpu` always runs (on the CPU). Otherwise the run needs n_gpus_per_node × nnodes
    CUDA devices; with fewer it stops with a message saying what to change. This version trains on
    one device: asking for more (and having them) trains on cuda:0 and says so.
    """
    want = str(getattr(trainer_cfg, "device", "auto"))
    if want == "cpu":
        return torch.device("cpu"), 1
    asked = int(trainer_cfg.n_gpus_per_node) * int(trainer_cfg.nnodes)
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if asked > available == 0:  # advising n_gpus_per_node=1 would not help: there is no device at all
        raise DeviceError(
            f"trainer.device={want} with trainer.n_gpus_per_node={trainer_cfg.n_gpus_per_node} × trainer.nnodes="
            f"{trainer_cfg.nnodes} asks for {asked} CUDA device(s) but this machine has 0 (no GPU, or "
            "CUDA_VISIBLE_DEVICES hides them). Set trainer.device=cpu to run on the CPU (slowly)."
        )
    if asked > available:
        raise DeviceError(
            f"trainer.n_gpus_per_node={trainer_cfg.n_gpus_per_node} × trainer.nnodes={trainer_cfg.nnodes} asks for "
            f"{asked} CUDA device(s) but this machine has {available}. Set trainer.n_gpus_per_node={max(available, 1)} "
            "to match, or trainer.device=cpu to run on the CPU (slowly)."
        )
    if asked > 1:
        print(
            f"note: {asked} devices asked; this version trains on one device (cuda:0). Multi-GPU is a later issue."
        )
    return torch.device("cuda", 0), 1


def check_model_paths(cfg: object) -> None:
    """Resolve and check the model folders before the heavy imports, so a typo fails in seconds."""
    models = {ACTOR_KEY: (cfg.actor_rollout_ref.model.path, True)}
    if uses_critic(cfg):
        models["critic.model.path"] = (cfg.critic.model.path, False)
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
        problems = vocab_problems(tokens, ACTOR_KEY, {key: str(name) for key, (name, _) in models.items()})
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        print("\nKeys are verl's (DESIGN §4), e.g. data.train_files=... actor_rollout_ref.model.path=...;")
        print("`fulcrum doctor KEY=VALUE ...` checks a configuration without running it.")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        load_config(argv)  # an unknown key or bad value is reported before anything runs, demo included
    except ConfigError as err:
        print(f"fulcrum train: {err}", file=sys.stderr)
        return 1
    if wants_demo(argv):
        try:
            from fulcrum.trainer.demo import run_demo
        except ImportError as err:
            print(
                f"fulcrum train: the built-in demo is not available ({err}); pass data.train_files=... "
                "and actor_rollout_ref.model.path=... to train",
                file=sys.stderr,
            )
            return 1
        return int(run_demo(argv) or 0)
    try:
        cfg = load_config(argv)
        device, n_devices = select_device(cfg.trainer)
        # The cross-key rules of `fulcrum doctor` (sizes that do not divide, missing micro-batch sizes...)
        # stop the run before any model is loaded; the device count was checked just above.
        check(cfg, n_devices=None)
        check_model_paths(cfg)
    except (ConfigError, DeviceError, ModelPathError) as err:
        print(f"fulcrum train: {err}", file=sys.stderr)
        if debug_requested():
            raise
        return 1
    for note in advise(cfg):
        print(f"note: {note}")
    from fulcrum.reward.manager import RewardError
    from fulcrum.trainer.checkpoint import CheckpointError
    from fulcrum.trainer.faults import NonFiniteTrainingError, OutOfMemoryHelp
    from fulcrum.trainer.ppo_trainer import PPOTrainer

    try:
        trainer = PPOTrainer(cfg, device, n_devices)
    except Exception as err:
        print(setup_error_message(err), file=sys.stderr)
        if debug_requested():
            raise
        return 1
    try:
        trainer.fit()
    except (CheckpointError, NonFiniteTrainingError, OutOfMemoryHelp, RewardError) as err:
        print(f"fulcrum train: {err}", file=sys.stderr)
        return 1
    return trainer.exit_code


if __name__ == "__main__":
    sys.exit(main())
