"""`fulcrum data SUBCOMMAND ...`: prepare data sets in verl's parquet schema.

    fulcrum data gsm8k --src SRC --out DIR [--multi-turn-tool | --multi-turn-interaction]
    fulcrum data math --src FILE_OR_DIR --out DIR
    fulcrum data humaneval --out DIR

SRC is a folder holding GSM8K's `train.jsonl` and `test.jsonl`, or the hub name `openai/gsm8k`.
Existing output files are never replaced. The files are written into a temporary folder inside DIR and
moved in when both are whole: an error, Ctrl-C or SIGTERM leaves nothing behind (not even DIR, when
this command created it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path


def _gsm8k(args: argparse.Namespace) -> int:
    from fulcrum.data.gsm8k import SPLITS, GSM8KError, prepare_gsm8k

    variant = "tool" if args.multi_turn_tool else "interaction" if args.multi_turn_interaction else "single"
    return _prepare(
        "gsm8k",
        args.out,
        [f"{s}.parquet" for s in SPLITS],
        lambda staging: prepare_gsm8k(args.src, staging, variant),
        GSM8KError,
    )


def _math(args: argparse.Namespace) -> int:
    from fulcrum.data.math import SPLITS, MathDataError, prepare_math

    return _prepare(
        "math",
        args.out,
        [f"{s}.parquet" for s in SPLITS],
        lambda staging: prepare_math(args.src, staging),
        MathDataError,
    )


def _humaneval(args: argparse.Namespace) -> int:
    from fulcrum.data.humaneval import HumanEvalError, prepare_humaneval

    return _prepare("humaneval", args.out, ["humaneval.parquet"], prepare_humaneval, HumanEvalError)


def _prepare(
    command: str,
    out_arg: str,
    names: list[str],
    write: Callable[[Path], dict[str, Path]],
    data_error: type[Exception],
) -> int:
    """`fulcrum data COMMAND`: refuse an --out that is a file or holds any of `names`, write the files
    with `write_whole`, and print each file's rows; 1 with one line on stderr when it fails."""
    import pyarrow.parquet as pq

    out = Path(out_arg).expanduser()
    if out.exists() and not out.is_dir():
        print(f"fulcrum data {command}: --out {out}: is a file, not a folder", file=sys.stderr)
        return 1
    taken = [p for p in (out / n for n in names) if p.exists() or p.is_symlink()]
    if taken:  # never overwrite data files: they may be a user's own
        shown = ", ".join(str(p) for p in taken)
        print(f"fulcrum data {command}: {shown} already exist(s); choose another --out", file=sys.stderr)
        return 1
    try:
        paths = write_whole(out, write)
    except (data_error, OSError) as err:
        print(f"fulcrum data {command}: {err}; nothing was written to {out}", file=sys.stderr)
        return 1
    for split, path in paths.items():
        print(f"{split}: {pq.ParquetFile(path).metadata.num_rows} rows -> {path}")
    return 0


def top_missing(folder: Path) -> Path | None:
    """The outermost of `folder` and its parents that does not exist yet: what a command that creates
    `folder` removes again when it fails (None when `folder` exists)."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    return missing[-1] if missing else None


def write_whole(out: Path, write: Callable[[Path], dict[str, Path]]) -> dict[str, Path]:
    """Run `write(staging)` (it returns {name: file it wrote}) in a temporary folder inside `out`, then
    move the files into `out`; on any failure or interrupt remove all of it (and `out` when created
    here) and say so on the exception. Returns {name: final path}."""
    created = top_missing(out)
    staging = out / f".fulcrum-data.tmp-{os.getpid()}"
    moved: dict[str, Path] = {}
    try:
        staging.mkdir(parents=True)
        for name, path in write(staging).items():
            os.rename(path, out / path.name)
            moved[name] = out / path.name
        staging.rmdir()
    except BaseException as exc:
        for path in moved.values():
            path.unlink(missing_ok=True)
        shutil.rmtree(created or staging, ignore_errors=True)
        if not isinstance(exc, Exception):  # Ctrl-C / SIGTERM: the one line is printed by `fulcrum`
            exc.add_note(f"nothing was written to {out}")
        raise
    return moved


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fulcrum data", description="prepare data sets in verl's parquet schema"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="DATASET")
    gsm8k = commands.add_parser("gsm8k", help="GSM8K -> DIR/train.parquet, DIR/test.parquet")
    gsm8k.add_argument("--src", required=True, help="folder with train.jsonl and test.jsonl, or openai/gsm8k")
    gsm8k.add_argument("--out", required=True, help="output folder (created if missing)")
    variants = gsm8k.add_mutually_exclusive_group()
    variants.add_argument(
        "--multi-turn-tool",
        action="store_true",
        help="verl's multi-turn variant with the calc_gsm8k_reward tool (gsm8k_multiturn_w_tool.py)",
    )
    variants.add_argument(
        "--multi-turn-interaction",
        action="store_true",
        help="verl's multi-turn variant with the GSM8K interaction (gsm8k_multiturn_w_interaction.py)",
    )
    gsm8k.set_defaults(run=_gsm8k)
    math = commands.add_parser("math", help="MATH jsonl -> DIR/{train,test}.parquet (verl's math_dataset.py)")
    math.add_argument(
        "--src", required=True, help="a jsonl of {problem, solution}, or a folder with train/test.jsonl"
    )
    math.add_argument("--out", required=True, help="output folder (created if missing)")
    math.set_defaults(run=_math)
    humaneval = commands.add_parser("humaneval", help="HumanEval's 164 problems -> DIR/humaneval.parquet")
    humaneval.add_argument("--out", required=True, help="output folder (created if missing)")
    humaneval.set_defaults(run=_humaneval)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
