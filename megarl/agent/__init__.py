"""Agent loops: the rollout seam (single-turn and multi-turn tool calling) between the controller
and the rollout fleet. See ``loop`` (the interface and registry), ``builtin_loops``, ``rollout``
(what the controller calls), ``tools`` (verl's tool interface and megarl's built-in tools)."""
from megarl.agent.loop import AGENT_LOOPS, AgentContext, AgentLoop, AgentSample, register_agent_loop, resolve_agent_loop
from megarl.agent.parsers import TOOL_PARSERS, ParsedTurn, ToolCall, register_tool_parser
from megarl.agent.rollout import AgentRollout, build_agent_context, tool_schemas_for
from megarl.agent.settings import MultiTurnSettings
from megarl.agent.trajectory import Trajectory, TrajectoryBuilder

__all__ = ["AGENT_LOOPS", "AgentContext", "AgentLoop", "AgentRollout", "AgentSample", "MultiTurnSettings",
           "ParsedTurn", "TOOL_PARSERS", "ToolCall", "Trajectory", "TrajectoryBuilder", "build_agent_context",
           "register_agent_loop", "register_tool_parser", "resolve_agent_loop", "tool_schemas_for"]
