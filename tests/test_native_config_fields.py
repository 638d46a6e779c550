"""The native engine samples only models it computes exactly: every field of transformers' config class of
each architecture it serves is classified (honoured, harmless, or runs only certain values), and a model
with a field it does not honour is sampled by the `hf` backend, with one line naming the field."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import GSM8K_ROW, seed_command
from transformers import AutoConfig, LlamaConfig, Qwen2Config

from fulcrum.config.schema_rollout import RolloutConfig
from fulcrum.models.arch import SPECS
from fulcrum.rollout import HFRollout, build_rollout
from fulcrum.rollout.native import NATIVE_ARCHITECTURES, NativeEngine, unsupported_reason
from fulcrum.rollout.testing import random_causal_lm
from fulcrum.tools import doctor

CPU = torch.device("cpu")


@pytest.mark.parametrize("model_type", sorted(NATIVE_ARCHITECTURES))
def test_every_field_of_the_config_class_is_classified(model_type: str) -> None:
    """Fails when a transformers release adds a field to a family's config class: classify it first."""
    declared = set(AutoConfig.for_model(model_type).to_dict())
    assert sorted(declared - set(SPECS[model_type].fields)) == []


def test_the_architectures_served_are_the_ones_specified() -> None:
    assert (
        set(SPECS)
        == set(NATIVE_ARCHITECTURES)
        == {
            "gemma3_text",
            "llama",
            "mistral",
            "olmo3",
            "qwen2",
            "qwen3",
            "qwen3_5_text",
            "qwen3_5_moe_text",
            "qwen3_moe",
            "qwen3_next",
            "smollm3",
        }
    )


# SmolLM2-135M-Instruct's config.json (a Llama written by an older transformers, with its own extras).
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536,
    "is_llama_config": True,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pad_token_id": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_interleaved": False,
    "rope_scaling": None,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3",
    "use_cache": True,
    "vocab_size": 49152,
}


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig.from_dict(SMOLLM2),
        LlamaConfig.from_dict({**SMOLLM2, "head_dim": 64, "hidden_act": "swish"}),
        LlamaConfig(
            max_position_embeddings=16384,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        Qwen2Config(rope_theta=1e6, tie_word_embeddings=True),
        # Qwen2.5's own configs: the switch on, but max_window_layers covers every layer
        Qwen2Config(num_hidden_layers=24, use_sliding_window=True, sliding_window=4096, max_window_layers=28),
        # sliding layers from max_window_layers on: each layer's own window in every path
        Qwen2Config(num_hidden_layers=30, use_sliding_window=True, sliding_window=4096, max_window_layers=28),
    ],
    ids=[
        "smollm2",
        "head_dim-swish",
        "llama3-rope",
        "qwen2.5",
        "qwen2-window-unused",
        "qwen2-sliding-layers",
    ],
)
def test_real_checkpoints_keep_the_native_engine(config: object) -> None:
    assert unsupported_reason(config) is None


@pytest.mark.parametrize(
    "config, named",
    [
        (LlamaConfig(hidden_act="gelu"), "hidden_act='gelu' (it runs silu)"),
        (Qwen2Config(hidden_act="relu"), "hidden_act='relu'"),
        (LlamaConfig(mlp_bias=True), "mlp_bias=True"),
        (LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "'rope_type': 'dynamic'"),
        (
            LlamaConfig(
                rope_scaling={
                    "rope_type": "longrope",
                    "short_factor": [1.0] * 64,
                    "long_factor": [2.0] * 64,
                    "original_max_position_embeddings": 1024,
                }
            ),
            "'rope_type': 'longrope'",
        ),
        (
            Qwen2Config(num_hidden_layers=2, layer_types=["full_attention", "chunked_attention"]),
            "chunked_attention",
        ),
    ],
    ids=["gelu", "relu", "mlp_bias", "dynamic-rope", "longrope", "chunked-layers"],
)
def test_a_field_it_does_not_honour_is_named(config: object, named: str) -> None:
    reason = unsupported_reason(config)
    assert reason is not None and named in reason


def test_a_field_the_list_does_not_know_is_refused() -> None:
    """A config class with a field this module has never seen (a newer transformers) is not guessed at."""

    class NewerLlamaConfig(LlamaConfig):
        def __init__(self, new_knob: int = 0, **kwargs: object) -> None:
            self.new_knob = new_knob
            super().__init__(**kwargs)

    assert (
        unsupported_reason(NewerLlamaConfig())
        == "the llama config field(s) ['new_knob'], which it does not know"
    )


def _rollout() -> RolloutConfig:
    return RolloutConfig(name="native", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)


class _Tokenizer:
    eos_token_id = 1
    pad_token_id = 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_gelu_model_is_sampled_by_hf_with_one_line(arch: str, caplog: pytest.LogCaptureFixture) -> None:
    """Before: the native engine sampled a GELU model with SiLU, so rollout and training differed."""
    assert isinstance(build_rollout(_rollout(), random_causal_lm(arch), _Tokenizer(), CPU), NativeEngine)
    gelu = random_causal_lm(arch, hidden_act="gelu")
    with caplog.at_level(logging.WARNING, logger="fulcrum.rollout"):
        engine = build_rollout(_rollout(), gelu, _Tokenizer(), CPU)
    assert isinstance(engine, HFRollout)
    lines = [r.getMessage() for r in caplog.records if "hidden_act" in r.getMessage()]
    assert lines == [
        "rollout: the native engine does not run hidden_act='gelu' (it runs silu); using the hf backend"
    ]


def test_doctor_says_which_field_sends_the_run_to_hf(
    tmp_path: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pq.write_table(pa.Table.from_pylist([GSM8K_ROW] * 512), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist([GSM8K_ROW]), tmp_path / "test.parquet")
    shutil.copytree(tiny_model, tmp_path / "model")
    assert doctor.main(seed_command(tmp_path)) == 0
    assert "native engine does not run" not in capsys.readouterr().out
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    assert doctor.main(seed_command(tmp_path)) == 0  # it runs, on the slower backend
    assert (
        "actor_rollout_ref.rollout.name: the native engine does not run hidden_act='gelu' (it runs silu); "
        "the run samples with the hf backend" in capsys.readouterr().out
    )
