"""The agent seam's settings from the config: ``actor_rollout_ref.rollout.multi_turn.*``,
``rollout.agent.*`` (``default_agent_loop``, ``agent_loop_config_path``, ``num_workers``), the
response budget (``rollout.response_length``), ``rollout.seed`` and ``data.apply_chat_template_kwargs``.
"""
from __future__ import annotations

from typing import Any

from megarl.agent.settings import AgentSettings, MultiTurnSettings

SINGLE_TURN_NAMES = ("single_turn_agent", "single_turn")


def multi_turn_settings(multi_turn: Any) -> MultiTurnSettings:
    """``rollout.multi_turn.*`` checked (its ``__post_init__`` raises naming every bad value)."""
    if multi_turn is None:
        return MultiTurnSettings()
    names = MultiTurnSettings.__dataclass_fields__
    return MultiTurnSettings(**{k: multi_turn[k] for k in names if k in multi_turn})


def agent_settings(cfg: Any) -> AgentSettings:
    rollout = cfg.actor_rollout_ref.rollout
    return AgentSettings(
        response_length=int(rollout.response_length), multi_turn=multi_turn_settings(rollout.multi_turn),
        chat_template_kwargs=tuple(sorted(dict(cfg.data.apply_chat_template_kwargs or {}).items())),
        loop_paths=tuple(sorted(load_agent_loop_config(rollout.agent.agent_loop_config_path).items())),
        default_loop=default_loop_name(rollout), num_workers=int(rollout.agent.num_workers), seed=int(rollout.seed))


def default_loop_name(rollout_cfg: Any) -> str:
    """``agent.default_agent_loop``; with ``multi_turn.enable`` a single-turn default becomes ``tool_agent``."""
    name = rollout_cfg.agent.default_agent_loop
    if rollout_cfg.multi_turn.enable and name in SINGLE_TURN_NAMES:
        return "tool_agent"
    return name


def load_agent_loop_config(path: str | None) -> dict[str, str]:
    """verl's ``agent.agent_loop_config_path``: a YAML list of ``{name, _target_}`` -> name -> class path."""
    if not path:
        return {}
    import yaml

    entries = yaml.safe_load(open(path)) or []
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "name" in e and "_target_" in e
                                                for e in entries):
        raise ValueError(f"agent.agent_loop_config_path={path}: expected a list of {{name, _target_: module.Class}}")
    return {str(e["name"]): str(e["_target_"]) for e in entries}
