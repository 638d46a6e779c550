"""verl's Interaction (simulated user turns): the interaction-config YAML and its errors, the GSM8K user's
verl semantics, and the agent loop with an interaction over the native engine (random model, CPU): a
wrong answer gets the user's feedback as a masked user turn and another turn, a right one ends it."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from test_agent_loop import PARAMS, ByteTokenizer, zero_runs
from test_rollout_requests import engine_for

from fulcrum.agent import ToolSet
from fulcrum.agent.chat import ChatDelta
from fulcrum.agent.conversations import run_conversations
from fulcrum.agent.gsm8k_interaction import CORRECT, INCORRECT, Gsm8kInteraction
from fulcrum.agent.interaction import BaseInteraction, InteractionSession
from fulcrum.agent.interaction_config import (
    InteractionConfigError,
    config_problems,
    load_interaction_config,
    pick_interaction,
)
from fulcrum.agent.loop import SINGLE_TURN_AGENT, ConversationRequest, LoopLimits, ToolAgentLoop
from fulcrum.rollout.testing import random_causal_lm

VERL_GSM8K = "verl.interactions.gsm8k_interaction.Gsm8kInteraction"


def write(tmp_path: Path, text: str, name: str = "interaction.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


class Polite(BaseInteraction):
    """A user-defined interaction, named by its class path."""


# ------------------------------------------------------------------------------------ config and registry
def test_verls_gsm8k_config_loads_to_fulcrums_interaction(tmp_path: Path) -> None:
    path = write(
        tmp_path, f'interaction:\n  - name: "gsm8k"\n    class_name: "{VERL_GSM8K}"\n    config: {{}}\n'
    )
    interactions = load_interaction_config(path)
    assert list(interactions) == ["gsm8k"] and isinstance(interactions["gsm8k"], Gsm8kInteraction)
    assert interactions["gsm8k"].name == "gsm8k" and interactions["gsm8k"].config == {"name": "gsm8k"}
    assert config_problems(path) == []


def test_names_default_from_the_class_as_verl_derives_them(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        f"""
        interaction:
          - class_name: {VERL_GSM8K}
          - class_name: test_interactions.Polite
            config: {{tone: warm}}
          - class_name: verl.interactions.base.BaseInteraction
        """,
    )
    interactions = load_interaction_config(path)
    assert list(interactions) == ["gsm8k", "polite", "base"]
    assert interactions["polite"].config == {"tone": "warm", "name": "polite"}
    assert type(interactions["base"]) is BaseInteraction


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("interaction: {}", r"expected a top-level `interaction:` list"),
        ("interaction:\n  - 3", r"interaction\[0\]: expected a mapping"),
        (
            "interaction:\n  - name: a\n    class_name: x.Y\n    tool_schema: {}",
            r"interaction\[0\]: unknown key",
        ),
        ("interaction:\n  - name: a", r"interaction\[0\]\.class_name: required"),
        (
            "interaction:\n  - class_name: x.Y\n    config: [1]",
            r"interaction\[0\]\.config: expected a mapping",
        ),
        (
            f"interaction:\n  - class_name: {VERL_GSM8K}\n  - name: gsm8k\n    class_name: x.Y",
            r"interaction\[1\]\.name: 'gsm8k' is already the name of interaction\[0\]",
        ),
        (
            "interaction:\n  - class_name: verl.interactions.weather_interaction.WeatherInteraction",
            r"interaction\[0\]\.class_name: verl\.interactions\.weather_interaction\.WeatherInteraction is a "
            r"verl interaction fulcrum has no counterpart for; fulcrum provides .*Gsm8kInteraction",
        ),
    ],
)
def test_config_errors_name_the_file_the_entry_and_the_key(tmp_path: Path, body: str, message: str) -> None:
    path = write(tmp_path, body)
    with pytest.raises(InteractionConfigError, match=message) as err:
        load_interaction_config(path)
    assert str(path) in str(err.value)
    assert len(config_problems(path)) == 1 and str(path) in config_problems(path)[0]


def test_classes_are_checked_when_loaded(tmp_path: Path) -> None:
    for class_name, message in [
        ("no_such_module.X", r"interaction\[0\]\.class_name: cannot import module 'no_such_module'"),
        ("test_interactions.Missing", r"module test_interactions has no 'Missing'"),
        ("test_interactions.write", r"test_interactions\.write is not a subclass of .*BaseInteraction"),
    ]:
        path = write(tmp_path, f"interaction:\n  - name: a\n    class_name: {class_name}\n")
        with pytest.raises(InteractionConfigError, match=message):
            load_interaction_config(path)
    # doctor never imports user code: a well-formed entry of an unimportable class passes there.
    assert config_problems(path) == []
    with pytest.raises(InteractionConfigError, match=r"interaction_config_path: no such file"):
        load_interaction_config(tmp_path / "absent.yaml")


def test_a_row_picks_its_interaction_by_name_as_verl_requires() -> None:
    interactions = {"gsm8k": Gsm8kInteraction({"name": "gsm8k"})}
    assert (
        pick_interaction(interactions, {"name": "gsm8k", "ground_truth": "3"}, "0") is interactions["gsm8k"]
    )
    with pytest.raises(ValueError, match=r"data row 4: extra_info.interaction_kwargs has no 'name'"):
        pick_interaction(interactions, {"ground_truth": "3"}, "4")
    with pytest.raises(ValueError, match=r"name 'weather' is not in .* \(interactions: gsm8k\)"):
        pick_interaction(interactions, {"name": "weather"}, "4")


# ----------------------------------------------------------------------------------- the GSM8K user
def test_gsm8k_interaction_as_verls() -> None:
    async def go() -> None:
        user = Gsm8kInteraction({"name": "gsm8k"})
        kwargs = {"name": "gsm8k", "query": "q", "ground_truth": "72"}
        assert await user.start_interaction("a", **kwargs) == "a"
        assert await user.start_interaction(ground_truth="5") not in ("a", None)  # a fresh id
        wrong = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "so 72"}]
        # strict: a number without `#### ` does not count
        assert await user.generate_response("a", wrong, **kwargs) == (False, INCORRECT, 0.0, {})
        assert await user.calculate_score("a") == 0.0
        right = [*wrong, {"role": "user", "content": INCORRECT}, {"role": "assistant", "content": "#### 72"}]
        assert await user.generate_response("a", right, **kwargs) == (True, CORRECT, 1.0, {})
        # the last assistant message is the one scored, wherever it is
        assert (await user.generate_response("a", [*right, {"role": "user", "content": "x"}]))[2] == 1.0
        await user.finalize_interaction("a")
        with pytest.raises(KeyError):
            await user.finalize_interaction("a")

    asyncio.run(go())
    assert (CORRECT, INCORRECT) == (
        "Your response is correct!",
        "Your response is incorrect! You need to reflect on your answer and try again.",
    )


def test_base_interaction_is_verls_default_and_a_bad_reply_is_named() -> None:
    class Broken(BaseInteraction):
        async def generate_response(self, instance_id: str, messages: list, **kwargs: Any) -> Any:
            return "fine"

    async def go() -> None:
        base = BaseInteraction({})
        assert base.name == "interaction_agent"
        assert await base.generate_response("i", []) == (
            False,
            "Your current result seems acceptable.",
            0.8,
            {},
        )
        session = InteractionSession(Broken({"name": "b"}), "i", {})
        with pytest.raises(TypeError, match=r"interaction 'b' \(Broken\): generate_response must return"):
            await session.reply([])

    asyncio.run(go())


# ------------------------------------------------------------------------------------ in the agent loop
class ScriptedTokenizer(ByteTokenizer):
    """ByteTokenizer whose decode gives each assistant turn the next scripted text."""

    def __init__(self, turns: list[str]) -> None:
        self.turns = list(turns)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.turns.pop(0)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    return random_causal_lm("qwen2", init_std=0.2)


def converse(
    model: torch.nn.Module, turns: list[str], limits: LoopLimits, agent: str = "tool_agent"
) -> tuple[Any, Gsm8kInteraction, Any]:
    """One conversation (n=1) on GSM8K with ground truth 72, the model's turns read as `turns`."""
    engine = engine_for(model)
    user = Gsm8kInteraction({"name": "gsm8k"})
    loop = ToolAgentLoop(ToolSet([]), ScriptedTokenizer(turns), limits, {"gsm8k": user})
    request = ConversationRequest(
        [5, 6, 7, 8],
        [{"role": "user", "content": "q"}],
        interaction_kwargs={"name": "gsm8k", "ground_truth": "72"},
        agent_name=agent,
    )
    [conversation] = run_conversations(engine, loop, [request], PARAMS)
    return conversation, user, engine


