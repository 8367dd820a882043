"""The object store: kube-apiserver's storage semantics over plain dicts.

Every stored object is immutable once committed (a write stores a new dict), so readers need no lock and no
copy. One global counter gives resourceVersions; a bounded history serves watch resumption, and a watch from
before that history gets 410 Expired, as from etcd after compaction.
"""

from __future__ import annotations

import base64
import collections
import json
import random
import re
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from . import errors, fields, schema
from .objects import ByIdentity, clone, now
from .omitempty import omit_empty
from .patch import json_patch, merge_patch, strategic_merge_patch
from .resources import ResourceType
from .selectors import LABEL_KEY, LABEL_VALUE, field_matcher, label_matcher

Obj = dict[str, Any]
Matcher = Callable[[Obj], bool] | None
Admission = Callable[[str, ResourceType, Obj, Obj | None], None]
Warnings = list[str] | None  # where a write reports warnings (unknown fields), if the caller wants them

ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"

APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"


@dataclass
class Event:
    rv: int
    type: str
    rtype: ResourceType
    obj: Obj
    old: Obj | None = None
    _line: bytes | None = field(default=None, repr=False)

    def line(self) -> bytes:
        """The event as one line of a watch stream (serialised once, whatever the number of watchers)."""
        if self._line is None:
            self._line = b'{"type":"' + self.type.encode() + b'","object":' + encoded(self.obj) + b"}\n"
        return self._line


# The JSON of stored objects: a write's response, its watch events and later lists and GETs send the same bytes.
_encoded: ByIdentity[bytes] = ByIdentity()


def encoded(obj: Obj) -> bytes:
    """`obj` (a stored object) as compact JSON."""
    return _encoded.get(obj, lambda: json.dumps(obj, separators=(",", ":")).encode())


def encoded_list_item(rtype: ResourceType, obj: Obj) -> bytes:
    """`obj` as an item of a list of its kind. kube-apiserver converts a built-in kind's list from the internal
    version item by item, and that conversion leaves each item's TypeMeta empty: only the list says apiVersion
    and kind. A custom resource's list is unstructured, its items kept whole."""
    if rtype.crd:
        return encoded(obj)
    return _encoded.get(obj, lambda: json.dumps(list_item(rtype, obj), separators=(",", ":")).encode(),
                        "list-item")


def list_item(rtype: ResourceType, obj: Obj) -> Obj:
    """`obj` as an item of a list of its kind (see encoded_list_item)."""
    if rtype.crd:
        return obj
    return {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}


