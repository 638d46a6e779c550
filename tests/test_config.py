"""Configuration: verl-style overrides, typed errors naming keys, derived keys, YAML round trip, rules."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.config import (
    ConfigError,
    FulcrumConfig,
    advise,
    describe,
    load_config,
    load_config_file,
    save_config,
    to_dict,
    validate,
)
from fulcrum.trainer.checks import check, configuration_findings

# Every key of the reference command (docs/configuration.md) and the other keys users set most must exist.
REFERENCE_KEYS = """
data.train_files data.val_files data.train_batch_size data.max_prompt_length data.max_response_length
actor_rollout_ref.model.path actor_rollout_ref.actor.optim.lr actor_rollout_ref.actor.ppo_mini_batch_size
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
actor_rollout_ref.rollout.tensor_model_parallel_size actor_rollout_ref.rollout.gpu_memory_utilization
actor_rollout_ref.rollout.max_num_seqs actor_rollout_ref.rollout.max_num_batched_tokens
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu critic.optim.lr critic.model.path
critic.ppo_micro_batch_size_per_gpu critic.forward_micro_batch_size_per_gpu algorithm.kl_ctrl.kl_coef
algorithm.kl_ctrl.target_kl trainer.logger trainer.val_before_train trainer.n_gpus_per_node trainer.nnodes
trainer.save_freq trainer.test_freq trainer.total_epochs
actor_rollout_ref.actor.ppo_epochs actor_rollout_ref.actor.clip_ratio actor_rollout_ref.actor.clip_ratio_low
actor_rollout_ref.actor.clip_ratio_high actor_rollout_ref.actor.clip_ratio_c actor_rollout_ref.actor.loss_agg_mode
actor_rollout_ref.actor.entropy_coeff actor_rollout_ref.actor.use_kl_loss actor_rollout_ref.actor.kl_loss_coef
actor_rollout_ref.actor.kl_loss_type actor_rollout_ref.actor.grad_clip actor_rollout_ref.actor.use_dynamic_bsz
actor_rollout_ref.actor.ppo_max_token_len_per_gpu actor_rollout_ref.actor.optim.lr_warmup_steps
actor_rollout_ref.actor.optim.lr_warmup_steps_ratio actor_rollout_ref.actor.optim.weight_decay
actor_rollout_ref.model.enable_gradient_checkpointing actor_rollout_ref.model.use_remove_padding
actor_rollout_ref.rollout.name actor_rollout_ref.rollout.n actor_rollout_ref.rollout.temperature
actor_rollout_ref.rollout.top_p actor_rollout_ref.rollout.top_k actor_rollout_ref.rollout.response_length
actor_rollout_ref.rollout.free_cache_engine actor_rollout_ref.rollout.enforce_eager
actor_rollout_ref.rollout.val_kwargs.temperature critic.cliprange_value critic.ppo_epochs algorithm.adv_estimator
algorithm.gamma algorithm.lam algorithm.use_kl_in_reward algorithm.kl_penalty algorithm.norm_adv_by_std_in_grpo
algorithm.kl_ctrl.type algorithm.kl_ctrl.horizon trainer.project_name trainer.experiment_name
trainer.default_local_dir trainer.total_training_steps trainer.resume_mode trainer.device
custom_reward_function.path custom_reward_function.name
""".split()


def seed_command(tmp_path=None) -> list[str]:
    """The reference command of docs/configuration.md, sized for one device."""
    root = str(tmp_path) if tmp_path else "/data"
    return [
        f"data.train_files={root}/train.parquet",
        f"data.val_files={root}/test.parquet",
        "data.train_batch_size=512",
        "data.max_prompt_length=512",
        "data.max_response_length=256",
        f"actor_rollout_ref.model.path={root}/model",
        "actor_rollout_ref.actor.optim.lr=1.5e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=128",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.65",
        "actor_rollout_ref.rollout.max_num_seqs=1896",
        "actor_rollout_ref.rollout.max_num_batched_tokens=16384",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
        "critic.optim.lr=1e-5",
        f"critic.model.path={root}/model",
        "critic.ppo_micro_batch_size_per_gpu=8",
        "critic.forward_micro_batch_size_per_gpu=8",
        "algorithm.kl_ctrl.kl_coef=0.0005",
        "algorithm.kl_ctrl.target_kl=0.05",
        "trainer.logger=[console]",
        "trainer.val_before_train=False",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.save_freq=10",
        "trainer.test_freq=10",
        "trainer.total_epochs=15",
        "trainer.device=cpu",
    ]


def test_every_design_key_exists_and_is_described():
    described = {info.key for info in describe()}
    missing = [k for k in REFERENCE_KEYS if k not in described]
    assert missing == []
    assert all(info.help for info in describe()), "every key has a one-line meaning"


def test_verl_defaults():
    cfg = load_config([])
    arr = cfg.actor_rollout_ref
    assert cfg.data.train_batch_size == 1024 and cfg.data.max_prompt_length == 512
    assert arr.actor.ppo_mini_batch_size == 256 and arr.actor.optim.lr == 1e-6
    assert arr.actor.clip_ratio == 0.2 and arr.actor.clip_ratio_c == 3.0
    assert arr.actor.kl_loss_type == "low_var_kl" and arr.actor.loss_agg_mode == "token-mean"
    assert cfg.critic.optim.lr == 1e-5 and cfg.critic.cliprange_value == 0.5
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.001 and cfg.algorithm.kl_ctrl.target_kl == 0.1
    assert cfg.algorithm.adv_estimator == "gae" and cfg.algorithm.gamma == 1.0
    assert arr.rollout.val_kwargs.temperature == 0.0 and arr.rollout.val_kwargs.do_sample is False
    assert arr.rollout.gpu_memory_utilization == 0.5 and arr.rollout.top_k == -1
    # ours
    assert arr.rollout.name == "native" and cfg.trainer.device == "auto" and cfg.trainer.seed == 1
    assert cfg.trainer.max_nan_steps == 3 and cfg.trainer.save_on_interrupt is True
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"


def test_override_kinds():
    cfg = load_config(
        [
            "data.train_batch_size=256",
            "actor_rollout_ref.actor.optim.lr=1.5e-6",
            "critic.optim.lr=1e-5",
            "actor_rollout_ref.actor.grad_clip=2",  # int into a float field
            "trainer.val_before_train=False",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "trainer.logger=[console,tensorboard]",
            "trainer.experiment_name='my run'",
            'trainer.project_name="proj"',
            "trainer.total_training_steps=null",
            "data.train_files=[/a/x.parquet, '/b/y.parquet']",
            "actor_rollout_ref.actor.optim.betas=[0.9,0.95]",
        ]
    )
    assert cfg.data.train_batch_size == 256
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1.5e-6)
    assert cfg.critic.optim.lr == pytest.approx(1e-5)
    assert cfg.actor_rollout_ref.actor.grad_clip == 2.0 and isinstance(
        cfg.actor_rollout_ref.actor.grad_clip, float
    )
    assert cfg.trainer.val_before_train is False and cfg.actor_rollout_ref.actor.use_kl_loss is True
    assert cfg.trainer.logger == ["console", "tensorboard"]
    assert cfg.trainer.experiment_name == "my run" and cfg.trainer.project_name == "proj"
    assert cfg.trainer.total_training_steps is None
    assert cfg.data.train_files == ["/a/x.parquet", "/b/y.parquet"]
    assert cfg.actor_rollout_ref.actor.optim.betas == [0.9, 0.95]


def test_quoted_list_and_single_file():
    cfg = load_config(["trainer.logger=['console']", "data.train_files=/d/train.parquet"])
    assert cfg.trainer.logger == ["console"]
    assert cfg.data.train_files == "/d/train.parquet"


def test_plus_prefix():
    cfg = load_config(["+trainer.val_only=True", "+reward_model.reward_kwargs.overlong_buffer=4"])
    assert cfg.trainer.val_only is True
    assert cfg.reward_model.reward_kwargs == {"overlong_buffer": 4}
    with pytest.raises(ConfigError, match=r"trainer\.not_a_key: unknown key"):
        load_config(["+trainer.not_a_key=1"])


def test_unknown_key_suggests_closest_full_path():
    with pytest.raises(ConfigError) as err:
        load_config(["actor_rollout_ref.actor.ppo_mini_batchsize=64"])
    assert "did you mean actor_rollout_ref.actor.ppo_mini_batch_size?" in str(err.value)
    assert err.value.key == "actor_rollout_ref.actor.ppo_mini_batchsize"
    with pytest.raises(ConfigError, match=r"did you mean actor_rollout_ref\.rollout\.n\?"):
        load_config(["rollout.n=4"])  # group prefix left out
    for typo, meant in [
        ("critic.optim.learning_rate", "critic.optim.lr"),  # other frameworks' name
        ("ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size"),  # actor before critic
        ("trainer.n_gpu_per_node", "trainer.n_gpus_per_node"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(f"did you mean {meant}?")):
            load_config([f"{typo}=1"])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("data.train_batch_size=abc", "data.train_batch_size: expected int, got 'abc'"),
        ("data.train_batch_size=1.5", "data.train_batch_size: expected int"),
        ("trainer.val_before_train=maybe", "trainer.val_before_train: expected bool"),
        ("actor_rollout_ref.actor.optim.lr=fast", "actor_rollout_ref.actor.optim.lr: expected float"),
        ("trainer.device=gpu", "trainer.device: expected one of [auto, cpu, cuda], got 'gpu'"),
        ("data.max_prompt_length=null", "data.max_prompt_length: expected int, got null"),
        ("critic.optim=1", "critic.optim: is a group of keys"),
        ("data.train_batch_size.x=1", "data.train_batch_size: is a single value"),
        ("data.train_batch_size", "is not KEY=VALUE"),
    ],
)
def test_wrong_type_names_key_and_expectation(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config([override])
    assert expected in str(err.value)


def test_derived_keys_follow_unless_set():
    cfg = load_config(["data.max_response_length=300", "data.max_prompt_length=100"])
    assert cfg.actor_rollout_ref.rollout.response_length == 300
    assert cfg.actor_rollout_ref.rollout.prompt_length == 100
    cfg = load_config(["data.max_response_length=300", "actor_rollout_ref.rollout.response_length=128"])
    assert cfg.actor_rollout_ref.rollout.response_length == 128
    cfg = load_config(
        ["actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.clip_ratio=0.3"]
    )
    assert cfg.critic.ppo_mini_batch_size == 32
    assert cfg.actor_rollout_ref.actor.clip_ratio_low == 0.2  # verl's default 0.2 is explicit, not derived
    cfg = load_config(
        ["actor_rollout_ref.actor.clip_ratio_low=null", "actor_rollout_ref.actor.clip_ratio=0.3"]
    )
    assert cfg.actor_rollout_ref.actor.clip_ratio_low == 0.3


def test_older_verl_names():
    cfg = load_config(["actor_rollout_ref.actor.optim.warmup_style=cosine"])
    assert cfg.actor_rollout_ref.actor.optim.lr_scheduler_type == "cosine"
    cfg = load_config(["actor_rollout_ref.rollout.name=vllm"])
    assert cfg.actor_rollout_ref.rollout.name == "native"


def test_save_and_load_round_trip(tmp_path):
    cfg = load_config(
        [*seed_command(tmp_path), "+reward_model.reward_kwargs.k=[1,2]", "trainer.logger=[console,jsonl]"]
    )
    path = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert yaml.safe_load(path.read_text())["data"]["train_batch_size"] == 512
    again = load_config_file(path)
    assert again == cfg
    assert to_dict(again) == to_dict(cfg)
    assert load_config_file(path, ["data.train_batch_size=64"]).data.train_batch_size == 64
    # keys that followed another follow it again when the saved config is loaded with overrides
    again = load_config_file(
        path, ["data.max_response_length=1024", "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine"]
    )
    assert again.actor_rollout_ref.rollout.response_length == 1024
    assert again.actor_rollout_ref.actor.optim.lr_scheduler_type == "cosine"
    assert load_config_file(path, ["trainer.experiment_name=b"]).trainer.default_local_dir.endswith("/b")


def test_partial_verl_yaml_with_interpolations(tmp_path):
    text = """
