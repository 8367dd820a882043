"""The agent's view of one object (its VM, its VMI): list, then watch, kept current in memory.

Every read the protocols make comes from here, never from a GET per request. The watch resumes from the last
resourceVersion it saw (bookmarks keep that fresh), re-lists after 410 Gone, and backs off while the API server
is unreachable.

A cache is only as good as the last time the API server spoke to it. A watch that is silent may be idle (nothing
changed) or dead (the API server is frozen, a connection was dropped without a reset): the two look the same,
and bookmarks, which a kube-apiserver sends about once a minute, come too rarely to tell them apart in time. So
each watch remembers when it last *heard* from the API server (a list, an event, a bookmark) and, after
PROBE_AFTER seconds of silence, asks itself: a LIST with `fieldSelector=metadata.name=<name>` and
`resourceVersion=0`, which the API server answers from its watch cache (no etcd read; the agent's Role already
allows it, the watch needs `list`), with a PROBE_TIMEOUT timeout. An answer alone would only prove the API server
is up, not that this watch stream still delivers; so the probe counts as hearing only when the cache shows what
the server showed (the same object resourceVersion, or absent on both sides), or when the watch delivers
something within CATCH_UP seconds (an event in flight). Otherwise the watch has fallen behind: it is restarted
(its stream shut down, a fresh list and watch). `fresh` is False once nothing was heard for STALE_AFTER seconds:
readers then refuse to answer from the cache (IPMI 0xC0, Redfish 503) rather than report a state that may be
minutes old. Checking it costs a clock read and a subtraction, no lock.

Cost: while a VM is idle, each watch (the agent has two or three) makes one such LIST every PROBE_AFTER seconds.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from .client import KubeClient, KubeError, Unreachable

log = logging.getLogger(__name__)
Obj = dict[str, Any]

PROBE_AFTER = 4.0  # seconds of watch silence before the agent asks the API server itself
PROBE_TIMEOUT = 2.0  # a probe not answered by then has failed; no read ever waits for a probe
PROBE_RETRY = 0.5  # after a failed probe: so that service resumes within a second of the API server answering
CATCH_UP = 1.0  # how long the watch may take to deliver what a probe saw before it counts as fallen behind
STALE_AFTER = 10.0  # seconds without word from the API server after which the cache is not served


def same_state(cached: Obj | None, listed: Obj | None) -> bool:
    """The cache shows the object the API server listed: both absent, or the same resourceVersion (opaque: only
    equality means anything, never order)."""
    if cached is None or listed is None:
        return cached is None and listed is None
    return _rv(cached) == _rv(listed) != ""


def _rv(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


class ObjectWatch:
    def __init__(self, client: KubeClient, collection: str, name: str,
                 on_change: Callable[[Obj | None], None] | None = None, server_timeout: int = 240, *,
                 probe_after: float = PROBE_AFTER, stale_after: float = STALE_AFTER) -> None:
        self.client = client
        self.collection = collection  # e.g. /apis/kubevirt.io/v1/namespaces/ns/virtualmachines
        self.name = name
        self.on_change = on_change
        self.server_timeout = server_timeout
        self.probe_after = probe_after
        self.stale_after = stale_after
        self._obj: Obj | None = None
        self._rv = ""
        self._synced = False
        self._connected = False
        self._heard = -math.inf  # time.monotonic() of the last word from the API server that the cache matched
        self._response: Any = None  # the open watch response, for a restart from the prober
        self._restart = False
        self._probe_failing = False
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._wake = threading.Event()  # ends a backoff early: a probe found the API server answering again
        self._thread = threading.Thread(target=self._run, name=f"watch-{name}", daemon=True)
        self._prober = threading.Thread(target=self._probe_loop, name=f"probe-{name}", daemon=True)

    @property
    def obj(self) -> Obj | None:
        return self._obj

    @property
    def synced(self) -> bool:
        """At least one list succeeded: `obj` reflects the cluster (None means the object does not exist)."""
        return self._synced

    @property
    def fresh(self) -> bool:
        """Listed, watching (not in a backoff after an error), and heard from the API server in the last
        `stale_after` seconds."""
        return self._synced and self._connected and time.monotonic() - self._heard < self.stale_after

    def staleness(self) -> str:
        """Why the cache is not fresh, for an error message; empty when it is."""
        kind = self.collection.rsplit("/", 1)[-1]
        if not self._synced:
            return f"the agent has not listed {kind}/{self.name} from the Kubernetes API server yet"
        if not self._connected:
            return f"the agent lost its watch on {kind}/{self.name}: the Kubernetes API server is unreachable"
        silence = time.monotonic() - self._heard
        if silence >= self.stale_after:
            return (f"the agent has not heard from the Kubernetes API server about {kind}/{self.name} for "
                    f"{silence:.0f} s: its cached state may be out of date")
        return ""

    def start(self) -> None:
        self._thread.start()
        self._prober.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        with self._cond:
            self._cond.notify_all()
        self._shutdown_stream()

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

    def _hear(self, at: float | None = None) -> None:
        with self._cond:
            self._heard = max(self._heard, time.monotonic() if at is None else at)
            self._cond.notify_all()

    def _set(self, obj: Obj | None) -> None:
        with self._cond:
            self._obj = obj
            self._synced = True
            self._heard = time.monotonic()
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
                if self._restart or self._stop.is_set():
                    continue  # our own shutdown of the stream, not the API server's doing
                self._connected = False
                log.warning("watch %s/%s: %s; retrying in %.1fs", self.collection, self.name, exc, backoff)
                self._wake.clear()
                self._wake.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                if self._restart:
                    self._restart = False
                    need_list = True

    def _watch_once(self) -> None:
        query = {"fieldSelector": f"metadata.name={self.name}", "resourceVersion": self._rv,
                 "allowWatchBookmarks": "true", "timeoutSeconds": str(self.server_timeout)}
        try:
            events = self.client.stream(self.collection, query, read_timeout=self.server_timeout + 30,
                                        opened=self._opened)
            for event in events:
                if self._stop.is_set() or self._restart:
                    return
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Expired()
                    raise KubeError(int(obj.get("code") or 500), obj.get("reason", ""), obj.get("message", ""),
                                    obj)
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if rv:
                    self._rv = rv
                if kind in ("ADDED", "MODIFIED"):
                    self._set(obj)
                elif kind == "DELETED":
                    self._set(None)
                else:  # BOOKMARK: nothing changed up to rv, which is word from the API server all the same
                    self._hear()
        finally:
            self._response = None

    def _opened(self, response: Any) -> None:
        self._response = response
        if self._restart or self._stop.is_set():
            self._shutdown_stream()

    def _shutdown_stream(self) -> None:
        response = self._response
        shutdown = getattr(response, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()  # wakes the watch thread's blocked read (urllib3 >= 2.3)
            except OSError as exc:
                log.debug("watch %s: shutting the stream down: %s", self.name, exc)

    # ---- the prober: word from the API server while the watch is silent

    def _probe_loop(self) -> None:
        while not self._stop.is_set():
            wait = self._heard + self.probe_after - time.monotonic()
            if wait > 0 or not self._synced:
                self._stop.wait(wait if wait > 0 else PROBE_RETRY)
                continue
            if not self._probe():
                self._stop.wait(PROBE_RETRY)

    def _probe(self) -> bool:
        """One cheap LIST; True when it proves the cache current (see the module docstring)."""
        sent = time.monotonic()
        try:
            listing = self.client.request(
                "GET", self.collection, timeout=PROBE_TIMEOUT,
                query={"fieldSelector": f"metadata.name={self.name}", "resourceVersion": "0"})
            items = listing.get("items") or []
        except (Unreachable, KubeError, ValueError, AttributeError) as exc:
            if not self._probe_failing:
                log.warning("watch %s/%s: the API server did not answer a probe after %.0f s of silence (%s); the "
                            "cache is served for %.0f s more at most", self.collection, self.name,
                            sent - self._heard, exc, max(0.0, self.stale_after - (sent - self._heard)))
            self._probe_failing = True
            return False
        if self._probe_failing:
            log.info("watch %s/%s: the API server answers again", self.collection, self.name)
            self._probe_failing = False
        listed = items[0] if items else None
        if not self._connected:
            self._wake.set()  # the watch is backing off from an error: try again now
            return False
        with self._cond:
            caught_up = self._cond.wait_for(lambda: same_state(self._obj, listed) or self._heard >= sent, CATCH_UP)
        if caught_up:
            self._hear(sent)
            return True
        log.warning("watch %s/%s: the watch has fallen behind the API server (cached resourceVersion %s, "
                    "listed %s): restarting it", self.collection, self.name, _rv(self._obj or {}) or "-",
                    _rv(listed or {}) or "-")
        self._restart = True
        self._shutdown_stream()
        return False


class _Expired(Exception):
    """The watch's resourceVersion is too old: list again."""
