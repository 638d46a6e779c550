"""A code-interpreter tool: each call runs the model's Python in a fresh jail on this machine.

verl's `verl.tools.sandbox_fusion_tools.SandboxFusionTool` maps here: instead of posting the code to a
Sandbox Fusion server it runs it locally with fulcrum.sandbox (bubblewrap namespaces, an unprivileged
user, limits, seccomp; see docs/multi-turn.md for what that does and does not guarantee). The model
reads stdout then stderr, as Sandbox Fusion returns them, plus a bracketed line for each failure. Where
no jail can be built the tool refuses to start with one line saying why, unless its config says
`sandbox: unjailed`.

Config keys (verl's, same defaults): `default_timeout` (seconds, wall-clock and CPU), `memory_limit_mb`,
`num_workers` (calls running at once in this process), `rate_limit` and `enable_global_rate_limit`
(when enabled, also a cap on calls at once), `default_language` (only "python"), `sandbox_fusion_url`
(not used). fulcrum's own: `max_output_bytes` (of each stream read back), `max_file_mb` (the largest
file, stdout and stderr included, the code may write), `max_disk_mb` (the call's writable folder),
`max_processes` (processes and threads of one call), `sandbox` (`jail`, or `unjailed` to run without
isolation). The model may ask for a shorter `timeout` in its
arguments (verl lets it ask for any; here it cannot exceed `default_timeout`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import weakref
from typing import Any

from fulcrum.agent.metrics import error_key
from fulcrum.agent.sandbox import answer_text, failure_kinds
from fulcrum.agent.schema import OpenAIFunctionToolSchema, ToolConfigError, ToolResponse
from fulcrum.agent.tool import BaseTool
from fulcrum.sandbox import JailLimits, jail_problem, run_jailed

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
    "max_disk_mb": (64, "size of a call's writable folder (/tmp, and /dev/shm)"),
    "max_processes": (64, "processes and threads of one call"),
    "sandbox": ("jail", "jail, or unjailed to run model code without isolation"),
}
SANDBOX_MODES = ("jail", "unjailed")

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


def limits_from_config(config: dict[str, Any]) -> JailLimits:
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
    return JailLimits(
        timeout_s=float(positive_number(config, "default_timeout")),
        memory_mb=int(positive_number(config, "memory_limit_mb")),
        max_output_bytes=max_output_bytes,
        max_file_bytes=max_file_bytes,
        disk_mb=int(positive_number(config, "max_disk_mb")),
        max_processes=int(positive_number(config, "max_processes")),
    )


def unjailed_from_config(config: dict[str, Any]) -> bool:
    """Whether `sandbox: unjailed` opts out of the jail; a ToolConfigError for any other value."""
    mode = config.get("sandbox", "jail")
    if mode not in SANDBOX_MODES:
        raise ToolConfigError(f"config.sandbox: expected one of {', '.join(SANDBOX_MODES)}, got {mode!r}")
    return mode == "unjailed"


def concurrency_from_config(config: dict[str, Any]) -> int:
    """How many calls may run at once: num_workers, capped by rate_limit when that is enabled."""
    workers = int(positive_number(config, "num_workers"))
    if config.get("enable_global_rate_limit", True):
        workers = min(workers, int(positive_number(config, "rate_limit")))
    return workers


class PythonTool(BaseTool):
    """Runs the model's Python code in a jail per call (verl's SandboxFusionTool maps here)."""

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None) -> None:
        super().__init__(config, tool_schema)
        self.limits = limits_from_config(self.config)
        self.unjailed = unjailed_from_config(self.config)
        if self.unjailed:
            log.warning("%s: sandbox: unjailed; model code runs without isolation", self.name)
        else:
            problem = jail_problem()
            if problem is not None:
                raise ToolConfigError(problem)
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

    def call_limits(self, parameters: dict[str, Any]) -> JailLimits:
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
            result = await run_jailed(code, limits=self.call_limits(parameters), unjailed=self.unjailed)
        kinds = sorted(failure_kinds(result))
        return ToolResponse(text=answer_text(result)), None, {error_key(kind): 1.0 for kind in kinds}
