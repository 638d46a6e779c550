"""`fulcrum doctor`'s lever rules and memory estimate: each rule fires on the setting it names (with keys,
why and fix) and stays silent on the seed command; the estimate matches the model's size and predicts an
out-of-memory on a card too small."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import GSM8K_ROW as ROW
from helpers import QWEN25_05B, model_folder_of_shape, seed_command

from fulcrum.config import load_config
from fulcrum.models.arch import model_shape
from fulcrum.rollout.native.memory import kv_cache_budget
from fulcrum.tools import doctor, doctor_rules
from fulcrum.tools.memory_estimate import estimate, param_count


@pytest.fixture
def files(tmp_path: Path, tiny_model: Path) -> Path:
    """GSM8K-sized parquet files (7,473 training and 1,319 test rows) and a model folder whose config.json
    says Qwen2.5-0.5B (doctor reads the shape; it loads no weights)."""
    for name, rows in (("train.parquet", 7473), ("test.parquet", 1319)):
        pq.write_table(pa.Table.from_pylist([ROW] * rows), tmp_path / name)
    model_folder_of_shape(tiny_model, tmp_path / "model", QWEN25_05B)
    return tmp_path


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = doctor.main(argv)
    return code, capsys.readouterr().out


def test_response_length_differing_from_data(files: Path, capsys) -> None:
    code, out = run([*seed_command(files), "actor_rollout_ref.rollout.response_length=200"], capsys)
    assert code == 0
    assert "actor_rollout_ref.rollout.response_length=200 differs from data.max_response_length=256" in out
    assert "fix:  set data.max_response_length=200" in out
    _, out = run(seed_command(files), capsys)
    assert "differs from data.max_response_length" not in out


def test_prompts_dropped_each_epoch(files: Path, capsys) -> None:
    _, out = run(seed_command(files), capsys)  # GSM8K: 7,473 = 14 x 512 + 305
    assert "7,473 training prompts at 512 a step = 14 steps per epoch; 305 prompts (4.1%) dropped" in out
    _, out = run(
        [
            *seed_command(files),
            "data.train_batch_size=141",
            "actor_rollout_ref.actor.ppo_mini_batch_size=141",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
            "critic.ppo_micro_batch_size_per_gpu=3",
        ],
        capsys,
    )
    assert "dropped" not in out  # 7,473 = 53 x 141


def test_dynamic_batch_token_limit_below_one_sequence(files: Path, capsys) -> None:
    dynamic = [*seed_command(files), "actor_rollout_ref.actor.use_dynamic_bsz=True"]
    code, out = run([*dynamic, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=300"], capsys)
    assert code == 1
    assert (
        "error: actor_rollout_ref.actor.ppo_max_token_len_per_gpu=300 is below one sequence of up to 768 tokens"
        in out
    )
    code, out = run([*dynamic, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2304"], capsys)
    assert code == 0 and "is below one sequence" not in out
    code, out = run(
        [*seed_command(files), "critic.use_dynamic_bsz=True", "critic.ppo_max_token_len_per_gpu=500"], capsys
    )
    assert code == 1 and "critic.ppo_max_token_len_per_gpu=500" in out


def test_prefill_budget_below_the_longest_prompt(files: Path, capsys) -> None:
    _, out = run([*seed_command(files), "actor_rollout_ref.rollout.max_num_batched_tokens=256"], capsys)
    assert "max_num_batched_tokens=256 is below the longest prompt (512 tokens)" in out
    _, out = run(seed_command(files), capsys)  # 16,384
    assert "below the longest prompt" not in out


def test_tensor_parallel_size_must_divide_the_heads(files: Path, capsys) -> None:
    # Qwen2.5-0.5B: 14 attention heads, 2 KV heads.
    _, out = run([*seed_command(files), "actor_rollout_ref.rollout.tensor_model_parallel_size=4"], capsys)
    assert "tensor_model_parallel_size=4 does not divide the model's 14 attention heads and 2 KV heads" in out
    assert "tensor_model_parallel_size in [1, 2]" in out
    _, out = run([*seed_command(files), "actor_rollout_ref.rollout.tensor_model_parallel_size=2"], capsys)
    assert "does not divide the model's" not in out


def test_target_kl_with_the_fixed_controller(files: Path, capsys) -> None:
    _, out = run(seed_command(files), capsys)  # the seed sets target_kl=0.05, type stays fixed
    assert "algorithm.kl_ctrl.target_kl set with algorithm.kl_ctrl.type=fixed: no effect" in out
    argv = [c for c in seed_command(files) if not c.startswith("algorithm.kl_ctrl.target_kl")]
    _, out = run(argv, capsys)
    assert "type=fixed: no effect" not in out
    _, out = run(
        [*seed_command(files), "algorithm.kl_ctrl.type=adaptive", "algorithm.use_kl_in_reward=True"], capsys
    )
    assert "type=fixed: no effect" not in out


def test_more_devices_than_the_machine_has(files: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(doctor, "cuda_device_count", lambda: 1)
    cuda = [*seed_command(files), "trainer.device=cuda", "trainer.n_gpus_per_node=2"]
    code, out = run([*cuda, "--device-memory-gib", "140"], capsys)
    assert (
        code == 1 and "the run asks for 2 device(s) but 1 are visible; set trainer.n_gpus_per_node=1" in out
    )
    code, out = run([*seed_command(files), "trainer.device=cuda", "--device-memory-gib", "140"], capsys)
    assert code == 0 and "device(s) but" not in out


def test_max_num_seqs_below_one_steps_responses(files: Path, capsys) -> None:
    _, out = run([*seed_command(files), "actor_rollout_ref.rollout.max_num_seqs=200"], capsys)
    assert "max_num_seqs=200 is below the 512 responses a device generates per step" in out
    assert "about 3 waves" in out
    _, out = run(seed_command(files), capsys)  # 1,896
    assert "waves" not in out


def test_kv_cache_too_small_for_a_steps_sequences(files: Path, capsys) -> None:
    """0.05 of an H200 was measured to preempt at the seed's 512 × 256 (docs/levers.md); 0.65 holds
    every sequence at its longest many times over."""
    _, out = run([*seed_command(files), "actor_rollout_ref.rollout.gpu_memory_utilization=0.05"], capsys)
    assert "a step's sequences at their longest need 393,216: the rollout preempts" in out
    assert "fix:  actor_rollout_ref.rollout.gpu_memory_utilization=0.0" in out
    _, out = run(seed_command(files), capsys)
    assert "preempts" not in out


def test_kv_tokens_needed_counts_a_shared_prompt_once_and_only_the_sequences_at_once() -> None:
    assert doctor_rules.kv_tokens_needed(512, 1, 1896, 512, 256) == 512 * (512 + 256)
    assert (
        doctor_rules.kv_tokens_needed(64, 8, 1896, 512, 256) == 64 * 512 + 512 * 256
    )  # GRPO: n share a prompt
    assert doctor_rules.kv_tokens_needed(64, 8, 128, 512, 256) == 16 * 512 + 128 * 256  # waves of 128


# ---------------------------------------------------------------------------------------- memory
def test_logit_chunk_matches_the_training_code() -> None:
    from fulcrum.models.linear_logprob import CHUNK_ELEMENTS
    from fulcrum.tools.memory_estimate import LOGIT_CHUNK_ELEMENTS

    assert LOGIT_CHUNK_ELEMENTS == CHUNK_ELEMENTS


def test_checkpointed_activations_match_the_training_code() -> None:
    from fulcrum.models.packed import SAVE_ATTENTION_OUTPUTS
    from fulcrum.tools.memory_estimate import ATTENTION_OUTPUTS_KEPT

    assert ATTENTION_OUTPUTS_KEPT == SAVE_ATTENTION_OUTPUTS


def test_the_estimate_parks_optimiser_state_when_the_key_says_so(files: Path) -> None:
    """trainer.park_optimizer_state (on by default): each update leaves out the other model's AdamW state."""
    totals = {}
    for parked in (False, True):
        key = f"trainer.park_optimizer_state={parked}"
        totals[parked] = {p.name: p.total for p in seed_estimate(files, key).phases}
    assert totals[True] == {p.name: p.total for p in seed_estimate(files).phases}
    shape = model_shape(QWEN25_05B)
    critic_state = 8 * (param_count(shape, lm_head=False) + shape.hidden + 1)
    actor_state = 8 * param_count(shape)
    assert totals[False]["actor update"] - totals[True]["actor update"] == critic_state
    assert totals[False]["critic update"] - totals[True]["critic update"] == actor_state
    assert totals[False]["generation"] == totals[True]["generation"]


