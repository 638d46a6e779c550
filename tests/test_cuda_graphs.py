"""What a graphed update micro-batch is padded with changes nothing (`fulcrum.workers.cuda_graphs`).

A CUDA graph needs fixed shapes, so each micro-batch is padded to a bucket: extra tokens in extra
sequences, extra response positions in extra rows whose response mask is 0, sequences of length 0.
On the CPU (float32, eager) the actor's and the critic's loss step on the padded micro-batch give the
unpadded one's losses, metrics and gradients. The graphs themselves run on CUDA:
tests/test_cuda_graphs_gpu.py.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from test_workers_units import make_batch
from test_workers_update import cfg_for

from fulcrum.batch import Batch
from fulcrum.config.sections import actor_section, critic_section
from fulcrum.models.packed import PackedMicroBatch, pack_micro_batch
from fulcrum.workers.actor import ActorWorker
from fulcrum.workers.critic import CriticWorker
from fulcrum.workers.graph_buckets import (
    ROW_STEP,
    TOKEN_STEP,
    Bucket,
    bucket_for,
    extra_work,
    fits,
    pad_packed,
    padded_inputs,
)
from fulcrum.workers.micro_batch import MicroInputs
from fulcrum.workers.update import global_agg_kwargs

CPU = torch.device("cpu")


def rl_batch(b: int = 7, p: int = 10, r: int = 7) -> Batch:
    batch = make_batch(b=b, p=p, r=r, seed=3)
    g = torch.Generator().manual_seed(4)
    mask = batch["response_mask"].float()
    for key, scale, shift in (
        ("advantages", 1.0, 0.0),
        ("old_log_probs", 0.3, -6.0),
        ("ref_log_prob", 0.3, -6.0),
    ):
        batch[key] = (torch.randn(batch["responses"].shape, generator=g) * scale + shift) * mask
    batch["values"] = torch.randn(batch["responses"].shape, generator=g) * mask
    batch["returns"] = torch.randn(batch["responses"].shape, generator=g) * mask
    return batch


def packed_of(batch: Batch) -> PackedMicroBatch:
    return pack_micro_batch(
        batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch.prompt_length
    )


def test_the_padded_stream_adds_sequences_rows_and_positions_the_mask_leaves_out() -> None:
    batch = rl_batch()
    packed = packed_of(batch)
    n, m, (b, r) = packed.input_ids.numel(), packed.labels.numel(), packed.shape
    bucket = bucket_for(packed)
    assert bucket.tokens % TOKEN_STEP == 0 and bucket.tokens > n
    assert bucket.rows % ROW_STEP == 0 and bucket.sequences % ROW_STEP == 0
    padded = pad_packed(packed, bucket)
    assert padded.input_ids.numel() == padded.position_ids.numel() == bucket.tokens
    assert padded.labels.numel() == padded.predictor.numel() == bucket.responses
    assert padded.shape == (bucket.rows, r)
    cu = padded.cu_seqlens
    assert cu.numel() == bucket.sequences + 1 and int(cu[-1]) == bucket.tokens
    assert torch.equal(cu[: packed.cu_seqlens.numel()], packed.cu_seqlens)
    lengths = cu.diff()
    assert int(lengths.min()) >= 0 and int(lengths.max()) <= packed.max_seqlen
    # Each padding sequence's positions restart at 0.
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        if start >= n and end > start:
            assert padded.position_ids[start:end].tolist() == list(range(end - start))
    # Padding positions: in rows >= B, each (row, column) once, predicted from a padding token.
    assert torch.equal(padded.predictor[:m], packed.predictor)
    assert bool((padded.rows[m:] >= b).all()) and bool((padded.predictor[m:] >= n).all())
    cells = set(zip(padded.rows.tolist(), padded.cols.tolist(), strict=True))
    assert len(cells) == bucket.responses


def test_a_long_padding_is_cut_into_sequences_no_longer_than_the_widest_row() -> None:
    batch = rl_batch(
        b=2, p=6, r=4
    )  # rows of at most 10 tokens: 128-token buckets need many padding sequences
    packed = packed_of(batch)
    bucket = bucket_for(packed)
    padded = pad_packed(packed, bucket)
    lengths = padded.cu_seqlens.diff()
    assert int(lengths.max()) <= packed.max_seqlen == 10
    assert int(lengths.sum()) == bucket.tokens


def loss_and_grads(
    worker: ActorWorker | CriticWorker,
    batch: Batch,
    padded: tuple[Bucket, PackedMicroBatch, dict[str, torch.Tensor]] | None,
    agg: dict[str, float],
    keys: list[str],
    static: tuple[object, ...] = (),
) -> tuple[dict[str, float], torch.Tensor]:
    """The worker's `fwd_bwd` on `batch` as its forwards move it to the device, or on its `padded_inputs`
    (the columns `keys`) when given: the metrics as floats and the model's gradients, flattened."""
    if padded is None:
        inputs = worker.forwards.inputs(batch, keys, agg)
    else:
        inputs = MicroInputs(padded[2], agg, padded[1], padded[1])
    out, _ = worker.fwd_bwd(inputs, *static)
    grads = torch.cat([p.grad.flatten() for p in worker.model.parameters() if p.grad is not None])
    return {k: float(v) for k, v in out.items()}, grads


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("on_policy", [False, True])
def test_the_actor_loss_step_on_a_padded_micro_batch_equals_the_unpadded_one(
    tiny_dir: str, mode: str, on_policy: bool
) -> None:
    cfg = cfg_for(
        tiny_dir,
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        f"actor_rollout_ref.actor.loss_agg_mode={mode}",
    )
    batch = rl_batch()
    agg = global_agg_kwargs(batch["response_mask"])
    results = []
    for padded in (False, True):
        actor = ActorWorker(actor_section(cfg), CPU, total_training_steps=1)
        assert actor.forwards.packed and actor.forwards.graphs is None  # no graphs on the CPU
        keys = ["response_mask", "advantages", "ref_log_prob"] + ([] if on_policy else ["old_log_probs"])
        inputs = padded_inputs(batch, keys) if padded else None
        if inputs is not None:
            assert isinstance(inputs[0], Bucket) and inputs[0].rows > len(batch)
        results.append(loss_and_grads(actor, batch, inputs, agg, keys, (on_policy, False)))
    (plain, plain_grads), (padded, padded_grads) = results
    assert plain.keys() == padded.keys()
    for key in plain:
        assert padded[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-6), key
    assert plain["actor/kl_loss"] != 0.0 and plain["actor/pg_loss"] != 0.0
    assert torch.allclose(padded_grads, plain_grads, rtol=1e-4, atol=1e-6)
    assert float(plain_grads.abs().max()) > 0


