"""Empty maps that kube-apiserver does not keep.

A built-in object goes through Go types on its way to storage and back: every map field of those types is tagged
`omitempty`, so `labels: {}` or a ConfigMap's `data: {}` comes back absent (as does `finalizers: []`, an
`omitempty` slice). Empty structs are kept (`resources: {}`, `emptyDir: {}` are structs or pointers to one), so
the rule is per field, not "drop every empty object". A custom resource's body is stored as its structural
schema allows, given maps and all; only its metadata is ObjectMeta and loses them.
"""

from __future__ import annotations

from typing import Any

from .resources import ResourceType

Obj = dict[str, Any]
# A path of field names; "*" steps into every item of a list.
Path = tuple[str, ...]

# ObjectMeta's omitempty maps and slices.
_OBJECT_META: tuple[Path, ...] = (("labels",), ("annotations",), ("finalizers",), ("ownerReferences",))
_RESOURCES: tuple[Path, ...] = (("resources", "limits"), ("resources", "requests"))
_CONTAINER: tuple[Path, ...] = _RESOURCES
_POD_SPEC: tuple[Path, ...] = (
    ("nodeSelector",), ("overhead",), *_RESOURCES,
    *((kind, "*", *p) for kind in ("containers", "initContainers", "ephemeralContainers") for p in _CONTAINER),
    ("volumes", "*", "csi", "volumeAttributes"), ("volumes", "*", "flexVolume", "options"),
)
_POD_TEMPLATE: tuple[Path, ...] = (*(("metadata", *p) for p in _OBJECT_META), *(("spec", *p) for p in _POD_SPEC))
_SELECTOR: tuple[Path, ...] = (("selector", "matchLabels"),)

# Beyond metadata, by kind key (group/plural).
_BY_KIND: dict[str, tuple[Path, ...]] = {
    "/configmaps": (("data",), ("binaryData",)),
    "/secrets": (("data",), ("stringData",)),
    "/services": (("spec", "selector"),),
    "/pods": tuple(("spec", *p) for p in _POD_SPEC),
    "/nodes": (("status", "capacity"), ("status", "allocatable")),
    "apps/deployments": tuple(("spec", *p) for p in (*_SELECTOR, *(("template", *t) for t in _POD_TEMPLATE))),
    "apps/replicasets": tuple(("spec", *p) for p in (*_SELECTOR, *(("template", *t) for t in _POD_TEMPLATE))),
}


def omitted_paths(rtype: ResourceType) -> tuple[Path, ...]:
    """The fields of `rtype` that are not kept when empty."""
    meta = tuple(("metadata", *p) for p in _OBJECT_META)
    if rtype.crd:
        return meta
    return (*meta, *_BY_KIND.get(rtype.key, ()))


def omit_empty(rtype: ResourceType, obj: Obj) -> None:
    """Remove from `obj` (the store's own copy, about to be stored) the empty maps and slices kube-apiserver
    would not keep. A parent that this empties stays: it is a struct, which Go serialises even when empty."""
    for path in omitted_paths(rtype):
        _drop(obj, path)


def _drop(node: Any, path: Path) -> None:
    if not path:
        return
    head, rest = path[0], path[1:]
    if head == "*":
        if isinstance(node, list):
            for item in node:
                _drop(item, rest)
        return
    if not isinstance(node, dict) or head not in node:
        return
    if rest:
        _drop(node[head], rest)
    elif node[head] in ({}, [], None):
        del node[head]
