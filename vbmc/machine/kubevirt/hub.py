"""The process's one event loop for its connections to the API server (watches: streams.py and watch.py; console
WebSockets: console.py), on a daemon thread started on first use, and where a request to the API server goes.
Imports nothing of the client, so that both the client's console and its watches can use it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar
from urllib.parse import urlencode, urlsplit

T = TypeVar("T")


class Hub:
    """The event loop of the process's connections to the API server (watches, console WebSockets), on one daemon
    thread started on first use. What runs on it must not block."""

    _shared: Hub | None = None
    _shared_lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kube-streams", daemon=True)
        self._thread.start()

    @classmethod
    def shared(cls) -> Hub:
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = Hub()
            return cls._shared

    def run(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def wait(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the loop and wait for it, from any other thread (on the loop itself it would deadlock)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("Hub.wait called on the hub's own loop")
        future = self.run(coro)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def call(self, callback: Any, *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is ending
            self.loop.call_soon_threadsafe(callback, *args)


def server_target(server: str, path: str, query: dict[str, str] | None) -> tuple[str, int, bool, str, str]:
    """(host, port, tls, Host header, request target) of a request to `path` on the API server `server` (a URL that
    may carry a path prefix)."""
    parts = urlsplit(server)
    tls = parts.scheme == "https"
    host = parts.hostname or "localhost"
    port = parts.port or (443 if tls else 80)
    host_header = parts.netloc.rpartition("@")[2]
    target = parts.path.rstrip("/") + path + (f"?{urlencode(query)}" if query else "")
    return host, port, tls, host_header, target
