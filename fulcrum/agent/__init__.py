"""Tools for multi-turn rollouts, as verl's: the interface users subclass, the tool-config YAML, the
Hermes `<tool_call>` parser, the built-in GSM8K checker and sandboxed Python tool, and the runner that
turns one assistant turn's calls into tool messages. The engine-side agent loop calls `ToolSet`.
"""

from fulcrum.agent.calls import ToolCallResult, ToolSet, truncate_text
from fulcrum.agent.parser import FunctionCall, ParsedMessage, get_parser, parse_hermes
from fulcrum.agent.registry import load_tool_config, resolve_tool_class
from fulcrum.agent.schema import (
    OpenAIFunctionParametersSchema,
    OpenAIFunctionPropertySchema,
    OpenAIFunctionSchema,
    OpenAIFunctionToolSchema,
    ToolConfigError,
    ToolResponse,
)
from fulcrum.agent.tool import BaseTool

__all__ = [
    "BaseTool",
    "FunctionCall",
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionPropertySchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolSchema",
    "ParsedMessage",
    "ToolCallResult",
    "ToolConfigError",
    "ToolResponse",
    "ToolSet",
    "get_parser",
    "load_tool_config",
    "parse_hermes",
    "resolve_tool_class",
    "truncate_text",
]
