"""The rollout seam: agent loops, registered by name and chosen per sample.

An agent loop turns one sample's prompt into a ``Trajectory``. It gets an ``AgentSample`` (prompt
token ids, chat messages, ``extra_info`` with verl's ``tools_kwargs``, and the numbers its seeds
derive from) and a ``GenerateClient`` (token in, token out, sticky to one engine replica), and
may call the engine as often as it likes: a single-turn loop calls it once, the tool loop once
per assistant turn. Many loops run concurrently (asyncio), so ``run`` must not block.

Which loop runs a sample: the dataset's ``agent_name`` column (verl's), else
``actor_rollout_ref.rollout.agent.default_agent_loop``. The config names the loops a run may use:
the registered ones (built in: ``single_turn_agent`` alias ``single_turn``, and ``tool_agent``),
the names of ``agent.agent_loop_config_path`` and ``default_agent_loop`` itself, which may be a
class path, ``package.module:Class`` or ``/path/to/file.py:Class``. A row picks among those
(``allowed_loop_names``): the data never names code to import, so a downloaded dataset cannot
run any. Your own::

    from megarl.agent import AgentLoop, register_agent_loop

    @register_agent_loop("my_loop")
    class MyLoop(AgentLoop):
        async def run(self, sample, client):
            ...
            return builder.build("stop", text, num_turns=2)
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from megarl.agent.trajectory import Trajectory
from megarl.config.registry import Registry, UnknownNameError
from megarl.rollout.sampling import Sampling, turn_seed

AGENT_LOOPS = Registry("agent loop", "actor_rollout_ref.rollout.agent.default_agent_loop (or the agent_name column)")


@dataclass(frozen=True)
class AgentSample:
    """One sample to roll out: the ``sample_index``-th response to prompt ``prompt_index`` of a step."""

    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    extra_info: dict[str, Any]
    prompt_index: int
    sample_index: int
    step: int
    base_seed: int
    sampling: Sampling  # this call's sampling (training or validation); ``max_tokens`` is not the budget
    images: tuple = ()  # the prompt's images (a vision-language row; megarl.data.images), sent with every turn

    def seed(self, turn: int) -> int:
        """The seed of this sample's ``turn``-th engine call (see ``rollout.sampling.turn_seed``)."""
        return turn_seed(self.base_seed, self.step, self.prompt_index, self.sample_index, turn)

    @property
    def tools_kwargs(self) -> dict[str, Any]:
        """verl's ``extra_info.tools_kwargs``: per tool name, ``create_kwargs`` / ``execute_kwargs`` / ..."""
        return dict(self.extra_info.get("tools_kwargs") or {})


@dataclass
class AgentContext:
    """What every loop of a run shares: the tokenizer, the response budget, tools and settings."""

    tokenizer: Any
    response_length: int  # the response budget: model and tool tokens together
    multi_turn: Any = None  # MultiTurnSettings (megarl.agent.settings)
    tools: Any = None  # ToolSet, or None without tools
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    loop_paths: dict[str, str] = field(default_factory=dict)  # agent.agent_loop_config_path: name -> class path
    default_loop: str | None = None  # agent.default_agent_loop (a name or a class path the config gives)


class AgentLoop:
    """Base class of agent loops. One instance serves every sample of a rollout that picks it.

    ``run_group`` rolls out the samples of one prompt together; the seam calls it (instead of
    ``run`` per sample) for loops with ``groups_samples = True``, which must give each sample
    exactly what ``run`` would (the single-turn loop sends the group as one engine request).
    """

    uses_tools = False  # True: prompts are rendered with the tool schemas (the dataset does it)
    groups_samples = False  # True: the seam hands ``run_group`` all samples of a prompt at once

    def __init__(self, context: AgentContext):
        self.context = context

    async def run(self, sample: AgentSample, client) -> Trajectory:
        raise NotImplementedError

    async def run_group(self, samples: list[AgentSample], client) -> list[Trajectory]:
        import asyncio

        return list(await asyncio.gather(*[self.run(sample, client) for sample in samples]))


