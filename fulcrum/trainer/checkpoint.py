"""Checkpoints: atomic save, exact resume, retention (DESIGN §8).

Layout of one checkpoint (every file loads without unpickling arbitrary objects)::

    <run_dir>/latest_checkpointed_iteration.txt       "N", replaced atomically after each save
    <run_dir>/global_step_N/
        checkpoint.json          manifest, written last: step, roles, every file's size
        trainer_state.json       global_step, epoch, data-loader state, KL-controller state, ...
        rng_state.pt             python / numpy / torch CPU / torch CUDA generators (tensors and ints)
        actor/                   a Hugging Face folder (config.json, model.safetensors, tokenizer files)
            optimizer.pt         optimizer.state_dict()    (tensors, numbers, lists: weights_only=True)
            lr_scheduler.pt      lr_scheduler.state_dict()
        critic/                  the same for the critic

A checkpoint is written into `global_step_N.tmp-<pid>`, every file fsync'ed, and renamed to
`global_step_N` only when whole, so a crash at any point leaves either the previous checkpoints or
the new complete one. Resume looks only at folders named `global_step_N` holding a manifest.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import random
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file, save_model

STEP_PREFIX = "global_step_"
LATEST_FILE = "latest_checkpointed_iteration.txt"
MANIFEST = "checkpoint.json"
TRAINER_STATE = "trainer_state.json"
RNG_STATE = "rng_state.pt"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "lr_scheduler.pt"
FORMAT_NAME = "fulcrum-checkpoint"
FORMAT_VERSION = 1
# Test hook: "SECONDS" or "SECONDS@STEP": sleep in the middle of a save (after the first role is written),
# of every save or only of step STEP's, so a test can SIGKILL the trainer there.
SLOW_WRITE_ENV = "FULCRUM_TEST_SLOW_CHECKPOINT_WRITE"

_STEP_DIR = re.compile(rf"^{STEP_PREFIX}(\d+)$")
_TMP_DIR = re.compile(rf"^{STEP_PREFIX}(\d+)\.(?:tmp|old)-(\d+)$")
RESUME_MODES = ("auto", "disable", "resume_path")


def slow_write_seconds(step: int) -> float:
    """The test hook's sleep for the save of `step` (0 when unset or aimed at another step)."""
    value = os.environ.get(SLOW_WRITE_ENV, "").strip()
    if not value:
        return 0.0
    seconds, _, only_step = value.partition("@")
    if only_step and int(only_step) != step:
        return 0.0
    return float(seconds)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the folder and what to do."""


class DiskFullError(CheckpointError):
    """The disk filled up during a save; the partial folder was removed, earlier checkpoints are intact."""


class Role(Protocol):
    """What a worker exposes for checkpointing (only `model` is required)."""

    model: torch.nn.Module


@dataclass
class CheckpointSettings:
    """The `trainer.*` keys this module reads (verl's names and meanings)."""

    resume_mode: str = "auto"
    resume_from_path: str | None = None
    max_actor_ckpt_to_keep: int | None = None
    max_critic_ckpt_to_keep: int | None = None

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


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step}"


def is_complete(ckpt_dir: Path, roles: list[str] | None = None) -> bool:
    """A checkpoint is complete when its folder has its final name, a manifest, and every asked role's folder."""
    if not _STEP_DIR.match(ckpt_dir.name) or not (ckpt_dir / MANIFEST).is_file():
        return False
    return all((ckpt_dir / role).is_dir() for role in roles or [])


