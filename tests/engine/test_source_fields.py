"""Dataclass field names read from source (what the pre-flight override checks use) equal
``dataclasses.fields`` of the imported classes, and anything unreadable falls back to importing."""

import dataclasses
import subprocess
import sys
import textwrap

import pytest

from megarl.engine.source_fields import field_names

CLASSES = [("megatron.core.transformer.transformer_config", "TransformerConfig"),
           ("megatron.core.transformer.transformer_config", "MLATransformerConfig"),
           ("megatron.core.optimizer.optimizer_config", "OptimizerConfig")]


@pytest.mark.heavy  # starts a process
def test_the_names_read_from_source_import_nothing():
    code = ("import sys; from megarl.engine.source_fields import field_names; "
            f"names = [field_names(m, c) for m, c in {CLASSES!r}]; "
            "assert all(names), names; print(sorted(m for m in sys.modules if m.startswith('megatron')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("module,cls", CLASSES)
def test_megatron_core_fields_equal_the_dataclass_fields(module, cls):
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        imported = getattr(importlib.import_module(module), cls)
    assert field_names(module, cls) == {f.name for f in dataclasses.fields(imported)}


def test_bases_relative_imports_and_classvars(tmp_path, monkeypatch):
    package = tmp_path / "srcfields_pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "base.py").write_text(textwrap.dedent("""
        from dataclasses import dataclass
        @dataclass
        class Base:
            a: int = 1
    """))
    (package / "sub" / "config.py").write_text(textwrap.dedent("""
        from dataclasses import dataclass
        from typing import ClassVar
        from ..base import Base
        import external
        @dataclass
        class Local(Base):
            b: str = "x"
            c: ClassVar[int] = 3
            def method(self): ...
        @dataclass
        class Child(Local):
            d: float = 0.0
        @dataclass
        class Foreign(external.Thing):
            e: int = 0
        @dataclass
        class Unknown(NotImported):
            f: int = 0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = "srcfields_pkg.sub.config"
    assert field_names(module, "Child") == {"a", "b", "d"}
    assert field_names(module, "Local") == {"a", "b"}
    assert field_names(module, "Foreign") is None  # an attribute base: not followed
    assert field_names(module, "Unknown") is None
    assert field_names(module, "Missing") is None
    assert field_names("no_such_package_xyz.mod", "C") is None
    assert "srcfields_pkg" not in sys.modules  # read, never imported


def test_unknown_override_names_still_get_close_matches():
    from megarl.engine.overrides import transformer_override_problems, optimizer_override_problems

    found = transformer_override_problems({"recompute_granularty": "full"}, "actor.megatron.override_transformer_config")
    assert found and "closest: recompute_granularity" in found[0]
    found = optimizer_override_problems({"optimizer_cpu_ofload": True}, "critic", True)
    assert found and "closest: optimizer_cpu_offload" in found[0]
