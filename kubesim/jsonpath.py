"""The small part of kubectl's JSONPath that printer columns use: `.a.b`, `[0]`, `[?(@.k=='v')]`."""

from __future__ import annotations

import re
from typing import Any

_STEP = re.compile(r"\.([A-Za-z0-9_\-]+)|\[(\d+)\]|\[\?\(@\.([A-Za-z0-9_.\-]+)\s*==\s*['\"]([^'\"]*)['\"]\)\]")


def evaluate(expression: str, obj: Any) -> list[Any]:
    nodes = [obj]
    pos = 0
    expr = expression.strip()
    if expr.startswith("{") and expr.endswith("}"):
        expr = expr[1:-1]
    while pos < len(expr):
        m = _STEP.match(expr, pos)
        if not m:
            return []
        pos = m.end()
        field, index, filter_key, filter_value = m.groups()
        out: list[Any] = []
        for node in nodes:
            if field is not None and isinstance(node, dict) and field in node:
                out.append(node[field])
            elif index is not None and isinstance(node, list) and int(index) < len(node):
                out.append(node[int(index)])
            elif filter_key is not None and isinstance(node, list):
                for item in node:
                    value: Any = item
                    for part in filter_key.split("."):
                        value = value.get(part) if isinstance(value, dict) else None
                    if value is not None and str(value) == filter_value:
                        out.append(item)
        nodes = out
    return nodes
