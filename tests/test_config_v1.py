"""trainer.use_v1 / trainer.v1.*: verl's V1 keys are read; what colocate_async cannot run is refused by name."""

from __future__ import annotations

import pytest

from fulcrum.config import ConfigError, advise, load_config, validate
from tests.helpers import seed_command

ASYNC = ["trainer.use_v1=True", "trainer.v1.trainer_mode=colocate_async"]


def problems(*keys: str) -> list[str]:
    return [str(p) for p in validate(load_config([*seed_command(), *keys]), n_devices=1)]


def test_verl_v1_keys_are_read_with_their_defaults():
    cfg = load_config(
        [
            *seed_command(),
            *ASYNC,
            "trainer.v1.colocate_async.num_warmup_batches=2",
            "trainer.v1.sampler.max_off_policy_threshold=3",
            "trainer.v1.sampler.max_off_policy_strategy=wait",
        ]
    )
    v1 = cfg.trainer.v1
    assert cfg.trainer.use_v1 and v1.trainer_mode == "colocate_async"
    assert (v1.colocate_async.num_warmup_batches, v1.sampler.max_off_policy_threshold) == (2, 3)
    assert v1.sampler.max_off_policy_strategy == "wait"
    default = load_config([]).trainer.v1
    assert (default.trainer_mode, default.sampler.max_off_policy_threshold) == ("sync", 8)
    assert default.sampler.max_off_policy_strategy == "drop"
    assert problems(*ASYNC) == []  # the seed command runs the native engine on one device


def test_what_colocate_async_cannot_run_is_refused_by_key():
    mode = "trainer.v1.trainer_mode"
    assert problems("trainer.v1.trainer_mode=colocate_async") == [
        f"{mode}, trainer.use_v1: trainer.v1.* takes effect with trainer.use_v1=True"
    ]
    for key, value in [
        ("actor_rollout_ref.rollout.name", "hf"),
        ("algorithm.filter_groups.enable", "True"),
        ("algorithm.adv_estimator", "remax"),
    ]:
        assert any(p.startswith(f"{mode}, {key}: colocate_async") for p in problems(*ASYNC, f"{key}={value}"))
    with pytest.raises(ConfigError, match=r"trainer\.v1\.trainer_mode"):
        load_config([*ASYNC[:1], "trainer.v1.trainer_mode=separate_async"])
    with pytest.raises(ConfigError, match="max_off_policy_strategy"):
        load_config(["trainer.v1.sampler.max_off_policy_strategy=keep"])


def test_colocate_async_without_rollout_correction_gets_a_note_naming_it():
    key = "algorithm.rollout_correction"
    notes = [n for n in advise(load_config([*seed_command(), *ASYNC])) if key in n.keys]
    assert len(notes) == 1 and "rollout_is=token" in notes[0].message
    corrected = load_config([*seed_command(), *ASYNC, f"{key}.rollout_is=token"])
    assert not [n for n in advise(corrected) if key in n.keys]
