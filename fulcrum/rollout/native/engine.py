"""The native engine: requests (`add_request` / `resume` / `step` / `release`) over the scheduler, the
model runner (KV cache, CUDA graphs) and the launcher, `generate` for a whole batch on top of them;
weights sync in place.

Usage (the factory `fulcrum.rollout.build_rollout` does this):
    engine = NativeEngine(hf_model, eos_token_ids=[...], pad_token_id=0, config=EngineConfig(...), device=dev)
    out = engine.generate(prompt_ids, SamplingParams(n=8, temperature=1.0, max_tokens=256))
    ...train...; engine.update_weights(actor.named_weights())

Turn by turn (an agent loop; `fulcrum.rollout.driver.AsyncRollout` does this for asyncio):
    rid = engine.add_request(prompt, params, keep=True)
    out = ...engine.step() until the output with seq_id == rid comes...
    engine.resume(rid, tool_answer_ids, params, keep=False)   # prefills only the new tokens

`generate` takes the KV cache if it was released and, with `config.free_cache_engine`, releases it again
before returning, so every caller (training, validation, ReMax's greedy baseline) leaves the memory free.

Each `step` is one round of `pipeline.Pipeline`: schedule -> run -> postprocess. An agent loop adds turns
of many conversations while others decode, so everything in flight shares each step.

One sampler runs over every row of a step (the fused Triton kernel samples the whole batch in one
pass), so the sampling distribution (temperature, top-p, top-k) is the same for everything in
flight; a request that asks for another one while the engine is busy is refused. The sampler's seed
is taken when it is made: by `seed_requests` (what `generate` does), or by the first request after
the distribution changed. Later requests draw from the same stream, so which tokens a sample gets
depends on what else shares its steps; the same requests, added in the same order between the same
steps, give the same tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from fulcrum.device_facts import device_hbm_bandwidth
from fulcrum.models.arch import spec_for, unsupported_reason
from fulcrum.models.packed_attention import fa4_unavailable_reason
from fulcrum.parallel.tensor_parallel import TensorParallel
from fulcrum.rollout.base import RolloutOutput, SamplingParams, SequenceOutput
from fulcrum.rollout.native.block_manager import BlockManager
from fulcrum.rollout.native.config import EngineConfig
from fulcrum.rollout.native.launcher import Launcher
from fulcrum.rollout.native.memory import prefill_context_tokens
from fulcrum.rollout.native.model_runner import ModelRunner
from fulcrum.rollout.native.models.decoder import DecoderLM, Rotary
from fulcrum.rollout.native.pipeline import Pipeline, figures_between
from fulcrum.rollout.native.sampler import DeviceSampler
from fulcrum.rollout.native.scheduler import Scheduler
from fulcrum.rollout.native.sequence import Sequence

logger = logging.getLogger(__name__)


def rotary_of(hf_model: nn.Module) -> Rotary:
    """(inv_freq (D/2,), attention scaling) of the HF model's rotary embedding module."""
    return next(iter(rotaries_of(hf_model).values()))


def rotaries_of(hf_model: nn.Module) -> dict[str, Rotary]:
    """The HF model's RoPE tables: {"": (inv_freq, scaling)}, or one per layer type when its rotary
    module keeps one per `layer_types` entry (Gemma 3: `{type}_inv_freq`, `{type}_attention_scaling`)."""
    for module in hf_model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor):
            return {"": (inv_freq.detach().float(), float(getattr(module, "attention_scaling", 1.0)))}
        kinds = getattr(module, "layer_types", None)
        if kinds and all(
            isinstance(getattr(module, f"{kind}_inv_freq", None), torch.Tensor) for kind in kinds
        ):
            return {
                kind: (
                    getattr(module, f"{kind}_inv_freq").detach().float(),
                    float(getattr(module, f"{kind}_attention_scaling", 1.0)),
                )
                for kind in kinds
            }
    raise ValueError(f"{type(hf_model).__name__} has no rotary embedding module with an inv_freq buffer")


def sampling_key(params: SamplingParams) -> tuple[float, float, int]:
    """What one sampler fixes for every row it samples: (temperature, top_p, top_k)."""
    return (params.temperature, params.top_p, params.top_k)


def output_of(seq: Sequence) -> SequenceOutput:
    """The finished turn of `seq` as the request API returns it."""
    assert seq.finish_reason is not None
    return SequenceOutput(
        seq_id=seq.output_index,
        request_id=seq.request_id,
        token_ids=seq.response,
        logprobs=list(seq.logprobs),
        loss_mask=seq.loss_mask(),
        finish_reason=seq.finish_reason,
        turn_start=seq.turn_start - seq.num_prompt_tokens,
        held=seq.keep,
    )


