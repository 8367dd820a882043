"""KubeVirt's consoles: the `console` (serial port) and `vnc` (screen) subresources of a running VMI, as WebSockets.

virt-api serves both at `subresources.kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances/{name}/{console|vnc}`
with the `plain.kubevirt.io` subprotocol: binary messages of raw bytes both ways, serial characters for `console`
and RFB (the VNC protocol, as QEMU speaks it) for `vnc` (virtctl console and virtctl vnc speak the same;
kubevirt/kubevirt staging/src/kubevirt.io/client-go/subresources/constants.go, pkg/virt-api/rest/vnc.go). A line
ends when the VMI does (stopped, or a reset that replaced it).

One owner per connection. An OpenSSL connection must not be used by two threads at once: the serial bridge once
read its WebSocket in one thread and wrote it in another, and typing while the VM printed its boot text ended the
line with `[SSL: WRONG_VERSION_NUMBER]` and lost what was typed. Here every console connection of the process is
driven by one asyncio event loop on one daemon thread (hub.Hub, the one the watches run on): the TLS
handshake, the WebSocket handshake (wsproto), every read, write, pong and the close happen there and nowhere else.
Other threads hand it bytes (`WebSocketStream.send`: thread-safe, bounded) and get what arrives through callbacks
that run on that loop and must not block (the IPMI server posts them to its own thread; the web consoles to the
agent's loop). A pooled agent with a hundred consoles open has one thread for all of them and its watches, not
two per console.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import threading
from collections.abc import Callable
from typing import Any

from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from ..model import ConsoleUnavailable
from .hub import Hub, server_target

log = logging.getLogger("vbmc.console")

SUBPROTOCOL = "plain.kubevirt.io"
SERIAL, SCREEN = "console", "vnc"  # the VMI subresources
# vnc: without it a new connection ends the one already open (virt-handler's newStopChan); with it, virt-api refuses
# while another client holds the screen (pkg/virt-handler/rest/console.go VNCHandler). The BMC asks for it, so that
# it never takes the screen from someone's `virtctl vnc`: it attaches again once they are done.
PRESERVE_SESSION = {"preserveSession": "true"}
OUTBOX = 256 * 1024  # bytes handed to a connection and not yet taken by the API server; beyond, send() refuses
READ_SIZE = 64 * 1024
REJECT_BODY = 64 * 1024  # of a refused upgrade's body (a Status), kept for the error



class Refused(Exception):
    """The server answered the upgrade with an HTTP status (its body is usually a Kubernetes Status)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.body = body


class HandshakeFailed(Exception):
    """The connection went away or broke the protocol before the upgrade was answered."""


async def _handshake(host: str, port: int, tls: ssl.SSLContext | None, host_header: str, target: str,
                     subprotocol: str, headers: list[tuple[str, str]]) \
        -> tuple[asyncio.StreamReader, asyncio.StreamWriter, WSConnection, list[Any]]:
    reader, writer = await asyncio.open_connection(host, port, ssl=tls, server_hostname=host if tls else None,
                                                   limit=READ_SIZE)
    ws = WSConnection(ConnectionType.CLIENT)
    try:
        writer.write(ws.send(Request(host=host_header, target=target, subprotocols=[subprotocol],
                                     extra_headers=[(k.encode(), v.encode()) for k, v in headers])))
        status, body = 0, bytearray()
        while True:
            data = await reader.read(READ_SIZE)
            ws.receive_data(data or None)
            events = list(ws.events())
            for index, event in enumerate(events):
                if isinstance(event, AcceptConnection):
                    return reader, writer, ws, events[index + 1:]  # messages that came with the answer
                if isinstance(event, RejectConnection):
                    status = event.status_code
                    if not event.has_body:
                        raise Refused(status, b"")
                elif isinstance(event, RejectData):
                    body += event.data[:max(0, REJECT_BODY - len(body))]
                    if event.body_finished:
                        raise Refused(status, bytes(body))
            if not data:
                raise Refused(status, bytes(body)) if status else HandshakeFailed("the connection closed")
    except (RemoteProtocolError, LocalProtocolError) as exc:
        writer.close()
        raise HandshakeFailed(str(exc)) from None
    except BaseException:
        writer.close()
        raise


