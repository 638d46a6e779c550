"""`fulcrum train KEY=VALUE ...` ≡ `python -m fulcrum.trainer.main_ppo KEY=VALUE ...` (verl's entry point).

With `trainer.n_gpus_per_node > 1` on CUDA it starts one process per GPU through torchrun
(fulcrum.trainer.launch); under `torchrun` each process trains its share of every batch.

With no data and no model given (no `data.train_files` and no `actor_rollout_ref.model.path`), it runs
the built-in demo (`fulcrum.trainer.demo.run_demo`) with the given overrides applied on top.

An error before the first step (configuration, devices, run directory, data, model, tokenizer,
reward function) prints one paragraph naming the key and file, without a traceback; set
FULCRUM_DEBUG=1 to see the traceback. A second `fulcrum train` on a run directory in use stops at
once, naming the process that holds it (docs/checkpoints.md). Ctrl-C ends it with one line, exit 130.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

# OpenMP threads that spin while waiting burn the CPU that other threads (and other processes) need: on a
# busy host a multi-threaded update slows several-fold under the default (spinning) policy. Only acts if
# torch is not imported yet; a user's own OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from fulcrum.config import ConfigError, load_config
from fulcrum.config.device import select_device

DEMO_TRIGGER_KEYS = ("data.train_files", "actor_rollout_ref.model.path")


def wants_demo(argv: list[str]) -> bool:
    keys = {a.split("=", 1)[0].lstrip("+") for a in argv}
    return not any(k in keys for k in DEMO_TRIGGER_KEYS)


def main(argv: list[str] | None = None) -> int:
    """The demo, or one process per GPU through torchrun, or `train(cfg)` in this process."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        print(
            "\nKeys are verl's (docs/configuration.md), e.g. data.train_files=... actor_rollout_ref.model.path=...;"
        )
        print("`fulcrum doctor KEY=VALUE ...` checks a configuration without running it.")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        from fulcrum.trainer.launch import cpu_note, processes_to_launch, relaunch

        try:  # an unknown key or bad value is reported before anything runs, demo included
            cfg = load_config(argv)
            nproc = 0 if wants_demo(argv) else processes_to_launch(cfg)
            if nproc:  # too few GPUs: say so here, once, rather than from every process started
                select_device(cfg.trainer.device, cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes)
        except ConfigError as err:
            print(f"fulcrum train: {err}", file=sys.stderr)
            return 1
        if wants_demo(argv):
            return _demo(argv)
        if nproc:
            return relaunch(nproc, argv, Path(cfg.trainer.default_local_dir).expanduser())
        if note := cpu_note(cfg):
            print(note)
        from fulcrum.trainer.run import train

        return train(cfg)
    except KeyboardInterrupt:  # before the run started (imports, configuration); the run says more
        print("fulcrum train: interrupted (Ctrl-C) before training started", file=sys.stderr)
        return 130


def _demo(argv: list[str]) -> int:
    try:
        from fulcrum.trainer.demo import run_demo
    except ImportError as err:
        print(
            f"fulcrum train: the built-in demo is not available ({err}); pass data.train_files=... "
            "and actor_rollout_ref.model.path=... to train",
            file=sys.stderr,
        )
        return 1
    return run_demo(argv)


if __name__ == "__main__":
    sys.exit(main())
