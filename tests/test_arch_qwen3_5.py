"""Qwen3.5 (dense text, `qwen3_5_text`): Gated DeltaNet linear attention in three layers of four beside
output-gated full attention with partial RoPE. The training path: padded and packed log-probs within
1e-5 of Hugging Face's forward of each sequence alone, sequence boundaries of a packed stream resetting
the recurrent state and the conv window."""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import sys
import types
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from arch_checks import (
    CPU,
    EOS,
    GATED_DELTANET_SHAPE,
    arch_model,
    check_greedy_equals_hf_generate,
    check_multimodal_folder_runs_as_its_text_model,
    check_training_log_probs_equal_hf,
    engine_config,
    hf_greedy,
    prompts_of,
)
from helpers import cpu_ppo_overrides, log_probs_of, make_assets
from transformers import AutoConfig

from fulcrum.models import gated_delta
from fulcrum.models.arch import model_shape
from fulcrum.models.arch.spec import kv_bytes_per_token, param_count, recurrent_state_bytes
from fulcrum.models.gated_delta import runs_fla
from fulcrum.models.load import load_causal_lm
from fulcrum.models.packed import enable_packed_attention, pack_micro_batch, packed_hidden_states
from fulcrum.models.packed_recurrent import enable_packed_recurrence
from fulcrum.rollout.base import SamplingParams
from fulcrum.rollout.native import NativeEngine
from fulcrum.rollout.native.models.linear_attention import turn_ended
from fulcrum.rollout.testing import random_causal_lm, scoring_batch
from fulcrum.trainer.main_ppo import main

# 8 layers: linear, linear, linear, full, twice.
SHAPE = dict(GATED_DELTANET_SHAPE, num_hidden_layers=8)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    return arch_model("qwen3_5_text", SHAPE)


def test_the_shape_counts_every_parameter_and_the_state(model: torch.nn.Module) -> None:
    shape = model_shape(model.config)
    assert (shape.layers, shape.linear_layers, shape.attention_layers) == (8, 6, 2)
    assert param_count(shape) == sum(p.numel() for p in model.parameters())
    # K/V only in the two attention layers: 2 layers x (K, V) x 2 heads x 16 x 2 bytes
    assert kv_bytes_per_token(shape) == 2 * 2 * 2 * 16 * 2
    # per linear layer: 4 x 8 x 12 float32 state + (2·2·8 + 4·12) channels x 3 taps in bf16
    assert recurrent_state_bytes(shape) == 6 * (4 * 8 * 12 * 4 + (32 + 48) * 3 * 2)


def test_training_log_probs_equal_hf_padded_and_packed() -> None:
    """At init std 0.1: at 0.2 the responses' log-probs average -9.4 nats, and the padded row's chunked
    delta rule (zeros ahead of the prompt in the same chunk) rounds differently from the sequence alone by
    1.4e-5 there (1.5e-6 relative; 2.9e-6 at 0.1), while a state carried across a boundary moves them by
    more than 1e-2."""
    check_training_log_probs_equal_hf(arch_model("qwen3_5_text", SHAPE, init_std=0.1))


def test_a_packed_stream_resets_the_state_at_each_sequence_start(model: torch.nn.Module) -> None:
    """Two sequences packed end to end: the second one's hidden states equal those of it alone (HF's
    forward), not those of its tokens read after the first sequence's."""
    packed = copy.deepcopy(model)
    assert enable_packed_recurrence(packed) == 6
    enable_packed_attention(packed)
    first, second = torch.randint(3, 1000, (1, 11)), torch.randint(3, 1000, (1, 7))
    ids = torch.cat([first, second], 1)
    stream = pack_micro_batch(
        ids, torch.ones_like(ids), torch.cat([torch.arange(11), torch.arange(7)])[None], 11
    )
    stream.cu_seqlens = torch.tensor([0, 11, 18], dtype=torch.int32)
    with torch.no_grad():
        got = packed_hidden_states(packed.model, stream)[11:]
        alone = model.model(input_ids=second).last_hidden_state[0]
        carried = model.model(input_ids=ids).last_hidden_state[0, 11:]
    assert (got - alone).abs().max() < 1e-5
    assert (carried - alone).abs().max() > 1e-2  # the check would see a state carried over


