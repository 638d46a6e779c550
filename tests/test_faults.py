"""Fault helpers: NaN/Inf step skipping and stop, out-of-memory explanation, graceful Ctrl-C."""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch

from fulcrum.config import load_config
from fulcrum.trainer import metrics as M
from fulcrum.trainer.faults import (
    NAN_SKIPPED_METRIC,
    GracefulInterrupt,
    NonFiniteGuard,
    OutOfMemoryHelp,
    explain_oom,
    nonfinite_metrics,
    oom_message,
)


def test_nonfinite_metrics_finds_nan_and_inf_only_in_watched_keys() -> None:
    metrics = {
        "actor/pg_loss": float("nan"),
        "critic/grad_norm": math.inf,
        "critic/vf_loss": 0.5,
        "x": math.nan,
    }
    assert nonfinite_metrics(metrics) == pytest.approx(
        {"actor/pg_loss": math.nan, "critic/grad_norm": math.inf}, nan_ok=True
    )
    assert nonfinite_metrics({"actor/pg_loss": 1.0}) == {}


def test_guard_counts_skips_resets_on_finite_and_stops_after_max() -> None:
    guard = NonFiniteGuard(max_nan_steps=3)
    assert guard.observe(1, {"actor/pg_loss": 0.25, "actor/grad_norm": 1.5}) == {NAN_SKIPPED_METRIC: 0.0}
    assert (
        guard.observe(2, {"actor/pg_loss": math.nan, "actor/grad_norm": math.nan})[NAN_SKIPPED_METRIC] == 1.0
    )
    assert guard.observe(3, {"actor/pg_loss": math.nan})[NAN_SKIPPED_METRIC] == 2.0
    guard.observe(4, {"actor/pg_loss": 0.5, "actor/grad_norm": 2.0})  # a finite step resets the run of NaNs
    assert guard.consecutive == 0 and guard.skipped_steps == 2

    restored = NonFiniteGuard(max_nan_steps=3)
    restored.load_state_dict(guard.state_dict())  # counts survive a resume
    restored.observe(5, {"critic/grad_norm": math.inf})
    restored.observe(6, {"critic/vf_loss": math.nan})
    assert not restored.exceeded
    assert restored.observe(7, {"actor/grad_norm": math.inf}) == {NAN_SKIPPED_METRIC: 5.0}
    assert restored.exceeded
    message = str(restored.error())
    assert "step 7" in message and "3 consecutive" in message and "max_nan_steps=3" in message
    assert "actor/grad_norm=inf" in message
    assert "last finite metrics (step 4)" in message and "actor/pg_loss=0.5" in message


def first_lever(message: str) -> str:
    """The line after the levers header: the most relevant lever, whether or not a figures line came first
    (explain_oom adds the device's memory figures on a CUDA machine)."""
    lines = message.splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.startswith("levers that cut memory")) + 1]


def test_oom_message_names_figures_levers_and_their_values() -> None:
    cfg = load_config(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"])
    text = oom_message(
        torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        cfg,
        "update_actor",
        {"allocated_gib": 70.5, "reserved_gib": 75.0, "free_gib": 0.4, "total_gib": 79.1},
    )
    assert "during update_actor" in text and "Tried to allocate 2.00 GiB" in text
    assert "allocated 70.50" in text and "total 79.10" in text
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu [8]" in first_lever(text)
    for key in (
        "gpu_memory_utilization",
        "ppo_max_token_len_per_gpu",
        "enable_gradient_checkpointing",
        "param_offload",
    ):
        assert key in text


def test_explain_oom_rewrites_only_out_of_memory_errors() -> None:
    cfg = load_config([])
    with pytest.raises(OutOfMemoryHelp, match="during gen") as info:
        with explain_oom(cfg, "gen"):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
    assert isinstance(info.value.__cause__, torch.cuda.OutOfMemoryError)
    assert "actor_rollout_ref.rollout.gpu_memory_utilization" in first_lever(str(info.value))
    with pytest.raises(ValueError), explain_oom(cfg, "gen"):
        raise ValueError("not memory")


def test_graceful_interrupt_first_signal_requests_second_raises() -> None:
    previous = signal.getsignal(signal.SIGINT)
    with GracefulInterrupt() as interrupt:
        assert not interrupt.requested
        os.kill(os.getpid(), signal.SIGINT)
        assert interrupt.requested and interrupt.exit_code == 130
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is previous


def test_explain_oom_names_the_innermost_timed_phase() -> None:
    timing: dict[str, float] = {}
    with pytest.raises(OutOfMemoryHelp, match="during gen_max") as info, explain_oom(load_config([])):
        with M.timer("step", timing), M.timer("gen_max", timing):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
    # ReMax's greedy generation gets generation's levers; both timers still counted their time.
    assert "actor_rollout_ref.rollout.gpu_memory_utilization" in first_lever(str(info.value))
    assert set(timing) == {"step", "gen_max"}
    with pytest.raises(OutOfMemoryHelp) as info, explain_oom(load_config([])):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory.")  # outside every timed phase
    assert "during" not in str(info.value).splitlines()[0]


@pytest.mark.gpu
def test_real_cuda_oom_is_explained_with_memory_figures() -> None:
    cfg = load_config([])
    device = torch.device("cuda", 0)
    too_much = 2 * torch.cuda.get_device_properties(device).total_memory
    with pytest.raises(OutOfMemoryHelp) as info, explain_oom(cfg, "update_actor", device):
        torch.empty(too_much, dtype=torch.uint8, device=device)
    text = str(info.value)
    assert "during update_actor" in text and "free" in text and "total" in text
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu [None]" in text
