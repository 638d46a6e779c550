# ruff: noqa: RUF009  -- `opt`/`sub` return dataclasses.field(...) objects, not shared default values
"""The key tree of a fulcrum run: typed dataclasses whose attribute paths are verl's keys.

One place defines each key: the dataclass field, its default (verl's `ppo_trainer.yaml` unless the
comment says otherwise), a one-line `help` for `fulcrum doctor --keys` and, for a number, its domain
(the values it accepts, fulcrum.config.domains; `validate` refuses any other). Over 400 lines for that
reason: one definition per key of verl's tree (~300 keys); splitting would scatter one table.
`fulcrum.config.loader` makes OmegaConf structured configs of these classes, so each type is one
OmegaConf holds (`Any` where verl takes a path or a list); a `None` default that "follows" another
key is filled when resolved (`DERIVED`, like verl's `${oc.select:...}`). `dict[str, Any]` fields
are free-form: any sub-key may be set (`+reward_model.reward_kwargs.x=1`). The `algorithm` section,
verl's recipe groups and `actor.policy_loss` are in fulcrum.config.schema_recipes,
`actor_rollout_ref.rollout` in fulcrum.config.schema_rollout and `data` in fulcrum.config.schema_data, to
keep this file under 500 lines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from fulcrum.config.domains import (
    ABOVE_0,
    ANY_NUMBER,
    AT_LEAST_0,
    AT_LEAST_1,
    FRACTION,
    OFF_OR_COUNT,
    SEED,
    SIZE_OR_AUTO,
    Domain,
)
from fulcrum.config.keys import Section, opt, sub
from fulcrum.config.schema_data import DataConfig
from fulcrum.config.schema_recipes import AlgorithmConfig, OverlongBufferConfig, PolicyLossConfig
from fulcrum.config.schema_recipes import KLControlConfig as KLControlConfig  # re-exported
from fulcrum.config.schema_rollout import RolloutConfig
from fulcrum.config.schema_v1 import V1Config


# ---------------------------------------------------------------------------- actor_rollout_ref
@dataclass
class ModelConfig(Section, path="actor_rollout_ref.model"):
    path: str = opt("~/models/deepseek-llm-7b-chat", "Hugging Face model folder or hub name of the policy")
    custom_chat_template: str | None = opt(None, "jinja chat template replacing the tokenizer's")
    use_shm: bool = opt(False, "copy the model to shared memory before loading (no effect)")
    external_lib: str | None = opt(None, "python module to import before loading (registers custom models)")
    override_config: dict[str, Any] = opt({}, "overrides applied to the model's config.json")
    enable_gradient_checkpointing: bool = opt(True, "recompute activations in backward to save memory")
    enable_activation_offload: bool = opt(False, "offload activations to CPU (no effect)")
    use_remove_padding: bool = opt(True, "pack sequences without padding (as verl's HFModelConfig)")
    lora_rank: int = opt(
        0, "LoRA rank: >0 trains peft LoRA adapters on a frozen base; 0 trains all weights", AT_LEAST_0
    )
    lora_alpha: int = opt(
        16, "LoRA alpha: the adapters' update is scaled by lora_alpha / lora_rank", AT_LEAST_1
    )
    target_modules: Any = opt(
        "all-linear", "modules given adapters: all-linear (every Linear but lm_head), or a list of names"
    )
    exclude_modules: Any = opt(None, "module names (or a regex) kept without adapters")
    lora_adapter_path: str | None = opt(
        None, "a PEFT adapter folder to start from (turns LoRA on; its own rank, alpha and modules)"
    )
    use_liger: bool = opt(False, "use Liger kernels (no effect)")
    use_fused_kernels: bool = opt(False, "use fused log-prob kernels")
    lm_head_fp32: bool = opt(False, "float32 LM-head logits, engine and actor/ref log-probs alike (ours)")
    fused_kernel_options: dict[str, Any] = opt({"impl_backend": "torch"}, "options for fused kernels")
    trust_remote_code: bool = opt(False, "allow the model's remote code")
    torch_dtype: str | None = opt(None, "dtype the model is loaded in (no effect: fp32 master weights)")


@dataclass
class CheckpointConfig:
    save_contents: list[str] = opt(["model", "optimizer", "extra"], "what a checkpoint holds")
    load_contents: list[str] | None = opt(None, "what resume loads; null follows save_contents")
    async_save: bool = opt(False, "save in the background (no effect)")


@dataclass
class OptimConfig:
    lr: float = opt(1e-6, "peak learning rate", AT_LEAST_0)
    lr_warmup_steps_ratio: float = opt(
        0.0, "warm-up steps as a fraction of total steps (if lr_warmup_steps<=0)", FRACTION
    )
    total_training_steps: int = opt(
        -1,
        "verl's trainer writes its step count here (no effect: the schedule spans the run's steps)",
        ANY_NUMBER,
    )
    weight_decay: float = opt(0.01, "AdamW weight decay", AT_LEAST_0)
    lr_warmup_steps: int | None = opt(
        -1, "warm-up steps; null, 0 or negative use lr_warmup_steps_ratio", ANY_NUMBER
    )
    lr_scheduler_type: Literal["constant", "cosine"] = opt("constant", "LR schedule after warm-up")
    warmup_style: Literal["constant", "cosine"] | None = opt(
        None, "older verl name of lr_scheduler_type; when set it wins"
    )
    min_lr_ratio: float | None = opt(0.0, "cosine schedule floor as a fraction of lr", FRACTION)
    num_cycles: float = opt(0.5, "cosine cycles over the schedule", AT_LEAST_0)
    betas: list[float] = opt([0.9, 0.999], "AdamW betas", Domain(0, 1, high_open=True))
    clip_grad: float | None = opt(None, "older name of the role's grad_clip; when set it wins", ABOVE_0)
    optimizer: str = opt("AdamW", "optimizer class name (AdamW only)")
    optimizer_impl: str = opt("torch.optim", "module holding the optimizer class")
    override_optimizer_config: dict[str, Any] | None = opt(None, "extra optimizer kwargs")


@dataclass
class FSDPConfig:
    strategy: str = opt("fsdp", "fsdp or fsdp2 (several processes use FSDP2 either way)")
    wrap_policy: dict[str, Any] = opt({"min_num_params": 0}, "FSDP wrap policy (no effect)")
    param_offload: bool = opt(
        False, "keep the FSDP shards and the optimiser step on the CPU (several processes)"
    )
    optimizer_offload: bool = opt(False, "optimiser state on the CPU between updates (several processes)")
    offload_policy: bool = opt(False, "FSDP2 CPU offload policy (no effect)")
    reshard_after_forward: bool = opt(
        True,
        "free each layer's gathered weights after its forward (several processes); false: keep them to the backward",
    )
    fsdp_size: int = opt(
        -1,
        "several processes: 1 replicates the model, the world size shards it, -1 chooses by its size",
        SIZE_OR_AUTO,
    )
    forward_prefetch: bool = opt(False, "FSDP forward prefetch (no effect)")
    model_dtype: str | None = opt(
        None, "dtype the trained weights are kept in; null: fp32 (verl: fp32 actor)"
    )


@dataclass
class ActorConfig(Section, path="actor_rollout_ref.actor"):
    strategy: Literal["fsdp", "fsdp2"] = opt(
        "fsdp", "data-parallel strategy (fsdp and fsdp2 mean the same here)"
    )
    ppo_mini_batch_size: int = opt(256, "prompts per optimiser step (x rollout.n responses)", AT_LEAST_1)
    ppo_micro_batch_size: int | None = opt(
        None, "deprecated global micro batch; use ppo_micro_batch_size_per_gpu", AT_LEAST_1
    )
    ppo_micro_batch_size_per_gpu: int | None = opt(
        None, "responses per forward/backward per device", AT_LEAST_1
    )
    use_dynamic_bsz: bool = opt(False, "pack micro-batches by token count instead of a fixed size")
    ppo_max_token_len_per_gpu: int = opt(
        16384, "token budget per micro-batch with use_dynamic_bsz", AT_LEAST_1
    )
    clip_ratio: float = opt(0.2, "PPO clip epsilon", ABOVE_0)
    clip_ratio_low: float | None = opt(0.2, "lower clip epsilon; null follows clip_ratio", ABOVE_0)
    clip_ratio_high: float | None = opt(0.2, "upper clip epsilon; null follows clip_ratio", ABOVE_0)
    policy_loss: PolicyLossConfig = sub(PolicyLossConfig, "policy loss variant")
    clip_ratio_c: float = opt(
        3.0,
        "dual-clip constant C (clips when advantage < 0); dppo_tv/dppo_kl truncate the ratio at C",
        Domain(1, low_open=True),
    )
    loss_agg_mode: str = opt(
        "token-mean",
        "how token losses are averaged: token-mean, seq-mean-token-sum, seq-mean-token-mean, ...",
    )
    entropy_coeff: float = opt(0.0, "entropy bonus coefficient", AT_LEAST_0)
    use_kl_loss: bool = opt(False, "add KL(actor||ref) to the loss (GRPO style)")
    use_torch_compile: bool = opt(True, "torch.compile the packed decoder layers (CUDA)")
    inductor_cpp_wrapper: bool = opt(True, "inductor's C++ wrapper for compiled passes (all models; ours)")
    cuda_graphs: bool = opt(
        True, "micro-batches as CUDA graphs (one process on CUDA, packed, no LoRA or Ulysses; ours)"
    )
    kl_loss_coef: float = opt(0.001, "coefficient of the KL loss", AT_LEAST_0)
    kl_loss_type: str = opt(
        "low_var_kl",
        "KL estimator of the loss: kl (k1), abs, mse (k2), low_var_kl (k3), full; +: k2 gradient",
    )
    ppo_epochs: int = opt(1, "passes over each batch", AT_LEAST_1)
    shuffle: bool = opt(False, "shuffle mini-batches across PPO epochs")
    checkpoint: CheckpointConfig = sub(CheckpointConfig, "checkpoint contents")
    optim: OptimConfig = sub(OptimConfig, "optimiser and LR schedule")
    grad_clip: float = opt(1.0, "max global gradient norm", ABOVE_0)
    ulysses_sequence_parallel_size: int = opt(
        1, "ranks that split each micro-batch's tokens (Ulysses; packed path)", AT_LEAST_1
    )
    entropy_from_logits_with_chunking: bool = opt(False, "compute entropy in chunks to save memory")
    entropy_checkpointing: bool = opt(False, "recompute entropy in backward")
    fsdp_config: FSDPConfig = sub(FSDPConfig, "FSDP settings")
    use_remove_padding: bool | None = opt(None, "null follows actor_rollout_ref.model.use_remove_padding")
    use_fused_kernels: bool | None = opt(None, "null follows actor_rollout_ref.model.use_fused_kernels")
    profiler: dict[str, Any] = opt({}, "profiler settings (no effect)")
    tau_pos: float = opt(1.0, "SAPO gate temperature where the advantage is positive", ABOVE_0)
    tau_neg: float = opt(1.05, "SAPO gate temperature where the advantage is not positive", ABOVE_0)
    calculate_sum_pi_squared: bool = opt(False, "compute sum_v pi_v^2 per token (optimal_token_baseline)")
    use_prefix_grouper: bool = opt(False, "share prompt prefixes across a group's forwards (no effect)")


@dataclass
class RefConfig(Section, path="actor_rollout_ref.ref"):
    strategy: str | None = opt(None, "null follows actor.strategy")
    use_torch_compile: bool | None = opt(None, "null follows actor.use_torch_compile")
    cuda_graphs: bool | None = opt(None, "null follows actor.cuda_graphs (ours)")
    log_prob_micro_batch_size: int | None = opt(
        None, "deprecated; use log_prob_micro_batch_size_per_gpu", AT_LEAST_1
    )
    log_prob_micro_batch_size_per_gpu: int | None = opt(
        None, "responses per reference forward per device", AT_LEAST_1
    )
    log_prob_use_dynamic_bsz: bool | None = opt(None, "null follows actor.use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int | None = opt(
        None, "null follows actor.ppo_max_token_len_per_gpu", AT_LEAST_1
    )
    fsdp_config: FSDPConfig = sub(FSDPConfig, "FSDP settings")
    ulysses_sequence_parallel_size: int | None = opt(
        None, "null follows actor.ulysses_sequence_parallel_size", AT_LEAST_1
    )
    entropy_from_logits_with_chunking: bool = opt(False, "compute entropy in chunks")
    entropy_checkpointing: bool = opt(False, "recompute entropy in backward")
    model: dict[str, Any] | None = opt(
        None, "a different reference model (null: the actor's initial weights)"
    )
    profiler: dict[str, Any] = opt({}, "profiler settings (no effect)")


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = opt(True, "actor, reference and rollout share devices (always true here)")
    nccl_timeout: int = opt(600, "collective timeout in seconds", AT_LEAST_1)
    model: ModelConfig = sub(ModelConfig, "the policy model")
    actor: ActorConfig = sub(ActorConfig, "policy training")
    ref: RefConfig = sub(RefConfig, "reference policy")
    rollout: RolloutConfig = sub(RolloutConfig, "generation")


# -------------------------------------------------------------------------------------- critic
@dataclass
class CriticModelConfig(Section, path="critic.model"):
    path: str = opt("~/models/deepseek-llm-7b-chat", "critic's initial model (a value head is added)")
    tokenizer_path: str | None = opt(None, "null follows actor_rollout_ref.model.path")
    override_config: dict[str, Any] = opt({}, "overrides applied to the model's config.json")
    external_lib: str | None = opt(None, "null follows actor_rollout_ref.model.external_lib")
    trust_remote_code: bool | None = opt(None, "null follows actor_rollout_ref.model.trust_remote_code")
    use_shm: bool = opt(False, "shared-memory loading (no effect)")
    enable_gradient_checkpointing: bool = opt(True, "recompute activations in backward")
    enable_activation_offload: bool = opt(False, "offload activations (no effect)")
    use_remove_padding: bool = opt(True, "pack sequences without padding (as verl's HFModelConfig)")
    fsdp_config: FSDPConfig = sub(FSDPConfig, "FSDP settings")
    lora_rank: int = opt(0, "LoRA rank of the critic's backbone (its value head trains whole)", AT_LEAST_0)
    lora_alpha: int = opt(16, "LoRA alpha of the critic's adapters", AT_LEAST_1)
    target_modules: Any = opt("all-linear", "modules of the critic's backbone given adapters")


def _critic_optim() -> OptimConfig:
    return OptimConfig(lr=1e-5, min_lr_ratio=None)


@dataclass
class CriticConfig(Section, path="critic"):
    enable: bool | None = opt(None, "null: use a critic when algorithm.adv_estimator is gae")
    strategy: Literal["fsdp", "fsdp2"] = opt("fsdp", "data-parallel strategy")
    rollout_n: int | None = opt(None, "null follows actor_rollout_ref.rollout.n", AT_LEAST_1)
    optim: OptimConfig = field(
        default_factory=_critic_optim,
        metadata={"help": "critic optimiser (verl: lr 1e-5, min_lr_ratio null)"},
    )
    model: CriticModelConfig = sub(CriticModelConfig, "critic model")
    ppo_mini_batch_size: int | None = opt(None, "null follows actor.ppo_mini_batch_size", AT_LEAST_1)
    ppo_micro_batch_size: int | None = opt(None, "deprecated; use ppo_micro_batch_size_per_gpu", AT_LEAST_1)
    ppo_micro_batch_size_per_gpu: int | None = opt(
        None, "responses per critic forward/backward per device", AT_LEAST_1
    )
    forward_micro_batch_size: int | None = opt(
        None, "deprecated; use forward_micro_batch_size_per_gpu", AT_LEAST_1
    )
    forward_micro_batch_size_per_gpu: int | None = opt(
        None, "null follows ppo_micro_batch_size_per_gpu", AT_LEAST_1
    )
    use_dynamic_bsz: bool | None = opt(None, "null follows actor.use_dynamic_bsz")
    ppo_max_token_len_per_gpu: int = opt(
        32768, "token budget per micro-batch with use_dynamic_bsz", AT_LEAST_1
    )
    forward_max_token_len_per_gpu: int | None = opt(
        None, "null follows ppo_max_token_len_per_gpu", AT_LEAST_1
    )
    ppo_epochs: int | None = opt(None, "null follows actor.ppo_epochs", AT_LEAST_1)
    shuffle: bool | None = opt(None, "null follows actor.shuffle")
    grad_clip: float = opt(1.0, "max global gradient norm", ABOVE_0)
    cliprange_value: float = opt(0.5, "value clipping range", ABOVE_0)
    cuda_graphs: bool | None = opt(None, "null follows actor_rollout_ref.actor.cuda_graphs (ours)")
    loss_agg_mode: str | None = opt(None, "null follows actor.loss_agg_mode")
    ulysses_sequence_parallel_size: int = opt(
        1, "ranks that split each micro-batch's tokens (Ulysses; packed path)", AT_LEAST_1
    )
    checkpoint: CheckpointConfig = sub(CheckpointConfig, "checkpoint contents")
    profiler: dict[str, Any] = opt({}, "profiler settings (no effect)")


# -------------------------------------------------------------------------------- reward_model
@dataclass
class RewardModelModelConfig:
    input_tokenizer: str | None = opt(None, "null follows actor_rollout_ref.model.path (no effect: see docs)")
    path: str = opt("~/models/FsfairX-LLaMA3-RM-v0.1", "reward model: a classifier with one label")
    external_lib: str | None = opt(None, "python module to import first")
    trust_remote_code: bool = opt(False, "allow remote code")
    use_shm: bool = opt(False, "shared-memory loading (no effect)")
    use_remove_padding: bool = opt(False, "pack sequences")
    use_fused_kernels: bool = opt(False, "fused kernels")
    fsdp_config: FSDPConfig = sub(FSDPConfig, "FSDP settings")


@dataclass
class SandboxFusionConfig:
    url: str | None = opt(
        None,
        "SandboxFusion service URL: code rewards run there (the same harness and scores) instead of in the "
        "local jail",
    )
    max_concurrent: int = opt(64, "concurrent sandbox requests", AT_LEAST_1)
    memory_limit_mb: int = opt(1024, "sandbox memory limit", AT_LEAST_1)


@dataclass
class RewardModelConfig(Section, path="reward_model"):
    enable: bool = opt(False, "score responses with reward_model.model.path (at the last token)")
    strategy: str = opt("fsdp", "strategy of the reward model")
    model: RewardModelModelConfig = sub(RewardModelModelConfig, "reward model")
    micro_batch_size: int | None = opt(None, "deprecated; use micro_batch_size_per_gpu", AT_LEAST_1)
    micro_batch_size_per_gpu: int | None = opt(None, "responses per reward-model forward", AT_LEAST_1)
    max_length: int | None = opt(
        None, "longest reward-model input in tokens (cut from the right)", AT_LEAST_1
    )
    use_dynamic_bsz: bool | None = opt(None, "null follows critic.use_dynamic_bsz")
    forward_max_token_len_per_gpu: int | None = opt(
        None, "null follows critic.forward_max_token_len_per_gpu", AT_LEAST_1
    )
    reward_manager: str = opt("naive", "naive, dapo (overlong penalty), batch, prime, or a registered name")
    overlong_buffer: OverlongBufferConfig = sub(OverlongBufferConfig, "DAPO soft overlong penalty")
    num_workers: int | None = opt(
        None, "scoring processes (sympy, Math-Verify, code); null: cores, <= 8", AT_LEAST_1
    )
    sample_timeout_s: float = opt(
        30.0, "seconds per such sample; then 0, in reward/num_timeouts (ours)", ABOVE_0
    )
    compute_score_kwargs: dict[str, Any] = opt({}, "built-in scorers' options: method (GSM8K), math_verify")
    use_reward_loop: bool = opt(False, "verl's asynchronous reward loop (no effect: scored in-process)")
    enable_resource_pool: bool = opt(False, "separate GPUs for the reward model (no effect)")
    n_gpus_per_node: int | None = opt(None, "reward-model pool devices (no effect)", AT_LEAST_1)
    nnodes: int | None = opt(None, "reward-model pool nodes (no effect)", AT_LEAST_1)
    reward_loop_source: str | None = opt(None, "reward-loop class source (no effect)")
    reward_loop_module_path: str | None = opt(None, "reward-loop module path (no effect)")
    reward_loop_class_name: str | None = opt(None, "reward-loop class name (no effect)")
    rollout: dict[str, Any] = opt({}, "generative reward model's engine (no effect)")
    on_error: str = opt(
        "raise",
        "a reward function that raises: raise (stop, naming the sample) or zero (score 0, count in "
        "reward/num_errors) (fulcrum)",
    )
    timeout_s: float | None = opt(
        600.0,
        "seconds the reward function may take to score one batch; past it, handled by on_error; null: "
        "no limit (fulcrum)",
        ABOVE_0,
    )
    launch_reward_fn_async: bool = opt(False, "score in a background process (no effect)")
    sandbox_fusion: SandboxFusionConfig = sub(SandboxFusionConfig, "code sandbox")
    reward_kwargs: dict[str, Any] = opt(
        {}, "manager options (dapo: overlong_buffer_cfg, max_resp_len; batch)"
    )
    ulysses_sequence_parallel_size: int = opt(1, "sequence parallel size", AT_LEAST_1)
    profiler: dict[str, Any] = opt({}, "profiler settings (no effect)")


@dataclass
class CustomRewardFunctionConfig(Section, path="custom_reward_function"):
    path: str | None = opt(None, "python file with a custom reward function")
    name: str = opt("compute_score", "function name in that file")
    reward_kwargs: dict[str, Any] = opt({}, "extra kwargs passed to the custom function")


# ------------------------------------------------------------------------------------- trainer
@dataclass
class TrainerConfig(Section, path="trainer"):
    balance_batch: bool = opt(True, "reorder responses so devices get equal token counts")
    total_epochs: int = opt(30, "passes over the training data", AT_LEAST_1)
    total_training_steps: int | None = opt(
        None, "stop after this many steps (null: epochs decide)", AT_LEAST_1
    )
    wall_clock_budget_s: float | None = opt(
        None,
        "end the run, last validation and checkpoint included, within this many seconds of its start; "
        "null: no limit (ours)",
        ABOVE_0,
    )
    project_name: str = opt("verl_examples", "project name (loggers, run directory)")
    experiment_name: str = opt("gsm8k", "experiment name (loggers, run directory)")
    logger: list[str] = opt(
        ["console"], "loggers: console, tensorboard, wandb, jsonl (verl: [console, wandb])"
    )
    log_val_generations: int = opt(0, "validation generations to log per validation", AT_LEAST_0)
    rollout_data_dir: str | None = opt(None, "dump training rollouts as jsonl here")
    validation_data_dir: str | None = opt(None, "dump validation generations as jsonl here")
    nnodes: int = opt(1, "machines (each starts its processes with torchrun --nnodes)", AT_LEAST_1)
    n_gpus_per_node: int = opt(8, "devices per machine", AT_LEAST_1)
    save_freq: int = opt(-1, "checkpoint every N steps; -1 never (except the last step)", OFF_OR_COUNT)
    esi_redundant_time: int = opt(0, "expiry margin for elastic instances (no effect)", AT_LEAST_0)
    resume_mode: Literal["auto", "disable", "resume_path"] = opt("auto", "auto, disable or resume_path")
    resume_from_path: str | None = opt(None, "checkpoint folder for resume_mode=resume_path")
    val_before_train: bool = opt(True, "validate before the first step")
    val_only: bool = opt(False, "validate and exit")
    test_freq: int = opt(-1, "validate every N steps; -1 never", OFF_OR_COUNT)
    critic_warmup: int = opt(0, "steps that train only the critic", AT_LEAST_0)
    default_hdfs_dir: str | None = opt(None, "HDFS copy of checkpoints (no effect)")
    del_local_ckpt_after_load: bool = opt(False, "delete local checkpoint after loading (no effect)")
    default_local_dir: str | None = opt(
        None, "run directory; null: checkpoints/{project_name}/{experiment_name}"
    )
    max_actor_ckpt_to_keep: int | None = opt(None, "keep only the newest N actor checkpoints", OFF_OR_COUNT)
    max_critic_ckpt_to_keep: int | None = opt(None, "keep only the newest N critic checkpoints", OFF_OR_COUNT)
    ray_wait_register_center_timeout: int = opt(300, "ray timeout (no effect: no ray)", AT_LEAST_0)
    device: Literal["auto", "cpu", "cuda"] = opt(
        "auto", "cpu runs everything on the CPU; auto and cuda use the CUDA devices asked for (verl: cuda)"
    )
    use_legacy_worker_impl: str = opt("auto", "verl worker implementation switch (no effect)")
    seed: int = opt(1, "seed for model init, sampling and data order (ours)", SEED)
    save_on_interrupt: bool = opt(True, "write a checkpoint on Ctrl-C / SIGTERM (ours)")
    save_in_background: bool = opt(
        True,
        "the step waits only for a host copy of the state; serialising, hashing and fsync run beside "
        "training (host RAM: one checkpoint's size) (ours)",
    )
    park_optimizer_state: bool = opt(
        True, "one process on CUDA: AdamW state of the model not training waits in host memory (ours)"
    )
    max_nan_steps: int = opt(
        3, "stop after this many consecutive steps with a NaN/inf loss (ours)", AT_LEAST_1
    )
    overwrite_run: bool = opt(
        False, "start afresh where another run is: move it into old_runs/<time>/ (never deleted) (ours)"
    )
    accept_config_changes: bool = opt(
        False, "resume although keys that change what or how the run trains differ (ours)"
    )
    use_v1: bool = opt(False, "verl's V1 trainer: trainer.v1.* takes effect")
    v1: V1Config = sub(V1Config, "V1 trainer: mode, partial rollouts, staleness bound")


# ------------------------------------------------------------------------------------------ root
@dataclass
class FulcrumConfig:
    data: DataConfig = sub(DataConfig, "prompt data")
    actor_rollout_ref: ActorRolloutRefConfig = sub(ActorRolloutRefConfig, "policy, reference and rollout")
    critic: CriticConfig = sub(CriticConfig, "value model")
    reward_model: RewardModelConfig = sub(RewardModelConfig, "reward")
    custom_reward_function: CustomRewardFunctionConfig = sub(
        CustomRewardFunctionConfig, "custom reward function"
    )
    algorithm: AlgorithmConfig = sub(AlgorithmConfig, "advantage estimation and KL")
    trainer: TrainerConfig = sub(TrainerConfig, "the training loop")
    global_profiler: dict[str, Any] = opt({}, "verl's profiler settings (no effect)")
    ray_kwargs: dict[str, Any] = opt({}, "verl's ray settings (no effect: no ray)")
    ray_init: dict[str, Any] = opt({}, "older verl's ray settings (no effect: no ray)")
