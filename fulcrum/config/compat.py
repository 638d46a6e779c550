"""Where fulcrum departs from verl's keys: keys accepted without effect, unsupported features, aliases."""

from __future__ import annotations

# Keys verl accepts that fulcrum takes and ignores (one process, no ray/FSDP sharding, no profiler).
# A key is "without effect" when it equals one of these paths or lies under one. `fulcrum doctor`
# lists the ones a configuration sets to a non-default value.
NO_EFFECT_KEYS: frozenset[str] = frozenset(
    {
        "data.use_shm",
        "data.dataloader_num_workers",
        "data.filter_overlong_prompts_workers",
        "data.return_raw_input_ids",
        "data.return_full_prompt",
        "data.return_multi_modal_inputs",
        "data.image_key",
        "data.video_key",
        "actor_rollout_ref.hybrid_engine",
        "actor_rollout_ref.nccl_timeout",
        "actor_rollout_ref.model.use_shm",
        "actor_rollout_ref.model.enable_activation_offload",
        "actor_rollout_ref.model.use_liger",
        "actor_rollout_ref.model.fused_kernel_options",
        "actor_rollout_ref.actor.strategy",
        "actor_rollout_ref.actor.use_torch_compile",
        "actor_rollout_ref.actor.fsdp_config",
        "actor_rollout_ref.actor.checkpoint.async_save",
        "actor_rollout_ref.actor.checkpoint.load_contents",
        "actor_rollout_ref.actor.profiler",
        "actor_rollout_ref.actor.optim.optimizer_impl",
        "actor_rollout_ref.ref.strategy",
        "actor_rollout_ref.ref.use_torch_compile",
        "actor_rollout_ref.ref.fsdp_config",
        "actor_rollout_ref.ref.profiler",
        "actor_rollout_ref.rollout.mode",
        "actor_rollout_ref.rollout.load_format",
        "actor_rollout_ref.rollout.layered_summon",
        "actor_rollout_ref.rollout.disable_log_stats",
        "actor_rollout_ref.rollout.over_sample_rate",
        "actor_rollout_ref.rollout.multi_stage_wake_up",
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes",
        "actor_rollout_ref.rollout.skip_rollout",
        "actor_rollout_ref.rollout.skip_dump_dir",
        "actor_rollout_ref.rollout.engine_kwargs",
        "actor_rollout_ref.rollout.agent",
        "actor_rollout_ref.rollout.trace",
        "actor_rollout_ref.rollout.profiler",
        "critic.strategy",
        "critic.model.use_shm",
        "critic.model.enable_activation_offload",
        "critic.model.fsdp_config",
        "critic.checkpoint.async_save",
        "critic.checkpoint.load_contents",
        "critic.profiler",
        "critic.optim.optimizer_impl",
        "reward_model.strategy",
        "reward_model.launch_reward_fn_async",
        "reward_model.profiler",
        "reward_model.model.use_shm",
        "reward_model.model.fsdp_config",
        "trainer.esi_redundant_time",
        "trainer.default_hdfs_dir",
        "trainer.del_local_ckpt_after_load",
        "trainer.ray_wait_register_center_timeout",
        "trainer.use_legacy_worker_impl",
        "global_profiler",
        "ray_kwargs",
        "ray_init",
    }
)

# Features verl has and fulcrum does not (yet): key -> the only value(s) accepted, and why.
# `validate()` reports any other value as a problem, because the run would silently differ from verl.
UNSUPPORTED: dict[str, tuple[tuple[object, ...], str]] = {
    "trainer.nnodes": ((1,), "multi-node training is not supported"),
    "actor_rollout_ref.model.lora_rank": ((0,), "LoRA is not supported yet"),
    "critic.model.lora_rank": ((0,), "LoRA is not supported yet"),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": ((1,), "sequence parallelism is not supported"),
    "critic.ulysses_sequence_parallel_size": ((1,), "sequence parallelism is not supported"),
    "actor_rollout_ref.rollout.multi_turn.enable": ((False,), "multi-turn rollouts are not supported"),
    "reward_model.enable": (
        (False,),
        "model-based rewards are not supported yet; use a rule-based or custom reward",
    ),
    "reward_model.reward_manager": (("naive",), "only the naive reward manager exists"),
    "data.custom_cls.path": ((None,), "custom dataset classes are not supported"),
    "data.sampler.class_path": ((None,), "custom samplers are not supported"),
    "data.datagen.path": ((None,), "dynamic data generation is not supported"),
}

# verl rollout backends that fulcrum replaces with its own default backend (one log line says so).
ROLLOUT_NAME_ALIASES: dict[str, str] = {"vllm": "native", "sglang": "native"}


def is_no_effect(key: str) -> bool:
    """True when `key` (a full dotted path) is, or lies under, a key accepted without effect."""
    parts = key.split(".")
    return any(".".join(parts[:i]) in NO_EFFECT_KEYS for i in range(1, len(parts) + 1))