def user_turn(text: str) -> list[int]:
    return ChatDelta(ByteTokenizer()).appended_ids([{"role": "user", "content": text}])


def test_a_wrong_answer_gets_feedback_as_a_masked_user_turn_and_a_right_one_ends_it(model) -> None:
    c, user, engine = converse(model, ["#### 70", "#### 72"], LoopLimits(response_length=240))
    assert (c.assistant_turns, c.user_turns, c.num_turns) == (2, 2, 5)
    # Both replies are in the response as the template renders a user message, and out of the loss.
    assert zero_runs(c.loss_mask, c.token_ids) == [user_turn(INCORRECT), user_turn(CORRECT)]
    assert c.loss_mask[-len(user_turn(CORRECT)) :] == [0] * len(user_turn(CORRECT))  # verl ends on it
    assert [lp for lp, m in zip(c.logprobs, c.loss_mask, strict=True) if not m] == [0.0] * (
        len(user_turn(INCORRECT)) + len(user_turn(CORRECT))
    )
    assert c.turn_scores == [0.0, 1.0] and c.finish_reason == "stop"
    assert user._instances == {}  # finalized
    assert engine.counters["held"] == 0 and engine.counters["blocks_in_use"] == 0


def test_a_right_first_answer_ends_after_one_turn(model) -> None:
    c, _, _ = converse(model, ["#### 72"], LoopLimits(response_length=240))
    assert (c.assistant_turns, c.user_turns, c.turn_scores) == (1, 1, [1.0])
    assert zero_runs(c.loss_mask, c.token_ids) == [user_turn(CORRECT)]


