"""verl's recipes end to end on the CPU (tiny model, two steps each): DAPO (dynamic sampling, overlong
penalty, clip-higher) with rollout correction, bypass mode with the optimal token baseline, PF-PPO with
SAPO, the Clip-Cov and KL-Cov losses, and a reward model built by the project scoring and training a
policy."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers import TINY
from transformers import AutoModelForSequenceClassification

from fulcrum.batch import response_lengths
from fulcrum.config import load_config
from fulcrum.models.tiny import build_tiny_reward_model
from fulcrum.trainer.main_ppo import main
from fulcrum.trainer.ppo_trainer import PPOTrainer

_spec = importlib.util.spec_from_file_location("_e2e", Path(__file__).with_name("test_trainer_e2e.py"))
_e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_e2e)
seed_like, read_rows = _e2e.seed_like, _e2e.read_rows
assets = _e2e.assets  # the module-scoped fixture: tiny model and synthetic data

GRPO = (
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=4",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
)
# Rewards that differ within a group (a random policy never solves the arithmetic): by response length.
LENGTH_REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return float(len(solution_str) % 3 == 0)\n"


def finite_rows(run: Path) -> list[dict]:
    rows = read_rows(run)
    assert [r["training/global_step"] for r in rows if "training/global_step" in r] == [1.0, 2.0]
    for row in rows:
        for key, value in row.items():
            assert torch.isfinite(torch.tensor(float(value))), key
    return rows


# Prompts with an even index score 0 whatever the response: their groups carry no signal and are dropped,
# so a step needs more than one generation round to gather its prompts.
HALF_SILENT_REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    if extra_info['index'] % 2 == 0:\n"
    "        return 0.0\n"
    "    return float(len(solution_str) % 3 == 0)\n"
)


def test_dapo_with_rollout_correction(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.set_num_threads(1)
    reward = tmp_path / "reward.py"
    reward.write_text(HALF_SILENT_REWARD)
    run = tmp_path / "dapo"
    extra = (
        *GRPO,
        f"custom_reward_function.path={reward}",
        "reward_model.reward_manager=dapo",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
        "algorithm.filter_groups.enable=True",
        "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=8",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.policy_loss.loss_mode=cispo",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_threshold=2.0",
        "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
    )
    assert main(seed_like(assets, run, *extra)) == 0
    rows = finite_rows(run)
    step = rows[0]
    steps = [r for r in rows if "train/num_gen_batches" in r]
    assert max(r["train/num_gen_batches"] for r in steps) >= 2  # extra rounds were drawn
    assert all(r["training/filter_groups/evicted_samples"] >= 1 for r in steps)
    # the share before the filter: what the kept batch's critic/score/groups_alike (0) no longer shows
    assert all(0 < r["training/filter_groups/groups_alike"] <= 1 for r in steps)
    assert all(r.get("critic/score/groups_alike", 0.0) == 0.0 for r in steps)
    for key in ("rollout_is_mean", "rollout_is_eff_sample_size", "rollout_rs_token_k1_masked_fraction", "kl"):
        assert f"rollout_corr/{key}" in step, key
    # The engine and the trainer score the same policy: weights near 1, almost nothing rejected.
    assert step["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=0.05)
    out = capsys.readouterr().out
    assert "dynamic sampling:" in out and "reward: manager dapo" in out


def test_bypass_mode_with_the_optimal_token_baseline(assets: Path, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    reward = tmp_path / "reward.py"
    reward.write_text(LENGTH_REWARD)
    run = tmp_path / "bypass"
    extra = (
        *GRPO,
        f"custom_reward_function.path={reward}",
        "algorithm.adv_estimator=optimal_token_baseline",
        "actor_rollout_ref.actor.calculate_sum_pi_squared=True",
        "algorithm.rollout_correction.bypass_mode=True",
        "algorithm.rollout_correction.loss_type=reinforce",
        "algorithm.rollout_correction.rollout_is=sequence",
    )
    assert main(seed_like(assets, run, *extra)) == 0
    step = finite_rows(run)[0]
    assert "rollout_corr/rollout_is_mean" in step  # computed in the loss against the current policy
    assert "actor/entropy" not in step  # no old-log-prob pass in bypass mode (as verl)


def test_pf_ppo_after_gae_with_sapo(assets: Path, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    run = tmp_path / "pfppo"
    extra = (
        "algorithm.use_pf_ppo=True",
        "algorithm.pf_ppo.reweight_method=max_random",
        "actor_rollout_ref.actor.policy_loss.loss_mode=sapo",
        "actor_rollout_ref.actor.tau_pos=1.2",
    )
    assert main(seed_like(assets, run, *extra)) == 0
    finite_rows(run)


POLICY_LOSS = "actor_rollout_ref.actor.policy_loss"


@pytest.mark.parametrize(
    ("loss_mode", "keys"),
    [
        # a band holding every covariance: each micro-batch cuts at least one token
        ("clip_cov", (f"{POLICY_LOSS}.clip_cov_lb=-100", f"{POLICY_LOSS}.clip_cov_ub=100")),
        ("kl_cov", (f"{POLICY_LOSS}.kl_cov_ratio=0.2",)),
    ],
)
def test_clip_cov_and_kl_cov_train(
    loss_mode: str, keys: tuple[str, ...], assets: Path, tmp_path: Path
) -> None:
    """Both pick their tokens from the whole micro-batch's statistics (covariances over all its tokens)."""
    torch.set_num_threads(1)
    reward = tmp_path / "reward.py"
    reward.write_text(LENGTH_REWARD)
    run = tmp_path / loss_mode
    extra = (*GRPO, f"custom_reward_function.path={reward}", f"{POLICY_LOSS}.loss_mode={loss_mode}", *keys)
    assert main(seed_like(assets, run, *extra)) == 0
    steps = [row for row in finite_rows(run) if "actor/pg_loss" in row]
    assert len(steps) == 2
    if loss_mode == "clip_cov":
        assert all(row["actor/pg_clipfrac"] > 0 for row in steps)
    else:
        # KL-Cov reports the mean |log-ratio| as ppo_kl: above 0 once the first of a step's two
        # mini-batches has moved the policy, and small at this learning rate.
        assert all(0 < row["actor/ppo_kl"] < 1e-2 for row in steps), [row["actor/ppo_kl"] for row in steps]


