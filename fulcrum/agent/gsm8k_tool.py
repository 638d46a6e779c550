"""The GSM8K answer checker as a tool, with the behaviour of verl's `Gsm8kTool` (`verl/tools/gsm8k_tool.py`).

The model submits an answer; the tool scores it against the sample's ground truth with fulcrum's GSM8K
scorer in `flexible` mode (1.0 when right, else 0.0) and tells the model what it parsed. The step
reward is verl's: 0.0 when the submission scores higher than the instance's best so far, −0.05
otherwise (resubmitting the same or a worse answer is penalised). `calc_reward` is the score of the
last submission. The ground truth comes from `create(ground_truth=...)` or, as the agent loop passes it,
`create(create_kwargs={"ground_truth": ...})` (the data's `extra_info.tools_kwargs.<name>.create_kwargs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import uuid4

from fulcrum.agent.schema import OpenAIFunctionToolSchema, ToolResponse
from fulcrum.agent.tool import BaseTool
from fulcrum.reward import gsm8k

NO_IMPROVEMENT_PENALTY = -0.05

_DEFAULT_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calc_gsm8k_reward",
        "description": "A tool for calculating the reward of gsm8k",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "The answer to the question"}},
            "required": ["answer"],
        },
    },
}


@dataclass
class _Instance:
    """One conversation's submissions: the last one (as `#### n`), the ground truth, the best score."""

    ground_truth: Any
    response: str = ""
    reward: float = 0.0


class Gsm8kTool(BaseTool):
    """Scores a submitted GSM8K answer; verl's `verl.tools.gsm8k_tool.Gsm8kTool` maps here."""

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None) -> None:
        super().__init__(config, tool_schema)
        self._instances: dict[str, _Instance] = {}

    @classmethod
    def default_tool_schema(cls) -> OpenAIFunctionToolSchema:
        """verl's schema for this tool (`calc_gsm8k_reward(answer: string)`)."""
        return OpenAIFunctionToolSchema.from_dict(_DEFAULT_SCHEMA, "Gsm8kTool default schema")

    async def create(
        self, instance_id: str | None = None, ground_truth: Any = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        """A fresh instance holding the ground truth."""
        instance_id = instance_id or str(uuid4())
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        self._instances[instance_id] = _Instance(ground_truth=ground_truth)
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, float]]:
        """Record the answer, score it, and penalise a submission that does not improve the score."""
        answer = parameters.get("answer", "")
        if not isinstance(answer, str):
            answer = str(answer)
        instance = self._instances[instance_id]
        # The scorer reads `#### n`; the model is asked for the bare number.
        instance.response = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        step_reward = 0.0 if reward > instance.reward else NO_IMPROVEMENT_PENALTY
        instance.reward = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """1.0 when the last submission equals the ground truth (flexible extraction), else 0.0."""
        instance = self._instances[instance_id]
        return gsm8k.compute_score(
            instance.response, instance.ground_truth, method="flexible", format_score=0.0, score=1.0
        )

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Forget the instance."""
        self._instances.pop(instance_id, None)
