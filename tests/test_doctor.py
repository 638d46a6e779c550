"""`fulcrum doctor`: exit 0 with a summary on a valid configuration, exit 1 naming each problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import GSM8K_ROW as ROW
from helpers import seed_command

from fulcrum.tools import doctor


@pytest.fixture
def files(tmp_path: Path, tiny_model: Path) -> Path:
    """The files the seed command points at: two verl-schema parquet files (a batch of 512 rows for
    training) and a model folder."""
    pq.write_table(pa.Table.from_pylist([ROW] * 512), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist([ROW]), tmp_path / "test.parquet")
    shutil.copytree(tiny_model, tmp_path / "model")
    return tmp_path


def test_seed_command_passes(files, capsys):
    assert doctor.main(seed_command(files)) == 0
    out = capsys.readouterr().out
    assert "can run" in out
    assert "512 prompts x n=1 = 512 responses" in out
    assert "4 mini-batch(es) of 128 prompts (128 responses per device)" in out
    assert "16 micro-batch(es) of 8" in out
    assert "device      cpu" in out


def test_the_summary_says_where_the_old_log_probs_come_from(files, capsys):
    """The seed command's 4 mini-batches need the old-log-prob pass (its micro-batch is named); one
    mini-batch of the whole batch gets them from the update, and the summary says there is no pass."""
    assert doctor.main(seed_command(files)) == 0
    assert "log-prob micro-batch 16" in capsys.readouterr().out
    assert doctor.main([*seed_command(files), "actor_rollout_ref.actor.ppo_mini_batch_size=512"]) == 0
    out = capsys.readouterr().out
    assert "old log-probs from the update" in out and "log-prob micro-batch" not in out


def test_keys_without_effect_are_listed(files, capsys):
    argv = [
        *seed_command(files),
        "actor_rollout_ref.actor.fsdp_config.forward_prefetch=True",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.actor.use_torch_compile=False",  # acts (compiled layers): not listed
    ]
    assert doctor.main(argv) == 0
    out = capsys.readouterr().out
    assert "accepted for compatibility, no effect" in out
    assert "actor_rollout_ref.actor.fsdp_config.forward_prefetch=True" in out
    assert "critic.model.tokenizer_path" not in out  # follows the model path: not set by the user
    assert "use_torch_compile" not in out
    assert "fulcrum has no vllm backend" in out


def test_bad_key_exits_1_with_suggestion(files, capsys):
    assert doctor.main([*seed_command(files), "actor_rollout_ref.actor.ppo_mini_batchsize=64"]) == 1
    assert "did you mean actor_rollout_ref.actor.ppo_mini_batch_size?" in capsys.readouterr().out


def test_missing_files_are_named(files, capsys):
    (files / "test.parquet").unlink()
    (files / "model" / "config.json").unlink()
    assert doctor.main(seed_command(files)) == 1
    out = capsys.readouterr().out
    assert f"data.val_files: {files}/test.parquet does not exist" in out
    assert f"actor_rollout_ref.model.path={files}/model: no config.json" in out
    assert "data.train_files" not in out


def test_batch_rule_and_custom_reward(files, capsys):
    reward = files / "my_reward.py"
    reward.write_text(
        "def other(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    )
    argv = [
        *seed_command(files),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=7",
        f"custom_reward_function.path={reward}",
    ]
    assert doctor.main(argv) == 1
    out = capsys.readouterr().out
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu" in out
    assert "defines no function 'compute_score'" in out


def test_config_file_and_keys_listing(files, capsys, tmp_path):
    from fulcrum.config import load_config, save_config

    path = save_config(load_config(seed_command(files)), tmp_path / "run" / "config.yaml")
    assert doctor.main(["--config", str(path)]) == 0
    assert doctor.main(["--keys"]) == 0
    out = capsys.readouterr().out
    assert "actor_rollout_ref.rollout.response_length = null" in out


def test_parquet_columns_and_context_length(files, capsys):
    pq.write_table(pa.table({"question": ["1 + 1?"], "data_source": ["x"]}), files / "test.parquet")
    (files / "train.parquet").write_bytes(b"not parquet")
    argv = [*seed_command(files), "data.max_prompt_length=2000"]
    assert doctor.main(argv) == 1
    out = capsys.readouterr().out
    assert f"data.train_files: {files}/train.parquet is not a readable parquet file" in out
    assert (
        f"data.val_files: {files}/test.parquet has no column(s) ['prompt', 'reward_model'] (set data.prompt_key)"
        in out
    )
    assert "2256 tokens exceeds actor_rollout_ref.model.path's max_position_embeddings = 2048" in out


def test_native_engine_settings_are_read_as_the_run_reads_them(files, capsys):
    argv = [
        *seed_command(files),
        "actor_rollout_ref.rollout.dtype=bf8",
        "+actor_rollout_ref.rollout.engine_kwargs.native.blok_size=32",
    ]
    assert doctor.main(argv) == 1
    out = capsys.readouterr().out
    assert "actor_rollout_ref.rollout.dtype='bf8'" in out


def test_an_override_config_key_the_model_lacks_is_named_before_the_run(files, capsys):
    """A typo in override_config would stop the run at load: doctor names it first, with the closest
    field; a real field (and the loader's attn_implementation) passes."""
    typo = "+actor_rollout_ref.model.override_config.attention_dropuot=0.0"
    assert doctor.main([*seed_command(files), typo]) == 1
    out = capsys.readouterr().out
    assert "actor_rollout_ref.model.override_config.attention_dropuot" in out
    assert "did you mean actor_rollout_ref.model.override_config.attention_dropout?" in out
    fine = [
        "+actor_rollout_ref.model.override_config.attention_dropout=0.0",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
    ]
    assert doctor.main([*seed_command(files), *fine]) == 0


def test_model_folders_data_rows_and_vocabularies_are_checked_without_loading_weights(
    files, capsys, tmp_path
):
    model = files / "model"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    critic = files / "critic"
    shutil.copytree(files / "model", critic)
    weights = critic / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    pq.write_table(pa.Table.from_pylist([ROW] * 3), files / "train.parquet")
    pq.write_table(pa.Table.from_pylist([ROW]).slice(0, 0), files / "test.parquet")
    assert doctor.main([*seed_command(files), f"critic.model.path={critic}"]) == 1
    out = capsys.readouterr().out
    assert f"actor_rollout_ref.model.path={model}: no tokenizer" in out
    assert f"critic.model.path: {weights}" in out and "truncated" in out
    assert "data.train_files" in out and "3 row(s), fewer than data.train_batch_size=512" in out
    assert "data.val_files" in out and "no rows" in out


def test_a_critic_with_a_smaller_vocabulary_is_an_error(files, capsys):
    critic = files / "critic"
    shutil.copytree(files / "model", critic)
    config = json.loads((critic / "config.json").read_text())
    config["vocab_size"] = 10
    (critic / "config.json").write_text(json.dumps(config))
    assert doctor.main([*seed_command(files), f"critic.model.path={critic}"]) == 1
    assert f"critic.model.path={critic}: its vocabulary has 10 tokens" in capsys.readouterr().out
