"""Layers point down: every folder of ``megarl/`` sits on one floor and imports only from floors below.

The floor table is the map of the house (docs/layout.md). Every import is read from the source
with ``ast``, the ones inside functions (lazy imports) too, and imports named in strings (class
paths Ray, vLLM or a registry load) are held to the same table.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import megarl

ROOT = Path(megarl.__file__).parent

# floor -> folders (or top-level modules). A folder may import its own floor's folder (itself) only.
FLOORS = {
    1: ("config", "platform", "logging"),          # the typed config, CUDA vs CPU, the console and metric sinks
    2: ("algorithms", "models", "data"),           # pure torch algorithms, the HF <-> megatron bridge, datasets
    3: ("engine", "weight_sync"),                  # the Megatron engine; layouts -> plan -> buckets -> transport
    4: ("rollout",),                               # the fleet and its backends (vllm/, hf/)
    5: ("rewards",),                               # rule and custom rewards, reward models and judges
    6: ("agent", "cluster"),                       # agent loops and tools; placement, Ray, the worker group
    7: ("settings",),                              # the door: what a config implies, for the components
    8: ("trainer", "plan", "devtools"),            # the RL step and its workers; the planner; test fixtures
    9: ("checks",),                                # everything checked before a process starts
    10: ("run",),                                  # entry points and what a person sees of a run
}
FLOOR = {folder: floor for floor, folders in FLOORS.items() for folder in folders}
# verl's command line with ``verl`` replaced by ``megarl`` (python -m megarl.trainer.main_ppo): an entry point
# that lives where verl's does, so it may import the run floor.
ENTRY_ALIASES = {"trainer/main_ppo.py"}
# Tools that document the whole house: they run the door (checks, prepare, settings) to record which
# module reads each config key, so they may import any floor; no megarl module imports them (tested below).
TOP_TOOLS = {"devtools/key_readers.py", "devtools/docs_pages.py"}
PENDING: set[str] = set()  # files allowed to break the floors for now: none
CLASS_PATH = re.compile(r"""["'](megarl(?:\.\w+)+)(?::\w+)?["']""")


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from megarl import algorithms`
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):  # "megarl.rollout.vllm.replica:X"
            names.update(m for m in CLASS_PATH.findall(repr(node.value)) if is_module(m))
    return {n for n in names if n == "megarl" or n.startswith("megarl.")}


def is_module(name: str) -> bool:
    """A dotted name that is a megarl module or package (not a logger name such as ``megarl.console``)."""
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def folder_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_folder_has_a_floor():
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    assert folders - set(FLOOR) == set() and modules == set(), "give every package a floor; no top-level modules"


def upward_imports() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if len(relative.parts) < 2 or str(relative) in ENTRY_ALIASES | TOP_TOOLS | PENDING:
            continue
        floor = FLOOR[relative.parts[0]]
        bad = sorted(m for m in imported_modules(path)
                     if (folder := folder_of(m)) not in (None, relative.parts[0]) and FLOOR.get(folder, 99) >= floor)
        if bad:
            found[str(relative)] = bad
    return found


def test_every_folder_imports_only_from_floors_below():
    assert upward_imports() == {}


def test_no_module_imports_the_top_tools():
    tools = {"megarl." + name.removesuffix(".py").replace("/", ".") for name in TOP_TOOLS}
    importers = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                       if str(p.relative_to(ROOT)) not in TOP_TOOLS and imported_modules(p) & tools)
    assert importers == []


def test_the_reader_finds_lazy_and_string_imports(tmp_path):
    """An import inside a function, or a class path in a string, is an import all the same."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from megarl.cluster.placement import plan_from_config\n"
                      "ACTOR = 'megarl.rollout.vllm.replica:EngineReplica'\n")
    assert {"megarl.cluster.placement", "megarl.rollout.vllm.replica"} <= imported_modules(source)


# The components (below the door, and the trainer above it) take typed settings, never the config tree.
COMPONENTS = ("algorithms", "models", "data", "engine", "weight_sync", "rollout", "rewards", "agent", "cluster", "trainer")
CONFIG_PARAMETER = re.compile(r"^(cfg|config_tree|\w+_cfg)$")


def config_uses(path: Path) -> list[str]:
    """Imports of omegaconf and parameters named like the raw config (``cfg``, ``*_cfg``) in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found += [f"imports {name}" for name in names if name.split(".")[0] == "omegaconf"]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            found += [f"{node.name}({a.arg})" for a in arguments if CONFIG_PARAMETER.match(a.arg)]
    return found


def test_components_take_settings_not_the_config_tree():
    problems = {str(path.relative_to(ROOT)): uses for folder in COMPONENTS for path in sorted((ROOT / folder).rglob("*.py"))
                if (uses := config_uses(path)) and str(path.relative_to(ROOT)) not in ENTRY_ALIASES}
    assert problems == {}


def test_the_config_use_reader_sees_imports_and_parameters(tmp_path):
    source = tmp_path / "component.py"
    source.write_text("from omegaconf import OmegaConf\ndef build(rollout_cfg, n):\n    pass\ndef f(settings):\n    pass\n")
    assert config_uses(source) == ["imports omegaconf", "build(rollout_cfg)"]
