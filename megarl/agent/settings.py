"""The agent seam's settings: ``multi_turn.*`` checked and frozen, and what every loop of a run shares
(``AgentSettings``). ``megarl.settings.agent`` builds them from the config."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TRUNCATE_SIDES = ("left", "middle", "right")
SANITY_CHECK_MODES = ("strict", "ignore_strippable", "disable")
DRIFT_ACTIONS = ("warn", "raise")


@dataclass(frozen=True)
class MultiTurnSettings:
    enable: bool = False
    max_assistant_turns: int | None = None  # None: no limit but the response budget
    max_user_turns: int | None = None  # turns of tool responses
    max_parallel_calls: int = 1  # calls executed per assistant turn; the rest get an error message
    max_tool_response_length: int = 256  # characters of one tool response
    tool_response_truncate_side: str = "middle"
    tokenization_sanity_check_mode: str = "strict"
    drift_action: str = "warn"  # megarl: warn (metric + one warning) | raise
    format: str = "hermes"
    tool_timeout_s: float = 30.0  # megarl: a tool call that takes longer is cancelled and reported
    tool_config_path: str | None = None
    function_tool_path: str | None = None

    def __post_init__(self) -> None:
        problems = []
        for key in ("max_assistant_turns", "max_user_turns"):
            value = getattr(self, key)
            if value is not None and value < 1:
                problems.append(f"multi_turn.{key}={value}: use null (no limit) or a count >= 1")
        if self.max_parallel_calls < 1:
            problems.append(f"multi_turn.max_parallel_calls={self.max_parallel_calls}: must be >= 1")
        if self.max_tool_response_length < 1:
            problems.append(f"multi_turn.max_tool_response_length={self.max_tool_response_length}: must be >= 1")
        if self.tool_response_truncate_side not in TRUNCATE_SIDES:
            problems.append(f"multi_turn.tool_response_truncate_side={self.tool_response_truncate_side!r}: "
                            f"use one of {TRUNCATE_SIDES}")
        if self.tokenization_sanity_check_mode not in SANITY_CHECK_MODES:
            problems.append(f"multi_turn.tokenization_sanity_check_mode={self.tokenization_sanity_check_mode!r}: "
                            f"use one of {SANITY_CHECK_MODES}")
        if self.drift_action not in DRIFT_ACTIONS:
            problems.append(f"multi_turn.drift_action={self.drift_action!r}: use one of {DRIFT_ACTIONS}")
        if not self.tool_timeout_s > 0:
            problems.append(f"multi_turn.tool_timeout_s={self.tool_timeout_s}: must be > 0")
        if problems:
            raise ValueError("; ".join(problems))



@dataclass(frozen=True)
class AgentSettings:
    """What the loops of a run share, but the tokenizer and the tools (built from it in each process)."""

    response_length: int  # the response budget: model and tool tokens together
    multi_turn: MultiTurnSettings = MultiTurnSettings()
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()  # data.apply_chat_template_kwargs
    loop_paths: tuple[tuple[str, str], ...] = ()  # agent.agent_loop_config_path: name -> class path
    default_loop: str = "single_turn_agent"  # agent.default_agent_loop (tool_agent with multi_turn.enable)
    num_workers: int = 0  # agent.num_workers: 0 runs the loops in the controller process
    seed: int = 0  # rollout.seed: the turns' seeds derive from it


def truncate_text(text: str, limit: int, side: str) -> tuple[str, bool]:
    """``text`` cut to at most ``limit`` characters (marker included), and whether it was cut.

    As verl: ``left`` keeps the start of the text, ``right`` its end, ``middle`` both ends.
    """
    if len(text) <= limit:
        return text, False
    marker = "...(truncated)..."
    if limit <= len(marker):
        return text[:limit], True
    keep = limit - len(marker)
    if side == "left":
        return text[:keep] + marker, True
    if side == "right":
        return marker + text[len(text) - keep:], True
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head):], True
