"""Sort every key of a composed (plain) config tree: megarl's, one of verl's, or unknown.

``screen_keys`` walks the tree once. A key the schema has stays. A key that a rule of
``megarl.config.verl_keys`` decides is taken out of the tree: an alias moves its value to the
megarl key, a refused key at a value that asks for a feature becomes a refusal, a noted key adds
its note. Every other key is unknown and becomes a problem with a pointer to the key meant.
What is left fits the schema's names (its types are checked when the typed config is built).
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from functools import lru_cache
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from megarl.config.errors import Problem, refusal
from megarl.config.schema import MegaRLConfig
from megarl.config.verl_keys import (ENGINE_ARG_KEYS, POINTERS, ROLLOUT_RS_DIVERGENCES, ROLLOUT_RS_NAMES,
                                     THRESHOLD_STRINGS, Alias, Mapped, Noted, Parameters, Refused, Renamed,
                                     alias_target, mapped_targets, rule_for, threshold_pair)

SECTION, LEAF, FREE = "section", "leaf", "free"  # FREE: a Dict field; whatever is under it belongs to it


@lru_cache(maxsize=None)
def schema_fields(schema: type = MegaRLConfig, prefix: str = "") -> dict[str, str]:
    """Every dotted key of the schema -> SECTION, LEAF or FREE."""
    out: dict[str, str] = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        full = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out[full] = SECTION
            out.update(schema_fields(tp, full + "."))
        elif typing.get_origin(tp) in (dict, typing.Dict):
            out[full] = FREE
        else:
            out[full] = LEAF
    return out


def schema_keys() -> list[str]:
    """Every dotted key of the schema, e.g. 'actor_rollout_ref.rollout.n'."""
    return list(schema_fields())


def in_schema(key: str) -> bool:
    """``key`` is a schema field or lies inside a free-form (Dict) field."""
    fields = schema_fields()
    if key in fields:
        return True
    parts = key.split(".")
    return any(fields.get(".".join(parts[:i])) == FREE for i in range(1, len(parts)))


def screen_keys(tree: DictConfig, source: str, problems: list[Problem], defaults: DictConfig,
                spellings: dict[str, str] | None = None) -> list[str]:
    """Take verl-only keys out of ``tree`` (see module docstring); return the notes to log.

    ``spellings`` receives megarl key -> the other spelling it was given as, for messages.
    """
    notes: dict[str, list[str]] = {}
    refused: dict[tuple, list[str]] = {}

    def select(node: DictConfig, path: str) -> Any:
        try:
            return OmegaConf.select(node, path)
        except Exception:  # an interpolation that does not resolve here: the typed build reports it
            return None

    def get(path: str) -> Any:
        return select(tree, path)

    as_given = tree.copy()  # conditional aliases look at the keys as given, before any of them moved

    for key, value in list(_leaves(tree)):
        if in_schema(key):
            if value is None and key.startswith("reward_model.") and select(defaults, key) is not None:
                _delete(tree, key)  # verl 2026 leaves its deprecated reward_model section null (reward.* is read)
            continue
        rule, target = _follow_aliases(key)
        if isinstance(rule, Alias) and rule.active is not None and not rule.active(lambda p: select(as_given, p)):
            pass  # a parameter of a feature that is off (deleted below)
        elif isinstance(rule, Alias):
            if _move(tree, key, target, value, defaults, problems) and spellings is not None:
                spellings[target] = key
            if rule.note:
                notes.setdefault(rule.note, []).append(key)
        elif isinstance(rule, Mapped):
            targets = mapped_targets(rule, key, value)
            if targets is None and not (value is None or (isinstance(value, str) and value.startswith("${"))):
                known = ", ".join(repr(v) for v in rule.values)
                problems.append(Problem(f"{key}={_show(value)}: megarl maps the values {known} of this verl key; "
                                        "use one of them", key=key))
            for target, target_value in (targets or {}).items():
                if _move(tree, key, target, target_value, defaults, problems, given=value) and spellings is not None:
                    spellings[target] = key
            if rule.note:
                notes.setdefault(rule.note, []).append(key)
        elif isinstance(rule, Refused):
            if rule.asks(value, get):
                refused.setdefault((rule.feature, rule.instead, rule.issue), []).append(f"{key}={_show(value)}")
            elif rule.note and value is not None and not (isinstance(value, str) and value.startswith("${")):
                notes.setdefault(rule.note, []).append(f"{key}={_show(value)}")
        elif isinstance(rule, Renamed):
            if value is not None:
                problems.append(Problem(f"{key} is a deprecated verl key that megarl does not convert; "
                                        f"set {rule.use} instead", key=key))
        elif isinstance(rule, Noted):
            notes.setdefault(rule.note, []).append(key)
        elif not isinstance(rule, Parameters):
            problems.append(Problem(f"{source}: unknown config key '{key}'.{suggest(target)}", key=key))
        _delete(tree, key)
    for (feature, instead, issue), keys in refused.items():
        problems.append(refusal(", ".join(keys), feature, instead, issue))
    _threshold_strings(tree, problems)
    _rollout_rs_names(tree, problems, notes)
    for key, target in ENGINE_ARG_KEYS.items():
        value = select(tree, key)
        if value is not None and _move(tree, key, target, value, defaults, problems):
            _delete(tree, key)
            if spellings is not None:
                spellings[target] = key
    return [f"{', '.join(keys)}: {note}" for note, keys in notes.items()]


def _rollout_rs_names(tree: DictConfig, problems: list[Problem], notes: dict[str, list[str]]) -> None:
    """verl 2026's rollout_rs level names: its ratio-bound (k1) levels are megarl's levels; others refused."""
    key = "algorithm.rollout_correction.rollout_rs"
    try:
        value = OmegaConf.select(tree, key, default=None)
    except Exception:  # an interpolation that does not resolve here: the typed build reports it
        return
    if not isinstance(value, str) or value.startswith("${"):
        return
    names = list(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
    if len(names) == 1 and names[0] in ROLLOUT_RS_NAMES:
        with open_dict(tree):
            OmegaConf.update(tree, key, ROLLOUT_RS_NAMES[names[0]], merge=False, force_add=True)
        notes.setdefault(f"read as {key}={ROLLOUT_RS_NAMES[names[0]]} (verl 2026's name of that level)",
                         []).append(f"{key}={value}")
    elif len(names) > 1 or (names and any(n in ROLLOUT_RS_NAMES or "_k" in n for n in names)):
        problems.append(refusal(f"{key}={value}", *ROLLOUT_RS_DIVERGENCES))
        with open_dict(tree):
            OmegaConf.update(tree, key, None, merge=False, force_add=True)


def _threshold_strings(tree: DictConfig, problems: list[Problem]) -> None:
    """verl's string forms of the ratio thresholds (``verl_keys.THRESHOLD_STRINGS``) as megarl's floats."""
    for key, lower_key in THRESHOLD_STRINGS.items():
        try:
            value = OmegaConf.select(tree, key, default=None)
        except Exception:  # an interpolation that does not resolve here: the typed build reports it
            continue
        if not isinstance(value, str) or value.startswith("${") or (pair := threshold_pair(value)) is None:
            continue  # a float, or not a threshold (the typed build reports it)
        lower, upper = pair
        with open_dict(tree):
            OmegaConf.update(tree, key, upper, merge=False, force_add=True)
        if lower is None:
            continue
        given = OmegaConf.select(tree, lower_key, default=None)
        if given is not None and given != lower:
            problems.append(Problem(f"{key}={value} sets {lower_key}={lower}, but {lower_key}={given} is given; "
                                    "give one of them", key=key))
        with open_dict(tree):
            OmegaConf.update(tree, lower_key, lower, merge=False, force_add=True)


def _follow_aliases(key: str) -> tuple[Any, str]:
    """The rule that decides ``key`` and, for an alias, its megarl key. An alias onto a key that is
    not the schema's but verl's other spelling of it (e.g. ``reward.reward_model.micro_batch_size_per_gpu``
    -> ``reward_model.micro_batch_size_per_gpu`` -> ``reward_model.rollout.max_num_seqs``) is followed;
    onto a refused or noted key, that key's rule decides."""
    rule, target = rule_for(key), key
    while isinstance(rule, Alias):
        target = alias_target(rule, target)
        if in_schema(target):
            return rule, target
        further = rule_for(target)
        if further is None:
            return None, target  # unknown under its megarl name too
        rule = further
    return rule, target


