"""Saving and resuming `global_step_N` checkpoints of a run directory: atomic save, verified resume, retention.

A save writes into `global_step_N.tmp-<pid>`, fsyncs every file, writes the manifest last and
renames the folder to `global_step_N`; then `latest_checkpointed_iteration.txt` is replaced. A crash
at any point leaves either the previous checkpoints or the new complete one.

Resume (`trainer.resume_mode`): `auto` takes the newest checkpoint that is intact (every file of the
roles this run trains present with the manifest's size and SHA-256) and names each newer one it
skipped and why; `resume_path` takes the one named and says exactly what is wrong with it if it is
damaged; `disable` starts fresh. Checkpoints newer than the one resumed are set aside as
`global_step_N.set-aside-<time>` (never deleted): the resumed run writes its own steps N.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fulcrum.trainer.checkpoint.adapters import is_adapter_folder, load_adapter_folder, save_adapter_folder
from fulcrum.trainer.checkpoint.atomic import fsync_dir, fsync_tree, write_text_atomic
from fulcrum.trainer.checkpoint.background import BackgroundWriter
from fulcrum.trainer.checkpoint.hf_folder import (
    check_tensors_finite,
    check_weights_finite,
    load_model_weights,
    save_model_folder,
)
from fulcrum.trainer.checkpoint.layout import (
    LATEST_FILE,
    MANIFEST,
    OPTIMIZER_FILE,
    RNG_STATE,
    RUN_CONFIG,
    SCHEDULER_FILE,
    STEP_DIR,
    STEP_PREFIX,
    TRAINER_STATE,
    CheckpointError,
    DiskFullError,
    build_manifest,
    complete_checkpoints,
    read_manifest,
    remove_stale_temp_dirs,
    step_dir_name,
    step_folders,
    verify_checkpoint,
)
from fulcrum.trainer.checkpoint.rng import capture_rng_state, restore_rng_state
from fulcrum.trainer.checkpoint.sharded import load_optimizer_state
from fulcrum.trainer.checkpoint.snapshot import HostBuffers, RoleSnapshot, snapshot_role

RESUME_MODES = ("auto", "disable", "resume_path")


@dataclass
class CheckpointSettings:
    """The `trainer.*` keys this module reads (verl's names and meanings)."""

    resume_mode: str = "auto"
    resume_from_path: str | None = None
    max_actor_ckpt_to_keep: int | None = None
    max_critic_ckpt_to_keep: int | None = None
    save_in_background: bool = True  # the trainer's saves: on the writer thread, or in the step

    @classmethod
    def from_trainer_cfg(cls, trainer_cfg: Any) -> CheckpointSettings:
        if trainer_cfg is None:
            return cls()
        get = trainer_cfg.get if isinstance(trainer_cfg, dict) else lambda k, d: getattr(trainer_cfg, k, d)
        settings = cls(
            resume_mode=str(get("resume_mode", "auto")),
            resume_from_path=get("resume_from_path", None),
            max_actor_ckpt_to_keep=get("max_actor_ckpt_to_keep", None),
            max_critic_ckpt_to_keep=get("max_critic_ckpt_to_keep", None),
            save_in_background=bool(get("save_in_background", True)),
        )
        if settings.resume_mode not in RESUME_MODES:
            raise CheckpointError(
                f"trainer.resume_mode={settings.resume_mode!r} is not one of {', '.join(RESUME_MODES)}"
            )
        if settings.resume_mode == "resume_path" and not settings.resume_from_path:
            raise CheckpointError(
                "trainer.resume_mode=resume_path needs trainer.resume_from_path=<run_dir>/global_step_N"
            )
        return settings

    def keep_for(self, role: str) -> int | None:
        """How many checkpoints of `role` to keep; None = all (verl: null or -1)."""
        keep = {"actor": self.max_actor_ckpt_to_keep, "critic": self.max_critic_ckpt_to_keep}.get(role)
        return keep if keep is not None and keep > 0 else None


def _save_torch(obj: Any, path: Path) -> None:
    torch.save(obj, path)


def _load_torch(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"{path}: file missing from the checkpoint")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only refuses arbitrary objects: say which file
        raise CheckpointError(f"{path}: cannot be loaded safely (weights_only=True): {exc}") from exc


def _json_checked(obj: Any, path: str = "trainer_state") -> Any:
    """`obj` if it is plain JSON (dict/list/str/number/bool/None); otherwise an error naming the key."""
    if isinstance(obj, dict):
        return {str(k): _json_checked(v, f"{path}.{k}") for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_checked(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, bool | int | float | str) or obj is None:
        return obj
    if isinstance(obj, np.generic | torch.Tensor) and getattr(obj, "ndim", 0) == 0:
        return obj.item()
    raise CheckpointError(f"{path} is a {type(obj).__name__}; trainer state must be plain JSON values")


@dataclass
class PendingSave:
    """A checkpoint decided and snapshotted between two steps, not yet on disk."""

    step: int
    final: Path  # global_step_N, the name it is published under
    needed: int  # estimated bytes, for the full-disk message
    state: dict[str, Any]  # trainer_state.json
    run_config: dict[str, Any] | None
    rng_state: dict[str, Any]
    roles: dict[str, RoleSnapshot]


@dataclass
class ResumeChoice:
    """The checkpoint `resume_mode` selected (None: start fresh) and the newer ones skipped, with reasons."""

    path: Path | None
    skipped: list[tuple[Path, list[str]]] = field(default_factory=list)

    def report(self) -> list[str]:
        lines = []
        for path, problems in self.skipped:
            lines.append(f"skipped damaged checkpoint {path.name}: " + "; ".join(problems[:3]))
        if self.skipped and self.path is not None:
            lines.append(f"resuming from {self.path.name}, the newest intact checkpoint")
        return lines


class CheckpointManager:
    """Saves and restores `global_step_N` checkpoints of a run directory (see module docstring)."""

    def __init__(self, run_dir: str | os.PathLike, trainer_cfg: Any = None) -> None:
        self.run_dir = Path(run_dir)
        self.settings = CheckpointSettings.from_trainer_cfg(trainer_cfg)
        self.writer = BackgroundWriter()  # the writes of save(background=True)
        self.host_buffers = HostBuffers()  # their snapshots' host memory, reused by every save
        self.waited_s = 0.0  # how long the last wait() blocked on the previous write
        # Called before a save or its plan reads the roles' state (one process): a trainer that parks
        # optimiser state off the device (fulcrum.workers.state_parking) brings it back here.
        self.before_reading_state: Callable[[], None] = lambda: None

    def prepare_host_buffers(self, roles: dict[str, Any]) -> None:
        """Map the host memory the first background save of `roles` copies into, on a thread beside the
        next steps (`HostBuffers.prepare`). Call between two steps, after the optimisers' first step."""
        if self.settings.save_in_background and not self.host_buffers.prepared:
            self.before_reading_state()  # the plan walks the state as a save will
            self.host_buffers.prepare(roles)

    # ------------------------------------------------------------------ save
    def save(
        self,
        step: int,
        roles: dict[str, Any],
        trainer_state: dict[str, Any],
        run_config: dict[str, Any] | None = None,
        background: bool = False,
    ) -> Path:
        """Write `global_step_<step>` atomically; returns its path. A background write still running is
        waited for first, and its error raised here. Now (`background=False`): from the live tensors,
        raising DiskFullError on a full disk. In the background: from a host snapshot taken here, on
        the writer thread; its error is raised by the next `save` or `wait`."""
        self.wait()
        self.host_buffers.wait_prepared()
        self.before_reading_state()
        pending = self._prepare(step, roles, trainer_state, run_config, copy=background)
        if not background:
            return self._write(pending)
        self.writer.submit(pending.final.name, lambda: self._write(pending))
        return pending.final

    def wait(self) -> None:
        """Block until the background write (if any) is on disk; raise its error if it failed."""
        started = time.perf_counter()
        try:
            self.writer.wait()
        finally:
            self.waited_s = time.perf_counter() - started

    def step_metrics(self, saved: bool) -> dict[str, float]:
        """`perf/checkpoint_wait_s` on a step that saved (of its stall, the wait for the previous write)
        and `perf/checkpoint_write_s` on the first step after a background write ended (its seconds)."""
        out = {"perf/checkpoint_wait_s": self.waited_s} if saved else {}
        written = self.writer.seconds_of_finished()
        if written is not None:
            out["perf/checkpoint_write_s"] = written
        return out

    def _prepare(
        self,
        step: int,
        roles: dict[str, Any],
        trainer_state: dict[str, Any],
        run_config: dict[str, Any] | None,
        copy: bool,
    ) -> PendingSave:
        """Everything a save decides and reads between two steps: the checks that refuse it (step,
        trainer state, finite weights, free space) and the snapshot it writes (`snapshot.snapshot_role`)."""
        if step < 0:
            raise CheckpointError(f"checkpoint step must be >= 0, got {step}")
        state = _json_checked({**trainer_state, "global_step": step})
        for name, role in roles.items():
            where = f"checkpoint {step_dir_name(step)}/{name}"
            check_weights_finite(role.model, where)
            # A gathered LoRA role (sharded.GatheredRole) holds its trained tensors beside the model.
            for gathered in (getattr(role, "adapter_state", None), getattr(role, "trained_weights", None)):
                check_tensors_finite((gathered or {}).items(), where)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        final = self.run_dir / step_dir_name(step)
        try:
            snaps = {name: snapshot_role(role, copy, self.host_buffers, name) for name, role in roles.items()}
        finally:
            self.host_buffers.finish()
        # About what the save writes: weights (or adapters) and optimiser state; tokenizer and JSON are small.
        needed = sum(snap.host_bytes() for snap in snaps.values())
        free = shutil.disk_usage(self.run_dir).free
        if needed > free:
            raise self._disk_full(final, needed, free)
        return PendingSave(step, final, needed, state, run_config, capture_rng_state(), snaps)

    def _write(self, pending: PendingSave) -> Path:
        """`pending` into `global_step_N.tmp-<pid>`, fsync'ed, renamed into place; then the latest-step
        file and retention. On any failure the temporary folder is removed and nothing is published."""
        final = pending.final
        tmp = self.run_dir / f"{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir()
            self._write_contents(tmp, pending)
            self.writer.check_cancelled()
            fsync_tree(tmp)
            self.writer.check_cancelled()
            self._publish(tmp, final)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                free = shutil.disk_usage(self.run_dir).free
                raise self._disk_full(final, pending.needed, free) from exc
            raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        write_text_atomic(self.run_dir / LATEST_FILE, f"{pending.step}\n")
        self._apply_retention(list(pending.roles))
        return final

    def _write_contents(self, tmp: Path, pending: PendingSave) -> None:
        (tmp / TRAINER_STATE).write_text(json.dumps(pending.state, indent=2, allow_nan=True))
        if pending.run_config is not None:
            (tmp / RUN_CONFIG).write_text(json.dumps(pending.run_config, indent=2, default=str))
        _save_torch(pending.rng_state, tmp / RNG_STATE)
        for name, snap in pending.roles.items():
            self.writer.check_cancelled()
            self._write_role(tmp / name, snap)
        self.writer.check_cancelled()
        manifest = build_manifest(tmp, pending.step, list(pending.roles))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))

    @staticmethod
    def _write_role(role_dir: Path, snap: RoleSnapshot) -> None:
        """One role's Hugging Face folder (or LoRA adapter folder) plus its optimiser and scheduler state."""
        role_dir.mkdir()
        if snap.adapters is not None:
            save_adapter_folder(role_dir, snap.adapters, snap.adapter_state, snap.trained_weights or {})
        else:
            save_model_folder(snap.model, None, role_dir)
        for rel, data in snap.tokenizer_files.items():
            (role_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            (role_dir / rel).write_bytes(data)
        if snap.optimizer_state is not None:
            _save_torch(snap.optimizer_state, role_dir / OPTIMIZER_FILE)
        if snap.scheduler_state is not None:
            _save_torch(snap.scheduler_state, role_dir / SCHEDULER_FILE)

    def _publish(self, tmp: Path, final: Path) -> None:
        """Rename the whole temp folder into place. A same-step folder already there (a run started
        over this one's steps) is set aside as `global_step_N.set-aside-<time>`, never deleted: a
        checkpoint is only ever removed by retention."""
        if final.exists():
            aside = set_aside_name(final)
            os.rename(final, aside)
            print(f"warning: {final} already existed: set aside as {aside.name}", flush=True)
        os.rename(tmp, final)
        fsync_dir(self.run_dir)

    def _disk_full(self, final: Path, needed: int, free: int) -> DiskFullError:
        previous = complete_checkpoints(self.run_dir)
        kept = (
            f"the previous checkpoint {previous[-1][1]} is intact"
            if previous
            else "no earlier checkpoint exists"
        )
        return DiskFullError(
            f"disk full while saving checkpoint {final}: needs about {needed / 2**20:.1f} MiB, "
            f"{free / 2**20:.1f} MiB free in {self.run_dir}. The partial folder was removed; {kept}. Free space, "
            "lower trainer.max_actor_ckpt_to_keep / max_critic_ckpt_to_keep, or point trainer.default_local_dir "
            "at a larger disk."
        )

    def _apply_retention(self, roles: list[str]) -> None:
        """Keep the newest `max_<role>_ckpt_to_keep` of each role; drop step folders left with no role."""
        for role in roles:
            keep = self.settings.keep_for(role)
            if keep is None:
                continue
            with_role = [path for _, path in complete_checkpoints(self.run_dir, [role])]
            for path in with_role[:-keep]:
                shutil.rmtree(path / role, ignore_errors=True)
        for _, path in complete_checkpoints(self.run_dir):
            manifest_roles = json.loads((path / MANIFEST).read_text()).get("roles", [])
            if manifest_roles and not any((path / r).is_dir() for r in manifest_roles):
                shutil.rmtree(path, ignore_errors=True)

    # ---------------------------------------------------------------- resume
    def choose_resume(self, role_names: list[str]) -> ResumeChoice:
        """The checkpoint `resume_mode` selects (verified), or none to start fresh. Errors name what is wrong."""
        mode = self.settings.resume_mode
        if mode == "disable":
            return ResumeChoice(None)
        remove_stale_temp_dirs(self.run_dir)
        if mode == "auto":
            return self._choose_auto(role_names)
        return ResumeChoice(self._checked_resume_path(role_names))

    def _choose_auto(self, role_names: list[str]) -> ResumeChoice:
        """The newest intact checkpoint with every role; newer damaged ones are skipped and named."""
        skipped: list[tuple[Path, list[str]]] = []
        without_roles: list[Path] = []
        for _, path in reversed(step_folders(self.run_dir)):
            lacks_role = not all((path / r).is_dir() for r in role_names)
            if (path / MANIFEST).is_file() and lacks_role:
                # A complete checkpoint that lacks a role (retention, or an actor-only run): not damaged.
                without_roles.append(path)
                continue
            problems = verify_checkpoint(path, role_names)
            if not problems:
                return ResumeChoice(path, skipped)
            skipped.append((path, problems))
        if without_roles and not skipped:
            newest = without_roles[0]
            missing = [r for r in role_names if not (newest / r).is_dir()]
            raise CheckpointError(
                f"{self.run_dir} holds checkpoints (newest {newest.name}) but none with "
                f"{', '.join(missing)}, which this run trains. Use another trainer.default_local_dir, or "
                "trainer.overwrite_run=True to move the old run aside and start fresh."
            )
        if skipped:
            details = "\n".join(f"  {p.name}: " + "; ".join(problems[:3]) for p, problems in skipped)
            raise CheckpointError(
                f"{self.run_dir} holds checkpoints but none is intact:\n{details}\n"
                "Name one with trainer.resume_mode=resume_path trainer.resume_from_path=..., use another "
                "trainer.default_local_dir, or trainer.overwrite_run=True to move the old run aside."
            )
        return ResumeChoice(None)

    def _checked_resume_path(self, role_names: list[str]) -> Path:
        path = Path(str(self.settings.resume_from_path)).expanduser()
        key = f"trainer.resume_from_path={path}"
        if not path.exists():
            raise CheckpointError(f"{key}: no such folder")
        if not (STEP_DIR.match(path.name) or (path / MANIFEST).exists()):
            found = complete_checkpoints(path, role_names)
            if not found:
                raise CheckpointError(f"{key}: no complete {STEP_PREFIX}N checkpoint inside")
            path = found[-1][1]
        if not (path / MANIFEST).is_file():
            raise CheckpointError(
                f"{key}: incomplete checkpoint (no {MANIFEST}: its save was interrupted, or the file was removed)"
            )
        problems = verify_checkpoint(path, role_names)
        if problems:
            raise CheckpointError(f"{key}: the checkpoint is damaged:\n  " + "\n  ".join(problems))
        return path

    def set_aside_newer(self, step: int) -> list[Path]:
        """Rename this run directory's `global_step_N` with N > `step` to `global_step_N.set-aside-<time>`.

        They belong to an abandoned continuation (or are damaged); the resumed run writes its own step
        N, and nothing is deleted.
        """
        moved = []
        for n, path in step_folders(self.run_dir):
            if n > step:
                target = set_aside_name(path)
                os.rename(path, target)
                moved.append(target)
        if moved:
            fsync_dir(self.run_dir)
            # verl's file must not name a checkpoint that is no longer there.
            write_text_atomic(self.run_dir / LATEST_FILE, f"{step}\n")
        return moved

    def resume(self, roles: dict[str, Any]) -> dict[str, Any] | None:
        """Restore weights, optimiser, scheduler and RNG into `roles`; return the trainer state (or None)."""
        choice = self.choose_resume(list(roles))
        for line in choice.report():
            print(f"warning: {line}", flush=True)
        if choice.path is None:
            return None
        return self.load(choice.path, roles, verify=False)

    def load(self, ckpt: Path, roles: dict[str, Any], verify: bool = True) -> dict[str, Any]:
        """Restore everything from checkpoint folder `ckpt` into `roles`; return its trainer state."""
        read_manifest(ckpt)
        if verify:
            problems = verify_checkpoint(ckpt, list(roles))
            if problems:
                raise CheckpointError(f"{ckpt}: the checkpoint is damaged:\n  " + "\n  ".join(problems))
        for name, role in roles.items():
            role_dir = ckpt / name
            if getattr(role, "adapters", None) is not None:
                load_adapter_folder(role_dir, role)
            elif is_adapter_folder(role_dir):
                raise CheckpointError(
                    f"{role_dir}: holds LoRA adapters, and this run trains whole weights; resume it with "
                    "the lora_rank it was trained with, or start a new run directory"
                )
            else:
                load_model_weights(role.model, role_dir)
            if getattr(role, "optimizer", None) is not None:  # numbered or named: any world size
                path = role_dir / OPTIMIZER_FILE
                load_optimizer_state(role.model, role.optimizer, _load_torch(path), path)
            self._load_into(getattr(role, "lr_scheduler", None), role_dir / SCHEDULER_FILE)
        restore_rng_state(_load_torch(ckpt / RNG_STATE))
        state = json.loads((ckpt / TRAINER_STATE).read_text())
        state["checkpoint_path"] = str(ckpt)
        return state

    @staticmethod
    def _load_into(stateful: Any, path: Path) -> None:
        if stateful is None:
            return
        try:
            stateful.load_state_dict(_load_torch(path))
        except (ValueError, KeyError, RuntimeError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{path}: does not match this {type(stateful).__name__}: {exc}") from exc


def set_aside_name(path: Path) -> Path:
    """`global_step_N.set-aside-<time>` beside `path`, with `.K` added when that name is taken (two set
    asides within a second)."""
    target = path.with_name(f"{path.name}.set-aside-{time.strftime('%Y%m%d-%H%M%S')}")
    base, suffix = target, 0
    while target.exists():
        suffix += 1
        target = base.with_name(f"{base.name}.{suffix}")
    return target


def read_run_config(ckpt: Path) -> dict[str, Any] | None:
    """The configuration a checkpoint was trained under (None for checkpoints written before it was kept)."""
    path = ckpt / RUN_CONFIG
    return json.loads(path.read_text()) if path.is_file() else None
