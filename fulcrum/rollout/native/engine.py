"""The native engine: requests (`add_request` / `resume` / `step` / `release`) over the scheduler and
the model runner, `generate` for a whole batch on top of them; weights sync in place.

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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fulcrum.models.arch import spec_for, unsupported_reason
from fulcrum.parallel.tensor_parallel import TensorParallel
from fulcrum.rollout.base import RolloutOutput, SamplingParams, SequenceOutput
from fulcrum.rollout.native.config import EngineConfig
from fulcrum.rollout.native.model_runner import ModelRunner
from fulcrum.rollout.native.models.decoder import DecoderLM, Rotary
from fulcrum.rollout.native.stepper import COUNTERS, Stepper

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
        dtype = config.dtype if self.device.type == "cuda" else next(hf_model.parameters()).dtype
        rotaries = rotaries_of(hf_model)
        self.model = DecoderLM(spec, hf_model.config, rotaries, dtype, self.device, self.tp)
        self.update_weights(hf_model.state_dict().items(), strict=True)
        self.runner = ModelRunner(self.model, config, self.device)
        self.runner.allocate_cache()
        self.stepper = Stepper(self.runner, config, self.eos_token_ids, self.tp)
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
            self.runner.use_graphs,
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
        self.stepper.settle()
        self.stepper.scheduler.drop_held_blocks()
        self.runner.free_cache()

    def wake_up(self) -> None:
        """Take the KV cache back; graphs are recaptured on first use."""
        self.runner.allocate_cache()

    def close(self) -> None:
        """Release the device resources (KV cache, CUDA graphs) before the process group is left; the
        engine stays usable (the next `generate` takes them again). Requests in flight are dropped."""
        self.runner.release_graphs()
        self.stepper.abort()
        self.sleep()

    @property
    def awake(self) -> bool:
        """Whether the KV cache is allocated."""
        return self.runner.awake

    # ------------------------------------------------------------------------------ requests
    def add_request(self, prompt: list[int], params: SamplingParams, keep: bool = False) -> int:
        """Queue `params.n` samples of `prompt` (see `fulcrum.rollout.base.RequestEngine`)."""
        return self.stepper.add_request(prompt, params, keep)

    def resume(self, seq_id: int, tokens: list[int], params: SamplingParams, keep: bool = False) -> None:
        """Continue held sample `seq_id` with `tokens` appended (see `RequestEngine`)."""
        self.stepper.resume(seq_id, tokens, params, keep)

    def seed_requests(self, params: SamplingParams) -> None:
        """A fresh sampler seeded by `params.seed` for the requests that follow (nothing in flight), so a
        rollout of many requests repeats under one seed as `generate` does."""
        if self.stepper.has_unfinished_requests():
            raise RuntimeError("seed_requests needs the native engine idle: requests are in flight")
        self.stepper.new_sampler(params)

    def step(self) -> list[SequenceOutput]:
        """One scheduler round over everything in flight; the turns it finished."""
        self.wake_up()
        return self.stepper.step()

    def release(self, seq_id: int) -> None:
        """Free held sample `seq_id`'s KV blocks."""
        self.stepper.release(seq_id)

    def has_unfinished_requests(self) -> bool:
        return self.stepper.has_unfinished_requests()

    @property
    def counters(self) -> dict[str, float]:
        """Totals since the engine was built: prefill/decode seconds and steps, prefilled tokens,
        preemptions, evictions of held sequences, blocks in use."""
        scheduler = self.stepper.scheduler
        return {
            **self.stepper.counters,
            "preemptions": scheduler.num_preemptions,
            "evictions": scheduler.num_evictions,
            "held": len(scheduler.held),
            "blocks_in_use": scheduler.blocks.num_usable - scheduler.blocks.num_free,
        }

    # ------------------------------------------------------------------------------ generation
    def _check(self, prompts: list[list[int]], params: SamplingParams) -> None:
        if params.n > self.config.max_num_seqs:
            raise ValueError(
                f"n={params.n} samples per prompt exceed actor_rollout_ref.rollout.max_num_seqs="
                f"{self.config.max_num_seqs}"
            )
        for index, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {index} is empty: every prompt needs at least one token")
            if len(prompt) + params.max_tokens > self.config.max_model_len:
                raise ValueError(
                    f"prompt {index} has {len(prompt)} tokens; with max_tokens={params.max_tokens} it exceeds "
                    f"actor_rollout_ref.rollout.max_model_len={self.config.max_model_len}"
                )

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """Sample `params.n` responses per prompt (see `RolloutOutput`): requests added in prompt order,
        stepped until all are done."""
        self._check(prompts, params)
        if not prompts:
            return RolloutOutput([], [], [], [])
        if self.stepper.has_unfinished_requests():
            raise RuntimeError("generate needs the native engine to itself: requests are in flight")
        start = time.perf_counter()
        self.wake_up()
        wake_up_s = time.perf_counter() - start
        try:
            return self._generate(prompts, params)
        except BaseException:
            self.stepper.abort()  # an interrupted batch must not stay in flight
            raise
        finally:
            start = time.perf_counter()
            if self.config.free_cache_engine:
                self.sleep()
            # The KV cache's allocation (and its release, under free_cache_engine): outside generate_s,
            # inside the trainer's gen time.
            self.stats.update(wake_up_s=wake_up_s, sleep_s=time.perf_counter() - start)

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        start = time.perf_counter()
        before = self.counters
        captured_before = self.runner.graph_capture_s
        self.stepper.scheduler.peak_blocks = 0
        self.stepper.new_sampler(params)
        first = self.stepper.add_request(prompts[0], params)
        for prompt in prompts[1:]:
            self.stepper.add_request(prompt, params)
        finished: list[SequenceOutput] = []
        while self.stepper.has_unfinished_requests():
            finished += self.stepper.step()
        finished.sort(key=lambda out: out.seq_id)
        assert [out.seq_id - first for out in finished] == list(range(len(prompts) * params.n))
        after = self.counters
        self.stats.update({key: after[key] - before[key] for key in (*COUNTERS, "preemptions")})
        self.stats.update(
            generate_s=time.perf_counter() - start,
            peak_kv_gib=self.stepper.scheduler.peak_blocks * self.runner.bytes_per_block() / 2**30,
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
