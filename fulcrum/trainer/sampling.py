"""Stages 1-2 of a step, and validation: prompts through the rollout engine into a Batch, each response
scored on its last policy token by the reward manager and/or a reward model, as verl combines them.

With algorithm.filter_groups.enable (DAPO) a step generates further prompt batches until enough prompt
groups have responses that differ; with adv_estimator=remax each prompt also gets a greedy response,
whose score is the baseline. With rollout.multi_turn.enable each sample is a conversation with tools
(fulcrum.agent.loop): its response holds every turn, tool answers masked out of the loss, and the
reward function scores the whole response text, as verl's agent loop does. With
rollout.multi_turn.interaction_config_path an interaction answers each turn without tool calls as a
user (fulcrum.agent.interaction); its turn scores reach the reward function in `extra_info`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from fulcrum.agent import ToolSet
from fulcrum.agent.conversations import run_conversations
from fulcrum.agent.interaction import BaseInteraction
from fulcrum.agent.interaction_config import load_interaction_config
from fulcrum.agent.loop import Conversation, ConversationRequest, LoopLimits, ToolAgentLoop, request_of
from fulcrum.agent.metrics import conversation_metrics, spread
from fulcrum.batch import Batch, assemble_batch, response_lengths
from fulcrum.config import FulcrumConfig
from fulcrum.config.schema_v1 import partial_rollouts_on
from fulcrum.data.budgets import response_budget
from fulcrum.models.reward_model import RewardModel
from fulcrum.reward.scoring import RewardResult, score_batch, token_level_scores
from fulcrum.rollout import RolloutEngine, SamplingParams, sampling_params
from fulcrum.trainer import metrics as M
from fulcrum.trainer.data_parallel import generate_shares, map_shares
from fulcrum.trainer.dynamic_sampling import GroupFilter, group_metric_values
from fulcrum.trainer.evaluation import measure_generations
from fulcrum.trainer.generations import dump_generations, generation_rows
from fulcrum.trainer.partial_steps import PartialSteps

logger = logging.getLogger(__name__)


def reward_model_of(cfg: Any, policy_tokenizer: Any, device: torch.device) -> RewardModel | None:
    rm = cfg.reward_model
    if not rm.enable:
        return None
    return RewardModel(
        rm.model.path,
        policy_tokenizer,
        device,
        micro_batch_size=rm.micro_batch_size_per_gpu or rm.micro_batch_size,  # None: 8 (verl's reward loop)
        max_length=rm.max_length,
    )


def tools_of(cfg: FulcrumConfig) -> ToolSet | None:
    """The run's tools (rollout.multi_turn.tool_config_path) when multi-turn rollouts are on, else None."""
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    return ToolSet.from_config(multi_turn) if multi_turn.enable else None


def interactions_of(cfg: FulcrumConfig) -> dict[str, BaseInteraction]:
    """The run's interactions by name (rollout.multi_turn.interaction_config_path), {} without one."""
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    path = multi_turn.interaction_config_path
    return load_interaction_config(path) if multi_turn.enable and path else {}


def with_conversations(batch: Batch, conversations: list[Conversation]) -> Batch:
    """`batch` with each row's turn count, tool rewards and interaction turn scores: in `extra_info` for
    the reward function (verl passes them there) and as columns for the metrics."""
    infos = batch.non_tensors["extra_info"]
    batch.non_tensors["extra_info"] = [
        dict(
            info,
            num_turns=c.num_turns,
            tool_rewards=list(c.tool_rewards),
            turn_scores=list(c.turn_scores),
        )
        for info, c in zip(infos, conversations, strict=True)
    ]
    batch.non_tensors["num_turns"] = [c.num_turns for c in conversations]
    batch.non_tensors["tool_rewards"] = [list(c.tool_rewards) for c in conversations]
    batch.non_tensors["turn_scores"] = [list(c.turn_scores) for c in conversations]
    batch.non_tensors["agent_metrics"] = [dict(c.metrics) for c in conversations]
    return batch


