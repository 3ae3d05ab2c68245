"""The field names of an installed dataclass, read from its source without importing it.

The controller checks ``override_transformer_config`` / ``override_optimizer_config`` names
before any process starts (``megarl plan``, pre-flight). Importing megatron-core for that costs
about 3 s (it pulls in its whole package tree); the names are the annotated assignments of the
class bodies, which ``ast`` reads from the installed files in milliseconds. Base classes are
followed through the module's own imports (absolute and relative). Whatever this cannot resolve
(a base from another package, a decorator-made field, a file that is not there) returns None,
and the caller imports the class instead, so the check is never less strict than
``dataclasses.fields``; a test holds the two equal for the installed megatron-core.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

_PLAIN_BASES = {"object"}


def _module_file(module: str) -> Path | None:
    """The source file of ``module`` found through its top-level package, importing nothing."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)  # a top-level find_spec runs no package code
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        base = Path(root).joinpath(*rest)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


@functools.lru_cache(maxsize=None)
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _imported_names(tree: ast.Module, module: str, is_package: bool) -> dict[str, tuple[str, str]]:
    """name -> (module, name) for the module's ``from ... import ...`` statements."""
    names = {}
    package = module if is_package else module.rsplit(".", 1)[0]
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                source = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                names[alias.asname or alias.name] = (source, alias.name)
    return names


def _is_classvar(annotation: ast.expr) -> bool:
    target = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
    return name in ("ClassVar", "InitVar")


def field_names(module: str, cls: str, _depth: int = 0) -> frozenset[str] | None:
    """Field names of dataclass ``module.cls`` including its bases' (None: not readable from source)."""
    path = _module_file(module)
    if path is None or _depth > 16:
        return None
    tree = _parsed(path)
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    if node is None:
        return None
    imports = _imported_names(tree, module, path.name == "__init__.py")
    names: set[str] = set()
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in _PLAIN_BASES:
            continue
        if not isinstance(base, ast.Name):
            return None
        if any(isinstance(n, ast.ClassDef) and n.name == base.id for n in tree.body):
            inherited = field_names(module, base.id, _depth + 1)
        elif base.id in imports:
            inherited = field_names(*imports[base.id], _depth=_depth + 1)
        else:
            return None
        if inherited is None:
            return None
        names |= inherited
    for statement in node.body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) \
                and not _is_classvar(statement.annotation):
            names.add(statement.target.id)
    return frozenset(names)
