"""Runs that would go through every step while no learning signal reaches the policy the engine samples
from, or with a file key silently ignored, are refused before any model loads: by `fulcrum doctor`
(exit 1) and by `fulcrum train` (the same configuration check), naming the keys."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import GSM8K_ROW as ROW
from helpers import seed_command

from fulcrum.config import ConfigError, load_config
from fulcrum.tools import doctor
from fulcrum.trainer.checks import check

T = "actor_rollout_ref.rollout"
GRPO = ["algorithm.adv_estimator=grpo", f"{T}.n=4"]


@pytest.fixture
def files(tmp_path: Path, tiny_model: Path) -> Path:
    pq.write_table(pa.Table.from_pylist([ROW] * 512), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist([ROW]), tmp_path / "test.parquet")
    shutil.copytree(tiny_model, tmp_path / "model")
    return tmp_path


def refusal(overrides: list[str]) -> str:
    """The message `fulcrum train`'s configuration check stops with ('' when it passes)."""
    try:
        check(load_config([*seed_command(), *overrides]))
    except ConfigError as err:
        return str(err)
    return ""


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        ([*GRPO, f"{T}.temperature=0"], [f"{T}.temperature", "algorithm.adv_estimator", f"{T}.n"]),
        ([*GRPO, f"{T}.do_sample=False"], [f"{T}.do_sample"]),
        (["algorithm.adv_estimator=rloo", f"{T}.n=2", f"{T}.top_k=1"], [f"{T}.top_k"]),
        (
            ["algorithm.adv_estimator=reinforce_plus_plus_baseline", f"{T}.n=8", f"{T}.temperature=0"],
            [f"{T}.temperature"],
        ),
        (["algorithm.adv_estimator=remax", f"{T}.temperature=0"], [f"{T}.temperature"]),
    ],
    ids=["grpo-t0", "grpo-greedy", "rloo-top1", "rpp-baseline", "remax"],
)
def test_group_baselines_over_greedy_rollouts_are_refused(overrides: list[str], keys: list[str]) -> None:
    message = refusal(overrides)
    assert "advantage" in message and all(k in message for k in keys), message


@pytest.mark.parametrize(
    "overrides",
    [
        [*GRPO, f"{T}.temperature=0.7"],  # sampling: the responses differ
        ["algorithm.adv_estimator=grpo", f"{T}.n=1", f"{T}.temperature=0"],  # a group of one keeps its score
        ["algorithm.adv_estimator=gae", f"{T}.temperature=0"],  # the critic's values are the baseline
    ],
    ids=["sampling", "n1", "gae"],
)
def test_sampling_or_a_critic_baseline_passes(overrides: list[str]) -> None:
    assert "greedy" not in refusal(overrides)


LORA = ["actor_rollout_ref.model.lora_rank=8"]


@pytest.mark.parametrize(
    ("targets", "named"),
    [
        ("[embed_tokens]", "model.embed_tokens"),
        ("[q_proj,lm_head]", "lm_head"),
        ("'.*embed_tokens'", "model.embed_tokens"),
    ],
)
def test_lora_targets_the_engine_never_sees_are_refused(targets: str, named: str) -> None:
    message = refusal([*LORA, f"actor_rollout_ref.model.target_modules={targets}"])
    assert "actor_rollout_ref.model.target_modules" in message and named in message, message


@pytest.mark.parametrize("targets", ["all-linear", "[q_proj,v_proj]", "'.*\\.(q|v)_proj'"])
def test_lora_on_linear_layers_passes(targets: str) -> None:
    assert "target_modules" not in refusal([*LORA, f"actor_rollout_ref.model.target_modules={targets}"])


@pytest.mark.parametrize("name", ["tool_config_path", "interaction_config_path"])
def test_a_multi_turn_file_without_multi_turn_is_refused(name: str) -> None:
    message = refusal([f"{T}.multi_turn.{name}=/nonexistent/tools.yaml"])
    assert f"{T}.multi_turn.{name}" in message and f"{T}.multi_turn.enable" in message, message


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ([*GRPO, f"{T}.temperature=0"], f"{T}.temperature"),
        ([*LORA, "actor_rollout_ref.model.target_modules=[embed_tokens]"], "target_modules"),
        ([*LORA, "actor_rollout_ref.model.target_modules=[lm_head]"], "target_modules"),
        ([f"{T}.multi_turn.tool_config_path=/nonexistent/tools.yaml"], f"{T}.multi_turn.tool_config_path"),
    ],
    ids=["grpo-t0", "lora-embed", "lora-head", "tool-config"],
)
def test_doctor_refuses_them(
    files: Path, capsys: pytest.CaptureFixture[str], overrides: list[str], key: str
) -> None:
    assert doctor.main([*seed_command(files), *overrides]) == 1
    out = capsys.readouterr().out
    assert key in out and "can run" not in out, out