@pytest.mark.parametrize("built", ["loaded", "from_config"])
def test_the_packed_state_reset_survives_train_and_eval(built: str, tmp_path: Path) -> None:
    """transformers (5.2x, with the `kernels` package it requires) kernelizes a model at each `train()` /
    `eval()` and resets the Gated DeltaNet's forward there: the actor's model, loaded from a folder or
    built from a config, keeps its packed state reset through both, and its packed log-probs equal the
    padded ones."""
    model = arch_model("qwen3_5_text", SHAPE, init_std=0.1)
    if built == "loaded":
        model.save_pretrained(tmp_path)
        model = load_causal_lm(str(tmp_path), CPU)
        assert not getattr(model, "use_kernels", False)
    enable_packed_attention(model)
    model.train()
    model.eval()
    model.train()
    prompts, responses = prompts_of([5, 11, 3], seed=3), prompts_of([8, 8, 8], seed=4)
    batch = scoring_batch(prompts, responses)
    mask = batch["response_mask"].bool()
    padded, _ = log_probs_of(model, batch, 1.0, False, CPU, packed=False)
    packed, _ = log_probs_of(model, batch, 1.0, False, CPU, packed=True)
    assert (padded - packed)[mask].abs().max() < 1e-5


def test_packed_gradients_equal_padded(model: torch.nn.Module) -> None:
    """The packed path's backward through the grid: the weights' gradients of a packed forward equal
    those of each sequence's own forward."""
    packed = copy.deepcopy(model).train()
    enable_packed_attention(packed)
    reference = copy.deepcopy(model).train()
    lengths = [9, 4, 13]
    generator = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 1000, (n,), generator=generator) for n in lengths]
    ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    stream = pack_micro_batch(ids, torch.ones_like(ids), positions, ids.shape[1])
    stream.cu_seqlens = torch.tensor([0, 9, 13, 26], dtype=torch.int32)
    packed_hidden_states(packed.model, stream).square().sum().backward()
    for seq in seqs:
        reference.model(input_ids=seq[None]).last_hidden_state.square().sum().backward()
    weight = "layers.0.linear_attn.in_proj_qkv.weight"
    got = dict(packed.model.named_parameters())[weight].grad
    expected = dict(reference.model.named_parameters())[weight].grad
    # float32 rounding, which the gated norm amplifies where a head's output is small (it divides by the
    # head's RMS): within 1e-4 of the gradient's scale (a state carried across a boundary moves it by
    # percents)
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


def qwen3_5_assets(root: Path) -> Path:
    """`make_assets`' tiny tokenizer and data, with a random Qwen3.5 model in place of its model."""
    make_assets(root, num_train=4, num_test=2)
    tiny = AutoConfig.from_pretrained(root / "model")
    ids = dict(eos_token_id=tiny.eos_token_id, pad_token_id=tiny.pad_token_id, bos_token_id=None)
    model = random_causal_lm("qwen3_5_text", vocab_size=tiny.vocab_size, hidden_size=32, **SHAPE)
    model.config.update(ids)
    model.generation_config.update(**ids)
    for stale in (root / "model").glob("*.safetensors"):
        stale.unlink()
    model.save_pretrained(root / "model", safe_serialization=True)
    return root


def test_a_grpo_step_on_the_cpu_samples_natively_and_trains_packed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assets = qwen3_5_assets(tmp_path / "assets")
    run = tmp_path / "run"
    keys = {
        "algorithm.adv_estimator": "grpo",
        "actor_rollout_ref.rollout.name": "native",
        "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.model.use_remove_padding": True,
        # a random model's rewards are all 0 (no advantage): the entropy bonus makes the gradient
        "actor_rollout_ref.actor.entropy_coeff": 0.01,
        "data.max_response_length": 6,
        "trainer.total_training_steps": 1,
        "trainer.save_freq": -1,
        "trainer.test_freq": -1,
        "trainer.val_before_train": False,
    }
    with caplog.at_level(logging.WARNING):
        assert main(cpu_ppo_overrides(assets, run, keys)) == 0
    assert "using padded micro-batches" not in caplog.text
    assert "using the hf backend" not in caplog.text
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert math.isfinite(rows[0]["actor/pg_loss"]) and rows[0]["actor/grad_norm"] > 0


