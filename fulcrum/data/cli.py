"""`fulcrum data SUBCOMMAND ...`: prepare data sets in verl's parquet schema.

    fulcrum data gsm8k --src SRC --out DIR

SRC is a folder holding GSM8K's `train.jsonl` and `test.jsonl`, or the hub name `openai/gsm8k`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyarrow.parquet as pq


def _gsm8k(args: argparse.Namespace) -> int:
    from fulcrum.data.gsm8k import GSM8KError, prepare_gsm8k

    taken = [
        p for p in (Path(args.out).expanduser() / f"{s}.parquet" for s in ("train", "test")) if p.exists()
    ]
    if taken:  # never overwrite data files: they may be a user's own
        names = ", ".join(str(p) for p in taken)
        print(f"fulcrum data gsm8k: {names} already exist(s); choose another --out", file=sys.stderr)
        return 1
    try:
        paths = prepare_gsm8k(args.src, args.out)
    except (GSM8KError, OSError) as err:
        print(f"fulcrum data gsm8k: {err}", file=sys.stderr)
        return 1
    for split, path in paths.items():
        print(f"{split}: {pq.ParquetFile(path).metadata.num_rows} rows -> {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fulcrum data", description="prepare data sets in verl's parquet schema"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="DATASET")
    gsm8k = commands.add_parser("gsm8k", help="GSM8K -> DIR/train.parquet, DIR/test.parquet")
    gsm8k.add_argument("--src", required=True, help="folder with train.jsonl and test.jsonl, or openai/gsm8k")
    gsm8k.add_argument("--out", required=True, help="output folder (created if missing)")
    gsm8k.set_defaults(run=_gsm8k)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
