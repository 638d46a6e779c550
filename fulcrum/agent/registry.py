"""Tools by class path, and verl's tool-config YAML.

A tool config lists tools as verl's does (`actor_rollout_ref.rollout.multi_turn.tool_config_path`):

    tools:
      - class_name: my_package.my_tools.WeatherTool     # any importable subclass of fulcrum.agent.BaseTool
        config: {type: native, ...}                      # given to the tool's constructor
        tool_schema: {type: function, function: {...}}   # OpenAI function schema; optional for built-ins

verl's built-in class names map to fulcrum's tools (VERL_TOOLS); any other `verl.` class is refused
with a line saying what fulcrum offers, since verl itself is not installed. Every error names the file,
the tool's index and the key.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from fulcrum.agent.class_path import import_class
from fulcrum.agent.schema import OpenAIFunctionToolSchema, ToolConfigError
from fulcrum.agent.tool import BaseTool

log = logging.getLogger("fulcrum.agent")

GSM8K_TOOL = "fulcrum.agent.gsm8k_tool.Gsm8kTool"
PYTHON_TOOL = "fulcrum.agent.python_tool.PythonTool"

# verl class path → (fulcrum class path, a line to print when it is used, or None).
VERL_TOOLS: dict[str, tuple[str, str | None]] = {
    "verl.tools.gsm8k_tool.Gsm8kTool": (GSM8K_TOOL, None),
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": (
        PYTHON_TOOL,
        "runs the code locally in a jail per call (fulcrum's PythonTool), "
        "not on a Sandbox Fusion server; sandbox_fusion_url is not used",
    ),
}
ENTRY_KEYS = ("class_name", "config", "tool_schema", "mcp")


def offered() -> str:
    """What fulcrum offers instead of an unknown verl tool, in one phrase."""
    mapped = ", ".join(f"{verl} (→ {ours})" for verl, (ours, _) in VERL_TOOLS.items())
    return f"fulcrum provides {mapped}; or subclass fulcrum.agent.BaseTool and give its class path"


def resolve_tool_class(class_name: str, where: str) -> type[BaseTool]:
    """The tool class named `class_name` (`package.module.Class`, or one of verl's built-ins)."""
    if class_name in VERL_TOOLS:
        target, note = VERL_TOOLS[class_name]
        if note:
            log.warning("%s: %s %s", where, class_name, note)
        class_name = target
    elif class_name.startswith("verl."):
        raise ToolConfigError(
            f"{where}: {class_name} is a verl tool fulcrum has no counterpart for; {offered()}"
        )
    cls = import_class(class_name, where, ToolConfigError)
    if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
        raise ToolConfigError(f"{where}: {class_name} is not a subclass of fulcrum.agent.BaseTool")
    return cls


def as_plain(value: Any) -> Any:
    """An OmegaConf node as plain dicts and lists (interpolations resolved); other values unchanged."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def build_tool(entry: Any, where: str) -> BaseTool:
    """One tool from one `tools[i]` entry of a tool config; `where` is `file: tools[i]`."""
    if not isinstance(entry, dict):
        raise ToolConfigError(
            f"{where}: expected a mapping with class_name, config, tool_schema; got {entry!r}"
        )
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise ToolConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(ENTRY_KEYS)}")
    class_name = entry.get("class_name")
    if not isinstance(class_name, str) or not class_name:
        raise ToolConfigError(f"{where}.class_name: required, a class path such as {GSM8K_TOOL}")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ToolConfigError(f"{where}.config: expected a mapping, got {config!r}")
    tool_type = config.get("type", "native")
    if tool_type != "native":
        raise ToolConfigError(
            f"{where}.config.type: {tool_type!r} tools are not supported (verl's MCP client is not part of "
            f"fulcrum); native tools only: {offered()}"
        )
    schema_dict = entry.get("tool_schema")
    schema = (
        None
        if schema_dict is None
        else OpenAIFunctionToolSchema.from_dict(schema_dict, f"{where}.tool_schema")
    )
    cls = resolve_tool_class(class_name, f"{where}.class_name")
    try:
        return cls(config=config, tool_schema=schema)
    except ToolConfigError as err:
        raise ToolConfigError(f"{where} ({class_name}): {err}") from err
    except Exception as err:
        raise ToolConfigError(f"{where} ({class_name}): the tool's constructor raised {err!r}") from err


def load_tool_config(path: str | Path) -> list[BaseTool]:
    """The tools of a verl tool-config YAML file, each built once; tool names must be unique."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ToolConfigError(f"actor_rollout_ref.rollout.multi_turn.tool_config_path: no such file {file}")
    try:
        raw = as_plain(OmegaConf.load(file))
    except Exception as err:
        raise ToolConfigError(f"{file}: not a readable YAML file: {err}") from err
    if not isinstance(raw, dict) or not isinstance(raw.get("tools"), list):
        raise ToolConfigError(f"{file}: expected a top-level `tools:` list")
    tools: list[BaseTool] = []
    first_index: dict[str, int] = {}
    for index, entry in enumerate(raw["tools"]):
        tool = build_tool(entry, f"{file}: tools[{index}]")
        if tool.name in first_index:
            raise ToolConfigError(
                f"{file}: tools[{index}].tool_schema.function.name: {tool.name!r} is already the name of "
                f"tools[{first_index[tool.name]}]; the model calls tools by name, so names must differ"
            )
        first_index[tool.name] = index
        tools.append(tool)
    return tools
