"""Layers point down: the config and the algorithms know nothing of the trainer or of any component
above them, no component below the trainer imports it, and none imports the launch checks
(``megarl.checks``) that sit on top.

Every import is read from the source with ``ast``, the ones inside functions (lazy imports) too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import megarl

ROOT = Path(megarl.__file__).parent
COMPONENTS = ("agent", "algorithms", "cluster", "config", "data", "engine", "logging", "models", "platform", "rewards",
              "rollout", "trainer", "weight_sync")


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from megarl import algorithms`
    return {n for n in names if n == "megarl" or n.startswith("megarl.")}


def offending(package: str, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = sorted(m for m in imported_modules(path) if m != "megarl" and not m.startswith(allowed))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_the_config_imports_only_itself():
    assert offending("config", ("megarl.config",)) == {}


def test_the_algorithms_import_only_the_config_and_themselves():
    assert offending("algorithms", ("megarl.algorithms", "megarl.config")) == {}


def importers(packages, prefix: str) -> set[str]:
    """The files of ``packages`` that import a module under ``prefix``."""
    return {str(path.relative_to(ROOT)) for package in packages for path in sorted((ROOT / package).rglob("*.py"))
            if any(m == prefix or m.startswith(prefix + ".") for m in imported_modules(path))}


def test_nothing_below_the_trainer_imports_it():
    assert importers([p for p in COMPONENTS if p != "trainer"], "megarl.trainer") == set()


def test_no_component_imports_the_launch_checks():
    assert importers(COMPONENTS, "megarl.checks") == set()


def test_the_reader_finds_lazy_imports(tmp_path):
    """The check must see an import inside a function, where the upward ones used to hide."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from megarl.cluster.placement import plan_from_config\n")
    assert "megarl.cluster.placement" in imported_modules(source)
