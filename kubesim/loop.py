"""ControlLoop: the shape of every simulated controller (virt-controller, deployments, kubelet, GC).

Store events map to keys; a de-duplicating queue feeds `sync(key)`, which reads the current state and acts
(level-triggered). `sync` may ask to run again after a delay, which is how timed behaviour (a VM that takes a
second to boot) is simulated without sleeping threads.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Hashable, Iterable

from . import errors
from .store import MODIFIED, Event, Store

log = logging.getLogger(__name__)


def status_only(event: Event) -> bool:
    """A MODIFIED event that changed only the status (and the resourceVersion and managedFields every write
    changes): what a controller wrote about an object it manages, which gives that controller nothing new to do."""
    old, new = event.old, event.obj
    if event.type != MODIFIED or old is None:
        return False
    if any(new.get(k) != old.get(k) for k in new.keys() | old.keys() if k not in ("status", "metadata")):
        return False
    meta, old_meta = new["metadata"], old["metadata"]
    return all(meta.get(k) == old_meta.get(k) for k in meta.keys() | old_meta.keys()
               if k not in ("resourceVersion", "managedFields"))


class ControlLoop:
    name = "controller"
    kinds: tuple[str, ...] = ()  # store type keys whose events this loop hears

    def __init__(self, store: Store, workers: int = 1) -> None:
        self.store = store
        self._workers = workers
        self._cond = threading.Condition()
        self._ready: collections.deque[Hashable] = collections.deque()
        self._queued: set[Hashable] = set()
        self._active: set[Hashable] = set()
        self._again: set[Hashable] = set()
        self._timers: list[tuple[float, int, Hashable]] = []
        self._seq = itertools.count()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        store.add_listener(self._hear)

    # ---- to override

    def keys_for(self, event: Event) -> Iterable[Hashable]:
        meta = event.obj["metadata"]
        return [(meta.get("namespace", ""), meta["name"])]

    def sync(self, key: Hashable) -> float | None:
        """Bring one key to its desired state; return seconds after which to look again, or None."""
        raise NotImplementedError

    # ---- machinery

    def _hear(self, event: Event) -> None:
        if event.rtype.key in self.kinds:
            for key in self.keys_for(event):
                self.enqueue(key)

    def enqueue(self, key: Hashable, delay: float = 0.0) -> None:
        with self._cond:
            if delay > 0:
                heapq.heappush(self._timers, (time.monotonic() + delay, next(self._seq), key))
            else:
                self._make_ready(key)
            self._cond.notify()

    def _make_ready(self, key: Hashable) -> None:
        """Queue a key (lock held); a key being synced now is synced once more afterwards."""
        if key in self._active:
            self._again.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._ready.append(key)

    def start(self) -> None:
        for i in range(self._workers):
            t = threading.Thread(target=self._run, name=f"{self.name}-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=2)

    def _next(self) -> Hashable | None:
        with self._cond:
            while not self._stopping:
                now = time.monotonic()
                while self._timers and self._timers[0][0] <= now:
                    self._make_ready(heapq.heappop(self._timers)[2])
                if self._ready:
                    key = self._ready.popleft()
                    self._queued.discard(key)
                    self._active.add(key)
                    return key
                wait = self._timers[0][0] - now if self._timers else None
                self._cond.wait(wait)
            return None

    def _run(self) -> None:
        while True:
            key = self._next()
            if key is None:
                return
            delay: float | None = None
            try:
                delay = self.sync(key)
            except errors.ApiError as exc:
                log.debug("%s: %s: %s", self.name, key, exc.message)
                delay = 0.2
            except Exception:
                log.exception("%s: sync %s failed", self.name, key)
                delay = 1.0
            with self._cond:
                self._active.discard(key)
                if key in self._again:
                    self._again.discard(key)
                    self._make_ready(key)
                    self._cond.notify()
            if delay is not None and not self._stopping:
                self.enqueue(key, delay)