def reward_model_scores(batch: Batch, reward_model: RewardModel) -> torch.Tensor:
    """The reward model's score (B,) of each row's prompt and response."""
    prompt_mask = batch["attention_mask"][:, : batch.prompt_length].bool()
    prompts = [row[keep].tolist() for row, keep in zip(batch["prompts"], prompt_mask, strict=True)]
    lengths = response_lengths(batch).tolist()
    responses = [batch["responses"][i, : int(n)].tolist() for i, n in enumerate(lengths)]
    return reward_model.score(prompts, responses, batch.non_tensors.get("raw_prompt"))


class Sampler:
    """The engine and the reward of one run: `generate`, `score`, a training step's `generate_and_score`
    and `validate`. Under torchrun every rank generates its share; rank 0 alone writes validation dumps."""

    def __init__(
        self,
        cfg: FulcrumConfig,
        rollout: RolloutEngine,
        tokenizer: Any,
        reward_manager: Any,
        reward_model: RewardModel | None,
        is_main: bool = True,
        tools: ToolSet | None = None,
    ) -> None:
        self.cfg = cfg
        self.rollout = rollout
        self.tokenizer = tokenizer
        self.reward_manager = reward_manager
        self.reward_model = reward_model
        self.is_main = is_main
        self.max_prompt_length = int(cfg.data.max_prompt_length)
        self.response_length = int(cfg.actor_rollout_ref.rollout.response_length)
        self.pad_id = int(tokenizer.pad_token_id)
        multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
        self.agent_loop = (
            ToolAgentLoop(
                tools,
                tokenizer,
                LoopLimits.from_config(multi_turn, self.response_length),
                interactions_of(cfg),
            )
            if tools is not None
            else None
        )
        self.partial_steps = (
            PartialSteps(cfg, rollout, self.pad_id)  # type: ignore[arg-type]  # native: validated
            if partial_rollouts_on(cfg.trainer)
            else None
        )

    def generate(self, items: list[dict[str, Any]], params: SamplingParams, uid_prefix: str) -> Batch:
        """Sample responses for `items` into a Batch: the one path to the engine (training, validation and
        ReMax's greedy baseline), each prompt's responses within its row's budget (fulcrum.data.budgets).
        Every backend batches under max_num_seqs by itself (the native engine also shares prompt blocks
        across the whole call) and owns its KV cache (`free_cache_engine`)."""
        if self.agent_loop is not None:
            return self.converse(items, params, uid_prefix)
        budgets = [response_budget(it, params.max_tokens) for it in items]
        out = generate_shares(self.rollout, [it["input_ids"] for it in items], params, budgets)
        return assemble_batch(
            items,
            out.token_ids,
            out.logprobs,
            out.prompt_index,
            self.max_prompt_length,
            self.response_length,
            self.pad_id,
            uid_prefix,
        )

    def converse(self, items: list[dict[str, Any]], params: SamplingParams, uid_prefix: str) -> Batch:
        """`generate` for multi-turn rollouts: every sample a conversation with tools; the batch carries
        each response's loss mask (tool answers 0) and the conversations' turn counts and counters."""
        loop = self.agent_loop
        assert loop is not None

        def run(share: list[ConversationRequest], seeded: SamplingParams, first: int) -> list[Conversation]:
            conversations = run_conversations(self.rollout, loop, share, seeded)  # type: ignore[arg-type]
            for c in conversations:
                c.prompt_index += first
            return conversations

        conversations = map_shares(self.rollout, run, [request_of(it) for it in items], params)
        batch = assemble_batch(
            items,
            [c.token_ids for c in conversations],
            [c.logprobs for c in conversations],
            [c.prompt_index for c in conversations],
            self.max_prompt_length,
            self.response_length,
            self.pad_id,
            uid_prefix,
            loss_masks=[c.loss_mask for c in conversations],
        )
        return with_conversations(batch, conversations)

    def sampling_params(self, validate: bool, step: int) -> SamplingParams:
        """rollout.* (or val_kwargs) with a different, reproducible seed per step (validation: the same
        every time)."""
        rc = self.cfg.actor_rollout_ref.rollout
        base_seed = int(rc.seed)  # type: ignore[arg-type]  # resolved: never null
        params = sampling_params(rc, self.response_length, 0, validate)
        params.seed = base_seed * 1_000_003 + (0 if validate else step) * 1009
        return params

    def score(self, batch: Batch) -> tuple[torch.Tensor, RewardResult]:
        """token_level_scores (B, R) and the scoring result. Without a reward model, the reward manager's
        scores; with one and no custom reward function, the model's score is the reward; with both, the
        function decides and finds the model's score in `extra_info["rm_score"]` (verl)."""
        if self.reward_model is None:
            return score_batch(batch, self.tokenizer, self.reward_manager)
        rm_scores = reward_model_scores(batch, self.reward_model)
        if self.cfg.custom_reward_function.path:
            infos = [
                dict(info or {}, rm_score=float(s))
                for info, s in zip(batch.non_tensors["extra_info"], rm_scores, strict=True)
            ]
            with_scores = Batch(batch.tensors, dict(batch.non_tensors, extra_info=infos))
            return score_batch(with_scores, self.tokenizer, self.reward_manager)
        return token_level_scores(batch, rm_scores), RewardResult(scores=rm_scores.tolist())

    def generate_and_score(
        self,
        items: list[dict[str, Any]],
        step: int,
        timing: dict[str, float],
        metrics: dict[str, float],
        peaks: dict[str, float] | None = None,
        more_prompts: Callable[[], list[dict[str, Any]] | None] = lambda: None,
        reward_stage: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> tuple[Batch, RewardResult]:
        """Stages 1-2 of step `step`. With algorithm.filter_groups.enable (DAPO), `more_prompts` batches are
        generated and scored until data.train_batch_size prompts have responses whose metric differs.
        `reward_stage` is entered around each scoring (the trainer's stop signal may drop the step there)."""
        if self.partial_steps is not None:
            return self.partial_generate_and_score(
                items, step, timing, metrics, peaks, more_prompts, reward_stage
            )
        fg = self.cfg.algorithm.filter_groups
        gate = (
            GroupFilter(int(self.cfg.data.train_batch_size), int(fg.max_num_gen_batches))
            if fg.enable
            else None
        )
        errors = RewardResult(scores=[])
        round_no = 0
        while True:
            with M.timer("gen", timing, peaks):
                # Prompt uids are unique per step and per round (rows group by uid).
                prefix = f"s{step}" + (f"r{round_no}" if round_no else "")
                batch = self.generate(items, self.sampling_params(validate=False, step=step), prefix)
            engine_metrics = getattr(self.rollout, "metrics", None)
            if engine_metrics is not None:  # the engine's own figures (prefill/decode time, preemptions, KV)
                metrics.update({k: float(v) for k, v in engine_metrics().items()})
            if self.cfg.algorithm.adv_estimator == "remax":
                with M.timer("gen_max", timing):
                    batch["reward_baselines"] = self.remax_baselines(items, batch)
            with M.timer("reward", timing), reward_stage():
                batch["token_level_scores"], reward = self.score(batch)
            if gate is None:
                metrics.update(self.conversation_metrics(batch))
                return batch, reward
            errors.num_errors += reward.num_errors
            errors.num_nonfinite += reward.num_nonfinite
            errors.num_timeouts += reward.num_timeouts
            errors.errors += reward.errors
            gate.add(
                batch,
                group_metric_values(fg.metric, batch["token_level_scores"], reward.scores, reward.extra),
            )
            note = gate.progress_note(step)
            if note:
                logger.warning(note)
            if gate.enough:
                break
            if not gate.may_generate_more():
                raise gate.too_many_rounds()
            next_items = more_prompts()
            if next_items is None:  # the step budget's data is spent: train on what was kept
                break
            items = next_items
            round_no += 1
        metrics.update(gate.metrics())
        batch = gate.take()
        errors.scores = batch["token_level_scores"].sum(-1).tolist()
        metrics.update(self.conversation_metrics(batch))
        return batch, errors

    def partial_generate_and_score(
        self,
        items: list[dict[str, Any]],
        step: int,
        timing: dict[str, float],
        metrics: dict[str, float],
        peaks: dict[str, float] | None,
        more_prompts: Callable[[], list[dict[str, Any]] | None],
        reward_stage: Callable[[], contextlib.AbstractContextManager[None]],
    ) -> tuple[Batch, RewardResult]:
        """Stages 1-2 under colocate_async (fulcrum.trainer.partial_steps): the step's complete groups,
        scored. Under `rollout.free_cache_engine` the KV cache is released for training, so the carried
        samples are prefilled again next step; without it their K/V stay while memory allows."""
        assert self.partial_steps is not None
        with M.timer("gen", timing, peaks):
            params = self.sampling_params(validate=False, step=step)
            batch, off_policy = self.partial_steps.generate(items, step, params, more_prompts)
            if self.cfg.actor_rollout_ref.rollout.free_cache_engine:
                self.rollout.sleep()
        metrics.update(off_policy)
        with M.timer("reward", timing), reward_stage():
            batch["token_level_scores"], reward = self.score(batch)
        return batch, reward

    @staticmethod
    def conversation_metrics(batch: Batch) -> dict[str, float]:
        """verl's multi-turn metrics and the tools' counters of a batch of conversations ({} otherwise)."""
        if "num_turns" not in batch.non_tensors:
            return {}
        return conversation_metrics(batch.non_tensors["num_turns"], batch.non_tensors["agent_metrics"])

    def remax_baselines(self, items: list[dict[str, Any]], batch: Batch) -> torch.Tensor:
        """ReMax's baseline: the score of a greedy response to the same prompt, per row (B,)."""
        params = SamplingParams(n=1, temperature=0.0, max_tokens=self.response_length)
        greedy = self.generate(items, params, "remax")
        _, greedy_result = self.score(greedy)
        per_prompt = torch.tensor(greedy_result.scores, dtype=torch.float32)
        n = int(self.cfg.actor_rollout_ref.rollout.n)
        return per_prompt.repeat_interleave(n)[: len(batch)]

    def validate(self, val_dataset: Any, step: int) -> dict[str, float]:
        """Validation (val_kwargs sampling) on the whole validation set, verl's metrics
        (fulcrum.trainer.evaluation); `trainer.validation_data_dir` gets the generations."""
        folder = self.cfg.trainer.validation_data_dir
        dumped = bool(folder) and self.is_main
        items = [val_dataset[i] for i in range(len(val_dataset))]
        metrics, rows = self.evaluate(items, step, prompts=dumped)
        if dumped:
            dump_generations(folder, rows, step)
        return metrics

    def evaluate(
        self, items: list[dict[str, Any]], step: int, prompts: bool = True
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Generate for `items` with the validation sampling (val_kwargs: n, temperature, ...), score, and
        return verl's validation metrics and one generation row per response (`fulcrum eval` and the
        trainer's validation both call this); `prompts` False: the rows without their decoded prompt."""
        batch = self.generate(items, self.sampling_params(validate=True, step=step), "val")
        _, result = self.score(batch)
        rows = generation_rows(batch, result.scores, self.tokenizer, step, prompts)
        metrics = measure_generations(rows, result.scores, result.extra, batch.non_tensors["uid"])
        metrics["val-aux/response_length/mean"] = float(M.prompt_and_response_lengths(batch)[1].mean().item())
        metrics["val-aux/reward/num_timeouts"] = float(result.num_timeouts)
        if "num_turns" in batch.non_tensors:  # verl's val-aux/num_turns/{min,max,mean}
            metrics.update(spread("val-aux/num_turns", [float(t) for t in batch.non_tensors["num_turns"]]))
        return metrics, rows