def test_the_estimate_keeps_what_the_micro_batches_graphs_keep(files: Path) -> None:
    """With CUDA graphs of the micro-batches (actor_rollout_ref.actor.cuda_graphs, on by default, which the
    critic's key follows) each model's bf16 compute weights and a bf16 buffer of their gradients (4 B a
    parameter) stay resident and the graphs' pool holds the largest forward's work beside the largest
    update's: every phase holds them, and a graphed phase counts neither its compute weights nor its
    micro-batch's work again."""
    from fulcrum.tools import graphs_estimate
    from fulcrum.workers.cuda_graphs import MAX_RESIDENT_SHARE

    assert graphs_estimate.GRAPHS_RESIDENT_SHARE == MAX_RESIDENT_SHARE
    phases = {}
    for graphs in (False, True):
        est = seed_estimate(files, f"actor_rollout_ref.actor.cuda_graphs={graphs}")
        phases[graphs] = {p.name: p for p in est.phases}
    assert {p.name: p.total for p in seed_estimate(files).phases} == {
        name: p.total for name, p in phases[True].items()
    }
    shape = model_shape(QWEN25_05B)
    actor, critic = param_count(shape), param_count(shape, lm_head=False) + shape.hidden + 1
    pool = phases[True]["generation"].items["CUDA graphs' memory pool"]
    assert 0 < pool < 8 * 2**30
    grown = {name: phases[True][name].total - phases[False][name].total for name in phases[True]}
    work_items = (
        "activations",
        "LM head",
        "the attention kernel",
        "hidden states",
        "one layer's",
        "one block",
    )

    def work(name: str) -> float:  # the phase's own micro-batch work, counted when it runs eagerly
        return sum(v for k, v in phases[False][name].items.items() if k.startswith(work_items))

    assert grown["generation"] == 4 * (actor + critic) + pool
    assert grown["actor update"] == 4 * critic + pool - work("actor update")
    assert grown["critic update"] == 4 * actor + pool - work("critic update")
    assert grown["values forward"] == 4 * (actor + critic) - 2 * critic + pool - work("values forward")
    # the pool: the largest forward's work, and beside it the largest update's with its bf16 gradients
    forwards = max(work("old log-prob forward"), work("values forward"))
    assert pool == forwards + max(2 * actor + work("actor update"), 2 * critic + work("critic update"))


