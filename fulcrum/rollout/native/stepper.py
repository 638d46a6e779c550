"""The engine's request loop: requests are added one by one, each `step` runs one scheduler round (a
prefill step or a decode window) and hands back the turns that finished.

`NativeEngine.generate` is a loop over `step` for a batch; an agent loop (`fulcrum.rollout.driver`)
adds turns of many conversations while others decode, so everything in flight shares each step.

One sampler runs over every row of a step (the fused Triton kernel samples the whole batch in one
pass), so the sampling distribution (temperature, top-p, top-k) is the same for everything in
flight; a request that asks for another one while the engine is busy is refused. The sampler's seed
is taken when it is made: by `new_sampler` (what `generate` calls), or by the first request after
the distribution changed. Later requests draw from the same stream, so which tokens a sample gets
depends on what else shares its steps; the same requests, added in the same order between the same
steps, give the same tokens.
"""

from __future__ import annotations

import time

from fulcrum.parallel.tensor_parallel import TensorParallel
from fulcrum.rollout.base import SamplingParams, SequenceOutput
from fulcrum.rollout.native.block_manager import BlockManager
from fulcrum.rollout.native.config import EngineConfig
from fulcrum.rollout.native.model_runner import HostCopy, ModelRunner, PrefillLaunch
from fulcrum.rollout.native.sampler import DeviceSampler
from fulcrum.rollout.native.scheduler import DecodeWork, PrefillWork, Scheduler
from fulcrum.rollout.native.sequence import Sequence

# A round launched on the device and not read yet: a decode window or a prefill step.
Launched = tuple[DecodeWork, HostCopy] | tuple[PrefillWork, PrefillLaunch]

COUNTERS = ("prefill_s", "decode_s", "prefill_steps", "prefill_tokens", "decode_steps")


def sampling_key(params: SamplingParams) -> tuple[float, float, int]:
    """What one sampler fixes for every row it samples: (temperature, top_p, top_k)."""
    return (params.temperature, params.top_p, params.top_k)


def stop_ids_of(params: SamplingParams, eos_token_ids: list[int]) -> frozenset[int]:
    """The ids that end a turn: the request's stop ids, and EOS unless `ignore_eos`."""
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_token_ids))


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


