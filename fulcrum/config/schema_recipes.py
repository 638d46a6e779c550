# ruff: noqa: RUF009  -- `opt`/`sub` return dataclasses.field(...) objects, not shared default values
"""The `algorithm` section of the key tree (fulcrum.config.schema holds the rest): advantage estimation,
the KL controller, verl's recipe groups (PF-PPO, DAPO's dynamic sampling, rollout correction),
reward_model.overlong_buffer (DAPO), and actor.policy_loss (the policy losses of verl's recipes and their
keys). Same conventions as fulcrum.config.schema."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fulcrum.config.domains import ABOVE_0, ANY_NUMBER, AT_LEAST_0, AT_LEAST_1, FRACTION, SHARE
from fulcrum.config.keys import Section, opt, sub


@dataclass
class OverlongBufferConfig:
    enable: bool = opt(False, "DAPO soft overlong penalty (reward_manager=dapo)")
    len: int = opt(
        0, "buffer length in tokens before max_response_length where the penalty grows", AT_LEAST_0
    )
    penalty_factor: float = opt(1.0, "penalty at max_response_length", AT_LEAST_0)
    log: bool = opt(False, "log overlong_reward / overlong per response")


# ---------------------------------------------------------------------------- actor.policy_loss
@dataclass
class PolicyLossConfig:
    loss_mode: str = opt(
        "vanilla",
        "policy loss: vanilla (PPO clip), gspo, geo_mean, gpg, cispo, sapo, clip_cov, kl_cov, dppo_tv, "
        "dppo_kl, dro",
    )
    path: str | None = opt(None, "a .py file or module to import: it registers losses (register_policy_loss)")
    clip_cov_ratio: float = opt(
        0.0002, "clip_cov: share of valid tokens (at least 1) whose gradient is cut", SHARE
    )
    clip_cov_lb: float = opt(
        1.0, "clip_cov: lower bound of a cut token's advantage-log-prob covariance", ANY_NUMBER
    )
    clip_cov_ub: float = opt(
        5.0, "clip_cov: upper bound of a cut token's advantage-log-prob covariance", ANY_NUMBER
    )
    kl_cov_ratio: float = opt(
        0.0002, "kl_cov: share of valid tokens (largest covariance) given a |log-ratio| penalty", SHARE
    )
    ppo_kl_coef: float = opt(0.1, "kl_cov: coefficient of that |log-ratio| penalty", AT_LEAST_0)
    dro_beta: float | None = opt(
        None, "dro: coefficient of the quadratic log-ratio penalty; loss_mode=dro needs it set", ABOVE_0
    )


# ----------------------------------------------------------------------------------- algorithm
@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = opt("fixed", "KL coefficient controller")
    kl_coef: float = opt(0.001, "(initial) KL coefficient of the in-reward penalty", AT_LEAST_0)
    horizon: int = opt(10000, "adaptive controller horizon", AT_LEAST_1)
    target_kl: float = opt(0.1, "adaptive controller target KL", ABOVE_0)


@dataclass
class PFPPOConfig:
    reweight_method: Literal["pow", "max_min", "max_random"] = opt("pow", "PF-PPO reweighting")
    weight_pow: float = opt(2.0, "PF-PPO power", AT_LEAST_0)


@dataclass
class FilterGroupsConfig:
    enable: bool = opt(
        False, "DAPO dynamic sampling: drop prompt groups whose metric is equal across the group"
    )
    metric: str = opt(
        "reward",
        "what must vary in a group: reward (= seq_reward), seq_final_reward, acc, score or a reward extra key",
    )
    max_num_gen_batches: int = opt(
        0, "generation rounds per step before giving up; <= 0: no limit", ANY_NUMBER
    )
    max_inflight_gen_batches: int = opt(
        1, "asynchronous generation batches in flight (no effect)", AT_LEAST_1
    )


@dataclass
class RolloutCorrectionConfig:
    rollout_is: str | None = opt(
        None, "importance weights between engine and trainer: null, token or sequence"
    )
    rollout_is_threshold: Any = opt(2.0, "truncate weights at U (TIS), or 'L_U': zero outside (IcePop)")
    rollout_is_batch_normalize: bool = opt(False, "rescale the weights to mean 1 over the batch")
    rollout_rs: str | None = opt(
        None, "rejection sampling, comma list: token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2..3"
    )
    rollout_rs_threshold: Any = opt(None, "bounds per rollout_rs option ('L_U' for k1)")
    bypass_mode: bool = opt(False, "use the engine's log-probs as old log-probs (no old-log-prob pass)")
    loss_type: Literal["ppo_clip", "reinforce"] = opt("ppo_clip", "bypass-mode loss")


@dataclass
class AlgorithmConfig(Section, path="algorithm"):
    gamma: float = opt(1.0, "discount factor", FRACTION)
    lam: float = opt(1.0, "GAE lambda", FRACTION)
    adv_estimator: str = opt("gae", "advantage estimator: gae, grpo, rloo, reinforce_plus_plus, remax, ...")
    norm_adv_by_std_in_grpo: bool = opt(True, "divide GRPO advantages by the group std (false: Dr. GRPO)")
    use_kl_in_reward: bool = opt(False, "subtract a KL penalty from the reward")
    kl_penalty: str = opt(
        "kl", "KL estimator of the in-reward penalty: kl (k1), abs, mse (k2), low_var_kl (k3), full"
    )
    kl_ctrl: KLControlConfig = sub(KLControlConfig, "KL coefficient controller")
    use_pf_ppo: bool = opt(False, "PF-PPO: resample the batch by reward after GAE")
    pf_ppo: PFPPOConfig = sub(PFPPOConfig, "PF-PPO settings")
    filter_groups: FilterGroupsConfig = sub(FilterGroupsConfig, "DAPO dynamic sampling")
    rollout_correction: RolloutCorrectionConfig = sub(
        RolloutCorrectionConfig, "rollout correction between the engine's and the trainer's log-probs"
    )
