"""Parquet string columns holding bytes that are not UTF-8: found by row and column, not a bare error.

Arrow stores a ``string`` column's bytes as written and checks them only when they become Python
strings, so a file written by a tool that put Latin-1 (or binary) bytes into a string column
reads fine and fails later with a bare ``UnicodeDecodeError`` that names neither the file nor the
row. ``to_python_rows`` converts a table and, when that fails, finds the first such value: its
row, its place in the row (``prompt[0].content``) and the offending bytes.
"""
from __future__ import annotations

from typing import Any

import pyarrow as pa

_BLOCK = 4096  # rows converted at a time while looking for the bad one


class InvalidUtf8(ValueError):
    """A string value of a parquet file is not valid UTF-8."""


def to_python_rows(table: pa.Table, path: str) -> list[dict[str, Any]]:
    """``table.to_pylist()``; a value that is not UTF-8 raises ``InvalidUtf8`` naming its row and key."""
    try:
        return table.to_pylist()
    except UnicodeDecodeError as exc:
        raise locate(table, path, exc) from None


def to_python_column(column: pa.ChunkedArray | pa.Array, path: str, name: str) -> list[Any]:
    """One column's values (``column.to_pylist()``), with the same error as ``to_python_rows``."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError as exc:
        raise locate(pa.table({name: column}), path, exc) from None


def locate(table: pa.Table, path: str, error: UnicodeDecodeError) -> InvalidUtf8:
    """The error for the first row (in file order) holding a value that is not UTF-8."""
    found = [hit for name in table.column_names if (hit := _first_bad_row(table.column(name), name)) is not None]
    if not found:  # a column type the search does not walk: the file, at least
        return InvalidUtf8(f"{path}: a text value is not valid UTF-8 ({error}); decode the file's text with its "
                           "real encoding and write the parquet again")
    row, key, raw, error = min(found, key=lambda hit: hit[0])
    return InvalidUtf8(
        f"{path}: row {row}: key {key!r}: the text is not valid UTF-8 (byte 0x{raw[error.start]:02x} at byte "
        f"{error.start}: {raw[max(0, error.start - 20):error.start + 20]!r}); the file holds text in another "
        "encoding (e.g. Latin-1) or binary data in a string column: decode it with its real encoding and write "
        "the parquet again, or drop the row")


def _first_bad_row(column: pa.ChunkedArray, name: str) -> tuple[int, str, bytes, UnicodeDecodeError] | None:
    for start in range(0, len(column), _BLOCK):
        block = column.slice(start, _BLOCK)
        try:
            block.to_pylist()
            continue
        except UnicodeDecodeError:
            pass
        for offset in range(len(block)):
            hit = _bad_value(block[offset], name)
            if hit is not None:
                return (start + offset, *hit)
    return None


def _bad_value(scalar: pa.Scalar, key: str) -> tuple[str, bytes, UnicodeDecodeError] | None:
    """The first value under ``scalar`` that is not UTF-8: (its key, its bytes, the decode error)."""
    if not scalar.is_valid:
        return None
    if pa.types.is_dictionary(scalar.type):
        scalar = scalar.value
    kind = scalar.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        raw = scalar.as_buffer().to_pybytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return key, raw, exc
        return None
    if pa.types.is_struct(kind):
        children = [(f"{key}.{field.name}", scalar[field.name]) for field in kind]
    elif pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind) \
            or pa.types.is_map(kind):
        children = [(f"{key}[{i}]", value) for i, value in enumerate(scalar.values)]
    else:
        return None
    for child_key, child in children:
        hit = _bad_value(child, child_key)
        if hit is not None:
            return hit
    return None
