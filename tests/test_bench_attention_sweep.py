"""bench/tools/attention_sweep.py's decode batches: the contexts each sweep draws and the block tables they
sit in, as the engine's default launch reads them."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "tools"))
from attention_sweep import BLOCK, MIXED_CASES, MIXED_TABLE_POSITIONS, context_summary, decode_batch


def test_log_uniform_contexts_spread_over_decades_where_uniform_ones_sit_together() -> None:
    cpu = torch.device("cpu")
    uneven = decode_batch(512, 2, 1, 8, cpu, context=(64, 8192), log_uniform=True, table_positions=8448)
    even = decode_batch(512, 2, 1, 8, cpu, context=(1536, 1792), table_positions=8448)
    lens = uneven["context_lens"]
    assert int(lens.min()) >= 64 and int(lens.max()) < 8192
    # log-uniform over 64-8,192: the median near their geometric mean (724), a quarter below ~215
    summary = context_summary(lens)
    assert 550 < summary["median"] < 950 and summary["max"] > 6000 and summary["min"] < 100
    assert float((lens < 215).float().mean()) > 0.2
    assert context_summary(even["context_lens"])["min"] >= 1536
    for batch in (uneven, even):
        # tables as wide as an engine's for 8k responses, each row's blocks its own
        tables, contexts = batch["block_tables"], batch["context_lens"]
        assert tables.shape == (512, MIXED_TABLE_POSITIONS // BLOCK)
        used = [
            b
            for row, n in zip(tables.tolist(), contexts.tolist(), strict=True)
            for b in row[: -(-n // BLOCK)]
        ]
        assert len(used) == len(set(used)) and 0 not in used
        assert batch["kv_bytes"] == int(contexts.sum()) * 1 * 8 * 2 * 2


def test_the_mixed_cases_pair_each_uneven_batch_with_an_even_control_of_its_shape() -> None:
    shapes = {}
    for name, sequences, heads, kv_heads, dim, context, log_uniform in MIXED_CASES:
        shapes.setdefault((sequences, heads, kv_heads, dim), set()).add(log_uniform)
        assert context[1] <= MIXED_TABLE_POSITIONS and name.split()[0] in ("qwen3-0.6b", "qwen2.5-0.5b")
    assert all(kinds == {True, False} for kinds in shapes.values())
