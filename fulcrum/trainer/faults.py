"""Faults during training that must neither lose work nor hide what happened.

Pure helpers the training loop calls:

- `NonFiniteGuard`: a NaN/Inf loss or gradient norm skips the update (the workers' `clip_and_step`
  zeroes the gradients and does not step); the guard counts such steps
  (`training/nan_skipped_steps`) and, after `trainer.max_nan_steps` consecutive ones, stops the run
  with `NonFiniteTrainingError` naming the step, the bad metrics and the last finite ones.
- `explain_oom` / `oom_message`: a CUDA out-of-memory error rewritten with the memory figures and
  the configuration levers that cut memory, with their current values.
- `GracefulInterrupt`: Ctrl-C / SIGTERM ask the loop to stop after the current step (and save a
  checkpoint when `trainer.save_on_interrupt`); a second Ctrl-C stops at once. Inside
  `abandonable()` (the reward stage: user code of unknown length, before anything of the step is
  applied) a signal raises `StepAbandoned` at once instead: the loop drops the step and saves the last
  completed one.

A reward function that raises is handled where rewards are computed (`fulcrum.reward.scoring`:
`on_error="raise"` names the sample index, data_source and exception; `"zero"` scores 0 and counts);
one that hangs, exits or returns the wrong number of scores by `fulcrum.reward.guard`.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch

from fulcrum.config.schema import ActorConfig, CriticConfig, CriticModelConfig, ModelConfig, RefConfig
from fulcrum.config.schema_data import DataConfig
from fulcrum.config.schema_rollout import RolloutConfig
from fulcrum.trainer.diagnosis import NON_FINITE_KEYS
from fulcrum.trainer.metrics import phase_of

# Metrics whose non-finite value means the step's update was (at least partly) skipped: the keys
# `fulcrum report`'s non-finite rule reads back, so the guard and the report watch the same ones.
WATCHED_METRICS = NON_FINITE_KEYS
NAN_SKIPPED_METRIC = "training/nan_skipped_steps"
PPO_LEVERS = (
    "lower actor_rollout_ref.actor.optim.lr / critic.optim.lr, set actor.grad_clip, "
    "check the reward function's output and the data for empty or overlong responses"
)


class NonFiniteTrainingError(RuntimeError):
    """Too many consecutive steps had a NaN/Inf loss or gradient norm; the run stops without saving."""


class OutOfMemoryHelp(RuntimeError):
    """A device out-of-memory error, with the memory figures and the levers that cut memory."""


def nonfinite_metrics(
    metrics: Mapping[str, Any], watched: tuple[str, ...] = WATCHED_METRICS
) -> dict[str, float]:
    """The watched metrics whose value is NaN or ±Inf (missing ones are ignored)."""
    bad = {}
    for key in watched:
        value = metrics.get(key)
        if value is not None and not math.isfinite(float(value)):
            bad[key] = float(value)
    return bad


@dataclass
class NonFiniteGuard:
    """Counts steps whose update was skipped for a NaN/Inf loss or grad norm; stops after `max_nan_steps` in a row.

    Call `observe(step, metrics)` once per step after the updates and merge the returned metrics into
    the step's; log them; then, if `exceeded`, raise `error()` (and save no checkpoint for that step).
    `state_dict()` goes into the checkpoint's trainer state so the counts survive a resume.
    """

    max_nan_steps: int = 3
    watched: tuple[str, ...] = WATCHED_METRICS
    levers: str = PPO_LEVERS  # the keys that cure it, in the stop message
    skipped_steps: int = 0
    consecutive: int = 0
    last_finite_step: int | None = None
    last_finite: dict[str, float] = field(default_factory=dict)
    last_bad: dict[str, float] = field(default_factory=dict)
    last_step: int = 0

    def observe(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        self.last_step = step
        bad = nonfinite_metrics(metrics, self.watched)
        if not bad:
            self.consecutive = 0
            self.last_finite_step = step
            self.last_finite = {k: float(metrics[k]) for k in self.watched if k in metrics}
            return {NAN_SKIPPED_METRIC: float(self.skipped_steps)}
        self.skipped_steps += 1
        self.consecutive += 1
        self.last_bad = bad
        if not self.exceeded:
            print(
                f"step {step}: non-finite {_fmt(bad)}; the update was skipped "
                f"({self.consecutive}/{self.max_nan_steps} in a row before the run stops)",
                file=sys.stderr,
            )
        return {NAN_SKIPPED_METRIC: float(self.skipped_steps)}

    @property
    def exceeded(self) -> bool:
        """True once `max_nan_steps` consecutive steps were non-finite (max_nan_steps <= 0: never)."""
        return 0 < self.max_nan_steps <= self.consecutive

    def error(self) -> NonFiniteTrainingError:
        return NonFiniteTrainingError(self._stop_message(self.last_step, self.last_bad))

    def _stop_message(self, step: int, bad: dict[str, float]) -> str:
        if self.last_finite_step is None:
            last = "no step had finite losses and gradient norms"
        else:
            last = f"last finite metrics (step {self.last_finite_step}): {_fmt(self.last_finite)}"
        return (
            f"stopping at step {step}: {self.consecutive} consecutive steps with a NaN/Inf loss or gradient norm "
            f"(trainer.max_nan_steps={self.max_nan_steps}); now {_fmt(bad)}. Their updates were skipped, so the "
            f"weights are those of step {self.last_finite_step}; no checkpoint was written for the failing steps. "
            f"{last}. Levers: {self.levers}."
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "skipped_steps": self.skipped_steps,
            "consecutive": self.consecutive,
            "last_finite_step": self.last_finite_step,
            "last_finite": dict(self.last_finite),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.consecutive = int(state.get("consecutive", 0))
        self.last_finite_step = state.get("last_finite_step")
        self.last_finite = {k: float(v) for k, v in dict(state.get("last_finite", {})).items()}


def _fmt(values: Mapping[str, float]) -> str:
    return ", ".join(f"{k}={v:.6g}" for k, v in values.items()) or "(none)"


# ------------------------------------------------------------------------------------ out of memory

# (config key, what it does), by the phase of the step where memory ran out; `None` = any phase.
OOM_LEVERS: dict[str | None, list[tuple[str, str]]] = {
    "gen": [
        (RolloutConfig.key("gpu_memory_utilization"), "lower it: a smaller KV cache"),
        (RolloutConfig.key("max_num_seqs"), "lower it: fewer sequences decoded at once"),
        (RolloutConfig.key("max_num_batched_tokens"), "lower it: smaller prefill chunks"),
        (RolloutConfig.key("free_cache_engine"), "True: release the KV cache while training"),
    ],
    "update_actor": [
        (ActorConfig.key("ppo_micro_batch_size_per_gpu"), "lower it: fewer responses per backward"),
        (ActorConfig.key("use_dynamic_bsz"), "True: micro-batches by token count"),
        (ActorConfig.key("ppo_max_token_len_per_gpu"), "lower it (with use_dynamic_bsz)"),
        (ModelConfig.key("enable_gradient_checkpointing"), "True: recompute activations"),
        (ActorConfig.key("fsdp_config.param_offload"), "True: parameters on the CPU"),
        (ActorConfig.key("fsdp_config.optimizer_offload"), "True: optimiser state on the CPU"),
    ],
    "update_critic": [
        (CriticConfig.key("ppo_micro_batch_size_per_gpu"), "lower it: fewer responses per backward"),
        (CriticConfig.key("use_dynamic_bsz"), "True: micro-batches by token count"),
        (CriticConfig.key("ppo_max_token_len_per_gpu"), "lower it (with use_dynamic_bsz)"),
        (CriticModelConfig.key("enable_gradient_checkpointing"), "True: recompute activations"),
        (CriticModelConfig.key("fsdp_config.param_offload"), "True: parameters on the CPU"),
        (CriticModelConfig.key("fsdp_config.optimizer_offload"), "True: optimiser state on the CPU"),
    ],
    "old_log_prob": [
        (RolloutConfig.key("log_prob_micro_batch_size_per_gpu"), "lower it"),
        (RolloutConfig.key("log_prob_max_token_len_per_gpu"), "lower it (with dynamic batch size)"),
    ],
    "ref": [
        (RefConfig.key("log_prob_micro_batch_size_per_gpu"), "lower it"),
        (RefConfig.key("fsdp_config.param_offload"), "True: reference weights on the CPU"),
    ],
    "values": [
        (CriticConfig.key("forward_micro_batch_size_per_gpu"), "lower it"),
        (CriticConfig.key("forward_max_token_len_per_gpu"), "lower it (with dynamic batch size)"),
    ],
    None: [
        (DataConfig.key("max_response_length"), "shorter responses"),
        (DataConfig.key("train_batch_size"), "fewer prompts per step"),
    ],
}


KV_CACHE_KEYS = ("gpu_memory_utilization", "free_cache_engine")


def config_value(cfg: Any, dotted: str) -> Any:
    """`cfg.a.b.c` for "a.b.c" (dataclasses or dicts); `"?"` when a key is absent."""
    node = cfg
    for part in dotted.split("."):
        if isinstance(node, Mapping):
            node = node.get(part, "?")
        else:
            node = getattr(node, part, "?")
        if node == "?":
            return "?"
    return node


def memory_figures(device: torch.device | None = None) -> dict[str, float]:
    """GiB allocated / reserved / peak by torch, and free / total on the device (empty without CUDA)."""
    if not torch.cuda.is_available():
        return {}
    device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    gib = 2**30
    figures = {
        "allocated_gib": torch.cuda.memory_allocated(device) / gib,
        "reserved_gib": torch.cuda.memory_reserved(device) / gib,
        "max_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
    }
    with contextlib.suppress(RuntimeError):
        free, total = torch.cuda.mem_get_info(device)
        figures.update(free_gib=free / gib, total_gib=total / gib)
    return figures


def oom_message(error: BaseException, cfg: Any, phase: str | None, figures: Mapping[str, float]) -> str:
    """What ran out, how much memory was in use, and which keys (with their values now) cut memory."""
    where = f" during {phase}" if phase else ""
    lines = [
        f"out of device memory{where}: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
    ]
    if figures:
        lines.append(
            "memory (GiB): " + ", ".join(f"{k.removesuffix('_gib')} {v:.2f}" for k, v in figures.items())
        )
    lever_phase = LEVERS_OF_PHASE.get(phase, phase) if phase is not None else None
    if lever_phase is not None and lever_phase in OOM_LEVERS:
        # The phase's own levers, the general ones, and the KV cache, which competes with every phase.
        levers = OOM_LEVERS[lever_phase] + OOM_LEVERS[None]
        levers += [
            lever for lever in OOM_LEVERS["gen"] if lever[0].endswith(KV_CACHE_KEYS) and lever not in levers
        ]
    else:
        levers = [lever for group in OOM_LEVERS.values() for lever in group]
    lines.append("levers that cut memory (most relevant first; current value in brackets):")
    lines += [f"  {key} [{config_value(cfg, key)}]: {what}" for key, what in levers]
    return "\n".join(lines)


# Phases whose memory is the rollout's: their levers are generation's.
LEVERS_OF_PHASE = {"gen_max": "gen", "testing": "gen"}


@contextlib.contextmanager
def explain_oom(cfg: Any, phase: str | None = None, device: torch.device | None = None) -> Iterator[None]:
    """Re-raise a torch out-of-memory error as `OutOfMemoryHelp` with figures and levers (the original chained).

    Without `phase`, it is the one the step's `timer` recorded on the error (`metrics.phase_of`).
    """
    try:
        yield
    except torch.cuda.OutOfMemoryError as error:
        figures = memory_figures(device)
        phase = phase or phase_of(error)
        raise OutOfMemoryHelp(oom_message(error, cfg, phase, figures)) from error


# ------------------------------------------------------------------------------------------ Ctrl-C


class StepAbandoned(BaseException):
    """A stop signal arrived while the step could still be dropped whole: nothing of it was applied.
    A BaseException, so that a reward function's `except Exception` lets it through."""


