"""A cache of one kind kept current by list+watch: bookmarks, resume, re-list on 410 Gone, back-off on errors.

Why not `kubernetes.informer.SharedInformer` (client 37): it lists through a typed `list_*` function and reads
`resp.items` (custom objects come back as dicts, so it sees none), does not ask for bookmarks (so a quiet watch
goes stale and ends in a full re-list), has no "has synced" signal (a controller that reconciles before its caches
are filled writes what already exists), and keeps whole objects (every Secret in the cluster). This one keeps
only what `keep` accepts, after `transform` (managedFields of other managers dropped, VMs slimmed), fetches an
object by name when it becomes interesting (`track`), and reports `synced`.

With `compact`, each object is held pickled and unpickled on every read: about a fifth of the memory of the dicts
(a Role of the controller's is 1 KB pickled, 10 KB as dicts), for about 20 us per read. That suits kinds read a
few times per reconcile (the agent's ServiceAccount, Role, RoleBinding, Service, Secrets; VMs); not one listed
whole on a hot path (Deployments: the fleet's rollout plans over all of them). A read returns a copy of its own.
"""

from __future__ import annotations

import logging
import pickle
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .kubeapi import ApiError, KubeApi

log = logging.getLogger(__name__)
Obj = dict[str, Any]
Key = tuple[str, str]
Handler = Callable[[Obj | None, Obj | None], None]  # (old, new); new None: deleted


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    plural: str

    def path(self, namespace: str = "") -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        return f"{base}/namespaces/{namespace}/{self.plural}" if namespace else f"{base}/{self.plural}"


def typed_items(page: Obj) -> list[Obj]:
    """A list's items with their apiVersion and kind. kube-apiserver leaves both out of the items of a built-in
    kind's list (only the list carries them: the items are converted without their TypeMeta), while watch events,
    GETs and custom resources' lists have them; a cache must not tell the two apart, or everything it compares
    with what the controller applies would differ after every list."""
    api_version, list_kind = page.get("apiVersion"), str(page.get("kind") or "")
    kind = list_kind[:-4] if list_kind.endswith("List") else ""
    items = page.get("items") or []
    for item in items:
        if isinstance(item, dict) and kind:
            item["apiVersion"] = item.get("apiVersion") or api_version
            item["kind"] = item.get("kind") or kind
    return items


def key_of(obj: Obj) -> Key:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


