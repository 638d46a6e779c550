"""bench/hybrid.py: its smoke run on the CPU (tiny shapes of both families, the torch path) measures both
models' engine and GRPO step, splits the hybrid's engine time by token mixer, and reports its recurrent
state as the engine holds it and as doctor's memory estimate counts it."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import hybrid
from hybrid import main


def test_the_smoke_run_reports_every_figure(tmp_path: Path) -> None:
    summary_path = tmp_path / "hybrid.json"
    args = ["--smoke", "--work", str(tmp_path / "work"), "--data", str(tmp_path / "no-gsm8k")]
    assert main([*args, "--json", str(summary_path)]) == 0
    summary = json.loads(summary_path.read_text())
    assert (
        summary["fla"] is False
        and summary["fla_trains"] is False
        and summary["grpo_data"].endswith("work/data")
    )  # the built-in prompts
    hybrid, dense = summary["qwen3.5-0.8b"], summary["qwen3-0.6b"]
    for model in (hybrid, dense):
        assert model["engine"]["native_tok_per_s"] > 0
        assert model["grpo"]["step_s"] > 0 and len(model["grpo"]["steps_s"]) == 2, model["grpo"]
        # float32 on the CPU: the engine's log-probs are the forward's (fla's kernels are not in play)
        assert model["engine"]["logprob_gap_bf16"]["rollout/logprob_diff_max"] < 1e-4
    split = hybrid["engine"]["split"]
    kinds = {
        f"{kind}/{phase}" for kind in ("linear_attention", "attention") for phase in ("prefill", "decode")
    }
    assert set(split["mixers_s"]) == kinds and all(s > 0 for s in split["mixers_s"].values())
    assert abs(sum(split["share"].values()) + split["rest_share"] - 1) < 0.01 and split["rest_share"] > 0
    # tiny shape: 3 Gated DeltaNet layers of 4 value heads of 16 x 16 (float32) and a conv window of 3 x 128
    # channels (bf16 in the engine's count); a slot per row (8) + 2
    per_sequence = 3 * (4 * 16 * 16 * 4 + 128 * 3 * 2)
    assert hybrid["engine"]["recurrent_state"]["bytes_per_sequence"] == per_sequence
    assert hybrid["engine"]["recurrent_state"]["engine_slots"] == 10
    assert list(hybrid["memory_estimate"]) == ["recurrent states of the linear-attention layers (514 slots)"]
    assert "split" not in dense["engine"] and "memory_estimate" not in dense
    assert summary["ratio_hybrid_over_dense"]["grpo_step_s"] > 0


def test_a_grpo_process_stopped_at_its_limit_still_gives_the_steps_it_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step runs in its own process under a time limit; when the limit stops it, the steps already
    in its metrics are the figure, marked as stopped, rather than nothing."""
    run = tmp_path / "run_qwen3-0.6b"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        '{"training/global_step": 1, "timing_s/step": 99.0}\n'
    )  # an older run's
    rows = [
        {"training/global_step": i + 1, "timing_s/step": s, "timing_s/gen": 1.0, "perf/throughput": 100.0}
        for i, s in enumerate((9.0, 4.0, 5.0))
    ]
    commands: list[list[str]] = []
    written: list[dict[str, float]] = rows  # what the process writes before the limit stops it

    def stopped(command: list[str], **kwargs: object) -> None:
        commands.append(command)
        run.mkdir(exist_ok=True)
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in written))
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])  # type: ignore[arg-type]

    monkeypatch.setattr(hybrid.subprocess, "run", stopped)
    args = argparse.Namespace(work=tmp_path, smoke=False, steps=5)
    result = hybrid.grpo_step("qwen3-0.6b", tmp_path / "model", tmp_path / "data", args, limit_s=200.0)
    assert result["step_s"] == 4.5 and result["steps_s"] == [9.0, 4.0, 5.0]  # the median after the first
    assert result["stopped"] == "at its 200 s limit"
    assert "trainer.wall_clock_budget_s=170" in commands[0]  # the run is asked to end by itself first
    written = []
    assert "before a step ended" in hybrid.grpo_step("qwen3-0.6b", tmp_path, tmp_path, args, 200.0)["failed"]
