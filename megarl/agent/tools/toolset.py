"""The tools of a rollout, and the rules for running one call: never a crash, never a hang.

``ToolSet.call`` runs one parsed call against its tool and always returns a ``CallOutcome``: the
text for the model, the step reward, the tool's metrics, and an ``error`` kind when it failed
(``unknown_tool``, ``raised``, ``timeout``, ``bad_return``). A failure becomes an error message to
the model, so the trajectory goes on and the failure is counted in the step's metrics. A call is
cancelled after ``multi_turn.tool_timeout_s``; a tool whose ``execute`` blocks (not a coroutine)
runs in the tool set's own thread pool, whose result is dropped after the timeout (Python cannot
stop a thread: such a tool should enforce its own limits, as the built-in Python tool does with a
separate process); being outside asyncio's default executor, a stuck thread never holds up the end
of a rollout.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from megarl.agent.tools.base import BaseTool, ToolResponse

logger = logging.getLogger(__name__)


@dataclass
class CallOutcome:
    text: str
    reward: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # unknown_tool | raised | timeout | bad_return


_THREADS = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="megarl-tool")


async def _maybe_await(fn, *args, timeout_s: float, **kwargs):
    if inspect.iscoroutinefunction(fn):
        return await asyncio.wait_for(fn(*args, **kwargs), timeout_s)
    call = asyncio.get_running_loop().run_in_executor(_THREADS, functools.partial(fn, *args, **kwargs))
    return await asyncio.wait_for(call, timeout_s)


class ToolSet:
    def __init__(self, tools: Mapping[str, BaseTool], timeout_s: float = 30.0):
        self.tools = dict(tools)
        self.timeout_s = float(timeout_s)

    def __bool__(self) -> bool:
        return bool(self.tools)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The OpenAI schemas, in config order: what the chat template renders into the prompt."""
        return [tool.get_openai_tool_schema() for tool in self.tools.values()]

    async def create(self, tools_kwargs: Mapping[str, Any]) -> dict[str, str]:
        """One instance per tool for a trajectory; ``tools_kwargs[name]["create_kwargs"]`` reaches ``create``."""
        unknown = sorted(set(tools_kwargs or {}) - set(self.tools))
        if unknown:
            raise ValueError(f"extra_info.tools_kwargs names tools {unknown} that the tool config does not define "
                             f"(defined: {sorted(self.tools)})")
        instances = {}
        for name, tool in self.tools.items():
            create_kwargs = dict(((tools_kwargs or {}).get(name) or {}).get("create_kwargs") or {})
            created = await _maybe_await(tool.create, timeout_s=self.timeout_s, **create_kwargs)
            instances[name] = created[0] if isinstance(created, tuple) else created
        return instances

    async def call(self, name: str, arguments: dict[str, Any], instances: Mapping[str, str],
                   tools_kwargs: Mapping[str, Any] | None = None) -> CallOutcome:
        tool = self.tools.get(name)
        if tool is None:
            return CallOutcome(f"Error: there is no tool named {name!r}; available tools: {', '.join(self.tools)}.",
                               error="unknown_tool")
        execute_kwargs = dict(((tools_kwargs or {}).get(name) or {}).get("execute_kwargs") or {})
        try:
            result = await _maybe_await(tool.execute, instances[name], arguments, timeout_s=self.timeout_s,
                                        **execute_kwargs)
        except asyncio.TimeoutError:
            return CallOutcome(f"Error: the tool {name!r} did not finish within {self.timeout_s:g} s and was stopped.",
                               error="timeout")
        except Exception as exc:  # a tool bug must not end the rollout
            logger.debug("tool %s raised", name, exc_info=True)
            return CallOutcome(f"Error: the tool {name!r} failed: {type(exc).__name__}: {exc}", error="raised")
        return _outcome(name, result)

    async def rewards(self, instances: Mapping[str, str], tools_kwargs: Mapping[str, Any] | None = None) -> dict[str, float]:
        """``calc_reward`` of every instance (a failing one counts 0 and is logged)."""
        out = {}
        for name, instance_id in instances.items():
            kwargs = dict(((tools_kwargs or {}).get(name) or {}).get("calc_reward_kwargs") or {})
            try:
                out[name] = float(await _maybe_await(self.tools[name].calc_reward, instance_id,
                                                     timeout_s=self.timeout_s, **kwargs))
            except Exception as exc:
                logger.warning("tool %s: calc_reward failed (counted 0): %s: %s", name, type(exc).__name__, exc)
                out[name] = 0.0
        return out

    async def release(self, instances: Mapping[str, str], tools_kwargs: Mapping[str, Any] | None = None) -> None:
        for name, instance_id in instances.items():
            kwargs = dict(((tools_kwargs or {}).get(name) or {}).get("release_kwargs") or {})
            try:
                await _maybe_await(self.tools[name].release, instance_id, timeout_s=self.timeout_s, **kwargs)
            except Exception as exc:
                logger.warning("tool %s: release failed: %s: %s", name, type(exc).__name__, exc)


def _outcome(name: str, result: Any) -> CallOutcome:
    """verl's ``(response, step_reward, metrics)``, a bare response, or a plain string."""
    response, reward, metrics = result, 0.0, {}
    if isinstance(result, tuple):
        if len(result) != 3:
            return CallOutcome(f"Error: the tool {name!r} returned a tuple of {len(result)} items.", error="bad_return")
        response, reward, metrics = result
    if isinstance(response, ToolResponse):
        text = response.text or ""
    elif isinstance(response, str):
        text = response
    elif isinstance(response, (dict, list, int, float, bool)) or response is None:
        text = json.dumps(response)
    else:
        return CallOutcome(f"Error: the tool {name!r} returned a {type(response).__name__}.", error="bad_return")
    try:
        reward = float(reward or 0.0)
    except (TypeError, ValueError):
        reward = math.nan
    if not math.isfinite(reward):
        return CallOutcome(text, 0.0, {}, error="bad_return")
    return CallOutcome(text, reward, dict(metrics or {}))
