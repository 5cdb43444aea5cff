"""JSON-schema numbers llguidance cannot hold: it reads a schema's numbers as 64-bit floats, so an integer
bound, ``const`` or ``enum`` value past 2^53 loses its value, and output generated under it breaks the schema
the client sent (a 200 with invalid output). Such schemas are refused (common/wire/guided.py)."""

from __future__ import annotations

from typing import Any

EXACT = 2**53  # llguidance reads a schema's numbers as 64-bit floats: integers past this lose their value
NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "const", "enum")


def inexact_integer(schema: Any) -> int | None:
    """An integer of a schema's numeric keywords (bounds, ``const``, ``enum``, at any depth) that a float
    cannot hold exactly, or None. Walked without recursion (schemas may nest deeply)."""
    todo: list[Any] = [schema]
    values: list[Any] = []
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                (values if key in NUMERIC else todo).append(value)
        elif isinstance(node, list):
            todo.extend(node)
    while values:  # everything inside a numeric keyword's value: const and enum may hold objects and lists
        value = values.pop()
        if isinstance(value, dict):
            values.extend(value.values())
        elif isinstance(value, list):
            values.extend(value)
        elif type(value) is int and abs(value) > EXACT:
            return value
    return None
