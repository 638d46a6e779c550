"""The GSM8K user, with the behaviour of verl's `Gsm8kInteraction` (`verl/interactions/gsm8k_interaction.py`).

After each plain assistant turn it scores the last assistant message against the row's ground truth
with fulcrum's GSM8K scorer in `strict` mode (the number after the last `#### `; 1.0 when equal, else
0.0). Right: "Your response is correct!" and the conversation ends. Wrong or missing: "Your response is
incorrect! You need to reflect on your answer and try again." and the model gets another turn. The turn
score is that 0.0 / 1.0. The ground truth comes from `start_interaction(ground_truth=...)`, which the
loop fills from the row's `extra_info.interaction_kwargs` (verl's GSM8K data puts it there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import uuid4

from fulcrum.agent.interaction import BaseInteraction
from fulcrum.reward import gsm8k

CORRECT = "Your response is correct!"
INCORRECT = "Your response is incorrect! You need to reflect on your answer and try again."


@dataclass
class _Instance:
    """One conversation: its last assistant message and the ground truth."""

    ground_truth: Any
    response: str = ""


def last_assistant_content(messages: list[dict[str, Any]]) -> str:
    """The content of the last assistant message ("" when there is none)."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return str(message.get("content") or "")
    return ""


class Gsm8kInteraction(BaseInteraction):
    """Tells the model whether its GSM8K answer is right; verl's `verl.interactions.gsm8k_interaction.
    Gsm8kInteraction` maps here."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self._instances: dict[str, _Instance] = {}

    async def start_interaction(
        self, instance_id: str | None = None, ground_truth: Any = None, **kwargs: Any
    ) -> str:
        """A fresh instance holding the ground truth."""
        instance_id = instance_id if instance_id is not None else str(uuid4())
        self._instances[instance_id] = _Instance(ground_truth=ground_truth)
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """Score the last assistant message; end the conversation when it is right."""
        self._instances[instance_id].response = last_assistant_content(messages)
        reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            return True, CORRECT, reward, {}
        return False, INCORRECT, reward, {}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        """1.0 when the last message's `#### n` equals the ground truth, else 0.0 (strict extraction)."""
        instance = self._instances[instance_id]
        return gsm8k.compute_score(
            instance.response, instance.ground_truth, method="strict", format_score=0.0, score=1.0
        )

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        """Forget the instance (verl raises KeyError for an unknown id; so does this)."""
        del self._instances[instance_id]