def test_the_critic_loss_step_on_a_padded_micro_batch_equals_the_unpadded_one(tiny_dir: str) -> None:
    cfg = cfg_for(tiny_dir, "critic.model.use_remove_padding=True", "critic.cliprange_value=0.1")
    batch = rl_batch()
    agg = global_agg_kwargs(batch["response_mask"])
    results = []
    for padded in (False, True):
        torch.manual_seed(0)  # the value head's initial weights
        critic = CriticWorker(critic_section(cfg), CPU, total_training_steps=1)
        assert critic.forwards.packed and critic.forwards.graphs is None
        keys = ["response_mask", "values", "returns"]
        inputs = padded_inputs(batch, keys) if padded else None
        results.append(loss_and_grads(critic, batch, inputs, agg, keys))
    (plain, plain_grads), (padded, padded_grads) = results
    for key in plain:
        assert padded[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-6), key
    assert 0.0 < plain["critic/vf_clipfrac"] < 1.0
    assert torch.allclose(padded_grads, plain_grads, rtol=1e-4, atol=1e-6)


def test_staged_gradients_add_up_as_the_eager_accumulation_does() -> None:
    """A graphed micro-batch stages its bf16 gradients in a resident buffer, added into the float32
    gradients after the replay: over two micro-batches the masters' gradients equal the eager path's."""
    from fulcrum.models.precision import ComputeWeights

    grads = []
    for resident in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
        compute = ComputeWeights(model, torch.bfloat16)
        if resident:
            compute.keep_resident()
        compute.refresh()
        with compute.swapped_in():
            if resident:
                compute.attach_resident_grads()
            for seed in (1, 2):
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed)).bfloat16()
                compute.backward(model(x).float().square().sum())
                if resident:
                    compute.stage_pending_grads()
                    compute.mark_staged()
                compute.accumulate_grads()
        compute.release()
        assert bool(compute.copies) == resident  # resident copies stay
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert grads[0].dtype == torch.float32 and torch.equal(grads[0], grads[1])