def register_agent_loop(name: str) -> Callable[[type], type]:
    """Class decorator: make an ``AgentLoop`` subclass selectable as ``name``."""
    def decorator(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
            raise TypeError(f"register_agent_loop({name!r}) decorates AgentLoop subclasses, got {cls!r}")
        return AGENT_LOOPS.register(name)(cls)

    return decorator


_loaded: dict[str, type] = {}


class DisallowedAgentLoop(UnknownNameError):
    """A loop name that the run's config does not offer (e.g. a class path in a dataset's ``agent_name``)."""


def allowed_loop_names(context: AgentContext) -> list[str]:
    """The loops a sample may name: registered ones, ``agent_loop_config_path``'s and the default."""
    import megarl.agent.builtin_loops  # noqa: F401  (registers the built-in loops)

    return sorted({*AGENT_LOOPS, *context.loop_paths, *([context.default_loop] if context.default_loop else [])})


def check_loop_name(name: str, context: AgentContext) -> None:
    """Refuse a loop ``name`` the config does not offer, before anything is imported for it."""
    allowed = allowed_loop_names(context)
    if name not in allowed:
        raise DisallowedAgentLoop(
            f"agent loop {name!r} is not one of this run's: {', '.join(allowed)} (registered loops, the names in "
            "actor_rollout_ref.rollout.agent.agent_loop_config_path and agent.default_agent_loop). A dataset's "
            "agent_name picks among these; a module or file it names is never imported: list your loop in "
            "agent_loop_config_path ({name, _target_: module.Class}) and put its name in the data")


def resolve_agent_loop(name: str) -> type:
    """The loop class for a registered name or a ``module:Class`` / ``file.py:Class`` path."""
    import megarl.agent.builtin_loops  # noqa: F401  (registers the built-in loops)

    if name in AGENT_LOOPS:
        return AGENT_LOOPS[name]
    if not isinstance(name, str) or ":" not in name:
        raise UnknownNameError(f"unknown agent loop {name!r} (from the agent_name column or "
                               f"actor_rollout_ref.rollout.agent.default_agent_loop). Registered: "
                               f"{', '.join(sorted(AGENT_LOOPS))}; or give a class path 'package.module:Class' "
                               "or '/path/file.py:Class'.")
    if name not in _loaded:
        cls = load_object(name, "agent loop")
        if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
            raise TypeError(f"agent loop {name!r} is {cls!r}, not a subclass of megarl.agent.AgentLoop")
        _loaded[name] = cls
    return _loaded[name]


def load_module(module_part: str, what: str):
    """An importable module (``package.module``) or a Python file (``/path/file.py``), loaded once."""
    from megarl.agent.verl_imports import verl_import_problem

    if not module_part.endswith(".py"):
        try:
            return importlib.import_module(module_part)
        except ImportError as exc:
            raise ImportError(verl_import_problem(exc, f"{what}: {module_part}")
                              or f"{what}: cannot import {module_part!r}: {exc}") from exc
    file = Path(module_part).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"{what}: file {file} not found")
    module_name = "megarl_user_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except ImportError as exc:
            del sys.modules[module_name]
            problem = verl_import_problem(exc, f"{what}: {file}")
            if problem is None:
                raise
            raise ImportError(problem) from None
        except Exception:
            del sys.modules[module_name]
            raise
    return module


def load_object(path: str, what: str) -> Any:
    """``package.module:Name``, ``package.module.Name`` or ``/path/file.py:Name`` -> the object."""
    if ":" in path:
        module_part, attr = path.rsplit(":", 1)
    else:
        module_part, _, attr = path.rpartition(".")
    if not module_part or not attr:
        raise ValueError(f"{what} {path!r}: give 'package.module:Name' or '/path/file.py:Name'")
    module = load_module(module_part, f"{what} {path!r}")
    if not hasattr(module, attr):
        raise AttributeError(f"{what} {path!r}: {module_part} has no attribute {attr!r}")
    return getattr(module, attr)
