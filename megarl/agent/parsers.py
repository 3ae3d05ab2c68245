"""Tool calls parsed from the model's text (``actor_rollout_ref.rollout.multi_turn.format``).

Built in: ``hermes`` (Qwen/Hermes style, verl's default): every
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the turn is a call; the text
outside the tags is the message content. A tag whose body is not a JSON object with a string
``name`` and an object ``arguments`` (a JSON string holding an object is accepted too) is a
malformed call: it is reported back to the model as an error, never executed. Another format is a
class with ``parse(text) -> ParsedTurn`` registered with ``register_tool_parser`` or given as a
path (``package.module:Class``).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from megarl.config.registry import Registry

TOOL_PARSERS = Registry("tool-call format", "actor_rollout_ref.rollout.multi_turn.format")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    content: str  # the text outside the tool-call markup
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one message per malformed call, in order

    @property
    def wants_tools(self) -> bool:
        return bool(self.calls or self.errors)


def register_tool_parser(name: str):
    return TOOL_PARSERS.register(name)


@register_tool_parser("hermes")
class HermesToolParser:
    pattern = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    unclosed = re.compile(r"<tool_call>(?!.*</tool_call>)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls, errors = [], []
        for match in self.pattern.finditer(text):
            call, error = self._one(match.group(1).strip())
            if call is not None:
                calls.append(call)
            else:
                errors.append(error)
        if self.unclosed.search(self.pattern.sub("", text)):
            errors.append("a <tool_call> tag was opened but never closed with </tool_call>")
        return ParsedTurn(self.pattern.sub("", text).strip(), calls, errors)

    @staticmethod
    def _one(body: str) -> tuple[ToolCall | None, str]:
        try:
            value = json.loads(body)
        except json.JSONDecodeError as exc:
            return None, f"the tool call is not valid JSON ({exc.msg} at position {exc.pos}): {body[:200]!r}"
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
            return None, f'a tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, got {body[:200]!r}'
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models emit the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            return None, f"the arguments of tool call {value['name']!r} must be a JSON object, got {arguments!r:.200}"
        return ToolCall(value["name"], arguments), ""


def get_tool_parser(name: str):
    """An instance of the parser registered as ``name`` or found at a class path."""
    if name in TOOL_PARSERS:
        return TOOL_PARSERS[name]()
    if ":" in name:
        from megarl.agent.loop import load_object

        return load_object(name, "tool-call format")()
    return TOOL_PARSERS[name]()  # raises the error that lists the known names