def test_the_estimate_says_which_models_replay_graphs_and_why_the_others_do_not(files: Path) -> None:
    """Where a cuda_graphs key cannot act (several processes, padded micro-batches, sequence parallelism,
    LoRA) it is ignored, as the trainer does: doctor's estimate (of a CUDA device) names the reason, and
    counts nothing kept for that model's graphs."""
    from fulcrum.tools.memory_estimate import format_estimate

    assert seed_estimate(files).graphs == {"actor": None, "critic": None}
    off = seed_estimate(files, "critic.cuda_graphs=false")
    assert off.graphs == {"actor": None, "critic": "critic.cuda_graphs=false"}
    assert "  CUDA graphs of the micro-batches: actor on, critic off (critic.cuda_graphs=false)" in (
        format_estimate(off)
    )
    kept = "critic compute weights and gradients kept for CUDA graphs (bf16)"
    assert kept in seed_estimate(files).phases[0].items and kept not in off.phases[0].items
    ignored = {
        "trainer.n_gpus_per_node=2": ("several processes", "several processes"),
        "critic.model.use_remove_padding=false": (
            None,
            "padded micro-batches (critic.model.use_remove_padding=false)",
        ),
        "critic.ulysses_sequence_parallel_size=2": (None, "sequence parallelism"),
        "actor_rollout_ref.model.lora_rank=8": ("LoRA adapters", None),
    }
    for key, (actor, critic) in ignored.items():
        assert seed_estimate(files, key).graphs == {"actor": actor, "critic": critic}, key


def test_parameter_count_of_qwen25_05b() -> None:
    assert param_count(model_shape(QWEN25_05B)) == 494_032_768  # the published 0.49B


# The peaks below were measured before the micro-batches' graphs.
NO_GRAPHS = "actor_rollout_ref.actor.cuda_graphs=false"


def seed_estimate(files: Path, *extra: str, device_gib: float = 140.0):
    cfg = load_config([*seed_command(files), *extra])
    shape = model_shape(QWEN25_05B)
    return estimate(
        cfg, shape, device_gib * 2**30, True, uses_critic=True, uses_reference=False, responses_per_device=512
    )