def complete_checkpoints(run_dir: Path, roles: list[str] | None = None) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint in `run_dir`, oldest first."""
    if not run_dir.is_dir():
        return []
    found = []
    for child in run_dir.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and is_complete(child, roles):
            found.append((int(match.group(1)), child))
    return sorted(found)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temp_dirs(run_dir: Path) -> list[Path]:
    """Delete `global_step_N.tmp-<pid>` / `.old-<pid>` folders left by a process that no longer runs."""
    removed = []
    if not run_dir.is_dir():
        return removed
    for child in run_dir.iterdir():
        match = _TMP_DIR.match(child.name)
        if match and child.is_dir():
            pid = int(match.group(2))
            if pid != os.getpid() and _pid_alive(pid):
                continue  # another live process is writing there right now
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


# ----------------------------------------------------------------------------------------------- RNG


def capture_rng_state() -> dict[str, Any]:
    """Every random generator the run draws from, as tensors / ints / floats (loadable with weights_only)."""
    version, mt_state, gauss_next = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(mt_state), "gauss_next": gauss_next},
        "numpy": {
            "kind": np_kind,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_cached),
        },
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npy = state["numpy"]
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch_cpu"])
    cuda_states = state.get("torch_cuda") or []
    if cuda_states and torch.cuda.is_available():
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            warnings.warn(
                f"checkpoint holds CUDA RNG state for {len(cuda_states)} devices, this machine has "
                f"{torch.cuda.device_count()}: CUDA sampling will not repeat the original run exactly",
                stacklevel=2,
            )


# ------------------------------------------------------------------------------------- model weights


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights as plain CPU-or-device tensors (DTensor shards gathered into full tensors)."""
    state = model.state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in state.items()}


def check_weights_finite(model: torch.nn.Module, where: str) -> None:
    """Refuse to write a checkpoint whose weights hold NaN/Inf: it would poison every resume."""
    for name, param in model.named_parameters():
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
        if not bool(torch.isfinite(tensor.detach()).all()):
            raise CheckpointError(
                f"{where}: parameter {name!r} holds NaN/Inf; not saving a corrupt checkpoint"
            )


def token_classification_config(config: Any) -> Any:
    """A copy of a backbone's config that `AutoModelForTokenClassification` loads as backbone + 1-output head.

    The critic (`fulcrum.models.value_head.CriticModel`) names its parts as `XxxForTokenClassification`
    does (`model.*`, `score.weight`, `score.bias`), so only the config needs the architecture and label count.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    arch = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES.get(config.model_type)
    if arch is None:
        raise CheckpointError(
            f"model_type {config.model_type!r} has no token-classification class in transformers: "
            "the critic cannot be written as a Hugging Face folder"
        )
    out = copy.deepcopy(config)
    out.architectures = [arch]
    out.num_labels = 1
    return out


def save_model_folder(model: torch.nn.Module, tokenizer: Any, out_dir: Path) -> None:
    """Write `model` (and `tokenizer`) as a Hugging Face folder: config.json + *.safetensors + tokenizer.

    A `PreTrainedModel` (the actor) uses its own `save_pretrained`; a value model with `.model` (backbone)
    and `.score` (head) is written in `AutoModelForTokenClassification` layout (num_labels=1).
    """
    state = full_state_dict(model)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(str(out_dir), state_dict=state)
    elif hasattr(model, "config") and hasattr(model, "score"):
        token_classification_config(model.config).save_pretrained(str(out_dir))
        save_model(model, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    else:
        raise CheckpointError(
            f"{type(model).__name__} is neither a Hugging Face PreTrainedModel nor a value model with "
            "`.config` and `.score`: cannot write it as a Hugging Face folder"
        )
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))


def load_safetensors_folder(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face folder's safetensors files (one file or shards)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weights file")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file), device="cpu"))
    return state


def load_model_weights(model: torch.nn.Module, folder: Path) -> None:
    """Copy the folder's weights into `model` in place. Tied weights (saved once) are allowed to be absent."""
    state = load_safetensors_folder(folder)
    own = model.state_dict()
    unexpected = sorted(set(state) - set(own))
    if unexpected:
        raise CheckpointError(f"{folder}: weights {unexpected[:5]} do not exist in {type(model).__name__}")
    loaded_ptrs = {own[k].data_ptr() for k in state}
    missing = [k for k in own if k not in state and own[k].data_ptr() not in loaded_ptrs]
    if missing:
        raise CheckpointError(f"{folder}: weights {missing[:5]} of {type(model).__name__} are missing")
    for key, value in state.items():
        if own[key].shape != value.shape:
            raise CheckpointError(
                f"{folder}: {key} has shape {tuple(value.shape)}, model has {tuple(own[key].shape)}"
            )
    model.load_state_dict(state, strict=False)


