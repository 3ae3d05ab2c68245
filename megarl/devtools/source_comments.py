"""Read what the source says next to a dataclass field or a lambda, for the generated docs pages.

The schema explains its keys in comments (a trailing ``# ...`` on the field's line, and comment
lines right above it), and ``verl_keys`` writes conditions as lambdas. Neither survives import, so
``megarl.devtools.docs_pages`` reads them back from the source here: the pages then say exactly
what the code says, and cannot drift from it.
"""
from __future__ import annotations

import ast
import inspect
import io
import re
import tokenize
from functools import lru_cache
from types import ModuleType
from typing import Any, Callable


@lru_cache(maxsize=None)
def _comments(path: str) -> dict[int, tuple[str, bool]]:
    """Line number -> (comment text without '#', whether the line holds nothing else)."""
    with open(path, encoding="utf-8") as handle:
        source = handle.read()
    lines = source.splitlines()
    found: dict[int, tuple[str, bool]] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            found[row] = (token.string.lstrip("#").strip(), not lines[row - 1][:col].strip())
    return found


@lru_cache(maxsize=None)
def _field_lines(path: str) -> dict[tuple[str, str], int]:
    """(class name, field name) -> the line of the field's annotated assignment."""
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    found[(node.name, item.target.id)] = item.lineno
    return found


def field_comment(cls: type, name: str) -> str:
    """The comment of field ``name`` where it is declared (``cls`` or a base): the comment lines
    right above it, then its trailing comment, joined into one text."""
    for owner in cls.__mro__:
        path = inspect.getsourcefile(owner) if owner.__module__ != "builtins" else None
        if path is None or (owner.__name__, name) not in _field_lines(path):
            continue
        line = _field_lines(path)[(owner.__name__, name)]
        comments = _comments(path)
        above = []
        row = line - 1
        while row in comments and comments[row][1]:
            above.insert(0, comments[row][0])
            row -= 1
        trailing = [comments[line][0]] if line in comments and not comments[line][1] else []
        return " ".join(above + trailing)
    return ""


class _Inline(ast.NodeTransformer):
    """Replace names the lambda closes over or takes from its module by their string values, so
    ``get(f"{MODEL}.path")`` reads ``get('actor_rollout_ref.model.path')``."""

    def __init__(self, values: dict[str, Any]):
        self.values = values

    def visit_JoinedStr(self, node: ast.JoinedStr) -> ast.AST:
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value, ast.FormattedValue) and isinstance(value.value, ast.Name) \
                    and isinstance(self.values.get(value.value.id), str):
                parts.append(self.values[value.value.id])
            else:
                return node
        return ast.Constant("".join(parts))


def lambda_text(function: Callable, module: ModuleType) -> str | None:
    """A lambda's body as source, with ``get('a.b')`` written as the key ``a.b``; None when the
    source does not show one lambda on the line where ``function`` starts."""
    code = function.__code__
    path = inspect.getsourcefile(module)
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    found = [node for node in ast.walk(tree) if isinstance(node, ast.Lambda) and node.lineno == code.co_firstlineno]
    if len(found) != 1:
        return None
    values = dict(vars(module))
    values.update(zip(code.co_freevars, (cell.cell_contents for cell in function.__closure__ or ())))
    body = ast.unparse(_Inline(values).visit(found[0].body))
    return re.sub(r"get\('([^']+)'\)", r"\1", body)