def test_seed_estimate_against_the_measured_h200_peak(files: Path) -> None:
    """BENCHMARKS.md ("The KV cache cut to what the engine can use", 2026-12-03, tree 8c5daf6): the seed
    command on one H200 peaked at 26.39 GiB allocated, while generating, with the critic's AdamW state
    parked (it waits in host memory from the actor's update to its own), without CUDA graphs of the
    micro-batches. The estimate is an upper bound
    above it by at most what it counts and that run did not hold: that state (resident again after a
    checkpoint), the engine's workspace whole (sized for max_num_seqs rows of logits; the seed decodes 512)
    and the CUDA context (outside torch's allocated figure)."""
    est = seed_estimate(files, NO_GRAPHS)
    generation = est.peak
    assert generation.name == "generation"
    measured = 26.39 * 2**30
    not_held = sum(
        generation.items[k]
        for k in ("critic AdamW state (fp32)", "engine workspace", "CUDA context and workspaces")
    )
    assert measured <= generation.total <= measured + not_held


MICRO = (
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size_per_gpu",
    "critic.forward_micro_batch_size_per_gpu",
)
# perf/max_memory_allocated_gb/<phase> of the 0.5B seed command on one H200, warm step, with whether the
# checkpointed layers kept the attention outputs then and whether the other model's optimiser state was
# parked during each update (BENCHMARKS.md): the seed's sizes with them kept (tree 16babe3), and with the
# state parked as well (tree 0ecd48f, "Optimiser state parked between updates": the updates only, the
# forwards then ran with the critic's state still parked, which a checkpoint brings back); before they
# were (tree 4facc41, "Spent gradients released, on a slower host" and "Lever tuning", 2026-12-01), the
# seed's sizes, fulcrum tune's micro-batch 64 row and dynamic
# batches of 16,384 tokens (the critic's budget stays at its default 32,768).
MEASURED_PEAKS_GIB = [
    ((), True, True, {"critic update": 12.61, "actor update": 13.46}),
    (
        (),
        True,
        False,
        {
            "old log-prob forward": 13.52,
            "values forward": 13.38,
            "critic update": 16.40,
            "actor update": 17.13,
        },
    ),
    (
        (),
        False,
        False,
        {
            "old log-prob forward": 13.51,
            "values forward": 13.37,
            "critic update": 16.14,
            "actor update": 16.87,
        },
    ),
    (
        tuple(f"{key}={size}" for key, size in zip(MICRO, (64, 128, 64, 128), strict=True)),
        False,
        False,
        {
            "old log-prob forward": 15.53,
            "values forward": 15.53,
            "critic update": 18.31,
            "actor update": 18.58,
        },
    ),
    (
        (
            "actor_rollout_ref.actor.use_dynamic_bsz=True",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384",
        ),
        False,
        False,
        {
            "old log-prob forward": 13.62,
            "values forward": 14.01,
            "critic update": 16.75,
            "actor update": 17.36,
        },
    ),
]


