"""How `fulcrum train` becomes many processes: torchrun starts them, or `fulcrum train` starts torchrun.

- Started by torchrun (`torchrun --nproc_per_node=N [--nnodes=M ...] -m fulcrum.trainer.main_ppo ...`):
  `trainer.n_gpus_per_node × trainer.nnodes` must be torchrun's world size (else an error naming both).
- Not started by torchrun, on CUDA, with `n_gpus_per_node > 1` on one machine: `fulcrum train`
  re-launches itself through `torch.distributed.run` (in this process, as `torchrun --standalone`
  would), one process per GPU. Several machines need torchrun on each (`--nnodes`, `--rdzv_endpoint`).
- `trainer.device=cpu` without torchrun stays one process, whatever `n_gpus_per_node` says (there are
  no GPUs to count; the key still sets the per-device batch checks, as in verl); torchrun with
  `--nproc_per_node=N` runs N CPU processes over gloo.

The run directory's lock (fulcrum.trainer.run_lock) is held by the launching group: rank 0 under a
user's torchrun; the launcher itself when `fulcrum train` starts the processes, which then tells its
children (FULCRUM_RUN_LOCK_OWNER) that their group holds it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from fulcrum.config import ConfigError, FulcrumConfig
from fulcrum.parallel import launched_by_torchrun
from fulcrum.trainer import run_lock

TRAIN_MODULE = "fulcrum.trainer.main_ppo"


def processes_to_launch(cfg: FulcrumConfig) -> int:
    """How many processes `fulcrum train` should start through torchrun; 0: run here, in this process."""
    trainer = cfg.trainer
    if launched_by_torchrun() or trainer.device == "cpu":
        return 0
    if trainer.nnodes > 1:
        raise ConfigError(
            f"trainer.nnodes={trainer.nnodes}: start fulcrum on each machine with torchrun, e.g. "
            f"`torchrun --nnodes={trainer.nnodes} --nproc_per_node={trainer.n_gpus_per_node} "
            f"--rdzv_backend=c10d --rdzv_endpoint=HOST:PORT -m {TRAIN_MODULE} ...` (HOST: the first machine)",
            "trainer.nnodes",
        )
    return trainer.n_gpus_per_node if trainer.n_gpus_per_node > 1 else 0


def cpu_note(cfg: FulcrumConfig) -> str | None:
    """The line a one-process CPU run prints when the configuration names several devices."""
    trainer = cfg.trainer
    asked = trainer.n_gpus_per_node * trainer.nnodes
    if launched_by_torchrun() or trainer.device != "cpu" or asked == 1:
        return None
    return (
        f"note: trainer.device=cpu runs one process (trainer.n_gpus_per_node={trainer.n_gpus_per_node} only "
        f"sets the per-device batch checks); `torchrun --nproc_per_node={trainer.n_gpus_per_node} -m "
        f"{TRAIN_MODULE} ...` runs {trainer.n_gpus_per_node} CPU processes (gloo)"
    )


def relaunch(nproc: int, argv: list[str], run_dir: Path) -> int:
    """Run `torchrun --standalone --nproc_per_node=nproc -m fulcrum.trainer.main_ppo ARGV` in this process,
    holding `run_dir`'s lock for its processes; 0 when every process succeeded, else 1 (the failing
    process printed its error)."""
    try:
        run_lock.acquire(run_dir, "fulcrum train")
    except (run_lock.RunDirBusyError, OSError) as err:
        print(f"fulcrum train: {err}", file=sys.stderr)
        return 1
    os.environ[run_lock.OWNER_ENV] = run_lock.owner_tag()
    try:
        return _run_torchrun(nproc, argv)
    finally:
        os.environ.pop(run_lock.OWNER_ENV, None)
        run_lock.release(run_dir)


def _run_torchrun(nproc: int, argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    print(
        f"starting {nproc} processes, one per GPU (torchrun --standalone --nproc_per_node={nproc})",
        flush=True,
    )
    args = parse_args(["--standalone", f"--nproc_per_node={nproc}", "-m", TRAIN_MODULE, *argv])
    try:
        run(args)
    except ChildFailedError as err:
        codes = sorted({failure.exitcode for failure in err.failures.values()})
        print(
            f"fulcrum train: {len(err.failures)} of {nproc} processes failed (exit codes {codes})",
            file=sys.stderr,
        )
        return 1
    return 0
