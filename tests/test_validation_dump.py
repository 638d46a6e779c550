"""`trainer.validation_data_dir`: every validation writes `<step>.jsonl` with verl's keys, one row a sample,
whose scores are the ones the validation metric averaged."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import cpu_ppo_overrides, make_assets

from fulcrum.trainer.main_ppo import main


def test_each_validation_dumps_its_generations(tmp_path: Path) -> None:
    assets = make_assets(tmp_path / "assets", num_train=4, num_test=3)
    run, dump = tmp_path / "run", tmp_path / "generations"
    reward = tmp_path / "reward.py"  # a score that differs between samples, so the mean check means something
    reward.write_text(
        "def length(data_source, solution_str, ground_truth, extra_info=None):\n    return len(solution_str) / 100\n"
    )
    keys = {
        "algorithm.adv_estimator": "grpo",
        "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,
        "data.max_response_length": 8,
        "trainer.total_training_steps": 1,
        "trainer.test_freq": 1,
        "trainer.save_freq": -1,
        "trainer.val_before_train": True,
        "trainer.logger": "[console]",
        "trainer.validation_data_dir": dump,
        "custom_reward_function.path": reward,
        "custom_reward_function.name": "length",
    }
    assert main(cpu_ppo_overrides(assets, run, keys)) == 0
    assert sorted(p.name for p in dump.iterdir()) == ["0.jsonl", "1.jsonl"]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val_means = [v for m in metrics for k, v in m.items() if k.startswith("val-core/")]  # step 0, then 1
    assert len(val_means) == 2
    for step in (0, 1):
        rows = [json.loads(line) for line in (dump / f"{step}.jsonl").read_text().splitlines()]
        assert len(rows) == 3
        assert {"input", "output", "gts", "score", "step"} <= set(rows[0])
        assert all(r["step"] == step and 0 <= r["response_length"] <= 8 for r in rows)
        assert all("<|im_start|>" in r["input"] for r in rows)  # the prompt as the model saw it
        assert all(r["score"] == len(r["output"]) / 100 for r in rows)
        assert abs(val_means[step] - sum(r["score"] for r in rows) / 3) < 1e-6
