"""verl's own FSDP example launch scripts pass `fulcrum doctor` with only paths and device counts changed.

The overrides of each script are in tests/fixtures/verl_example_overrides.json, with the verl commit
they were read from (regenerate with tests/fixtures/make_verl_example_overrides.py). What a user changes:
data and model paths, the run directory, and the device layout (1 node, trainer.device=cpu here).
Ulysses sequence parallelism stays as each script sets it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_agent_tools import gsm8k_config

from fulcrum.models.tiny import build_tiny_model
from fulcrum.tools import doctor

EXAMPLES = json.loads((Path(__file__).parent / "fixtures" / "verl_example_overrides.json").read_text())
SCRIPTS = sorted(EXAMPLES["scripts"])

PATH_KEYS = ("data.train_files", "data.val_files", "trainer.default_local_dir", "custom_reward_function.path")
MODEL_KEYS = ("actor_rollout_ref.model.path", "critic.model.path", "reward_model.model.path")
DEVICE_KEYS = {
    "trainer.nnodes": "1",
    "trainer.n_gpus_per_node": "8",
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A training set of one full batch for every script, and a real (tiny) model folder."""
    root = tmp_path_factory.mktemp("verl_examples")
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "1 + 1?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"split": "train", "index": 0},
    }
    pq.write_table(pa.Table.from_pylist([row] * 4096), root / "data.parquet")
    build_tiny_model(
        root / "model",
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,  # sequence parallelism of 4 (test_dapo_7b_math.sh) splits them
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=65536,
    )
    # A PEFT adapter folder on that model (verl's from-adapter script starts from one).
    from peft import LoraConfig, get_peft_model

    from fulcrum.models.load import load_causal_lm

    base = load_causal_lm(str(root / "model"), torch.device("cpu"))
    get_peft_model(base, LoraConfig(r=4, target_modules="all-linear")).save_pretrained(str(root / "adapter"))
    gsm8k_config(root)  # verl's GSM8K tool config, as the multi-turn script names it
    gsm8k_interaction_config(root)  # and its GSM8K interaction config
    (root / "reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    )
    return root


def gsm8k_interaction_config(root: Path) -> Path:
    """verl's examples/sglang_multiturn/config/interaction_config/gsm8k_interaction_config.yaml."""
    path = root / "interaction.yaml"
    path.write_text(
        "interaction:\n"
        '  - name: "gsm8k"\n'
        '    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"\n'
        "    config: {}\n"
    )
    return path


# The scripts that do not say how many devices they use assume verl's default of 8; these divide their
# mini-batches over fewer (verl's own divisibility rule refuses them on 8), so the user gives them fewer.
N_GPUS = {
    "examples/rollout_correction/run_with_rollout_corr.sh": "4",
    "examples/rollout_correction/run_with_rollout_corr_multi_rs.sh": "4",
    # These say how many devices they run on.
    "examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh": "2",
    "examples/tuning/0.5b/qwen2-0.5b_grpo-lora_1_h100_fsdp_vllm.sh": "1",
    "examples/tuning/7b/qwen2-7b_grpo-lora_1_h100_fsdp_vllm.sh": "1",
}


def as_user_would(overrides: list[str], files: Path, n_gpus: str = "8") -> list[str]:
    """Point paths at local files and the device layout at this machine; keep every other key and value."""
    out = []
    for item in overrides:
        key, _, value = item.partition("=")
        bare = key.lstrip("+")
        if bare in ("data.train_files", "data.val_files"):
            value = str(files / "data.parquet")
        elif bare in MODEL_KEYS:
            value = str(files / "model")
        elif bare == "trainer.default_local_dir":
            value = str(files / "run")
        elif bare == "custom_reward_function.path":
            value = str(files / "reward.py")
        elif bare == "actor_rollout_ref.model.lora_adapter_path":
            value = str(files / "adapter")
        elif bare == "actor_rollout_ref.rollout.multi_turn.tool_config_path":
            value = str(files / "tools.yaml")
        elif bare == "actor_rollout_ref.rollout.multi_turn.interaction_config_path":
            value = str(files / "interaction.yaml")
        elif bare in DEVICE_KEYS:
            value = n_gpus if bare == "trainer.n_gpus_per_node" else DEVICE_KEYS[bare]
        out.append(f"{key}={value}")
    # This machine has no wandb (a logger package); the scripts log to the console too.
    return [*out, "trainer.device=cpu", "trainer.logger=[console]", f"trainer.n_gpus_per_node={n_gpus}"]


def test_fixture_records_its_source() -> None:
    assert len(EXAMPLES["verl_commit"]) == 40
    assert len(SCRIPTS) >= 15 and all(path.startswith("examples/") for path in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_verl_example_script_passes_doctor(
    script: str, files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = as_user_would(EXAMPLES["scripts"][script], files, N_GPUS.get(script, "8"))
    code = doctor.main(argv)
    out = capsys.readouterr().out
    assert code == 0, f"{script}:\n{out}"


def test_a_verl_script_with_sequence_parallelism_passes() -> None:
    overrides = EXAMPLES["scripts"]["examples/gmpo_trainer/test_dapo_7b_math.sh"]
    assert "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4" in overrides  # run above as written


@pytest.mark.parametrize(
    "extra, named",
    [
        # the padded path has no sequence parallelism
        (
            ["actor_rollout_ref.model.use_remove_padding=False"],
            "actor_rollout_ref.model.use_remove_padding=True",
        ),
        # 3 does not divide the 8 devices, 8 does not divide the model's 4 heads
        (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=3"], "must divide the 8 device(s)"),
        (
            ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=8"],
            "does not divide the model's 4 attention heads",
        ),
        (
            ["critic.ulysses_sequence_parallel_size=8"],
            "critic.ulysses_sequence_parallel_size=8 does not divide",
        ),
    ],
)
def test_sequence_parallelism_that_cannot_run_is_refused_naming_the_key(
    files: Path, capsys: pytest.CaptureFixture[str], extra: list[str], named: str
) -> None:
    script = "examples/ppo_trainer/run_deepseek7b_llm.sh"  # actor, reference and critic
    argv = as_user_would(EXAMPLES["scripts"][script], files)
    assert doctor.main([*argv, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", *extra]) == 1
    assert named in capsys.readouterr().out


def test_keys_without_effect_are_accepted_and_named(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = [
        "actor_rollout_ref.actor.fsdp_config.strategy=fsdp2",
        "actor_rollout_ref.rollout.data_parallel_size=2",
        "actor_rollout_ref.rollout.expert_parallel_size=4",
        "actor_rollout_ref.actor.use_prefix_grouper=True",
        "reward_model.use_reward_loop=True",
    ]
    argv = as_user_would(EXAMPLES["scripts"]["examples/grpo_trainer/run_qwen2-7b.sh"], files)
    assert doctor.main([*argv, *keys]) == 0
    out = capsys.readouterr().out
    listed = out[out.index("accepted for compatibility, no effect:") :]
    for item in keys:
        assert item in listed, item


# Shrunk to the tiny model and two steps on the CPU; every other key of the script as verl wrote it.
SHRINK = [
    "data.train_batch_size=2",
    "data.max_prompt_length=128",
    "data.max_response_length=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.rollout.max_model_len=256",
    "actor_rollout_ref.rollout.max_num_batched_tokens=512",
    "actor_rollout_ref.actor.optim.lr=1e-2",  # large enough that the adapters move in two steps
    "actor_rollout_ref.rollout.name=native",  # the engine with its own weights: the sync must reach it
    "trainer.total_training_steps=2",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
]


def test_verl_lora_example_trains_two_steps_on_the_cpu(files: Path) -> None:
    """verl's 0.5B LoRA GRPO script, shrunk: the adapters train, and the engine samples from them (its
    log-probs equal the trainer's at step 2, after an update, to fp32 rounding)."""
    from fulcrum.config import load_config
    from fulcrum.trainer.ppo_trainer import PPOTrainer

    script = "examples/tuning/0.5b/qwen2-0.5b_grpo-lora_1_h100_fsdp_vllm.sh"
    argv = [*as_user_would(EXAMPLES["scripts"][script], files, "1"), *SHRINK]
    argv = [a for a in argv if not a.startswith("trainer.default_local_dir=")]
    run = files / "lora_run"
    trainer = PPOTrainer(load_config([*argv, f"trainer.default_local_dir={run}"]), torch.device("cpu"))
    assert trainer.actor.adapters is not None and trainer.ref is not None
    before = {n: p.detach().clone() for n, p in trainer.actor.model.named_parameters() if p.requires_grad}
    trainer.fit()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = {int(r["training/global_step"]): r for r in rows if "training/global_step" in r}
    assert sorted(steps) == [1, 2]
    after = dict(trainer.actor.model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before), "the adapters did not train"
    assert steps[2]["rollout/logprob_diff_max"] < 1e-4, steps[2]["rollout/logprob_diff_max"]
    assert all(bool(torch.isfinite(p).all()) for p in trainer.actor.model.parameters())
