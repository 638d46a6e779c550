"""Checkpoints: atomic save, verified and exact resume, retention (docs/checkpoints.md).

Layout of one checkpoint (every file loads without unpickling arbitrary objects)::

    <run_dir>/latest_checkpointed_iteration.txt       "N", replaced atomically after each save
    <run_dir>/global_step_N/
        checkpoint.json          manifest, written last: step, roles, every file's size and SHA-256
        trainer_state.json       global_step, epoch, data-loader state, KL-controller state, ...
        run_config.json          the resolved configuration the run trained under
        rng_state.pt             python / numpy / torch CPU / torch CUDA generators (tensors and ints)
        actor/                   a Hugging Face folder (config.json, model.safetensors, tokenizer files)
            optimizer.pt         optimizer.state_dict()    (tensors, numbers, lists: weights_only=True)
            lr_scheduler.pt      lr_scheduler.state_dict()
        critic/                  the same for the critic

Modules: `atomic` (fsync, atomic replace, streamed hashes), `layout` (names, manifest, verification),
`rng` (generator state), `hf_folder` (models as Hugging Face folders), `snapshot` (a role's state as
host copies, taken between steps), `background` (the writer thread beside training), `manager` (save,
resume, retention).
"""

from fulcrum.trainer.checkpoint.layout import (
    LATEST_FILE,
    MANIFEST,
    OPTIMIZER_FILE,
    RUN_CONFIG,
    SCHEDULER_FILE,
    STEP_PREFIX,
    CheckpointError,
    DiskFullError,
    complete_checkpoints,
    is_complete,
    read_latest_step,
    step_folders,
    verify_checkpoint,
)
from fulcrum.trainer.checkpoint.manager import CheckpointManager, ResumeChoice, read_run_config

__all__ = [
    "LATEST_FILE",
    "MANIFEST",
    "OPTIMIZER_FILE",
    "RUN_CONFIG",
    "SCHEDULER_FILE",
    "STEP_PREFIX",
    "CheckpointError",
    "CheckpointManager",
    "DiskFullError",
    "ResumeChoice",
    "complete_checkpoints",
    "is_complete",
    "read_latest_step",
    "read_run_config",
    "step_folders",
    "verify_checkpoint",
]
