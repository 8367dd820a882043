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
  "the machine is off"}`; text from a client of the serial console is typed like binary. A client message is at
  most INPUT_LIMIT bytes (4 KiB of typing, what a tty takes at once; 64 KiB of RFB for the screen).
- A new serial viewer is first shown the line's recent output (the last 64 KiB, vbmc/machine/console.py).
- The server ends a connection with a text message saying why (`"Attached": false`), then a close frame with the
  same words as its reason: 1008 when the session ends (DELETE, or its inactivity timeout; typing on a console
  counts as activity), 1009 for a message over the limit, 1002 when a screen viewer breaks RFB, 1003 for text to
  the screen, 1011 when a viewer reads too slowly (OUTBOX bytes wait for it, or one message is not taken within
  SEND_DEADLINE seconds: a viewer that stops reading loses its slot then, whatever else it does).

Safe by construction: an upgrade is refused with an HTTP status, before anything opens, over plain HTTP when the
BMC takes credentials over HTTPS only (spec.redfish.requireTLS), from a browser page of another origin (the Origin
header must name this very host), from a source locked out by the login throttle (429), and without a live session
(401). A refusal after authentication has to be one the page can read (a browser shows a refused upgrade as 1006,
without its status): the WebSocket opens, says why in a text message and closes, with 1013 (try again later) past
MAX_VIEWERS viewers of a console and 1003 for the screen of a machine that has none. Every send to a viewer has a
deadline, so a viewer that never reads cannot keep its slot: not past SEND_DEADLINE, nor past its session's end.
Each console opened, refused or closed is one audit line (who, from where, and for how long), and each open
console is listed with its session (SessionStore.open_console: the sessions view shows it).
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
from ..redfish.errors import RedfishError, not_found
from ..redfish.sessions import Session, SessionStore

log = logging.getLogger("vbmc.web")

SERIAL_URI, SCREEN_URI = "/consoles/serial", "/consoles/screen"
KINDS = {SERIAL_URI: "serial", SCREEN_URI: "screen"}
TOKEN_PREFIX = "x-auth-token."
# Bytes queued for one viewer and not yet written to it: beyond, the viewer is too slow and its connection ends. A
# screen viewer asks for each update, so it never has more than about one screen's worth queued.
OUTBOX = {"serial": 1 << 20, "screen": 16 << 20}
# Bytes of one message from a viewer (the server takes at most WEBSOCKET_MESSAGE, vbmc/redfish/server.py): typing,
# as much as a tty's input buffer takes at once; RFB input events and a clipboard's text for the screen.
INPUT_LIMIT = {"serial": 4096, "screen": 64 * 1024}
# Seconds a viewer has to take one message from the server, plus a second for every SEND_RATE bytes of it (a whole
# screen over a slow link): a viewer that takes nothing for that long has stopped reading, and its slot is freed.
SEND_DEADLINE = 10.0
SEND_RATE = 64 * 1024
CLOSE_DEADLINE = 2.0  # seconds to tell a viewer that may not read why its connection ends
CLOSE_REASON = 123  # bytes of a close frame's reason (RFC 6455 5.5: a control frame's payload is 125 bytes)
# Why a viewer's connection ended when the server refused a message over WEBSOCKET_MESSAGE (it closed with 1009).
TOO_LARGE = "the viewer sent a message larger than the server takes"
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

    def error(self, path: str) -> RedfishError:
        """The refusal as the Redfish service would answer the same condition (vbmc/redfish/accounts.py): 401 without a
        session, 403 GeneralError over plain HTTP (and for another origin's page), 404 for a URI with nothing."""
        if self.status == 404:
            return not_found(path[:200])
        key = "NoValidSession" if self.status == 401 else "GeneralError"
        return RedfishError(self.status, key, detail=self.message)


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


def close_reason(why: str) -> str:
    """`why` as a close frame's reason: at most CLOSE_REASON bytes of UTF-8, cut on a character."""
    return why.encode()[:CLOSE_REASON].decode(errors="ignore")


@dataclass(frozen=True)
class Ending:
    """How the server ends a viewer's connection: the close code and why (the text message's and the reason)."""

    code: int
    why: str


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
                 screen: ScreenHub | None, *, require_tls: bool = False, session_check: float = SESSION_CHECK,
                 send_deadline: float = SEND_DEADLINE) -> None:
        self.store = store
        self.throttle = throttle
        self.vm = vm
        self.serial = serial
        self.screen = screen
        self.require_tls = require_tls
        self.session_check = session_check
        self.send_deadline = send_deadline

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        source = str((scope.get("client") or ("", 0))[0])
        decided = upgrade(scope.get("path", ""), scope.get("scheme", "ws"), scope.get("headers", []),
                          list(scope.get("subprotocols") or []), self.require_tls)
        action = f"open {decided.kind} console" if isinstance(decided, Upgrade) else "open console"
        actor = audit.Actor("web", source)
        if isinstance(decided, Refusal):
            return await self._deny(send, decided.error(scope.get("path", "")), action, actor)
        wait = self.throttle.retry_after(source)
        if wait > 0:
            self.throttle.refused("web-console")
            seconds = max(1, math.ceil(wait))
            # As the Redfish service's lockout (Service.refuse_if_throttled).
            return await self._deny(send, RedfishError(429, "ServiceTemporarilyUnavailable", seconds,
                                                       detail="Too many failed logins from this address.",
                                                       headers={"Retry-After": str(seconds)}), action, actor)
        session = self.store.authenticate(decided.token)
        if session is None:
            return await self._deny(send, Refusal(401, "No live Redfish session for this token.").error(""), action,
                                    actor)
        actor = audit.Actor("web", source, session.username, session.id)
        if decided.kind == "screen" and self.screen is None:
            return await self._refuse_open(send, decided, actor, Ending(1003, "this machine has no screen"))
        await self._serve(decided, session, actor, send, receive)

    async def _deny(self, send: Send, error: RedfishError, action: str, actor: audit.Actor) -> None:
        """Refuse the upgrade with an HTTP status and the Redfish service's error body (nothing opens)."""
        audit.record(action, self.vm, f"denied: {error.detail or error}", actor=actor, level=logging.WARNING)
        body = json.dumps(error.body(), separators=(",", ":")).encode()
        await self._within(CLOSE_DEADLINE, send, {
            "type": "websocket.http.response.start", "status": error.status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                        *((k.lower().encode(), v.encode()) for k, v in error.headers.items())]},
            {"type": "websocket.http.response.body", "body": body, "more_body": False})

    async def _refuse_open(self, send: Send, decided: Upgrade, actor: audit.Actor, ending: Ending) -> None:
        """Refuse an authenticated viewer in words a browser shows: open, say why, close."""
        audit.record(f"open {decided.kind} console", self.vm, f"denied: {ending.why}", actor=actor,
                     level=logging.WARNING)
        await self._within(CLOSE_DEADLINE, send, {"type": "websocket.accept", "subprotocol": decided.subprotocol},
                           *self._ending(decided.kind, ending))

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
            return await self._refuse_open(send, decided, actor, Ending(1013, str(exc)))
        listed = self.store.open_console(session, kind, actor.source)
        started = time.monotonic()
        audit.record(f"open {kind} console", self.vm, "opened", actor=actor)
        why, ending = "closed by the viewer", None
        try:
            if await self._within(self.send_deadline, send, {"type": "websocket.accept",
                                                              "subprotocol": decided.subprotocol}):
                why, ending = await self._run(kind, session, decided.token, viewer, outbox, send, receive)
            else:
                why = "the viewer did not complete the upgrade"
        except OSError:
            why = "the connection ended"
        finally:
            # The slot is free before anything more is said to the viewer (which may never read it).
            viewer.leave()
            self.store.close_console(session, listed)
            audit.record(f"{kind} console", self.vm, f"closed: {why}", time.monotonic() - started, actor=actor)
        if ending is not None:
            await self._within(CLOSE_DEADLINE, send, *self._ending(kind, ending))
        elif why == TOO_LARGE:
            # The server has closed with 1009 and reads the rest of the message to drop it: the connection stays
            # until the viewer answers the close (or CLOSE_DEADLINE), so that it can read why.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLOSE_DEADLINE):
                    await receive()

    async def _run(self, kind: str, session: Session, token: str, viewer: SerialViewer | ScreenViewer,
                   outbox: _Outbox, send: Send, receive: Receive) -> tuple[str, Ending | None]:
        """Carry the console until either side ends it: why it ended, and how to end the connection (None: it
        has ended)."""
        ending: Ending | None = None
        # A serial viewer types on the line; a screen viewer's bytes are RFB for the hub to read.
        feed = viewer.send if isinstance(viewer, SerialViewer) else viewer.feed
        limit = INPUT_LIMIT[kind]

        def end(code: int, why: str) -> str:
            nonlocal ending
            ending = Ending(code, why)
            return why

        async def reader() -> str:
            touched = time.monotonic()
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    return TOO_LARGE if message.get("code") == 1009 else "closed by the viewer"
                data = message.get("bytes")
                if data is None:
                    if kind == "screen":
                        return end(1003, "the screen takes binary messages only")
                    data = (message.get("text") or "").encode()
                if len(data) > limit:
                    return end(1009, f"a {kind} console message is at most {limit} bytes")
                if time.monotonic() - touched > TOUCH_EVERY:
                    touched = time.monotonic()
                    self.store.authenticate(token)  # typing is activity on the session
                try:
                    feed(data)
                except RfbError as exc:
                    return end(1002, f"RFB: {exc}")

        async def writer() -> str:
            while True:
                item = await outbox.get()
                message = {"type": "websocket.send", "bytes": item} if isinstance(item, bytes) else \
                    {"type": "websocket.send", "text": item}
                if not await self._within(self.send_deadline + len(item) / SEND_RATE, send, message):
                    return end(1011, f"the viewer stopped reading: nothing sent to it was taken for "
                                     f"{self.send_deadline:.0f} s")
                gone = viewer.ended if isinstance(viewer, ScreenViewer) else ""
                if gone:
                    return end(1011, gone)

        async def watchdog() -> str:
            while True:
                overflow = asyncio.ensure_future(outbox.overflowed.wait())
                done, _ = await asyncio.wait({overflow}, timeout=self.session_check)
                overflow.cancel()
                if done:
                    return end(1011, "the viewer is not keeping up with the console")
                if self.store.get(session.id) is None:
                    return end(1008, "the Redfish session ended")

        tasks = [asyncio.ensure_future(reader()), asyncio.ensure_future(writer()), asyncio.ensure_future(watchdog())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            why = next(iter(done)).result()
        finally:
            for task in tasks:
                task.cancel()
            # Bounded: a task that does not end when cancelled (asyncio.wait_for in a send can swallow it) must not
            # keep the viewer's slot.
            _, pending = await asyncio.wait(tasks, timeout=CLOSE_DEADLINE)
            for task in pending:
                task.cancel()  # once more: the first may have been swallowed
        return why, ending

    @staticmethod
    def _ending(kind: str, ending: Ending) -> tuple[dict[str, Any], dict[str, Any]]:
        """What ends a connection: a text message saying why, then the close frame with the same words."""
        return ({"type": "websocket.send", "text": status_message(kind, False, ending.why)},
                {"type": "websocket.close", "code": ending.code, "reason": close_reason(ending.why)})

    @staticmethod
    async def _within(seconds: float, send: Send, *messages: dict[str, Any]) -> bool:
        """Send `messages` in order; False when the viewer has not taken them within `seconds` or the connection
        ended (a send to a viewer that never reads would otherwise wait for good)."""
        try:
            async with asyncio.timeout(seconds):
                for message in messages:
                    await send(message)
        except (TimeoutError, OSError):
            return False
        return True
