"""The host time of turning a rollout's token lists into the step's batch (`fulcrum.batch.assemble_batch`).

It runs inside the step's `gen` phase, after the engine returns and before anything else can start: the
device idles through all of it. The seed's shape by default: 512 responses of 256 tokens (each with its
log-probs) after GSM8K-length prompts of 60-200 tokens, left-padded to 512.

    python bench/assemble_host.py                        # this tree
    python bench/assemble_host.py /tmp/old . --rounds 5  # trees alternating, medians, ratios to the first

Each tree runs in its own process with its own `fulcrum` first on PYTHONPATH. Figures depend on the host
(`bench/host_speed.py`'s probe is printed with them): compare trees in one call, never across calls.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time


def measure(rows: int, prompt_length: int, response_length: int, repeats: int) -> dict[str, float]:
    """Median ms of `repeats` assemble_batch calls over the same random rollout."""
    from fulcrum.batch import assemble_batch

    rng = random.Random(0)
    items = [
        {"input_ids": [rng.randrange(50_000) for _ in range(rng.randrange(60, 200))]} for _ in range(rows)
    ]
    tokens = [[rng.randrange(50_000) for _ in range(response_length)] for _ in range(rows)]
    logprobs = [[-rng.random() for _ in range(response_length)] for _ in range(rows)]
    index = list(range(rows))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        assemble_batch(items, tokens, logprobs, index, prompt_length, response_length, 0, "s")
        times.append(time.perf_counter() - start)
    return {"assemble_ms": 1000 * statistics.median(times)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trees", nargs="*", help="source trees to compare (default: this one, in process)")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--prompt-length", type=int, default=512)
    parser.add_argument("--response-length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    sizes = [str(args.rows), str(args.prompt_length), str(args.response_length), str(args.repeats)]
    if not args.trees:
        print(json.dumps(measure(*map(int, sizes))))
        return
    results: dict[str, list[float]] = {tree: [] for tree in args.trees}
    for _ in range(args.rounds):
        for tree in args.trees:
            # the script itself, not `-c`, whose first path entry is the working directory (this tree)
            env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
            command = [sys.executable, __file__, "--rows", *sizes[:1], "--prompt-length", sizes[1]]
            command += ["--response-length", sizes[2], "--repeats", sizes[3]]
            out = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
            results[tree].append(json.loads(out.stdout.strip().splitlines()[-1])["assemble_ms"])
    first = statistics.median(results[args.trees[0]])
    summary = {
        tree: {
            "median_ms": statistics.median(ms),
            "runs_ms": ms,
            "ratio_to_first": statistics.median(ms) / first,
        }
        for tree, ms in results.items()
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
