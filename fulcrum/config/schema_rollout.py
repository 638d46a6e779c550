# ruff: noqa: RUF009  -- `opt`/`sub` return dataclasses.field(...) objects, not shared default values
"""The `actor_rollout_ref.rollout` section of the key tree (fulcrum.config.schema holds the rest): the
generation backend, its sampling, engine sizes and validation sampling. Same conventions as
fulcrum.config.schema."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fulcrum.config.domains import ABOVE_0, AT_LEAST_0, AT_LEAST_1, OFF_OR_COUNT, SEED, SHARE
from fulcrum.config.keys import Section, opt, sub


@dataclass
class SamplingConfig:
    n: int = opt(1, "responses per validation prompt", AT_LEAST_1)
    do_sample: bool = opt(False, "sample (true) or greedy (false) at validation")
    temperature: float = opt(0.0, "validation temperature", AT_LEAST_0)
    top_p: float = opt(1.0, "validation nucleus sampling", SHARE)
    top_k: int = opt(-1, "validation top-k; -1 off", OFF_OR_COUNT)


@dataclass
class MultiTurnConfig:
    enable: bool = opt(False, "multi-turn rollouts with tools (the native engine's agent loop)")
    max_assistant_turns: int | None = opt(
        None, "most assistant turns per conversation; null: no limit", AT_LEAST_1
    )
    tool_config_path: str | None = opt(None, "verl's tool-config YAML (docs/multi-turn.md)")
    max_user_turns: int | None = opt(
        None,
        "most user turns (tool answers, interaction replies) per conversation; null: no limit",
        AT_LEAST_1,
    )
    max_parallel_calls: int = opt(1, "calls of one turn that run (at once); the rest are dropped", AT_LEAST_1)
    max_tool_response_length: int = opt(256, "characters of each tool answer", AT_LEAST_1)
    tool_response_truncate_side: str = opt("middle", "what a cut tool answer keeps: left, right or middle")
    interaction_config_path: str | None = opt(
        None, "verl's interaction-config YAML: simulated user turns (docs/multi-turn.md)"
    )
    use_inference_chat_template: bool = opt(False, "SGLang rollout's template choice (no effect)")
    tokenization_sanity_check_mode: str = opt("strict", "SGLang rollout's tokenisation check (no effect)")
    format: str = opt("hermes", "tool-call format: hermes (Qwen's <tool_call> JSON)")
    call_timeout: float = opt(
        60.0,
        "seconds any one call into a tool or an interaction may take (ours); then it is abandoned",
        ABOVE_0,
    )


@dataclass
class RolloutConfig(Section, path="actor_rollout_ref.rollout"):
    name: Literal["native", "hf"] = opt(
        "native", "generation backend: native (ours) or hf; vllm/sglang are mapped to native (verl: vllm)"
    )
    mode: str = opt("async", "verl's sync/async rollout mode (no effect)")
    temperature: float = opt(1.0, "sampling temperature; 0 is greedy", AT_LEAST_0)
    top_k: int = opt(-1, "top-k sampling; -1 off", OFF_OR_COUNT)
    top_p: float = opt(1.0, "nucleus sampling", SHARE)
    prompt_length: int | None = opt(None, "null follows data.max_prompt_length", AT_LEAST_1)
    response_length: int | None = opt(None, "null follows data.max_response_length", AT_LEAST_1)
    dtype: str = opt("bfloat16", "rollout weights dtype")
    gpu_memory_utilization: float = opt(
        0.5, "fraction of device memory the engine may use (weights + KV cache)", SHARE
    )
    ignore_eos: bool = opt(False, "keep generating past EOS")
    enforce_eager: bool = opt(False, "no CUDA graphs for decode")
    cudagraph_capture_sizes: list[int] | None = opt(None, "batch sizes captured as CUDA graphs", AT_LEAST_1)
    free_cache_engine: bool = opt(True, "release the KV cache while training")
    load_format: str = opt("dummy_dtensor", "how the engine first gets weights (no effect: shared in place)")
    layered_summon: bool = opt(False, "LoRA weight sync one module at a time (fulcrum always syncs that way)")
    tensor_model_parallel_size: int = opt(2, "tensor-parallel size of the engine", AT_LEAST_1)
    max_num_batched_tokens: int = opt(8192, "token budget per engine step", AT_LEAST_1)
    max_model_len: int | None = opt(
        None, "engine's longest sequence; null: prompt_length + response_length", AT_LEAST_1
    )
    max_num_seqs: int = opt(1024, "sequences scheduled at once", AT_LEAST_1)
    log_prob_micro_batch_size: int | None = opt(
        None, "deprecated; use log_prob_micro_batch_size_per_gpu", AT_LEAST_1
    )
    log_prob_micro_batch_size_per_gpu: int | None = opt(
        None, "responses per old-log-prob forward per device", AT_LEAST_1
    )
    log_prob_use_dynamic_bsz: bool | None = opt(None, "null follows actor.use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int | None = opt(
        None, "null follows actor.ppo_max_token_len_per_gpu", AT_LEAST_1
    )
    disable_log_stats: bool = opt(True, "silence engine statistics")
    enable_chunked_prefill: bool = opt(True, "split long prefills across engine steps")
    do_sample: bool = opt(True, "sample (true) or greedy (false) in training rollouts")
    use_fire_sampling: bool = opt(
        False, "older verl: FIRE sampling (temperature-scheduled first token); not supported"
    )
    n: int = opt(1, "responses per prompt (GRPO/RLOO need > 1)", AT_LEAST_1)
    over_sample_rate: float = opt(0.0, "over-sampling for partial rollouts (no effect)", AT_LEAST_0)
    multi_stage_wake_up: bool = opt(False, "wake weights and KV cache in stages (no effect)")
    calculate_log_probs: bool = opt(False, "log rollout_corr/*: the engine's vs the trainer's log-probs")
    update_weights_bucket_megabytes: int = opt(512, "weight-sync bucket size (no effect)", AT_LEAST_1)
    skip_rollout: bool = opt(False, "reuse dumped rollouts (no effect)")
    skip_dump_dir: str = opt("/tmp/rollout_dump", "where skipped rollouts live (no effect)")
    engine_kwargs: dict[str, Any] = opt(
        {"vllm": {}, "sglang": {}, "native": {}},
        "backend kwargs; native: the native engine's own options (docs/rollout.md, Knobs; an unknown one is "
        "refused, naming the known ones) (vllm/sglang: no effect)",
    )
    val_kwargs: SamplingConfig = sub(SamplingConfig, "sampling at validation")
    multi_turn: MultiTurnConfig = sub(MultiTurnConfig, "multi-turn rollouts with tools")
    data_parallel_size: int = opt(
        1, "engine data-parallel replicas (no effect: one engine per process)", AT_LEAST_1
    )
    expert_parallel_size: int = opt(1, "engine expert-parallel size (no effect)", AT_LEAST_1)
    pipeline_model_parallel_size: int = opt(1, "engine pipeline-parallel size (no effect)", AT_LEAST_1)
    agent: dict[str, Any] = opt({}, "agent loop settings (no effect)")
    trace: dict[str, Any] = opt({}, "rollout tracing (no effect)")
    profiler: dict[str, Any] = opt({}, "profiler settings (no effect)")
    seed: int | None = opt(None, "sampling seed; null follows trainer.seed (ours)", SEED)
