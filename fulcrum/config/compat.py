"""Where fulcrum departs from verl's keys: keys accepted without effect, unsupported features, aliases."""

from __future__ import annotations

# The roles whose models FSDP shards (or replicates) with several processes, by their fsdp_config's prefix.
FSDP_ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")


def fsdp_size_note(size: int, world: int) -> str | None:
    """What fulcrum does instead of verl's hybrid sharding, or None. verl's `fsdp_size` of s with
    1 < s < the world size shards over groups of s ranks and replicates across groups (HSDP); fulcrum
    has no hybrid layout and shards over every rank (the same result, less memory, more collectives).
    One process, -1, 1 and sizes of at least the world size (verl: shard over all) need no note."""
    if world <= 1 or size in (-1, 1) or size >= world:
        return None
    return (
        f"hybrid sharding over groups of {size} ranks is not supported: "
        f"fulcrum shards over all {world} ranks (fsdp_size=1 replicates the model instead)"
    )


# Keys verl accepts that fulcrum takes and ignores: no ray, FSDP layout knobs or load balancing, no
# profiler, and options of features fulcrum does not have.
# A key is "without effect" when it equals one of these paths or lies under one. `fulcrum doctor`
# lists the ones a configuration sets to a non-default value. When a part starts acting on a key,
# remove it here (and from docs/configuration.md).
FSDP_LAYOUT_KEYS = (
    "strategy",
    "wrap_policy",
    "offload_policy",
    "forward_prefetch",
    "model_dtype",
)
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
        "data.val_batch_size",
        "data.validation_shuffle",
        "data.reward_fn_key",
        "data.apply_chat_template_kwargs",
        "data.sampler.class_name",
        "data.custom_cls.name",
        "data.datagen.name",
        "actor_rollout_ref.hybrid_engine",
        "actor_rollout_ref.nccl_timeout",
        "actor_rollout_ref.model.use_shm",
        "actor_rollout_ref.model.enable_activation_offload",
        "actor_rollout_ref.model.use_liger",
        "actor_rollout_ref.model.fused_kernel_options",
        "actor_rollout_ref.model.use_fused_kernels",
        "actor_rollout_ref.model.custom_chat_template",
        "actor_rollout_ref.model.trust_remote_code",
        "actor_rollout_ref.model.external_lib",
        "actor_rollout_ref.actor.use_fused_kernels",
        "actor_rollout_ref.actor.entropy_from_logits_with_chunking",
        "actor_rollout_ref.actor.entropy_checkpointing",
        "actor_rollout_ref.actor.checkpoint.save_contents",
        "actor_rollout_ref.actor.optim.total_training_steps",
        "critic.optim.total_training_steps",
        "actor_rollout_ref.actor.optim.override_optimizer_config",
        "actor_rollout_ref.ref.entropy_from_logits_with_chunking",
        "actor_rollout_ref.ref.entropy_checkpointing",
        "actor_rollout_ref.actor.strategy",
        "actor_rollout_ref.actor.checkpoint.async_save",
        "actor_rollout_ref.actor.checkpoint.load_contents",
        "actor_rollout_ref.actor.profiler",
        "actor_rollout_ref.ref.strategy",
        "actor_rollout_ref.ref.profiler",
        "actor_rollout_ref.rollout.mode",
        "actor_rollout_ref.rollout.enable_chunked_prefill",
        # verl's SGLang multi-turn rollout's tokenisation options; its agent loop reads neither
        "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template",
        "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode",
        "actor_rollout_ref.rollout.load_format",
        "actor_rollout_ref.rollout.disable_log_stats",
        "actor_rollout_ref.rollout.over_sample_rate",
        "actor_rollout_ref.rollout.multi_stage_wake_up",
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes",
        "actor_rollout_ref.rollout.skip_rollout",
        "actor_rollout_ref.rollout.skip_dump_dir",
        "actor_rollout_ref.rollout.engine_kwargs.vllm",
        "actor_rollout_ref.rollout.engine_kwargs.sglang",
        "actor_rollout_ref.rollout.agent",
        "actor_rollout_ref.rollout.trace",
        "actor_rollout_ref.rollout.profiler",
        "actor_rollout_ref.rollout.data_parallel_size",
        "actor_rollout_ref.rollout.expert_parallel_size",
        "actor_rollout_ref.rollout.pipeline_model_parallel_size",
        "actor_rollout_ref.actor.use_prefix_grouper",
        "actor_rollout_ref.model.torch_dtype",
        "algorithm.filter_groups.max_inflight_gen_batches",
        "reward_model.use_reward_loop",
        "reward_model.enable_resource_pool",
        "reward_model.n_gpus_per_node",
        "reward_model.nnodes",
        "reward_model.reward_loop_source",
        "reward_model.reward_loop_module_path",
        "reward_model.reward_loop_class_name",
        "reward_model.rollout",
        "reward_model.model.input_tokenizer",
        "reward_model.model.external_lib",
        "reward_model.model.trust_remote_code",
        "reward_model.model.use_shm",
        "reward_model.model.use_remove_padding",
        "reward_model.model.use_fused_kernels",
        "reward_model.model.fsdp_config",
        "data.gen_batch_size",
        "critic.strategy",
        "critic.model.use_shm",
        "critic.model.enable_activation_offload",
        "critic.model.tokenizer_path",
        "critic.model.external_lib",
        "critic.model.trust_remote_code",
        "critic.checkpoint.save_contents",
        "critic.optim.override_optimizer_config",
        "critic.checkpoint.async_save",
        "critic.checkpoint.load_contents",
        "critic.profiler",
        "reward_model.strategy",
        "reward_model.launch_reward_fn_async",
        "reward_model.profiler",
        "reward_model.use_dynamic_bsz",
        "reward_model.forward_max_token_len_per_gpu",
        "reward_model.sandbox_fusion.max_concurrent",
        "reward_model.ulysses_sequence_parallel_size",
        "trainer.balance_batch",
        "trainer.log_val_generations",
        "trainer.rollout_data_dir",
        "trainer.esi_redundant_time",
        "trainer.default_hdfs_dir",
        "trainer.del_local_ckpt_after_load",
        "trainer.ray_wait_register_center_timeout",
        "trainer.use_legacy_worker_impl",
        "global_profiler",
        "ray_kwargs",
        "ray_init",
        # FSDP's layout knobs: one unit per decoder layer (fsdp_size, reshard_after_forward and the
        # offload keys act)
        *(f"{role}.fsdp_config.{key}" for role in FSDP_ROLES for key in FSDP_LAYOUT_KEYS),
    }
)

