"""End-to-end: the reference command of docs/configuration.md, scaled down (tiny model, synthetic
GSM8K-format data, CPU), for PPO with a critic and KL in the reward, and for GRPO with the KL loss; every
metric of docs/metrics.md present and finite, config.yaml written, validation and the final checkpoint done."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import make_assets

from fulcrum.config.device import select_device
from fulcrum.trainer.main_ppo import main, wants_demo

# docs/metrics.md: the metrics every PPO step writes (critic ones dropped for critic-free runs).
STEP_METRICS = """actor/pg_loss actor/pg_clipfrac actor/pg_clipfrac_lower actor/ppo_kl actor/grad_norm actor/entropy
actor/lr critic/vf_loss critic/vf_clipfrac critic/vpred_mean critic/grad_norm critic/lr critic/vf_explained_var
critic/score/mean critic/score/max critic/score/min critic/rewards/mean critic/rewards/max critic/rewards/min
critic/advantages/mean critic/advantages/max critic/advantages/min critic/returns/mean critic/returns/max
critic/returns/min critic/values/mean critic/values/max critic/values/min response_length/mean response_length/max
response_length/min response_length/clip_ratio prompt_length/mean prompt_length/max prompt_length/min
prompt_length/clip_ratio timing_s/step timing_s/gen timing_s/reward timing_s/old_log_prob timing_s/ref
timing_s/values timing_s/adv timing_s/update_critic timing_s/update_actor timing_s/update_weights timing_s/testing
timing_s/save_checkpoint timing_per_token_ms/gen timing_per_token_ms/ref timing_per_token_ms/values
timing_per_token_ms/adv timing_per_token_ms/update_critic timing_per_token_ms/update_actor perf/total_num_tokens
perf/time_per_step perf/throughput perf/mfu/actor perf/mfu/critic perf/max_memory_allocated_gb perf/max_memory_reserved_gb
perf/cpu_memory_used_gb actor/reward_kl_penalty actor/reward_kl_penalty_coeff training/global_step
training/epoch""".split()
CRITIC_ONLY = ("critic/v", "critic/grad_norm", "critic/lr", "timing_s/values", "timing_s/update_critic")
CRITIC_ONLY += ("timing_per_token_ms/values", "timing_per_token_ms/update_critic", "perf/mfu/critic")


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_assets(tmp_path_factory.mktemp("assets"), num_train=16, num_test=4)


def seed_like(assets: Path, run_dir: Path, *extra: str) -> list[str]:
    """The seed command's keys (docs/configuration.md) with sizes shrunk for CI, then `extra`."""
    return [
        f"data.train_files={assets}/data/train.parquet",
        f"data.val_files={assets}/data/test.parquet",
        "data.train_batch_size=8",
        "data.max_prompt_length=128",
        "data.max_response_length=12",
        f"actor_rollout_ref.model.path={assets}/model",
        "actor_rollout_ref.actor.optim.lr=1.5e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.65",
        "actor_rollout_ref.rollout.max_num_seqs=1896",
        "actor_rollout_ref.rollout.max_num_batched_tokens=16384",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "critic.optim.lr=1e-5",
        f"critic.model.path={assets}/model",
        "critic.ppo_micro_batch_size_per_gpu=2",
        "critic.forward_micro_batch_size_per_gpu=2",
        "algorithm.kl_ctrl.kl_coef=0.0005",
        "algorithm.kl_ctrl.target_kl=0.05",
        "trainer.logger=[console]",
        "trainer.val_before_train=False",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.save_freq=10",
        "trainer.test_freq=10",
        "trainer.total_epochs=15",
        "trainer.total_training_steps=2",
        "trainer.device=cpu",
        "actor_rollout_ref.rollout.name=hf",
        f"trainer.default_local_dir={run_dir}",
        *extra,
    ]


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def check_run(run_dir: Path, need: list[str]) -> list[dict]:
    rows = read_rows(run_dir)
    keys = {k for r in rows for k in r}
    missing = [k for k in need if k not in keys]
    assert not missing, f"missing metrics: {missing}"
    bad = [k for r in rows for k, v in r.items() if not isinstance(v, (int, float)) or not math.isfinite(v)]
    assert not bad, f"non-finite metrics: {bad}"
    assert [r["training/global_step"] for r in rows] == [1.0, 2.0]
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "global_step_2" / "actor").is_dir()  # the last step always saves (verl)
    assert any(k.startswith("val-core/") and k.endswith("/reward/mean@1") for k in rows[-1])
    return rows


