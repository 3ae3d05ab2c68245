"""A Python code-interpreter tool: the model's code runs in the sandbox (``sandbox.py``).

The reply is the code's stdout, then its stderr (a traceback, say) under ``[stderr]``, and a line
saying that it was stopped at the timeout or that its output was cut. Each call is a fresh process
with an empty scratch directory: nothing persists between calls.

Config (``config:`` in the tool YAML), all optional: ``timeout_s`` (10), ``cpu_s`` (10),
``memory_mb`` (512, all of a call's processes together), ``max_processes`` (32), ``max_file_mb`` (16), ``scratch_mb`` (64),
``max_output_bytes`` (65536). The schema's single parameter is ``code`` (a string). The tool
refuses to start where the sandbox cannot run (see ``sandbox.check_available``).
"""
from __future__ import annotations

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


class PythonCodeTool(BaseTool):
    def __init__(self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None):
        super().__init__(config, tool_schema or DEFAULT_SCHEMA)
        known = {f.name for f in fields(SandboxLimits)}
        unknown = sorted(set(self.config) - known - {"type"})
        if unknown:
            raise ValueError(f"python tool: unknown config keys {unknown}; known: {sorted(known)}")
        self.limits = SandboxLimits(**{k: v for k, v in self.config.items() if k in known})
        check_available()
        properties = self.tool_schema["function"]["parameters"].get("properties", {})
        self.argument = next(iter(properties), "code")

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        code = parameters.get(self.argument)
        if not isinstance(code, str) or not code.strip():
            return ToolResponse(text=f"Error: give the program as a non-empty string in {self.argument!r}"), 0.0, {}
        result = await run_python(code, self.limits)
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
