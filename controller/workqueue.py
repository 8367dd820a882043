"""client-go's rate-limited work queue, small: a key is queued at most once, is never handed to two workers at a
time (a key added while it is being processed is queued again when `done`), can be added after a delay, and
backs off exponentially per key on failures until `forget`."""

from __future__ import annotations

import collections
import heapq
import itertools
import threading
import time
from collections.abc import Hashable


class WorkQueue:
    def __init__(self, base_delay: float = 0.05, max_delay: float = 60.0) -> None:
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._queue: collections.deque[Hashable] = collections.deque()
        self._dirty: set[Hashable] = set()
        self._processing: set[Hashable] = set()
        self._failures: dict[Hashable, int] = {}
        self._waiting: list[tuple[float, int, Hashable]] = []  # (due, seq, key); stale entries skipped
        self._due: dict[Hashable, float] = {}  # key -> when it is due: one delayed add per key, the earliest
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._shutdown = False

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)

    def add(self, key: Hashable) -> None:
        with self._cond:
            if self._shutdown or key in self._dirty:
                return
            self._dirty.add(key)
            if key not in self._processing:
                self._queue.append(key)
                self._cond.notify()

    def add_after(self, key: Hashable, delay: float) -> None:
        if delay <= 0:
            self.add(key)
            return
        due = time.monotonic() + delay
        with self._cond:
            # As client-go's delaying queue: a key already waiting keeps the earlier of its two due times, so a
            # key requeued on every event does not pile up heap entries (and reconciles) for one change.
            if key in self._due and self._due[key] <= due:
                return
            self._due[key] = due
            heapq.heappush(self._waiting, (due, next(self._seq), key))
            self._cond.notify()

    def add_rate_limited(self, key: Hashable) -> float:
        """Add after this key's back-off (doubling with each failure since the last `forget`); the delay."""
        with self._cond:
            failures = self._failures.get(key, 0)
            self._failures[key] = failures + 1
        delay = min(self.max_delay, self.base_delay * (2 ** failures))
        self.add_after(key, delay)
        return delay

    def failures(self, key: Hashable) -> int:
        with self._cond:
            return self._failures.get(key, 0)

    def forget(self, key: Hashable) -> None:
        with self._cond:
            self._failures.pop(key, None)

    def get(self, timeout: float | None = None) -> Hashable | None:
        """The next key to process (the caller must call `done`), or None at shutdown or timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._shutdown:  # what is left is not drained: level-triggered, the next run resyncs it
                    return None
                self._promote()
                if self._queue:
                    key = self._queue.popleft()
                    self._processing.add(key)
                    self._dirty.discard(key)
                    return key
                wait = None if deadline is None else deadline - time.monotonic()
                if self._waiting:
                    until_due = self._waiting[0][0] - time.monotonic()
                    wait = until_due if wait is None else min(wait, until_due)
                if wait is not None and wait <= 0 and deadline is not None and time.monotonic() >= deadline:
                    return None
                self._cond.wait(None if wait is None else max(wait, 0.001))

    def done(self, key: Hashable) -> None:
        with self._cond:
            self._processing.discard(key)
            if key in self._dirty:
                self._queue.append(key)
                self._cond.notify()

    def shutdown(self) -> None:
        with self._cond:
            self._shutdown = True
            self._cond.notify_all()

    def _promote(self) -> None:
        now = time.monotonic()
        while self._waiting and self._waiting[0][0] <= now:
            due, _, key = heapq.heappop(self._waiting)
            if self._due.get(key) != due:
                continue  # superseded by an earlier add_after of the same key
            del self._due[key]
            if key not in self._dirty:
                self._dirty.add(key)
                if key not in self._processing:
                    self._queue.append(key)
