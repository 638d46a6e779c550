"""`fulcrum export CKPT_DIR --out DIR [--role actor|critic] [--dtype ...]`: a checkpoint as a Hugging Face folder.

Checkpoints already keep each role in Hugging Face layout (`fulcrum.trainer.checkpoint`), so export
copies config, safetensors weights, generation config and tokenizer, leaving out optimiser and
scheduler state; `--dtype` casts the floating-point weights (e.g. to bfloat16 for serving). The
actor loads with `AutoModelForCausalLM`, the critic with `AutoModelForTokenClassification`
(backbone + 1-output `score` head: the value of every token is `logits[..., 0]`).

Export writes only its own output: `--out` may not be, contain, or lie inside the source run
directory, and `--force` replaces only a folder that a previous export wrote (it holds
`fulcrum_export.json`); anything else is refused, never deleted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fulcrum.trainer.checkpoint import (
    MANIFEST,
    OPTIMIZER_FILE,
    SCHEDULER_FILE,
    STEP_PREFIX,
    CheckpointError,
    complete_checkpoints,
    is_complete,
    verify_checkpoint,
)

# Files of a role folder that belong to training only.
TRAINING_ONLY = {OPTIMIZER_FILE, SCHEDULER_FILE}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO_CLASS = {"actor": "AutoModelForCausalLM", "critic": "AutoModelForTokenClassification"}
EXPORT_MARKER = "fulcrum_export.json"  # written into every export: what --force may replace


def resolve_checkpoint(path: Path, role: str) -> Path:
    """`path` itself when it is a complete checkpoint, else the newest complete one inside a run folder."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    if (path / MANIFEST).exists() or path.name.startswith(STEP_PREFIX):
        if not is_complete(path):
            raise CheckpointError(f"{path}: incomplete checkpoint (no {MANIFEST}: its save was interrupted)")
        if not (path / role).is_dir():
            raise CheckpointError(
                f"{path}: has no {role} folder (was it removed by max_{role}_ckpt_to_keep?)"
            )
        return path
    found = complete_checkpoints(path, [role])
    if not found and complete_checkpoints(path):
        raise CheckpointError(
            f"{path}: no checkpoint in it has a {role} folder (runs without a critic, e.g. GRPO, save only the actor)"
        )
    if not found:
        raise CheckpointError(
            f"{path}: neither a checkpoint nor a run folder with a complete global_step_N/{role}"
        )
    return found[-1][1]


def check_out_folder(out_dir: Path, run_dir: Path, force: bool) -> None:
    """Refuse an --out that would delete or overwrite anything but a previous export."""
    out, run = out_dir.resolve(), run_dir.resolve()
    if out == run or run in out.parents:
        raise CheckpointError(
            f"--out {out_dir}: lies inside the source run {run_dir}; choose a folder outside it"
        )
    if out in run.parents:
        raise CheckpointError(
            f"--out {out_dir}: contains the source run {run_dir}; choose a new folder outside the run"
        )
    if not out_dir.exists() or not any(out_dir.iterdir()):
        return
    if not (out_dir / EXPORT_MARKER).is_file():
        raise CheckpointError(
            f"--out {out_dir}: folder exists, is not empty and was not written by fulcrum export "
            f"(no {EXPORT_MARKER}); choose a new or empty folder (--force replaces only a previous export)"
        )
    if not force:
        raise CheckpointError(
            f"--out {out_dir}: holds a previous export and is not empty (pass --force to replace it)"
        )


def cast_weights(folder: Path, dtype: torch.dtype) -> None:
    """Cast every floating-point tensor of the folder's safetensors files to `dtype`, and say so in config.json."""
    for file in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(file))
        cast = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
        save_file(cast, str(file), metadata={"format": "pt"})
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name
    if "torch_dtype" in config:
        config["torch_dtype"] = name
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def enable_kv_cache(folder: Path) -> None:
    """Training turns `use_cache` off (gradient checkpointing); a served model wants its KV cache back."""
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    if config.get("use_cache") is False:
        config["use_cache"] = True
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def export_checkpoint(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    role: str = "actor",
    dtype: str | None = None,
    force: bool = False,
) -> Path:
    """Write checkpoint `ckpt`'s `role` into `out` as a Hugging Face folder; returns `out`."""
    if role not in AUTO_CLASS:
        raise CheckpointError(f"--role {role!r}: expected one of {', '.join(AUTO_CLASS)}")
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    checkpoint = resolve_checkpoint(Path(ckpt).expanduser(), role)
    problems = verify_checkpoint(checkpoint, [role])
    if problems:
        raise CheckpointError(f"{checkpoint}: the checkpoint is damaged:\n  " + "\n  ".join(problems))
    source = checkpoint / role
    if not (source / "config.json").is_file() or not list(source.glob("*.safetensors")):
        raise CheckpointError(f"{source}: no config.json or *.safetensors; not a Hugging Face folder")
    out_dir = Path(out).expanduser()
    check_out_folder(out_dir, source.parent.parent, force)
    # Written beside the target and renamed when whole, like the checkpoints themselves; a previous
    # export is swapped out only once the new one is complete.
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    old = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}")
    if tmp.exists() or old.exists():
        raise CheckpointError(f"--out {out_dir}: {tmp.name} or {old.name} is in the way; remove it first")
    try:
        shutil.copytree(source, tmp, ignore=lambda _d, names: [n for n in names if n in TRAINING_ONLY])
        if dtype is not None:
            cast_weights(tmp, DTYPES[dtype])
        enable_kv_cache(tmp)
        marker = {"source": str(source.resolve()), "role": role, "dtype": dtype}
        (tmp / EXPORT_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if out_dir.exists():
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old.exists():
        shutil.rmtree(old)  # a previous export (it held EXPORT_MARKER), now replaced
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fulcrum export",
        description="Write a checkpoint's actor (or critic) as a Hugging Face model folder loadable by transformers.",
    )
    parser.add_argument(
        "checkpoint", help="RUN_DIR/global_step_N (or RUN_DIR: its newest complete checkpoint)"
    )
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument(
        "--role", default="actor", choices=sorted(AUTO_CLASS), help="which model (default actor)"
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="cast weights (default: as trained)"
    )
    parser.add_argument("--force", action="store_true", help="replace a previous export in --out")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out, role=args.role, dtype=args.dtype, force=args.force)
    except CheckpointError as exc:
        print(f"fulcrum export: {exc}", file=sys.stderr)
        return 1
    print(f"exported {args.role} to {out}")
    print(f"load it with: transformers.{AUTO_CLASS[args.role]}.from_pretrained({str(out)!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
