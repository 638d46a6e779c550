"""The tool interface users subclass, as verl's `BaseTool` (`verl/tools/base_tool.py`).

A tool lives for the whole run; each conversation that calls it gets an instance id:

    instance_id, response = await tool.create(create_kwargs=...)     # per call, with the sample's kwargs
    response, step_reward, metrics = await tool.execute(instance_id, arguments)
    reward = await tool.calc_reward(instance_id)
    await tool.release(instance_id)

`execute` returns the ToolResponse the model reads, a step reward (a float, or None for none) and a
dict of numbers the loop adds up (see fulcrum.agent.metrics). Porting a verl tool means changing its
imports to `from fulcrum.agent import BaseTool, OpenAIFunctionToolSchema, ToolResponse`; the methods,
their arguments and the constructor `(config, tool_schema)` are verl's.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from fulcrum.agent.schema import OpenAIFunctionToolSchema, ToolConfigError, ToolResponse


class BaseTool:
    """A tool the model calls by name. Subclass it and override `execute` (and the others as needed).

    `config` is the tool's `config` mapping from the tool-config YAML; `tool_schema` its `tool_schema`,
    or None to use `default_tool_schema()` (a built-in tool's own schema).
    """

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None) -> None:
        self.config = dict(config or {})
        schema = tool_schema or self.default_tool_schema()
        if schema is None:
            raise ToolConfigError(
                f"{type(self).__name__} has no tool_schema: give one in the tool config "
                "(type: function, function: {name, description, parameters})"
            )
        self.tool_schema = schema
        self.name = schema.function.name

    @classmethod
    def default_tool_schema(cls) -> OpenAIFunctionToolSchema | None:
        """The schema used when the config gives none; None means the config must give one."""
        return None

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        """The schema shown to the model."""
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """Start an instance for one call; returns its id and a response (usually empty)."""
        return instance_id or str(uuid4()), ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float | None, dict[str, float]]:
        """Run the call with the model's `parameters`; returns (response, step reward, metrics)."""
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The reward of the instance's current state."""
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Forget the instance."""
