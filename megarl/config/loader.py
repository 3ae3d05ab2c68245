"""Compose a config the way verl's command line does, and report all of its problems in one pass.

    cfg = compose_config("quickstart", ["actor_rollout_ref.rollout.n=8"], checks=...)

Launches and tools call ``megarl.checks.load_config``, which passes the checks; this module
knows no component (the trainer, the rollout, the rewards).

1. compose: the YAML (``--config-name``, default ``ppo_megatron_trainer``) with its defaults list,
   over megarl's schema defaults, then the overrides in Hydra's grammar (``compose.py``);
2. screen the keys: verl's other spellings move to megarl's keys, verl keys for features megarl
   lacks are refused, keys without effect are noted, unknown keys get a pointer (``screen.py``);
3. build the typed config (every value type-checked, each bad one reported), resolve ``${...}``;
4. ``checks(cfg, notes)``, given by the caller: the cross-key rules and, before a launch, the
   files the run will read (``megarl.checks``), whose problems join the same list.

Every step adds to one list of problems; a ``ConfigError`` lists them all, one line each. Nothing
here starts a process or builds a model: a bad launch fails in seconds.
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Callable, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megarl.config.compose import (CONFIG_DIR, DEFAULT_CONFIG, apply_overrides, compose_file, locate_config,
                                   packaged_configs)
from megarl.config.errors import ConfigError, Problem
from megarl.config.schema import MegaRLConfig
from megarl.config.screen import FREE, LEAF, schema_fields, screen_keys


__all__ = ["CONFIG_DIR", "DEFAULT_CONFIG", "Checks", "ConfigError", "compose_config", "resolve_config_path", "to_yaml"]


def resolve_config_path(name_or_path: str | os.PathLike, config_path: str | os.PathLike | None = None) -> Path:
    try:
        return locate_config(name_or_path, config_path)
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None


Checks = Callable[[DictConfig, list[str]], list[Problem]]  # (typed, resolved config, notes) -> its problems


def compose_config(name_or_path: str | os.PathLike | None = None, overrides: Sequence[str] = (), *,
                   config_path: str | os.PathLike | None = None, checks: Checks | None = None,
                   notes: list[str] | None = None) -> DictConfig:
    """The typed and resolved config, with ``checks`` run on it; ``ConfigError`` lists every problem found.

    ``name_or_path=None`` with ``config_path=None`` is the schema's defaults alone (no YAML);
    the command line passes ``DEFAULT_CONFIG`` instead, as verl does. ``notes``, if given, is
    filled with one line per accepted verl key that changes nothing in megarl (to be logged).
    """
    problems: list[Problem] = []
    notes = [] if notes is None else notes
    spellings: dict[str, str] = {}  # megarl key -> the verl spelling the user wrote
    defaults = OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(MegaRLConfig)))
    tree = defaults.copy()
    if name_or_path is not None or config_path is not None:
        try:
            path = locate_config(name_or_path, config_path, notes)
            layer = compose_file(path)
        except FileNotFoundError as exc:
            raise ConfigError(str(exc)) from None
        except Exception as exc:  # YAML syntax, a defaults entry that is not found, ...
            raise ConfigError(_composition_problem(name_or_path, exc)) from None
        notes += screen_keys(layer, str(path), problems, defaults, spellings)
        tree = OmegaConf.merge(tree, layer)
    apply_overrides(tree, overrides, problems)
    notes += screen_keys(tree, "command line", problems, defaults, spellings)

    cfg = _typed(tree, problems)
    missing = sorted(_missing_keys(cfg))
    resolved = not missing
    if missing:
        problems.append(Problem("required config keys are not set: " + ", ".join(missing)
                                + " (set them in the YAML or as key=value overrides)"))
    else:
        try:
            OmegaConf.resolve(cfg)
        except OmegaConfBaseException as exc:
            problems.append(Problem(f"cannot resolve an interpolation: {_first_line(exc)}"))
            resolved = False
    if checks is not None and resolved:  # also after other problems: every problem is reported in one pass
        problems += checks(cfg, notes)
    if problems:
        raise ConfigError([_as_given(p, spellings) for p in problems])
    notes[:] = list(dict.fromkeys(notes))
    return cfg


def _composition_problem(name: Any, exc: Exception) -> str:
    text = _first_line(exc)
    missing = re.search(r"Could not load '([^']+)'", text)
    if missing:
        entry = missing.group(1)
        hint = ("verl's FSDP default config; megarl trains with Megatron-core: use `- ppo_megatron_trainer`"
                if entry.rsplit("/", 1)[-1] == "ppo_trainer" else
                f"a config next to it, in the working directory or one of megarl's ({', '.join(packaged_configs())})")
        return f"{name}: its defaults list names '{entry}', which is not found: {hint}"
    return f"{name}: cannot compose the config: {text}"


def _as_given(problem: Problem, spellings: dict[str, str]) -> Problem:
    """Name the spelling the user wrote in a problem about the megarl key it maps onto."""
    given = spellings.get(problem.key or "")
    if given is None:
        return problem
    return dataclasses.replace(problem, message=f"{problem.message} (given as {given})")


def _typed(tree: DictConfig, problems: list[Problem]) -> DictConfig:
    """The structured config with every value of ``tree``; each value of the wrong type is a problem."""
    cfg = OmegaConf.structured(MegaRLConfig)
    fields = schema_fields()
    for key, value in _assignments(tree):
        if fields.get(key) not in (LEAF, FREE):
            problems.append(Problem(f"'{key}' is a section of the config; set its keys as {key}.<key>=value", key=key))
            continue
        value = _verl_value_forms(key, value)
        try:
            OmegaConf.update(cfg, key, value, merge=False)
        except OmegaConfBaseException as exc:
            problems.append(Problem(f"{key}={value!r}: {_first_line(exc)}", key=key))
    return cfg


def _assignments(tree: DictConfig, prefix: str = ""):
    fields = schema_fields()
    for key in tree.keys():
        full = f"{prefix}{key}"
        raw = tree._get_node(key)  # noqa: SLF001
        if OmegaConf.is_missing(tree, key):
            continue  # the schema's ??? stays
        if OmegaConf.is_interpolation(tree, key):
            yield full, raw._value()  # noqa: SLF001
        elif fields.get(full) == FREE or not isinstance(tree[key], DictConfig):
            yield full, OmegaConf.to_container(tree[key]) if OmegaConf.is_config(tree[key]) else tree[key]
        else:
            yield from _assignments(tree[key], full + ".")


def _verl_value_forms(key: str, value: Any) -> Any:
    """Value forms verl accepts that the schema's types do not: a logger name alone, an empty path."""
    if key == "trainer.logger" and isinstance(value, str) and not value.startswith("${"):
        return [value]
    if key.endswith(".dist_checkpointing_path") and value == "":
        return None
    if key.endswith((".lora.target_modules", ".lora.exclude_modules")) and isinstance(value, str) \
            and not value.startswith("${"):
        return [value]  # verl's FSDP form: target_modules: all-linear
    return value


def _missing_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Keys whose value is ??? (interpolations to them are not followed, so each is named once)."""
    found = []
    for key in node.keys():
        if OmegaConf.is_missing(node, key):
            found.append(f"{prefix}{key}")
        elif not OmegaConf.is_interpolation(node, key) and isinstance(node[key], DictConfig):
            found.extend(_missing_keys(node[key], f"{prefix}{key}."))
    return found


def _first_line(exc: Exception) -> str:
    text = getattr(exc, "msg", None) or str(exc)
    return " ".join(str(text).split("\n    full_key")[0].split())


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
