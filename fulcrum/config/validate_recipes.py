"""Rules for verl's recipe keys (fulcrum.config.validate lists them with its own): rollout correction,
DAPO dynamic sampling and overlong penalty, PF-PPO, the optimal-token-baseline estimator, the DRO loss,
reward managers, multi-turn rollouts."""

from __future__ import annotations

from fulcrum.config.finding import Finding
from fulcrum.config.schema import FulcrumConfig
from fulcrum.config.schema_v1 import partial_rollouts_on

BUILT_IN_REWARD_MANAGERS = ("naive", "dapo", "batch", "prime")


def recipe_problems(cfg: FulcrumConfig) -> list[Finding]:
    """Settings of the recipes that would fail at start-up or mid-run."""
    problems = []
    algo, actor, rm = cfg.algorithm, cfg.actor_rollout_ref.actor, cfg.reward_model
    rollout, custom = cfg.actor_rollout_ref.rollout, cfg.custom_reward_function
    loss_mode = actor.key("policy_loss.loss_mode")
    if algo.adv_estimator == "optimal_token_baseline" and not actor.calculate_sum_pi_squared:
        problems.append(
            Finding(
                (algo.key("adv_estimator"), actor.key("calculate_sum_pi_squared")),
                "optimal_token_baseline needs actor.calculate_sum_pi_squared=True (as verl)",
            )
        )
    if algo.filter_groups.enable and rollout.n < 2:
        problems.append(
            Finding(
                (algo.key("filter_groups.enable"), rollout.key("n")),
                "dynamic sampling keeps groups whose responses differ; set rollout.n >= 2",
            )
        )
    if actor.policy_loss.loss_mode == "dro" and actor.policy_loss.dro_beta is None:
        # verl raises this inside the first training step; here it stops the run before any model loads.
        # (A value <= 0 is outside the key's domain, which names it too.)
        problems.append(
            Finding(
                (actor.key("policy_loss.dro_beta"), loss_mode),
                "loss_mode=dro needs policy_loss.dro_beta > 0, the weight of its quadratic log-ratio penalty",
            )
        )
    if actor.policy_loss.loss_mode == "bypass_mode" and not algo.rollout_correction.bypass_mode:
        # verl's trainer switches to this loss itself (apply_bypass_mode) and hands it the correction.
        bypass = algo.key("rollout_correction.bypass_mode")
        problems.append(
            Finding(
                (loss_mode, bypass),
                "loss_mode=bypass_mode is rollout correction's bypass mode, whose loss needs the correction's "
                f"settings: set {bypass}=True (its loss_type reinforce or ppo_clip) and leave "
                "loss_mode=vanilla",
            )
        )
    gen = cfg.data.gen_batch_size
    if gen is not None and gen <= 0:
        problems.append(Finding((cfg.data.key("gen_batch_size"),), f"must be positive, got {gen}"))
    if rm.reward_manager not in BUILT_IN_REWARD_MANAGERS and not custom.path:
        problems.append(
            Finding(
                (rm.key("reward_manager"),),
                f"{rm.reward_manager!r} is not built in ({', '.join(BUILT_IN_REWARD_MANAGERS)}); register your "
                f"own with @fulcrum.reward.managers.register_reward_manager in {custom.key('path')}",
            )
        )
    if rm.reward_manager == "batch" and not custom.path:
        problems.append(
            Finding(
                (rm.key("reward_manager"), custom.key("path")),
                f"the batch manager calls a batched function: set {custom.key('path')} and name",
            )
        )
    if rollout.multi_turn.enable and rollout.name == "hf":
        problems.append(
            Finding(
                (rollout.key("multi_turn.enable"), rollout.key("name")),
                "multi-turn rollouts need rollout.name=native: the hf backend generates whole batches, not "
                "conversations turn by turn",
            )
        )
    for name, what in (
        ("tool_config_path", "tools are called"),
        ("interaction_config_path", "an interaction answers the turns"),
    ):
        if getattr(rollout.multi_turn, name) and not rollout.multi_turn.enable:
            problems.append(
                Finding(
                    (rollout.key(f"multi_turn.{name}"), rollout.key("multi_turn.enable")),
                    f"{what} only in the agent loop, which runs with multi_turn.enable=True; without it "
                    f"{getattr(rollout.multi_turn, name)} would be ignored",
                )
            )
    problems += v1_problems(cfg)
    buffer = rm.overlong_buffer
    max_len = cfg.data.max_response_length
    if buffer.enable and not 0 < buffer.len <= max_len:
        problems.append(
            Finding(
                (rm.key("overlong_buffer.len"),),
                f"{buffer.len} must be in 1..{cfg.data.key('max_response_length')} ({max_len})",
            )
        )
    return problems


