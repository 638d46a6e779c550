"""The built-in dispatch by data_source: verl's families, what is refused, and ground truths of other types."""

from __future__ import annotations

import numpy as np
import pytest

from fulcrum.reward import GroundTruthError, UnscoredSource, default_compute_score, scorer_name
from fulcrum.reward.extras import MissingExtra, need


@pytest.mark.parametrize(
    ("data_source", "scorer"),
    [
        ("openai/gsm8k", "gsm8k"),
        ("lighteval/MATH", "math_reward"),
        ("DigitalLearningGmbH/MATH-lighteval", "math_reward"),
        ("HuggingFaceH4/MATH-500", "math_reward"),
        ("math_dapo", "math_dapo"),
        ("math", "math_dapo"),
        ("math_dapo_reasoning", "math_dapo"),
        ("aime2024", "math_dapo"),
        ("aime_2025_i", "math_dapo"),
        ("numina_cn_k12", "prime_math"),
        ("numina_olympiads", "prime_math"),
        ("apps", "prime_code"),
        ("codecontests", "prime_code"),
        ("codeforces", "prime_code"),
        ("taco", "prime_code"),
        ("searchR1_nq", "search_r1_like_qa_em"),
        ("searchR1_bamboogle", "search_r1_like_qa_em"),
    ],
)
def test_every_verl_data_source_has_verls_scorer(data_source: str, scorer: str) -> None:
    assert scorer_name(data_source) == scorer


def test_math_verify_and_sandbox_are_choices() -> None:
    assert scorer_name("lighteval/MATH", math_verify=True) == "math_verify"
    assert scorer_name("apps", sandbox_fusion_url="http://localhost:8080/run_code") == "sandbox_fusion"


@pytest.mark.parametrize("data_source", ["numina_other", "MATH", "my_org/unscored_source", "searchR1_other"])
def test_a_source_verl_does_not_score_is_refused_by_name(data_source: str) -> None:
    with pytest.raises(UnscoredSource, match=f"{data_source!r}.*custom_reward_function.path"):
        default_compute_score(data_source, "\\boxed{1}", "1")


def test_a_vision_source_is_refused_as_such() -> None:
    with pytest.raises(UnscoredSource, match="'hiyouga/geometry3k' is a vision data set"):
        default_compute_score("hiyouga/geometry3k", "\\boxed{1}", "1")


@pytest.mark.parametrize(
    ("data_source", "response"),
    [
        ("openai/gsm8k", "so #### 72"),
        ("lighteval/MATH", "so \\boxed{72}"),
        ("numina_olympiads", "so \\boxed{72}"),
    ],
)
@pytest.mark.parametrize("truth", [72, np.int64(72)])
def test_an_integer_ground_truth_is_compared_as_its_digits(
    data_source: str, response: str, truth: object
) -> None:
    """verl scores these 0 (the integer never equals the extracted string); its own preprocessing writes "72"."""
    assert default_compute_score(data_source, response, truth) == 1.0
    assert default_compute_score(data_source, response.replace("72", "71"), truth) == 0.0


def test_an_integer_ground_truth_on_dapo_is_compared_as_its_digits() -> None:
    assert default_compute_score("aime2024", "Answer: 72", 72)["score"] == 1.0


@pytest.mark.parametrize("truth", [72.0, True, None])
def test_a_ground_truth_that_is_no_answer_string_is_refused(truth: object) -> None:
    with pytest.raises(
        GroundTruthError, match=r"'openai/gsm8k'.*write reward_model.ground_truth as a string"
    ):
        default_compute_score("openai/gsm8k", "#### 72", truth)


def test_gsm8k_method_is_verls_compute_score_kwarg() -> None:
    assert default_compute_score("openai/gsm8k", "the answer is 72", "72") == 0.0
    assert default_compute_score("openai/gsm8k", "the answer is 72", "72", method="flexible") == 1.0


def test_a_missing_extra_is_one_line_naming_it() -> None:
    with pytest.raises(MissingExtra) as info:
        need("no_such_module_for_fulcrum", "math", "the numina_* scorer (prime_math)")
    message = str(info.value)
    assert "\n" not in message
    assert "pip install 'fulcrum[math]'" in message and "no_such_module_for_fulcrum" in message


def test_math_verify_scores_what_string_equality_misses() -> None:
    pytest.importorskip("math_verify")
    response = "so \\boxed{0.5}"
    assert default_compute_score("lighteval/MATH", "so \\boxed{\\frac{2}{4}}", "\\frac{1}{2}") == 0.0
    assert (
        default_compute_score("lighteval/MATH", "so \\boxed{\\frac{2}{4}}", "\\frac{1}{2}", math_verify=True)
        == 1.0
    )
    assert default_compute_score("lighteval/MATH", response, "\\frac{1}{3}", math_verify=True) == 0.0


def test_verl_0_9_reward_keys_set_the_same_settings_or_are_refused_by_name() -> None:
    from fulcrum.config import ConfigError, load_config

    cfg = load_config(
        [
            "reward.reward_manager.name=dapo",
            "reward.reward_manager.source=register",
            "+reward.reward_kwargs.max_resp_len=64",
            "reward.custom_reward_function.path=/tmp/r.py",
            "reward.num_workers=3",
            "reward.sandbox_fusion.url=http://localhost:8080/run_code",
            "reward.reward_model.model_path=/models/rm",
        ]
    )
    rm = cfg.reward_model
    assert (rm.reward_manager, rm.reward_kwargs, rm.num_workers) == ("dapo", {"max_resp_len": 64}, 3)
    assert cfg.custom_reward_function.path == "/tmp/r.py" and rm.model.path == "/models/rm"
    assert rm.sandbox_fusion.url == "http://localhost:8080/run_code"
    with pytest.raises(ConfigError, match=r"reward\.reward_manager\.source=importlib"):
        load_config(["reward.reward_manager.source=importlib"])
    with pytest.raises(ConfigError, match=r"reward\.no_such_key: not a reward key"):
        load_config(["reward.no_such_key=1"])


def test_a_verl_0_9_yaml_reward_section_sets_the_same_settings(tmp_path) -> None:
    from fulcrum.config import ConfigError, load_config_file

    path = tmp_path / "verl.yaml"
    path.write_text(
        "reward:\n  num_workers: 4\n  compute_score_kwargs: {method: flexible}\n"
        "  reward_manager: {source: register, name: dapo, module: {path: null, name: custom_reward_manager}}\n"
        "  sandbox_fusion: {url: 'http://localhost:8080/run_code', max_concurrent: 64, memory_limit_mb: 512}\n"
    )
    rm = load_config_file(path).reward_model
    assert (rm.num_workers, rm.reward_manager, rm.compute_score_kwargs) == (4, "dapo", {"method": "flexible"})
    assert (rm.sandbox_fusion.url, rm.sandbox_fusion.memory_limit_mb) == (
        "http://localhost:8080/run_code",
        512,
    )
    path.write_text("reward:\n  reward_manager: {source: importlib}\n")
    with pytest.raises(ConfigError, match=r"verl.yaml: reward\.reward_manager\.source=importlib"):
        load_config_file(path)