# ------------------------------------------------------------------------------------------ file I/O


def _fsync_tree(root: Path) -> None:
    """fsync every file and folder under `root` (so the rename publishes data that is really on disk)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return  # some file systems do not open folders; nothing more we can do
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _save_torch(obj: Any, path: Path) -> None:
    torch.save(obj, path)


def _load_torch(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"{path}: file missing from the checkpoint")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only refuses arbitrary objects: say which file
        raise CheckpointError(f"{path}: cannot be loaded safely (weights_only=True): {exc}") from exc


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def estimate_checkpoint_bytes(roles: dict[str, Any]) -> int:
    """About how many bytes a save writes: weights + optimiser state (tokenizers and JSON are small)."""
    total = 0
    for role in roles.values():
        total += _tensor_bytes(dict(role.model.state_dict()))
        optimizer = getattr(role, "optimizer", None)
        if optimizer is not None:
            total += _tensor_bytes(optimizer.state_dict()["state"])
    return total


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


# ------------------------------------------------------------------------------------------ manager


class CheckpointManager:
    """Saves and restores `global_step_N` checkpoints of a run directory (see module docstring)."""

    def __init__(self, run_dir: str | os.PathLike, trainer_cfg: Any = None) -> None:
        self.run_dir = Path(run_dir)
        self.settings = CheckpointSettings.from_trainer_cfg(trainer_cfg)

    # ------------------------------------------------------------------ save
    def save(self, step: int, roles: dict[str, Any], trainer_state: dict[str, Any]) -> Path:
        """Write `global_step_<step>` atomically; returns its path. Raises DiskFullError on a full disk."""
        if step < 0:
            raise CheckpointError(f"checkpoint step must be >= 0, got {step}")
        state = _json_checked({**trainer_state, "global_step": step})
        for name, role in roles.items():
            check_weights_finite(role.model, f"checkpoint {step_dir_name(step)}/{name}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        final = self.run_dir / step_dir_name(step)
        tmp = self.run_dir / f"{final.name}.tmp-{os.getpid()}"
        needed = estimate_checkpoint_bytes(roles)
        free = shutil.disk_usage(self.run_dir).free
        if needed > free:
            raise self._disk_full(final, needed, free)
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir()
            self._write_contents(tmp, step, roles, state)
            _fsync_tree(tmp)
            self._publish(tmp, final)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._disk_full(final, needed, shutil.disk_usage(self.run_dir).free) from exc
            raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _write_text_atomic(self.run_dir / LATEST_FILE, f"{step}\n")
        self._apply_retention(list(roles))
        return final

    def _write_contents(self, tmp: Path, step: int, roles: dict[str, Any], state: dict[str, Any]) -> None:
        (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2, allow_nan=True))
        _save_torch(capture_rng_state(), tmp / RNG_STATE)
        slow = slow_write_seconds(step)
        for i, (name, role) in enumerate(roles.items()):
            role_dir = tmp / name
            role_dir.mkdir()
            save_model_folder(role.model, getattr(role, "tokenizer", None), role_dir)
            optimizer = getattr(role, "optimizer", None)
            if optimizer is not None:
                _save_torch(optimizer.state_dict(), role_dir / OPTIMIZER_FILE)
            scheduler = getattr(role, "lr_scheduler", None)
            if scheduler is not None:
                _save_torch(scheduler.state_dict(), role_dir / SCHEDULER_FILE)
            if i == 0 and slow > 0:
                time.sleep(slow)
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "global_step": step,
            "roles": list(roles),
            "files": files,
            "saved_at_unix": time.time(),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))

    def _publish(self, tmp: Path, final: Path) -> None:
        """Rename the whole temp folder into place; an existing same-step folder is swapped out, then removed."""
        old = None
        if final.exists():
            old = final.with_name(f"{final.name}.old-{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(self.run_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

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
    def find_resume_checkpoint(self, role_names: list[str]) -> Path | None:
        """The checkpoint `resume_mode` selects, or None to start fresh. Errors name the bad path."""
        mode = self.settings.resume_mode
        if mode == "disable":
            return None
        remove_stale_temp_dirs(self.run_dir)
        if mode == "auto":
            found = complete_checkpoints(self.run_dir, role_names)
            if found:
                return found[-1][1]
            others = complete_checkpoints(self.run_dir)
            if others:  # starting fresh here would silently overwrite them
                newest = others[-1][1]
                missing = [r for r in role_names if not (newest / r).is_dir()]
                raise CheckpointError(
                    f"{self.run_dir} holds checkpoints (newest {newest.name}) but none with "
                    f"{', '.join(missing)}, which this run trains. Set trainer.resume_mode=disable to start "
                    "fresh (overwriting them), or use another trainer.default_local_dir."
                )
            return None
        path = Path(str(self.settings.resume_from_path))
        if not path.exists():
            raise CheckpointError(f"trainer.resume_from_path={path}: no such folder")
        if _STEP_DIR.match(path.name) or (path / MANIFEST).exists():
            if not is_complete(path):
                raise CheckpointError(
                    f"trainer.resume_from_path={path}: incomplete checkpoint (no {MANIFEST}; a save was interrupted)"
                )
            missing = [r for r in role_names if not (path / r).is_dir()]
            if missing:
                raise CheckpointError(f"trainer.resume_from_path={path}: has no {', '.join(missing)} folder")
            return path
        found = complete_checkpoints(path, role_names)
        if not found:
            raise CheckpointError(
                f"trainer.resume_from_path={path}: no complete {STEP_PREFIX}N checkpoint inside"
            )
        return found[-1][1]

    def resume(self, roles: dict[str, Any]) -> dict[str, Any] | None:
        """Restore weights, optimiser, scheduler and RNG into `roles`; return the trainer state (or None)."""
        ckpt = self.find_resume_checkpoint(list(roles))
        if ckpt is None:
            return None
        return self.load(ckpt, roles)

    def load(self, ckpt: Path, roles: dict[str, Any]) -> dict[str, Any]:
        """Restore everything from checkpoint folder `ckpt` into `roles`; return its trainer state."""
        manifest = json.loads((ckpt / MANIFEST).read_text())
        if manifest.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{ckpt / MANIFEST}: not a fulcrum checkpoint manifest")
        for rel, size in manifest.get("files", {}).items():
            if rel.split("/")[0] in roles or "/" not in rel:
                file = ckpt / rel
                if not file.is_file() or file.stat().st_size != size:
                    raise CheckpointError(f"{file}: missing or truncated (expected {size} bytes)")
        for name, role in roles.items():
            role_dir = ckpt / name
            load_model_weights(role.model, role_dir)
            self._load_into(getattr(role, "optimizer", None), role_dir / OPTIMIZER_FILE)
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


def read_latest_step(run_dir: str | os.PathLike) -> int | None:
    """The step recorded in `latest_checkpointed_iteration.txt` (verl's file), or None."""
    path = Path(run_dir) / LATEST_FILE
    if not path.is_file():
        return None
    text = path.read_text().strip()
    return int(text) if text.isdigit() else None


def trim_metrics_log(path: str | os.PathLike, last_step: int) -> int:
    """Drop rows of a `metrics.jsonl` logged after `last_step` (a run killed past its last checkpoint logged
    steps that the resumed run will log again). Rewritten in place, so a logger holding the file open in
    append mode keeps writing to it. Returns how many rows were dropped."""
    file = Path(path)
    if not file.is_file():
        return 0
    kept, dropped = [], 0
    for line in file.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1  # a row cut short by the kill
            continue
        step = row.get("training/global_step", row.get("step"))
        if step is not None and float(step) > last_step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        with open(file, "r+") as f:
            f.write("".join(f"{line}\n" for line in kept))
            f.truncate()
            f.flush()
            os.fsync(f.fileno())
    return dropped
