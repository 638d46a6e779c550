"""The built-in demo end to end, shrunk: data, tiny model, warm start, PPO, the closing accuracy line."""

import json
import re
from dataclasses import replace

import pytest

from fulcrum.data.synthetic import ArithmeticTask
from fulcrum.trainer.demo import DemoPlan, demo_ppo_config, run_demo, validation_accuracies


def test_validation_accuracies_reads_val_rows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [
        {"training/global_step": 0, "val-core/synthetic/arithmetic/reward/mean@1": 0.25},
        {"training/global_step": 1, "critic/score/mean": 0.5},
        {"training/global_step": 2, "val-core/synthetic/arithmetic/reward/mean@1": 0.75},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert validation_accuracies(path) == [(0, 0.25), (2, 0.75)]


@pytest.mark.slow
def test_small_demo_runs_to_its_accuracy_line(tmp_path, capsys):
    small = DemoPlan(
        task=ArithmeticTask(max_operand=9), num_train=128, num_test=16, sft_steps=8, sft_batch_size=16
    )
    ppo = demo_ppo_config()
    ppo.data.train_batch_size = 8
    ppo.actor_rollout_ref.rollout.n = 2
    ppo.actor_rollout_ref.actor.ppo_mini_batch_size = 8
    ppo.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 16
    ppo.trainer.test_freq = 2
    small = replace(small, ppo=ppo)
    # The user's overrides act on the PPO stage, over the demo's settings.
    code = run_demo([f"trainer.default_local_dir={tmp_path}", "trainer.total_training_steps=2"], plan=small)
    assert code == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    match = re.search(r"after warm start ([0-9.]+) -> after PPO \(2 steps\) ([0-9.]+)", last)
    assert match, last
    vals = validation_accuracies(tmp_path / "metrics.jsonl")
    assert [step for step, _ in vals] == [0, 2]
    assert float(match.group(1)) == pytest.approx(vals[0][1], abs=1e-3)
    assert float(match.group(2)) == pytest.approx(vals[1][1], abs=1e-3)
    assert (tmp_path / "config.yaml").is_file()
    assert (tmp_path / "demo" / "sft" / "global_step_8" / "config.json").is_file()
    assert (tmp_path / "demo" / "data" / "test.parquet").is_file()
    # The same run directory again: refused at once, before the warm start, and nothing is touched.
    metrics = (tmp_path / "metrics.jsonl").read_text()
    assert run_demo([f"trainer.default_local_dir={tmp_path}"], plan=small) == 1
    assert "holds another run" in capsys.readouterr().err
    assert (tmp_path / "metrics.jsonl").read_text() == metrics