@pytest.mark.parametrize(("overrides", "attention_outputs_kept", "parked", "measured"), MEASURED_PEAKS_GIB)
def test_training_phase_estimates_against_the_measured_h200_peaks(
    files: Path,
    overrides: tuple[str, ...],
    attention_outputs_kept: bool,
    parked: bool,
    measured: dict[str, float],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each training phase within 10% of its measured peak, from 6k- to 49k-token micro-batches (the
    modelling before 2026-12-01, with float32 activations and logit blocks, was 18-27% over at micro 64),
    estimated for the checkpointing the peak was measured with."""
    from fulcrum.tools import memory_estimate

    monkeypatch.setattr(memory_estimate, "ATTENTION_OUTPUTS_KEPT", attention_outputs_kept)
    keys = (NO_GRAPHS, f"trainer.park_optimizer_state={parked}")
    estimated = {p.name: p.total / 2**30 for p in seed_estimate(files, *overrides, *keys).phases}
    for phase, peak in measured.items():
        assert abs(estimated[phase] - peak) / peak < 0.10, (phase, estimated[phase], peak)


def test_checkpointing_and_micro_batch_move_the_update_estimate(files: Path) -> None:
    def actor_update(*extra: str) -> float:
        phases = seed_estimate(files, NO_GRAPHS, *extra).phases
        return next(p.total for p in phases if p.name == "actor update")

    base = actor_update()
    no_checkpointing = actor_update("actor_rollout_ref.model.enable_gradient_checkpointing=False")
    bigger_micro = actor_update("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32")
    assert no_checkpointing > base and bigger_micro > base
    # Measured (BENCHMARKS.md, tree 10ad1ac, 2026-11-30): the actor's checkpointing off raised its
    # update's peak by 5.4 GiB at micro 8 (6,144 tokens): 24 layers' bf16 tensors instead of their inputs.
    assert abs((no_checkpointing - base) / 2**30 - 5.4) / 5.4 < 0.10


def test_out_of_memory_predicted_on_a_small_card(files: Path, capsys) -> None:
    code, out = run([*seed_command(files), "--device-memory-gib", "16"], capsys)
    assert code == 1
    # generation: the two models' training state fills the card (the updates fit: each parks the other
    # model's AdamW state in host memory)
    assert "predicted out of memory in generation" in out and "16.0 GiB device" in out
    assert "leaves no room for the KV cache" in out
    assert "other phase: actor update 14.0 GiB" in out
    code, out = run([*seed_command(files), "--device-memory-gib", "140"], capsys)
    assert code == 0 and "predicted out of memory" not in out
    # 34.1 GiB without the micro-batches' graphs: +4 B a parameter of each model and their pool (2.8 GiB)
    assert "memory estimate per device (device 140.0 GiB): peak 40.6 GiB while in generation" in out
    assert "2.80 GiB  CUDA graphs' memory pool" in out


def test_reference_and_hf_backend_in_the_estimate(files: Path) -> None:
    shape = model_shape(QWEN25_05B)
    cfg = load_config([*seed_command(files), "actor_rollout_ref.rollout.name=hf"])
    without = estimate(
        cfg, shape, 140 * 2**30, True, uses_critic=True, uses_reference=False, responses_per_device=512
    )
    with_ref = estimate(
        cfg, shape, 140 * 2**30, True, uses_critic=True, uses_reference=True, responses_per_device=512
    )
    generation = with_ref.phases[0]
    assert generation.items["reference weights (fp32)"] == 4 * param_count(shape)
    # and its bf16 compute weights, kept for the graphs of its micro-batches
    assert generation.items["reference compute weights kept for CUDA graphs"] == 2 * param_count(shape)
    assert with_ref.peak.total - without.peak.total == 6 * param_count(shape)
    # hf: the cache of the decoding batch, 512 sequences x 768 tokens x 24 layers x K and V x 2 heads x 64 x 2 bytes
    assert generation.items["KV cache of generate (bf16)"] == 512 * 768 * 24 * 2 * 2 * 64 * 2


def test_the_reference_pass_is_a_phase_at_its_own_micro_batch(files: Path) -> None:
    """The trainer runs the reference's log-probs as a pass of their own, micro-batched by the ref's keys:
    at 128 rows of 768 tokens against the old log-probs' 16 its hidden states and working set are 8x, and it
    is the largest forward."""
    shape = model_shape(QWEN25_05B)
    keys = [*seed_command(files), NO_GRAPHS, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=128"]
    est = estimate(
        load_config(keys),
        shape,
        140 * 2**30,
        True,
        uses_critic=True,
        uses_reference=True,
        responses_per_device=512,
    )
    phases = {p.name: p for p in est.phases}
    ref, old = phases["reference log-prob forward"], phases["old log-prob forward"]
    tokens = 128 * 768
    assert ref.items["hidden states, micro-batch of 128 x 768 tokens"] == 2 * shape.hidden * tokens
    assert ref.items["one layer's working set"] == 2 * (shape.hidden + 3 * shape.intermediate) * tokens
    assert ref.items["bf16 compute weights"] == 2 * param_count(shape)  # the reference's own copies
    assert ref.total > old.total
    without = estimate(
        load_config(keys),
        shape,
        140 * 2**30,
        True,
        uses_critic=True,
        uses_reference=False,
        responses_per_device=512,
    )
    assert "reference log-prob forward" not in {p.name for p in without.phases}


def test_the_kv_cache_leaves_the_engine_workspace_room_on_a_full_card(files: Path) -> None:
    """The engine sizes its cache from what is free before its workspace exists: a cache that took all of
    it less 1 GiB would leave a prefill step or the sampler no room (the estimate said 27.1 GiB in
    generation on a 24 GiB card for the seed command). Cache + workspace + 1 GiB now fit in what is free."""
    shape = model_shape(QWEN25_05B)
    cfg = load_config([*seed_command(files)])
    est = estimate(
        cfg, shape, 24 * 2**30, True, uses_critic=True, uses_reference=False, responses_per_device=512
    )
    generation = est.phases[0]
    assert generation.total <= 24 * 2**30 - 2**30
    utilization = cfg.actor_rollout_ref.rollout.gpu_memory_utilization
    weights, workspace = generation.items["engine weights (bf16)"], generation.items["engine workspace"]
    by_fraction = kv_cache_budget(24 * 2**30, utilization, weights, workspace, float("inf"))
    assert 0 < est.kv_cache_bytes < by_fraction  # what is free bounds it here, not the fraction
    assert kv_cache_budget(100.0, 0.5, 10.0, 5.0, 1e12) == 35.0  # the fraction: 50 - 10 - 5
    assert kv_cache_budget(100.0, 0.5, 10.0, 5.0, 2**30 + 20.0) == 15.0  # free - workspace - 1 GiB


# Qwen3.5-0.8B's text config (the sizes the estimate reads).
QWEN3_5_08B = {
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 24,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "tie_word_embeddings": True,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
}


def test_the_estimate_counts_a_hybrid_models_recurrent_states(files: Path) -> None:
    """Qwen3.5-0.8B: 18 linear-attention layers, each sequence 16 x 128 x 128 float32 state and a
    3-input conv window of 6,144 bf16 channels a layer (19.1 MiB); max_num_seqs 1,896 + 2 slots; K/V in
    the 6 attention layers only."""
    cfg = load_config([*seed_command(files)])
    est = estimate(cfg, model_shape(QWEN3_5_08B), 140 * 2**30, True, True, False, 512)
    per_seq = 18 * (16 * 128 * 128 * 4 + 6144 * 3 * 2)
    states = est.phases[0].items["recurrent states of the linear-attention layers (1898 slots)"]
    assert states == 1898 * per_seq
    assert est.kv_tokens == int(est.kv_cache_bytes // (6 * 2 * 2 * 256 * 2))  # 6 layers x (K, V) x 2 heads
    # its micro-batches run eagerly, as the trainer runs them: nothing kept for graphs
    assert est.graphs == {"actor": "linear-attention layers", "critic": "linear-attention layers"}
    assert not any("CUDA graphs" in name for name in est.phases[0].items)


def test_bypass_mode_has_no_old_log_prob_forward_in_the_estimate(files: Path, capsys) -> None:
    """Rollout correction's bypass mode takes the engine's log-probs as the old ones (the trainer runs no
    old-log-prob pass): doctor's estimate has no such phase, and its summary says where they come from."""
    names = {p.name for p in seed_estimate(files).phases}
    assert "old log-prob forward" in names
    bypass = "algorithm.rollout_correction.bypass_mode=True"
    assert "old log-prob forward" not in {p.name for p in seed_estimate(files, bypass).phases}
    code, out = run([*seed_command(files), bypass, "--device-memory-gib", "140"], capsys)
    assert code == 0 and "old log-probs from the rollout (bypass mode: no old-log-prob pass)" in out


def test_partial_rollouts_that_release_the_cache_are_told_where_keeping_it_fits(files: Path, capsys) -> None:
    """Under colocate_async with verl's free_cache_engine=True the held samples are prefilled again every
    step: doctor names free_cache_engine=False where the estimate with the cache kept fits the device,
    and says nothing once it is kept, on synchronous steps, or where the kept cache would not fit."""
    partial = ["trainer.use_v1=True", "trainer.v1.trainer_mode=colocate_async"]
    out = run([*seed_command(files), *partial, "--device-memory-gib", "140"], capsys)[1]
    assert "warning: actor_rollout_ref.rollout.free_cache_engine=True under partial rollouts" in out
    assert "actor_rollout_ref.rollout.free_cache_engine=False" in out and "of 140.0 GiB" in out
    kept = "actor_rollout_ref.rollout.free_cache_engine=False"
    assert (
        "under partial rollouts"
        not in run([*seed_command(files), *partial, kept, "--device-memory-gib", "140"], capsys)[1]
    )
    assert (
        "under partial rollouts" not in run([*seed_command(files), "--device-memory-gib", "140"], capsys)[1]
    )
    # the engine's cache beside an update of large micro-batches without checkpointing would not fit
    heavy = [
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.actor.cuda_graphs=False",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "--device-memory-gib",
        "60",
    ]
    code, out = run([*seed_command(files), *partial, *heavy], capsys)
    assert code == 0 and "free_cache_engine=True under partial rollouts" not in out, out