def suggest(key: str) -> str:
    """A pointer to the key probably meant: a close spelling, verl's name of it, or where the leaf lives."""
    fields = schema_fields()
    parent, _, leaf = key.rpartition(".")
    siblings = [k.rsplit(".", 1)[-1] for k in fields if k.rpartition(".")[0] == parent]
    close = difflib.get_close_matches(leaf, siblings, n=3, cutoff=0.6)
    if close:
        return " Did you mean " + " or ".join(f"'{parent + '.' if parent else ''}{c}'" for c in close) + "?"
    wanted = POINTERS.get(leaf)
    if wanted:
        found = _nearest([k for k in fields if k == wanted or k.endswith("." + wanted)], key)
        if found:
            return f" megarl's key for it is '{found[0]}'."
    elsewhere = _nearest([k for k in fields if k.rsplit(".", 1)[-1] == leaf], key)
    if elsewhere:
        return " A key of that name exists at " + ", ".join(f"'{k}'" for k in elsewhere) + "."
    if siblings:
        return f" Known keys here: {', '.join(sorted(siblings))}."
    return ""


def _nearest(candidates: list[str], key: str) -> list[str]:
    """Candidates sharing the longest dotted prefix with ``key`` (all of them on a tie)."""
    def shared(k: str) -> int:
        n = 0
        for a, b in zip(k.split("."), key.split(".")):
            if a != b:
                break
            n += 1
        return n

    if not candidates:
        return []
    best = max(shared(k) for k in candidates)
    return sorted(k for k in candidates if shared(k) == best)


