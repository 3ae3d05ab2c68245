"""Every check a launch runs before any process starts, and the config loader that runs them.

This package sits above every component: a rule checks a value against the component that reads
it (the estimators' registry, the weight-sync transports, the trainer's async modes, megatron's
config fields), so it imports them; ``megarl.config`` below it composes and types the tree and
imports none of them.

    cfg = load_config("quickstart", ["actor_rollout_ref.rollout.n=8"])      # config rules
    cfg = load_config("grpo_math", overrides, config_path="config", preflight=True)  # + files, memory

* ``rules.py``: cross-key rules of the typed config (values, combinations, batch arithmetic),
  LoRA's (``lora.py``) and the engine's keys (``megarl.checks.engine_keys``);
* ``preflight.py`` (``preflight=True``): what the run will read (model, checkpoints, data, reward
  function) and, on a GPU, its memory plan (``megarl.plan.check``).
"""
from __future__ import annotations

import os
from typing import Sequence

from omegaconf import DictConfig

from megarl.checks.rules import config_problems
from megarl.config import ConfigError, Problem, compose_config
from megarl.config.derived import derive_async_keys

__all__ = ["ConfigError", "config_problems", "load_config", "launch_problems", "validate_config"]


def launch_problems(cfg: DictConfig, notes: list[str], preflight: bool = False) -> list[Problem]:
    """Every problem of a typed, resolved config (``preflight``: with the files it names)."""
    derive_async_keys(cfg, notes)
    problems = config_problems(cfg, notes)
    if preflight:
        from megarl.checks.preflight import preflight_problems

        problems += preflight_problems(cfg)
    return problems


def load_config(name_or_path: str | os.PathLike | None = None, overrides: Sequence[str] = (),
                validate: bool = True, *, config_path: str | os.PathLike | None = None,
                preflight: bool = False, notes: list[str] | None = None) -> DictConfig:
    """The typed, resolved and checked config; ``ConfigError`` lists every problem found.

    ``name_or_path=None`` with ``config_path=None`` is the schema's defaults alone (no YAML); the
    command line passes ``DEFAULT_CONFIG`` instead, as verl does. ``validate=False`` composes and
    types only. ``notes``, if given, is filled with one line per accepted verl key that changes
    nothing in megarl (to be logged).
    """
    def checks(cfg: DictConfig, found_notes: list[str]) -> list[Problem]:
        return launch_problems(cfg, found_notes, preflight)

    return compose_config(name_or_path, overrides, config_path=config_path, notes=notes,
                          checks=checks if validate else None)


def validate_config(cfg: DictConfig) -> None:
    """Raise a ``ConfigError`` listing every problem of ``cfg`` (the config rules)."""
    problems = config_problems(cfg)
    if problems:
        raise ConfigError(problems)