class Watcher:
    """One watch: the events for one kind that match its namespace and selectors, in order."""

    def __init__(self, store: Store, rtype: ResourceType, namespace: str, labels: Matcher, fields_: Matcher):
        self.store = store
        self.rtype = rtype
        self.namespace = namespace
        self.labels = labels
        self.fields = fields_
        self.progress_rv = 0  # every event of this kind up to here has been offered
        self._queue: collections.deque[Event] = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self.closed = False

    def matches(self, obj: Obj) -> bool:
        if self.namespace and obj.get("metadata", {}).get("namespace") != self.namespace:
            return False
        if self.labels is not None and not self.labels(obj):
            return False
        return self.fields is None or self.fields(obj)

    def offer(self, event: Event) -> None:
        """Called under the store lock, in resourceVersion order."""
        new_match = self.matches(event.obj)
        if event.type == MODIFIED and event.old is not None:
            old_match = self.matches(event.old)
            if old_match and not new_match:
                event = Event(event.rv, DELETED, event.rtype, event.obj)
            elif new_match and not old_match:
                event = Event(event.rv, ADDED, event.rtype, event.obj)
            elif not new_match:
                event = None  # type: ignore[assignment]
        elif not new_match:
            event = None  # type: ignore[assignment]
        with self._cond:
            self.progress_rv = max(self.progress_rv, event.rv if event else self.progress_rv)
            if event is not None:
                self._queue.append(event)
                self._cond.notify()

    def advance(self, rv: int) -> None:
        with self._cond:
            self.progress_rv = max(self.progress_rv, rv)

    def next(self, timeout: float) -> Event | None:
        with self._cond:
            if not self._queue and not self.closed:
                self._cond.wait(timeout)
            return self._queue.popleft() if self._queue else None

    def drain(self, limit: int) -> list[Event]:
        """Up to `limit` events already queued, without waiting."""
        with self._cond:
            return [self._queue.popleft() for _ in range(min(limit, len(self._queue)))]

    def close(self) -> None:
        self.store._drop_watcher(self)
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class Store:
    def __init__(self, history_size: int = 20000) -> None:
        self._lock = threading.RLock()
        self._rv = 1
        self._types: dict[str, ResourceType] = {}
        self._objects: dict[str, dict[str, dict[str, Obj]]] = {}
        self._by_uid: dict[str, tuple[str, str, str]] = {}
        self._history: collections.deque[Event] = collections.deque()
        self._history_size = history_size
        self._compacted = 0
        self._watchers: dict[str, set[Watcher]] = collections.defaultdict(set)
        self._listeners: list[Callable[[Event], None]] = []
        self._admission: list[Admission] = []
        self.writes = 0  # committed writes, for tests and benchmarks

    # ---- kinds

    def add_type(self, rtype: ResourceType) -> None:
        with self._lock:
            self._types[rtype.key] = rtype
            self._objects.setdefault(rtype.key, {})

    def remove_type(self, key: str) -> None:
        with self._lock:
            self._types.pop(key, None)
            for objs in self._objects.pop(key, {}).values():
                for obj in objs.values():
                    self._by_uid.pop(obj["metadata"]["uid"], None)

    def types(self) -> list[ResourceType]:
        return list(self._types.values())

    def type(self, key: str) -> ResourceType:
        return self._types[key]

    def find_type(self, group: str, plural: str) -> ResourceType | None:
        return self._types.get(f"{group}/{plural}")

    def add_listener(self, listener: Callable[[Event], None]) -> None:
        """`listener(event)` runs under the store lock after each commit: it must only enqueue."""
        with self._lock:
            self._listeners.append(listener)

    def add_admission(self, hook: Admission) -> None:
        """`hook(operation, rtype, new, old)` may mutate `new` or raise an ApiError (CREATE or UPDATE)."""
        self._admission.append(hook)

    @property
    def resource_version(self) -> int:
        return self._rv

    # ---- reads

    def get(self, rtype: ResourceType, namespace: str, name: str) -> Obj:
        obj = self._objects.get(rtype.key, {}).get(namespace, {}).get(name)
        if obj is None:
            raise errors.not_found(rtype.plural, name, rtype.group)
        return obj

    def find(self, rtype: ResourceType, namespace: str, name: str) -> Obj | None:
        return self._objects.get(rtype.key, {}).get(namespace, {}).get(name)

    def by_uid(self, uid: str) -> tuple[ResourceType, Obj] | None:
        where = self._by_uid.get(uid)
        if where is None:
            return None
        rtype = self._types.get(where[0])
        obj = self.find(rtype, where[1], where[2]) if rtype else None
        return (rtype, obj) if rtype and obj else None

    def list(self, rtype: ResourceType, namespace: str = "", labels: Matcher = None,
             fields_: Matcher = None, name: str | None = None) -> tuple[list[Obj], int]:
        """Objects matching the selectors, sorted; `name` (from a metadata.name field selector) reads only that
        name's objects instead of the whole kind."""
        with self._lock:
            buckets = self._objects.get(rtype.key, {})
            scopes: Iterable[dict[str, Obj]] = (
                [buckets.get(namespace, {})] if namespace else list(buckets.values()))
            if name is not None:
                items = [o for scope in scopes if (o := scope.get(name)) is not None]
            else:
                items = [o for scope in scopes for o in scope.values()]
            rv = self._rv
        items = [o for o in items if (labels is None or labels(o)) and (fields_ is None or fields_(o))]
        items.sort(key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))
        return items, rv

    def watch(self, rtype: ResourceType, namespace: str = "", label_selector: str | None = None,
              field_selector: str | None = None, resource_version: str | None = None) -> Watcher:
        """A watch from `resource_version` (replaying history), or from now after an ADDED per object."""
        watcher = Watcher(self, rtype, namespace, label_matcher(label_selector),
                          field_matcher(rtype, field_selector))
        with self._lock:
            if resource_version and resource_version != "0":
                since = _parse_rv(resource_version)
                if since < self._compacted:
                    raise errors.gone(f"too old resource version: {since} ({self._compacted})")
                watcher.advance(since)
                for event in self._history:
                    if event.rv > since and event.rtype.key == rtype.key:
                        watcher.offer(event)
            else:
                items, rv = self.list(rtype, namespace, watcher.labels, watcher.fields)
                for obj in items:
                    watcher.offer(Event(int(obj["metadata"]["resourceVersion"]), ADDED, rtype, obj))
                watcher.advance(rv)
            watcher.advance(self._rv)
            self._watchers[rtype.key].add(watcher)
        return watcher

    def _drop_watcher(self, watcher: Watcher) -> None:
        with self._lock:
            self._watchers[watcher.rtype.key].discard(watcher)

    def compact_and_close_watches(self) -> int:
        """As an API server restart after etcd compacted its history: every watch ends, and one resumed from
        the resourceVersion it had reached gets 410 Gone, so its client lists again. The number of watches."""
        with self._lock:
            self._history.clear()
            # One revision on (others' writes move etcd's counter too): whatever a watch had reached is now
            # behind the compaction, while a list's resourceVersion is not.
            self._rv += 1
            self._compacted = self._rv
            watchers = [w for ws in self._watchers.values() for w in ws]
        for watcher in watchers:
            watcher.close()
        return len(watchers)

    def watcher_count(self) -> int:
        return sum(len(ws) for ws in self._watchers.values())

    # ---- writes

    def create(self, rtype: ResourceType, obj: Obj, *, namespace: str = "", manager: str = "",
               dry_run: bool = False, field_validation: str = "", warnings: Warnings = None,
               applied: tuple[str, Obj] | None = None, copy: bool = True) -> Obj:
        new = clone(obj) if copy else obj  # copy=False: the caller hands `obj` over
        meta = new.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise errors.bad_request("metadata must be an object")
        self._check_namespace_field(rtype, meta, namespace)
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(random.choice(_NAME_CHARS) for _ in range(5))
        name = meta.get("name") or ""
        new["apiVersion"], new["kind"] = new.get("apiVersion") or rtype.api_version(), rtype.kind
        with self._lock:
            if rtype.namespaced:
                self._check_namespace_open(namespace)
            if self.find(rtype, namespace, name) is not None:
                raise errors.already_exists(rtype.plural, name, rtype.group)
            for key in ("uid", "resourceVersion", "generation", "creationTimestamp", "deletionTimestamp",
                        "deletionGracePeriodSeconds", "managedFields", "selfLink"):
                meta.pop(key, None)
            if rtype.status_subresource:
                new.pop("status", None)
            if applied is not None:
                # Merged before defaulting and validation, which see the object as it will be stored (merged
                # after, the applied configuration would undo defaults inside the lists it replaces).
                new = fields.apply(rtype, new, applied[1], applied[0], "", False, rtype.api_version(), now(),
                                   live_owned=True)
                new["apiVersion"] = rtype.api_version()
            self._prepare("CREATE", rtype, new, None, field_validation, warnings)
            self._validate_meta(rtype, new)
            meta = new["metadata"]
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now()
            if rtype.has_generation:
                meta["generation"] = 1
            if applied is None and manager:
                fields.track_update(rtype, None, new, manager, "", rtype.api_version(), now())
            if dry_run:
                return new
            return self._commit(rtype, ADDED, new, None)

    def update(self, rtype: ResourceType, obj: Obj, *, namespace: str, name: str, subresource: str = "",
               manager: str = "", dry_run: bool = False, field_validation: str = "",
               warnings: Warnings = None, copy: bool = True) -> Obj:
        """PUT: optimistic concurrency on metadata.resourceVersion when the client sends one.

        `copy=False` hands `obj` over to the store (the caller made it and will not touch it again)."""
        new = clone(obj) if copy else obj
        meta = new.get("metadata")
        if not isinstance(meta, dict):
            raise errors.bad_request("metadata must be an object")
        if meta.get("name") and meta["name"] != name:
            raise errors.bad_request(
                f"the name of the object ({meta['name']}) does not match the name on the URL ({name})")
        self._check_namespace_field(rtype, meta, namespace)
        with self._lock:
            old = self.get(rtype, namespace, name)
            sent_rv = meta.get("resourceVersion")
            if sent_rv and sent_rv != old["metadata"]["resourceVersion"]:
                raise errors.conflict(rtype.plural, name, rtype.group)
            return self._write(rtype, old, new, subresource, manager, dry_run, field_validation, warnings)

    def patch(self, rtype: ResourceType, namespace: str, name: str, patch_type: str, body: Any, *,
              subresource: str = "", manager: str = "", force: bool = False, dry_run: bool = False,
              field_validation: str = "", warnings: Warnings = None) -> tuple[Obj, bool]:
        """A patch of any of the four types; returns (object, created). Apply creates a missing object. An apply's
        body is handed over (the request's own, as the server decodes it): the stored object takes its parts."""
        with self._lock:
            old = self.find(rtype, namespace, name)
            if patch_type == APPLY:
                if not manager:
                    raise errors.unprocessable(
                        "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required "
                        "for apply patch")
                self._check_applied(rtype, body, namespace, name)
                if old is None:
                    if subresource:
                        raise errors.not_found(rtype.plural, name, rtype.group)
                    base = {"apiVersion": body["apiVersion"], "kind": body["kind"],
                            "metadata": {"name": name, **({"namespace": namespace} if namespace else {})}}
                    # The body is the request's own, handed over: the new object takes its parts as they are.
                    for key in ("labels", "annotations", "finalizers", "ownerReferences", "generateName"):
                        if key in body.get("metadata", {}):
                            base["metadata"][key] = body["metadata"][key]
                    for key, value in body.items():
                        if key not in ("apiVersion", "kind", "metadata"):
                            base[key] = value
                    return self.create(rtype, base, namespace=namespace, dry_run=dry_run,
                                       field_validation=field_validation, warnings=warnings,
                                       applied=(manager, body), copy=False), True
                new = fields.apply(rtype, old, body, manager, subresource, force, rtype.api_version(), now())
                return self._write(rtype, old, new, subresource, "", dry_run, field_validation, warnings), False
            if old is None:
                raise errors.not_found(rtype.plural, name, rtype.group)
            if patch_type == MERGE:
                if not isinstance(body, dict):
                    raise errors.bad_request("merge patch must be a JSON object")
                new = merge_patch(old, body)
            elif patch_type == STRATEGIC:
                if rtype.crd:
                    raise errors.unsupported_media_type(patch_type)
                if not isinstance(body, dict):
                    raise errors.bad_request("strategic merge patch must be a JSON object")
                new = strategic_merge_patch(rtype, old, body)
            elif patch_type == JSON_PATCH:
                new = json_patch(rtype, clone(old), body)
            else:
                raise errors.unsupported_media_type(patch_type)
            sent_rv = (new.get("metadata") or {}).get("resourceVersion")
            if sent_rv and sent_rv != old["metadata"]["resourceVersion"]:
                raise errors.conflict(rtype.plural, name, rtype.group)
            return self._write(rtype, old, _writable(rtype, new, subresource), subresource, manager, dry_run,
                               field_validation, warnings), False

    def _check_applied(self, rtype: ResourceType, body: Any, namespace: str, name: str) -> None:
        if not isinstance(body, dict):
            raise errors.bad_request("apply patch must be an object")
        if not body.get("apiVersion") or not body.get("kind"):
            raise errors.bad_request("invalid object type: apply patches need apiVersion and kind")
        if body["kind"] != rtype.kind:
            raise errors.bad_request(f"the kind in the body ({body['kind']}) does not match the URL ({rtype.kind})")
        body_name = (body.get("metadata") or {}).get("name")
        if body_name and body_name != name:
            raise errors.bad_request(
                f"the name of the object ({body_name}) does not match the name on the URL ({name})")

    def delete(self, rtype: ResourceType, namespace: str, name: str, *, propagation: str = "",
               grace_period: int | None = None, preconditions: Obj | None = None,
               dry_run: bool = False) -> tuple[Obj, bool]:
        """DELETE: returns (object, gone now). Finalizers and grace periods leave it marked for deletion."""
        with self._lock:
            old = self.get(rtype, namespace, name)
            meta = old["metadata"]
            pre = preconditions or {}
            if pre.get("uid") and pre["uid"] != meta["uid"]:
                raise errors.conflict(rtype.plural, name, rtype.group,
                                      f"Precondition failed: UID in precondition: {pre['uid']}, UID in object "
                                      f"meta: {meta['uid']}")
            if pre.get("resourceVersion") and pre["resourceVersion"] != meta["resourceVersion"]:
                raise errors.conflict(rtype.plural, name, rtype.group,
                                      f"Precondition failed: ResourceVersion in precondition: "
                                      f"{pre['resourceVersion']}, ResourceVersion in object meta: "
                                      f"{meta['resourceVersion']}")
            finalizers = list(meta.get("finalizers") or [])
            if propagation == "Foreground" and "foregroundDeletion" not in finalizers:
                finalizers.append("foregroundDeletion")
            elif propagation == "Orphan" and "orphan" not in finalizers:
                finalizers.append("orphan")
            grace = rtype.grace_period(old, grace_period) if rtype.grace_period else 0
            if meta.get("deletionTimestamp"):
                spec_pending = rtype.spec_finalizers and (old.get("spec") or {}).get("finalizers")
                if not finalizers and not spec_pending and grace == 0 and not dry_run:
                    return self._commit(rtype, DELETED, old, old), True
                if finalizers == list(meta.get("finalizers") or []) or dry_run:
                    return old, False
            if rtype.spec_finalizers and (old.get("spec") or {}).get("finalizers"):
                finalizers_pending = True
            else:
                finalizers_pending = bool(finalizers)
            if finalizers_pending or grace > 0:
                new = clone(old)
                new["metadata"]["finalizers"] = finalizers
                if not finalizers:
                    new["metadata"].pop("finalizers")
                if not meta.get("deletionTimestamp"):
                    new["metadata"]["deletionTimestamp"] = _in_seconds(grace)
                    new["metadata"]["deletionGracePeriodSeconds"] = grace
                if dry_run:
                    return new, False
                return self._commit(rtype, MODIFIED, new, old), False
            if dry_run:
                return old, True
            return self._commit(rtype, DELETED, old, old), True

    def mutate(self, rtype: ResourceType, namespace: str, name: str, change: Callable[[Obj], bool | None], *,
               subresource: str = "", manager: str = "kubesim", only: str | tuple[str, ...] = "") -> Obj | None:
        """Read, change a copy, write; retried on conflict. `change` returns False to write nothing.

        `only` names the top-level fields `change` edits ("metadata", "spec"; "status" through /status): only
        those are copied, the rest is shared with the stored version, which nobody edits in place."""
        edited = ("status",) if subresource == "status" else (only,) if isinstance(only, str) and only else only
        for _ in range(20):
            cur = self.find(rtype, namespace, name)
            if cur is None:
                return None
            if edited:
                new = {**cur, "metadata": dict(cur["metadata"])}
                new.update((key, clone(cur[key])) for key in edited if key in cur)
            else:
                new = clone(cur)
            if change(new) is False:
                return cur
            try:
                return self.update(rtype, new, namespace=namespace, name=name, subresource=subresource,
                                   manager=manager, copy=False)
            except errors.ApiError as exc:
                if exc.code != 409:
                    raise
        raise errors.internal(f"too many conflicts writing {rtype.plural} {namespace}/{name}")

    # ---- internals

    def _write(self, rtype: ResourceType, old: Obj, new: Obj, subresource: str, manager: str, dry_run: bool,
               field_validation: str, warnings: Warnings) -> Obj:
        new["apiVersion"], new["kind"] = old["apiVersion"], rtype.kind
        # `new` is the store's own copy. What this endpoint may not change is put back as stored, shared with
        # the stored version (which nobody edits in place): later steps see by identity what was not touched.
        if subresource == "status":
            managed = (new.get("metadata") or {}).get("managedFields", old["metadata"].get("managedFields"))
            for key in (set(old) | set(new)) - {"status", "apiVersion", "kind"}:
                if key not in old:
                    new.pop(key)
                elif key == "metadata":
                    if rtype.status_writes_metadata and isinstance(new.get(key), dict):
                        labels = old[key].get("labels")
                        new[key].pop("labels", None)
                        if labels is not None:
                            new[key]["labels"] = labels
                    elif new.get(key) != old[key]:
                        new[key] = clone(old[key])
                else:
                    new[key] = old[key]
            new["metadata"]["managedFields"] = managed
            if managed is None:
                new["metadata"].pop("managedFields")
        elif rtype.status_subresource:
            if "status" not in old:
                new.pop("status", None)
            else:
                new["status"] = old["status"]
        meta = new.setdefault("metadata", {})
        for key in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp",
                    "deletionGracePeriodSeconds", "generation", "generateName"):
            if key in old["metadata"]:
                meta[key] = old["metadata"][key]
            else:
                meta.pop(key, None)
        meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        if old["metadata"].get("deletionTimestamp"):
            gone = set(old["metadata"].get("finalizers") or [])
            added = [f for f in meta.get("finalizers") or [] if f not in gone]
            if added:
                raise errors.forbidden(
                    f"no new finalizers can be added if the object is being deleted, found new finalizers {added}")
        self._prepare("UPDATE", rtype, new, old, field_validation, warnings)
        self._validate_meta(rtype, new)
        if manager:
            fields.track_update(rtype, old, new, manager, subresource, rtype.api_version(), now())
        if rtype.has_generation and _spec_changed(old, new):
            meta["generation"] = int(old["metadata"].get("generation") or 0) + 1
        if not meta.get("managedFields"):
            meta.pop("managedFields", None)
        if new == old:
            return old  # a no-op write stores nothing and keeps the resourceVersion
        if dry_run:
            return new
        if meta.get("deletionTimestamp") and not meta.get("finalizers") and not meta.get(
                "deletionGracePeriodSeconds") and not (rtype.spec_finalizers and (new.get("spec") or {}).get(
                "finalizers")):
            return self._commit(rtype, DELETED, new, old)
        return self._commit(rtype, MODIFIED, new, old)

    def _prepare(self, op: str, rtype: ResourceType, new: Obj, old: Obj | None, field_validation: str,
                 warnings: Warnings) -> None:
        if rtype.schema is not None:
            unknown: list[str] = []
            pruned = schema.prune(rtype.schema, new, "", unknown, root=True, old=old)
            if unknown:
                if field_validation == "Strict":
                    text = ", ".join(f'unknown field "{u}"' for u in unknown)
                    raise errors.bad_request(f"strict decoding error: {text}")
                if warnings is not None and field_validation != "Ignore":
                    warnings.extend(f'unknown field "{u}"' for u in unknown)
                new.clear()
                new.update(pruned)
            schema.apply_defaults(rtype.schema, new, old)
        if rtype.defaulter is not None:
            rtype.defaulter(new)
        for hook in self._admission:
            hook(op, rtype, new, old)
        omit_empty(rtype, new)
        causes: list[dict[str, str]] = []
        if rtype.schema is not None:
            schema.validate_object(rtype.schema, new, old, causes)
            if rtype.rules is not None:
                causes.extend(rtype.rules(new, old, list(causes)))
        if rtype.validator is not None:
            causes.extend(rtype.validator(new, old))
        if causes:
            raise errors.invalid(rtype.kind, new["metadata"].get("name", ""), causes, rtype.group)

    def _validate_meta(self, rtype: ResourceType, obj: Obj) -> None:
        meta = obj["metadata"]
        name = meta.get("name") or ""
        causes = []
        if not name:
            causes.append({"field": "metadata.name", "message": "Required value: name or generateName is required",
                           "reason": "FieldValueRequired"})
        elif rtype.label_names and (len(name) > 63 or not _DNS_LABEL.match(name)):
            causes.append({"field": "metadata.name", "message": f'Invalid value: "{name}": a lowercase RFC 1123 '
                           "label must consist of lower case alphanumeric characters or '-', and must start and "
                           "end with an alphanumeric character"})
        elif rtype.kind == "Service" and not name[0].isalpha():  # ValidateServiceName: a DNS-1035 label
            causes.append({"field": "metadata.name", "message": f'Invalid value: "{name}": a DNS-1035 label must '
                           "consist of lower case alphanumeric characters or '-', start with an alphabetic "
                           "character, and end with an alphanumeric character"})
        elif len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
            causes.append({"field": "metadata.name", "message": f'Invalid value: "{name}": a lowercase RFC 1123 '
                           "subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
                           "start and end with an alphanumeric character"})
        for key, value in (meta.get("labels") or {}).items():
            if not isinstance(value, str) or not LABEL_KEY.match(key) or not LABEL_VALUE.match(value):
                causes.append({"field": "metadata.labels", "message": f'Invalid value: "{value}": a valid label '
                               "must be an empty string or consist of alphanumeric characters, '-', '_' or '.'"})
        for key, value in (meta.get("annotations") or {}).items():
            if not LABEL_KEY.match(key):  # ValidateAnnotations: every key is a qualified name, as a label's
                causes.append({"field": "metadata.annotations", "message": f'Invalid value: "{key}": name part '
                               "must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
                               "with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex "
                               "used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"})
            elif not isinstance(value, str):
                causes.append({"field": f"metadata.annotations.{key}", "message": "Invalid value: must be a "
                               "string", "reason": "FieldValueTypeInvalid"})
        if causes:
            raise errors.invalid(rtype.kind, name, causes, rtype.group)

    def _check_namespace_field(self, rtype: ResourceType, meta: Obj, namespace: str) -> None:
        sent = meta.get("namespace")
        if rtype.namespaced:
            if sent and sent != namespace:
                raise errors.bad_request("the namespace of the provided object does not match the namespace "
                                         "sent on the request")
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)

    def _check_namespace_open(self, namespace: str) -> None:
        ns_type = self._types.get("/namespaces")
        if ns_type is None:
            return
        ns = self.find(ns_type, "", namespace)
        if ns is None:
            raise errors.not_found("namespaces", namespace)
        if ns["metadata"].get("deletionTimestamp"):
            raise errors.forbidden(f"unable to create new content in namespace {namespace} because it is being "
                                   "terminated")

    def _commit(self, rtype: ResourceType, kind: str, obj: Obj, old: Obj | None) -> Obj:
        """Store a new version (or remove it), record the event and tell watchers and listeners."""
        self._rv += 1
        self.writes += 1
        if kind == DELETED:
            obj = clone(obj)
        meta = obj["metadata"]
        meta["resourceVersion"] = str(self._rv)
        ns, name = meta.get("namespace", ""), meta["name"]
        bucket = self._objects[rtype.key]
        if kind == DELETED:
            bucket.get(ns, {}).pop(name, None)
            self._by_uid.pop(meta["uid"], None)
        else:
            bucket.setdefault(ns, {})[name] = obj
            self._by_uid[meta["uid"]] = (rtype.key, ns, name)
        event = Event(self._rv, kind, rtype, obj, old)
        if len(self._history) >= self._history_size:
            self._compacted = self._history.popleft().rv
        self._history.append(event)
        for watcher in list(self._watchers.get(rtype.key, ())):
            watcher.offer(event)
        for listener in self._listeners:
            listener(event)
        return obj


