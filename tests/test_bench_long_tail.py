"""bench/long_tail.py: the budgets follow the stated log-normal distribution, and the smoke path on the
CPU runs both modes and reports every figure (carried tokens only under partial rollouts)."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from long_tail import kv_read_floor_s, lognormal_budgets, main, share_of_deadline


def test_budgets_are_log_normal_around_the_median_and_cut_at_the_cap() -> None:
    budgets = lognormal_budgets(20_000, median=1536, sigma=0.8, cap=8192, seed=0)
    assert budgets == lognormal_budgets(20_000, median=1536, sigma=0.8, cap=8192, seed=0)  # seeded
    assert abs(statistics.median(budgets) - 1536) < 40
    assert max(budgets) == 8192 and min(budgets) >= 1
    cut = 1 - statistics.NormalDist().cdf(math.log(8192 / 1536) / 0.8)  # P(draw > cap), about 1.8 %
    assert sum(b == 8192 for b in budgets) / len(budgets) == pytest.approx(cut, abs=0.004)


def test_the_smoke_run_compares_both_modes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary_path = tmp_path / "summary.json"
    assert main(["--smoke", "--out", str(tmp_path / "out"), "--json", str(summary_path)]) == 0
    rows = pq.read_table(tmp_path / "out/data/train.parquet").to_pylist()
    budgets = [r["extra_info"]["max_response_length"] for r in rows]
    assert max(budgets) <= 32 and len(set(budgets)) > 5  # the smoke's cap, and a spread of lengths
    summary = json.loads(summary_path.read_text())
    sync, partial = summary["sync"], summary["partial"]
    assert sync["steps"] == partial["steps"] == 3
    assert sync["carried_token_share"] == 0 and partial["carried_token_share"] > 0
    assert sync["step_s"] > 0 and partial["tok_per_s"] > 0
    over = summary["over_sync"]["partial"]
    assert over["step_rate_ratio"] == pytest.approx(sync["step_s"] / partial["step_s"])
    assert over["tok_per_s_ratio"] == pytest.approx(partial["tok_per_s"] / sync["tok_per_s"])
    assert over["tok_per_s_total_ratio"] == pytest.approx(
        partial["tok_per_s_total"] / sync["tok_per_s_total"]
    )
    assert sync["gpu_util_mean"] is None  # no GPU here: said, not invented
    assert summary["kv_read_floor_s"] is None  # no card, no bandwidth: no floor
    # the engine's figures: under partial rollouts it samples at least what is trained
    assert sync["generated_tok_per_s"] > 0 and partial["generated_tok_per_s"] > 0
    assert sync["prefill_tokens"] > 0 and sync["preemptions"] >= 0
    out = capsys.readouterr().out
    assert "| step rate (steps/s) |" in out and "| carried-token share |" in out
    assert "| figure | sync | partial | partial / sync |" in out
    assert "| **trained response tok/s** |" in out.split("|---|")[1].splitlines()[1]  # the first row
    assert "| engine's sampled tok/s while generating |" in out
    assert "| the same, all tokens over all the time |" in out
    assert summary["overrides"] == {"sync": [], "partial": []} and "different overrides" not in out


def test_the_kv_read_floor_is_the_k_v_each_response_reads_over_its_decode_steps() -> None:
    # a response of b tokens after P: the first from the prefill, then decode steps over P + 1 ... P + b - 1
    assert kv_read_floor_s([3], 10, samples=1, groups=1, kv_bytes=1, bandwidth=1) == 11 + 12
    # the mean over the budgets, times the step's responses, bytes over bandwidth
    floor = kv_read_floor_s([1, 3], 0, samples=8, groups=64, kv_bytes=114_688, bandwidth=3.35e12)
    assert floor == pytest.approx(64 * 8 * (0 + 1 + 2) / 2 * 114_688 / 3.35e12)


def test_the_runs_share_what_is_left_of_the_deadline() -> None:
    args = argparse.Namespace(deadline_s=480.0)
    now = time.perf_counter()
    assert share_of_deadline(args, now, 2) == pytest.approx(240, abs=1)
    assert share_of_deadline(args, now - 300, 1) == pytest.approx(180, abs=1)  # the first run took 300 s
    assert share_of_deadline(args, now - 470, 1) == 60  # a minute at least: one step, then the run ends


def test_the_modes_can_run_in_two_calls_over_one_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--modes sync` keeps its figures and compares nothing; `--modes partial` over the same folder then
    writes the comparison of both, as one call running both would."""
    out, summary_path = tmp_path / "out", tmp_path / "summary.json"
    assert main(["--smoke", "--out", str(out), "--modes", "sync", "--json", str(summary_path)]) == 0
    assert (out / "qwen3-0.6b/sync.json").exists() and not summary_path.exists()
    assert "the comparison once sync and a partial mode are in" in capsys.readouterr().out
    # a mode file written before a figure existed: that figure reads n/a, the rest compares
    sync_path = out / "qwen3-0.6b/sync.json"
    older = {k: v for k, v in json.loads(sync_path.read_text()).items() if k != "tok_per_s_total"}
    sync_path.write_text(json.dumps(older))
    order = "+actor_rollout_ref.rollout.engine_kwargs.native.decode_order=longest_first"
    assert main(["--smoke", "--out", str(out), "--modes", "partial", "--json", str(summary_path), order]) == 0
    summary = json.loads(summary_path.read_text())
    assert summary["overrides"] == {"sync": [], "partial": [order]}  # each mode's call, said when they differ
    assert summary["over_sync"]["partial"]["tok_per_s_total_ratio"] is None
    assert summary["over_sync"]["partial"]["tok_per_s_ratio"] > 0
    printed = capsys.readouterr().out
    assert "| the same, all tokens over all the time | n/a |" in printed
    assert f"the modes ran with different overrides: sync: (none); partial: {order}" in printed
    assert summary["sync"] == json.loads((out / "qwen3-0.6b/sync.json").read_text())
    assert summary["sync"]["carried_token_share"] == 0 and summary["partial"]["carried_token_share"] > 0
    with pytest.raises(SystemExit):
        main(["--smoke", "--out", str(out), "--modes", "async"])
    # another shape keeps its own figures: its first mode compares nothing
    assert main(["--smoke", "--out", str(out), "--shape", "qwen2.5-0.5b", "--modes", "sync"]) == 0
    assert (out / "qwen2.5-0.5b/sync.json").exists() and not (out / "qwen2.5-0.5b/partial.json").exists()


def test_partial_kept_skips_the_old_log_prob_pass_and_keeps_the_held_k_v(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--modes sync,partial-kept`: its column beside sync's, a run with no old-log-prob pass (bypass mode)
    and the KV cache kept through training (`free_cache_engine=False`: the held samples are not prefilled
    again)."""
    out, summary_path = tmp_path / "out", tmp_path / "summary.json"
    assert (
        main(["--smoke", "--out", str(out), "--modes", "sync,partial-kept", "--json", str(summary_path)]) == 0
    )
    summary = json.loads(summary_path.read_text())
    assert set(summary["over_sync"]) == {"partial-kept"} and "partial" not in summary
    kept = summary["partial-kept"]
    assert kept["carried_token_share"] > 0
    run = out / "qwen3-0.6b/run_partial-kept"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "training/global_step" in r]
    assert steps and all("timing_s/old_log_prob" not in r for r in steps)  # bypass mode: no such pass
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["actor_rollout_ref"]["rollout"]["free_cache_engine"] is False
    assert config["algorithm"]["rollout_correction"]["bypass_mode"] is True
    assert "| figure | sync | partial-kept | partial-kept / sync |" in capsys.readouterr().out