class Stepper:
    """Requests in, finished turns out, over one scheduler and one model runner that persist."""

    def __init__(
        self, runner: ModelRunner, config: EngineConfig, eos_token_ids: list[int], tp: TensorParallel
    ) -> None:
        self.runner = runner
        self.config = config
        self.eos_token_ids = list(eos_token_ids)
        self.tp = tp
        self.scheduler = Scheduler(config, BlockManager(runner.num_blocks, config.block_size))
        self.sampler: DeviceSampler | None = None
        self.next_id = 0
        # Running totals since the engine was built; `generate` reports its own share as differences.
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        # One stop set per (stop ids, ignore_eos), shared by the sequences that use it: a batch of
        # conversations would otherwise build one per turn.
        self._stop_sets: dict[tuple[tuple[int, ...], bool], frozenset[int]] = {}
        # overlap_windows: the decode window or prefill step launched ahead, read by the next `step`.
        self.inflight: Launched | None = None

    # ------------------------------------------------------------------------------ requests
    def new_sampler(self, params: SamplingParams) -> None:
        """A fresh sampler for `params` (seeded by `params.seed`, or one seed shared by the engine's ranks)."""
        seed = self.tp.shared_seed(params.seed)
        self.sampler = DeviceSampler(
            SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=seed),
            self.runner.device,
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
        self.new_sampler(params)

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        key = (tuple(params.stop_token_ids), params.ignore_eos)
        stop_ids = self._stop_sets.get(key)
        if stop_ids is None:
            stop_ids = self._stop_sets[key] = stop_ids_of(params, self.eos_token_ids)
        return stop_ids

    def check_turn(self, num_tokens: int, params: SamplingParams) -> None:
        """Refuse a turn that cannot run: no tokens, too long for max_model_len, n above max_num_seqs."""
        if num_tokens == 0:
            raise ValueError("a prompt needs at least one token")
        if num_tokens + params.max_tokens > self.config.max_model_len:
            raise ValueError(
                f"{num_tokens} tokens with max_tokens={params.max_tokens} exceed "
                f"actor_rollout_ref.rollout.max_model_len={self.config.max_model_len}"
            )
        if params.n > self.config.max_num_seqs:
            raise ValueError(
                f"n={params.n} samples per prompt exceed actor_rollout_ref.rollout.max_num_seqs="
                f"{self.config.max_num_seqs}"
            )

    def add_request(self, prompt: list[int], params: SamplingParams, keep: bool = False) -> int:
        """Queue `params.n` samples of `prompt`; their ids are the returned id + 0 .. n - 1."""
        self.check_turn(len(prompt), params)
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
        """Queue the next turn of held sample `seq_id`: `tokens` appended, then sampling resumes."""
        if params.n != 1:
            raise ValueError(f"a next turn continues one sample: n must be 1, got {params.n}")
        seq = self.scheduler.held.get(seq_id)
        if seq is not None:
            self.check_turn(seq.num_tokens + len(tokens), params)
        self._sampler_for(params)
        self.scheduler.resume(seq_id, list(tokens), params.max_tokens, self._stop_ids(params), keep)

    def release(self, seq_id: int) -> None:
        self.scheduler.release(seq_id)

    def has_unfinished_requests(self) -> bool:
        """Work queued or running, a window in flight, or turns finished by `settle` not handed out."""
        return self.scheduler.has_work() or self.inflight is not None or bool(self.scheduler.finished)

    def _take_inflight(self) -> Launched | None:
        """The round in flight (overlap_windows), no longer in flight once taken."""
        inflight, self.inflight = self.inflight, None
        return inflight

    def settle(self) -> None:
        """Read the round in flight (overlap_windows) into the scheduler, launching none after it: the
        turns it finishes come out of the next `step`."""
        if (inflight := self._take_inflight()) is None:
            return
        work, launch = inflight
        if isinstance(work, DecodeWork):
            self._read(work, launch, time.perf_counter())
        else:
            self._read_prefill(work, launch, self.scheduler.commit_prefill(work), time.perf_counter())

    def abort(self) -> None:
        """Drop every queued and running sequence (held ones stay), after the round in flight ends."""
        if (inflight := self._take_inflight()) is not None:
            work, launch = inflight
            if isinstance(work, DecodeWork):
                self.runner.read_decode(launch)
            else:  # its prompts left the queue when it was scheduled: running now, they are dropped too
                self.runner.read_prefill(launch)
                self.scheduler.commit_prefill(work)
        self.scheduler.abort()

    # ------------------------------------------------------------------------------ stepping
    def step(self) -> list[SequenceOutput]:
        """One scheduler round; the turns it finished, in the order they finished."""
        scheduler = self.scheduler
        if (inflight := self._take_inflight()) is not None:  # launched by the step before: read it now
            work, launch = inflight
            if isinstance(work, DecodeWork):
                self._decode(work, launch, time.perf_counter())
            else:
                self._prefill(work, launch, time.perf_counter())
        elif scheduler.has_work():
            self._copy_pending_blocks()
            work = scheduler.schedule()
            tick = time.perf_counter()
            if isinstance(work, DecodeWork):
                self._decode(work, self.runner.launch_decode(work.seqs, work.steps, self.sampler), tick)
            else:
                self._prefill(work, self.runner.launch_prefill(work, self.sampler), tick)
        finished, scheduler.finished = scheduler.finished, []
        return [output_of(seq) for seq in finished]

    def _copy_pending_blocks(self) -> None:
        self.runner.copy_blocks(self.scheduler.pending_copies)
        self.scheduler.pending_copies.clear()

    def _decode(self, work: DecodeWork, launch: HostCopy, tick: float) -> None:
        """Read the launched window `work` into the scheduler. With overlap_windows, the window after it
        is launched first (`Scheduler.schedule_ahead`), so the device decodes while the host reads."""
        if self.config.overlap_windows:
            ahead = self.scheduler.schedule_ahead(work)
            if ahead is not None:
                launched = self.runner.launch_decode(ahead.seqs, ahead.steps, self.sampler, ahead.rows)
                self.inflight = (ahead, launched)
        self._read(work, launch, tick)

    def _read(self, work: DecodeWork, launch: HostCopy, tick: float) -> None:
        """The launched window's tokens into the scheduler; its seconds since `tick` and steps counted."""
        self.scheduler.after_decode(work, *self.runner.read_decode(launch))
        self.counters["decode_s"] += time.perf_counter() - tick
        self.counters["decode_steps"] += work.steps

    def _prefill(self, work: PrefillWork, launch: PrefillLaunch, tick: float) -> None:
        """Read the launched prefill step `work` (the first token of each of the n samples of every
        prompt it completes) into the scheduler. With overlap_windows, while another prompt waits that
        fits, the next prefill step is launched first (`Scheduler.schedule_prefill_ahead`), so the device
        prefills while the host reads this step's tokens and builds the next one's inputs."""
        families = self.scheduler.commit_prefill(work)
        if self.config.overlap_windows:
            self._copy_pending_blocks()  # the forks' copies, queued behind this step's forward
            ahead = self.scheduler.schedule_prefill_ahead()
            if ahead is not None:
                self.inflight = (ahead, self.runner.launch_prefill(ahead, self.sampler))
        self._read_prefill(work, launch, families, tick)

    def _read_prefill(
        self, work: PrefillWork, launch: PrefillLaunch, families: list[list[Sequence]], tick: float
    ) -> None:
        """The launched prefill's first tokens into the scheduler; its seconds since `tick` counted."""
        self.scheduler.take_first_tokens(families, *self.runner.read_prefill(launch))
        self.counters["prefill_s"] += time.perf_counter() - tick
        self.counters["prefill_steps"] += 1
        self.counters["prefill_tokens"] += sum(work.lengths)
