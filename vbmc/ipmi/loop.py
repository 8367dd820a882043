"""One IPMI event loop per process: one thread waits for the UDP sockets and deadlines of every IpmiServer in it.

A pooled agent serves hundreds of BMCs; a thread and a wake socket pair for each would cost two threads (with its
backend writer) and three descriptors a member, all asleep. Here one thread polls every server's socket, and when one
has a packet, is due (a session sweep, a SOL retransmission or output) or was handed work from another thread, the
server takes a turn (`Served.turn`) on a worker thread. The loop thread itself runs no server code, so it never waits
for a Machine.

A server's turns never overlap: while one runs, its socket is out of the poll set (poll is level-triggered: a socket
left in would wake the loop over and over), and it goes back in when the turn ends. A server whose backend hangs
therefore holds one worker and nothing else; the others take their turns on the other workers. Workers are created
when every existing one is busy, up to WORKERS, and stay (an idle one waits on a queue): a pool at rest runs the
loop thread and as many workers as its busiest moment needed.

poll, not select.select: a pool's process holds thousands of descriptors, and select.select refuses any numbered
1,024 or more. poll rather than epoll: a socket leaves and rejoins the poll set at every turn, which for poll is a
change to a dict and for epoll two system calls; poll's cost per wait grows with the sockets watched, a few
microseconds for a pool of 500.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("vbmc.ipmi")

# Workers at most: a server whose backend hangs holds one, so this many would have to hang at once for the others
# to wait. Created only when every existing one is busy; daemon threads, so that a hung backend call does not hold
# up the process's exit.
WORKERS = 64


class Served(Protocol):
    """What the loop needs of a server (vbmc/ipmi/server.py's IpmiServer)."""

    def turn(self) -> float | None:
        """Run on a worker, never two at once for one server: take the packets waiting, the work handed in, what is
        due. Returns when the next turn is due (time.monotonic()) if no packet comes first, or None."""
        ...


class _Entry:
    """A server as the loop thread sees it."""

    def __init__(self, server: Served, sock: socket.socket) -> None:
        self.server = server
        self.socket = sock
        self.watched = False  # its socket is in the poll set
        self.busy = False  # a turn is running or queued
        self.again = False  # work was handed in during the turn: another one at once
        self.due: float | None = None  # when its next turn is due without a packet
        self.removed = False
        self.idle = threading.Event()  # no turn running (remove waits on it)
        self.idle.set()


class IpmiLoop:
    """The loop (see the module docstring). `IpmiLoop.shared()` is the process's; `add`, `wake` and `remove` may be
    called from any thread; the thread starts with the first server added."""

    _shared: IpmiLoop | None = None
    _shared_lock = threading.Lock()

    def __init__(self, workers: int = WORKERS) -> None:
        self._max_workers = workers
        self._workers: list[threading.Thread] = []
        self._jobs: queue.SimpleQueue[_Entry] = queue.SimpleQueue()
        self._idle_workers = threading.Semaphore(0)  # released by a worker each time it finishes a turn
        self._selector = selectors.PollSelector()
        self._wake_in, self._wake_out = socket.socketpair()
        for end in (self._wake_in, self._wake_out):
            end.setblocking(False)
        self._selector.register(self._wake_out, selectors.EVENT_READ)
        self._calls: collections.deque[Callable[[], None]] = collections.deque()  # run on the loop thread
        self._entries: dict[Served, _Entry] = {}  # the loop thread's
        self._timed: dict[Served, _Entry] = {}  # entries waiting, with a due time
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._last_error = ""

    @classmethod
    def shared(cls) -> IpmiLoop:
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = IpmiLoop()
            return cls._shared

    @property
    def threads(self) -> int:
        """The loop's threads: its own and its workers."""
        return (self._thread is not None) + len(self._workers)

    # ---- from any thread

    def add(self, server: Served, sock: socket.socket) -> None:
        """Watch `server`'s socket (non-blocking); its first turn comes with its first packet."""
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ipmi-loop", daemon=True)
                self._thread.start()
        self._call(lambda: self._add(_Entry(server, sock)))

    def wake(self, server: Served) -> None:
        """Work was handed to `server` from another thread: a turn soon (after the running one, if any)."""
        self._call(lambda: self._begin(self._entries.get(server)))

    def remove(self, server: Served, timeout: float) -> None:
        """Stop watching `server`; returns once the loop has let go of its socket (at once: the loop thread never
        waits) and its running turn, if any, is over, or after `timeout`. Call it before closing the socket: the
        descriptor's number may be reused at once."""
        dropped = threading.Event()
        idle: list[threading.Event] = []

        def drop() -> None:
            entry = self._entries.pop(server, None)
            if entry is not None:
                entry.removed = True
                self._unwatch(entry)
                self._timed.pop(server, None)
                idle.append(entry.idle)
            dropped.set()

        deadline = time.monotonic() + timeout
        self._call(drop)
        dropped.wait(timeout)
        for event in idle:
            event.wait(max(0.0, deadline - time.monotonic()))

    def _call(self, work: Callable[[], None]) -> None:
        self._calls.append(work)
        with contextlib.suppress(OSError):  # full: the loop is awake anyway
            self._wake_in.send(b"\0")

    # ---- the loop thread

    def _run(self) -> None:
        while True:
            try:
                events = self._selector.select(self._timeout())
            except (OSError, ValueError) as exc:
                # Not expected (the loop lets go of a socket before it is closed); logged once per error, and
                # the loop carries on: every server of the process depends on it.
                if repr(exc) != self._last_error:
                    self._last_error = repr(exc)
                    log.exception("ipmi loop: waiting for packets failed")
                time.sleep(0.1)
                continue
            for key, _ in events:
                if key.fileobj is self._wake_out:
                    self._run_calls()
                else:
                    self._begin(key.data)
            now = time.monotonic()
            for entry in [e for e in self._timed.values() if e.due is not None and e.due <= now]:
                self._begin(entry)

    def _timeout(self) -> float | None:
        """Until the next due turn; None (sleep until a packet or a call) when none is due: a pool at rest costs
        no wake-ups."""
        due = min((e.due for e in self._timed.values() if e.due is not None), default=math.inf)
        return None if due == math.inf else max(0.0, due - time.monotonic())

    def _run_calls(self) -> None:
        with contextlib.suppress(OSError):  # drained
            while self._wake_out.recv(4096):
                pass
        while self._calls:
            work = self._calls.popleft()
            try:
                work()
            except Exception:
                log.exception("ipmi loop: a call failed")

    def _add(self, entry: _Entry) -> None:
        self._entries[entry.server] = entry
        self._watch(entry)

    def _watch(self, entry: _Entry) -> None:
        try:
            self._selector.register(entry.socket, selectors.EVENT_READ, entry)
        except (ValueError, KeyError, OSError) as exc:  # closed under the loop (never by stop(), which removes first)
            log.warning("ipmi loop: a server's socket cannot be watched: %s", exc)
            self._entries.pop(entry.server, None)
            return
        entry.watched = True

    def _unwatch(self, entry: _Entry) -> None:
        if entry.watched:
            entry.watched = False
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(entry.socket)

    def _begin(self, entry: _Entry | None) -> None:
        """A turn for `entry` on a worker, or right after its running one."""
        if entry is None or entry.removed:
            return
        if entry.busy:
            entry.again = True
            return
        self._unwatch(entry)
        self._timed.pop(entry.server, None)
        entry.busy, entry.again, entry.due = True, False, None
        entry.idle.clear()
        self._jobs.put(entry)
        if not self._idle_workers.acquire(blocking=False) and len(self._workers) < self._max_workers:
            worker = threading.Thread(target=self._work, name=f"ipmi-{len(self._workers) + 1}", daemon=True)
            self._workers.append(worker)
            worker.start()

    def _work(self) -> None:
        """A worker: turns, one after another, for whichever servers the loop hands it."""
        while True:
            entry = self._jobs.get()
            due: float | None = None
            try:
                due = entry.server.turn()
            except Exception:
                log.exception("ipmi loop: a server's turn failed")
            finally:
                self._call(functools.partial(self._ended, entry, due))
                entry.idle.set()
                self._idle_workers.release()

    def _ended(self, entry: _Entry, due: float | None) -> None:
        entry.busy = False
        if entry.removed:
            return
        if entry.again:
            self._begin(entry)
            return
        self._watch(entry)
        if due is not None and entry.watched:
            entry.due = due
            self._timed[entry.server] = entry
