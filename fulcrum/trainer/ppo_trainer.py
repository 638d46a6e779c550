"""The PPO/GRPO training loop on one device, or as one rank of a torchrun run (trainer/data_parallel.py). `fit()` reads top to bottom like docs/design.md,
"One training step":

    prompts ─► rollout.generate ─► Batch ─► reward (score on the last response token)
      ─► actor old log-prob · ref log-prob · critic values ─► KL in reward (optional)
      ─► advantages ─► critic update ─► actor update ─► weights → rollout ─► metrics,
      validation every test_freq, checkpoint every save_freq.

verl's rules, owned by `fulcrum.config.validate` (`uses_reference`, `uses_critic`): a reference policy
exists only when the KL is used (`use_kl_in_reward` or `actor.use_kl_loss`); with neither on, no KL is
applied even if `kl_ctrl.kl_coef` is set. A critic is used when `critic.enable` says so, else only for
an estimator that needs values (gae). Each worker is built from its typed section (fulcrum.config.sections).
Generation and scoring (stages 1-2, and validation) are trainer/sampling.py's, the KL in reward and
the advantages (stage 4) trainer/advantage_stage.py's; what is decided before the first step is in
startup.py.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
import time
from pathlib import Path
from typing import Any

import torch

from fulcrum.algo.kl import build_kl_controller
from fulcrum.config import FulcrumConfig, to_dict, uses_critic, uses_reference
from fulcrum.config.sections import actor_section, critic_section, reference_section
from fulcrum.data.dataset import rl_datasets
from fulcrum.models.load import load_tokenizer
from fulcrum.parallel import DistInfo, max_over_ranks, on_main
from fulcrum.reward.guard import guard_manager
from fulcrum.reward.managers import manager_from_config
from fulcrum.rollout import build_rollout
from fulcrum.trainer import metrics as M
from fulcrum.trainer.advantage_stage import (
    advantages_of,
    correct_batch,
    kl_in_reward,
    pf_ppo_resample,
    rollout_correction_of,
)
from fulcrum.trainer.checkpoint import CheckpointManager
from fulcrum.trainer.checkpoint.sharded import gather_roles
from fulcrum.trainer.console import StepBar, quiet_library_bars_off_terminal
from fulcrum.trainer.data_parallel import engine_tp_size, on_shares, startup_line
from fulcrum.trainer.diagnosis import LiveDiagnosis
from fulcrum.trainer.faults import GracefulInterrupt, NonFiniteGuard, StepAbandoned, explain_oom
from fulcrum.trainer.loggers import Tracking
from fulcrum.trainer.old_log_probs import old_log_prob_stage, update_actor
from fulcrum.trainer.partial_steps import carried_groups, dropped_on_resume
from fulcrum.trainer.run_dir import open_run_dir
from fulcrum.trainer.sampling import Sampler, reward_model_of, tools_of
from fulcrum.trainer.startup import (
    engine_model_of,
    kl_startup_line,
    resolve_total_steps,
    seed_everything,
    startup_lines,
)
from fulcrum.trainer.wall_clock import WallClockBudget
from fulcrum.workers.actor import ActorWorker, reference_worker
from fulcrum.workers.critic import CriticWorker
from fulcrum.workers.forwards import startup_line as graphs_startup_line
from fulcrum.workers.state_parking import park_between_updates

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ trainer
class PPOTrainer:
    def __init__(
        self, cfg: FulcrumConfig, device: torch.device, n_devices: int = 1, dist: DistInfo | None = None
    ) -> None:
        self.cfg = cfg
        # trainer.wall_clock_budget_s counts from here
        self.wall_clock = WallClockBudget(cfg.trainer.wall_clock_budget_s, cfg.trainer.save_in_background)
        self.device = device
        self.n_devices = n_devices
        # Under torchrun: this rank's place. Rank 0 alone writes the run directory's shared files.
        self.dist = dist or DistInfo()
        quiet_library_bars_off_terminal(self.dist.is_main)  # a log file gets no carriage-return redraws
        seed = int(cfg.trainer.seed)
        seed_everything(seed)
        arr = cfg.actor_rollout_ref
        self.run_dir = Path(cfg.trainer.default_local_dir).expanduser()
        # Which checkpoint to resume (verified), the one-run rule and the configuration check, before
        # anything is loaded: a refusal costs no time.
        self.checkpoints = CheckpointManager(self.run_dir, cfg.trainer)
        role_names = ["actor", "critic"] if uses_critic(cfg) else ["actor"]
        # Rank 0 verifies and opens; the others take its decision (or its error).
        self.resume_choice = on_main(lambda: self.checkpoints.choose_resume(role_names))
        self.attempt = on_main(lambda: open_run_dir(self.run_dir, cfg, self.resume_choice, self.checkpoints))
        for note in self.attempt.notes:
            print(f"note: {note}", flush=True)

        self.tokenizer = load_tokenizer(arr.model.path)
        data = cfg.data
        # Multi-turn: the tools' schemas are part of every prompt's chat template.
        self.tools = tools_of(cfg)
        schemas = self.tools.schemas if self.tools is not None else None
        self.train_dataset, self.val_dataset, self.train_loader = rl_datasets(data, self.tokenizer, schemas)
        self.steps_per_epoch = len(self.train_dataset) // int(data.train_batch_size)
        # The LR schedules span the run's steps: handed to the workers, the configuration stays as loaded.
        self.total_training_steps = resolve_total_steps(cfg, self.steps_per_epoch)

        # The custom reward file is imported (run as Python) here, before any model is loaded. The guard
        # copies its inputs, limits its time per batch and names its failures (reward_model.on_error).
        reward_manager = guard_manager(manager_from_config(cfg), cfg.reward_model)
        for line in startup_lines(cfg):
            print(line, flush=True)
        print(kl_startup_line(cfg), flush=True)
        total = self.total_training_steps
        self.correction = rollout_correction_of(cfg)
        bypass = self.correction if self.correction is not None and self.correction.bypass_mode else None
        self.actor = ActorWorker(actor_section(cfg), device, total, self.tokenizer, bypass)
        self.ref = (
            reference_worker(reference_section(cfg), device, self.actor) if uses_reference(cfg) else None
        )
        self.critic = (
            CriticWorker(critic_section(cfg), device, total, self.tokenizer) if uses_critic(cfg) else None
        )
        # With a critic (trainer.park_optimizer_state): each model's optimiser state waits in host memory
        # while the other one trains; a checkpoint brings it back before it reads the state.
        roles, host_available = list(self.roles().values()), M.host_meminfo().get("MemAvailable")
        self.parking = park_between_updates(
            roles, device, self.dist.distributed, host_available, bool(cfg.trainer.park_optimizer_state)
        )
        if self.parking is not None:
            self.checkpoints.before_reading_state = self.parking.restore_all
        self.kl_ctrl = build_kl_controller(cfg.algorithm.kl_ctrl) if cfg.algorithm.use_kl_in_reward else None
        self.rollout = build_rollout(
            arr.rollout,
            engine_model_of(self.actor, arr, device),
            self.tokenizer,
            device,
            lm_head_fp32=bool(arr.model.lm_head_fp32),
        )
        if self.actor.adapters is not None:  # the engine started from the base: the adapters' effect now
            self.rollout.update_weights(self.actor.named_weights())
        for line in (startup_line(self.dist, cfg, engine_tp_size(self.rollout)), graphs_startup_line(self)):
            if line:
                print(line, flush=True)
        reward_model = reward_model_of(cfg, self.tokenizer, device)
        self.sampler = Sampler(
            cfg, self.rollout, self.tokenizer, reward_manager, reward_model, self.dist.is_main, self.tools
        )
        self.tracking = (
            Tracking(
                list(cfg.trainer.logger),
                self.run_dir,
                cfg.trainer.project_name,
                cfg.trainer.experiment_name,
                to_dict(cfg),
            )
            if self.dist.is_main
            else Tracking.silent()
        )
        self.nan_guard = NonFiniteGuard(int(cfg.trainer.max_nan_steps))
        self.live_diagnosis = LiveDiagnosis()  # one line the first time each rule fires (docs/levers.md)
        self.exit_code = 0  # 128 + signal number when Ctrl-C / SIGTERM stopped the run, as a shell reports it
        self._interrupt: GracefulInterrupt | None = None
        self.global_step = 0
        self.epoch = 0
        self.saved_step: int | None = None  # the last step this run checkpointed
        self._prompt_stream: Any = None  # fit's prompt batches; dynamic sampling draws extra rounds from it

    # -------------------------------------------------------------------------------- the loop
    def roles(self) -> dict[str, Any]:
        roles: dict[str, Any] = {"actor": self.actor}
        if self.critic is not None:
            roles["critic"] = self.critic
        return roles

    def trainer_state(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "epoch": self.epoch,
            "data_loader": self.train_loader.state_dict(),
            "kl_ctrl": self.kl_ctrl.state_dict() if self.kl_ctrl is not None else None,
            "nan_guard": self.nan_guard.state_dict(),
            "carried_groups": carried_groups(self.sampler.partial_steps),
        }

    def interrupt_requested(self) -> bool:
        """Ctrl-C / SIGTERM seen by this process, or by any rank: every rank takes the same path (the
        save that follows gathers from all of them)."""
        asked = self._interrupt is not None and self._interrupt.requested
        return bool(max_over_ranks(int(asked))) if self.dist.distributed else asked

    def save_checkpoint(self) -> None:
        """`global_step_N` of this step: every rank gathers the sharded roles' whole state to rank 0
        (trainer/checkpoint/sharded.py), rank 0 writes it as one process would; the others wait. With
        `trainer.save_in_background` rank 0 waits for the previous write, takes a host snapshot and
        writes it beside the next steps (trainer/checkpoint/background.py); an earlier write's error
        is raised here, on every rank."""
        roles = gather_roles(self.roles())
        on_main(
            lambda: self.checkpoints.save(
                self.global_step,
                roles,
                self.trainer_state(),
                run_config=to_dict(self.cfg),
                background=self.checkpoints.settings.save_in_background,
            )
        )
        self.saved_step = self.global_step

    def end_checkpoint_write(self, stopping: BaseException | None) -> None:
        """The end of `fit` for a checkpoint still being written in the background
        (`BackgroundWriter.finish`): rank 0 waits for it on a normal end; a stop cancels or waits."""
        writer = self.checkpoints.writer
        if stopping is not None:
            writer.finish(stopping)
            return
        line = on_main(lambda: writer.finish(None))
        if line and self.dist.is_main:
            print(line, flush=True)

    def _resume(self) -> None:
        if self.resume_choice.path is None:
            return
        state = self.checkpoints.load(self.resume_choice.path, self.roles(), verify=False)
        self.global_step = int(state["global_step"])
        self.epoch = int(state.get("epoch", 0))
        if state.get("data_loader") is not None:
            self.train_loader.load_state_dict(state["data_loader"])
        if self.kl_ctrl is not None and state.get("kl_ctrl"):
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if state.get("nan_guard"):
            self.nan_guard.load_state_dict(state["nan_guard"])
        # The native engine keeps its own copy of the weights: hand it the restored ones.
        self.rollout.update_weights(self.actor.named_weights())
        print(f"resumed from global_step {self.global_step}{dropped_on_resume(state)}", flush=True)

    def fit(self) -> dict[str, float]:
        """Train for total_training_steps; returns the last step's metrics (validation included)."""
        cfg = self.cfg.trainer
        self._resume()
        last: dict[str, float] = {}
        if self.val_dataset is not None and cfg.val_before_train and self.global_step == 0:
            started = time.monotonic()
            val = self.sampler.validate(self.val_dataset, self.global_step)
            self.wall_clock.observe_validation(time.monotonic() - started)
            val["perf/elapsed_s"] = self.wall_clock.elapsed()
            self.tracking.log(val, step=0)
            last.update(val)
            if cfg.val_only:
                return last
        progress = StepBar(self.total_training_steps, self.global_step, self.dist.is_main).open()
        # Ctrl-C / SIGTERM: finish the step, save, exit (trainer.save_on_interrupt); else they stop at once.
        interrupt = GracefulInterrupt()
        self._interrupt = interrupt
        if cfg.save_on_interrupt:
            interrupt.install()
        start_step = self.global_step
        # Each full pass of the cycle collector walks every long-lived object (0.2 s for the 370k that models,
        # engine and libraries leave): frozen, collections skip them; unfrozen at the end for the next run.
        gc.collect()
        gc.freeze()
        try:
            self._prompt_stream = self._batches()
            before_step = self._data_position()
            for items in self._prompt_stream:
                self.global_step += 1
                is_last = self.global_step >= self.total_training_steps
                if (
                    not is_last
                    and self.wall_clock.budget_s is not None
                    and on_main(lambda: self.wall_clock.next_step_is_last(**self._work_due(is_last=False)))
                ):
                    is_last = True
                    print(self.wall_clock.last_step_line(self.global_step), flush=True)
                try:
                    with explain_oom(self.cfg, device=self.device):
                        metrics = self.train_step(items, is_last)
                except StepAbandoned:
                    self._stop_before_step(before_step, start_step, interrupt)
                    break
                before_step = self._data_position()
                self.wall_clock.observe_step(metrics)
                metrics["perf/elapsed_s"] = self.wall_clock.elapsed()
                self.tracking.log(metrics, step=self.global_step)
                for line in self.live_diagnosis.observe(metrics, self.global_step):
                    print(line, flush=True)
                last = metrics
                progress.step(metrics)
                if self.nan_guard.exceeded:
                    raise self.nan_guard.error()
                if self.interrupt_requested():
                    # The signal may land after this step's save check (e.g. while it was being logged).
                    if self.saved_step != self.global_step:
                        self.save_checkpoint()
                    print(f"stopped after step {self.global_step} (checkpoint saved)", flush=True)
                    self.exit_code = interrupt.exit_code if interrupt.requested else 128 + signal.SIGTERM
                    break
                if is_last:
                    break
        except BaseException as exc:
            self.end_checkpoint_write(exc)
            raise
        else:
            self.end_checkpoint_write(None)
        finally:
            interrupt.uninstall()
            self.tracking.close()
            progress.close()
            # The suspended generator holds this trainer (a reference cycle that only the garbage
            # collector would break): drop it, so nothing outlives the run by accident.
            self._prompt_stream = None
            gc.unfreeze()
        return last

    def _work_due(self, is_last: bool) -> dict[str, bool]:
        """Whether this step validates and saves: every `trainer.test_freq` / `trainer.save_freq` steps and
        on the last step (as verl); the save's other reasons (Ctrl-C) and vetoes (NaN stop) are the step's."""
        cfg, step = self.cfg.trainer, self.global_step
        validates = cfg.test_freq > 0 and (is_last or step % cfg.test_freq == 0)
        saves = cfg.save_freq > 0 and (is_last or step % cfg.save_freq == 0)
        return {"validates": validates and self.val_dataset is not None, "saves": saves}

    def _data_position(self) -> tuple[dict[str, Any], int]:
        """Where the data stands between steps (the loader's state, the epoch): a dropped step goes back here."""
        return self.train_loader.state_dict(), self.epoch

    def _stop_before_step(
        self, position: tuple[dict[str, Any], int], start_step: int, interrupt: GracefulInterrupt
    ) -> None:
        """A stop signal dropped the step while its reward was scored (nothing of it was applied): go back
        to the last completed step, checkpoint it unless it already is, and end with the signal's code."""
        dropped = self.global_step
        self.global_step -= 1
        self.train_loader.load_state_dict(position[0])
        self.epoch = position[1]
        if self.global_step > start_step and self.saved_step != self.global_step:
            self.save_checkpoint()
        # The words of the usual stop ("stopped after step N (checkpoint saved)"), which scripts look for.
        if self.global_step > 0:
            stopped = f"stopped after step {self.global_step} (checkpoint saved)"
        else:
            stopped = "stopped before the first step (nothing to save)"
        print(f"{stopped}; step {dropped} was dropped during its reward", flush=True)
        self.exit_code = interrupt.exit_code

    def _reward_stage(self) -> contextlib.AbstractContextManager[None]:
        """Scoring a training batch, when nothing of the step is applied yet: a stop signal here drops the
        step at once rather than waiting on the reward function. One process only: under torchrun the
        ranks could part ways (one dropping the step, another past its reward), so there the time limit
        (reward_model.timeout_s) bounds the wait."""
        if self._interrupt is None:
            return contextlib.nullcontext()
        return self._interrupt.abandonable(enabled=not self.dist.distributed)

    def _more_prompts(self) -> list[dict[str, Any]] | None:
        """The next prompt batch for another round of dynamic sampling; None when the step budget's data is spent."""
        return next(self._prompt_stream, None) if self._prompt_stream is not None else None

    def close(self) -> None:
        """Release what must go before the process group does: the engine's CUDA graphs (under tensor
        parallelism they captured NCCL all-reduces, and NCCL's teardown waits for such graphs to be
        destroyed: pytorch/pytorch#115388) and its KV cache. Every rank calls it, on every way out."""
        self.rollout.close()

    def _batches(self):
        """Prompt batches epoch after epoch until the step budget is spent."""
        while self.global_step < self.total_training_steps:
            for items in self.train_loader:
                self.epoch = int(self.train_loader.state_dict().get("epoch", self.epoch))
                yield items
                if self.global_step >= self.total_training_steps:
                    return

    def train_step(self, items: list[dict[str, Any]], is_last: bool = False) -> dict[str, float]:
        """One step (docs/design.md, "One training step"). As in verl, validation and checkpointing (when due) are inside the step
        timer, so `timing_s/step` and `perf/throughput` include them on those steps."""
        cfg, arr = self.cfg, self.cfg.actor_rollout_ref
        timing: dict[str, float] = {}
        peaks: dict[str, float] = {}  # peak CUDA memory per phase
        metrics: dict[str, float] = {}
        with M.timer("step", timing):
            # 1-2. generate and score (the score sits on the last response token); with dynamic sampling,
            # rounds are added until enough prompt groups have responses that differ
            batch, reward = self.sampler.generate_and_score(
                items, self.global_step, timing, metrics, peaks, self._more_prompts, self._reward_stage
            )
            for name in ("num_errors", "num_nonfinite", "num_timeouts"):  # docs/metrics.md: reward/*
                metrics[f"reward/{name}"] = float(getattr(reward, name))
            for message in reward.errors:
                logger.warning("step %d: reward scored 0 after an error: %s", self.global_step, message)
            # 3. old log-probs and entropy (unless the update gives them), reference log-probs, values
            if self.correction is not None and self.correction.bypass_mode:
                batch["old_log_probs"] = batch["rollout_log_probs"]  # bypass: no old-log-prob pass (verl)
            else:
                metrics.update(old_log_prob_stage(self.actor, batch, cfg, self.global_step, timing, peaks))
            if arr.actor.calculate_sum_pi_squared:
                with M.timer("old_log_prob", timing):
                    batch["sum_pi_squared"] = on_shares(
                        self.actor.compute_sum_pi_squared, batch, self.actor.forwards.sp_size
                    )
            if self.ref is not None:
                with M.timer("ref", timing, peaks):
                    batch["ref_log_prob"] = on_shares(
                        self.ref.compute_ref_log_prob, batch, self.ref.forwards.sp_size
                    )
            else:
                timing["ref"] = 0.0  # timing_s/ref every step (docs/metrics.md): 0 s with no reference
            if self.critic is not None:
                with M.timer("values", timing, peaks):
                    batch["values"] = on_shares(
                        self.critic.compute_values, batch, self.critic.forwards.sp_size
                    )
            # 4. KL in reward, then advantages
            with M.timer("adv", timing):
                if self.kl_ctrl is not None:
                    rewards, kl_metrics = kl_in_reward(batch, self.kl_ctrl, cfg.algorithm.kl_penalty)
                    batch["token_level_rewards"] = rewards
                    metrics.update(kl_metrics)
                else:
                    batch["token_level_rewards"] = batch["token_level_scores"]
                if self.correction is not None and not self.correction.bypass_mode:
                    metrics.update(correct_batch(batch, self.correction))
                batch["advantages"], batch["returns"] = advantages_of(batch, cfg.algorithm)
                if cfg.algorithm.use_pf_ppo and cfg.algorithm.adv_estimator == "gae":
                    batch = pf_ppo_resample(batch, cfg.algorithm.pf_ppo)
            # 5. updates: critic first (its loss uses the pre-update values), then the actor
            if self.critic is not None:
                with M.timer("update_critic", timing, peaks):
                    metrics.update(self.critic.update_critic(batch, self.global_step))
            if int(cfg.trainer.critic_warmup) <= self.global_step:
                with M.timer("update_actor", timing, peaks):
                    metrics.update(update_actor(self.actor, batch, self.global_step))
                # 6. the new weights into the engine (in place; the hf backend shares the module)
                with M.timer("update_weights", timing):
                    self.rollout.update_weights(self.actor.named_weights())
            # NaN/Inf loss or grad norm: the workers skipped the update; count it, stop after max_nan_steps.
            metrics.update(self.nan_guard.observe(self.global_step, metrics))
            # 7. validation and checkpoint when due (last step always, as verl; also on Ctrl-C)
            trainer_cfg = cfg.trainer
            due = self._work_due(is_last)
            if due["validates"]:
                with M.timer("testing", timing):
                    metrics.update(self.sampler.validate(self.val_dataset, self.global_step))
            interrupted = self.interrupt_requested()
            if not self.nan_guard.exceeded and (due["saves"] or interrupted):
                # timed: the stall (the host snapshot, and any wait for the write before)
                with M.timer("save_checkpoint", timing):
                    self.save_checkpoint()
            elif trainer_cfg.save_freq > 0 and not self.dist.distributed:
                self.checkpoints.prepare_host_buffers(self.roles())  # once: the first save's memory, mapped
        # 8. metrics
        critic = (self.critic.model.config, self.critic.ppo_epochs) if self.critic is not None else None
        metrics.update(
            M.step_metrics(
                batch,
                timing,
                (self.actor.model.config, int(arr.actor.ppo_epochs)),
                critic,
                self.device,
                self.n_devices,
                peaks,
            )
        )
        metrics.update(self.checkpoints.step_metrics("save_checkpoint" in timing))
        # Integers, as verl logs them ("training/global_step": 3, not 3.0): scripts grep and compare them.
        metrics["training/global_step"] = self.global_step
        metrics["training/epoch"] = self.epoch
        return metrics
