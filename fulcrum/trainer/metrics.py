"""Per-step metrics with verl's names and definitions (docs/metrics.md; verl's `trainer/ppo/metric_utils.py`).

- data metrics: sequence-level score/reward (sums over response tokens), token-level advantages,
  returns and values (masked), explained variance of the returns by the values, prompt/response lengths;
- timing: `timing_s/<stage>` and `timing_per_token_ms/<stage>` (gen per response token, the other
  stages per prompt + response token);
- throughput: tokens (prompt + response, every sample) ÷ (step seconds × devices);
- MFU of the actor and critic updates: verl's FLOPs estimate (6·N·tokens + 12·Σ seqlen²·head_dim·heads·layers)
  × ppo_epochs ÷ (update seconds × devices × peak FLOP/s). The CPU has no known peak, so MFU is 0 there,
  as in verl for an unknown device;
- memory: peak CUDA allocated/reserved over the step and per phase (0 on the CPU), the machine's used
  RAM (total - available, like verl's psutil figure) and this process's peak resident memory.

Docs for each metric and the lever it points to: docs/metrics.md.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import time
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import torch

from fulcrum.batch import Batch, response_lengths
from fulcrum.device_facts import device_peak_flops
from fulcrum.models.arch import model_shape
from fulcrum.models.arch.spec import matmul_param_count, train_flops
from fulcrum.trainer.dynamic_sampling import rows_with_signal
from fulcrum.workers.cuda_graphs import capture_metrics

GiB = 1024**3


# The attribute under which `timer` records, on an error escaping it, the innermost phase it escaped from.
PHASE_ATTRIBUTE = "fulcrum_phase"


@contextlib.contextmanager
def timer(name: str, timing_raw: dict[str, float], peaks: dict[str, float] | None = None) -> Iterator[None]:
    """Add the wall seconds of the block to `timing_raw[name]` (CUDA work is synchronised first).

    An error leaving the block carries the phase `name` (the innermost one), so a failure report
    (`faults.explain_oom`) names the phase from this fact rather than guessing (`phase_of`).
    With `peaks`, also the block's peak CUDA memory allocated (GiB) into `peaks[name]` (the peak
    counter is reset at the block's start; `memory_metrics` folds the phases back together).
    """
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.synchronize()
        if peaks is not None:
            _fold_peaks(peaks, "_before")
            torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        yield
    except BaseException as error:
        if phase_of(error) is None:
            with contextlib.suppress(AttributeError):  # an exception type without __dict__
                setattr(error, PHASE_ATTRIBUTE, name)
        raise
    finally:
        if cuda:
            torch.cuda.synchronize()
            if peaks is not None:
                _fold_peaks(peaks, name)
        timing_raw[name] = timing_raw.get(name, 0.0) + time.perf_counter() - start


def phase_of(error: BaseException) -> str | None:
    """The innermost `timer` phase `error` escaped from; None when it was raised outside every timer."""
    return getattr(error, PHASE_ATTRIBUTE, None)


def _fold_peaks(peaks: dict[str, float], name: str) -> None:
    """Fold the CUDA peak counters since their last reset into `peaks[name]` and `peaks["_reserved"]`."""
    peaks[name] = max(peaks.get(name, 0.0), torch.cuda.max_memory_allocated() / GiB)
    peaks["_reserved"] = max(peaks.get("_reserved", 0.0), torch.cuda.max_memory_reserved() / GiB)


def phase_memory_metrics(peaks: dict[str, float]) -> dict[str, float]:
    """perf/max_memory_allocated_gb/<phase>: the peak CUDA memory allocated during each timed phase (GiB)."""
    return {f"perf/max_memory_allocated_gb/{k}": v for k, v in peaks.items() if not k.startswith("_")}


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    """{prefix/mean, prefix/max, prefix/min} of a 1-D tensor (0.0 for an empty one)."""
    if x.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    x = x.float()
    return {
        f"{prefix}/mean": x.mean().item(),
        f"{prefix}/max": x.max().item(),
        f"{prefix}/min": x.min().item(),
    }


def prompt_and_response_lengths(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Real (unpadded) prompt and response token counts per sample: two (B,) float tensors.

    The response count is every response token in the sequence (the attention mask, as verl's
    `response_length/*`), tool answers inside a multi-turn response included; the loss counts only
    the tokens of `response_mask`."""
    p = batch.prompt_length
    mask = batch["attention_mask"]
    return mask[:, :p].sum(-1).float(), response_lengths(batch).float()


