"""Load a YAML config, apply dotted overrides, check every key against the schema.

    cfg = load_config("quickstart", ["actor_rollout_ref.rollout.n=8"])

The name is a YAML path or the stem of a file in ``configs/``. Overrides use verl's form,
``a.b.c=value`` with YAML values (``trainer.logger=['console']``). Nothing here starts a
process or touches a GPU, so a bad config fails in a second, before any allocation.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megarl.config.schema import MegaRLConfig

CONFIG_DIR = Path(os.environ.get("MEGARL_CONFIG_DIR", Path(__file__).resolve().parents[2] / "configs"))


class ConfigError(ValueError):
    """A config problem, worded so that the message says which key and how to fix it."""


def resolve_config_path(name_or_path: str | os.PathLike) -> Path:
    path = Path(name_or_path)
    if path.is_file():
        return path
    for candidate in (CONFIG_DIR / f"{name_or_path}.yaml", CONFIG_DIR / str(name_or_path)):
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError(f"config '{name_or_path}' not found: not a file, and not one of {known} in {CONFIG_DIR}")


def load_config(name_or_path: str | os.PathLike | None = None, overrides: Sequence[str] = (),
                validate: bool = True) -> DictConfig:
    """Return the resolved, type-checked and validated config (a structured DictConfig)."""
    layers = []
    if name_or_path is not None:
        path = resolve_config_path(name_or_path)
        try:
            layer = OmegaConf.load(path)
        except Exception as exc:  # yaml syntax errors
            raise ConfigError(f"{path}: cannot parse YAML: {exc}") from exc
        layer = OmegaConf.create(apply_renames(OmegaConf.to_container(layer), source=str(path)))
        check_known_keys(OmegaConf.to_container(layer), source=str(path))
        layers.append(layer)
    if overrides:
        layer = OmegaConf.create(apply_renames(OmegaConf.to_container(parse_overrides(overrides)), "command line"))
        check_known_keys(OmegaConf.to_container(layer), source="command line")
        layers.append(layer)

    try:
        cfg = OmegaConf.merge(OmegaConf.structured(MegaRLConfig), *layers)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"{key}: {exc.msg if hasattr(exc, 'msg') else exc}".split("\n    full_key")[0]) from exc
    _check_resolvable_and_complete(cfg)
    if validate:
        from megarl.config.validate import validate_config

        validate_config(cfg)
    return cfg


def parse_overrides(overrides: Iterable[str]) -> DictConfig:
    items = []
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' is not of the form key=value "
                              "(example: actor_rollout_ref.rollout.n=8)")
        items.append(item[1:] if item.startswith("+") else item)
    try:
        return OmegaConf.from_dotlist(items)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot parse overrides {items}: {exc}") from exc


# Old spellings of keys that verl users still write, and the key that holds each now.
RENAMED_KEYS = {
    "actor_rollout_ref.rollout.tool_kwargs.tools_config_file": "actor_rollout_ref.rollout.multi_turn.tool_config_path",
}


def apply_renames(tree: Any, source: str) -> Any:
    """Move every old-spelled key of ``tree`` to its current name, with one warning each."""
    import logging

    if not isinstance(tree, dict):
        return tree
    for old, new in RENAMED_KEYS.items():
        *parents, leaf = old.split(".")
        node = tree
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        value = node.pop(leaf)
        logging.getLogger(__name__).warning("%s: '%s' is an old spelling; read as '%s'", source, old, new)
        target = tree
        *new_parents, new_leaf = new.split(".")
        for part in new_parents:
            target = target.setdefault(part, {})
        target[new_leaf] = value
        for depth in range(len(parents), 0, -1):  # drop sections the move left empty
            holder = tree
            for part in parents[:depth - 1]:
                holder = holder[part]
            if holder.get(parents[depth - 1]) == {}:
                del holder[parents[depth - 1]]
    return tree


def schema_keys(schema: type = MegaRLConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, e.g. 'actor_rollout_ref.rollout.n'."""
    keys = []
    for f in dataclasses.fields(schema):
        full = f"{prefix}{f.name}"
        keys.append(full)
        sub = _dataclass_type(schema, f)
        if sub is not None:
            keys.extend(schema_keys(sub, full + "."))
    return keys


def check_known_keys(tree: Any, source: str, schema: type = MegaRLConfig, prefix: str = "") -> None:
    """Reject keys the schema does not have, suggesting the closest known key."""
    if not isinstance(tree, dict):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key, value in tree.items():
        full = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(f"{source}: unknown config key '{full}'.{_suggest(str(key), full, list(fields), prefix)}")
        sub = _dataclass_type(schema, fields[key])
        if sub is not None:
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"{source}: '{full}' is a section (keys: {', '.join(f.name for f in dataclasses.fields(sub))}); "
                                  f"give it a mapping, or set one of its keys as {full}.<key>=value")
            check_known_keys(value, source, sub, full + ".")


def _suggest(key: str, full: str, siblings: list[str], prefix: str) -> str:
    close = difflib.get_close_matches(key, siblings, n=3, cutoff=0.6)
    if close:
        return " Did you mean " + " or ".join(f"'{prefix}{c}'" for c in close) + "?"
    elsewhere = [k for k in schema_keys() if k.rsplit(".", 1)[-1] == key]
    if elsewhere:
        return " A key of that name exists at " + ", ".join(f"'{k}'" for k in elsewhere) + "."
    return f" Known keys here: {', '.join(sorted(siblings))}."


def _dataclass_type(schema: type, f: dataclasses.Field) -> type | None:
    hints = getattr(schema, "__dataclass_hints__", None)
    if hints is None:
        import typing

        hints = typing.get_type_hints(schema)
        schema.__dataclass_hints__ = hints
    tp = hints[f.name]
    return tp if dataclasses.is_dataclass(tp) else None


def _check_resolvable_and_complete(cfg: DictConfig) -> None:
    missing = sorted(_missing_keys(cfg))
    if missing:
        raise ConfigError("required config keys are not set: " + ", ".join(missing)
                          + " (set them in the YAML or as key=value overrides)")
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot resolve an interpolation: {exc}") from exc


def _missing_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Keys whose value is ??? (interpolations to them are not followed, so each is named once)."""
    found = []
    for key in node.keys():
        if OmegaConf.is_missing(node, key):
            found.append(f"{prefix}{key}")
        elif not OmegaConf.is_interpolation(node, key) and isinstance(node[key], DictConfig):
            found.extend(_missing_keys(node[key], f"{prefix}{key}."))
    return found


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
