"""bench/long_train.py: the micro-batches are the largest that doctor's estimate fits on the card, and the
smoke path on the CPU runs the warm step and the three phases and reports every figure."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
from helpers import model_folder_of_shape

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from long_train import doctor_estimate, largest_fitting, load, main, phase_totals
from train_step import make_model

GiB = 1024**3


def test_a_smaller_card_gets_smaller_update_micro_batches(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model", shape="qwen3-0.6b", tiny=True)
    args = argparse.Namespace(
        model=model, prompt_width=300, response=64, rows=0, smoke=True, overrides=[], max_seqs=4, fill=0.8
    )
    big = 80 * GiB
    assert largest_fitting(args, big) == (4, 4)  # a tiny model: every size fits
    # A card where the estimated update of 2 sequences does not fit and that of 1 does.
    one, two = (phase_totals(doctor_estimate(load(args, k, k), big, 2 * k))["update_actor"] for k in (1, 2))
    small = (one + two) / 2 / args.fill
    k_update, k_forward = largest_fitting(args, small)
    assert k_update == 1 and k_forward > 1  # a forward holds less than an update
    keys = load(args, 3, 5).actor_rollout_ref
    assert keys.actor.use_dynamic_bsz and keys.actor.ppo_max_token_len_per_gpu == 3 * 364
    assert keys.ref.log_prob_max_token_len_per_gpu == keys.rollout.log_prob_max_token_len_per_gpu == 5 * 364


def test_the_smoke_run_measures_every_phase(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary_path = tmp_path / "summary.json"
    assert main(["--smoke", "--out", str(tmp_path / "out"), "--json", str(summary_path)]) == 0
    summary = json.loads(summary_path.read_text())
    assert summary["micro_batch_sequences"] == {"update": 2, "forwards": 2}
    assert summary["rows"] == 4 and summary["sequence_tokens"]["max"] <= 300 + 64
    assert "actor_rollout_ref.model.enable_gradient_checkpointing=True" in summary["keys"]
    assert set(summary["phases"]) == {"old_log_prob", "ref_log_prob", "update_actor"}
    for phase in summary["phases"].values():
        assert phase["seconds"] > 0 and phase["tokens_per_s"] > 0 and phase["estimate_gib"] > 0
        assert phase["peak_reserved_gib"] is None and phase["mfu"] is None  # no GPU here: said, not invented
    # The warm step (compiles, captures) is compared with the estimate's largest phase.
    assert summary["warm_step"]["estimate_gib"] == max(p["estimate_gib"] for p in summary["phases"].values())
    out = capsys.readouterr().out
    assert "| update_actor |" in out and "| warm step (compiles, captures) |" in out


# BENCHMARKS.md, "Training at 16k tokens a sequence" (one H100 80GB HBM3, 2026-12-07): Qwen3-0.6B's shape,
# micro-batches of 8 sequences of 16,384 tokens in every pass, each phase's peak reserved GiB (the graphs'
# pool 31.52 of them) and the device's total as torch reported it.
MEASURED_16K_RESERVED_GIB = {"old_log_prob": 44.56, "ref_log_prob": 44.56, "update_actor": 46.78}
H100_GIB = 79.19


def test_doctor_within_ten_percent_of_the_measured_peaks_at_16k_tokens(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The issue's bar for training at 16k tokens a sequence: each phase's estimate within 10 % of its
    measured peak. At that length the graphs' pool is most of the gap: it holds the forwards' work beside
    the update's, and the update's attention backward grows with the micro-batch's tokens."""
    from shapes import shape_of

    model_type, fields = shape_of("qwen3-0.6b")  # the full shape: doctor reads only config.json
    model = model_folder_of_shape(tiny_model, tmp_path / "model", {"model_type": model_type, **fields})
    args = argparse.Namespace(
        model=model,
        prompt_width=300,
        response=16084,
        rows=16,
        smoke=False,
        overrides=[],
        max_seqs=8,
        fill=0.8,
    )
    assert largest_fitting(args, H100_GIB * GiB) == (8, 8)  # the micro-batches the measurement ran
    totals = phase_totals(doctor_estimate(load(args, 8, 8), H100_GIB * GiB, 16))
    for phase, measured in MEASURED_16K_RESERVED_GIB.items():
        assert abs(totals[phase] / GiB - measured) / measured < 0.10, (phase, totals[phase] / GiB, measured)