def test_verls_turn_limits_count_the_interactions_turns(model) -> None:
    wrong = ["#### 1"] * 5
    # max_user_turns=1: one reply, then the turn after it is the last (verl checks after generating).
    c, _, _ = converse(model, wrong, LoopLimits(response_length=240, max_user_turns=1))
    assert (c.assistant_turns, c.user_turns, c.turn_scores) == (2, 1, [0.0])
    c, _, _ = converse(model, wrong, LoopLimits(response_length=240, max_assistant_turns=3))
    assert (c.assistant_turns, c.user_turns, c.turn_scores) == (3, 2, [0.0, 0.0])


def test_a_reply_past_the_budget_is_appended_cut_and_ends_the_conversation(model) -> None:
    budget = len(user_turn(INCORRECT)) + 1  # the first turn (a token or two) and all or part of the reply
    c, user, engine = converse(model, ["#### 1"] * 3, LoopLimits(response_length=budget))
    assert len(c.token_ids) == budget and c.finish_reason == "length"
    assert (c.assistant_turns, c.user_turns) == (1, 1)
    first = c.loss_mask.index(0)
    assert c.token_ids[first:] == user_turn(INCORRECT)[: budget - first]
    assert user._instances == {} and engine.counters["held"] == 0


def test_a_single_turn_row_is_not_asked(model) -> None:
    c, _, _ = converse(model, ["#### 1"], LoopLimits(response_length=240), agent=SINGLE_TURN_AGENT)
    assert (c.assistant_turns, c.user_turns, c.turn_scores) == (1, 0, []) and all(c.loss_mask)
