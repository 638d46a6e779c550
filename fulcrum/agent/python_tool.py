"""A code-interpreter tool: each call runs the model's Python in a fresh sandboxed process on this machine.

verl's `verl.tools.sandbox_fusion_tools.SandboxFusionTool` maps here: instead of posting the code to a
Sandbox Fusion server it runs it locally with fulcrum.agent.sandbox (limits, a fresh directory, no
network, an audit hook; see docs/multi-turn.md for what that does and does not protect against). The
model reads stdout then stderr, as Sandbox Fusion returns them, plus a bracketed line for each failure.

Config keys (verl's, same defaults): `default_timeout` (seconds, wall-clock and CPU), `memory_limit_mb`,
`num_workers` (calls running at once in this process), `rate_limit` and `enable_global_rate_limit`
(when enabled, also a cap on calls at once), `default_language` (only "python"), `sandbox_fusion_url`
(not used). fulcrum's own: `max_output_bytes` (of each stream read back), `max_file_mb` (the largest
file, stdout and stderr included, the code may write). The model may ask for a shorter `timeout` in its
arguments (verl lets it ask for any; here it cannot exceed `default_timeout`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import weakref
from typing import Any

from fulcrum.agent.metrics import error_key
from fulcrum.agent.sandbox import SandboxLimits, run_python
from fulcrum.agent.schema import OpenAIFunctionToolSchema, ToolConfigError, ToolResponse
from fulcrum.agent.tool import BaseTool

log = logging.getLogger("fulcrum.agent")

# key → (default, what it is); verl's keys first.
CONFIG_KEYS: dict[str, tuple[Any, str]] = {
    "type": ("native", "tool type"),
    "default_timeout": (30, "seconds a call may run"),
    "memory_limit_mb": (1024, "address-space limit of a call"),
    "num_workers": (10, "calls running at once"),
    "rate_limit": (10, "calls running at once, with enable_global_rate_limit"),
    "enable_global_rate_limit": (True, "apply rate_limit"),
    "default_language": ("python", "language of the code"),
    "sandbox_fusion_url": ("", "not used: the code runs locally"),
    "max_output_bytes": (16 * 1024, "bytes of stdout and of stderr given back"),
    "max_file_mb": (16, "largest file a call may write"),
}

_DEFAULT_SCHEMA = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "A tool for executing Python code. Print what you want to see.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to execute."}},
            "required": ["code"],
        },
    },
}


def positive_number(config: dict[str, Any], key: str) -> float:
    """`config[key]` (or its default) as a positive number; a ToolConfigError naming `config.key`."""
    value = config.get(key, CONFIG_KEYS[key][0])
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ToolConfigError(
            f"config.{key}: expected a positive number ({CONFIG_KEYS[key][1]}), got {value!r}"
        )
    return value


def limits_from_config(config: dict[str, Any]) -> SandboxLimits:
    """The sandbox limits a tool config asks for (verl's keys and fulcrum's)."""
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ToolConfigError(f"config: unknown key(s) {', '.join(unknown)}; known: {', '.join(CONFIG_KEYS)}")
    language = config.get("default_language", "python")
    if language != "python":
        raise ToolConfigError(f"config.default_language: only 'python' runs locally, got {language!r}")
    max_file_bytes = int(positive_number(config, "max_file_mb") * 1024 * 1024)
    max_output_bytes = int(positive_number(config, "max_output_bytes"))
    if max_file_bytes <= max_output_bytes:
        raise ToolConfigError(
            f"config.max_file_mb: {config.get('max_file_mb')} MB is not more than max_output_bytes "
            f"({max_output_bytes}); truncation is seen by a stream growing past it"
        )
    return SandboxLimits(
        timeout_s=float(positive_number(config, "default_timeout")),
        memory_mb=int(positive_number(config, "memory_limit_mb")),
        max_output_bytes=max_output_bytes,
        max_file_bytes=max_file_bytes,
    )


def concurrency_from_config(config: dict[str, Any]) -> int:
    """How many calls may run at once: num_workers, capped by rate_limit when that is enabled."""
    workers = int(positive_number(config, "num_workers"))
    if config.get("enable_global_rate_limit", True):
        workers = min(workers, int(positive_number(config, "rate_limit")))
    return workers


class PythonTool(BaseTool):
    """Runs the model's Python code in a sandboxed process per call (verl's SandboxFusionTool maps here)."""

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None) -> None:
        super().__init__(config, tool_schema)
        self.limits = limits_from_config(self.config)
        self.max_concurrent = concurrency_from_config(self.config)
        # One semaphore per event loop: an asyncio primitive belongs to the loop it first waits on.
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    @classmethod
    def default_tool_schema(cls) -> OpenAIFunctionToolSchema:
        """`code_interpreter(code: string)`, the schema of verl's example config."""
        return OpenAIFunctionToolSchema.from_dict(_DEFAULT_SCHEMA, "PythonTool default schema")

    def slots(self) -> asyncio.Semaphore:
        """The semaphore bounding this tool's concurrent processes on the running loop."""
        loop = asyncio.get_running_loop()
        if loop not in self._slots:
            self._slots[loop] = asyncio.Semaphore(self.max_concurrent)
        return self._slots[loop]

    def call_limits(self, parameters: dict[str, Any]) -> SandboxLimits:
        """The limits of one call: the model may shorten the time limit, never lengthen it."""
        asked = parameters.get("timeout")
        if (
            isinstance(asked, (int, float))
            and not isinstance(asked, bool)
            and 0 < asked < self.limits.timeout_s
        ):
            return dataclasses.replace(self.limits, timeout_s=float(asked))
        return self.limits

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float | None, dict[str, float]]:
        """Run `parameters["code"]`; the response is its output, the metrics its failure kinds."""
        language = parameters.get("language", "python")
        if language != "python":
            text = f"Error when executing tool: only Python runs here, not {language!r}"
            return ToolResponse(text=text), None, {error_key("invalid_call"): 1.0}
        code = parameters.get("code", "")
        if not isinstance(code, str):
            code = str(code)
        async with self.slots():
            result = await run_python(code, self.call_limits(parameters))
        return ToolResponse(text=result.text()), None, {error_key(kind): 1.0 for kind in sorted(result.kinds)}
