"""A tool's OpenAI function schema and its response, as plain dataclasses with verl's names and checks.

The names are verl's (`verl/tools/schemas.py`) so that a ported tool changes only its imports. verl
builds these with pydantic; here `from_dict` checks what pydantic checks there: the same required keys,
strings that must be strings (a number is not turned into a string), lists that must be lists. Unknown
keys are dropped, as pydantic drops them, so the chat template sees exactly the schema verl would give
it. Every error names where the value came from (`where`: a file and the path of keys inside it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ToolConfigError(ValueError):
    """A tool config or tool schema that cannot be used; the message names the file and the key."""


def _key(where: str, key: str) -> str:
    """`where.key`, or `key` when `where` is empty."""
    return f"{where}.{key}" if where else key


def _mapping(value: Any, where: str) -> dict[str, Any]:
    """`value` as a dict, or a ToolConfigError naming `where`."""
    if not isinstance(value, dict):
        raise ToolConfigError(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
    return value


def _string(data: dict[str, Any], key: str, where: str, required: bool = True) -> str | None:
    """`data[key]` when it is a string; None when absent and not required; else a ToolConfigError."""
    if key not in data or data[key] is None:
        if required:
            raise ToolConfigError(f"{_key(where, key)}: required key is missing")
        return None
    value = data[key]
    if not isinstance(value, str):
        raise ToolConfigError(f"{_key(where, key)}: expected a string, got {type(value).__name__} {value!r}")
    return value


def _string_list(data: dict[str, Any], key: str, where: str, required: bool = True) -> list[str] | None:
    """`data[key]` when it is a list of strings; None when absent and not required; else an error."""
    if key not in data or data[key] is None:
        if required:
            raise ToolConfigError(f"{_key(where, key)}: required key is missing")
        return None
    value = data[key]
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ToolConfigError(f"{_key(where, key)}: expected a list of strings, got {value!r}")
    return list(value)


@dataclass(frozen=True)
class OpenAIFunctionPropertySchema:
    """One parameter of a function: its JSON type, a description and the allowed values."""

    type: str
    description: str | None = None
    enum: list[str] | None = None

    @classmethod
    def from_dict(cls, data: Any, where: str) -> OpenAIFunctionPropertySchema:
        """Checked as verl's pydantic model: `type` required, `description` a string, `enum` strings."""
        data = _mapping(data, where)
        return cls(
            type=_string(data, "type", where),
            description=_string(data, "description", where, required=False),
            enum=_string_list(data, "enum", where, required=False),
        )

    def to_dict(self) -> dict[str, Any]:
        """The keys that are set (verl: `model_dump(exclude_none=True)`)."""
        out: dict[str, Any] = {"type": self.type}
        if self.description is not None:
            out["description"] = self.description
        if self.enum is not None:
            out["enum"] = list(self.enum)
        return out


@dataclass(frozen=True)
class OpenAIFunctionParametersSchema:
    """The parameters object of a function: `type` (always "object" in practice), properties, required."""

    type: str = "object"
    properties: dict[str, OpenAIFunctionPropertySchema] = field(default_factory=dict)
    required: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> OpenAIFunctionParametersSchema:
        """verl requires all three keys once `parameters` is given."""
        data = _mapping(data, where)
        if "properties" not in data or data["properties"] is None:
            raise ToolConfigError(f"{_key(where, 'properties')}: required key is missing")
        properties = _mapping(data["properties"], _key(where, "properties"))
        return cls(
            type=_string(data, "type", where),
            properties={
                str(name): OpenAIFunctionPropertySchema.from_dict(prop, _key(where, f"properties.{name}"))
                for name, prop in properties.items()
            },
            required=_string_list(data, "required", where),
        )

    def to_dict(self) -> dict[str, Any]:
        """The three keys, properties as dicts."""
        return {
            "type": self.type,
            "properties": {name: prop.to_dict() for name, prop in self.properties.items()},
            "required": list(self.required),
        }


@dataclass(frozen=True)
class OpenAIFunctionSchema:
    """A function the model may call: name, description, parameters and OpenAI's `strict` flag.

    `given` remembers which optional keys the config set: verl dumps the schema for the chat template
    with `exclude_unset=True`, so an absent `parameters` or `strict` must stay absent in `to_dict`.
    """

    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema = field(default_factory=OpenAIFunctionParametersSchema)
    strict: bool = False
    given: frozenset[str] = field(default=frozenset({"parameters"}), compare=False, repr=False)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> OpenAIFunctionSchema:
        """`name` and `description` required strings, `parameters` checked, `strict` a bool."""
        data = _mapping(data, where)
        strict = data.get("strict", False)
        if not isinstance(strict, bool):
            raise ToolConfigError(f"{_key(where, 'strict')}: expected true or false, got {strict!r}")
        given = frozenset(key for key in ("parameters", "strict") if data.get(key) is not None)
        parameters = (
            OpenAIFunctionParametersSchema.from_dict(data["parameters"], _key(where, "parameters"))
            if "parameters" in given
            else OpenAIFunctionParametersSchema()
        )
        return cls(
            name=_string(data, "name", where),
            description=_string(data, "description", where),
            parameters=parameters,
            strict=strict,
            given=given,
        )

    def to_dict(self) -> dict[str, Any]:
        """name, description, and parameters / strict where the config set them."""
        out: dict[str, Any] = {"name": self.name, "description": self.description}
        if "parameters" in self.given:
            out["parameters"] = self.parameters.to_dict()
        if "strict" in self.given:
            out["strict"] = self.strict
        return out


@dataclass(frozen=True)
class OpenAIFunctionToolSchema:
    """A tool in OpenAI's format: `{"type": "function", "function": {...}}`."""

    type: str
    function: OpenAIFunctionSchema

    @classmethod
    def from_dict(cls, data: Any, where: str = "tool_schema") -> OpenAIFunctionToolSchema:
        """Checked as verl's `OpenAIFunctionToolSchema.model_validate`; errors name `where` and the key."""
        data = _mapping(data, where)
        if data.get("function") is None:
            raise ToolConfigError(f"{_key(where, 'function')}: required key is missing")
        return cls(
            type=_string(data, "type", where),
            function=OpenAIFunctionSchema.from_dict(data["function"], _key(where, "function")),
        )

    def to_dict(self) -> dict[str, Any]:
        """The schema as the chat template takes it (`tokenizer.apply_chat_template(tools=[...])`)."""
        return {"type": self.type, "function": self.function.to_dict()}


@dataclass
class ToolResponse:
    """What a tool gives back to the model: text, and images or videos for a vision-language model."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    def __post_init__(self) -> None:
        # verl checks the same, because a single image passed unwrapped fails much later in the processor.
        for key in ("image", "video"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, list):
                raise TypeError(
                    f"ToolResponse.{key} must be a list, got {type(value).__name__}: wrap a single one as [{key}]"
                )

    def is_empty(self) -> bool:
        """No text, no image, no video."""
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        """Text and nothing else."""
        return bool(self.text) and not self.image and not self.video
