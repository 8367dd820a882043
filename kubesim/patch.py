"""The three patch formats kube-apiserver accepts besides apply: JSON merge, strategic merge and JSON patch."""

from __future__ import annotations

from typing import Any

import jsonpatch
import jsonpointer

from . import errors
from .objects import clone
from .resources import ResourceType
from .structure import ATOMIC, SET, list_type

Obj = dict[str, Any]


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return clone(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(rtype: ResourceType, target: Obj, patch: Obj) -> Obj:
    """Strategic merge patch: a merge patch whose keyed lists merge item by item (with `$patch` directives)."""
    return _smp_map(rtype, (), target, patch)


def _smp_map(rtype: ResourceType, path: tuple[str, ...], target: Any, patch: Obj) -> Any:
    directive = patch.get("$patch")
    if directive == "delete":
        return None
    if directive == "replace":
        return {k: v for k, v in patch.items() if k != "$patch"}
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if key.startswith("$setElementOrder/") or key.startswith("$retainKeys"):
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            merged = _smp_map(rtype, (*path, key), result.get(key), value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list):
            result[key] = _smp_list(rtype, (*path, key), result.get(key), value)
        else:
            result[key] = clone(value)
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            if isinstance(result.get(name), list):
                result[name] = [v for v in result[name] if v not in value]
    return result


def _smp_list(rtype: ResourceType, path: tuple[str, ...], target: Any, patch: list[Any]) -> list[Any]:
    current = list(target) if isinstance(target, list) else []
    kind = list_type(rtype, path)
    if kind == ATOMIC:
        return clone(patch)
    if kind == SET:
        out = list(current)
        for v in patch:
            if v not in out:
                out.append(clone(v))
        return out
    keys = kind
    if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
        return [clone(i) for i in patch if not (isinstance(i, dict) and "$patch" in i)]
    out = list(current)
    for item in patch:
        if not isinstance(item, dict):
            return clone(patch)
        ident = {k: item.get(k) for k in keys if k in item}
        index = next(
            (i for i, cur in enumerate(out) if isinstance(cur, dict) and ident
             and all(cur.get(k) == v for k, v in ident.items())),
            None,
        )
        if item.get("$patch") == "delete":
            if index is not None:
                out.pop(index)
            continue
        if index is None:
            out.append({k: v for k, v in clone(item).items() if k != "$patch"})
        else:
            out[index] = _smp_map(rtype, path, out[index], item)
    return out


def json_patch(rtype: ResourceType, target: Obj, operations: Any) -> Obj:
    """RFC 6902 JSON patch. A failed `test` or a bad path is 422 Invalid, as kube-apiserver answers."""
    if not isinstance(operations, list):
        raise errors.bad_request("json patch must be a list of operations")
    try:
        patched = jsonpatch.JsonPatch(operations).apply(target)
    except jsonpatch.JsonPatchTestFailed as exc:
        raise errors.invalid(rtype.kind, target.get("metadata", {}).get("name", ""),
                             [{"field": "", "message": f"the server rejected our request due to an error in our "
                               f"request: testing value failed: {exc}", "reason": "FieldValueInvalid"}],
                             rtype.group) from exc
    except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException, KeyError, IndexError,
            TypeError) as exc:
        raise errors.unprocessable(f"the server rejected our request due to an error in our request: {exc}",
                                   rtype.kind, target.get("metadata", {}).get("name", "")) from exc
    if not isinstance(patched, dict):
        raise errors.unprocessable("a JSON patch must leave an object", rtype.kind)
    return patched
