"""Every rollout backend's replica actor has the methods the fleet calls, with the same parameters.

The seam's list (``megarl.rollout.backend.REPLICA_METHODS``, plus ``POOLING_METHODS`` for reward
models) is checked both ways: against what megarl calls on replica actors (read from the source:
``replica.<method>.remote(...)`` in the fleet and its client, ``fleet.call_async("<method>", ...)``
anywhere), and against each registered backend's replica class. A method the fleet starts to call,
or a backend that misses one, fails here instead of as an ``AttributeError`` inside a Ray actor.
No process starts here.
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import megarl
from megarl.rollout.backend import POOLING_METHODS, REPLICA_METHODS, backend_names, rollout_backend

PACKAGE = Path(megarl.__file__).parent
# where `x.<method>.remote(...)` is a replica's
REPLICA_HANDLE_FILES = ("rollout/fleet.py", "rollout/client.py", "rollout/replica_table.py", "rollout/replica_places.py")
# `<caller>("<method>", ...)`: a replica's method by name (the fleet's spread over replicas, a client's failover call)
BY_NAME = {"spread": None, "_call": "rollout/client.py"}


def called_on_replicas() -> dict[str, set[str]]:
    """Method name -> the files (relative to megarl/) that call it on replica actors."""
    calls: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            func = node.func
            if (relative in REPLICA_HANDLE_FILES and func.attr == "remote"
                    and isinstance(func.value, ast.Attribute)):
                calls.setdefault(func.value.attr, set()).add(relative)
            elif (func.attr == "call_async" and node.args and isinstance(node.args[0], ast.Constant)
                  and ("fleet" in ast.unparse(func.value) or (relative == "rollout/fleet.py"
                                                              and ast.unparse(func.value) == "self"))):
                calls.setdefault(node.args[0].value, set()).add(relative)
            elif (func.attr in BY_NAME and BY_NAME[func.attr] in (None, relative) and node.args
                  and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                calls.setdefault(node.args[0].value, set()).add(relative)
    return calls


def public_methods(cls: type) -> dict[str, object]:
    return {name: member for name, member in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


def test_the_seams_list_is_what_megarl_calls_on_replicas():
    calls = called_on_replicas()
    assert {"generate_group", "generate_tokens", "sync_receive", "classify"} <= set(calls)  # the scan sees them
    listed = set(REPLICA_METHODS) | set(POOLING_METHODS)
    assert not set(calls) - listed, {m: calls[m] for m in set(calls) - listed}  # called, not in the seam's list
    assert not listed - set(calls), listed - set(calls)  # listed, called by nobody


@pytest.mark.parametrize("name", backend_names())
def test_every_backends_replica_has_the_seams_methods_and_no_others(name):
    backend = rollout_backend(name)
    expected = set(REPLICA_METHODS) | (set(POOLING_METHODS) if backend.traits()["pooling"] else set())
    methods = public_methods(backend.actor_class())
    assert set(methods) == expected, (f"{backend.replica_class}: missing {sorted(expected - set(methods))}, "
                                      f"not in the seam {sorted(set(methods) - expected)}")
    assert all(inspect.iscoroutinefunction(m) for m in methods.values())  # the actor is async


def test_the_replicas_methods_take_the_same_parameters():
    classes = {name: rollout_backend(name).actor_class() for name in backend_names()}
    assert {"vllm", "hf"} <= set(classes)
    for method in REPLICA_METHODS:
        parameters = {name: list(inspect.signature(getattr(cls, method)).parameters) for name, cls in classes.items()}
        assert len({tuple(p) for p in parameters.values()}) == 1, (method, parameters)
