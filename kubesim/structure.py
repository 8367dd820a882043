"""How lists in an object merge: associative (keyed), set, or atomic, by kind and path.

Server-side apply, strategic merge patch and managed-field tracking all need to know, for a list at a given
path, whether its items are identified by key fields. Built-in kinds use the Kubernetes types' patch merge
keys; custom resources use `x-kubernetes-list-type` / `x-kubernetes-list-map-keys` from their schema.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from .resources import BUILTIN_LIST_KEYS, CONTAINER_PORT_KEYS, SERVICE_PORT_KEYS, ResourceType

SET = "set"
ATOMIC = "atomic"
# A list type: a tuple of key fields (associative), SET, or ATOMIC.
ListType = tuple[str, ...] | str


def list_type(rtype: ResourceType, path: tuple[str, ...]) -> ListType:
    """The list type of the list at `path` (map keys only, list indices left out)."""
    if path == ("metadata", "finalizers"):
        return SET
    if path == ("metadata", "ownerReferences"):
        return ("uid",)
    if rtype.schema is not None:
        return _schema_list_type(id(rtype.schema), rtype, path)
    name = path[-1] if path else ""
    if name == "ports":
        return CONTAINER_PORT_KEYS if any("ontainers" in p for p in path) else SERVICE_PORT_KEYS
    if name in BUILTIN_LIST_KEYS:
        return BUILTIN_LIST_KEYS[name]
    return ATOMIC


@lru_cache(maxsize=4096)
def _schema_list_type(_schema_id: int, rtype: ResourceType, path: tuple[str, ...]) -> ListType:
    node: Any = rtype.schema
    for name in path:
        node = _child(node, name)
        if node is None:
            return ATOMIC
    if not isinstance(node, dict):
        return ATOMIC
    kind = node.get("x-kubernetes-list-type")
    if kind == "map":
        return tuple(node.get("x-kubernetes-list-map-keys") or ())
    if kind == "set":
        return SET
    return ATOMIC


def _child(node: Any, name: str) -> Any:
    """The schema of field `name` below `node`, stepping through array items."""
    while isinstance(node, dict) and node.get("type") == "array":
        node = node.get("items")
    if not isinstance(node, dict):
        return None
    props = node.get("properties")
    if isinstance(props, dict) and name in props:
        return props[name]
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        return extra
    return None
