"""doctor on long responses: a step's decode floor at full length, and a KV cache no share of the device
could make hold every sequence at its longest (the fix then names max_num_seqs, not an impossible share)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import QWEN25_05B, model_folder_of_shape, seed_command

from fulcrum.tools import doctor
from fulcrum.tools.doctor_rules import kv_tokens_needed, sequences_that_fit


@pytest.fixture
def qwen25(tmp_path: Path, tiny_model: Path) -> Path:
    model_folder_of_shape(tiny_model, tmp_path / "model", QWEN25_05B)
    return tmp_path


def grpo_64x8_of_16k(folder: Path) -> list[str]:
    """The seed command on the CPU as a step of 64 prompts x 8 responses of up to 16,384 tokens."""
    return [
        *seed_command(folder),
        "trainer.device=cpu",
        "data.train_batch_size=64",
        "actor_rollout_ref.rollout.n=8",
        "data.max_response_length=16384",
        "actor_rollout_ref.actor.ppo_mini_batch_size=64",
        "critic.ppo_mini_batch_size=64",
    ]


def test_doctor_says_the_seed_commands_decode_floor(qwen25: Path, capsys) -> None:
    """The seed command on Qwen2.5-0.5B's shape, no card visible (an H200's 4.8 TB/s assumed): 512
    responses of 256 tokens after 512 read the bf16 weights 255 times (attention 896 x 2,048 and MLP
    3 x 896 x 4,864 in each of 24 layers, the tied head 151,936 x 896: 987.9 MB) and 512 x Σ_{j=1..255}
    (512 + j) tokens' K/V of 24 x 2 x 2 x 64 x 2 = 12,288 B."""
    weights = 2 * ((896 * 2048 + 3 * 896 * 4864) * 24 + 151936 * 896)
    reads = 512 * sum(512 + j for j in range(1, 256))
    floor = (255 * weights + reads * 12_288) / 4.8e12
    assert doctor.main([*seed_command(qwen25), "trainer.device=cpu"]) in (0, 1)
    out = capsys.readouterr().out
    assert (
        f"decode floor: a step's 512 responses at their longest take at least {floor:.3g} s at 4.80 TB/s"
        in out
    )
    assert "(assumed: an H200)" in out and "12,288 B a token" in out


def test_the_sequences_that_fit_are_the_most_whose_longest_the_cache_holds() -> None:
    fits = sequences_that_fit(454_394, 8, 512, 8192)
    assert fits == 55  # 7 prompts of 512 and 55 responses of 8,192: 454,144 tokens
    assert kv_tokens_needed(7, 8, 55, 512, 8192) <= 454_394 < kv_tokens_needed(7, 8, 56, 512, 8192)
    assert sequences_that_fit(100, 1, 50, 60) == 0  # not even one


def test_a_cache_no_share_can_grow_enough_gets_max_num_seqs_not_a_share_above_one(
    qwen25: Path, capsys
) -> None:
    """GRPO 64 x 8 of 16k responses on a 40 GiB card: 8.4M tokens at their longest, 103 GB of K/V at
    Qwen2.5-0.5B's 12,288 B a token; the fix names the sequences that fit, never a share of the device
    above what it has."""
    keys = grpo_64x8_of_16k(qwen25)
    doctor.main([*keys, "--device-memory-gib", "40"])
    out = capsys.readouterr().out
    assert "the rollout preempts" in out
    assert "actor_rollout_ref.rollout.max_num_seqs=" in out and "rules it out" in out
    fix = next(line for line in out.splitlines() if "fix:" in line and "max_num_seqs" in line)
    assert "gpu_memory_utilization=" not in fix  # the share is said as what it would need, not as a fix


def test_partial_rollouts_count_every_batch_in_flight(qwen25: Path, capsys) -> None:
    """Partial rollouts hold the step's prompt batch and `num_warmup_batches` more at once: GRPO 64 x 8 of
    16k responses needs 64 x 512 + 512 x 16,384 tokens synchronously, and with one warm-up batch twice the
    prompts and sequences (1,024, under the command's max_num_seqs of 1,896)."""
    keys = [*grpo_64x8_of_16k(qwen25), "algorithm.adv_estimator=grpo"]
    doctor.main([*keys, "--device-memory-gib", "80"])
    sync = capsys.readouterr().out
    assert f"a step's sequences at their longest need {64 * 512 + 512 * 16384:,}" in sync
    assert "num_warmup_batches" not in sync
    partial = [*keys, "trainer.use_v1=True", "trainer.v1.trainer_mode=colocate_async"]
    doctor.main([*partial, "--device-memory-gib", "80"])
    out = capsys.readouterr().out
    assert (
        f"the 2 prompt batches in flight (partial rollouts) at their longest need {128 * 512 + 1024 * 16384:,}"
        in out
    )
    assert "fewer trainer.v1.colocate_async.num_warmup_batches" in out
    doctor.main([*partial, "trainer.v1.colocate_async.num_warmup_batches=0", "--device-memory-gib", "80"])
    assert f"a step's sequences at their longest need {64 * 512 + 512 * 16384:,}" in capsys.readouterr().out