class GracefulInterrupt:
    """While active, the first SIGINT/SIGTERM sets `requested` (the loop stops after the current step);
    a second SIGINT raises KeyboardInterrupt at once. Inside `abandonable()`, any of them raises
    StepAbandoned at once. Outside the main thread it does nothing."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._abandonable = False

    @property
    def requested(self) -> bool:
        return self.received is not None

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + signal number (130 for Ctrl-C)."""
        return 128 + int(self.received) if self.received is not None else 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._abandonable:
            self.received = signum
            self._abandonable = False  # raised once; the stage's clean-up runs undisturbed
            print(
                f"\n{signal.Signals(signum).name} received while the reward function runs: dropping this "
                "step (nothing of it was applied) and stopping",
                file=sys.stderr,
            )
            raise StepAbandoned
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        print(
            f"\n{signal.Signals(signum).name} received: stopping after the current step "
            "(checkpoint if trainer.save_on_interrupt); press Ctrl-C again to stop at once",
            file=sys.stderr,
        )

    @contextlib.contextmanager
    def abandonable(self, enabled: bool = True) -> Iterator[None]:
        """While inside (and `enabled`, and installed), a stop signal raises StepAbandoned at once: for a
        stage that waits on user code (the reward function) before anything of the step is applied."""
        self._abandonable = enabled and bool(self._previous)
        try:
            yield
        finally:
            self._abandonable = False

    def install(self) -> GracefulInterrupt:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> GracefulInterrupt:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
