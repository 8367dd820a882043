"""Serving the Redfish app: hypercorn's asyncio front and a small thread pool for the agent; werkzeug for tests.

Why this model. A BMC endpoint is reachable by anyone on the network, and a client that opens a connection and
then sends nothing, half a request line, or the first bytes of a TLS handshake must not take the threads that
serve real requests. gunicorn's gthread worker (which served the agent before) hands each new connection to a
worker thread that blocks reading it: two stalled connections took both threads, and every other request and the
health probes timed out until the stallers closed.

Here all network I/O runs on one asyncio event loop (hypercorn: h11 for HTTP/1.1, asyncio's TLS): a connection costs
some memory (70 to 120 KB measured, at most 512 connections open) and no thread until its request is complete.
The front (`RedfishFront`, an ASGI app):

- answers `/healthz` and `/readyz` on the event loop itself, so neither stalled clients nor slow backend calls
  holding every worker thread can keep the kubelet's probes from an answer;
- checks the request target, the header fields and the body size against limits, reads the whole body under a
  deadline (the body is at most 64 KiB: every Redfish request this service takes is a small JSON document), and
  only then gives the request to the Flask app on one of `threads` worker threads;
- renders every error it raises itself, and those h11 raises for malformed requests, as a Redfish error body.

Timeouts: the TLS handshake must finish within `header_timeout` seconds, and then the request line and headers
within `header_timeout` more (hypercorn's keep-alive timer runs from the connection's start, or the end of the
previous response, to the end of the headers: trickling bytes does not extend it); the body must arrive within
`body_timeout` seconds. A connection past any of these is closed (a late body gets 408 first).

Measured (bench/slow_clients.py, bench/agent.py; the figures are in docs/reference.md, "The Redfish server"):
with 200 stalled connections on each of the HTTP and HTTPS ports, gunicorn answered nothing, probes included,
while here a normal client's GET of the System kept a p99 under 5 ms (under 9 ms with 200 + 200 trickling), with
every stalled connection closed after 5 s. The price is per-request time: the event loop and the hop to a
worker thread take about 0.4 ms that gunicorn's threads did not (at 8 connections 1553 requests/s against 2079,
still 9.8x sushy-tools with a p99 of 8 ms). Against the alternatives: uvicorn has no header or handshake deadline
for a new connection (a stalled one stays open for good), and gunicorn's asgi worker none either; waitress reads
whole requests on its own loop but has no TLS. The agent is also one process instead of a master and a worker
(44.1 MB PSS on kubesim's VM, 52.8 MB before).

`Listeners` serve listening sockets on a running event loop (any number of fronts on one loop: the agent serves
every BMC of a pool on one); on SIGTERM the agent stops accepting, lets in-flight requests finish for
`graceful_timeout` seconds, then closes every connection (vbmc/agent/runtime.py): it exits within two seconds."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
import ssl
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from io import BytesIO
from typing import Any
from urllib.parse import unquote_to_bytes

from .errors import RedfishError
from .eventservice import SSE_ENVIRON

log = logging.getLogger("vbmc.redfish.server")

Probe = Callable[[], bool]  # True: 200 "ok"; False: 503 "not ready"
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

JSON_TYPE = b"application/json; charset=utf-8"
TLS_READ_BUFFER = 32 * 1024
# The largest WebSocket message a client may send (the consoles take keystrokes and RFB input events; vbmc/web
# sets smaller limits per console): past it the connection closes with 1009 and the rest of the message is read
# and dropped, never kept.
WEBSOCKET_MESSAGE = 64 * 1024
# A peer that takes nothing of what is written to it for this long (its receive window stays shut) is cut off: a
# client that never reads must not hold its connection, and what is queued for it, for good.
WRITE_DEADLINE = 30.0


@dataclass(frozen=True)
class Limits:
    """What one request may be. Each limit past which the front answers before the app sees anything."""

    target: int = 4096  # bytes of path and query (414 above)
    fields: int = 100  # header fields (431 above)
    field_bytes: int = 8190  # one header field, name and value (431 above)
    headers_bytes: int = 16 * 1024  # request line and all headers, h11's buffer (431 above)
    body: int = 64 * 1024  # bytes of body (413 above), as the Flask app's MAX_CONTENT_LENGTH
    queued: int = 64  # requests waiting for, or on, a worker thread (503 with Retry-After above)
    connections: int = 512  # open connections on all listeners; past it a new one is closed at once


@dataclass
class ServerConfig:
    http: str | None = "0.0.0.0:10080"  # "host:port"; None for HTTPS only
    https: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    threads: int = 2  # worker threads for the app; connections cost none
    header_timeout: float = 5.0  # TLS handshake, then request line and headers; also an idle keep-alive's life
    body_timeout: float = 10.0  # the whole body, once the headers are in
    graceful_timeout: float = 1.0  # SIGTERM: in-flight requests get this long
    limits: Limits = field(default_factory=Limits)

    def binds(self) -> tuple[list[str], list[str]]:
        """(TLS binds, plain binds)."""
        import os

        if not (self.http or self.https):
            raise ValueError("nothing to listen on: give an HTTP or an HTTPS address")
        if self.https and not (self.certfile and self.keyfile):
            raise ValueError("an HTTPS address needs a certificate and a key file")
        for path in (self.certfile, self.keyfile):
            if path and not os.path.exists(path):
                raise ValueError(f"{path} does not exist")
        return ([self.https] if self.https else []), ([self.http] if self.http else [])


# ---- the front: probes, limits, whole requests to the app


def error_body(status: int, key: str, *args: object, detail: str = "") -> bytes:
    return json.dumps(RedfishError(status, key, *args, detail=detail).body(), separators=(",", ":")).encode()


class _Gone(Exception):
    """The client closed the connection before its request was whole: nothing to answer."""


class _Refused(Exception):
    def __init__(self, status: int, detail: str, key: str = "GeneralError", *args: object,
                 headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
        super().__init__(detail)
        self.status = status
        self.body = error_body(status, key, *args, detail=detail)
        self.headers = list(headers)


class RedfishFront:
    """An ASGI app in front of a WSGI app: probes on the event loop, whole requests to worker threads."""

    def __init__(self, app: Any, *, probes: Mapping[str, Probe] | None = None, threads: int = 2,
                 body_timeout: float = 10.0, limits: Limits | None = None, web: Any = None,
                 arrived: Callable[[], None] | None = None, monitoring: Iterable[str] = ()) -> None:
        self.app = app
        # What the port serves besides Redfish (the agent's vbmc/web WebFront: the page and the consoles'
        # WebSockets), on the event loop; without it every WebSocket is refused.
        self.web = web
        self.probes = dict(probes or {})
        # Told of every request but a monitor's, when its head is whole and before its body is read (must not
        # block): the probes, `monitoring`'s paths (the app answers them, e.g. /metrics, but the kubelet and
        # Prometheus ask them on a clock, not a client), and a connection that sends nothing (a tcpSocket probe, a
        # port scan) never tell it, so that they cost the backend nothing (a silent cache is confirmed for clients).
        self.arrived = arrived
        self.monitoring = frozenset(monitoring)
        self.body_timeout = body_timeout
        self.limits = limits or Limits()
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="redfish")
        self.queued = 0  # touched on the event loop only

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        elif kind == "websocket":
            if self.web is not None:
                if self.arrived is not None:
                    self.arrived()
                await self.web.websocket(scope, receive, send)
            else:
                await send({"type": "websocket.close", "code": 1003})

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        probe = self.probes.get(scope["path"])
        if probe is not None and scope["method"] in ("GET", "HEAD"):
            ok = probe()
            await _respond(send, 200 if ok else 503, [(b"content-type", b"text/plain")],
                           b"ok\n" if ok else b"not ready\n")
            return
        if self.arrived is not None and scope["path"] not in self.monitoring:
            self.arrived()
        if self.web is not None and self.web.takes_body(scope):
            # The page's media upload (vbmc/web/upload.py): a body of any size, read by the web front as it comes.
            await self.web.stream(scope, receive, send)
            return
        if self.web is not None and self.web.serves(scope):
            await self.web.http(scope, send)
            return
        try:
            self._check_head(scope)
            body = await self._read_body(scope, receive)
            if self.queued >= self.limits.queued:
                raise _Refused(503, "", "ServiceTemporarilyUnavailable", 1, headers=[(b"retry-after", b"1")])
        except _Refused as refused:
            await _respond(send, refused.status, [(b"content-type", JSON_TYPE), *refused.headers], refused.body,
                           close=refused.status in (408, 413))
            return
        except _Gone:
            return
        environ = _environ(scope, body)
        self.queued += 1
        try:
            loop = asyncio.get_running_loop()
            status, headers, chunks = await loop.run_in_executor(self.executor, self._call_app, environ)
        finally:
            self.queued -= 1
        stream = environ.get(SSE_ENVIRON)
        if stream is not None:
            await self._stream(stream, status, headers, receive, send, scope["method"] == "HEAD")
            return
        await _respond(send, status, headers, b"".join(chunks), head=scope["method"] == "HEAD")

    async def _stream(self, stream: Any, status: int, headers: list[tuple[bytes, bytes]], receive: Receive,
                      send: Send, head: bool) -> None:
        """An SSE response (vbmc/redfish/eventservice.py's EventStream), written on the event loop: it takes no worker
        thread, and ends when the client goes away (http.disconnect) or the stream is closed."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        stream.set_waker(lambda: loop.call_soon_threadsafe(wake.set))

        async def gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(gone())
        try:
            headers = [h for h in headers if h[0].lower() != b"content-length"]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            if head:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            await send({"type": "http.response.body", "body": b": stream open\n\n", "more_body": True})
            while not stream.closed and not watcher.done():
                wake.clear()
                chunks = stream.drain()
                if chunks:
                    await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": True})
                    continue
                waiter = asyncio.ensure_future(wake.wait())
                done, _ = await asyncio.wait({waiter, watcher}, timeout=stream.keepalive,
                                             return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if not done:  # quiet for a while: a comment, so that proxies keep the connection open
                    await send({"type": "http.response.body", "body": b": keep-alive\n\n", "more_body": True})
            if not watcher.done():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            stream.close()

    def _check_head(self, scope: Scope) -> None:
        limits = self.limits
        if len(scope["raw_path"]) + len(scope["query_string"]) + 1 > limits.target:
            raise _Refused(414, f"The request target is longer than {limits.target} bytes.")
        headers = scope["headers"]
        if len(headers) > limits.fields:
            raise _Refused(431, f"The request has more than {limits.fields} header fields.")
        if any(len(name) + len(value) > limits.field_bytes for name, value in headers):
            raise _Refused(431, f"A header field of the request is longer than {limits.field_bytes} bytes.")
        for name, value in headers:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    raise _Refused(400, "The Content-Length header is not a number.") from None
                if length > limits.body:
                    raise _Refused(413, f"The request body is longer than {limits.body} bytes.")

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        body = bytearray()
        try:
            async with asyncio.timeout(self.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise _Gone
                    body += message.get("body", b"")
                    if len(body) > self.limits.body:
                        raise _Refused(413, f"The request body is longer than {self.limits.body} bytes.")
                    if not message.get("more_body", False):
                        return bytes(body)
        except TimeoutError:
            raise _Refused(408, f"The request body did not arrive within {self.body_timeout:g} seconds.") from None

    def _call_app(self, environ: dict[str, Any]) -> tuple[int, list[tuple[bytes, bytes]], list[bytes]]:
        """Run on a worker thread: the WSGI app, its whole answer collected (Redfish answers are small)."""
        started: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            started[:] = [status, headers]
            return lambda data: chunks.append(data)

        chunks: list[bytes] = []
        try:
            result = self.app(environ, start_response)
            if environ.get(SSE_ENVIRON) is not None:
                # An event stream: written by _stream on the event loop, not collected here. The iterable is
                # dropped without its close(), which would close the stream.
                status, headers = started
                return int(status.split(" ", 1)[0]), [
                    (name.encode("latin-1"), value.encode("latin-1")) for name, value in headers], []
            try:
                chunks.extend(result)
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()
            status, headers = started
            return int(status.split(" ", 1)[0]), [
                # Names as the app wrote them (`X-Auth-Token`, not `x-auth-token`): HTTP/1.1 does not care, but the
                # scripts that grep a login's headers for the token often do.
                (name.encode("latin-1"), value.encode("latin-1")) for name, value in headers], chunks
        except Exception:
            # The app renders its own errors; reaching this is a bug in it, and worth a traceback.
            log.exception("redfish: the app failed on %s %s", environ["REQUEST_METHOD"], environ["PATH_INFO"])
            return 500, [(b"content-type", JSON_TYPE)], [error_body(500, "GeneralError")]

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


async def _respond(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes, *,
                   head: bool = False, close: bool = False) -> None:
    headers = [h for h in headers if h[0].lower() != b"content-length"]
    if status not in (204, 304):  # RFC 9110 8.6: no Content-Length on a 204
        headers.append((b"content-length", str(len(body)).encode()))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if head else body, "more_body": False})


def _environ(scope: Scope, body: bytes) -> dict[str, Any]:
    """The WSGI environ (PEP 3333) of a complete request."""
    server = scope.get("server") or ("localhost", 80)
    client = scope.get("client") or ("", 0)
    environ: dict[str, Any] = {
        "REQUEST_METHOD": scope["method"],
        "SCRIPT_NAME": "",
        # PEP 3333: the path is the percent-decoded bytes, carried in a latin-1 str; never fails to decode.
        "PATH_INFO": unquote_to_bytes(scope["raw_path"]).decode("latin-1"),
        "QUERY_STRING": scope["query_string"].decode("latin-1"),
        "RAW_URI": scope["raw_path"].decode("latin-1"),
        "SERVER_NAME": str(server[0]),
        "SERVER_PORT": str(server[1]),
        "SERVER_PROTOCOL": f"HTTP/{scope['http_version']}",
        "REMOTE_ADDR": str(client[0]),
        "REMOTE_PORT": str(client[1]),
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": scope.get("scheme", "http"),
        "wsgi.input": BytesIO(body),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
        "wsgi.input_terminated": True,
    }
    for raw_name, raw_value in scope["headers"]:
        name = raw_name.decode("latin-1")
        if "_" in name:
            # X_Auth_Token would land where X-Auth-Token does: drop it, as gunicorn and nginx do.
            continue
        if name == "content-type":
            key = "CONTENT_TYPE"
        elif name in ("content-length", "transfer-encoding"):
            continue  # the body is whole: CONTENT_LENGTH above is its length
        else:
            key = "HTTP_" + name.upper().replace("-", "_")
        value = raw_value.decode("latin-1")
        environ[key] = f"{environ[key]},{value}" if key in environ else value
    return environ


# ---- below the app: HTTP/1.1 only, and h11's 400 and 431 as Redfish bodies


def _http1_with_redfish_errors() -> None:
    """HTTP/1.1 only (see `http1_only`), and Redfish error bodies below the app: h11 rejects a malformed request
    line or header block, or one larger than its buffer, before any app sees it, and hypercorn then answers with
    an empty body. Answer with a Redfish error body instead, and never with a 5xx: an unknown transfer coding
    (h11's 501) is the client's error too (400). hypercorn is pinned; tests/redfish/test_hostile_http.py checks both."""
    from hypercorn.protocol import h11 as hypercorn_h11

    if getattr(hypercorn_h11.H11Protocol, "_kubevbmc_errors", False):
        return
    h11 = hypercorn_h11.h11

    async def send_error_response(self: Any, status_code: int) -> None:
        status = 431 if status_code == 431 else 400
        detail = ("The request line and headers are larger than the service accepts." if status == 431 else
                  "The request is not valid HTTP/1.1.")
        body = error_body(status, "GeneralError", detail=detail)
        headers = [(b"content-type", JSON_TYPE), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close"), *self.config.response_headers("h11")]
        await self._send_h11_event(h11.Response(status_code=status, headers=headers))
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())

    async def http1_only(self: Any, event: Any) -> None:
        """No switch to HTTP/2 (`Upgrade: h2c`, or the prior-knowledge preface `PRI * HTTP/2.0`): every Redfish
        client speaks HTTP/1.1, and an HTTP/2 connection that opens no stream escapes the header deadline
        (hypercorn keeps it open), so a few hundred would hold every connection slot for good."""

    protocol: Any = hypercorn_h11.H11Protocol
    protocol._send_error_response = send_error_response
    protocol._check_protocol = http1_only
    protocol._kubevbmc_errors = True
    _websocket_handshakes_that_cannot_crash()
    _websocket_messages_that_stay_small()


def _websocket_handshakes_that_cannot_crash() -> None:
    """hypercorn reads a WebSocket upgrade's Connection, Sec-WebSocket-Protocol and Sec-WebSocket-Extensions as
    ASCII, and a byte above 127 in one ended the connection with no answer at all (found by the consoles' fuzz
    test). Such an upgrade is not valid: answer it as one (400)."""
    from hypercorn.protocol import ws_stream

    handshake: Any = ws_stream.Handshake
    if getattr(handshake, "_kubevbmc_ascii", False):
        return
    original = handshake.__init__
    lists = (b"connection", b"sec-websocket-protocol", b"sec-websocket-extensions")

    def init(self: Any, headers: list[tuple[bytes, bytes]], http_version: str) -> None:
        try:
            original(self, headers, http_version)
        except UnicodeDecodeError:
            original(self, [(n, v) for n, v in headers if n.lower() not in lists], http_version)
            self.key = None  # is_valid() is then False: 400

    handshake.__init__ = init
    handshake._kubevbmc_ascii = True


def _websocket_messages_that_stay_small() -> None:
    """hypercorn appends what comes of a WebSocket message to its buffer before it compares the buffer with
    websocket_max_message_size, and after closing with 1009 it went on reading the rest of the message into the same
    buffer: a 10 MB message held 10 MB until its connection ended (twenty took an agent from 66 to 218 MB). Here the
    rest of a refused message, and anything after it, is read and dropped: a connection holds at most one message of
    the limit (plus one read). A compressed message (permessage-deflate, which browsers offer) is inflated no
    further than the limit either: a few KiB of deflated zeros would otherwise become megabytes before any check."""
    from hypercorn.protocol import ws_stream
    from wsproto.connection import ConnectionState
    from wsproto.events import CloseConnection, Message, Ping

    stream: Any = ws_stream.WSStream
    if getattr(stream, "_kubevbmc_small", False):
        return

    async def handle_events(self: Any) -> None:
        for event in self.connection.events():
            if isinstance(event, Message):
                if getattr(self, "_kubevbmc_refused", False):
                    continue
                try:
                    self.buffer.extend(event)
                except ws_stream.FrameTooLargeError:
                    self.buffer.clear()
                    self._kubevbmc_refused = True
                    await self._send_wsproto_event(CloseConnection(
                        code=1009, reason=f"a message is at most {self.buffer.max_length} bytes"))
                    # The app is told at once (1009), not when the peer answers the close, if ever.
                    await self.app_put({"type": "websocket.disconnect", "code": 1009})
                    continue
                if event.message_finished:
                    await self.app_put(self.buffer.to_message())
                    self.buffer.clear()
            elif isinstance(event, Ping):
                await self._send_wsproto_event(event.response())
            elif isinstance(event, CloseConnection):
                if self.connection.state == ConnectionState.REMOTE_CLOSING:
                    await self._send_wsproto_event(event.response())
                elif self.connection.state == ConnectionState.OPEN:  # the peer broke the protocol: say how
                    await self._send_wsproto_event(CloseConnection(code=event.code, reason=event.reason))
                await self.send(ws_stream.StreamClosed(stream_id=self.stream_id))

    stream._handle_events = handle_events
    stream._kubevbmc_small = True
    module: Any = ws_stream  # the Handshake makes its PerMessageDeflate by this name
    module.PerMessageDeflate = _bounded_deflate()


def _bounded_deflate() -> type:
    """wsproto's permessage-deflate, inflating at most WEBSOCKET_MESSAGE bytes of one message: past it the message
    fails with 1009 (hypercorn's own check comes after inflating, too late)."""
    import zlib

    from wsproto.extensions import PerMessageDeflate
    from wsproto.frame_protocol import CloseReason

    class BoundedDeflate(PerMessageDeflate):
        limit = WEBSOCKET_MESSAGE
        _inflated = 0

        def frame_inbound_payload_data(self, proto: Any, data: bytes) -> bytes | CloseReason:
            if not self._inbound_compressed or not self._inbound_is_compressible:
                return data
            assert self._decompressor is not None
            try:
                inflated = self._decompressor.decompress(bytes(data), self.limit + 1 - self._inflated)
            except zlib.error:
                return CloseReason.INVALID_FRAME_PAYLOAD_DATA
            self._inflated += len(inflated)
            if self._inflated > self.limit or self._decompressor.unconsumed_tail:
                return CloseReason.MESSAGE_TOO_BIG
            return inflated

        def frame_inbound_complete(self, proto: Any, fin: bool) -> bytes | CloseReason | None:
            result = super().frame_inbound_complete(proto, fin)
            if fin:
                self._inflated = 0
            return result

    return BoundedDeflate


async def drained(writer: asyncio.StreamWriter, deadline: float = WRITE_DEADLINE) -> None:
    """Wait until what was written to `writer` drains (asyncio's drain()); a peer that takes nothing of it for
    `deadline` seconds is cut off (the connection aborted, ConnectionAbortedError). A slow reader is not: any
    progress starts the deadline again."""
    transport = writer.transport
    left = transport.get_write_buffer_size()
    while True:
        try:
            async with asyncio.timeout(deadline):  # not wait_for: in 3.11 it can swallow the caller's cancellation
                await writer.drain()
            return
        except TimeoutError:
            now = transport.get_write_buffer_size()
            if now >= left:
                transport.abort()
                raise ConnectionAbortedError(f"the peer took nothing for {deadline:.0f} s") from None
            left = now


@functools.cache
def _connection_server() -> Any:
    """hypercorn's TCPServer, with WRITE_DEADLINE on every write and on the close: hypercorn waited for drain() and
    for the socket to close without a deadline, so a peer that never reads (a WebSocket viewer that stopped, a client
    that sends a request and never reads the answer) kept its connection, and a slot of `Limits.connections`, for
    ever."""
    from hypercorn.asyncio.tcp_server import TCPServer
    from hypercorn.events import Closed, RawData

    class DeadlineTCPServer(TCPServer):
        async def protocol_send(self, event: Any) -> None:
            if not isinstance(event, RawData):
                await super().protocol_send(event)
                return
            async with self.send_lock:
                try:
                    self.writer.write(event.data)
                    await drained(self.writer)
                except (ConnectionError, RuntimeError):
                    await self.protocol.handle(Closed())

        async def _close(self) -> None:
            # A close waits for what is queued to go out (asyncio's transport.close()): for good, if nobody reads it.
            closing = asyncio.ensure_future(super()._close())
            transport = self.writer.transport
            left = transport.get_write_buffer_size()
            while not (await asyncio.wait({closing}, timeout=WRITE_DEADLINE))[0]:
                now = transport.get_write_buffer_size()
                if now >= left:
                    transport.abort()
                    break
                left = now
            await closing

    return DeadlineTCPServer


# ---- running it


def quiet_loop_errors(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """A peer that resets, sends garbage for a TLS handshake or times out ends its connection: one debug line,
    never a traceback in the agent's log."""
    exc = context.get("exception")
    if isinstance(exc, OSError | asyncio.CancelledError):
        log.debug("redfish: connection ended: %s", exc)
        return
    log.warning("redfish: %s: %r", context.get("message", "event loop error"), exc)


def hypercorn_config(config: ServerConfig) -> Any:
    from hypercorn.config import Config

    tls, plain = config.binds()
    hc = Config()
    hc.bind = tls or plain
    hc.insecure_bind = plain if tls else []
    if tls:
        hc.certfile, hc.keyfile = config.certfile, config.keyfile
        hc.alpn_protocols = ["http/1.1"]  # every Redfish client speaks HTTP/1.1; no HTTP/2 over TLS
    hc.ssl_handshake_timeout = config.header_timeout
    hc.keep_alive_timeout = config.header_timeout
    # A reading deadline long after any request's (the app's backend calls time out well within it): hypercorn
    # applies it to every read, also while the client waits for an answer.
    hc.read_timeout = int(config.body_timeout + 60)
    hc.h11_max_incomplete_size = config.limits.headers_bytes
    hc.wsgi_max_body_size = config.limits.body
    hc.graceful_timeout = config.graceful_timeout
    # The consoles' WebSockets (vbmc/web): a ping every 20 s keeps an idle console within read_timeout (the
    # browser's pong is a read) and finds a viewer that went away; a viewer's messages are keystrokes and RFB
    # input events, small.
    hc.websocket_ping_interval = 20.0
    hc.websocket_max_message_size = WEBSOCKET_MESSAGE
    # hypercorn's default of 100 drops the SYNs of a burst of connections: clients then wait 1 s, 3 s, 7 s... to
    # retry. The kernel caps it at net.core.somaxconn.
    hc.backlog = 1024
    hc.include_server_header = False
    hc.accesslog = None
    # hypercorn's own lines ("Running on ...") say what the agent's start line says already.
    errorlog = logging.getLogger("vbmc.redfish.hypercorn")
    errorlog.setLevel(logging.WARNING)
    hc.errorlog = errorlog
    return hc


class _Slots:
    """Open connections against a cap, shared by the listeners, and a share of it per client address: a client
    that opens connections and sends nothing (a port scan, a stuck tool) holds each for up to `header_timeout`
    seconds, and must not take them all from the others: one address holds half of them at most. Taken on accept
    (the event loop's thread), given back on close (the same thread: asyncio closes a transport's socket there)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.per_source = max(8, cap // 2)
        self.open = 0
        self._by_source: dict[str, int] = {}

    def take(self, source: str) -> bool:
        held = self._by_source.get(source, 0)
        if self.open >= self.cap or held >= self.per_source:
            return False
        self.open += 1
        self._by_source[source] = held + 1
        return True

    def give(self, source: str) -> None:
        self.open -= 1
        held = self._by_source.get(source, 0) - 1
        if held > 0:
            self._by_source[source] = held
        else:
            self._by_source.pop(source, None)


class _CountedSocket(socket.socket):
    slots: _Slots | None = None
    source = ""

    def close(self) -> None:
        slots, self.slots = self.slots, None
        if slots is not None:
            slots.give(self.source)
        super().close()


class _CappedListener(socket.socket):
    """A listening socket whose accept() closes a connection at once when `slots` are all taken: memory stays
    bounded (each connection costs tens of kilobytes, a TLS one more) however many a client opens."""

    slots: _Slots

    def accept(self) -> tuple[socket.socket, Any]:
        fd, address = self._accept()  # type: ignore[attr-defined]
        conn = _CountedSocket(self.family, self.type, self.proto, fileno=fd)
        source = str(address[0]) if isinstance(address, tuple) else ""
        if not self.slots.take(source):
            conn.close()
            log.debug("redfish: %d connections open (%d of them from one address at most), closed one from %s",
                      self.slots.cap, self.slots.per_source, address)
            raise ConnectionAbortedError  # asyncio's accept loop drops it and goes on
        conn.slots, conn.source = self.slots, source
        return conn, address


def bind_listener(host: str, port: int, slots: _Slots, backlog: int = 1024) -> socket.socket:
    """One listening TCP socket on (host, port) as listen() makes them (TCP_NODELAY, SO_REUSEADDR, capped by
    `slots`), for the pool agent's listeners. Raises OSError (port in use, address not local)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.setblocking(False)
        listener = _CappedListener(sock.family, sock.type, sock.proto, fileno=sock.detach())
    except BaseException:
        sock.close()
        raise
    listener.slots = slots
    listener.set_inheritable(False)
    listener.listen(backlog)
    return listener


def connection_slots(cap: int) -> _Slots:
    """A cap on open connections, for bind_listener (listeners given the same one share it)."""
    return _Slots(cap)


class Listeners:
    """Listening sockets served on the running event loop by hypercorn's connection handling (hypercorn's config:
    deadlines, limits, HTTP/1.1 only), each plain or with its own TLS context, for one front. Several share one
    event loop, and close() ends their connections too (the pool agent restarts one member's listeners while the
    others serve on)."""

    def __init__(self, front: RedfishFront, hc: Any, sockets: list[tuple[socket.socket, ssl.SSLContext | None]],
                 context: Any, state: dict[str, Any]) -> None:
        from hypercorn.utils import wrap_app

        self.front = front
        self._hc = hc
        self._sockets = sockets
        self._context = context  # hypercorn's WorkerContext: shared by every Listeners of a loop
        self._state = state
        self._app = wrap_app(front, hc.wsgi_max_body_size, "asgi")  # type: ignore[arg-type]
        self._servers: list[asyncio.AbstractServer] = []
        self._connections: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}

    async def start(self) -> None:
        _http1_with_redfish_errors()
        _small_tls_buffers()
        try:
            for sock, tls in self._sockets:
                # No word to the front's `arrived` on accept: the kubelet's probes connect every few seconds, and a
                # connection is a client only once it asks for something other than a probe (RedfishFront).
                self._servers.append(await asyncio.start_server(
                    self._connection, sock=sock, backlog=self._hc.backlog, ssl=tls,
                    ssl_handshake_timeout=self._hc.ssl_handshake_timeout if tls is not None else None))
        except BaseException:
            await self.close()
            raise

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        try:
            await _connection_server()(self._app, asyncio.get_running_loop(), self._hc, self._context, self._state,
                                       reader, writer)
        finally:
            self._connections.pop(task, None)

    @property
    def connections(self) -> int:
        return len(self._connections)

    def stop_accepting(self) -> None:
        for server in self._servers:
            server.close()

    async def close(self, grace: float = 0.5) -> None:
        """Stop listening and end every connection at once (in-flight requests included: the caller is
        replacing or removing what they talk to). The front is its owner's to close (it may serve other
        listeners)."""
        for server in self._servers:
            server.close()
        for sock, _ in self._sockets:
            sock.close()
        for writer in list(self._connections.values()):
            transport = writer.transport
            with contextlib.suppress(Exception):
                transport.abort()
        tasks = list(self._connections)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace)
            for task in pending:
                task.cancel()
        self._servers.clear()


