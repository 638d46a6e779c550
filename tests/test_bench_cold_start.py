"""bench/cold_start.py: each condition's run is the measured command with only the run's keys added (cold
and warm on one cache folder, the Python wrapper's two runs on another, eager with compile off on its own), step 1 is set against the later steps,
and the CPU smoke reports every condition with the trainer process's compile accounting and profile."""

from __future__ import annotations

import json
import pstats
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from cold_start import caches_of, command, main, overrides, phase_table
from cold_start_runner import recompile


def keys_of(keys: list[str]) -> dict[str, str]:
    pairs = [k.split("=", 1) for k in keys]
    assert len(pairs) == len({k for k, _ in pairs}), "a key given twice"
    return dict(pairs)


@pytest.mark.parametrize("grpo", [False, True])
def test_each_condition_runs_the_command_for_its_steps_with_its_own_keys(grpo: bool, tmp_path: Path) -> None:
    base = command(grpo, Path("M"), Path("D"))
    for condition in ("cold", "warm", "python_wrapper", "python_wrapper_warm", "eager"):
        keys = keys_of(overrides(base, condition, tmp_path / "run", 3, ["data.train_batch_size=64"]))
        assert keys["trainer.total_training_steps"] == "3"
        assert (keys["trainer.test_freq"], keys["trainer.save_freq"]) == ("-1", "-1")  # steps only
        assert keys["trainer.default_local_dir"] == str(tmp_path / "run")
        assert keys["data.train_batch_size"] == "64"  # the user's override wins over the command's
        assert keys["actor_rollout_ref.model.path"] == "M"
        assert ("actor_rollout_ref.actor.use_torch_compile" in keys) == (condition == "eager")
        if condition == "eager":
            assert keys["actor_rollout_ref.actor.use_torch_compile"] == "False"
        python_wrapper = condition.startswith("python_wrapper")
        assert ("actor_rollout_ref.actor.inductor_cpp_wrapper" in keys) == python_wrapper
        if python_wrapper:
            assert keys["actor_rollout_ref.actor.inductor_cpp_wrapper"] == "False"
        assert (keys.get("algorithm.adv_estimator") == "grpo") == grpo
    cold, warm, python, python_warm, eager = (
        caches_of(tmp_path, c) for c in ("cold", "warm", "python_wrapper", "python_wrapper_warm", "eager")
    )
    assert cold == warm and python == python_warm  # a second run reuses its first run's caches
    assert len({cold, python, eager}) == 3  # the first runs start on their own


def test_step_one_is_set_against_the_mean_of_the_later_steps() -> None:
    steps = [
        {
            "timing_s/old_log_prob": 40.0,
            "timing_s/step": 60.0,
            "perf/graph_captures": 12.0,
            "perf/mfu/actor": 0.1,
        },
        {"timing_s/old_log_prob": 0.5, "timing_s/step": 5.0, "perf/graph_captures": 2.0},
        {"timing_s/old_log_prob": 0.3, "timing_s/step": 4.0, "perf/graph_captures": 0.0},
    ]
    table = phase_table(steps)
    assert set(table) == {"timing_s/old_log_prob", "timing_s/step", "perf/graph_captures"}
    assert table["timing_s/old_log_prob"] == pytest.approx({"step1": 40.0, "warm": 0.4, "extra": 39.6})
    assert table["perf/graph_captures"] == pytest.approx({"step1": 12.0, "warm": 1.0, "extra": 11.0})


def test_a_recompile_is_a_frames_second_compile_or_later() -> None:
    assert not recompile("DYNAMO:0/0") and recompile("DYNAMO:3/1") and recompile("DYNAMO:12/10_1")
    assert not recompile("LAZY_BACKWARD:4/0")


def test_the_smoke_run_reports_each_condition_from_inside_the_trainer(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = main(
        [
            "--smoke",
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(out),
            "--steps",
            "2",
            "--conditions",
            "cold,warm",
        ]
    )
    assert code == 0
    summary = json.loads((out / "cold_start.json").read_text())
    cold, warm = summary["conditions"]
    assert (cold["condition"], warm["condition"]) == ("cold", "warm")
    assert cold["caches"] == warm["caches"]
    for result in (cold, warm):
        assert result["exit_code"] == 0 and len(result["steps"]) == 2
        step = result["phases"]["timing_s/step"]
        assert step["step1"] > 0 and step["warm"] > 0
        inside = result["inside"]
        assert inside["exit_code"] == 0 and inside["steps"] == 2
        assert inside["to_first_step_s"] > 0 and inside["wall_s"] >= inside["to_first_step_s"]
        assert {
            "compile_times_s",
            "counters",
            "graph_breaks",
            "recompiles",
            "compiles_by_step_and_phase",
        } <= set(inside)
    profiles = (out / "step1_profiles.txt").read_text().split("===== ")[1:]
    assert [p.splitlines()[0] for p in profiles] == ["cold", "warm"]
    for profile in profiles:
        assert "top 30 by cumulative" in profile and "train_step" in profile
        assert (
            "callers of the subprocess calls" in profile and "callees of a compiled module's load" in profile
        )
    with tarfile.open(out / "step1_profiles.tar.gz") as tar, tempfile.TemporaryDirectory() as raw:
        assert sorted(tar.getnames()) == ["cold.prof", "warm.prof"]
        tar.extractall(raw, filter="data")
        stats = pstats.Stats(str(Path(raw) / "warm.prof"))
        assert any(name == "train_step" for _, _, name in stats.stats)
    assert "| timing_s/step |" in (out / "cold_start.md").read_text()
    assert "===== warm" in (out / "cold_start_logs.txt").read_text()
