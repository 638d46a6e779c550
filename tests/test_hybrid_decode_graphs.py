"""The host side of a hybrid model's decode graphs (Qwen3.5), on the CPU: a graph captured over the decode
step holds the recurrent states' addresses, so a wake-up that moves the states drops the graphs (also
where the KV cache is read through its device-held address), and a capture's warm-up run steps only the
scratch state slot; and which models' decode steps no graph can capture (Qwen3-Next's experts in
float32 on CUDA). The graphs themselves are checked against eager decode on the GPU
(`tests/test_linear_attention_gpu.py`)."""

from __future__ import annotations

import pytest
import torch
from arch_checks import CPU, EOS, GATED_DELTANET_SHAPE, arch_model, engine_config, prompts_of

from fulcrum.rollout.base import SamplingParams
from fulcrum.rollout.native import NativeEngine
from fulcrum.rollout.native.kernels import IndirectCache
from fulcrum.rollout.native.model_runner import ModelRunner, graph_obstacle
from fulcrum.rollout.native.models.linear_attention import RecurrentStates


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    return arch_model("qwen3_5_text", dict(GATED_DELTANET_SHAPE, num_hidden_layers=4))


class StubGraph:
    """Stands for a captured CUDA graph (the CPU has none): `release_graphs` resets it."""

    def reset(self) -> None:
        pass


def pretend_captured(runner: ModelRunner) -> None:
    runner.graphs = {1: (StubGraph(), torch.zeros(1))}
    runner._graphs_addresses = runner.graph_addresses()


def test_a_wake_up_that_moves_the_recurrent_states_drops_the_decode_graphs(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the KV cache read through its device-held address (graphs survive a moved cache), the
    states still count: new states elsewhere drop the graphs, the same states back keep them."""
    engine = NativeEngine(model, [EOS], 0, engine_config(free_cache_engine=False), CPU)
    runner = engine.runner
    runner.indirect = IndirectCache(runner._cache_shape(), runner.model.dtype, CPU)
    runner.indirect.point_to(runner.kv_cache)
    assert runner.graph_addresses() == (runner.states.conv.data_ptr(), runner.states.delta.data_ptr())
    pretend_captured(runner)
    old = runner.states  # still held: the new states cannot take its memory
    engine.sleep()
    engine.wake_up()
    assert runner.states.delta.data_ptr() != old.delta.data_ptr()
    assert runner.graphs == {}
    pretend_captured(runner)
    again = runner.states
    monkeypatch.setattr(RecurrentStates, "empty", lambda *args, **kwargs: again)
    engine.sleep()
    engine.wake_up()
    assert runner.states is again and set(runner.graphs) == {1}


def test_a_captures_warm_up_steps_only_the_scratch_state_slot(model: torch.nn.Module) -> None:
    """The warm-up run before a capture executes the decode step, which the replay then executes again:
    it must leave every sequence's state as it found it (a recurrent step is not idempotent)."""
    engine = NativeEngine(model, [EOS], 0, engine_config(free_cache_engine=False), CPU)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.seed_requests(params)
    seq_id = engine.add_request(prompts_of([11])[0], params, keep=True)
    while engine.has_unfinished_requests():
        engine.step()
    runner = engine.runner
    slot = engine.scheduler.held[seq_id].state_slot
    assert slot != 0
    runner.state_slots[:2] = torch.tensor([slot, 0])  # row 1 pads the batch (block 0, slot 0)
    runner.state_writes[:2] = torch.tensor([slot, 0])
    runner.input_ids[1] = 5  # not the pad id, whose embedding row is zeros
    before = (runner.states.conv.clone(), runner.states.delta.clone())
    width = runner.max_blocks_per_seq * runner.block_size
    runner._decode_forward(2, width, scratch_states=True)
    for after, was in zip((runner.states.conv, runner.states.delta), before, strict=True):
        assert torch.equal(after[:, 1:], was[:, 1:])  # every slot but the scratch one
        assert not torch.equal(after[:, 0], was[:, 0])
    runner._decode_forward(2, width)  # the step itself moves the row's slot on
    assert not torch.equal(runner.states.delta[:, slot], before[1][:, slot])


def test_no_graph_where_the_experts_products_read_their_row_counts_on_the_host(
    model: torch.nn.Module,
) -> None:
    """On CUDA torch's grouped GEMM takes bf16 only: Qwen3-Next's experts in float32 loop over the
    experts with each one's row count read on the host, which a graph cannot capture, and the engine
    says so; in bf16 (and on the CPU, in any dtype) the counts stay on the device. A dense model has
    no experts to stop it."""
    shape = dict(GATED_DELTANET_SHAPE, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2)
    moe = arch_model("qwen3_next", shape | dict(moe_intermediate_size=32, shared_expert_intermediate_size=48))
    decoder = NativeEngine(moe, [EOS], 0, engine_config(), CPU).model
    assert graph_obstacle(decoder) is None  # the CPU
    decoder.device = torch.device("cuda")  # the rule reads the device's type and the dtype only
    assert "float32 read each expert's row count on the host" in graph_obstacle(decoder)
    decoder.dtype = torch.bfloat16
    assert graph_obstacle(decoder) is None
    dense = NativeEngine(model, [EOS], 0, engine_config(), CPU).model
    dense.device = torch.device("cuda")
    assert graph_obstacle(dense) is None