def grown(own: Bucket, token_steps: int, row_steps: int) -> Bucket:
    """`own` made larger: more tokens and 128 more response positions, with room in the rows and the
    sequences for their padding."""
    return replace(
        own,
        tokens=own.tokens + token_steps * TOKEN_STEP,
        responses=own.responses + 128,
        rows=own.rows + row_steps * ROW_STEP,
        sequences=own.sequences + row_steps * ROW_STEP,
    )


def test_a_micro_batch_fits_a_larger_bucket_and_pads_to_it_just_as_neutrally(tiny_dir: str) -> None:
    """Beyond `MAX_GRAPHS` a micro-batch without a graph of its own replays a larger captured bucket:
    padded to it, the critic's loss step gives the same loss, metrics and gradients."""
    batch = rl_batch()
    packed = packed_of(batch)
    own = bucket_for(packed)
    # Rows of at most 17 tokens and 7 response tokens: more tokens take more padding sequences, more
    # response positions more padding rows.
    larger = grown(own, token_steps=2, row_steps=4)
    assert fits(packed, own) and fits(packed, larger)
    assert not fits(packed, replace(own, tokens=own.tokens - TOKEN_STEP))
    assert not fits(packed, replace(own, sequences=1))  # no room for the padding sequences
    # The attention's bound on a sequence and the response grid's width are the batch's: never padded.
    assert not fits(packed, replace(larger, width=own.width + 1))
    assert not fits(packed, replace(larger, columns=own.columns + 1))
    cfg = cfg_for(tiny_dir, "critic.model.use_remove_padding=True", "critic.cliprange_value=0.1")
    agg = global_agg_kwargs(batch["response_mask"])
    results = []
    for bucket in (own, larger):
        torch.manual_seed(0)
        critic = CriticWorker(critic_section(cfg), CPU, total_training_steps=1)
        keys = ["response_mask", "values", "returns"]
        inputs = padded_inputs(batch, keys, lambda _packed, _own, b=bucket: b)
        assert inputs[0] == bucket and inputs[1].input_ids.numel() == bucket.tokens
        results.append(loss_and_grads(critic, batch, inputs, agg, keys))
    (first, first_grads), (second, second_grads) = results
    assert first == pytest.approx(second, rel=1e-5, abs=1e-6)
    assert torch.allclose(first_grads, second_grads, rtol=1e-4, atol=1e-6)