def _small_tls_buffers() -> None:
    """asyncio gives every TLS connection a 256 KiB read buffer the moment it is accepted, before the handshake:
    200 clients that send five bytes of a ClientHello and wait cost 50 MB. A TLS record carries at most 16 KiB of
    plaintext, so 32 KiB reads as much per call as any record holds (measured with bench/slow_clients.py: the
    agent's PSS under 400 stalled connections fell from 110 MB to the figure in docs/reference.md)."""
    import asyncio.sslproto

    protocol: Any = asyncio.sslproto.SSLProtocol
    if getattr(protocol, "max_size", 0) > TLS_READ_BUFFER:
        protocol.max_size = TLS_READ_BUFFER


class BackgroundServer:
    """The agent's server (front, limits, timeouts, Listeners) for a WSGI app, on an event loop in a background
    thread: for tests and benchmarks that need the real server in their own process. The addresses are bound at
    once (`ports`, `tls_ports`)."""

    def __init__(self, app: Any, config: ServerConfig, *, probes: Mapping[str, Probe] | None = None,
                 web: Any = None) -> None:
        self.config = config
        self._hc = hypercorn_config(config)
        tls_binds, plain_binds = config.binds()
        slots = connection_slots(config.limits.connections)
        context = self._hc.create_ssl_context() if tls_binds else None
        self._sockets: list[tuple[socket.socket, ssl.SSLContext | None]] = []
        try:
            for bind, tls in [*((b, None) for b in plain_binds), *((b, context) for b in tls_binds)]:
                host, _, port = bind.rpartition(":")
                self._sockets.append((bind_listener(host.strip("[]") or "0.0.0.0", int(port), slots,
                                                    self._hc.backlog), tls))
        except BaseException:
            for sock, _ in self._sockets:
                sock.close()
            raise
        self.ports = [sock.getsockname()[1] for sock, tls in self._sockets if tls is None]
        self.tls_ports = [sock.getsockname()[1] for sock, tls in self._sockets if tls is not None]
        self.front = RedfishFront(app, probes=probes, threads=config.threads, body_timeout=config.body_timeout,
                                  limits=config.limits, web=web)
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="redfish-server", daemon=True)

    def _run(self) -> None:
        from hypercorn.asyncio.worker_context import WorkerContext

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._loop.set_exception_handler(quiet_loop_errors)
            self._stop = asyncio.Event()
            listeners = Listeners(self.front, self._hc, self._sockets, WorkerContext(None), {})
            await listeners.start()
            self._ready.set()
            try:
                await self._stop.wait()
            finally:
                await listeners.close()

        try:
            asyncio.run(main())
        except BaseException as exc:
            self._failed = exc
            self._ready.set()

    def start(self, timeout: float = 10) -> BackgroundServer:
        self._thread.start()
        if not self._ready.wait(timeout) or self._failed is not None:
            raise RuntimeError(f"the server did not start: {self._failed!r}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)
        for sock, _ in self._sockets:
            sock.close()
        self.front.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ThreadedServer:
    """The app on werkzeug's threaded server in a background thread: for tests and benchmarks, not the agent."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        from werkzeug.serving import make_server

        self._server = make_server(host, port, app, threaded=True, ssl_context=ssl_context)
        self.port = self._server.server_port
        scheme = "https" if ssl_context else "http"
        self.url = f"{scheme}://{host}:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="redfish-test-server",
                                        daemon=True)

    def start(self) -> ThreadedServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
