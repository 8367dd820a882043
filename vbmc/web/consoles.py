"""The BMC's consoles as WebSockets: the serial line at `/consoles/serial`, the screen at `/consoles/screen`.

Both are the BMC's shared consoles (vbmc/machine/console.py's SerialHub, vbmc/machine/screen.py's ScreenHub): every
viewer sees the one serial line that IPMI SOL shows, and the one screen.

The protocol, for the page and for any WebSocket client:
- Authentication is a Redfish session (POST /redfish/v1/SessionService/Sessions): its token goes in the
  `Sec-WebSocket-Protocol` list as `x-auth-token.<token>` (browsers cannot set other headers), or in an
  `X-Auth-Token` header (other clients). Never in the URL: URLs end up in logs and browser history. The other
  protocol offered is the one the server answers with (any name: `binary` for noVNC, `kubevbmc` otherwise).
- Binary messages carry the console's bytes both ways: serial characters, or RFB 3.8 (RFC 6143) for the screen.
  Text messages from the server say how the console is: `{"Console": "serial", "Attached": false, "Message":
  "the machine is off"}`; text from a client of the serial console is typed like binary.
- The connection ends (close code 1008) when the session does (DELETE, or its inactivity timeout; typing on a
  console counts as activity), with 1002 when a screen viewer breaks RFB, 1011 when a viewer reads too slowly.

Safe by construction: an upgrade is refused (an HTTP status, before anything opens) over plain HTTP when the BMC
takes credentials over HTTPS only (spec.redfish.requireTLS), from a browser page of another origin (the Origin
header must name this very host), from a source locked out by the login throttle (429), without a live session
(401), and past MAX_VIEWERS viewers of a console (503). Each console opened, refused or closed is one audit line
(who, from where, and for how long).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..access import audit
from ..access.throttle import LoginThrottle
from ..machine.console import SerialHub, SerialViewer, TooManyViewers
from ..machine.rfb import RfbError
from ..machine.screen import ScreenHub, ScreenViewer
from ..redfish.sessions import Session, SessionStore

log = logging.getLogger("vbmc.web")

SERIAL_URI, SCREEN_URI = "/consoles/serial", "/consoles/screen"
KINDS = {SERIAL_URI: "serial", SCREEN_URI: "screen"}
TOKEN_PREFIX = "x-auth-token."
# Bytes queued for one viewer and not yet written to it: beyond, the viewer is too slow and its connection ends. A
# screen viewer asks for each update, so it never has more than about one screen's worth queued.
OUTBOX = {"serial": 1 << 20, "screen": 16 << 20}
SESSION_CHECK = 1.0  # seconds between looks at whether the viewer's session is still alive
TOUCH_EVERY = 10.0  # typing keeps the session alive, touched at most this often

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class Upgrade:
    """An upgrade that may go on to authentication: which console, the token offered, the protocol to answer."""

    kind: str
    token: str
    subprotocol: str | None


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def same_origin(origin: str | None, scheme: str, host: str | None) -> bool:
    """Whether a browser's Origin names this service as it was reached (no Origin: not a browser, nothing to
    check: the session token is what authenticates)."""
    if origin is None:
        return True
    if not host:
        return False
    return origin.lower() == f"{'https' if scheme in ('wss', 'https') else 'http'}://{host.lower()}"


def upgrade(path: str, scheme: str, headers: Iterable[tuple[bytes, bytes]], subprotocols: list[str],
            require_tls: bool) -> Upgrade | Refusal:
    """What to make of a WebSocket upgrade, before any session is looked at (a pure function)."""
    kind = KINDS.get(path)
    if kind is None:
        return Refusal(404, f"no console at {path[:200]}")
    headers = list(headers)
    if require_tls and scheme not in ("wss", "https"):
        return Refusal(403, "This BMC accepts credentials over HTTPS only (spec.redfish.requireTLS): use wss://.")
    if not same_origin(_header(headers, b"origin"), scheme, _header(headers, b"host")):
        return Refusal(403, "The page that opened this console is not this BMC's (Origin).")
    offered = [p for p in subprotocols if p.startswith(TOKEN_PREFIX)]
    if len(offered) > 1:
        return Refusal(400, "More than one session token offered.")
    token = offered[0][len(TOKEN_PREFIX):] if offered else (_header(headers, b"x-auth-token") or "")
    if not token:
        return Refusal(401, f"No Redfish session: offer the subprotocol {TOKEN_PREFIX}<X-Auth-Token>.")
    others = [p for p in subprotocols if not p.startswith(TOKEN_PREFIX)]
    return Upgrade(kind, token, others[0] if others else None)


def status_message(kind: str, attached: bool, why: str) -> str:
    return json.dumps({"Console": kind, "Attached": attached, "Message": why})


class _Outbox:
    """What the hubs' threads hand one viewer, queued for the event loop, bounded in bytes."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int) -> None:
        self._loop = loop
        self._limit = limit
        self._queue: asyncio.Queue[bytes | str] = asyncio.Queue()
        self._lock = threading.Lock()
        self._bytes = 0
        self.overflowed = asyncio.Event()

    def put(self, item: bytes | str) -> None:
        """From any thread."""
        with self._lock:
            self._bytes += len(item)
            over = self._bytes > self._limit
        with contextlib.suppress(RuntimeError):  # the loop is closed: the agent is stopping
            if over:
                self._loop.call_soon_threadsafe(self.overflowed.set)
            else:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def get(self) -> bytes | str:
        item = await self._queue.get()
        with self._lock:
            self._bytes -= len(item)
        return item


