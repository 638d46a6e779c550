"""Every numeric key has a domain; a value outside it stops `fulcrum train` and `fulcrum doctor` alike,
with the key, the value and the domain named, before any model loads."""

from __future__ import annotations

import dataclasses
import json
import shutil
import typing
from pathlib import Path

import pytest
from helpers import cpu_ppo_overrides, make_assets

from fulcrum.config import FulcrumConfig, advise, load_config, validate
from fulcrum.config.domains import Domain, domain_of
from fulcrum.config.keys import field_types, is_group, non_null
from fulcrum.tools import doctor
from fulcrum.trainer.main_ppo import main as train_main


def _numeric_fields(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """(key, field) of every int / float / list-of-numbers key under `cls`."""
    out = []
    for f in dataclasses.fields(cls):
        tp = field_types(cls)[f.name]
        if is_group(tp):
            out += _numeric_fields(tp, f"{prefix}{f.name}.")
            continue
        base = non_null(tp)
        if typing.get_origin(base) is list:
            (base,) = typing.get_args(base)
        if base in (int, float):
            out.append((f"{prefix}{f.name}", f))
    return out


def test_every_numeric_key_declares_a_domain_that_holds_its_default() -> None:
    fields = _numeric_fields(FulcrumConfig)
    assert len(fields) > 120
    assert [key for key, f in fields if domain_of(f) is None] == []
    assert [str(p) for p in validate(load_config()) if "domain" in p.message] == []


# (override, the problem line validate() reports): the cases that trained wrongly or failed late.
OUTSIDE = [
    (
        "actor_rollout_ref.actor.grad_clip=-1",
        "actor_rollout_ref.actor.grad_clip: -1.0 is outside its domain: > 0",
    ),
    (
        "actor_rollout_ref.actor.grad_clip=0",
        "actor_rollout_ref.actor.grad_clip: 0.0 is outside its domain: > 0",
    ),
    ("critic.grad_clip=0", "critic.grad_clip: 0.0 is outside its domain: > 0"),
    ("critic.optim.clip_grad=-2", "critic.grad_clip: -2.0 is outside its domain: > 0"),  # older name wins
    (
        "actor_rollout_ref.actor.clip_ratio_low=-0.1",
        "actor_rollout_ref.actor.clip_ratio_low: -0.1 is outside its domain: > 0 or null",
    ),
    (
        "actor_rollout_ref.actor.clip_ratio_high=0",
        "actor_rollout_ref.actor.clip_ratio_high: 0.0 is outside its domain: > 0 or null",
    ),
    (
        "actor_rollout_ref.actor.clip_ratio_c=1",
        "actor_rollout_ref.actor.clip_ratio_c: 1.0 is outside its domain: > 1",
    ),
    (
        "actor_rollout_ref.actor.entropy_coeff=-0.01",
        "actor_rollout_ref.actor.entropy_coeff: -0.01 is outside its domain: >= 0",
    ),
    (
        "actor_rollout_ref.actor.kl_loss_coef=-0.1",
        "actor_rollout_ref.actor.kl_loss_coef: -0.1 is outside its domain: >= 0",
    ),
    ("algorithm.kl_ctrl.kl_coef=-1", "algorithm.kl_ctrl.kl_coef: -1.0 is outside its domain: >= 0"),
    ("trainer.seed=-1", "trainer.seed: -1 is outside its domain: in [0, 4294967295]"),
    ("trainer.seed=4294967296", "trainer.seed: 4294967296 is outside its domain: in [0, 4294967295]"),
    (
        "actor_rollout_ref.actor.optim.lr=-1e-6",
        "actor_rollout_ref.actor.optim.lr: -1e-06 is outside its domain: >= 0",
    ),
    (
        "actor_rollout_ref.actor.optim.lr=inf",
        "actor_rollout_ref.actor.optim.lr: inf is outside its domain: >= 0",
    ),
    (
        "actor_rollout_ref.actor.optim.betas=[0.9,1.0]",
        "actor_rollout_ref.actor.optim.betas: [0.9, 1.0] is outside its domain (each value): in [0, 1)",
    ),
    (
        "actor_rollout_ref.rollout.temperature=-1",
        "actor_rollout_ref.rollout.temperature: -1.0 is outside its domain: >= 0",
    ),
    (
        "actor_rollout_ref.rollout.top_p=0",
        "actor_rollout_ref.rollout.top_p: 0.0 is outside its domain: in (0, 1]",
    ),
    (
        "actor_rollout_ref.rollout.val_kwargs.top_p=1.5",
        "actor_rollout_ref.rollout.val_kwargs.top_p: 1.5 is outside its domain: in (0, 1]",
    ),
    (
        "actor_rollout_ref.rollout.top_k=-2",
        "actor_rollout_ref.rollout.top_k: -2 is outside its domain: >= -1",
    ),
    (
        "actor_rollout_ref.rollout.gpu_memory_utilization=0",
        "actor_rollout_ref.rollout.gpu_memory_utilization: 0.0 is outside its domain: in (0, 1]",
    ),
    ("data.train_batch_size=0", "data.train_batch_size: 0 is outside its domain: >= 1"),
    (
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=0",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu: 0 is outside its domain: >= 1 or null",
    ),
    ("algorithm.gamma=1.5", "algorithm.gamma: 1.5 is outside its domain: in [0, 1]"),
    ("algorithm.kl_ctrl.target_kl=0", "algorithm.kl_ctrl.target_kl: 0.0 is outside its domain: > 0"),
    (
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=0",
        "actor_rollout_ref.actor.fsdp_config.fsdp_size: 0 is outside its domain: >= 1 or -1",
    ),
]


@pytest.mark.parametrize("override, problem", OUTSIDE, ids=[o for o, _ in OUTSIDE])
def test_a_value_outside_its_domain_names_key_value_and_domain(override: str, problem: str) -> None:
    assert problem in [str(p) for p in validate(load_config([override]))]


@pytest.mark.parametrize(
    "override",
    [
        "actor_rollout_ref.actor.clip_ratio_low=null",  # follows clip_ratio
        "actor_rollout_ref.actor.clip_ratio_low=10",  # verl's CISPO example: no lower bound
        "actor_rollout_ref.actor.grad_clip=1e9",
        "actor_rollout_ref.rollout.top_k=0",  # off, as in HF (verl: -1 for vLLM, 0 for HF)
        "trainer.save_freq=0",  # verl saves only when save_freq > 0
        "trainer.seed=0",
        "algorithm.kl_ctrl.kl_coef=0",
    ],
)
def test_values_verl_uses_stay_inside(override: str) -> None:
    assert [str(p) for p in validate(load_config([override])) if "domain" in p.message] == []


def test_a_lower_clip_that_never_acts_is_a_warning_for_ppo_clipping_only() -> None:
    notes = [str(p) for p in advise(load_config(["actor_rollout_ref.actor.clip_ratio_low=1.5"]))]
    assert any(n.startswith("actor_rollout_ref.actor.clip_ratio_low: 1.5 >= 1") for n in notes)
    cispo = [
        "actor_rollout_ref.actor.clip_ratio_low=10",
        "actor_rollout_ref.actor.policy_loss.loss_mode=cispo",
    ]
    assert not any("clip_ratio_low" in str(p) for p in advise(load_config(cispo)))


def test_domains_are_listed_by_doctor_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor.main(["--keys"]) == 0
    out = capsys.readouterr().out
    assert "actor_rollout_ref.actor.grad_clip = 1.0  # max global gradient norm  [float, > 0]" in out
    assert "actor_rollout_ref.rollout.top_p = 1.0  # nucleus sampling  [float, in (0, 1]]" in out
    assert "trainer.seed = 1" in out and "[int, in [0, 4294967295]]" in out


def test_domain_text() -> None:
    assert str(Domain(0, 1, low_open=True)) == "in (0, 1]"
    assert str(Domain(1, also=(-1,))) == ">= 1 or -1"
    assert str(Domain()) == "any number"
    assert -1 in Domain(1, also=(-1,)) and 0 not in Domain(1, also=(-1,))
    assert float("nan") not in Domain() and float("inf") not in Domain(0)


# ----------------------------------------------------------------- train and doctor: one validation
@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_assets(tmp_path_factory.mktemp("assets"))


@pytest.fixture
def no_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if `fulcrum train` gets as far as building the trainer (loading the models)."""

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the trainer was built: the check came after the models loaded")

    monkeypatch.setattr("fulcrum.trainer.ppo_trainer.PPOTrainer", refuse)


def _train_and_doctor(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """(train's stderr, doctor's stdout); both must refuse the configuration."""
    assert train_main(argv) == 1
    train_err = capsys.readouterr().err
    assert doctor.main(argv) == 1
    return train_err, capsys.readouterr().out


@pytest.mark.usefixtures("no_trainer")
def test_train_refuses_what_doctor_refuses_before_any_model_loads(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = {"actor_rollout_ref.actor.grad_clip": -1, "trainer.seed": -1}
    train_err, doctor_out = _train_and_doctor(cpu_ppo_overrides(assets, tmp_path / "run", bad), capsys)
    for line in (
        "actor_rollout_ref.actor.grad_clip: -1.0 is outside its domain: > 0",
        "trainer.seed: -1 is outside its domain: in [0, 4294967295]",
    ):
        assert line in train_err and line in doctor_out
    assert "Traceback" not in train_err
    assert not (tmp_path / "run").exists()  # nothing written for a run that cannot start


@pytest.mark.usefixtures("no_trainer")
def test_train_refuses_a_context_longer_than_the_models_positions(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model"
    shutil.copytree(assets / "model", model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 64
    (model / "config.json").write_text(json.dumps(config))
    keys = {"actor_rollout_ref.model.path": model, "critic.model.path": model, "data.max_response_length": 8}
    train_err, doctor_out = _train_and_doctor(cpu_ppo_overrides(assets, tmp_path / "run", keys), capsys)
    line = (
        "prompt + response = 136 tokens exceeds actor_rollout_ref.model.path's max_position_embeddings = 64"
    )
    assert line in train_err and line in doctor_out