class NativeEngine:
    """Paged-KV continuous-batching engine over its own copy of a model's weights (any family
    `fulcrum.models.arch.SPECS` holds whose config `unsupported_reason` accepts)."""

    def __init__(
        self,
        hf_model: nn.Module,
        eos_token_ids: list[int],
        pad_token_id: int,
        config: EngineConfig,
        device: torch.device,
        tp: TensorParallel | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.tp = tp or TensorParallel()
        self.config = config
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        reason = unsupported_reason(hf_model.config, config.max_model_len)
        if reason is not None:
            raise ValueError(f"native engine: it does not run {reason}; use rollout.name=hf")
        spec = spec_for(hf_model.config)
        assert spec is not None  # unsupported_reason names an unknown model_type
        if config.prefill_attention == "fa4" and self.device.type == "cuda":
            why = fa4_unavailable_reason(self.device)
            if why is not None:
                raise ValueError(
                    f"actor_rollout_ref.rollout.engine_kwargs.native.prefill_attention=fa4: {why}"
                )
        dtype = config.dtype if self.device.type == "cuda" else next(hf_model.parameters()).dtype
        rotaries = rotaries_of(hf_model)
        self.model = DecoderLM(spec, hf_model.config, rotaries, dtype, self.device, self.tp)
        self.update_weights(hf_model.state_dict().items(), strict=True)
        self.runner = ModelRunner(self.model, config, self.device)
        self.runner.allocate_cache()
        self.launcher = Launcher(self.runner, config)
        blocks = BlockManager(self.runner.num_blocks, config.block_size, self.runner.num_state_slots)
        m = self.model
        context_budget = prefill_context_tokens(
            m.hidden, m.config.intermediate_size, m.num_kv_heads, m.head_dim, config.max_num_batched_tokens
        )
        self.scheduler = Scheduler(config, blocks, context_budget)
        self.pipeline = Pipeline(self.scheduler, self.launcher, config)
        # The memory roofline of decoding (`counters["decode_floor_s"]`): each step reads every weight and
        # the K/V of every token its sequences attend over, at the card's bandwidth (None: unknown card).
        self.bandwidth = device_hbm_bandwidth(self.device)
        # a step reads every weight but an untied embedding, of which it looks up a row a sequence
        read = [t for t in self.model.weight_tensors() if self.model.tied or t is not self.model.embed]
        self.weight_bytes = sum(t.numel() * t.element_size() for t in read)
        self.kv_bytes_per_token = self.runner.bytes_per_block() // config.block_size
        self.sampler: DeviceSampler | None = None
        self.next_id = 0
        # One stop set per (stop ids, ignore_eos), shared by the sequences that use it: a batch of
        # conversations would otherwise build one per turn.
        self._stop_sets: dict[tuple[tuple[int, ...], bool], frozenset[int]] = {}
        self.stats: dict[str, float] = {}
        logger.info(
            "native engine: %s on %s%s, %d KV blocks of %d tokens (%.2f GiB), triton=%s, cuda graphs=%s",
            hf_model.config.model_type,
            self.device,
            f" (tensor-parallel rank {self.tp.rank} of {self.tp.size})" if self.tp.size > 1 else "",
            self.runner.num_blocks,
            config.block_size,
            self.runner.cache_bytes() / 2**30,
            self.runner.use_triton,
            self.runner.graphs_off_reason or self.runner.use_graphs,
        )

    # ------------------------------------------------------------------------------ hybrid engine
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = False) -> None:
        """Copy HF-named tensors into the engine's weights in place (graphs stay valid)."""
        start = time.perf_counter()
        loaded = self.model.load_weights(named_tensors)
        if strict:
            missing = self.model.required_weight_names() - loaded
            if missing:
                raise ValueError(f"native engine: the model lacks weights {sorted(missing)[:5]} ...")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats = getattr(self, "stats", {})
        self.stats["update_weights_s"] = time.perf_counter() - start

    def sleep(self) -> None:
        """Free the KV cache (and the CUDA graphs that point into it) while the model trains. Held
        samples stay resumable; their next turn recomputes their tokens."""
        self.pipeline.drain()
        self.scheduler.drop_held_blocks()
        self.runner.free_cache()

    def wake_up(self) -> None:
        """Take the KV cache back; graphs are recaptured on first use."""
        self.runner.allocate_cache()

    def close(self) -> None:
        """Release the device resources (KV cache, CUDA graphs) before the process group is left; the
        engine stays usable (the next `generate` takes them again). Requests in flight are dropped."""
        self.runner.release_graphs()
        self.abort()
        self.sleep()

    @property
    def awake(self) -> bool:
        """Whether the KV cache is allocated."""
        return self.runner.awake

    # ------------------------------------------------------------------------------ requests
    def seed_requests(self, params: SamplingParams) -> None:
        """A fresh sampler seeded by `params.seed` for the requests that follow (nothing in flight), so a
        rollout of many requests repeats under one seed as `generate` does."""
        if self.has_unfinished_requests():
            raise RuntimeError("seed_requests needs the native engine idle: requests are in flight")
        self._new_sampler(params)

    def _new_sampler(self, params: SamplingParams) -> None:
        """A sampler for `params`, seeded by `params.seed` (or one seed shared by the engine's ranks)."""
        seed = self.tp.shared_seed(params.seed)
        self.sampler = DeviceSampler(
            SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=seed),
            self.device,
            self.runner.use_triton,
        )

    def _sampler_for(self, params: SamplingParams) -> None:
        current = self.sampler
        if current is not None and sampling_key(current.params) == sampling_key(params):
            return
        if current is not None and self.scheduler.has_work():
            raise ValueError(
                f"the native engine samples with temperature={current.params.temperature}, top_p="
                f"{current.params.top_p}, top_k={current.params.top_k} for the requests in flight; a request "
                f"with {sampling_key(params)} must wait until they finish"
            )
        self._new_sampler(params)

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The ids that end a turn: the request's stop ids, and EOS unless `ignore_eos`."""
        key = (tuple(params.stop_token_ids), params.ignore_eos)
        if key not in self._stop_sets:
            eos = frozenset() if params.ignore_eos else frozenset(self.eos_token_ids)
            self._stop_sets[key] = frozenset(params.stop_token_ids) | eos
        return self._stop_sets[key]

    def add_request(self, prompt: list[int], params: SamplingParams, keep: bool = False) -> int:
        """Queue `params.n` samples of `prompt`; their ids are the returned id + 0 .. n - 1 (see
        `fulcrum.rollout.base.RequestEngine`)."""
        self.scheduler.admit(len(prompt), params)
        self._sampler_for(params)
        request_id = self.next_id
        self.scheduler.add(
            Sequence(
                token_ids=list(prompt),
                num_prompt_tokens=len(prompt),
                output_index=request_id,
                max_tokens=params.max_tokens,
                num_samples=params.n,
                stop_ids=self._stop_ids(params),
                keep=keep,
            )
        )
        self.next_id += params.n
        return request_id

    def resume(self, seq_id: int, tokens: list[int], params: SamplingParams, keep: bool = False) -> None:
        """Continue held sample `seq_id` with `tokens` appended, then sampling (see `RequestEngine`)."""
        if params.n != 1:
            raise ValueError(f"a next turn continues one sample: n must be 1, got {params.n}")
        seq = self.scheduler.held.get(seq_id)
        if seq is not None:  # not held: `Scheduler.resume` names the id
            self.scheduler.admit(seq.num_tokens + len(tokens), params)
        self._sampler_for(params)
        self.scheduler.resume(seq_id, list(tokens), params.max_tokens, self._stop_ids(params), keep)

    def release(self, seq_id: int) -> None:
        """Free held sample `seq_id`'s KV blocks."""
        self.scheduler.release(seq_id)

    def step(self) -> list[SequenceOutput]:
        """One round over everything in flight (`Pipeline.step`); the turns it finished, in order."""
        self.wake_up()
        self.pipeline.step(self.sampler)
        finished, self.scheduler.finished = self.scheduler.finished, []
        return [output_of(seq) for seq in finished]

    def suspend(self) -> tuple[list[SequenceOutput], list[SequenceOutput], list[int]]:
        """Stop everything in flight where it stands, for partial rollouts: the round launched ahead is
        read first, so no sampled token is lost. Returns (the turns that round finished; the unfinished
        turns, held with their tokens and log-probs so far, finish reason "abort", to be continued by
        `resume(seq_id, [], params)` with the rest of their `max_tokens`; the ids of requests not
        prefilled yet, dropped with nothing sampled). A held turn's K/V stay while memory allows
        (eviction, `sleep`: its continuation prefills its tokens again)."""
        self.pipeline.drain()
        finished, self.scheduler.finished = self.scheduler.finished, []
        held, dropped = self.scheduler.suspend()
        return [output_of(seq) for seq in finished], [output_of(seq) for seq in held], dropped

    def has_unfinished_requests(self) -> bool:
        """Work queued or running, a round launched ahead, or finished turns not handed out yet."""
        return self.scheduler.has_work() or self.pipeline.ahead is not None or bool(self.scheduler.finished)

    def abort(self) -> None:
        """Drop every queued and running sequence (held ones stay), after the round in flight ends."""
        self.pipeline.drop()
        self.scheduler.abort()

    @property
    def counters(self) -> dict[str, float]:
        """Totals since the engine was built: prefill/decode seconds and steps, prefilled tokens, tokens
        whose K/V the decode read, tokens sampled (`generated_tokens`), preemptions, evictions of held
        sequences, blocks in use; on a card of known bandwidth `decode_floor_s`, the decode's memory floor:
        (decode steps · weight bytes + K/V tokens read · K/V bytes a token) / bandwidth (the weights and the
        attention layers' K/V; the linear-attention layers' states and the sampler's passes are left out)."""
        scheduler, pipeline = self.scheduler, self.pipeline.counters
        floor = {}
        if self.bandwidth:
            read = (
                pipeline["decode_steps"] * self.weight_bytes
                + pipeline["kv_token_reads"] * self.kv_bytes_per_token
            )
            floor["decode_floor_s"] = read / self.bandwidth
        return {
            **pipeline,
            **floor,
            "generated_tokens": scheduler.num_sampled,
            "preemptions": scheduler.num_preemptions,
            "evictions": scheduler.num_evictions,
            "held": len(scheduler.held),
            "blocks_in_use": scheduler.blocks.num_usable - scheduler.blocks.num_free,
        }

    # ------------------------------------------------------------------------------ generation
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, max_tokens: list[int] | None = None
    ) -> RolloutOutput:
        """Sample `params.n` responses per prompt (see `RolloutOutput`): requests added in prompt order,
        stepped until all are done. A prompt that cannot run is refused before any is sampled.
        `max_tokens`: one response budget per prompt (default `params.max_tokens` for all)."""
        if not prompts:
            return RolloutOutput([], [], [], [])
        if self.has_unfinished_requests():
            raise RuntimeError("generate needs the native engine to itself: requests are in flight")
        start = time.perf_counter()
        self.wake_up()
        wake_up_s = time.perf_counter() - start
        try:
            return self._generate(prompts, params, max_tokens)
        except BaseException:
            self.abort()  # an interrupted batch must not stay in flight
            raise
        finally:
            start = time.perf_counter()
            if self.config.free_cache_engine:
                self.sleep()
            # The KV cache's allocation (and its release, under free_cache_engine): outside generate_s,
            # inside the trainer's gen time.
            self.stats.update(wake_up_s=wake_up_s, sleep_s=time.perf_counter() - start)

    def _generate(
        self, prompts: list[list[int]], params: SamplingParams, max_tokens: list[int] | None
    ) -> RolloutOutput:
        start = time.perf_counter()
        before = self.counters
        captured_before = self.runner.graph_capture_s
        self.scheduler.peak_blocks = 0
        self._new_sampler(params)
        first = self.next_id
        budgets = max_tokens or [params.max_tokens] * len(prompts)
        for index, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
            try:
                self.add_request(
                    prompt, replace(params, max_tokens=budget) if budget != params.max_tokens else params
                )
            except (ValueError, RuntimeError) as exc:
                raise type(exc)(f"prompt {index} refused: {exc}") from None
        finished: list[SequenceOutput] = []
        while self.has_unfinished_requests():
            finished += self.step()
        finished.sort(key=lambda out: out.seq_id)
        assert [out.seq_id - first for out in finished] == list(range(len(prompts) * params.n))
        after = self.counters
        self.stats.update(figures_between(before, after))
        self.stats.update(
            generate_s=time.perf_counter() - start,
            peak_kv_gib=self.scheduler.peak_blocks * self.runner.bytes_per_block() / 2**30,
            graph_capture_s=self.runner.graph_capture_s - captured_before,  # this call's (re)captures
        )
        return RolloutOutput(
            token_ids=[out.token_ids for out in finished],
            logprobs=[out.logprobs for out in finished],
            finish_reasons=[out.finish_reason for out in finished],
            prompt_index=[(out.seq_id - first) // params.n for out in finished],
        )

    def metrics(self) -> dict[str, Any]:
        """The last generate's engine figures, under `rollout/` names for the trainer's log."""
        return {f"rollout/{key}": value for key, value in self.stats.items()}
