"""The agent's view of one object (its VM, its VMI, its VirtualMachineBMC): list, then watch, kept in memory.

Every read the protocols make comes from here, never from a GET per request. The watch runs on the process's
watch loop (streams.py: one thread for every watch), resumes from the last resourceVersion it saw (bookmarks keep
that fresh), re-lists after 410 Gone, and backs off while the API server is unreachable. An idle watch costs the
API server one request per WATCH_SECONDS: its renewal.

A cache is only as good as the last time the API server spoke to it. A silent watch may be idle (nothing changed)
or dead (the API server frozen, a connection dropped without a reset), and bookmarks, which a kube-apiserver sends
about once a minute, come too rarely to tell the two apart in time. So each watch remembers when it last *heard*
from the API server (a list, an event, a bookmark), and a read that finds a cache unheard of for STALE_AFTER
seconds confirms it first (`confirm`): one LIST with `fieldSelector=metadata.name=<name>` and `resourceVersion=0`
(answered from the API server's watch cache, no etcd read; the agent's Role allows it, the watch needs `list`)
within CONFIRM_TIMEOUT. The cost follows the clients, not the clock: no client, no request.

One LIST confirms a machine's watches together (its VM, VMI and VirtualMachineBMC, one client, one API server):
it confirms the first (the VM) when the API server shows what its cache shows (the same resourceVersion, or
absent on both sides), or when the watch delivers something within CATCH_UP seconds (an event in flight); the
others when their streams are open, which the kernel's TCP keepalive checks every few seconds (streams.py): the
API server that answered is the one whose streams they are. A cache the LIST shows behind (a stream that stopped
delivering while its connection stayed up: a middlebox swallowing it) has every watch of the machine restarted, a
fresh list and watch each, and the read waits for them. A confirmation that fails (the API server does not answer
in time) refuses the read (IPMI 0xC0, Redfish 503) rather than report a state that may be minutes old, and reads
in the next CONFIRM_RETRY seconds are refused without asking again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .client import KubeClient, KubeError, Unreachable
from .hub import Hub
from .streams import Response, get_json, watch_events

log = logging.getLogger(__name__)
Obj = dict[str, Any]

WATCH_SECONDS = 1800  # a watch request's timeoutSeconds: an idle watch is renewed this often
STALE_AFTER = 10.0  # seconds without word from the API server after which a read confirms the cache first
CONFIRM_TIMEOUT = 2.0  # a confirmation not answered by then has failed
CONFIRM_RETRY = 0.5  # after a failed confirmation, reads are refused this long without asking again
CATCH_UP = 1.0  # how long the watch may take to deliver what a confirmation saw before it counts as fallen behind


def same_state(cached: Obj | None, listed: Obj | None) -> bool:
    """The cache shows the object the API server listed: both absent, or the same resourceVersion (opaque: only
    equality means anything, never order)."""
    if cached is None or listed is None:
        return cached is None and listed is None
    return _rv(cached) == _rv(listed) != ""


def _rv(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


def confirm(watches: Sequence[ObjectWatch]) -> str:
    """"" when the caches of `watches` (one client's; the first is the one a LIST checks) may be read now, else
    why not (for the error a protocol returns). Blocks for at most a LIST when a cache was not heard of for
    STALE_AFTER seconds (see the module docstring); concurrent readers share one confirmation."""
    if all(w.fresh for w in watches):
        return ""
    first = watches[0]
    for watch in watches:
        if not watch.synced or not watch.connected:
            watch.retry_now()  # backing off after an error: a client is asking, try again now
            return watch.staleness()
    with first.confirm_lock:
        if all(w.fresh for w in watches):
            return ""  # confirmed by the reader we waited for
        if time.monotonic() < first.refused_until:
            return first.staleness()
        sent = time.monotonic()
        if first.probe(watches):
            for watch in watches:
                watch.heard_at(sent)
            return ""
        first.refused_until = time.monotonic() + CONFIRM_RETRY
        return first.staleness() or "the Kubernetes API server is unreachable"


_ahead: ThreadPoolExecutor | None = None
_ahead_lock = threading.Lock()


def confirm_soon(watches: Sequence[ObjectWatch]) -> None:
    """Start `confirm(watches)` in the background when a read would have to (a client has just arrived: its first
    read then finds the confirmation done, or under way, and waits only for the rest). A clock read when the caches
    are fresh; never blocks."""
    global _ahead
    if all(w.fresh for w in watches) or watches[0].confirm_lock.locked():
        return
    with _ahead_lock:
        if _ahead is None:
            _ahead = ThreadPoolExecutor(max_workers=4, thread_name_prefix="confirm")
    _ahead.submit(confirm, watches)


class ObjectWatch:
    def __init__(self, client: KubeClient, collection: str, name: str,
                 on_change: Callable[[Obj | None], None] | None = None, server_timeout: int = WATCH_SECONDS, *,
                 stale_after: float = STALE_AFTER, hub: Hub | None = None) -> None:
        self.client = client
        self.collection = collection  # e.g. /apis/kubevirt.io/v1/namespaces/ns/virtualmachines
        self.name = name
        self.on_change = on_change
        self.server_timeout = server_timeout
        self.stale_after = stale_after
        self.confirm_lock = threading.Lock()
        self.refused_until = 0.0
        self._hub = hub
        self._obj: Obj | None = None
        self._rv = ""
        self._synced = False
        self._connected = False
        self._heard = -math.inf  # time.monotonic() of the last word from the API server that the cache matched
        self._response: Response | None = None  # the open watch stream (watch loop), for a restart
        self._restart = False
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._wake: asyncio.Event | None = None  # ends a backoff early (watch loop)
        self._future: Future[Any] | None = None

    @property
    def obj(self) -> Obj | None:
        return self._obj

    @property
    def synced(self) -> bool:
        """At least one list succeeded: `obj` reflects the cluster (None means the object does not exist)."""
        return self._synced

    @property
    def connected(self) -> bool:
        """Listed and watching: not backing off after an error."""
        return self._connected

    @property
    def fresh(self) -> bool:
        """Listed, watching, and heard from the API server in the last `stale_after` seconds: readable without
        confirming (a clock read and a subtraction, no lock)."""
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
        hub = self._hub = self._hub or Hub.shared()
        self._future = hub.run(self._run())

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._future is not None:
            self._future.cancel()

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

    def heard_at(self, at: float | None = None) -> None:
        """Word from the API server about this cache (now, or at `at`)."""
        with self._cond:
            self._heard = max(self._heard, time.monotonic() if at is None else at)
            self._cond.notify_all()

    def retry_now(self) -> None:
        """End a backoff: the next attempt to list and watch starts now."""
        if self._hub is not None and self._wake is not None:
            self._hub.call(self._wake.set)

    def restart(self) -> None:
        """A fresh list and watch (the stream fell behind)."""
        self._restart = True
        if self._hub is not None:
            self._hub.call(self._close_stream)
        self.retry_now()

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

    # ---- on the watch loop

    async def _list(self) -> None:
        listing = await get_json(self.client, self.collection, {"fieldSelector": f"metadata.name={self.name}"},
                                 self.client.timeout)
        items = listing.get("items") or []
        self._rv = listing.get("metadata", {}).get("resourceVersion", "")
        self._set(items[0] if items else None)

    async def _run(self) -> None:
        self._wake = asyncio.Event()
        backoff = 0.2
        need_list = True
        while not self._stop.is_set():
            try:
                if self._restart:
                    self._restart, need_list = False, True
                if need_list:
                    await self._list()
                    need_list = False
                self._connected = True
                await self._watch_once()
                backoff = 0.2
            except _Expired:
                need_list = True
            except (Unreachable, KubeError, ValueError) as exc:
                if self._restart or self._stop.is_set():
                    continue  # our own closing of the stream, not the API server's doing
                self._connected = False
                log.warning("watch %s/%s: %s; retrying in %.1fs", self.collection, self.name, exc, backoff)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), backoff)
                backoff = min(backoff * 2, 5.0)

    async def _watch_once(self) -> None:
        query = {"fieldSelector": f"metadata.name={self.name}", "resourceVersion": self._rv,
                 "allowWatchBookmarks": "true", "timeoutSeconds": str(self.server_timeout)}
        try:
            async for event in watch_events(self.client, self.collection, query, self.server_timeout + 30,
                                            opened=self._opened):
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
                    self.heard_at()
        finally:
            self._response = None

    def _opened(self, response: Response) -> None:
        self._response = response
        if self._restart or self._stop.is_set():
            response.close()

    def _close_stream(self) -> None:
        if self._response is not None:
            self._response.close()

    # ---- a reader's confirmation (its own thread)

    def probe(self, group: Sequence[ObjectWatch]) -> bool:
        """One LIST; True when it proves this cache current (see the module docstring). When it shows the cache
        behind, every watch of `group` is restarted and this waits for their fresh lists."""
        sent = time.monotonic()
        try:
            listing = self.client.request(
                "GET", self.collection, timeout=CONFIRM_TIMEOUT,
                query={"fieldSelector": f"metadata.name={self.name}", "resourceVersion": "0"})
            items = listing.get("items") or []
        except (Unreachable, KubeError, ValueError, AttributeError) as exc:
            log.warning("watch %s/%s: the API server did not confirm the cache after %.0f s of silence (%s): "
                        "reads are refused until it does", self.collection, self.name, sent - self._heard, exc)
            return False
        listed = items[0] if items else None
        with self._cond:
            caught_up = self._cond.wait_for(lambda: same_state(self._obj, listed) or self._heard >= sent, CATCH_UP)
        if caught_up:
            return True
        log.warning("watch %s/%s: the watch has fallen behind the API server (cached resourceVersion %s, "
                    "listed %s): restarting the watches", self.collection, self.name, _rv(self._obj or {}) or "-",
                    _rv(listed or {}) or "-")
        restarted = time.monotonic()
        for watch in group:
            watch.restart()
        deadline = restarted + CONFIRM_TIMEOUT
        for watch in group:
            with watch._cond:
                watch._cond.wait_for(lambda w=watch: w._heard >= restarted and w._connected,  # type: ignore[misc]
                                     max(0.0, deadline - time.monotonic()))
        return all(w._heard >= restarted for w in group)


class _Expired(Exception):
    """The watch's resourceVersion is too old: list again."""
