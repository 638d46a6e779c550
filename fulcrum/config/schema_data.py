# ruff: noqa: RUF009  -- `opt`/`sub` return dataclasses.field(...) objects, not shared default values
"""The `data` section of the key tree (fulcrum.config.schema holds the rest): the prompt files, their
columns and lengths, and the data set's hooks. Same conventions as fulcrum.config.schema."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fulcrum.config.domains import AT_LEAST_0, AT_LEAST_1, SEED
from fulcrum.config.keys import Section, opt, sub


@dataclass
class CustomClsConfig:
    path: str | None = opt(None, "python file defining a custom dataset class")
    name: str | None = opt(None, "name of the dataset class in that file")


@dataclass
class SamplerConfig:
    class_path: str | None = opt(None, "python file defining a custom sampler (curriculum)")
    class_name: str | None = opt(None, "name of the sampler class")


@dataclass
class DatagenConfig:
    path: str | None = opt(None, "python file defining a dynamic data generator")
    name: str | None = opt(None, "name of the generator class")


@dataclass
class DataConfig(Section, path="data"):
    tokenizer: str | None = opt(None, "tokenizer path; null uses actor_rollout_ref.model.path")
    use_shm: bool = opt(False, "copy the model to shared memory before loading (verl; no effect)")
    train_files: Any = opt("~/data/rlhf/gsm8k/train.parquet", "training parquet file(s)")
    val_files: Any = opt("~/data/rlhf/gsm8k/test.parquet", "validation parquet file(s)")
    prompt_key: str = opt("prompt", "parquet column holding the chat-message prompt")
    reward_fn_key: str = opt("data_source", "column used to pick the reward function")
    max_prompt_length: int = opt(512, "longest prompt in tokens (after the chat template)", AT_LEAST_1)
    max_response_length: int = opt(512, "longest generated response in tokens", AT_LEAST_1)
    train_batch_size: int = opt(1024, "prompts per training step (responses = this x rollout.n)", AT_LEAST_1)
    gen_batch_size: int | None = opt(
        None, "DAPO's round size (no effect: a round draws train_batch_size)", AT_LEAST_1
    )
    val_batch_size: int | None = opt(
        None, "deprecated in verl: validation uses the whole set at once", AT_LEAST_1
    )
    return_raw_input_ids: bool = opt(False, "also return prompt ids without chat template (verl)")
    return_raw_chat: bool = opt(False, "raw chat kept with each prompt (always: multi-turn reads it)")
    return_full_prompt: bool = opt(False, "also return the templated prompt text")
    shuffle: bool = opt(True, "shuffle training prompts each epoch")
    seed: int | None = opt(None, "shuffle seed; null uses trainer.seed (verl: 1)", SEED)
    dataloader_num_workers: int = opt(
        8, "data loader worker processes (no effect: prompts are pre-tokenised)", AT_LEAST_0
    )
    validation_shuffle: bool = opt(False, "shuffle validation prompts")
    filter_overlong_prompts: bool = opt(
        True, "drop prompts longer than max_prompt_length (verl: false; fulcrum tokenises all at load anyway)"
    )
    filter_overlong_prompts_workers: int = opt(1, "processes used for filtering (no effect)", AT_LEAST_1)
    truncation: Literal["error", "left", "right", "middle"] = opt(
        "error", "what to do with a prompt over max_prompt_length"
    )
    image_key: str = opt("images", "column with images (multi-modal; not supported)")
    video_key: str = opt("videos", "column with videos (multi-modal; not supported)")
    trust_remote_code: bool = opt(False, "allow the tokenizer's remote code")
    custom_cls: CustomClsConfig = sub(CustomClsConfig, "custom dataset class")
    return_multi_modal_inputs: bool = opt(True, "multi-modal inputs (not supported)")
    sampler: SamplerConfig = sub(SamplerConfig, "custom sampler")
    datagen: DatagenConfig = sub(DatagenConfig, "dynamic data generator")
    apply_chat_template_kwargs: dict[str, Any] = opt({}, "extra kwargs for tokenizer.apply_chat_template")
