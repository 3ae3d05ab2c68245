"""A Python code-interpreter tool: the model's code runs in the sandbox (``sandbox.py``).

The reply is the code's stdout, then its stderr (a traceback, say) under ``[stderr]``, and a line
saying that it was stopped at the timeout or that its output was cut. Each call is a fresh process
with an empty scratch directory: nothing persists between calls.

Config (``config:`` in the tool YAML), all optional: ``timeout_s`` (10), ``cpu_s`` (10),
``memory_mb`` (512, all of a call's processes together), ``max_processes`` (32), ``max_file_mb`` (16),
``scratch_mb`` (64), ``max_output_bytes`` (65536), ``max_concurrent_calls`` (unbounded: calls of this
tool instance running at once; more wait). The schema's first parameter (``code``) is the program.
The tool refuses to start where the sandbox cannot run (see ``sandbox.check_available``).

verl's ``SandboxFusionTool`` config is read by ``from_sandbox_fusion``: what has a counterpart
here maps onto these keys, the rest is refused naming what megarl does instead.
"""
from __future__ import annotations

import asyncio
from dataclasses import fields
from typing import Any

from megarl.agent.tools.base import BaseTool, ToolResponse
from megarl.agent.tools.sandbox import SandboxLimits, check_available, run_python

DEFAULT_SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code and return what it prints. No network, no files outside the "
                       "working directory, nothing persists between calls.",
        "parameters": {"type": "object",
                       "properties": {"code": {"type": "string", "description": "the Python program"}},
                       "required": ["code"]},
    },
}


def from_sandbox_fusion(config: dict[str, Any]) -> dict[str, Any]:
    """This tool's config for verl's ``SandboxFusionTool`` config (verl/tools/sandbox_fusion_tools.py): the
    code runs in megarl's local sandbox instead of on a SandboxFusion server."""
    refused = {
        "sandbox_fusion_url": "megarl runs the code in its local sandbox (bubblewrap), not on a SandboxFusion server: "
                              "remove sandbox_fusion_url",
        "default_language": "megarl's sandbox runs Python only: remove default_language (or set it to python)",
    }
    mapped: dict[str, Any] = {"type": config.get("type", "native")}
    if "default_timeout" in config:  # verl: the server's run timeout; here the wall clock and the CPU seconds
        mapped["timeout_s"] = mapped["cpu_s"] = config["default_timeout"]
    if "memory_limit_mb" in config:
        mapped["memory_mb"] = config["memory_limit_mb"]
    workers, rate = config.get("num_workers", 10), config.get("rate_limit", 10)
    if any(k in config for k in ("num_workers", "rate_limit", "enable_global_rate_limit")):
        mapped["max_concurrent_calls"] = min(workers, rate) if config.get("enable_global_rate_limit", True) else workers
    problems = [f"{key}: {why}" for key, why in refused.items()
                if key in config and not (key == "default_language" and config[key] == "python")]
    unknown = sorted(set(config) - set(refused) - {"type", "default_timeout", "memory_limit_mb", "num_workers",
                                                   "rate_limit", "enable_global_rate_limit"})
    if unknown:
        problems.append(f"{unknown}: not keys of verl's SandboxFusionTool")
    if problems:
        raise ValueError("verl's SandboxFusionTool runs as megarl's python tool (sandbox_fusion_tools.SandboxFusionTool "
                         "-> python; default_timeout -> timeout_s and cpu_s, memory_limit_mb -> memory_mb, num_workers / "
                         "rate_limit -> max_concurrent_calls); " + "; ".join(problems))
    return mapped


class PythonCodeTool(BaseTool):
    def __init__(self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None):
        super().__init__(config, tool_schema or DEFAULT_SCHEMA)
        known = {f.name for f in fields(SandboxLimits)}
        unknown = sorted(set(self.config) - known - {"type", "max_concurrent_calls"})
        if unknown:
            raise ValueError(f"python tool: unknown config keys {unknown}; known: {sorted(known | {'max_concurrent_calls'})}")
        self.limits = SandboxLimits(**{k: v for k, v in self.config.items() if k in known})
        self.max_concurrent_calls = self.config.get("max_concurrent_calls")
        if self.max_concurrent_calls is not None and int(self.max_concurrent_calls) < 1:
            raise ValueError(f"python tool: max_concurrent_calls={self.max_concurrent_calls} must be >= 1")
        self._slots: dict[Any, asyncio.Semaphore] = {}  # one per event loop
        check_available()
        properties = self.tool_schema["function"]["parameters"].get("properties", {})
        self.argument = next(iter(properties), "code")

    async def _run(self, code: str):
        if self.max_concurrent_calls is None:
            return await run_python(code, self.limits)
        loop = asyncio.get_running_loop()
        slots = self._slots.setdefault(loop, asyncio.Semaphore(int(self.max_concurrent_calls)))
        async with slots:
            return await run_python(code, self.limits)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        code = parameters.get(self.argument)
        if not isinstance(code, str) or not code.strip():
            return ToolResponse(text=f"Error: give the program as a non-empty string in {self.argument!r}"), 0.0, {}
        result = await self._run(code)
        parts = [result.stdout.rstrip("\n")] if result.stdout else []
        if result.stderr:
            parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
        if result.timed_out:
            parts.append(f"[stopped: the program ran longer than {self.limits.timeout_s:g} s]")
        elif result.memory_exceeded:
            parts.append(f"[killed: the program's processes together used more than {self.limits.memory_mb} MB]")
        elif result.returncode:
            parts.append(f"[exit status {result.returncode}]")
        if result.output_truncated:
            parts.append(f"[output cut at {self.limits.max_output_bytes} bytes]")
        metrics = {"python_timeout": int(result.timed_out), "python_seconds": result.seconds}
        return ToolResponse(text="\n".join(parts) if parts else "(no output)"), 0.0, metrics