def test_greedy_equals_hf_generate(model: torch.nn.Module) -> None:
    """Prefill chunked by a 64-token budget (the 40-token prompt splits across steps beside the
    others), decode windows of 4 steps, each sequence's state in its own slot."""
    check_greedy_equals_hf_generate(model)


def test_chunked_prefill_forks_and_preemption_keep_each_state(model: torch.nn.Module) -> None:
    """A 16-token prefill budget splits the 40-token prompt over three steps (its state carried between
    them); n=2 forks copy the prompt's state into their own slots; 12 blocks of 8 tokens force
    preemptions, whose sequences recompute their state from the first token. Every sample is HF's greedy
    continuation, and every slot is free again at the end."""
    prompts = prompts_of([40, 9, 23])
    config = engine_config(
        max_num_batched_tokens=16, block_size=8, num_kv_blocks=12, headroom_tokens=0, max_model_len=80
    )
    engine = NativeEngine(model, [EOS], 0, config, CPU)
    params = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)
    out = engine.generate(prompts, params)
    assert engine.stats["preemptions"] > 0
    for index, tokens in zip(out.prompt_index, out.token_ids, strict=True):
        assert tokens == hf_greedy(model, prompts[index], 24)
    blocks = engine.scheduler.blocks
    assert len(blocks.free_states) == engine.runner.num_state_slots - 1


def test_a_next_turn_and_sleep_between_turns_continue_as_hf(model: torch.nn.Module) -> None:
    """A held conversation: turn one, sleep and wake, then a next turn with tokens appended; the second
    turn's tokens are HF's greedy continuation of the whole conversation."""
    engine = NativeEngine(model, [EOS], 0, engine_config(free_cache_engine=False), CPU)
    prompt = prompts_of([13])[0]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine.seed_requests(params)
    seq_id = engine.add_request(prompt, params, keep=True)
    first = []
    while engine.has_unfinished_requests():
        first += engine.step()
    assert first[0].token_ids == hf_greedy(model, prompt, 10)
    engine.sleep()
    engine.wake_up()
    tool = [5, 6, 7]
    engine.resume(seq_id, tool, params, keep=False)
    second = []
    while engine.has_unfinished_requests():
        second += engine.step()
    context = prompt + first[0].token_ids + tool
    assert second[0].token_ids[len(first[0].token_ids) + 3 :] == hf_greedy(model, context, 10)
    assert len(engine.scheduler.blocks.free_states) == engine.runner.num_state_slots - 1


def run_all(engine: NativeEngine) -> dict[int, list[int]]:
    """Step until nothing is in flight; each finished turn's tokens by its id."""
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.seq_id: out.token_ids for out in engine.step()})
    return done


