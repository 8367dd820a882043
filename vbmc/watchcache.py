"""The agent's view of one object (its VM, its VMI): list, then watch, kept current in memory.

Every read the protocols make comes from here, never from a GET per request. The watch resumes from the last
resourceVersion it saw (bookmarks keep that fresh), re-lists after 410 Gone, and backs off while the API server
is unreachable; `fresh` tells readers whether the cache can be trusted right now.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .kube import KubeClient, KubeError, Unreachable

log = logging.getLogger(__name__)
Obj = dict[str, Any]


class ObjectWatch:
    def __init__(self, client: KubeClient, collection: str, name: str,
                 on_change: Callable[[Obj | None], None] | None = None, server_timeout: int = 240) -> None:
        self.client = client
        self.collection = collection  # e.g. /apis/kubevirt.io/v1/namespaces/ns/virtualmachines
        self.name = name
        self.on_change = on_change
        self.server_timeout = server_timeout
        self._obj: Obj | None = None
        self._rv = ""
        self._synced = False
        self._connected = False
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{name}", daemon=True)

    @property
    def obj(self) -> Obj | None:
        return self._obj

    @property
    def synced(self) -> bool:
        """At least one list succeeded: `obj` reflects the cluster (None means the object does not exist)."""
        return self._synced

    @property
    def fresh(self) -> bool:
        """Listed and watching now (not in a backoff after an error)."""
        return self._synced and self._connected

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def wait(self, predicate: Callable[[Obj | None], bool], timeout: float) -> bool:
        """Wait until `predicate(obj)` holds (checked on every change) or `timeout` passes."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self._obj):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stop.is_set():
                    return False
                self._cond.wait(remaining)
            return True

    def wait_synced(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._synced and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            return self._synced

    def _set(self, obj: Obj | None) -> None:
        with self._cond:
            self._obj = obj
            self._synced = True
            self._cond.notify_all()
        if self.on_change is not None:
            try:
                self.on_change(obj)
            except Exception:
                log.exception("watch %s: change handler failed", self.name)

    def _list(self) -> None:
        listing = self.client.request("GET", self.collection, query={"fieldSelector": f"metadata.name={self.name}"})
        items = listing.get("items") or []
        self._rv = listing.get("metadata", {}).get("resourceVersion", "")
        self._set(items[0] if items else None)

    def _run(self) -> None:
        backoff = 0.2
        need_list = True
        while not self._stop.is_set():
            try:
                if need_list:
                    self._list()
                    need_list = False
                self._connected = True
                self._watch_once()
                backoff = 0.2
            except _Expired:
                need_list = True
            except (Unreachable, KubeError, ValueError) as exc:
                self._connected = False
                log.warning("watch %s/%s: %s; retrying in %.1fs", self.collection, self.name, exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _watch_once(self) -> None:
        query = {"fieldSelector": f"metadata.name={self.name}", "resourceVersion": self._rv,
                 "allowWatchBookmarks": "true", "timeoutSeconds": str(self.server_timeout)}
        for event in self.client.stream(self.collection, query, read_timeout=self.server_timeout + 30):
            if self._stop.is_set():
                return
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise _Expired()
                raise KubeError(int(obj.get("code") or 500), obj.get("reason", ""), obj.get("message", ""), obj)
            rv = (obj.get("metadata") or {}).get("resourceVersion")
            if rv:
                self._rv = rv
            if kind in ("ADDED", "MODIFIED"):
                self._set(obj)
            elif kind == "DELETED":
                self._set(None)


class _Expired(Exception):
    """The watch's resourceVersion is too old: list again."""