def test_ppo_gae_with_kl_in_reward(assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.set_num_threads(1)
    run = tmp_path / "ppo"
    assert main(seed_like(assets, run, "algorithm.use_kl_in_reward=True")) == 0
    rows = check_run(run, STEP_METRICS)
    assert (run / "global_step_2" / "critic").is_dir()
    out = capsys.readouterr().out
    assert "KL: KL in reward" in out and "step 2 |" in out
    # Live diagnosis: a random tiny model's 12-token responses run to the limit; said once, not every step.
    assert out.count("diagnosis (length_limit)") == 1, out
    assert rows[0]["actor/reward_kl_penalty_coeff"] == 0.0005


def test_grpo_with_kl_loss_has_no_critic(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.set_num_threads(1)
    run = tmp_path / "grpo"
    extra = (
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.use_kl_loss=True",
    )
    assert main(seed_like(assets, run, *extra)) == 0
    need = [k for k in STEP_METRICS if not k.startswith(CRITIC_ONLY) and "reward_kl" not in k]
    rows = check_run(run, [*need, "actor/kl_loss"])
    assert not any(k.startswith(("critic/vf", "critic/values")) for k in rows[0])
    assert not (run / "global_step_2" / "critic").exists()
    assert rows[0]["perf/total_num_tokens"] > 16 * 1  # 4 prompts × 4 responses


def test_no_kl_line_when_kl_unused(assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.set_num_threads(1)
    extra = (
        "algorithm.adv_estimator=rloo",
        "actor_rollout_ref.rollout.n=2",
        "trainer.total_training_steps=1",
    )
    args = [a for a in seed_like(assets, tmp_path / "rloo", *extra) if "total_training_steps=2" not in a]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "KL: none" in out and "kl_coef=0.0005 has no effect" in out
    row = read_rows(tmp_path / "rloo")[0]
    assert "actor/reward_kl_penalty" not in row
    assert row["timing_s/ref"] == 0.0  # logged every step (docs/metrics.md); no reference pass ran


def test_too_few_devices_stops_with_a_clear_message(assets: Path, tmp_path: Path, capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA devices")
    args = [a for a in seed_like(assets, tmp_path / "x") if not a.startswith("trainer.device")]
    assert main([*args, "trainer.device=auto", "trainer.n_gpus_per_node=2"]) == 1
    err = capsys.readouterr().err
    assert "asks for 2 CUDA device(s) but this machine has 0" in err and "trainer.device=cpu" in err
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_select_device_cpu_and_demo_rule() -> None:
    assert select_device("cpu", n_gpus_per_node=8, nnodes=1) == torch.device("cpu")
    assert wants_demo([]) and wants_demo(["trainer.default_local_dir=/tmp/x"])
    assert not wants_demo(["data.train_files=a.parquet"])
    assert not wants_demo(["actor_rollout_ref.model.path=m"])


def test_bad_sizes_stop_before_loading_models(assets: Path, tmp_path: Path, capsys) -> None:
    args = seed_like(assets, tmp_path / "bad", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3")
    assert main(args) == 1  # a mini-batch of 4 responses does not split into micro-batches of 3
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu" in capsys.readouterr().err


def test_remax_generates_a_greedy_baseline(assets: Path, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    extra = (
        "algorithm.adv_estimator=remax",
        "actor_rollout_ref.rollout.n=2",
        "trainer.total_training_steps=1",
    )
    args = [a for a in seed_like(assets, tmp_path / "remax", *extra) if "total_training_steps=2" not in a]
    assert main(args) == 0
    row = read_rows(tmp_path / "remax")[0]
    assert row["timing_s/gen_max"] > 0 and math.isfinite(row["actor/pg_loss"])
    assert "critic/vf_loss" not in row  # ReMax is critic-free


def test_unknown_key_stops_before_the_demo_runs(tmp_path: Path, capsys) -> None:
    # No data and no model: this would be the demo, but the misspelt key is reported first.
    assert main(["data.train_fiels=x.parquet", f"trainer.default_local_dir={tmp_path / 'demo'}"]) == 1
    assert "did you mean data.train_files?" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("free_cache_engine", [True, False])
def test_remax_step_leaves_the_kv_cache_released_through_the_updates(
    assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, free_cache_engine: bool
) -> None:
    """ReMax generates twice per step (samples, then the greedy baseline), validation once more; with
    free_cache_engine the native engine's KV cache must be released while the actor trains, and after."""
    from fulcrum.config import load_config
    from fulcrum.trainer.ppo_trainer import PPOTrainer

    torch.set_num_threads(1)
    extra = (
        "algorithm.adv_estimator=remax",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.name=native",
        "actor_rollout_ref.rollout.max_num_seqs=16",
        f"actor_rollout_ref.rollout.free_cache_engine={free_cache_engine}",
        "trainer.total_training_steps=1",
        "trainer.save_freq=-1",
    )
    args = [a for a in seed_like(assets, tmp_path / "run", *extra) if "total_training_steps=2" not in a]
    trainer = PPOTrainer(load_config(args), torch.device("cpu"))
    assert type(trainer.rollout).__name__ == "NativeEngine"
    awake_during_update: list[bool] = []
    update_policy = trainer.actor.update_policy

    def recording_update(*a, **k):
        awake_during_update.append(trainer.rollout.awake)
        return update_policy(*a, **k)

    monkeypatch.setattr(trainer.actor, "update_policy", recording_update)
    metrics = trainer.fit()
    assert metrics["timing_s/gen_max"] > 0  # the greedy baseline was generated
    assert awake_during_update == [not free_cache_engine]
    assert trainer.rollout.awake is not free_cache_engine
