"""bench/learning.py --variants: the arguments a user writes become the runs' overrides, and bad ones stop
the benchmark before its warm start (the whole pipeline: `bench/learning.py --smoke`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from learning import planned_runs
from learning_report import RunResult, markdown, summarise
from learning_variants import LEVERS, MAX_RUNS, check_overrides, merge_overrides, parse_variants


def test_a_variant_keeps_list_values_and_names_its_algorithm() -> None:
    (v,) = parse_variants(
        [
            "clip=algorithm.adv_estimator=gae,trainer.logger=[console,tensorboard],actor_rollout_ref.actor.grad_clip=0.3"
        ]
    )
    assert (v.name, v.algo) == ("clip", "gae")
    assert v.overrides == (
        "algorithm.adv_estimator=gae",
        "trainer.logger=[console,tensorboard]",
        "actor_rollout_ref.actor.grad_clip=0.3",
    )


def test_the_built_in_set_fits_one_card_and_loads() -> None:
    variants = parse_variants(["levers"])
    assert [v.name for v in variants] == list(LEVERS) and len(variants) <= MAX_RUNS
    check_overrides(variants)  # every key and value is one fulcrum train accepts


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (["x=trainer.seed=2"], "give its algorithm"),
        (["x=algorithm.adv_estimator=reinforce"], "gae or grpo"),
        (["trainer.seed=2"], "go before --variants"),
        (["a=algorithm.adv_estimator=grpo", "a=algorithm.adv_estimator=gae"], "more than once"),
        (["levers", "extra=algorithm.adv_estimator=grpo"], "at most 6"),
    ],
)
def test_a_bad_variant_is_refused_with_the_reason(specs: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_variants(specs)


def test_a_misspelt_key_is_caught_before_the_run() -> None:
    variants = parse_variants(["slow=algorithm.adv_estimator=grpo,actor_rollout_ref.actor.optim.lrr=3e-5"])
    with pytest.raises(ValueError, match=r"slow: actor_rollout_ref\.actor\.optim\.lrr"):
        check_overrides(variants)


def test_a_variant_replaces_the_plans_value_in_place() -> None:
    base = ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.optim.lr=0.0001", "trainer.seed=1"]
    merged = merge_overrides(
        base, ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.optim.lr=3e-5", "x.y=1"]
    )
    assert merged == [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.optim.lr=3e-5",
        "trainer.seed=1",
        "x.y=1",
    ]


@dataclass(frozen=True)
class _Plan:  # what summarise reads of bench/learning.py's Plan
    algos: tuple[str, ...] = ("gae", "grpo")


def test_the_summary_has_one_row_per_variant_with_its_kl() -> None:
    curves = {"actor/kl_loss": [[0.1, 1, 0.02], [0.2, 2, 0.30], [0.3, 3, 0.04]]}
    runs = [
        RunResult("grpo", 1, -15, True, curves, [[0.0, 0, 0.4], [0.3, 3, 0.5]], 3, variant="grpo-kl0.1"),
        RunResult(
            "gae", 1, 1, False, last_step=2, error="fulcrum train: out of memory", variant="ppo-clr1e-5"
        ),
    ]
    warm = {"accuracy": 0.4, "format_accuracy": 1.0, "num_problems": 24}
    summary = summarise(warm, runs, _Plan(), {"grpo-kl0.1": ["x=1"], "ppo-clr1e-5": ["y=2"]})
    assert summary["by_algo"] == {} and list(summary["curves"]) == ["grpo-kl0.1", "ppo-clr1e-5"]
    assert summary["runs"][0]["peak_kl"] == pytest.approx(0.30)
    text = markdown(summary)
    assert "| grpo-kl0.1 | GRPO | 3 | 0.3 | 0.400 | 0.500 | 0.500 | +0.100 | 0.120 | 0.300 | — |" in text
    assert "| ppo-clr1e-5 | PPO (GAE, critic) | **failed** (exit 1) at step 2" in text
    assert "mean ± std" not in text  # one seed per variant: nothing to average


def test_variants_that_differ_only_in_seed_are_averaged_as_one_setting() -> None:
    dapo = "algorithm.filter_groups.enable=True"
    variants = {
        "ppo-s1": ["algorithm.adv_estimator=gae", "trainer.seed=1"],
        "ppo-s2": ["algorithm.adv_estimator=gae", "trainer.seed=2"],
        "dapo-s1": ["algorithm.adv_estimator=grpo", "trainer.seed=1", dapo],
        "dapo-s2": ["algorithm.adv_estimator=grpo", "trainer.seed=2", dapo],
        "lone": ["algorithm.adv_estimator=grpo", "x=1"],
    }
    parsed = parse_variants([f"{n}={','.join(o)}" for n, o in variants.items()])
    assert [seed for _, seed, _ in planned_runs(_SeedPlan(), parsed)] == [1, 2, 1, 2, 7]  # lone: the plan's
    finals = {"ppo-s1": 0.6, "ppo-s2": 0.8, "dapo-s1": 0.7, "dapo-s2": 0.7, "lone": 0.5}
    runs = [
        RunResult(v.algo, seed, -15, True, {}, [[0.0, 0, 0.4], [1.0, 9, finals[v.name]]], 9, variant=v.name)
        for v, (_, seed, _) in zip(parsed, planned_runs(_SeedPlan(), parsed), strict=True)
    ]
    warm = {"accuracy": 0.4, "format_accuracy": 1.0, "num_problems": 24}
    summary = summarise(warm, runs, _Plan(), variants)
    assert list(summary["by_setting"]) == ["ppo-s1, ppo-s2", "dapo-s1, dapo-s2"]  # "lone" has no other seed
    assert summary["by_setting"]["ppo-s1, ppo-s2"]["gain"]["mean"] == pytest.approx(0.3)
    assert summary["by_setting"]["ppo-s1, ppo-s2"]["gain"]["std"] == pytest.approx(0.1414, abs=1e-4)
    text = markdown(summary)
    assert "| dapo-s1 | GRPO + dynamic sampling | 9 |" in text and "| lone | GRPO | 9 |" in text
    assert "| ppo-s1, ppo-s2 | 2 | 0.700 ± 0.141 (0.600–0.800) | +0.300 ± 0.141 (+0.200 … +0.400) |" in text


@dataclass(frozen=True)
class _SeedPlan:  # what planned_runs reads of bench/learning.py's Plan
    seeds: tuple[int, ...] = (7,)
    algos: tuple[str, ...] = ("gae", "grpo")