class Informer:
    PAGE = 500  # objects per list page, as client-go's reflector asks

    def __init__(self, api: KubeApi, kind: Kind, *, namespace: str = "", label_selector: str = "",
                 keep: Callable[[Obj], bool] | None = None,
                 transform: Callable[[Obj, Obj | None], Obj] | None = None,
                 watch_timeout: int = 300, compact: bool = False) -> None:
        self.api = api
        self.kind = kind
        self.namespace = namespace
        self.label_selector = label_selector
        self.keep = keep or (lambda _obj: True)
        self.transform = transform or (lambda obj, _cached: obj)  # (the event's object, what the cache holds)
        self.watch_timeout = watch_timeout
        self.handlers: list[Handler] = []
        self.resolved: list[Callable[[str, str], None]] = []  # a `track`ed fetch answered, found or not
        self.compact = compact
        self._items: dict[Key, Any] = {}  # Key -> the object (pickled with `compact`)
        self._lock = threading.RLock()
        self._rv = ""
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._started = False
        self._wanted: set[Key] = set()
        self._wanted_cond = threading.Condition(self._lock)
        self._threads = [threading.Thread(target=self._run, name=f"informer-{kind.plural}", daemon=True),
                         threading.Thread(target=self._fetch_loop, name=f"fetch-{kind.plural}", daemon=True)]

    # ---- reading

    def get(self, namespace: str, name: str) -> Obj | None:
        with self._lock:
            held = self._items.get((namespace, name))
        return self._read(held)

    def list(self) -> list[Obj]:
        with self._lock:
            held = list(self._items.values())
        return [self._read(h) for h in held] if self.compact else held

    def _read(self, held: Any) -> Any:
        return pickle.loads(held) if self.compact and held is not None else held

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def wait_synced(self, timeout: float) -> bool:
        return self._synced.wait(timeout)

    def pending(self, namespace: str, name: str) -> bool:
        """A fetch asked for by `track` has not answered yet: the cache cannot say whether the object exists."""
        with self._lock:
            return (namespace, name) in self._wanted

    def track(self, namespace: str, name: str) -> None:
        """`keep` now accepts this object: fetch it, since the watch dropped it before."""
        with self._lock:
            if (namespace, name) in self._items or not name:
                return
            self._wanted.add((namespace, name))
            self._wanted_cond.notify_all()

    def forget_unkept(self) -> None:
        """Drop cached objects `keep` no longer accepts (a BMC stopped referencing them)."""
        with self._lock:
            gone = [(k, o) for k, o in ((k, self._read(h)) for k, h in self._items.items()) if not self.keep(o)]
            for k, _ in gone:
                del self._items[k]
        for _, obj in gone:
            self._fire(obj, None)

    def seen_through(self, resource_version: int) -> bool:
        """Whether the cache reflects every change up to `resource_version`: the watch has delivered it, so what
        the cache holds for an object it selects (or that it holds nothing) is at least that recent.
        resourceVersions are compared as integers, as kube-apiserver's (etcd revisions) are."""
        text = self._rv
        return text.isdigit() and int(text) >= resource_version

    # ---- lifecycle

    def start(self) -> None:
        """Start listing and watching; again is a no-op (Caches.start is called again while a sync waits)."""
        if self._started:
            return
        self._started = True
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._wanted_cond.notify_all()

    # ---- internals

    def _fire(self, old: Obj | None, new: Obj | None) -> None:
        for handler in self.handlers:
            try:
                handler(old, new)
            except Exception:
                log.exception("informer %s: handler failed", self.kind.plural)

    def _store(self, obj: Obj, deleted: bool = False) -> None:
        key = key_of(obj)
        kept = not deleted and self.keep(obj)
        with self._lock:
            old = self._read(self._items.get(key))
            new = self.transform(obj, old) if kept else None
            if new is not None:
                self._items[key] = pickle.dumps(new, pickle.HIGHEST_PROTOCOL) if self.compact else new
            elif old is not None:
                del self._items[key]
            self._wanted.discard(key)
        if old is not None or new is not None:
            self._fire(old, new)

    def _query(self) -> dict[str, str]:
        return {"labelSelector": self.label_selector} if self.label_selector else {}

    def _list(self) -> None:
        """List in pages, each stored (slimmed by `transform`, in place of the cached copy) before the next is
        asked for: at 10,000 VirtualMachineBMCs a whole list of Secrets as the server sends them (managedFields
        and all) held next to the cache was most of a re-list's memory. Only the keys seen are kept until the
        end, to drop what the list no longer has. A re-list that fails midway leaves a cache as current as its
        pages, which the next list completes.

        Every page of one list is read at the first page's resourceVersion (the continue token carries it), so the
        pages together are one consistent snapshot, as a single list would be."""
        query = {**self._query(), "limit": str(self.PAGE)}
        seen: set[Key] = set()
        while True:
            page = self.api.request("GET", self.kind.path(self.namespace), query=query, timeout=60)
            meta = page.get("metadata") or {}
            for obj in typed_items(page):
                seen.add(key_of(obj))
                self._store(obj)
            del page  # this page's objects as sent: the next page replaces them, not joins them
            if not meta.get("continue"):
                break
            query["continue"] = meta["continue"]
        with self._lock:
            stale = [self._read(h) for k, h in self._items.items() if k not in seen]
        for obj in stale:
            self._store(obj, deleted=True)
        self._rv = str(meta.get("resourceVersion") or "")  # after the cache has what the list said
        self._synced.set()

    def _run(self) -> None:
        backoff = 0.2
        need_list = True
        while not self._stop.is_set():
            try:
                if need_list:
                    self._list()
                    need_list = False
                self._watch_once()
                backoff = 0.2
            except _Expired:
                log.info("informer %s: resourceVersion %s is too old (410 Gone); listing again", self.kind.plural,
                         self._rv)
                need_list = True
            except (ApiError, ValueError) as exc:
                log.warning("informer %s: %s; retrying in %.1fs", self.kind.plural, exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    def _watch_once(self) -> None:
        # Watches end at a jittered timeout, as client-go's reflector does, so many controllers do not reconnect
        # in step.
        timeout = int(self.watch_timeout * (1 + random.random()))
        query = {**self._query(), "resourceVersion": self._rv, "allowWatchBookmarks": "true",
                 "timeoutSeconds": str(timeout)}
        for event in self.api.stream(self.kind.path(self.namespace), query, read_timeout=timeout + 30):
            if self._stop.is_set():
                return
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise _Expired()
                raise ApiError(int(obj.get("code") or 500), str(obj.get("reason", "")), str(obj.get("message", "")))
            if kind in ("ADDED", "MODIFIED"):
                self._store(obj)
            elif kind == "DELETED":
                self._store(obj, deleted=True)
            rv = (obj.get("metadata") or {}).get("resourceVersion")
            if rv:
                self._rv = str(rv)  # after the cache has the event: see seen_through

    def _fetch_loop(self) -> None:
        # The first list answers for every name tracked before it (`keep` accepts them by then): only what it did
        # not store is fetched. At a start over 10,000 BMCs, that is 20,000 GETs of VMs and Secrets not made.
        while not self._stop.is_set() and not self._synced.wait(0.5):
            pass
        while not self._stop.is_set():
            with self._lock:
                while not self._wanted and not self._stop.is_set():
                    self._wanted_cond.wait(1.0)
                wanted = list(self._wanted)
            for namespace, name in wanted:
                with self._lock:
                    if (namespace, name) not in self._wanted:
                        continue  # stored since by the watch (or a re-list): its handlers have told everyone
                try:
                    page = self.api.request("GET", self.kind.path(namespace),
                                            query={"fieldSelector": f"metadata.name={name}"})
                except ApiError as exc:
                    log.warning("informer %s: fetching %s/%s: %s", self.kind.plural, namespace, name, exc)
                    self._stop.wait(0.5)
                    continue
                items = typed_items(page)
                with self._lock:
                    cached = (namespace, name) in self._items
                    self._wanted.discard((namespace, name))
                if items and not cached:
                    self._store(items[0])
                for callback in self.resolved:
                    try:
                        callback(namespace, name)
                    except Exception:
                        log.exception("informer %s: resolved callback failed", self.kind.plural)


class _Expired(Exception):
    """The watch's resourceVersion is too old: list again."""
