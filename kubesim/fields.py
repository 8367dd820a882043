"""Managed fields and server-side apply.

A field set is a set of paths; each path is a tuple of fieldsV1 keys: `f:name` for a map key, `k:{...}` for an
item of an associative list, `v:...` for an item of a set list, and `.` for the item itself. Ownership lives in
the object's own `metadata.managedFields`, as on a real API server, so it survives any restart of whoever reads
it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from . import errors
from .objects import ByIdentity, clone
from .resources import ResourceType
from .structure import ATOMIC, SET, list_type

Obj = dict[str, Any]
Path = tuple[str, ...]

# Metadata fields the server owns; they never appear in managedFields.
_SERVER_METADATA = {"name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
                    "deletionTimestamp", "deletionGracePeriodSeconds", "managedFields", "selfLink", "generateName"}


def _item_key(item: Obj, keys: tuple[str, ...]) -> str:
    return "k:" + json.dumps({k: item.get(k) for k in sorted(keys) if k in item}, separators=(",", ":"))


def field_set(rtype: ResourceType, obj: Obj, subresource: str = "") -> set[Path]:
    """The paths `obj` sets, limited to what the endpoint (main resource or `/status`) may change."""
    return set(field_values(rtype, obj, subresource))


def field_values(rtype: ResourceType, obj: Obj, subresource: str = "") -> dict[Path, Any]:
    """`field_set` with the value at each path (what `value_at` would find there), in one walk."""
    out: dict[Path, Any] = {}
    for values in _endpoint(rtype, _grouped_values(rtype, obj), subresource).values():
        out.update(values)
    return out


Grouped = dict[str, dict[Path, Any]]  # field_values by top-level field


def _grouped_values(rtype: ResourceType, obj: Obj, old: Obj | None = None, old_values: Grouped | None = None) \
        -> Grouped:
    """field_values of every top-level field. A field that `obj` shares with `old` (the same object: writes copy
    only what they change) takes its values from `old_values` instead of a walk."""
    out: Grouped = {}
    for key, value in obj.items():
        if key in ("apiVersion", "kind"):
            continue
        if key == "metadata":
            if isinstance(value, dict):
                meta = {k: v for k, v in value.items() if k not in _SERVER_METADATA}
                if meta:
                    _walk(rtype, ("metadata",), ("f:metadata",), meta, out.setdefault(key, {}))
        elif old_values is not None and old is not None and old.get(key) is value and key in old_values:
            out[key] = old_values[key]
        else:
            _walk(rtype, (key,), ("f:" + key,), value, out.setdefault(key, {}))
    return out


def _endpoint(rtype: ResourceType, grouped: Grouped, subresource: str) -> Grouped:
    """The fields the endpoint (main resource or `/status`) may change."""
    return {key: values for key, values in grouped.items() if (key != "metadata" or not subresource)
            and not (rtype.status_subresource and (key == "status") != (subresource == "status"))}


def _walk(rtype: ResourceType, names: tuple[str, ...], path: Path, value: Any, out: dict[Path, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, child in value.items():
            _walk(rtype, (*names, key), (*path, "f:" + key), child, out)
        return
    if isinstance(value, list) and value:
        kind = list_type(rtype, names)
        if kind == ATOMIC:
            out[path] = value
            return
        if kind == SET:
            for item in value:
                out[(*path, "v:" + json.dumps(item, separators=(",", ":")))] = item
            return
        keys = tuple(kind)
        if not all(isinstance(item, dict) for item in value):
            out[path] = value
            return
        for item in value:
            item_path = (*path, _item_key(item, keys))
            out[(*item_path, ".")] = item
            for key, child in item.items():
                _walk(rtype, (*names, key), (*item_path, "f:" + key), child, out)
        return
    out[path] = value


# _grouped_values of stored objects.
_stored_values: ByIdentity[Grouped] = ByIdentity()


def value_at(rtype: ResourceType, obj: Any, path: Path) -> Any:
    """The value at `path`, or a sentinel when absent."""
    node = obj
    for elem in path:
        if elem == ".":
            return node
        if elem.startswith("f:"):
            if not isinstance(node, dict) or elem[2:] not in node:
                return _ABSENT
            node = node[elem[2:]]
        elif elem.startswith("k:"):
            ident = json.loads(elem[2:])
            if not isinstance(node, list):
                return _ABSENT
            node = next((i for i in node if isinstance(i, dict)
                         and all(i.get(k) == v for k, v in ident.items())), _ABSENT)
            if node is _ABSENT:
                return _ABSENT
        elif elem.startswith("v:"):
            value = json.loads(elem[2:])
            return value if isinstance(node, list) and value in node else _ABSENT
    return node


_ABSENT = object()


# ---- fieldsV1 encoding


def encode(paths: set[Path]) -> Obj:
    tree: Obj = {}
    for path in sorted(paths):
        node = tree
        for elem in path:
            node = node.setdefault(elem, {})
    return tree


def decode(tree: Obj, prefix: Path = ()) -> set[Path]:
    out: set[Path] = set()
    for key, child in tree.items():
        path = (*prefix, key)
        if isinstance(child, dict) and child:
            out |= decode(child, path)
        else:
            out.add(path)
    return out


@dataclass
class Entry:
    manager: str
    operation: str  # Apply or Update
    subresource: str
    api_version: str
    time: str
    paths: set[Path]
    # The stored fieldsV1 these paths were read from, reused as is when they come out unchanged.
    fields_v1: Obj | None = None
    read_paths: frozenset[Path] = frozenset()

    @property
    def ident(self) -> tuple[str, str, str]:
        return (self.manager, self.operation, self.subresource)


# Decoded fieldsV1 of stored objects' entries.
_decoded: ByIdentity[frozenset[Path]] = ByIdentity()


def _stored_paths(tree: Obj) -> frozenset[Path]:
    return _decoded.get(tree, lambda: frozenset(decode(tree)))


def read_entries(obj: Obj) -> list[Entry]:
    entries = []
    for mf in obj.get("metadata", {}).get("managedFields") or []:
        tree = mf.get("fieldsV1") or {}
        paths = _stored_paths(tree)
        entries.append(Entry(
            manager=mf.get("manager", ""), operation=mf.get("operation", "Update"),
            subresource=mf.get("subresource", ""), api_version=mf.get("apiVersion", ""),
            time=mf.get("time", ""), paths=set(paths), fields_v1=tree, read_paths=paths,
        ))
    return entries


def write_entries(obj: Obj, entries: list[Entry]) -> None:
    out = []
    for e in entries:
        if not e.paths:
            continue
        if e.fields_v1 is not None and e.paths == e.read_paths:
            tree = e.fields_v1
        else:
            tree = encode(e.paths)
            _decoded.put(tree, frozenset(e.paths))  # what the next write's read_entries would decode
        mf: Obj = {"manager": e.manager, "operation": e.operation, "apiVersion": e.api_version,
                   "time": e.time, "fieldsType": "FieldsV1", "fieldsV1": tree}
        if e.subresource:
            mf["subresource"] = e.subresource
        out.append(mf)
    meta = obj.setdefault("metadata", {})
    if out:
        meta["managedFields"] = out
    else:
        meta.pop("managedFields", None)


def _touch(entries: list[Entry], ident: tuple[str, str, str], api_version: str, now: str) -> Entry:
    for e in entries:
        if e.ident == ident:
            return e
    entry = Entry(ident[0], ident[1], ident[2], api_version, now, set())
    entries.append(entry)
    return entry


def _covers(owned: set[Path], path: Path) -> bool:
    """Whether a path or anything below it is owned."""
    if path in owned:
        return True
    n = len(path)
    return any(len(p) > n and p[:n] == path for p in owned)


# ---- updates (POST, PUT, merge/JSON/strategic patches)


def track_update(rtype: ResourceType, old: Obj | None, new: Obj, manager: str, subresource: str,
                 api_version: str, now: str) -> None:
    """Give `manager` (operation Update) the fields this write changed, taking them from everyone else."""
    entries = read_entries(old) if old is not None else []
    stored = _stored_values.get(old, lambda: _grouped_values(rtype, old)) if old is not None else {}
    written = _grouped_values(rtype, new, old, stored)
    _stored_values.put(new, written)  # `new` is about to be stored: its next write, whatever the endpoint, reads this
    before, after = _endpoint(rtype, stored, subresource), _endpoint(rtype, written, subresource)
    changed: set[Path] = set()
    removed: set[Path] = set()
    for key in before.keys() | after.keys():
        was, now_ = before.get(key, {}), after.get(key, {})
        if was is now_:
            continue  # a field the write did not touch
        changed.update(p for p, v in now_.items() if was.get(p, _ABSENT) != v)
        removed.update(was.keys() - now_.keys())
    if changed or removed:
        for e in entries:
            e.paths -= changed | removed
        mine = _touch(entries, (manager, "Update", subresource), api_version, now)
        if changed:
            mine.paths |= changed
            mine.time, mine.api_version = now, api_version
    write_entries(new, entries)


# ---- server-side apply


def apply(rtype: ResourceType, live: Obj, config: Obj, manager: str, subresource: str, force: bool,
          api_version: str, now: str, live_owned: bool = False) -> Obj:
    """Merge an applied configuration into the live object; 409 Conflict on a field another manager owns.

    `config` is handed over (a request's own body): the merged object takes its parts as they are. `live_owned`:
    the live object is the caller's own too (a create), not the store's, so it is not copied first."""
    entries = read_entries(live)
    ident = (manager, "Apply", subresource)
    wanted = field_set(rtype, config, subresource)
    conflicts: list[tuple[str, str, Path]] = []
    for e in entries:
        if e.ident == ident:
            continue
        for p in wanted & e.paths:
            if p[-1] == "." or value_at(rtype, live, p) == value_at(rtype, config, p):
                continue
            if force:
                e.paths.discard(p)
            else:
                conflicts.append((e.manager, e.api_version, p))
    if conflicts:
        conflicts.sort()
        causes = [{"reason": "FieldManagerConflict", "message": f'conflict with "{m}" using {v}',
                   "field": _dotted(p)} for m, v, p in conflicts]
        if len(conflicts) == 1:
            m, v, p = conflicts[0]
            detail = f'conflict with "{m}" using {v}: {_dotted(p)}'
        else:
            detail = "\n".join(f'conflict with "{m}" using {v}: {_dotted(p)}' for m, v, p in conflicts)
        raise errors.ApiError(
            409, "Conflict",
            f"Apply failed with {len(conflicts)} conflict{'s' if len(conflicts) > 1 else ''}: {detail}",
            details={"causes": causes, "kind": rtype.plural, "name": live["metadata"]["name"],
                     **({"group": rtype.group} if rtype.group else {})})
    # A copy: removal below edits in place, and the live object is shared with every reader of the store.
    merged = _merge(rtype, (), live if live_owned else clone(live), _scope(rtype, config, subresource))
    mine = _touch(entries, ident, api_version, now)
    others: set[Path] = set().union(*(e.paths for e in entries if e.ident != ident))
    for path in sorted(mine.paths - wanted, key=len, reverse=True):
        if path[-1] == ".":
            path = path[:-1]
        if not _covers(others, path) and not _covers(wanted, path):
            _remove(merged, path)
    if mine.paths != wanted:
        mine.paths, mine.time, mine.api_version = set(wanted), now, api_version
    write_entries(merged, entries)
    return merged


def _scope(rtype: ResourceType, config: Obj, subresource: str) -> Obj:
    """The part of an applied configuration the endpoint may change."""
    out = {}
    for key, value in config.items():
        if key in ("apiVersion", "kind"):
            continue
        if key == "metadata":
            if not subresource and isinstance(value, dict):
                out["metadata"] = {k: v for k, v in value.items() if k not in _SERVER_METADATA}
            continue
        if rtype.status_subresource and (key == "status") != (subresource == "status"):
            continue
        out[key] = value
    return out


def _merge(rtype: ResourceType, names: tuple[str, ...], live: Any, config: Any) -> Any:
    if live is config:  # a create's object is made of its applied body: nothing to merge
        return config
    if isinstance(config, dict) and isinstance(live, dict):
        out = dict(live)
        for key, value in config.items():
            if value is None:
                continue
            out[key] = _merge(rtype, (*names, key), live.get(key), value)
        return out
    if isinstance(config, list) and isinstance(live, list):
        kind = list_type(rtype, names)
        if kind == ATOMIC:
            return config
        if kind == SET:
            return list(live) + [v for v in config if v not in live]
        out_list = list(live)
        for item in config:
            if not isinstance(item, dict):
                return config
            index = next((i for i, cur in enumerate(out_list) if isinstance(cur, dict)
                          and all(cur.get(k) == item.get(k) for k in kind)), None)
            if index is None:
                out_list.append(item)
            else:
                out_list[index] = _merge(rtype, names, out_list[index], item)
        return out_list
    return config  # handed over by the caller (`apply`): no copy


def _remove(obj: Obj, path: Path) -> None:
    """Remove the field or list item at `path`, and any map or list it leaves empty."""
    parents: list[tuple[Any, Any]] = []
    node: Any = obj
    for elem in path:
        if elem.startswith("f:"):
            if not isinstance(node, dict) or elem[2:] not in node:
                return
            parents.append((node, elem[2:]))
            node = node[elem[2:]]
        elif elem.startswith("k:") or elem.startswith("v:"):
            if not isinstance(node, list):
                return
            if elem.startswith("k:"):
                ident = json.loads(elem[2:])
                index = next((i for i, it in enumerate(node) if isinstance(it, dict)
                              and all(it.get(k) == v for k, v in ident.items())), None)
            else:
                value = json.loads(elem[2:])
                index = node.index(value) if value in node else None
            if index is None:
                return
            parents.append((node, index))
            node = node[index]
    if not parents:
        return
    container, key = parents.pop()
    del container[key]
    while parents and not container:
        container, key = parents.pop()
        del container[key]


def _dotted(path: Path) -> str:
    out = ""
    for elem in path:
        if elem.startswith("f:"):
            out += "." + elem[2:]
        elif elem.startswith("k:") or elem.startswith("v:"):
            out += "[" + elem[2:] + "]"
    return out