def compute_data_metrics(batch: Batch, use_critic: bool) -> dict[str, float]:
    """verl's `compute_data_metrics`.

    score/rewards: per sequence, Σ_t token_level_scores / token_level_rewards (B,);
    advantages/returns/values: over the tokens where response_mask = 1;
    vf_explained_var = 1 - Var(returns - values) / (Var(returns) + 1e-5) over those tokens;
    response_length/* and clip_ratio: every response token in the sequence (attention mask), so a
    multi-turn response counts its tool answers too (verl's definition); clip_ratio: fraction of
    sequences exactly at the maximum length.
    """
    mask = batch["response_mask"].bool()
    sequence_score = batch["token_level_scores"].sum(-1)
    sequence_reward = batch["token_level_rewards"].sum(-1)
    valid_adv = torch.masked_select(batch["advantages"], mask)
    valid_returns = torch.masked_select(batch["returns"], mask)
    prompt_length, response_length = prompt_and_response_lengths(batch)
    metrics: dict[str, float] = {}
    metrics.update(_stats("critic/score", sequence_score))
    metrics.update(_stats("critic/rewards", sequence_reward))
    metrics.update(_stats("critic/advantages", valid_adv))
    metrics.update(_stats("critic/returns", valid_returns))
    if use_critic:
        valid_values = torch.masked_select(batch["values"], mask)
        metrics.update(_stats("critic/values", valid_values))
        metrics["critic/vf_explained_var"] = explained_variance(valid_returns, valid_values)
    metrics.update(_stats("response_length", response_length))
    metrics["response_length/clip_ratio"] = (
        torch.eq(response_length, batch.response_length).float().mean().item()
    )
    metrics.update(_stats("prompt_length", prompt_length))
    metrics["prompt_length/clip_ratio"] = torch.eq(prompt_length, batch.prompt_length).float().mean().item()
    alike = groups_scored_alike(sequence_score, batch.non_tensors.get("uid"))
    if alike is not None:
        metrics["critic/score/groups_alike"] = alike
    return metrics


def groups_scored_alike(sequence_score: torch.Tensor, uids: Sequence[Hashable] | None) -> float | None:
    """The fraction of prompt groups whose responses all scored the same (TRL's `frac_reward_zero_std`):
    under GRPO-style estimators their advantages are 0, so they cost a backward pass and teach nothing.
    None when no prompt has more than one response (rollout.n = 1: PPO's usual shape)."""
    if uids is None or len(set(uids)) == len(uids):
        return None
    _, kept, dropped = rows_with_signal(sequence_score.tolist(), uids)
    return dropped / (kept + dropped)


def step_metrics(
    batch: Batch,
    timing_raw: dict[str, float],
    actor: tuple[Any, int],
    critic: tuple[Any, int] | None,
    device: torch.device,
    n_devices: int,
    peaks: dict[str, float] | None = None,
) -> dict[str, float]:
    """Everything a step logs about its data, time, throughput, MFU and memory (verl's names).

    `actor`, `critic` = (model config, ppo_epochs), critic None without one; `peaks` from `timer`.
    """
    metrics = compute_data_metrics(batch, use_critic=critic is not None)
    metrics.update(compute_timing_metrics(batch, timing_raw))
    metrics.update(compute_throughput_metrics(batch, timing_raw, n_devices))
    update_s = timing_raw.get("update_actor", 0.0)
    metrics["perf/mfu/actor"] = compute_mfu(actor[0], batch, update_s, actor[1], device, n_devices)
    if critic is not None:
        seconds = timing_raw.get("update_critic", 0.0)
        metrics["perf/mfu/critic"] = compute_mfu(
            critic[0], batch, seconds, critic[1], device, n_devices, lm_head=False
        )
    metrics.update(memory_metrics(device, peaks))
    metrics.update(phase_memory_metrics(peaks or {}))
    metrics.update(host_load_metrics())
    metrics.update(capture_metrics())
    return metrics


def explained_variance(returns: torch.Tensor, values: torch.Tensor) -> float:
    """1 - Var(returns - values) / (Var(returns) + 1e-5), over flattened valid tokens (N,)."""
    if returns.numel() < 2:
        return 0.0
    return (1.0 - torch.var(returns - values) / (torch.var(returns) + 1e-5)).item()


def compute_timing_metrics(batch: Batch, timing_raw: dict[str, float]) -> dict[str, float]:
    """timing_s/<stage> and timing_per_token_ms/<stage> (gen: per response token; others: all tokens)."""
    prompt_length, response_length = prompt_and_response_lengths(batch)
    num_response = max(float(response_length.sum().item()), 1.0)
    num_overall = max(float(prompt_length.sum().item()) + num_response, 1.0)
    per_token = {"gen": num_response}
    per_token.update({k: num_overall for k in ("ref", "values", "adv", "update_critic", "update_actor")})
    out = {f"timing_s/{k}": v for k, v in timing_raw.items()}
    out.update(
        {
            f"timing_per_token_ms/{k}": timing_raw[k] * 1000 / per_token[k]
            for k in per_token
            if k in timing_raw
        }
    )
    return out


