"""Name -> function registries, with errors that list the known names.

Every named choice of the config is a registry entry: algorithms (`algorithm.adv_estimator`,
`policy_loss.loss_mode`, ...), rollout backends (`rollout.name`), weight-sync transports, rule
rewards, agent loops, tools, loggers. A `Registry` maps those names to plain functions (or
objects); a new entry is added with its decorator, without touching the trainer:

    @ADVANTAGE_ESTIMATORS.register("my_estimator", grouped=True)
    def my_estimator(token_level_rewards, response_mask, index): ...

Traits (`grouped=True`, `needs_gpu=True`, ...) are facts about an entry that other code asks
instead of comparing names (`registry.traits(name)["grouped"]`, `registry.having(grouped=True)`);
a registry declares its traits and their defaults, so every entry answers every trait.

`UniformCall` lets the trainer call whichever entry the config picked with one set of keyword
arguments: it passes each function only the arguments it declares (see its docstring).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any


class UnknownNameError(KeyError, ValueError):
    """A name that is not registered. Both a KeyError (mapping lookup) and a ValueError (bad config)."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


class Registry(Mapping[str, Callable[..., Any]]):
    """A read-only mapping from names to functions, filled by the `register` decorator.

    Args:
        kind: what the entries are, for messages ("advantage estimator").
        config_key: the config key that selects an entry, for messages ("algorithm.adv_estimator").
    """

    def __init__(self, kind: str, config_key: str, traits: Mapping[str, Any] | None = None) -> None:
        self.kind = kind
        self.config_key = config_key
        self.trait_defaults: dict[str, Any] = dict(traits or {})
        self._entries: dict[str, Callable[..., Any]] = {}
        self._traits: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **traits: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator that registers a function under `name` (with its traits) and returns it unchanged.

        Registering the same function twice is harmless (module reloads); registering a
        different function under a taken name is an error, so that one never silently
        replaces another. A trait the registry does not declare is an error.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        unknown = sorted(set(traits) - set(self.trait_defaults))
        if unknown:
            raise ValueError(f"{self.kind} {name!r}: unknown traits {unknown}; "
                             f"this registry has {sorted(self.trait_defaults) or 'none'}")

        def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
            existing = self._entries.get(name)
            if existing is not None and _unwrap(existing) is not _unwrap(fn):
                raise ValueError(
                    f"{self.kind} {name!r} is already registered to {_qualname(existing)}; "
                    f"pick another name for {_qualname(fn)}."
                )
            self._entries[name] = fn
            self._traits[name] = {**self.trait_defaults, **traits}
            return fn

        return decorator

    def traits(self, name: str) -> dict[str, Any]:
        """The traits of entry `name` (every declared trait, defaults filled in)."""
        self[name]  # raises the helpful error for an unknown name
        return dict(self._traits[name])

    def having(self, **traits: Any) -> frozenset[str]:
        """The names whose traits have all the given values."""
        return frozenset(name for name, held in self._traits.items()
                         if all(held.get(key) == value for key, value in traits.items()))

    def unregister(self, name: str) -> None:
        """Remove `name` (for tests and plugins that register temporarily)."""
        self[name]  # raises the helpful error for an unknown name
        del self._entries[name]
        del self._traits[name]

    def __getitem__(self, name: str) -> Callable[..., Any]:
        try:
            return self._entries[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name
            raise UnknownNameError(
                f"unknown {self.kind} {name!r} (set by `{self.config_key}`). "
                f"Known names: {', '.join(sorted(self._entries))}."
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={sorted(self._entries)})"


class UniformCall:
    """Call a registered function with keyword arguments, passing only those it declares.

    The trainer hands every advantage estimator (or policy loss) the same superset of inputs,
    e.g. `values` and `index` to all estimators, although GRPO has no use for `values`.
    Names from `shared` that the function does not declare are dropped. Any other name the
    function does not declare is an error (a typo in an option should not pass silently), as
    is a required parameter that is missing. A function with `**kwargs` receives everything.
    """

    def __init__(self, kind: str, name: str, fn: Callable[..., Any], shared: frozenset[str]) -> None:
        self.kind = kind
        self.name = name
        self.fn = fn
        self.shared = shared
        params = inspect.signature(fn).parameters.values()
        named_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        self.accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        self.accepted = frozenset(p.name for p in params if p.kind in named_kinds)
        self.required = frozenset(
            p.name for p in params if p.kind in named_kinds and p.default is inspect.Parameter.empty
        )

    def __call__(self, **kwargs: Any) -> Any:
        if not self.accepts_any:
            unexpected = set(kwargs) - self.accepted - self.shared
            if unexpected:
                raise TypeError(
                    f"{self.kind} {self.name!r} got unexpected argument(s) {sorted(unexpected)}; "
                    f"it accepts {sorted(self.accepted)}."
                )
            kwargs = {key: value for key, value in kwargs.items() if key in self.accepted}
        missing = self.required - set(kwargs)
        if missing:
            raise TypeError(
                f"{self.kind} {self.name!r} needs {sorted(missing)}, which the caller did not pass "
                f"(given: {sorted(kwargs)})."
            )
        return self.fn(**kwargs)

    def __repr__(self) -> str:
        return f"UniformCall({self.kind!r}, {self.name!r}, {_qualname(self.fn)})"


def _unwrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    return inspect.unwrap(fn)


def _qualname(fn: Callable[..., Any]) -> str:
    fn = _unwrap(fn)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
