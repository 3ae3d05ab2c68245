"""verl's tool interface: a class with ``create`` / ``execute`` / ``calc_reward`` / ``release``.

A tool is built once per rollout from its config entry (``BaseTool(config, tool_schema)``) and
serves many trajectories at once: ``create`` makes an instance for one trajectory (with the
sample's ``extra_info.tools_kwargs.<tool>.create_kwargs``) and returns its id, ``execute`` runs
one call and returns ``(response, step_reward, metrics)``, ``calc_reward`` scores the instance at
the end, ``release`` frees it. All four are coroutines. verl's return conventions are accepted
too (``create`` returning ``(instance_id, ToolResponse)``, ``execute`` returning a plain string).

``tool_schema`` is the OpenAI function schema (``{"type": "function", "function": {"name",
"description", "parameters"}}``); its name is the name the model calls.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any


@dataclass
class ToolResponse:
    """What a tool call returns to the model (verl's class; text only in megarl)."""

    text: str | None = None
    image: Any = None
    video: Any = None

    def __post_init__(self) -> None:
        if self.image is not None or self.video is not None:
            raise ValueError("tool responses with images or video are not supported by megarl (text only)")


def check_schema(tool_schema: Any, where: str) -> dict[str, Any]:
    """An OpenAI function schema as a plain dict, or a ValueError naming what is missing."""
    if hasattr(tool_schema, "model_dump"):
        tool_schema = tool_schema.model_dump()
    if not isinstance(tool_schema, dict) or tool_schema.get("type") != "function":
        raise ValueError(f"{where}: tool_schema must be an OpenAI function schema with type: function, "
                         f"got {tool_schema!r:.200}")
    function = tool_schema.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"{where}: tool_schema.function.name is missing")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ValueError(f"{where}: tool_schema.function.parameters must be a JSON schema of type object")
    return {"type": "function", "function": {**function, "parameters": parameters}}


class BaseTool:
    def __init__(self, config: dict[str, Any] | None, tool_schema: dict[str, Any]):
        self.config = dict(config or {})
        self.tool_schema = check_schema(tool_schema, type(self).__name__)
        self.name = self.tool_schema["function"]["name"]
        self._instances: dict[str, dict[str, Any]] = {}

    def get_openai_tool_schema(self) -> dict[str, Any]:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        instance_id = instance_id or str(uuid.uuid4())
        self._instances[instance_id] = dict(kwargs)
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        raise NotImplementedError(f"{type(self).__name__}.execute")

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)

    def instance(self, instance_id: str) -> dict[str, Any]:
        """The state ``create`` stored for ``instance_id``."""
        if instance_id not in self._instances:
            raise KeyError(f"tool {self.name!r} has no instance {instance_id!r}: call create first")
        return self._instances[instance_id]