@pytest.mark.parametrize("between", ["windows-in-turn", "overlap-windows", "sleep"])
def test_a_held_turn_keeps_its_state_for_the_next_turn(model: torch.nn.Module, between: str) -> None:
    """Two conversations held in a batch whose decode windows (4 steps, the next launched ahead under
    overlap_windows) run on past their ends: one stops at a stop id mid-window, one at its max_tokens
    while a longer request decodes beside them. Their next turns prefill only the new tokens (the tool's
    3 and the last sampled token, whose K/V no step wrote) and continue as HF's greedy continuation of
    the whole conversation. After a sleep (the cache freed) the next turns recompute the conversation."""
    config = engine_config(free_cache_engine=False, overlap_windows=between != "windows-in-turn")
    engine = NativeEngine(model, [EOS], 0, config, CPU)
    stopped, capped, longer = prompts_of([13, 9, 20], seed=3)
    reference = hf_greedy(model, stopped, 12)
    stop = next(t for k, t in enumerate(reference) if k >= 5 and t not in reference[:k])
    cut = reference.index(stop) + 1
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.seed_requests(params)
    first_id = engine.add_request(stopped, replace(params, stop_token_ids=[stop]), keep=True)
    second_id = engine.add_request(capped, replace(params, max_tokens=6), keep=True)
    engine.add_request(longer, replace(params, max_tokens=30))
    first = run_all(engine)
    assert first[first_id] == reference[:cut]
    assert first[second_id] == hf_greedy(model, capped, 6)
    if between == "sleep":
        engine.sleep()
        engine.wake_up()
    tool = [5, 6, 7]
    before = engine.counters["prefill_tokens"]
    engine.resume(first_id, tool, params)
    engine.resume(second_id, tool, params)
    second = run_all(engine)
    contexts = [stopped + first[first_id] + tool, capped + first[second_id] + tool]
    expected = 2 * 4 if between != "sleep" else sum(map(len, contexts))
    assert engine.counters["prefill_tokens"] - before == expected
    for seq_id, context, prompt in zip((first_id, second_id), contexts, (stopped, capped), strict=True):
        assert second[seq_id][len(context) - len(prompt) :] == hf_greedy(model, context, 12)
    assert len(engine.scheduler.blocks.free_states) == engine.runner.num_state_slots - 1


def test_the_cpu_runs_the_torch_path_even_where_fla_imports(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gated DeltaNet's kernels follow the device: flash-linear-attention's on CUDA where it imports, the
    torch reference anywhere else. With fla taken as importable but any import of it failing, and
    transformers' delta-rule names sending every call to fla as transformers does where fla imports (here:
    raising), the CPU engine samples HF's greedy tokens and the packed pass gives HF's hidden states (both
    computed before): neither touched fla."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    assert runs_fla("cuda", True) and not runs_fla("cuda", False) and not runs_fla("cpu", True)
    prompt = prompts_of([9], seed=7)[0]
    ids = torch.tensor([prompt])
    expected_tokens = hf_greedy(model, prompt, 8)
    with torch.no_grad():
        expected = model.model(input_ids=ids).last_hidden_state[0]
    monkeypatch.setattr(gated_delta, "fla_importable", lambda: True)
    monkeypatch.setitem(sys.modules, "fla", None)  # `import fla...` raises ImportError
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        monkeypatch.setattr(modeling_qwen3_5, name, sent_to_fla(getattr(modeling_qwen3_5, name)))
    assert gated_delta.use_fla(torch.device("cuda")) and not gated_delta.use_fla(CPU)
    engine = NativeEngine(model, [EOS], 0, engine_config(), CPU)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert out.token_ids[0] == expected_tokens
    packed = copy.deepcopy(model)
    enable_packed_attention(packed)
    stream = pack_micro_batch(ids, torch.ones_like(ids), torch.arange(9)[None], 9)
    stream.cu_seqlens = torch.tensor([0, 9], dtype=torch.int32)
    with torch.no_grad():
        got = packed_hidden_states(packed.model, stream)
    assert (got - expected).abs().max() < 1e-5