class WebSocketStream:
    """A connected console WebSocket, owned by the stream loop (hub.Hub): `output` gets what the server sends
    and `closed` is called once, with the reason, when the server ends the line (not after close()); both on the
    loop."""

    def __init__(self, owner: Hub, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 ws: WSConnection, output: Callable[[bytes], None], closed: Callable[[str], None], name: str) -> None:
        self._owner = owner
        self._reader, self._writer, self._ws = reader, writer, ws
        self._output, self._closed = output, closed
        self.name = name
        self._lock = threading.Lock()
        self._queued = 0  # bytes given to send() and not yet drained to the socket
        self._hung_up = False  # close() was called: no callback
        self._ended = False
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, early: list[Any]) -> None:
        """On the loop: deliver what came with the handshake's answer, then read and write."""
        self._events(early)
        if not self._ended:
            self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._write())]

    # ---- any thread

    def send(self, data: bytes) -> None:
        with self._lock:
            if self._hung_up or self._ended:
                raise ConsoleUnavailable("the console connection was closed")
            if self._queued + len(data) > OUTBOX:
                # The API server's connection does not take what is sent: lost, as on a stalled line.
                raise ConsoleUnavailable("the console connection is not keeping up")
            self._queued += len(data)
        self._owner.call(self._outbox.put_nowait, data)

    def close(self) -> None:
        with self._lock:
            if self._hung_up:
                return
            self._hung_up = True
        self._owner.call(self._end, "")

    # ---- the loop

    async def _read(self) -> None:
        reason = "the console closed"
        try:
            while not self._ended:
                data = await self._reader.read(READ_SIZE)
                self._ws.receive_data(data or None)
                self._events(list(self._ws.events()))
                if not data:
                    break
        except (OSError, ssl.SSLError, RemoteProtocolError, LocalProtocolError) as exc:
            reason = f"the console connection ended: {exc or type(exc).__name__}"
        except asyncio.CancelledError:
            return
        self._end(reason)

    def _events(self, events: list[Any]) -> None:
        for event in events:
            if isinstance(event, BytesMessage) and event.data:
                self._deliver(bytes(event.data))
            elif isinstance(event, TextMessage) and event.data:
                self._deliver(event.data.encode())
            elif isinstance(event, Ping):
                self._writer.write(self._ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                if self._ws.state is ConnectionState.REMOTE_CLOSING:
                    self._writer.write(self._ws.send(event.response()))
                why = f": {event.reason}" if event.reason else ""
                self._end(f"the console closed ({event.code}{why})")
                return

    def _deliver(self, data: bytes) -> None:
        if self._hung_up:
            return
        try:
            self._output(data)
        except Exception:  # a consumer's bug must not end the loop every console shares
            log.exception("console %s: output callback failed", self.name)

    async def _write(self) -> None:
        try:
            while True:
                data = await self._outbox.get()
                try:
                    self._writer.write(self._ws.send(BytesMessage(data=data)))
                    await self._writer.drain()
                finally:
                    with self._lock:
                        self._queued -= len(data)
        except asyncio.CancelledError:
            return
        except (OSError, ssl.SSLError, LocalProtocolError) as exc:
            self._end(f"the console connection ended: {exc or type(exc).__name__}")

    def _end(self, reason: str) -> None:
        if self._ended:
            return
        self._ended = True
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        with contextlib.suppress(OSError, LocalProtocolError, RuntimeError):
            if self._ws.state is ConnectionState.OPEN:
                self._writer.write(self._ws.send(CloseConnection(code=1000)))
            self._writer.close()  # flushes what is buffered, then closes
        with self._lock:
            tell = not self._hung_up
            self._hung_up = True
        if tell:
            try:
                self._closed(reason)
            except Exception:
                log.exception("console %s: closed callback failed", self.name)


def connect(server: str, path: str, query: dict[str, str] | None, tls: ssl.SSLContext | None,
            headers: list[tuple[str, str]], output: Callable[[bytes], None], closed: Callable[[str], None],
            name: str, timeout: float) -> WebSocketStream:
    """A console WebSocket to `path` on `server`, driven by the process's stream loop (hub.Hub). Blocks the
    caller (never the loop) until the upgrade is answered. Raises Refused with the server's answer, HandshakeFailed,
    OSError, ssl.SSLError or TimeoutError."""
    host, port, is_tls, host_header, target = server_target(server, path, query)
    owner = Hub.shared()

    async def open_stream() -> WebSocketStream:
        async with asyncio.timeout(timeout):
            reader, writer, ws, early = await _handshake(host, port, tls if is_tls else None, host_header, target,
                                                         SUBPROTOCOL, headers)
        stream = WebSocketStream(owner, reader, writer, ws, output, closed, name)
        stream.start(early)
        return stream

    return owner.wait(open_stream(), timeout + 1)