def _move(tree: DictConfig, key: str, target: str, value: Any, defaults: DictConfig, problems: list[Problem],
          given: Any = None) -> bool:
    """An alias: ``target`` takes the value, unless it holds another value already (not its default).
    An interpolation is verl's wiring between its two spellings (e.g. ``${oc.select:reward_model.reward_manager}``),
    not a setting: it moves nowhere."""
    if value is None or (isinstance(value, str) and value.startswith("${")):
        return False
    current = OmegaConf.select(tree, target, default=None)
    default = OmegaConf.select(defaults, target, default=None)
    if current is not None and current != default and current != value:
        if given is not None:
            problems.append(Problem(f"{key}={_show(given)} means {target}={_show(value)}, but {target}="
                                    f"{_show(current)} is given; give one of them", key=key))
        else:
            problems.append(Problem(f"{key}={_show(value)} and {target}={_show(current)} are the same setting "
                                    "(two spellings) with different values; give one of them", key=key))
        return False
    with open_dict(tree):
        OmegaConf.update(tree, target, value, merge=False, force_add=True)
    return True


def _leaves(node: DictConfig, prefix: str = ""):
    """(dotted key, plain value) for every leaf; an empty section is a leaf with value {}."""
    for key in list(node.keys()):
        full = f"{prefix}{key}"
        if OmegaConf.is_interpolation(node, key) or OmegaConf.is_missing(node, key):
            yield full, node._get_node(key)._value()  # noqa: SLF001 ('${...}' or '???', unresolved)
            continue
        child = node[key]
        if isinstance(child, DictConfig) and len(child) and schema_fields().get(full) in (None, SECTION):
            yield from _leaves(child, full + ".")
        else:  # a value, or a whole free-form dict of the schema
            yield full, OmegaConf.to_container(child) if OmegaConf.is_config(child) else child


def _delete(tree: DictConfig, key: str) -> None:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(tree, parent) if parent else tree
    with open_dict(tree):
        if node is not None and leaf in node:
            del node[leaf]
        # drop sections left empty by the deletion, unless the schema has them
        while parent and not in_schema(parent):
            up, _, name = parent.rpartition(".")
            holder = OmegaConf.select(tree, up) if up else tree
            child = holder.get(name) if holder is not None else None
            if isinstance(child, DictConfig) and len(child) == 0:
                del holder[name]
            parent = up


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) and value == "" else str(value)