data:
  train_batch_size: 64
actor_rollout_ref:
  actor:
    _target_: verl.workers.config.FSDPActorConfig
    optim:
      lr: 1e-5
  rollout:
    name: ???
    response_length: ${oc.select:data.max_response_length,512}
trainer:
  project_name: p
  default_local_dir: checkpoints/${trainer.project_name}/${trainer.experiment_name}
defaults:
  - _self_
"""
    (tmp_path / "c.yaml").write_text(text)
    cfg = load_config_file(tmp_path / "c.yaml")
    assert cfg.data.train_batch_size == 64 and cfg.actor_rollout_ref.actor.optim.lr == 1e-5
    assert cfg.actor_rollout_ref.rollout.response_length == 512
    assert cfg.trainer.default_local_dir == "checkpoints/p/gsm8k"
    (tmp_path / "bad.yaml").write_text("trainer:\n  total_epoch: 3\n")
    with pytest.raises(ConfigError, match=r"did you mean trainer\.total_epochs"):
        load_config_file(tmp_path / "bad.yaml")


def test_seed_command_is_valid_on_one_device():
    cfg = load_config(seed_command())
    assert validate(cfg, n_devices=1) == []
    check(cfg, n_devices=1)


def test_train_refuses_a_token_budget_below_one_sequence_before_any_model_loads():
    """The check `fulcrum train` runs first (not only doctor) names the budget that holds no full sequence."""
    key = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
    cfg = load_config([*seed_command(), "actor_rollout_ref.actor.use_dynamic_bsz=True", f"{key}=300"])
    with pytest.raises(ConfigError, match=f"{key}=300 is below one sequence of up to 768 tokens"):
        check(cfg, n_devices=1)
    cfg = load_config([*seed_command(), "actor_rollout_ref.actor.use_dynamic_bsz=True", f"{key}=768"])
    assert validate(cfg, n_devices=1) == []


def test_hybrid_fsdp_size_runs_with_a_start_up_note():
    key = "critic.model.fsdp_config.fsdp_size"
    cfg = load_config([*seed_command(), "trainer.n_gpus_per_node=4", f"{key}=2"])
    assert validate(cfg, n_devices=4) == []  # a pasted verl command runs
    (note,) = [n for n in advise(cfg) if n.keys == (key,)]
    assert note.message.startswith(f"{key}=2: hybrid sharding over groups of 2 ranks is not supported")
    for size in (-1, 1, 4, 32):
        cfg = load_config([*seed_command(), "trainer.n_gpus_per_node=4", f"{key}={size}"])
        assert not [n for n in advise(cfg) if n.keys == (key,)]


def test_rules_name_the_keys():
    cfg = load_config([*seed_command(), "trainer.n_gpus_per_node=2"])
    problems = [str(p) for p in validate(cfg, n_devices=1)]
    assert any(p.startswith("trainer.n_gpus_per_node") and "1 are visible" in p for p in problems)

    cfg = load_config([*seed_command(), "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=7"])
    (problem,) = validate(cfg)
    assert problem.keys == (
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    )
    assert "128 responses per device" in problem.message

    cfg = load_config([*seed_command(), "actor_rollout_ref.actor.ppo_micro_batch_size=8"])
    assert any("both are set" in str(p) for p in validate(cfg))

    cfg = load_config([*seed_command(), "critic.ppo_micro_batch_size_per_gpu=null"])
    assert [str(p) for p in validate(cfg)] == [
        "critic.ppo_micro_batch_size_per_gpu: must be set (responses per forward/backward per device)"
    ]
    # without a critic (grpo), the critic's micro-batch is not needed
    cfg = load_config(
        [
            *seed_command(),
            "critic.ppo_micro_batch_size_per_gpu=null",
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=4",
        ]
    )
    assert validate(cfg) == []

    cfg = load_config([*seed_command(), "data.train_batch_size=64"])  # mini-batch 128 > 64 prompts
    assert any("larger than the 64 prompts" in str(p) for p in validate(cfg))

    cfg = load_config([*seed_command(), "actor_rollout_ref.rollout.val_kwargs.do_sample=True"])
    assert any("val_kwargs.temperature" in str(p) for p in validate(cfg))

    # rloo with one response per prompt runs in verl (plain REINFORCE): a warning, not an error.
    cfg = load_config([*seed_command(), "algorithm.adv_estimator=rloo"])
    assert validate(cfg) == []
    assert any("rollout.n=1 it has no baseline" in str(p) for p in advise(cfg))

    cfg = load_config([*seed_command(), "actor_rollout_ref.model.lora_rank=8", "critic.model.lora_rank=8"])
    assert validate(cfg) == []

    cfg = load_config([*seed_command(), "trainer.logger=[console,swanlab,foo]"])
    assert {str(p) for p in validate(cfg)} == {
        "trainer.logger: ['swanlab']: verl loggers fulcrum does not support yet",
        "trainer.logger: unknown logger(s) ['foo']; one of ['console', 'jsonl', 'tensorboard', 'wandb', 'mlflow']",
    }

    with pytest.raises(ConfigError, match="problem"):
        check(load_config([*seed_command(), "data.train_batch_size=0"]))


def test_advice_is_not_an_error():
    cfg = load_config(seed_command())
    notes = [str(a) for a in advise(cfg)]
    assert any(n.startswith("algorithm.kl_ctrl") for n in notes)  # kl_ctrl set without use_kl_in_reward
    assert {a.severity for a in advise(cfg)} == {"warning"}
    assert validate(cfg) == []


def test_a_mini_batch_that_does_not_divide_the_step_is_a_note_for_the_actor_and_the_critic():
    """The last mini-batch of each epoch is smaller: said once at start, naming each role's key."""
    sizes = ["data.train_batch_size=96", "actor_rollout_ref.actor.ppo_mini_batch_size=64"]
    cfg = load_config(
        [*seed_command(), *sizes, "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=64"]
    )
    keys = {note.keys[1] for note in advise(cfg) if "last mini-batch" in str(note)}
    assert keys == {"actor_rollout_ref.actor.ppo_mini_batch_size", "critic.ppo_mini_batch_size"}
    assert validate(cfg, n_devices=1) == []


