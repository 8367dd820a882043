"""The garbage collector and the namespace controller of kube-controller-manager.

Dependents whose owners are all gone are deleted (background); a dependent that keeps a live owner loses the
references to the gone ones, removed by uid while anyone else may be writing the object (as kube-controller-manager
does, so a controller that rewrites owner references from a stale cache races it here too); an owner deleted in
the foreground waits, with its `foregroundDeletion` finalizer, until its dependents are gone; an `orphan`
finalizer strips the owner reference from dependents first. A namespace being deleted empties itself, then disappears.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Hashable, Iterable
from typing import Any

from . import errors
from .loop import ControlLoop
from .objects import drop_finalizer
from .store import DELETED, Event, Store

Obj = dict[str, Any]


class GarbageCollector(ControlLoop):
    name = "garbage-collector"
    OWNER_LOOKUP = 0.05  # seconds per owner looked up: kube-controller-manager's client allows 20 requests/s

    def __init__(self, store: Store) -> None:
        super().__init__(store, workers=2)
        # owner uid -> dependents (type key, namespace, name); rebuilt from events, never from a scan per sync.
        self._dependents: dict[str, set[tuple[str, str, str]]] = {}

    def _hear(self, event: Event) -> None:
        meta = event.obj["metadata"]
        me = (event.rtype.key, meta.get("namespace", ""), meta["name"])
        old_refs = {r.get("uid") for r in ((event.old or {}).get("metadata", {}).get("ownerReferences") or [])}
        refs = {r.get("uid") for r in meta.get("ownerReferences") or []} if event.type != DELETED else set()
        for uid in old_refs - refs:
            self._dependents.get(uid, set()).discard(me)
        for uid in refs:
            self._dependents.setdefault(uid, set()).add(me)
        # A new owner that does not exist (the real graph's "virtual" node) gets the dependent looked at; one that
        # exists is looked at only when it goes (graph_builder.go: attemptToDelete is for owners it has not seen).
        if any(self.store.by_uid(uid) is None for uid in refs - old_refs):
            self.enqueue(("dependent", *me))
        if event.type == DELETED or meta.get("deletionTimestamp"):
            self.enqueue(("owner", meta["uid"], *me))

    def keys_for(self, event: Event) -> Iterable[Hashable]:
        return []

    def sync(self, key: Hashable) -> float | None:
        assert isinstance(key, tuple)
        if key[0] == "dependent":
            return self._sync_dependent(key[1], key[2], key[3])
        return self._sync_owner(key[1], key[2], key[3], key[4])

    def _sync_dependent(self, type_key: str, namespace: str, name: str) -> float | None:
        """attemptToDeleteItem (pkg/controller/garbagecollector/garbagecollector.go): its owners are solid (alive),
        dangling (gone, or another object under that name) or waiting (deleted in the foreground). With a solid
        owner left, the dangling and waiting references are removed by uid (GenerateDeleteOwnerRefStrategicMergeBytes:
        whatever else changed in the object meanwhile stays); with none, the object is deleted."""
        store = self.store
        try:
            rtype = store.type(type_key)
        except KeyError:
            return None
        obj = store.find(rtype, namespace, name)
        if obj is None or obj["metadata"].get("deletionTimestamp"):
            return None
        refs = obj["metadata"].get("ownerReferences") or []
        if not refs:
            return None
        solid, gone = [], []
        waiting = False
        for ref in refs:
            # One GET per owner, through kube-controller-manager's rate-limited client (--kube-api-qps 20): the
            # verdict on the first owner can be older than the one on the last, and a writer's change comes in
            # between (issue 21: 8 owners took the real collector 1.5 s).
            time.sleep(self.OWNER_LOOKUP)
            found = store.by_uid(ref.get("uid", ""))
            owner = found[1] if found is not None else None
            if owner is None or owner["metadata"].get("namespace", "") not in ("", namespace) \
                    or owner["metadata"].get("name") != ref.get("name"):
                gone.append(ref.get("uid", ""))
            elif owner["metadata"].get("deletionTimestamp") \
                    and "foregroundDeletion" in (owner["metadata"].get("finalizers") or []):
                waiting = True
                gone.append(ref.get("uid", ""))
            else:
                solid.append(ref)
        if solid:
            if gone:
                self._strip_owners((type_key, namespace, name), obj["metadata"]["uid"], set(gone))
            return None
        # No owner left. One deleted in the foreground waits for us: then we go in the foreground too (the real
        # collector does so when we have dependents of our own; for one without, Foreground and Background end
        # the same). Only the object as it was looked at (operations.go deleteObject: uid and resourceVersion
        # preconditions; after a conflict, again without the resourceVersion when its owner references did not
        # change, else looked at again).
        preconditions = {"uid": obj["metadata"]["uid"], "resourceVersion": obj["metadata"]["resourceVersion"]}
        try:
            self.store.delete(rtype, namespace, name, propagation="Foreground" if waiting else "Background",
                              preconditions=preconditions)
        except errors.ApiError as exc:
            if exc.code == 409:
                live = store.find(rtype, namespace, name)
                if live is not None and live["metadata"].get("uid") == obj["metadata"]["uid"]:
                    if (live["metadata"].get("ownerReferences") or []) == refs:
                        self._delete(rtype, namespace, name, "Foreground" if waiting else "Background")
                    else:
                        self.enqueue(("dependent", type_key, namespace, name))
            elif exc.code != 404:
                raise
        return None

    def _sync_owner(self, uid: str, type_key: str, namespace: str, name: str) -> float | None:
        store = self.store
        dependents = sorted(self._dependents.get(uid, set()))
        try:
            rtype = store.type(type_key)
        except KeyError:
            rtype = None
        owner = store.find(rtype, namespace, name) if rtype else None
        if owner is not None and owner["metadata"]["uid"] != uid:
            owner = None
        finalizers = (owner or {}).get("metadata", {}).get("finalizers") or []
        if owner is not None and "orphan" in finalizers:
            for dep in dependents:
                found = self.store.find(self.store.type(dep[0]), dep[1], dep[2]) if self._exists(dep) else None
                if found is not None:
                    self._strip_owners(dep, found["metadata"]["uid"], {uid})
            self._remove_finalizer(rtype, namespace, name, "orphan")
            return None
        if owner is not None and "foregroundDeletion" in finalizers:
            remaining = [d for d in dependents if self._exists(d)]
            for dep in remaining:
                self.enqueue(("dependent", *dep))
            if remaining:
                return 0.2
            self._remove_finalizer(rtype, namespace, name, "foregroundDeletion")
            return None
        if owner is None:
            for dep in dependents:
                self.enqueue(("dependent", *dep))
            self._dependents.pop(uid, None)
        return None

    def _exists(self, dep: tuple[str, str, str]) -> bool:
        try:
            return self.store.find(self.store.type(dep[0]), dep[1], dep[2]) is not None
        except KeyError:
            return False

    def _delete(self, rtype: Any, namespace: str, name: str, propagation: str) -> None:
        try:
            self.store.delete(rtype, namespace, name, propagation=propagation)
        except errors.ApiError as exc:
            if exc.code != 404:
                raise

    def _strip_owners(self, dep: tuple[str, str, str], dependent_uid: str, uids: set[str]) -> None:
        """Remove the owner references with these uids from the dependent with that uid, as the collector's patch
        does: the other references, and anything else changed since it looked, stay."""
        def strip(obj: Obj) -> bool:
            if obj["metadata"].get("uid") != dependent_uid:
                return False
            refs = obj["metadata"].get("ownerReferences") or []
            kept = [r for r in refs if r.get("uid") not in uids]
            if len(kept) == len(refs):
                return False
            if kept:
                obj["metadata"]["ownerReferences"] = kept
            else:
                obj["metadata"].pop("ownerReferences", None)
            return True

        with contextlib.suppress(KeyError, errors.ApiError):
            self.store.mutate(self.store.type(dep[0]), dep[1], dep[2], strip, manager="garbage-collector")

    def _remove_finalizer(self, rtype: Any, namespace: str, name: str, finalizer: str) -> None:
        self.store.mutate(rtype, namespace, name, functools.partial(drop_finalizer, finalizer=finalizer),
                          manager="garbage-collector")


class NamespaceController(ControlLoop):
    name = "namespace-controller"
    kinds = ("/namespaces",)

    def keys_for(self, event: Event) -> Iterable[Hashable]:
        if event.type != DELETED and event.obj["metadata"].get("deletionTimestamp"):
            return [event.obj["metadata"]["name"]]
        return []

    def sync(self, key: Hashable) -> float | None:
        store = self.store
        ns_type = store.type("/namespaces")
        ns = store.find(ns_type, "", str(key))
        if ns is None or not ns["metadata"].get("deletionTimestamp"):
            return None
        if ns.get("status", {}).get("phase") != "Terminating":
            store.mutate(ns_type, "", str(key), lambda o: o.setdefault("status", {}).update(phase="Terminating"),
                         subresource="status", manager="namespace-controller")
        remaining = 0
        for rtype in store.types():
            if not rtype.namespaced:
                continue
            items, _ = store.list(rtype, str(key))
            for item in items:
                remaining += 1
                if not item["metadata"].get("deletionTimestamp"):
                    try:
                        store.delete(rtype, str(key), item["metadata"]["name"])
                    except errors.ApiError as exc:
                        if exc.code != 404:
                            raise
        if remaining:
            return 0.2

        def finalize(obj: Obj) -> None:
            obj.setdefault("spec", {})["finalizers"] = []

        # Emptying spec.finalizers (the `finalize` subresource) lets the deletion complete.
        store.mutate(ns_type, "", str(key), finalize, manager="namespace-controller")
        return None