class Replayed:
    """A captured graph's stand-in: records the padded micro-batch it is given."""

    def __init__(self) -> None:
        self.padded = None
        self.layout = SimpleNamespace(rebuild=lambda outs, n_rows: outs)

    def replay(self, packed: PackedMicroBatch, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        self.padded = packed
        return (torch.tensor([1.0]),)


def step(inputs: MicroInputs) -> tuple[torch.Tensor, ...]:
    """A function graphs wrap (never run here: the stand-ins replay, captures are recorded)."""
    return ()


FORWARD = (step, (), (), False)  # its graphs' kind: a no-grad forward, no counts
UPDATE = (step, (), (), True)


def graphs_holding(buckets: list[Bucket], shape: tuple, limit: int, monkeypatch: pytest.MonkeyPatch):
    """A CPU `CudaGraphs` whose captured graphs are stand-ins for `buckets` (of the response mask, of
    kind `shape`); its captures recorded in the list returned beside it, not made."""
    from fulcrum.models.precision import ComputeWeights
    from fulcrum.workers.cuda_graphs import CudaGraphs

    graphs = CudaGraphs(CPU, ComputeWeights(torch.nn.Linear(2, 2), torch.bfloat16), limit=limit)
    graphs.graphs = {(b, ("response_mask",), shape): Replayed() for b in buckets}
    captures: list[tuple] = []
    monkeypatch.setattr(graphs, "capture", lambda *args: captures.append(args))
    return graphs, captures


def test_past_the_graph_limit_the_fitting_captured_bucket_of_least_extra_work_replays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch = rl_batch()
    packed = packed_of(batch)
    own = bucket_for(packed)
    near = replace(own, tokens=own.tokens + TOKEN_STEP, sequences=own.sequences + 4 * ROW_STEP)
    far = grown(own, token_steps=4, row_steps=8)
    assert fits(packed, near) and fits(packed, far)
    graphs, captures = graphs_holding([far, near], FORWARD, 2, monkeypatch)
    outs = graphs(batch, [], step, (), {}, False)
    assert not captures and graphs.replays == 1 and float(outs[0][0]) == 1.0
    chosen = graphs.graphs[(near, ("response_mask",), FORWARD)]
    assert chosen.padded is not None and chosen.padded.input_ids.numel() == near.tokens
    # Another kind of pass has no graph it may borrow: not graphed (the caller runs it eagerly).
    assert graphs(batch, [], step, (), {}, True) is None


def test_a_captured_bucket_within_a_small_share_of_more_work_replays_instead_of_a_capture(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Below the limit, a micro-batch without a graph of its own replays a captured larger bucket when the
    extra work (tokens, and a quarter of a token a response position) is within NEAR_SHARE of its own
    tokens; a larger one does not serve it: its own bucket is captured."""
    from fulcrum.workers import cuda_graphs

    batch = rl_batch()
    packed = packed_of(batch)
    own = bucket_for(packed)
    shape = FORWARD
    more_responses = replace(own, responses=own.responses + 128, rows=own.rows + 8 * ROW_STEP)
    assert fits(packed, more_responses)
    assert extra_work(more_responses, own) == 32  # 128 positions at a quarter of a token
    monkeypatch.setattr(cuda_graphs, "NEAR_SHARE", 32 / own.tokens)  # just within
    graphs, captures = graphs_holding([more_responses], shape, 100, monkeypatch)
    assert graphs(batch, [], step, (), {}, False) is not None
    assert not captures and graphs.replays == 1
    monkeypatch.setattr(cuda_graphs, "NEAR_SHARE", 31 / own.tokens)  # just beyond: its own is captured
    graphs(batch, [], step, (), {}, False)
    assert len(captures) == 1 and captures[0][0][0] == own and graphs.replays == 1


def test_a_pool_whose_graphs_are_all_gone_is_not_captured_into_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch refuses a capture into a pool none of whose graphs is alive (an allocator assertion): the
    models share one pool while one of them holds a graph, and take a new one after."""
    from fulcrum.workers import cuda_graphs

    handles = iter(range(100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    monkeypatch.setattr(cuda_graphs, "_POOLS", {})
    actor, _ = graphs_holding([], UPDATE, 10, monkeypatch)
    critic, _ = graphs_holding([], UPDATE, 10, monkeypatch)
    first = cuda_graphs.shared_pool(actor)
    assert cuda_graphs.shared_pool(critic) != first  # no graph holds the first pool yet
    critic.graphs = {"captured": object()}
    assert cuda_graphs.shared_pool(actor) == cuda_graphs.shared_pool(critic)  # shared while it holds one
    critic.graphs = {}
    assert cuda_graphs.shared_pool(actor) not in (first, 1)


def test_what_graphs_keep_resident_is_two_bytes_a_copy_and_two_a_trained_gradient() -> None:
    from fulcrum.models.precision import ComputeWeights
    from fulcrum.workers.cuda_graphs import resident_bytes

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))  # 15 + 8 parameters
    model[1].requires_grad_(False)  # frozen, float32: copied, no gradient (a reference's layer)
    assert resident_bytes(ComputeWeights(model, torch.bfloat16)) == 4 * 15 + 2 * 8


def test_the_start_says_why_a_model_runs_its_micro_batches_eagerly() -> None:
    from fulcrum.models.precision import ComputeWeights
    from fulcrum.workers.cuda_graphs import graphs_refused
    from fulcrum.workers.forwards import graphs_line, startup_line

    model = torch.nn.Linear(2, 2)
    cuda = torch.device("cuda")  # only its type is read before the device's size

    def refused(**kw: object) -> str | None:
        fields = {
            "model": model,
            "device": cuda,
            "enabled": True,
            "packed": True,
            "compute": ComputeWeights(model),
            "sp": None,
        }
        return graphs_refused(**{**fields, **kw})  # type: ignore[arg-type]

    def forwards(**kw: object) -> SimpleNamespace:
        """What the start-up line reads of a model's forwards."""
        return SimpleNamespace(
            device=kw.get("device", cuda), compute=kw.get("compute"), graphs_off=refused(**kw)
        )

    assert refused(device=CPU) == "not on CUDA"
    assert refused(packed=False).startswith("padded micro-batches")
    assert refused(compute=None) == "no compute copies of its own (FSDP-sharded)"
    assert refused(sp=object()) == "sequence parallelism"

    class TinyGatedDeltaNet(torch.nn.Linear):  # what `is_recurrent_mixer` recognises by its class name
        pass

    hybrid = torch.nn.Sequential(torch.nn.Linear(2, 2), TinyGatedDeltaNet(2, 2))
    assert refused(model=hybrid, compute=ComputeWeights(hybrid)).startswith("linear-attention layers")
    actor, critic = forwards(packed=False), forwards(compute=None)
    line = graphs_line({"actor": actor, "critic": critic})
    assert line is not None and "actor off (padded micro-batches" in line and "critic off (no compute" in line
    # From the trainer's workers: a reference that shares the actor's forwards (LoRA's) is not listed twice.
    trainer = SimpleNamespace(
        actor=SimpleNamespace(forwards=actor), critic=None, ref=SimpleNamespace(forwards=actor)
    )
    assert startup_line(trainer) == "CUDA graphs of the micro-batches: actor off (padded micro-batches " + (
        "(use_remove_padding=False or an architecture without packing)) [actor_rollout_ref.actor.cuda_graphs]"
    )
    assert refused(enabled=False) == "its cuda_graphs key is false"
    assert graphs_line({"actor": forwards(device=CPU)}) is None  # a CPU run says nothing


def test_the_pool_is_read_at_each_capture_and_kept_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """perf/cuda_graph_pool_reserved_gb: the allocator is asked once a capture (only a capture grows the
    pool), never by a step's metrics; the steps between log the last figure."""
    from fulcrum.workers import cuda_graphs

    reads = []

    def reserved() -> int:
        reads.append(1)
        return 3 * 2**30

    monkeypatch.setattr(cuda_graphs, "pool_reserved_bytes", reserved)
    monkeypatch.setattr(cuda_graphs, "TALLY", cuda_graphs.CaptureTally())
    assert cuda_graphs.capture_metrics() == {}  # no graph yet
    cuda_graphs.note_capture(0.25)
    cuda_graphs.note_capture(0.25)  # two captures in one step
    first = cuda_graphs.capture_metrics()
    assert first["perf/cuda_graph_pool_reserved_gb"] == 3.0 and first["perf/graph_captures"] == 2.0
    assert first["perf/graph_capture_s"] == 0.5
    second = cuda_graphs.capture_metrics()
    assert second["perf/cuda_graph_pool_reserved_gb"] == 3.0 and second["perf/graph_captures"] == 0.0
    assert len(reads) == 2  # one a capture, none for the steps' metrics
