"""Metric definitions (verl's) on hand-built batches, the FLOPs estimate, and the loggers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fulcrum.batch import Batch
from fulcrum.trainer import metrics as M
from fulcrum.trainer.loggers import Tracking, console_line


def hand_batch() -> Batch:
    """2 samples, prompt width 3, response width 4.

    sample 0: prompt 2 tokens, response 4 (clipped), score 1 on its last token;
    sample 1: prompt 3 tokens (clipped), response 2, score 0.
    """
    attention = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]])
    response_mask = attention[:, 3:]
    scores = torch.tensor([[0, 0, 0, 1.0], [0, 0, 0, 0]])
    return Batch(
        {
            "prompts": torch.zeros(2, 3, dtype=torch.long),
            "responses": torch.zeros(2, 4, dtype=torch.long),
            "attention_mask": attention,
            "response_mask": response_mask,
            "token_level_scores": scores,
            "token_level_rewards": scores - 0.1 * response_mask,
            "advantages": torch.tensor([[1.0, 2, 3, 4], [5, 6, 100, 100]]),
            "returns": torch.tensor([[1.0, 1, 1, 1], [0, 0, 9, 9]]),
            "values": torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 7, 7]]),
        }
    )


def test_data_metrics_hand_values() -> None:
    m = M.compute_data_metrics(hand_batch(), use_critic=True)
    assert m["critic/score/mean"] == pytest.approx(0.5)
    assert m["critic/score/max"] == 1.0 and m["critic/score/min"] == 0.0
    assert m["critic/rewards/mean"] == pytest.approx(((1 - 0.4) + (-0.2)) / 2)
    # advantages over the 6 valid tokens only (the 100s are padding)
    assert m["critic/advantages/mean"] == pytest.approx(21 / 6)
    assert m["critic/advantages/max"] == 6.0
    valid_returns = torch.tensor([1.0, 1, 1, 1, 0, 0])
    valid_values = torch.full((6,), 0.5)
    expected_ev = 1 - torch.var(valid_returns - valid_values) / (torch.var(valid_returns) + 1e-5)
    assert m["critic/vf_explained_var"] == pytest.approx(expected_ev.item())
    assert m["critic/values/mean"] == pytest.approx(0.5)
    assert m["response_length/mean"] == 3.0 and m["response_length/clip_ratio"] == 0.5
    assert m["prompt_length/mean"] == 2.5 and m["prompt_length/clip_ratio"] == 0.5


def test_groups_scored_alike_counts_groups_whose_advantages_grpo_zeroes() -> None:
    batch = Batch.concat([hand_batch()] * 3)  # sequence scores 1, 0, 1, 0, 1, 0
    batch.non_tensors["uid"] = ["a", "b", "a", "b", "c", "c"]  # a: 1, 1 (alike); b: 0, 0 (alike); c: 1, 0
    m = M.compute_data_metrics(batch, use_critic=False)
    assert m["critic/score/groups_alike"] == pytest.approx(2 / 3)
    batch.non_tensors["uid"] = ["a", "a", "b", "b", "c", "c"]  # each group has a 1 and a 0
    assert M.compute_data_metrics(batch, use_critic=False)["critic/score/groups_alike"] == 0.0
    batch.non_tensors["uid"] = list("abcdef")  # one response a prompt (PPO): no groups to speak of
    assert "critic/score/groups_alike" not in M.compute_data_metrics(batch, use_critic=False)


def test_data_metrics_without_critic_omit_values() -> None:
    m = M.compute_data_metrics(hand_batch(), use_critic=False)
    assert "critic/values/mean" not in m and "critic/vf_explained_var" not in m
    assert "critic/returns/mean" in m


def test_timing_and_throughput() -> None:
    batch = hand_batch()  # 5 prompt + 6 response tokens
    timing = {"gen": 0.6, "update_actor": 1.1, "step": 2.2, "reward": 0.1}
    t = M.compute_timing_metrics(batch, timing)
    assert t["timing_s/gen"] == 0.6
    assert t["timing_per_token_ms/gen"] == pytest.approx(600 / 6)
    assert t["timing_per_token_ms/update_actor"] == pytest.approx(1100 / 11)
    assert "timing_per_token_ms/reward" not in t
    p = M.compute_throughput_metrics(batch, timing, n_devices=2)
    assert p["perf/total_num_tokens"] == 11
    assert p["perf/throughput"] == pytest.approx(11 / (2.2 * 2))


def test_flops_estimate_qwen2_0_5b_shape() -> None:
    cfg = SimpleNamespace(
        hidden_size=896,
        num_attention_heads=14,
        num_key_value_heads=2,
        num_hidden_layers=24,
        intermediate_size=4864,
        vocab_size=151936,
    )
    per_layer = 896 * (896 + 2 * 128 + 896) + 3 * 896 * 4864
    n = per_layer * 24 + 2 * 151936 * 896
    assert M.dense_param_count(cfg) == n == 630_095_872
    flops = M.estimate_train_flops(cfg, [100, 200])
    assert flops == pytest.approx(6 * n * 300 + 12 * (100**2 + 200**2) * 64 * 14 * 24)
    # The critic (perf/mfu/critic): no LM head, the embedding counted once.
    assert M.dense_param_count(cfg, lm_head=False) == n - 151936 * 896
    critic_flops = M.estimate_train_flops(cfg, [100, 200], lm_head=False)
    assert flops - critic_flops == pytest.approx(6 * 151936 * 896 * 300)


def test_mfu_is_zero_on_cpu_and_memory_metrics_present() -> None:
    cfg = SimpleNamespace(hidden_size=8, num_attention_heads=2, num_hidden_layers=1, vocab_size=10)
    assert M.compute_mfu(cfg, hand_batch(), 1.0, 1, torch.device("cpu"), 1) == 0.0
    mem = M.memory_metrics(torch.device("cpu"))
    assert mem["perf/max_memory_allocated_gb"] == 0.0
    assert mem["perf/cpu_memory_used_gb"] > 0 and mem["perf/cpu_memory_peak_rss_gb"] > 0


def test_host_load_is_the_load_average_per_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(M.os, "getloadavg", lambda: (24.0, 20.0, 16.0))
    monkeypatch.setattr(M.os, "cpu_count", lambda: 16)
    assert M.host_load_metrics() == {"perf/cpu_load": 1.5}

    def no_load_average() -> tuple[float, float, float]:
        raise OSError("no load average here")

    monkeypatch.setattr(M.os, "getloadavg", no_load_average)
    assert M.host_load_metrics() == {}


def test_jsonl_always_written_and_console_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tracking = Tracking(["console"], tmp_path, "p", "e", {})
    tracking.log({"critic/score/mean": 0.25, "val-core/openai/gsm8k/reward/mean@1": 0.5}, step=3)
    tracking.log({"actor/pg_loss": float("nan")}, step=4)
    tracking.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 3, "critic/score/mean": 0.25, "val-core/openai/gsm8k/reward/mean@1": 0.5}
    assert rows[1]["actor/pg_loss"] == "nan"  # strict JSON has no NaN literal
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 3 | score 0.250") and "val-core/openai/gsm8k/reward/mean@1 0.500" in out[0]
    assert console_line({"perf/throughput": 12.3}, 1) == "step 1 | tok/s 12"


def test_tensorboard_logger_writes_events(tmp_path: Path) -> None:
    tracking = Tracking(["tensorboard"], tmp_path, "p", "e", {})
    tracking.log({"actor/pg_loss": 0.5}, step=1)
    tracking.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_missing_logger_package_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ModuleNotFoundError, match=r"trainer.logger lists 'wandb'.*pip install wandb"):
        Tracking(["console", "wandb"], tmp_path, "p", "e", {})
    with pytest.raises(ValueError, match="unknown logger"):
        Tracking(["consol"], tmp_path, "p", "e", {})


def test_explained_variance_perfect_and_constant() -> None:
    r = torch.tensor([1.0, 2.0, 3.0])
    assert M.explained_variance(r, r) == pytest.approx(1.0)
    assert math.isfinite(M.explained_variance(r, torch.zeros(3)))
