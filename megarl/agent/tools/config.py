"""Build a rollout's tools from verl's tool YAML and from plain Python functions.

``multi_turn.tool_config_path`` is verl's format::

    tools:
      - class_name: verl.tools.gsm8k_tool.Gsm8kTool      # or megarl.agent.tools.calculator.CalculatorTool, my.module.MyTool
        config: {type: native}                           # passed to the tool's constructor
        tool_schema: {type: function, function: {name: ..., description: ..., parameters: {...}}}

verl's own class names are resolved to megarl's built-in equivalents (``VERL_CLASS_NAMES``); any
other class path is imported (``package.module.Class`` or ``/path/file.py:Class``) and must
subclass ``BaseTool`` or have its four methods. ``config.type`` must be ``native`` (verl's MCP
tools are not supported). ``tool_schema`` may be left out for megarl's built-in tools.

``multi_turn.function_tool_path`` is a ``.py`` file whose public functions become tools: the
function name is the tool name, the first docstring paragraph its description, and the
parameters (with their annotations: str, int, float, bool, list, dict) its JSON schema. A
function may be sync or async and returns the text for the model (anything else is JSON-encoded).
A file that defines ``__all__`` exposes only those names.
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Callable

import yaml

from megarl.agent.loop import load_module, load_object
from megarl.agent.tools.base import BaseTool, ToolResponse, check_schema
from megarl.config.registry import Registry

VERL_CLASS_NAMES = {
    "verl.tools.gsm8k_tool.Gsm8kTool": "megarl.agent.tools.answer_check:Gsm8kTool",
    "verl.tools.geo3k_tool.Geo3kTool": "megarl.agent.tools.answer_check:Geo3kTool",
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "megarl.agent.tools.python_code:PythonCodeTool",
}
# verl tools whose config keys differ from the megarl tool's: class name -> (module:function) translating them
VERL_CONFIGS = {"verl.tools.sandbox_fusion_tools.SandboxFusionTool": "megarl.agent.tools.python_code:from_sandbox_fusion"}
# The built-in tools a tool config names by ``class_name`` (a class path each; imported when used).
BUILTIN_TOOLS = Registry("built-in tool", "class_name in actor_rollout_ref.rollout.multi_turn.tool_config_path")
for _name, _path in (("calculator", "megarl.agent.tools.calculator:CalculatorTool"),
                     ("python", "megarl.agent.tools.python_code:PythonCodeTool"),
                     ("gsm8k", "megarl.agent.tools.answer_check:Gsm8kTool"),
                     ("geo3k", "megarl.agent.tools.answer_check:Geo3kTool")):
    BUILTIN_TOOLS.register(_name)(_path)
_METHODS = ("create", "execute", "calc_reward", "release")


def load_tool_config(path: str | Path) -> list[BaseTool]:
    """The tools a verl tool YAML declares, constructed, in file order."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"actor_rollout_ref.rollout.multi_turn.tool_config_path={path}: file not found")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{file}: not valid YAML: {exc}") from exc
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{file}: expected a top-level 'tools' list of {{class_name, config, tool_schema}} entries")
    return [_build(entry, f"{file}: tools[{i}]") for i, entry in enumerate(entries)]


def _build(entry: Any, where: str) -> BaseTool:
    if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
        raise ValueError(f"{where}: needs a class_name (e.g. megarl.agent.tools.calculator.CalculatorTool)")
    unknown = sorted(set(entry) - {"class_name", "config", "tool_schema"})
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; an entry has class_name, config and tool_schema")
    config = dict(entry.get("config") or {})
    kind = config.get("type", "native")
    if kind != "native":
        raise ValueError(f"{where}: config.type={kind!r}: megarl runs native (in-process) tools only; MCP tools "
                         "are not supported")
    name = entry["class_name"]
    if name.startswith("verl.") and name not in VERL_CLASS_NAMES:
        raise ImportError(f"{where}: class_name {name} is verl's, and megarl has no counterpart; megarl maps "
                          f"{', '.join(sorted(VERL_CLASS_NAMES))} and has the built-in tools {', '.join(BUILTIN_TOOLS)} "
                          "(docs/agent-loops.md), or give your own tool class")
    if name in VERL_CONFIGS:
        try:
            config = load_object(VERL_CONFIGS[name], "tool config")(config)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    cls = load_object(VERL_CLASS_NAMES.get(name) or BUILTIN_TOOLS.get(name) or name, f"{where} class_name")
    if not isinstance(cls, type) or not all(callable(getattr(cls, m, None)) for m in _METHODS):
        raise TypeError(f"{where}: class_name {name} is not a tool class (it needs {', '.join(_METHODS)})")
    schema = entry.get("tool_schema")
    try:
        tool = cls(config, check_schema(schema, where) if schema is not None else None)
    except TypeError as exc:
        raise TypeError(f"{where}: constructing {name}(config, tool_schema) failed: {exc}") from exc
    return tool


class FunctionTool(BaseTool):
    """A plain function as a stateless tool; a sync function's ``execute`` is sync too, so the
    ``ToolSet`` runs it in its thread pool instead of blocking the trajectories' event loop."""

    def __init__(self, fn: Callable[..., Any], schema: dict[str, Any]):
        super().__init__({}, schema)
        self.fn = fn
        self.parameters = set(inspect.signature(fn).parameters)
        self.execute = self._execute_async if inspect.iscoroutinefunction(fn) else self._execute_sync

    def _unknown(self, parameters: dict[str, Any]):
        unknown = sorted(set(parameters) - self.parameters)
        if unknown:
            return ToolResponse(text=f"Error: {self.name} has no parameters {unknown}; it takes "
                                     f"{sorted(self.parameters)}"), 0.0, {}
        return None

    async def _execute_async(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        return self._unknown(parameters) or (await self.fn(**parameters), 0.0, {})

    def _execute_sync(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        return self._unknown(parameters) or (self.fn(**parameters), 0.0, {})


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def function_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI function schema of ``fn`` from its signature and docstring."""
    doc = inspect.getdoc(fn) or ""
    properties, required = {}, []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"function tool {fn.__name__}: *args/**kwargs cannot be described to the model")
        annotation = param.annotation if isinstance(param.annotation, type) else None
        properties[name] = {"type": _JSON_TYPES.get(annotation, "string")}
        if param.default is param.empty:
            required.append(name)
    return {"type": "function", "function": {
        "name": fn.__name__, "description": doc.split("\n\n")[0].replace("\n", " "),
        "parameters": {"type": "object", "properties": properties, "required": required}}}


def load_function_tools(path: str | Path) -> list[BaseTool]:
    file = Path(path).expanduser()
    if not file.is_file() or file.suffix != ".py":
        raise FileNotFoundError(f"actor_rollout_ref.rollout.multi_turn.function_tool_path={path}: not a .py file")
    module = load_module(str(file), "actor_rollout_ref.rollout.multi_turn.function_tool_path")
    names = getattr(module, "__all__", None) or [
        n for n, v in vars(module).items()
        if not n.startswith("_") and inspect.isfunction(v) and v.__module__ == module.__name__]
    tools = [FunctionTool(getattr(module, n), function_schema(getattr(module, n))) for n in names]
    if not tools:
        raise ValueError(f"function_tool_path={path}: the file defines no public functions to use as tools")
    return tools
