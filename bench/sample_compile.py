"""Benchmark: what the sampler's first call at a batch size not seen before costs (a Triton compilation?).

    python bench/sample_compile.py [--json out.json]
    PYTHONPATH=OLD_TREE python bench/sample_compile.py   # another tree's sampler (bench/compare_trees.sh)

A rollout samples the first tokens of however many prompts a prefill step completes (n rows each) and
decodes a batch that shrinks as sequences finish, so `sample_kernels.sample_tokens` meets new batch sizes
in every step. Triton compiles a new variant of a kernel whenever an integer argument changes its
specialisation (== 1, divisible by 16) or a pointer its 16-byte alignment. This warms the sampler at the
0.5B shape's decode batch (512 x 151,936 bf16 logits), then times the first call at each of a list of
batch sizes (wall clock around a synchronised call, so a compilation shows) and a second call at the same
size, and counts the kernels' compiled variants. A fresh Triton cache directory is used, so a variant
compiled by an earlier process is not loaded from disk.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

BATCHES = (136, 17, 1, 7, 16, 64, 509, 300)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_cache_")
    import torch

    from fulcrum.rollout.native import sample_kernels as sk

    device = torch.device("cuda")
    logits = (torch.randn(512, 151936, device=device) * 3).to(torch.bfloat16)
    seed = torch.tensor([1], device=device)

    def timed(batch: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        sk.sample_tokens(logits[:batch], 1.0, seed)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    kernels = (sk._sample_tile_stats_kernel, sk._sample_pick_kernel)

    def variants() -> int:
        return sum(len(k.device_caches[torch.cuda.current_device()][0]) for k in kernels)

    warm_s = timed(512)
    timed(512)
    after_warm = variants()
    rows = [{"batch": b, "first_s": timed(b), "second_s": timed(b), "variants": variants()} for b in BATCHES]
    result = {"warm_first_s": warm_s, "variants_after_warm": after_warm, "rows": rows}
    result["variants_total"] = variants()
    result["first_call_s_total"] = sum(r["first_s"] for r in rows)
    for r in rows:
        print(
            f"batch {r['batch']:4d}: first {1e3 * r['first_s']:8.2f} ms, second {1e3 * r['second_s']:6.2f} ms,"
            f" compiled variants so far {r['variants']}"
        )
    print(
        f"first call at 512: {warm_s:.2f} s; first calls at {len(rows)} new sizes: "
        f"{result['first_call_s_total']:.2f} s; compiled variants {result['variants_total']}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