def test_bypass_mode_as_a_loss_mode_is_refused_pointing_at_rollout_correction():
    """verl's trainer sets loss_mode=bypass_mode itself from rollout correction's bypass key; set by hand
    the loss has no correction to apply, so the run stops before any model loads, naming both keys."""
    key = "actor_rollout_ref.actor.policy_loss.loss_mode"
    cfg = load_config([*seed_command(), f"{key}=bypass_mode"])
    with pytest.raises(ConfigError, match=r"set algorithm\.rollout_correction\.bypass_mode=True") as err:
        check(cfg, n_devices=1)
    assert err.value.key == key
    fixed = ["algorithm.rollout_correction.bypass_mode=True", "algorithm.rollout_correction.rollout_is=token"]
    assert not [f for f in validate(load_config([*seed_command(), *fixed]), n_devices=1) if key in f.keys]


def test_defaults_are_not_shared_between_configs():
    a, b = FulcrumConfig(), FulcrumConfig()
    a.trainer.logger.append("wandb")
    assert b.trainer.logger == ["console"]


def test_docs_tables_match_the_schema():
    """docs/configuration.md names real keys, and its main-keys table is what the schema says.

    To refresh the table: `markdown_rows([...keys...])` from fulcrum.config.listing.
    """
    from pathlib import Path

    from fulcrum.config.keys import all_keys
    from fulcrum.config.listing import markdown_rows

    text = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    known = set(all_keys(FulcrumConfig))
    named = re.findall(r"^\| `([a-z0-9_.]+)`", text, flags=re.MULTILINE)
    assert len(named) > 80
    assert [key for key in named if key not in known] == []
    main = text[text.index("## Main keys") :]
    rows = [line for line in main.splitlines() if line.startswith("| `")]
    keys = [re.match(r"\| `([a-z0-9_.]+)`", row).group(1) for row in rows]
    assert "\n".join(rows) == markdown_rows(keys)


