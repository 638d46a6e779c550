"""The rows of docs/levers.md's tune table from a `fulcrum tune` work folder's trials.json.

    python bench/tools/tune_table.py OUT/tune-micro-checkpointing-dynamic/trials.json

Prints one markdown row per trial: #, probe, tok/s/GPU, step s, update_actor s, update_critic s, the
training-phase peak (GiB allocated, generation left out), outcome; paste them over the _TUNE_ rows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _num(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def rows(trials: list[dict]) -> list[str]:
    out = [
        "| # | probe | tok/s/GPU | step s | update_actor s | update_critic s | training-phase peak GiB | outcome |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, t in enumerate(trials):
        phases = t.get("phases") or {}
        probe = t["probe"].replace("|", "\\|")
        out.append(
            f"| {i} | {probe} | {_num(t.get('throughput'), ',.0f')} | {_num(t.get('step_seconds'), '.2f')} | "
            f"{_num(phases.get('timing_s/update_actor'), '.2f')} | {_num(phases.get('timing_s/update_critic'), '.2f')} | "
            f"{_num(t.get('train_memory_gb'), '.1f')} | {t['outcome']} |"
        )
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    path = Path(argv[0])
    if not path.is_file():
        print(f"tune_table: no such file {path}", file=sys.stderr)
        return 1
    print("\n".join(rows(json.loads(path.read_text()))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