class Consoles:
    """The consoles of one BMC, as WebSockets (see the module's docstring)."""

    def __init__(self, store: SessionStore, throttle: LoginThrottle, vm: str, serial: SerialHub,
                 screen: ScreenHub | None, *, require_tls: bool = False,
                 session_check: float = SESSION_CHECK) -> None:
        self.store = store
        self.throttle = throttle
        self.vm = vm
        self.serial = serial
        self.screen = screen
        self.require_tls = require_tls
        self.session_check = session_check

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        source = str((scope.get("client") or ("", 0))[0])
        decided = upgrade(scope.get("path", ""), scope.get("scheme", "ws"), scope.get("headers", []),
                          list(scope.get("subprotocols") or []), self.require_tls)
        action = f"open {decided.kind} console" if isinstance(decided, Upgrade) else "open console"
        actor = audit.Actor("web", source)
        if isinstance(decided, Refusal):
            return await self._deny(send, decided, action, actor)
        wait = self.throttle.retry_after(source)
        if wait > 0:
            self.throttle.refused("web-console")
            seconds = max(1, math.ceil(wait))
            return await self._deny(send, Refusal(429, "Too many failed logins from this address."), action, actor,
                                    [(b"retry-after", str(seconds).encode())])
        session = self.store.authenticate(decided.token)
        if session is None:
            return await self._deny(send, Refusal(401, "No live Redfish session for this token."), action, actor)
        actor = audit.Actor("web", source, session.username, session.id)
        if decided.kind == "screen" and self.screen is None:
            return await self._deny(send, Refusal(404, "This machine has no screen."), action, actor)
        await self._serve(decided, session, actor, send, receive)

    async def _deny(self, send: Send, refusal: Refusal, action: str, actor: audit.Actor,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
        audit.record(action, self.vm, f"denied: {refusal.message}", actor=actor, level=logging.WARNING)
        body = json.dumps({"error": {"code": "Base.1.19.GeneralError", "message": refusal.message}}).encode()
        await send({"type": "websocket.http.response.start", "status": refusal.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *(headers or [])]})
        await send({"type": "websocket.http.response.body", "body": body, "more_body": False})

    async def _serve(self, decided: Upgrade, session: Session, actor: audit.Actor, send: Send,
                     receive: Receive) -> None:
        kind = decided.kind
        loop = asyncio.get_running_loop()
        outbox = _Outbox(loop, OUTBOX[kind])

        def attached(available: bool, why: str) -> None:
            outbox.put(status_message(kind, available, why))

        viewer: SerialViewer | ScreenViewer
        try:
            if kind == "serial":
                viewer = self.serial.join(outbox.put, attached, replay=True)
            else:
                assert self.screen is not None
                viewer = self.screen.join(outbox.put, attached)
        except TooManyViewers as exc:
            return await self._deny(send, Refusal(503, str(exc)), f"open {kind} console", actor,
                                    [(b"retry-after", b"10")])
        started = time.monotonic()
        audit.record(f"open {kind} console", self.vm, "opened", actor=actor)
        why = "closed by the viewer"
        try:
            await send({"type": "websocket.accept", "subprotocol": decided.subprotocol})
            why = await self._run(kind, session, decided.token, viewer, outbox, send, receive)
        except OSError:
            why = "the connection ended"
        finally:
            viewer.leave()
            audit.record(f"{kind} console", self.vm, f"closed: {why}", time.monotonic() - started, actor=actor)

    async def _run(self, kind: str, session: Session, token: str, viewer: SerialViewer | ScreenViewer,
                   outbox: _Outbox, send: Send, receive: Receive) -> str:
        """Carry the console until either side ends it; why it ended."""
        closing: tuple[int, str] | None = None
        # A serial viewer types on the line; a screen viewer's bytes are RFB for the hub to read.
        feed = viewer.send if isinstance(viewer, SerialViewer) else viewer.feed

        async def reader() -> str:
            nonlocal closing
            touched = time.monotonic()
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    return "closed by the viewer"
                data = message.get("bytes")
                if data is None:
                    text = message.get("text") or ""
                    if kind == "screen":
                        closing = (1003, "the screen takes binary messages only")
                        return closing[1]
                    data = text.encode()
                if time.monotonic() - touched > TOUCH_EVERY:
                    touched = time.monotonic()
                    self.store.authenticate(token)  # typing is activity on the session
                try:
                    feed(data)
                except RfbError as exc:
                    closing = (1002, f"RFB: {exc}"[:120])
                    return closing[1]

        async def writer() -> str:
            nonlocal closing
            while True:
                item = await outbox.get()
                if isinstance(item, bytes):
                    await send({"type": "websocket.send", "bytes": item})
                else:
                    await send({"type": "websocket.send", "text": item})
                    gone = viewer.ended if isinstance(viewer, ScreenViewer) else ""
                    if gone:
                        closing = (1011, gone[:120])
                        return gone

        async def watchdog() -> str:
            nonlocal closing
            while True:
                overflow = asyncio.ensure_future(outbox.overflowed.wait())
                done, _ = await asyncio.wait({overflow}, timeout=self.session_check)
                overflow.cancel()
                if done:
                    closing = (1011, "the viewer is not keeping up with the console")
                    return closing[1]
                if self.store.get(session.id) is None:
                    closing = (1008, "the Redfish session ended")
                    return closing[1]

        tasks = [asyncio.ensure_future(reader()), asyncio.ensure_future(writer()), asyncio.ensure_future(watchdog())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            why = next(iter(done)).result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if closing is not None:
            with contextlib.suppress(OSError, RuntimeError):
                await send({"type": "websocket.close", "code": closing[0], "reason": closing[1]})
        return why