# Features verl has and fulcrum does not (yet): key -> the only value(s) accepted, and why.
# `validate()` reports any other value as a problem, because the run would silently differ from verl.
UNSUPPORTED: dict[str, tuple[tuple[object, ...], str]] = {
    "reward_model.ulysses_sequence_parallel_size": (
        (1,),
        "Ulysses sequence parallelism is not supported for the reward model (actor, reference and critic have it)",
    ),
    "actor_rollout_ref.rollout.use_fire_sampling": ((False,), "FIRE sampling is not supported"),
    "actor_rollout_ref.actor.optim.optimizer": (("AdamW",), "only AdamW is supported"),
    "critic.optim.optimizer": (("AdamW",), "only AdamW is supported"),
    "actor_rollout_ref.actor.optim.optimizer_impl": (
        ("torch.optim",),
        "only torch.optim's AdamW is supported",
    ),
    "critic.optim.optimizer_impl": (("torch.optim",), "only torch.optim's AdamW is supported"),
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


# verl 0.9's `reward.*` section (its reward loop) -> the key that holds the same setting here (verl's
# older spelling, which it migrates the same way). Longest prefix first; the rest of the key follows.
REWARD_SECTION: tuple[tuple[str, str], ...] = (
    ("reward.custom_reward_function", "custom_reward_function"),
    ("reward.compute_score_kwargs", "reward_model.compute_score_kwargs"),
    ("reward.reward_kwargs", "reward_model.reward_kwargs"),
    ("reward.num_workers", "reward_model.num_workers"),
    ("reward.sandbox_fusion", "reward_model.sandbox_fusion"),
    ("reward.reward_manager.name", "reward_model.reward_manager"),
    ("reward.reward_model.model_path", "reward_model.model.path"),
    ("reward.reward_model.enable_resource_pool", "reward_model.enable_resource_pool"),
    ("reward.reward_model.enable", "reward_model.enable"),
    ("reward.reward_model.n_gpus_per_node", "reward_model.n_gpus_per_node"),
    ("reward.reward_model.nnodes", "reward_model.nnodes"),
    ("reward.reward_model.rollout", "reward_model.rollout"),
)
# reward.* keys accepted only at verl's default (a reward manager class loaded by importlib).
REWARD_SECTION_DEFAULTS: dict[str, tuple[object, ...]] = {
    "reward.reward_manager.source": ("register",),
    "reward.reward_manager.module.path": (None, "null", ""),
    "reward.reward_manager.module.name": ("custom_reward_manager",),
}


def reward_section_key(key: str, value: str) -> str | None:
    """The key a verl 0.9 `reward.*` key sets here; None when it is accepted at verl's default and
    changes nothing. ValueError naming the key for one that has no counterpart."""
    for new, old in REWARD_SECTION:
        if key == new or key.startswith(new + "."):
            return old + key[len(new) :]
    if key in REWARD_SECTION_DEFAULTS:
        if value.strip("'\"") in REWARD_SECTION_DEFAULTS[key]:
            return None
        raise ValueError(
            f"{key}={value}: reward managers load by name here; register yours with "
            "@fulcrum.reward.managers.register_reward_manager in custom_reward_function.path and set "
            "reward.reward_manager.name"
        )
    known = ", ".join(sorted({k for k, _ in REWARD_SECTION} | set(REWARD_SECTION_DEFAULTS)))
    raise ValueError(f"{key}: not a reward key fulcrum knows; the reward.* keys are {known}")
