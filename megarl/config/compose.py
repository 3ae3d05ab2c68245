"""verl's command-line config composition, with Hydra's own code.

verl's entry point is a ``@hydra.main`` app: ``--config-path`` / ``--config-name`` pick a YAML
file, its ``defaults:`` list pulls in other configs (usually ``ppo_megatron_trainer``), and every
other argument is a Hydra override (``a.b=1``, ``+a.b=1`` adds a key, ``++a.b=1`` adds or sets,
``~a.b`` deletes, values in Hydra's grammar: ``[a,b]``, ``{k: v}``, ``null``, quoted strings).
megarl composes the same way with hydra-core's compose API and its override parser, so every
form a verl user writes means the same here. What megarl adds:

* megarl's packaged ``configs/`` are always on the search path, so a ``defaults:`` entry or a
  ``--config-name`` of ``ppo_megatron_trainer`` (the default config) finds megarl's version;
* the base every override applies to is megarl's whole schema (its defaults) under the YAML, as
  verl's base is its whole default config; a verl key megarl decides in ``verl_keys`` counts as
  present (verl's defaults have it), and so does a new key inside a free-form dict field
  (``override_transformer_config``, ``engine_kwargs.vllm``, ...): neither needs a ``+``;
* every override is applied on its own, so all bad overrides are reported, not the first.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from megarl.config.errors import Problem
from megarl.config.screen import in_schema, suggest
from megarl.config.verl_keys import ADDED_WITH_PLUS, rule_for

CONFIG_DIR = Path(os.environ.get("MEGARL_CONFIG_DIR", Path(__file__).resolve().parents[2] / "configs"))
DEFAULT_CONFIG = "ppo_megatron_trainer"  # verl's default config name for the Megatron trainer
YAML_SUFFIXES = (".yaml",)  # Hydra loads .yaml files


def packaged_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def locate_config(config_name: str | os.PathLike | None, config_path: str | os.PathLike | None = None,
                  notes: list[str] | None = None) -> Path:
    """The YAML file a ``--config-path`` / ``--config-name`` pair names.

    The name may carry ``.yaml`` or not, and may be a path. It is looked up in ``config_path``
    (relative to the working directory; a relative path that does not exist here is verl's
    form, relative to verl's entry script, i.e. verl's packaged configs: megarl's are used),
    then in the working directory, then in megarl's packaged ``configs/``.
    """
    name = str(config_name) if config_name is not None else DEFAULT_CONFIG
    dirs: list[Path] = []
    if config_path is not None:
        given = Path(config_path).expanduser()
        if given.is_dir():
            dirs.append(given)
        elif given.is_absolute():
            raise FileNotFoundError(f"--config-path {config_path}: no such directory")
        elif notes is not None:
            notes.append(f"--config-path {config_path}: not a directory here; as in verl (where it is relative to "
                         f"the entry script) it means the packaged configs, megarl's {CONFIG_DIR}")
    dirs += [Path.cwd(), CONFIG_DIR]
    candidates = [name] if name.endswith(YAML_SUFFIXES) else [name + s for s in YAML_SUFFIXES] + [name]
    if Path(name).expanduser().is_absolute():
        dirs = [Path("/")]
    for folder in dirs:
        for candidate in candidates:
            path = folder / Path(candidate).expanduser()
            if path.is_file():
                return path.resolve()
    looked = ", ".join(str(d) for d in dict.fromkeys(dirs))
    raise FileNotFoundError(f"config '{name}' not found in {looked}; megarl's packaged configs: {packaged_configs()}")


def compose_file(path: Path) -> DictConfig:
    """The YAML at ``path`` with its ``defaults:`` list composed (Hydra), as a plain DictConfig."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    searchpath = [f"file://{CONFIG_DIR}"]
    declared = OmegaConf.select(OmegaConf.load(path), "hydra.searchpath", default=None) or []
    for entry in declared:  # verl's YAMLs point at verl's package (file://verl/trainer/config): dropped
        entry = str(entry)
        if not entry.startswith("file://") or Path(entry[len("file://"):]).is_dir():
            searchpath.insert(0, entry)
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with initialize_config_dir(config_dir=str(path.parent), version_base=None):
            cfg = compose(config_name=path.name, overrides=[f"hydra.searchpath=[{','.join(searchpath)}]"])
    OmegaConf.set_struct(cfg, False)
    return cfg


def apply_overrides(tree: DictConfig, overrides: Sequence[str], problems: list[Problem]) -> None:
    """Apply command-line overrides to ``tree`` with Hydra's semantics, each on its own."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    OmegaConf.set_struct(tree, True)  # as Hydra: a key that is not there needs '+'
    try:
        for text in overrides:
            try:
                override = parser.parse_override(text)
            except HydraException as exc:
                problems.append(Problem(f"command line: cannot parse '{text}' as key=value in Hydra's grammar: "
                                        f"{_first_line(exc)}"))
                continue
            if override.is_sweep_override():
                problems.append(Problem(f"command line: '{text}' is a sweep (several values); megarl runs one "
                                        "job per launch: give one value", key=override.key_or_group))
                continue
            key = override.key_or_group
            present = _present(tree, key)
            if override.package is None and not present and _known_without_plus(key):
                if not override.is_delete():  # nothing to delete: verl's default would be used anyway
                    OmegaConf.update(tree, key, override.value(), merge=True, force_add=True)
                continue
            if override.is_add() and present and key in ADDED_WITH_PLUS:  # verl's defaults lack it: '+' sets it
                OmegaConf.update(tree, key, override.value(), merge=True)
                continue
            try:
                ConfigLoaderImpl._apply_overrides_to_config([override], tree)
            except HydraException as exc:
                if override.package is None and not present and not override.is_delete():
                    problems.append(Problem(f"command line: unknown config key '{key}'.{suggest(key)}", key=key))
                else:
                    problems.append(Problem(f"command line: '{text}': {_first_line(exc)}", key=key))
    finally:
        OmegaConf.set_struct(tree, False)


def _present(tree: DictConfig, key: str) -> bool:
    """Whether ``key`` is in ``tree``, without resolving its value: ``critic.model.path`` is
    ``${actor_rollout_ref.model.path}``, which a later override may set, so an override of it
    must not need that value yet."""
    try:
        return OmegaConf.select(tree, key, default=_ABSENT, throw_on_missing=False) is not _ABSENT
    except InterpolationResolutionError:  # present, an interpolation to a value not set yet
        return True


def _known_without_plus(key: str) -> bool:
    """Keys a verl user sets without '+': verl's own keys, and new keys inside free-form dicts."""
    return rule_for(key) is not None or in_schema(key)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("See https")]
    return " ".join(lines[:3])


class _Absent:
    pass


_ABSENT: Any = _Absent()