def compute_throughput_metrics(
    batch: Batch, timing_raw: dict[str, float], n_devices: int
) -> dict[str, float]:
    """perf/total_num_tokens, perf/time_per_step, perf/throughput = tokens / (step seconds × devices)."""
    total_tokens = float(batch["attention_mask"].sum().item())
    step_s = timing_raw["step"]
    return {
        "perf/total_num_tokens": total_tokens,
        "perf/time_per_step": step_s,
        "perf/throughput": total_tokens / (step_s * n_devices),
    }


def dense_param_count(config: Any, lm_head: bool = True) -> int:
    """verl's N for the model's family (`fulcrum.models.arch.spec.matmul_param_count`): the attention
    and MLP linears, plus embedding and LM head; `lm_head=False` (the critic) counts the embedding once."""
    return matmul_param_count(model_shape(config), lm_head)


def estimate_train_flops(config: Any, seq_lengths: list[int], lm_head: bool = True) -> float:
    """FLOPs of one forward + backward over sequences of these lengths: 6·N·Σℓ + 12·Σℓ²·head_dim·heads·layers
    (`fulcrum.models.arch.spec.train_flops` over the family's shape); recomputation is not counted (as verl)."""
    return train_flops(model_shape(config), seq_lengths, lm_head)


def compute_mfu(
    config: Any,
    batch: Batch,
    update_seconds: float,
    ppo_epochs: int,
    device: torch.device,
    n_devices: int,
    lm_head: bool = True,
) -> float:
    """Model FLOPs utilisation of an update (`perf/mfu/actor`, `perf/mfu/critic` with lm_head=False).

        MFU = (6·N·T + 12·Σℓ²·d·h·L) · ppo_epochs / (update seconds · devices · peak)

    T = Σℓ the real (prompt + response) tokens of the batch, ℓ each sample's length, N =
    `dense_param_count` (embedding and LM head both counted, as verl; the critic: embedding once),
    d·h·L head dim × query heads × layers, peak the device's dense bf16 FLOP/s (H100/H200: 989e12).
    Recomputation under gradient checkpointing is not counted. 0.0 where the peak is unknown (the CPU).
    """
    peak = device_peak_flops(device)
    if peak is None or update_seconds <= 0:
        return 0.0
    lengths = batch["attention_mask"].sum(-1).long().tolist()
    flops = estimate_train_flops(config, lengths, lm_head) * ppo_epochs
    return flops / (update_seconds * n_devices * peak)


def memory_metrics(device: torch.device, peaks: dict[str, float] | None = None) -> dict[str, float]:
    """Peak CUDA memory (0 on the CPU), the machine's used RAM, and this process's peak resident memory.

    `peaks` (from `timer`, whose phases reset the CUDA peak counters) are folded in, so the peak
    covers every phase of the step.
    """
    out = {"perf/max_memory_allocated_gb": 0.0, "perf/max_memory_reserved_gb": 0.0}
    if device.type == "cuda":
        peaks = peaks or {}
        allocated = [v for k, v in peaks.items() if k != "_reserved"]
        out["perf/max_memory_allocated_gb"] = max([torch.cuda.max_memory_allocated(device) / GiB, *allocated])
        out["perf/max_memory_reserved_gb"] = max(
            torch.cuda.max_memory_reserved(device) / GiB, peaks.get("_reserved", 0.0)
        )
    out["perf/cpu_memory_used_gb"] = _system_memory_used_gb()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    out["perf/cpu_memory_peak_rss_gb"] = peak_rss / (GiB if sys.platform == "darwin" else 1024**2)
    return out


def host_load_metrics() -> dict[str, float]:
    """perf/cpu_load: the host's 1-minute load average per CPU (runnable tasks per core; above 1 the
    CPUs are oversubscribed and every kernel launch of a host-bound pass waits its turn). Nothing where
    the OS keeps no load average."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return {}
    return {"perf/cpu_load": load / max(os.cpu_count() or 1, 1)}


def host_meminfo() -> dict[str, int]:
    """/proc/meminfo's figures in bytes (MemTotal, MemAvailable, ...); empty where there is no /proc."""
    try:
        with open("/proc/meminfo") as f:
            return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:]}
    except (OSError, ValueError):
        return {}


def _system_memory_used_gb() -> float:
    """MemTotal - MemAvailable (0.0 where they are not known)."""
    info = host_meminfo()
    if "MemTotal" not in info or "MemAvailable" not in info:
        return 0.0
    return (info["MemTotal"] - info["MemAvailable"]) / 1024**3