def v1_problems(cfg: FulcrumConfig) -> list[Finding]:
    """trainer.v1.*: colocate_async runs partial rollouts of the native engine for single-turn GRPO-style
    steps; what it cannot run is refused here rather than ignored."""
    trainer, rollout, algo = cfg.trainer, cfg.actor_rollout_ref.rollout, cfg.algorithm
    mode = trainer.key("v1.trainer_mode")
    if trainer.v1.trainer_mode != "colocate_async":
        return []
    if not trainer.use_v1:
        return [Finding((mode, trainer.key("use_v1")), "trainer.v1.* takes effect with trainer.use_v1=True")]
    refused = [
        (rollout.name != "native", rollout.key("name"), "needs rollout.name=native (it suspends sequences)"),
        (rollout.multi_turn.enable, rollout.key("multi_turn.enable"), "runs single-turn rollouts only"),
        (algo.filter_groups.enable, algo.key("filter_groups.enable"), "does not run DAPO's dynamic sampling"),
        (algo.adv_estimator == "remax", algo.key("adv_estimator"), "does not run ReMax's greedy baseline"),
        (
            trainer.nnodes * trainer.n_gpus_per_node > 1,
            trainer.key("n_gpus_per_node"),
            "runs on one device (trainer.nnodes * n_gpus_per_node = 1)",
        ),
    ]
    return [Finding((mode, key), f"colocate_async {why}") for bad, key, why in refused if bad]


def recipe_notes(cfg: FulcrumConfig) -> list[Finding]:
    """What a verl user should know: settings that are legal but act differently than they may expect."""
    notes = []
    algo, rm = cfg.algorithm, cfg.reward_model
    if algo.use_pf_ppo and algo.adv_estimator != "gae":
        notes.append(
            Finding(
                (algo.key("use_pf_ppo"), algo.key("adv_estimator")),
                "PF-PPO resamples only after gae (as verl): no effect with this estimator",
            )
        )
    if (
        rm.overlong_buffer.enable or rm.reward_kwargs.get("overlong_buffer_cfg")
    ) and rm.reward_manager != "dapo":
        notes.append(
            Finding(
                (rm.key("overlong_buffer"), rm.key("reward_manager")),
                "the overlong penalty is applied by reward_manager=dapo only",
            )
        )
    rc = algo.rollout_correction
    if rc.bypass_mode and cfg.actor_rollout_ref.actor.policy_loss.loss_mode != "vanilla":
        notes.append(
            Finding(
                (
                    algo.key("rollout_correction.bypass_mode"),
                    cfg.actor_rollout_ref.actor.key("policy_loss.loss_mode"),
                ),
                f"bypass mode replaces the policy loss with its own ({rc.loss_type}), as verl",
            )
        )
    trainer = cfg.trainer
    if partial_rollouts_on(trainer) and not (rc.rollout_is or rc.rollout_rs or rc.bypass_mode):
        notes.append(
            Finding(
                (trainer.key("v1.trainer_mode"), algo.key("rollout_correction")),
                "carried responses were partly sampled by older weights, and without rollout correction the "
                "loss treats them as on-policy: set rollout_correction.rollout_is=token (decoupled weights) "
                "or bypass_mode=True",
                severity="warning",
            )
        )
    if rm.use_reward_loop:
        notes.append(
            Finding(
                (rm.key("use_reward_loop"),),
                f"rewards are scored in this process (sympy, Math-Verify and code in {rm.key('num_workers')} "
                "processes; prime: in a pool of its own); no reward-loop workers",
            )
        )
    return notes