def sent_to_fla(torch_rule: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' wrapper of a torch delta rule where fla imports: fla's kernel whatever the device,
    which fails on CPU tensors (here at once)."""

    @functools.wraps(torch_rule)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")

    return wrapped


@pytest.mark.parametrize(
    ("major", "triton", "tilelang", "refused"),
    [
        (9, "3.6.0", False, True),  # H100 / H200 with torch 2.11's Triton
        (9, "3.4.0", False, True),
        (9, "3.7.0", False, True),
        (9, "3.7.1", False, False),  # fixed in Triton
        (9, "3.3.1", False, False),  # before the regression
        (9, "3.6.0", True, False),  # fla's TileLang backend takes the kernel
        (8, "3.6.0", False, False),  # A100
        (10, "3.6.0", False, False),  # Blackwell
    ],
)
def test_fla_refuses_the_gated_backward_on_hopper_with_triton_3_4_to_3_7_0(
    major: int, triton: str, tilelang: bool, refused: bool
) -> None:
    assert gated_delta.fla_backward_refused(major, triton, tilelang) is refused


class NoFla:
    """An import finder for which `fla` is not installed, wherever this test runs."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "fla":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


@pytest.mark.parametrize(
    ("fla_module", "warned"),
    [(None, False), ("a package without its kernels", True)],
    ids=["not-installed", "installed-without-fla-core"],
)
def test_a_broken_fla_install_is_named_where_a_missing_one_is_not(
    fla_module: str | None, warned: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """flash-linear-attention's wheel holds the models and layers, fla-core the kernels: with the first
    alone `import fla` works and its kernels do not. The torch path runs either way; only the broken
    install, which the user meant to use, is reported, naming what is missing."""
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    if fla_module is None:
        monkeypatch.setattr(sys, "meta_path", [NoFla(), *sys.meta_path])
    else:
        package = types.ModuleType("fla", fla_module)
        package.__path__ = []  # a package with no submodules
        monkeypatch.setitem(sys.modules, "fla", package)
    gated_delta.fla_importable.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=gated_delta.__name__):
            assert gated_delta.fla_importable() is False
    finally:
        gated_delta.fla_importable.cache_clear()
    assert ("fla.modules" in caplog.text) is warned


def test_the_trainer_takes_fla_only_where_fla_takes_the_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where fla refuses the delta rule's backward on the GPU, every training pass of a Gated DeltaNet
    layer runs the torch reference (no-grad passes too: an update's first ratio is one kernel's), while
    the engine, which takes no gradients, keeps fla's kernels."""
    monkeypatch.setattr(gated_delta, "fla_importable", lambda: True)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(gated_delta, "fla_training_refusal", lambda index: None)
    assert gated_delta.fla_trains(cuda) and not gated_delta.fla_trains(CPU)
    monkeypatch.setattr(gated_delta, "fla_training_refusal", lambda index: "fla #640")
    assert not gated_delta.fla_trains(cuda) and gated_delta.use_fla(cuda)


def test_doctor_says_which_linear_attention_layers_run_the_torch_reference_on_this_gpu(
    model: torch.nn.Module, tiny_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a machine with a GPU, doctor warns before the run when a Qwen3.5 model's linear-attention layers
    would run the torch reference: without flash-linear-attention (everywhere: the install to run), or
    where fla refuses their backward (the trainer's passes: its reason); nothing for a model without such
    layers, or with no GPU to ask."""
    from types import SimpleNamespace

    from fulcrum.config import load_config
    from fulcrum.tools.doctor_model import check_linear_attention_kernels

    model.save_pretrained(tmp_path)

    def warnings(path: str, device: str = "cuda", visible: int = 1, *overrides: str) -> list[str]:
        cfg = load_config([f"actor_rollout_ref.model.path={path}", *overrides])
        ctx = SimpleNamespace(cfg=cfg, device=device, n_visible=visible, overrides=[], device_memory_gib=None)
        return [f.message for f in check_linear_attention_kernels(ctx)]

    monkeypatch.setattr(gated_delta, "fla_importable", lambda: False)
    (missing,) = warnings(str(tmp_path))
    assert "6 linear-attention layers run the torch reference" in missing and "[linear-attention]" in missing
    assert warnings(str(tmp_path), "cpu", 0) == [] and warnings(str(tmp_path), "cuda", 0) == []
    assert warnings(tiny_dir) == []  # Qwen2: no linear-attention layers
    monkeypatch.setattr(gated_delta, "fla_importable", lambda: True)
    monkeypatch.setattr(gated_delta, "fla_training_refusal", lambda index: "fla refuses (fla #640)")
    assert warnings(str(tmp_path)) == ["actor_rollout_ref.model.path: fla refuses (fla #640)"]
    (_, padded) = warnings(str(tmp_path), "cuda", 1, "actor_rollout_ref.model.use_remove_padding=False")
    assert padded.startswith("actor_rollout_ref.model.use_remove_padding=False: padded micro-batches")
    monkeypatch.setattr(gated_delta, "fla_training_refusal", lambda index: None)
    assert warnings(str(tmp_path)) == []


def test_padded_training_is_refused_where_fla_would_take_its_gradients_and_refuse(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Padded micro-batches run transformers' own Qwen3.5 forward, which sends the delta rule to fla
    wherever fla imports: where fla refuses that rule's backward, an actor or critic on padded
    micro-batches is refused at build time, naming its use_remove_padding key; the packed path, the
    reference (no gradients) and a model without linear attention are not."""
    from fulcrum.config.keys import ConfigError
    from fulcrum.models import packed_recurrent
    from fulcrum.rollout.testing import random_causal_lm
    from fulcrum.workers import forwards
    from fulcrum.workers.forwards import ModelForwards

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(gated_delta, "fla_importable", lambda: True)
    monkeypatch.setattr(gated_delta, "fla_training_refusal", lambda index: "fla refuses (fla #640)")
    assert packed_recurrent.padded_training_refusal(model, cuda) == "fla refuses (fla #640)"
    assert packed_recurrent.padded_training_refusal(model, CPU) is None  # the torch reference
    assert packed_recurrent.padded_training_refusal(random_causal_lm("qwen2", seed=0), cuda) is None
    monkeypatch.setattr(forwards, "padded_training_refusal", lambda m, d: "fla refuses (fla #640)")
    with pytest.raises(ConfigError, match=r"critic\.model\.use_remove_padding=False: padded .*fla #640"):
        ModelForwards(copy.deepcopy(model), CPU, use_remove_padding=False, role="critic")
    ModelForwards(copy.deepcopy(model), CPU, use_remove_padding=False, role="reference")
    ModelForwards(copy.deepcopy(model), CPU, use_remove_padding=True, role="actor")


def test_turn_ended_marks_a_stop_id_or_the_last_token_of_a_row() -> None:
    tokens = torch.tensor([7, 9, 4, 4])
    stops = torch.tensor([[7, -1], [3, 5], [3, 5], [-1, -1]])
    left = torch.tensor([5, 3, 1, 2])
    assert turn_ended(tokens, stops, left, 0).tolist() == [True, False, True, False]
    assert turn_ended(tokens, stops, left, 2).tolist() == [True, True, False, False]


def test_held_turns_give_their_slots_back_when_a_prompt_needs_one(model: torch.nn.Module) -> None:
    """max_num_seqs=2: three usable state slots, all held by finished conversations, plenty of blocks.
    A new prompt takes the slot of the conversation held longest (an eviction), whose next turn then
    recomputes its tokens and still continues as HF."""
    engine = NativeEngine(model, [EOS], 0, engine_config(max_num_seqs=2, free_cache_engine=False), CPU)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.seed_requests(params)
    prompts = prompts_of([6, 7, 8, 9], seed=5)
    ids = []
    for prompt in prompts[:3]:
        ids.append(engine.add_request(prompt, params, keep=True))
        run_all(engine)
    assert not engine.scheduler.blocks.free_states and engine.counters["evictions"] == 0
    last = engine.add_request(prompts[3], params)
    assert run_all(engine)[last] == hf_greedy(model, prompts[3], 5)
    assert engine.counters["evictions"] == 1
    oldest = engine.scheduler.held[ids[0]]
    context = [*oldest.token_ids, 5, 6]
    engine.resume(ids[0], [5, 6], params)
    assert run_all(engine)[ids[0]][len(context) - 6 :] == hf_greedy(model, context, 5)


def test_a_multimodal_qwen3_5_checkpoint_runs_as_its_text_model(tmp_path: Path) -> None:
    """Qwen3.5 checkpoints ship `qwen3_5` (Qwen3_5ForConditionalGeneration, its text model's config in
    `text_config`), which AutoModelForCausalLM loads as the text model alone (the vision tower left out).
    The trainer's loader, the native engine, doctor's check of the folder and the memory estimate all
    read it as that text model: same logits, sampled natively as HF, its shape counting its parameters."""
    shape = check_multimodal_folder_runs_as_its_text_model("qwen3_5", SHAPE, tmp_path)
    assert shape.linear_layers == 6