def test_bool_spellings_verl_accepts():
    for word, expected in [("yes", True), ("off", False), ("1", True), ("0", False), ("TRUE", True)]:
        assert load_config([f"trainer.val_before_train={word}"]).trainer.val_before_train is expected
    with pytest.raises(ConfigError, match=r"trainer\.val_only: expected bool, got '2'"):
        load_config(["trainer.val_only=2"])
    with pytest.raises(ConfigError, match="expected float, got 'nan'"):
        load_config(["actor_rollout_ref.actor.optim.lr=nan"])


def test_validation_imports_nothing_above_the_configuration():
    code = (
        "import sys; from fulcrum.config import load_config, validate, advise; "
        "cfg = load_config(['algorithm.adv_estimator=nope']); validate(cfg); advise(cfg); "
        "print(sorted(m for m in sys.modules if m.startswith('fulcrum.') and not m.startswith('fulcrum.config')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_names_implemented_by_the_algorithms():
    cfg = load_config(
        [
            *seed_command(),
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl+",
            "algorithm.kl_penalty=k4",
            "actor_rollout_ref.actor.policy_loss.loss_mode=clip-cov",
            "reward_model.reward_manager=dpao",
        ]
    )
    assert {p.keys[0] for p in configuration_findings(cfg)} == {
        "algorithm.kl_penalty",
        "actor_rollout_ref.actor.policy_loss.loss_mode",
        "reward_model.reward_manager",
    }


# Scalar keys and a strategy for a value of their type: any such override survives config.yaml.
_SCALARS = {
    "data.train_batch_size": st.integers(1, 4096),
    "data.max_response_length": st.integers(1, 8192),
    "actor_rollout_ref.actor.optim.lr": st.floats(1e-9, 1.0, allow_nan=False),
    "actor_rollout_ref.rollout.temperature": st.floats(0.0, 2.0),
    "trainer.val_before_train": st.booleans(),
    "trainer.experiment_name": st.text("abc xyz-_0123", min_size=1, max_size=12).filter(
        lambda s: s.strip() == s
    ),
    "trainer.logger": st.lists(st.sampled_from(["console", "tensorboard", "jsonl"]), max_size=3),
    "trainer.total_training_steps": st.none() | st.integers(1, 10**6),
}


def _spell(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ",".join(value) + "]"
    if isinstance(value, str):
        return f"'{value}'"
    return repr(value)


@settings(max_examples=25, deadline=None)
@given(st.fixed_dictionaries({}, optional=_SCALARS))
def test_any_override_round_trips_through_yaml(tmp_path_factory, values):
    cfg = load_config([f"{key}={_spell(value)}" for key, value in values.items()])
    for key, value in values.items():
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        assert node == (pytest.approx(value) if isinstance(value, float) else value)
    path = save_config(cfg, tmp_path_factory.mktemp("run") / "config.yaml")
    assert load_config_file(path) == cfg


def test_log_prob_micro_batches_follow_the_actor_unless_a_spelling_is_set():
    cfg = load_config(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])
    assert cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 4
    assert cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == 4
    # The global spelling set: the per-device one is not derived beside it (that would set both).
    cfg = load_config(
        [
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size=16",
        ]
    )
    assert cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size == 16
    assert cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu is None
    assert cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == 4


def test_overlong_prompts_are_filtered_by_default():
    assert load_config([]).data.filter_overlong_prompts is True


def test_rollout_tensor_parallel_size_has_no_effect_so_only_warns():
    from fulcrum.config import advise, validate

    cfg = load_config(["trainer.device=cpu", "trainer.n_gpus_per_node=1"])  # verl's default tp=2
    assert not any("tensor_model_parallel_size" in k for p in validate(cfg, n_devices=0) for k in p.keys)
    assert any("tensor_model_parallel_size" in k for note in advise(cfg) for k in note.keys)


@pytest.mark.parametrize("composite", [False, True])
def test_context_longer_than_the_models_positions_is_refused_for_a_composite_config(tmp_path, composite):
    """A multimodal folder (qwen3_5) keeps max_position_embeddings in config.json's `text_config`."""
    (tmp_path / "model").mkdir()
    text = {"model_type": "qwen3_5_text", "max_position_embeddings": 512}
    config = {"model_type": "qwen3_5", "text_config": text} if composite else text
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    problems = [str(p) for p in validate(load_config(seed_command(tmp_path)), n_devices=1)]
    assert any("prompt + response = 768 tokens exceeds" in p and "= 512" in p for p in problems)
