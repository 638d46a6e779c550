"""`fulcrum import-gguf FILE.gguf --out DIR`: a GGUF checkpoint as a plain Hugging Face model folder.

GGUF is llama.cpp's single-file format: weights (often quantized: Q4_1, Q8_0, ...), the model's
hyper-parameters and its tokenizer (vocabulary, merges, chat template) as metadata. Transformers reads
it (`from_pretrained(folder, gguf_file=NAME)`), dequantizes every tensor and undoes llama.cpp's
reordering of the query/key rows, but the model it returns keeps a `quantization_config` and refuses
`save_pretrained`. This module writes what fulcrum (and any Hugging Face tool) trains from:

- `model.safetensors` in bf16 (or `--dtype float32`), from a plain model class built from a config
  without `quantization_config`, the dequantized weights loaded strictly (no key missing or unused);
- the tokenizer files with the chat template, and `generation_config.json`;
- `gguf_source.json`: the file's name, size and sha256, and how many tensors each GGUF type held.

What conversion loses: quantized weights dequantized are *not* the original checkpoint's weights
(Q4_1 keeps 4 bits a weight plus a scale and a minimum per block of 32), so a model imported from
a Q4_1 file is a slightly different model from the one its authors published in bf16. Any figure
measured on it says so.

Supported: the Llama, Qwen2 and Gemma 3 families (`general.architecture` `llama`, `qwen2`, `gemma3`;
transformers reads Gemma 3 as its text model, `gemma3_text`, and turns llama.cpp's stored norm
weights 1 + w back into w), which the native rollout engine serves; others are refused with a message naming
the architecture. The file must hold exactly the tensors its architecture needs, each of its shape
(`gguf_tensors`): a missing, left-over or misshapen tensor is refused by name, never filled with random
weights or dropped. The output folder is written under a temporary name and renamed when complete; an
existing non-empty folder is refused unless it is itself an earlier import and `--force` is given, and then
only the files that import wrote (listed in `gguf_source.json`) are replaced or removed: the source file
and anything else kept there stay.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from fulcrum.models.gguf_tensors import needed_tensors, tensor_problem
from fulcrum.models.load import NO_HUB_KERNELS

GGUF_MAGIC = b"GGUF"
# GGUF `general.architecture` -> Hugging Face `model_type`.
SUPPORTED_ARCHITECTURES = {"gemma3": "gemma3_text", "llama": "llama", "qwen2": "qwen2"}
SOURCE_FILE = "gguf_source.json"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class GGUFImportError(ValueError):
    """A GGUF file that cannot be imported; the message names the file and why."""


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# GGUF metadata key -> the tokenizer's special-token attribute.
SPECIAL_TOKEN_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token",
    "tokenizer.ggml.eos_token_id": "eos_token",
    "tokenizer.ggml.padding_token_id": "pad_token",
    "tokenizer.ggml.unknown_token_id": "unk_token",
}


@dataclass
class GGUFHeader:
    architecture: str
    tensor_types: Counter[str]  # tensors by GGUF type, e.g. {"Q4_1": 210, "F32": 61}
    special_ids: dict[str, int]  # "eos_token" -> 2, ... (SPECIAL_TOKEN_KEYS present in the file)
    shapes: dict[str, tuple[int, ...]]  # tensor name -> shape in llama.cpp's `ne` order


def read_gguf_header(path: Path) -> GGUFHeader:
    """The file's architecture, tensor types and special-token ids.

    Raises GGUFImportError for a missing file, one that is not GGUF, or a truncated one."""
    if not path.is_file():
        raise GGUFImportError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFImportError(f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF file with b'GGUF')")
    from gguf import GGUFReader  # the optional dependency, imported only when a file is read

    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, OSError) as err:  # numpy memmap of a truncated or damaged file
        raise GGUFImportError(f"{path}: unreadable GGUF file ({err})") from err
    field = reader.fields.get("general.architecture")
    if field is None:
        raise GGUFImportError(f"{path}: no general.architecture in its metadata")
    special = {
        name: int(reader.fields[key].contents())
        for key, name in SPECIAL_TOKEN_KEYS.items()
        if key in reader.fields
    }
    return GGUFHeader(
        str(field.contents()),
        Counter(t.tensor_type.name for t in reader.tensors),
        special,
        {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors},
    )


def set_special_tokens(tokenizer: Any, special_ids: dict[str, int]) -> None:
    """The file's own BOS/EOS/pad/unk on the tokenizer: transformers' GGUF tokenizer conversion has
    chosen differently across versions (SmolLM2's EOS came out as <|im_start|>, with no pad token, under 5.17 and as the
    chat template's <|im_end|> under 5.24; the file says <|im_end|>), and a training run appends the
    tokenizer's EOS to every SFT example and stops generation at it."""
    for name, token_id in special_ids.items():
        if 0 <= token_id < len(tokenizer):
            setattr(tokenizer, name, tokenizer.convert_ids_to_tokens(token_id))


def plain_config(config: Any, architecture: str) -> Any:
    """The loaded config without `quantization_config` and GGUF bookkeeping, as its own class;
    `architecture`: the model class's name (Gemma3TextConfig's is Gemma3ForCausalLM)."""
    data = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        data.pop(key, None)
    data["architectures"] = [architecture]
    return type(config).from_dict(data)


def convert(path: Path, out: Path, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Write the Hugging Face folder `out` (which must not exist) from the GGUF file `path`, with
    transformers' dequantization notices and per-tensor progress bars silenced.

    Returns what `gguf_source.json` records."""
    from transformers import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        return _convert(path, out, dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


def _convert(path: Path, out: Path, dtype: torch.dtype) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    header = read_gguf_header(path)
    if header.architecture not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(
            f"{path}: architecture {header.architecture!r} is not supported; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    folder, name = str(path.parent), path.name
    try:
        file_config = AutoConfig.from_pretrained(folder, gguf_file=name)
        problem = tensor_problem(header.shapes, *needed_tensors(file_config), header.architecture)
        if problem:
            raise GGUFImportError(f"{path}: {problem}")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        set_special_tokens(tokenizer, header.special_ids)
        loaded = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, **NO_HUB_KERNELS
        )
    except GGUFImportError:
        raise
    except (ValueError, KeyError, RuntimeError) as err:
        # metadata transformers cannot build a model from: its own message, on one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise GGUFImportError(
            f"{path}: transformers cannot read it as a {header.architecture} model ({first})"
        ) from err
    config = plain_config(loaded.config, type(loaded).__name__)
    config.dtype = dtype
    for name in ("bos_token", "eos_token", "pad_token"):  # the model's ids agree with the tokenizer's
        if name in header.special_ids:
            setattr(config, f"{name}_id", header.special_ids[name])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # strict: every tensor of the file lands in the model and the model has no untouched weight
    model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    out.mkdir(parents=True)
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out)
    source = {
        "file": path.name,
        "bytes": path.stat().st_size,
        "sha256": sha256_of(path),
        "architecture": header.architecture,
        "tensor_types": dict(sorted(header.tensor_types.items())),
        "special_tokens": {k: tokenizer.convert_ids_to_tokens(v) for k, v in header.special_ids.items()},
        "dtype": str(dtype).removeprefix("torch."),
        "note": "weights dequantized from the GGUF file: not the original checkpoint's weights when quantized",
        "files": sorted([*(p.name for p in out.iterdir()), SOURCE_FILE]),  # what --force may replace
    }
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    return source


def out_problem(out: Path, force: bool) -> str | None:
    """Why `out` may not be written (None when it may): never replace what an import did not write."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        return f"--out {out} exists and is not a folder"
    if not out.exists() or not any(out.iterdir()):
        return None
    if not (out / SOURCE_FILE).is_file():
        return (
            f"--out {out} is not empty and is not a folder this command wrote; choose a new or empty folder"
        )
    if not force:
        return f"--out {out} already holds an imported model; add --force to replace it"
    return None


def written_files(out: Path) -> set[str]:
    """The names an earlier import in `out` wrote: its `gguf_source.json` lists them; an import that did
    not list them wrote at most the files a new import writes, which are replaced by name."""
    try:
        files = json.loads((out / SOURCE_FILE).read_text()).get("files", [])
    except (OSError, ValueError, AttributeError):
        return set()
    return {name for name in files if isinstance(name, str) and name == Path(name).name}


def replace_owned(new: Path, out: Path, source: Path) -> None:
    """Move the files of the finished import `new` into the earlier import `out`: each written file
    replaces the one of its name, files only the earlier import wrote are removed, and every other file
    (the source `.gguf`, the user's notes) stays. `gguf_source.json` moves last, so the folder is marked
    as this import's only once all its files are in place."""
    names = sorted(p.name for p in new.iterdir())
    owned = written_files(out) | set(names)
    for name in owned:
        if (out / name).resolve() == source.resolve():
            raise GGUFImportError(
                f"--out {out} holds the source {source} under the name {name}; move it first"
            )
    for name in sorted(names, key=lambda n: n == SOURCE_FILE):
        os.replace(new / name, out / name)
    for name in owned - set(names):
        if (out / name).is_file():
            (out / name).unlink()
    new.rmdir()


def import_gguf(path: Path, out: Path, dtype: torch.dtype = torch.bfloat16, force: bool = False) -> dict:
    """Convert into a temporary sibling of `out`, then rename it into place; an earlier import in `out`
    (with `--force`) has only its own files replaced, so the source file and anything else kept there stay."""
    problem = out_problem(out, force)
    if problem:
        raise GGUFImportError(problem)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        source = convert(path, tmp, dtype)
        if out.is_dir() and any(out.iterdir()):
            replace_owned(tmp, out, path)
        else:
            if out.is_dir():
                out.rmdir()
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return source


def describe(source: dict, out: Path) -> str:
    types = ", ".join(f"{n} {t}" for t, n in source["tensor_types"].items())
    return (
        f"wrote {out}: {source['architecture']} in {source['dtype']} from {source['file']} "
        f"(sha256 {source['sha256'][:12]}…; tensors: {types}; quantized weights are dequantized, "
        "not the original checkpoint's)"
    )


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """--out, --dtype, --force: shared by `import-gguf` and `pretrained`."""
    parser.add_argument("--out", type=Path, required=True, help="the Hugging Face folder to write")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16", help="weights' type on disk")
    parser.add_argument("--force", action="store_true", help="replace an earlier import in --out")


def run_command(prog: str, convert_with: Callable[[], dict], out: Path) -> int:
    """Run a conversion; its refusals, a missing `gguf` package and Ctrl-C end with one line."""
    try:
        source = convert_with()
    except GGUFImportError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as err:
        if err.name != "gguf":
            raise
        print(f"{prog}: the `gguf` package is missing: pip install 'fulcrum[gguf]'", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; nothing written", file=sys.stderr)
        return 130
    print(describe(source, out))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fulcrum import-gguf", description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path, help="the .gguf file")
    add_output_options(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    convert_with = partial(import_gguf, args.file, args.out, DTYPES[args.dtype], args.force)
    return run_command("fulcrum import-gguf", convert_with, args.out)


if __name__ == "__main__":
    sys.exit(main())