def test_a_reward_model_scores_and_trains_a_policy(assets: Path, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    rm_path = build_tiny_reward_model(tmp_path / "rm", seed=5, intermediate_size=64, **TINY)
    run = tmp_path / "rm_run"
    argv = seed_like(
        assets,
        run,
        *GRPO,
        "reward_model.enable=True",
        f"reward_model.model.path={rm_path}",
        "reward_model.micro_batch_size_per_gpu=3",
    )
    cfg = load_config(argv)
    trainer = PPOTrainer(cfg, torch.device("cpu"))
    items = next(iter(trainer.train_loader))
    batch, _ = trainer.sampler.generate_and_score(items, 0, {}, {})
    # The score on each response's last token is the classifier's own output for prompt + response.
    model = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    lengths = response_lengths(batch)
    for i in range(len(batch)):
        prompt = batch["prompts"][i][batch["attention_mask"][i, : batch.prompt_length].bool()]
        ids = torch.cat([prompt, batch["responses"][i, : int(lengths[i])]])
        with torch.no_grad():
            expected = model(input_ids=ids.unsqueeze(0)).logits[0, 0]
        assert float(batch["token_level_scores"][i].sum()) == pytest.approx(float(expected), abs=1e-4)
        assert float(batch["token_level_scores"][i, int(lengths[i]) - 1]) == pytest.approx(
            float(expected), abs=1e-4
        )
    # And it trains: two steps with the reward model's scores, every metric finite.
    assert main(argv) == 0
    rows = finite_rows(run)
    assert rows[0]["critic/score/max"] != rows[0]["critic/score/min"]
