"""`fulcrum export CKPT_DIR --out DIR [--role actor|critic] [--dtype ...]`: a checkpoint as a Hugging Face folder.

Checkpoints already keep each role in Hugging Face layout (`fulcrum.trainer.checkpoint`), so export
copies config, safetensors weights, generation config and tokenizer, leaving out optimiser and
scheduler state; `--dtype` casts the floating-point weights (e.g. to bfloat16 for serving). The
actor loads with `AutoModelForCausalLM`, the critic with `AutoModelForTokenClassification`
(backbone + 1-output `score` head: the value of every token is `logits[..., 0]`); a critic whose
backbone transformers gives no token classifier loads its backbone with `AutoModel`, beside its `score`
tensors (`fulcrum.trainer.checkpoint.hf_folder`).

Only the role's files that the checkpoint's manifest lists (and `verify_checkpoint` has just checked)
are copied: a file added to the folder later is left out, and named.

Export writes only its own output: `--out` may not be, contain, or lie inside the source run
directory, nor be a file or a symbolic link, and `--force` replaces only a folder that a previous
export wrote (it holds `fulcrum_export.json`); anything else is refused, never deleted. The export is
written beside `--out` and renamed when whole; Ctrl-C, SIGTERM or a full disk removes the partial
folder (and puts back a previous export being replaced).
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

from fulcrum.data.cli import top_missing
from fulcrum.models.load import NO_HUB_KERNELS
from fulcrum.models.lora import base_pointer_problems, read_base_pointer
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
from fulcrum.trainer.checkpoint.adapters import is_adapter_folder
from fulcrum.trainer.checkpoint.layout import read_manifest

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
    if out_dir.is_symlink():
        raise CheckpointError(
            f"--out {out_dir}: is a symbolic link (to {os.readlink(out_dir)}); name a real folder"
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"--out {out_dir}: is a file, not a folder; choose a new folder")
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
    if not config_path.is_file():  # a PEFT adapter folder: its tensors are all there is
        return
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
    adapter: bool = False,
) -> Path:
    """Write checkpoint `ckpt`'s `role` into `out` as a Hugging Face folder (a LoRA checkpoint's adapters
    merged into its base), or with `adapter` as the PEFT adapter folder it holds; returns `out`."""
    if role not in AUTO_CLASS:
        raise CheckpointError(f"--role {role!r}: expected one of {', '.join(AUTO_CLASS)}")
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    checkpoint = resolve_checkpoint(Path(ckpt).expanduser(), role)
    problems = verify_checkpoint(checkpoint, [role])
    if problems:
        raise CheckpointError(f"{checkpoint}: the checkpoint is damaged:\n  " + "\n  ".join(problems))
    source = checkpoint / role
    lora = is_adapter_folder(source)
    if adapter and not lora:
        raise CheckpointError(
            f"{source}: holds whole weights, not LoRA adapters; export it without --adapter"
        )
    if lora and role != "actor":
        raise CheckpointError(
            f"{source}: a LoRA critic's value head is not part of a PEFT adapter or a merged causal LM; "
            "only the actor's adapters export"
        )
    if lora and not adapter:
        base_problems = base_pointer_problems(read_base_pointer(source), str(source))
        if base_problems:
            raise CheckpointError("; ".join(base_problems) + " (--adapter exports the adapters alone)")
    elif not lora and (not (source / "config.json").is_file() or not list(source.glob("*.safetensors"))):
        raise CheckpointError(f"{source}: no config.json or *.safetensors; not a Hugging Face folder")
    out_dir = Path(out).expanduser()
    check_out_folder(out_dir, source.parent.parent, force)
    files = manifest_files(checkpoint, role)
    # Written beside the target and renamed when whole, like the checkpoints themselves; a previous
    # export is swapped out only once the new one is complete.
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    old = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}")
    if tmp.exists() or old.exists():
        raise CheckpointError(f"--out {out_dir}: {tmp.name} or {old.name} is in the way; remove it first")
    created = top_missing(out_dir.parent)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        marker = {"source": str(source.resolve()), "role": role, "dtype": dtype}
        if lora and not adapter:
            write_merged_export(source, tmp, {**marker, "merged": "true"})
        else:
            write_export(source, files, tmp, marker)
        if out_dir.exists():
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
    except BaseException as exc:
        undo_export(tmp, old, out_dir, created, exc)
        if isinstance(exc, OSError):
            raise CheckpointError(
                f"--out {out_dir}: export failed at {exc.filename or tmp} ({_reason(exc)}); nothing was left "
                "behind"
            ) from exc
        raise
    try:
        shutil.rmtree(old, ignore_errors=True)  # a previous export (it held EXPORT_MARKER), now replaced
    except BaseException as exc:  # interrupted while removing it: finish, the new export is whole
        shutil.rmtree(old, ignore_errors=True)
        exc.add_note(f"the export in {out_dir} is complete")
        raise
    return out_dir


def _reason(exc: OSError) -> str:
    return (exc.strerror or str(exc)).lower()


def manifest_files(checkpoint: Path, role: str) -> list[str]:
    """The role's files as the checkpoint's manifest lists them (relative to the role folder), but the
    training-only ones: what export copies."""
    prefix = f"{role}/"
    listed = [
        rel.removeprefix(prefix)
        for rel in read_manifest(checkpoint).get("files", {})
        if rel.startswith(prefix)
    ]
    # ".." in a (tampered) manifest would copy from and write to outside the two folders
    return sorted(
        rel for rel in listed if Path(rel).name not in TRAINING_ONLY and ".." not in Path(rel).parts
    )


def unlisted_files(checkpoint: Path, role: str) -> list[str]:
    """Files in the role folder that its manifest does not list (added after the save; never exported)."""
    source = checkpoint / role
    listed = set(manifest_files(checkpoint, role)) | TRAINING_ONLY
    present = (str(p.relative_to(source)) for p in source.rglob("*") if p.is_file() or p.is_symlink())
    return sorted(rel for rel in present if rel not in listed)


def write_export(source: Path, files: list[str], tmp: Path, marker: dict[str, str | None]) -> None:
    """The export's whole content in `tmp`: the listed files, cast and with the KV cache on, and its marker."""
    tmp.mkdir(exist_ok=source == tmp)
    for rel in files:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / rel, tmp / rel)
    if marker["dtype"] is not None:
        cast_weights(tmp, DTYPES[marker["dtype"]])
    if (tmp / "config.json").is_file():  # a model folder (a PEFT adapter folder has no model config)
        enable_kv_cache(tmp)
    (tmp / EXPORT_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def write_merged_export(source: Path, tmp: Path, marker: dict[str, str | None]) -> None:
    """A LoRA checkpoint as one Hugging Face folder: its base (from the pointer, checked) with the
    adapters merged in (W + scale·B·A), the tokenizer saved beside the adapters, cast and marked."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(
        read_base_pointer(source)["path"], dtype=torch.float32, **NO_HUB_KERNELS
    )
    merged = PeftModel.from_pretrained(base, str(source)).merge_and_unload()
    merged.save_pretrained(str(tmp))
    if list(source.glob("tokenizer*")):
        AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(tmp))
    write_export(tmp, [], tmp, marker)


def undo_export(tmp: Path, old: Path, out_dir: Path, created: Path | None, exc: BaseException) -> None:
    """After a failed or interrupted export: remove the partial folder, put a previous export back where
    it was, remove the folders created for it; say so on `exc`."""
    if tmp.exists():
        shutil.rmtree(tmp, ignore_errors=True)
        exc.add_note(f"removed the partial export {tmp}")
    if old.exists() and not out_dir.exists():
        os.rename(old, out_dir)
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)


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
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA checkpoint's adapters as a PEFT adapter folder (default: merged into the base)",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        out = export_checkpoint(
            args.checkpoint,
            args.out,
            role=args.role,
            dtype=args.dtype,
            force=args.force,
            adapter=args.adapter,
        )
    except CheckpointError as exc:
        print(f"fulcrum export: {exc}", file=sys.stderr)
        return 1
    print(f"exported {args.role} to {out}")
    left_out = unlisted_files(resolve_checkpoint(Path(args.checkpoint).expanduser(), args.role), args.role)
    if left_out:
        print(
            f"left out {len(left_out)} file(s) its manifest does not list (unchecked): {', '.join(left_out)}"
        )
    if args.adapter:
        print(f"load it with: peft.PeftModel.from_pretrained(base_model, {str(out)!r})")
    elif "fulcrum_value_head" in json.loads((out / "config.json").read_text()):
        # transformers has no token classifier of this backbone (docs/checkpoints.md)
        print(
            f"load its backbone with: transformers.AutoModel.from_pretrained({str(out)!r}); "
            "values = last_hidden_state @ score.weight.T + score.bias (model.safetensors)"
        )
    else:
        print(f"load it with: transformers.{AUTO_CLASS[args.role]}.from_pretrained({str(out)!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