def _writable(rtype: ResourceType, patched: Obj, subresource: str) -> Obj:
    """The store's own copy of a patched object, for `_write`: what this endpoint may change is copied (the patch
    shares what it did not touch with the stored version); the rest `_write` puts back as stored anyway."""
    writable: tuple[str, ...]
    if subresource == "status":
        writable = ("metadata", "status")
    elif rtype.status_subresource:
        writable = tuple(k for k in patched if k != "status")
    else:
        return clone(patched)
    return {k: clone(v) if k in writable else v for k, v in patched.items()}


def _spec_changed(old: Obj, new: Obj) -> bool:
    keys = (set(old) | set(new)) - {"metadata", "status", "apiVersion", "kind"}
    return any(old.get(k) != new.get(k) for k in keys)


def _parse_rv(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise errors.bad_request(f'invalid resource version "{text}"') from None


def _in_seconds(seconds: int) -> str:
    import datetime
    return (datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=seconds)).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


def encode_continue(rv: int, last: tuple[str, str]) -> str:
    return base64.urlsafe_b64encode(json.dumps([rv, *last]).encode()).decode()


def decode_continue(token: str) -> tuple[int, tuple[str, str]]:
    try:
        rv, ns, name = json.loads(base64.urlsafe_b64decode(token.encode()))
        return int(rv), (str(ns), str(name))
    except (ValueError, TypeError) as exc:
        raise errors.bad_request(f"continue key is not valid: {exc}") from None
