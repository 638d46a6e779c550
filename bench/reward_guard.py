"""What the reward guard costs per batch: the GSM8K scorer on 512 responses, plain and guarded.

The guard (fulcrum.reward.guard) deep-copies each sample's extra_info and arms a time limit (a
watchdog thread and a signal handler) around the manager's call. Responses are the gold solutions of
the real GSM8K test split (../shared/data/gsm8k/test.jsonl); extra_info is the dataset's
{split, index, question, answer}, as `fulcrum data gsm8k` writes it.

    .venv/bin/python bench/reward_guard.py [--gsm8k DIR] [--responses 512] [--repeats 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from fulcrum.reward.guard import GuardedRewardManager
from fulcrum.reward.managers import NaiveRewardManager


def batch(gsm8k: Path, size: int) -> tuple[list[str], list[str], list[str], list[dict]]:
    """`size` (response, ground truth, data_source, extra_info) of the test split, gold solutions as responses."""
    rows = [json.loads(line) for line in (gsm8k / "test.jsonl").read_text().splitlines()[:size]]
    responses = [row["answer"] for row in rows]
    truths = [row["answer"].split("#### ")[-1].replace(",", "").strip() for row in rows]
    infos = [
        {"split": "test", "index": i, "question": row["question"], "answer": row["answer"]}
        for i, row in enumerate(rows)
    ]
    return responses, truths, ["openai/gsm8k"] * len(rows), infos


def median_ms(manager: object, args: tuple, repeats: int) -> float:
    """Median milliseconds of `manager.score(*args)` over `repeats` calls, after one warm-up call."""
    manager.score(*args)  # type: ignore[attr-defined]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        manager.score(*args)  # type: ignore[attr-defined]
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--gsm8k", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/gsm8k"
    )
    parser.add_argument("--responses", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=50)
    opts = parser.parse_args()
    responses, truths, sources, infos = batch(opts.gsm8k, opts.responses)
    args = (responses, truths, sources, infos, None)
    plain = NaiveRewardManager()
    guarded = GuardedRewardManager(plain, timeout_s=600.0)
    plain_ms = median_ms(plain, args, opts.repeats)
    guarded_ms = median_ms(guarded, args, opts.repeats)
    assert guarded.score(*args).scores == plain.score(*args).scores == [1.0] * len(responses)
    print(
        f"{len(responses)} responses, median of {opts.repeats}: plain {plain_ms:.2f} ms, guarded "
        f"{guarded_ms:.2f} ms, overhead {guarded_ms - plain_ms:.2f} ms a batch"
    )


if __name__ == "__main__":
    main()
