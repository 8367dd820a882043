"""Every watch of the process on one thread: the agent's watches (three per BMC, and a pool's Secret) as tasks of
one asyncio event loop (hub.py's `Hub`, which also drives the consoles' WebSockets: console.py), over plain HTTP/1.1
connections of their own.

A pool of 100 members used to run 300 watch threads, each blocked in a read for minutes; here they are 300
coroutines waiting on their sockets (bench/agent.py counts the threads). Nothing a reader does waits on this
loop: a watch's handler runs here and only updates its cache.

Each connection carries one request (`Connection: close`): a LIST or a WATCH, with the KubeClient's credentials of
the moment (a rotated token, a new CA for new connections; a 401 with a token from a file is retried once with the
file read again, as KubeClient.request does). TCP keepalive probes every few seconds make the kernel notice a
connection whose peer is gone without a reset (a NAT or load balancer that forgot it, a node that vanished) within
KEEPALIVE_BOUND seconds, at no cost to the API server: such a watch fails, and its cache stops being served (see
watch.py, which also covers an API server that still answers TCP but nothing else).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
from collections.abc import AsyncIterator
from typing import Any

from .client import KubeClient, KubeError, Unreachable
from .hub import server_target

Obj = dict[str, Any]

KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 3, 2, 2  # seconds, seconds, probes
KEEPALIVE_BOUND = KEEPALIVE_IDLE + KEEPALIVE_INTERVAL * KEEPALIVE_COUNT  # a dead peer noticed within this
MAX_LINE = 16 * 2**20  # one watch event (a VM's JSON) is far smaller; a bigger line is a broken stream


class Response:
    """An answer being read: status, headers, then its body as a whole or as lines."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int,
                 headers: dict[str, str]) -> None:
        self.reader, self.writer, self.status, self.headers = reader, writer, status, headers

    async def chunks(self, read_timeout: float) -> AsyncIterator[bytes]:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = await asyncio.wait_for(self.reader.readline(), read_timeout)
                if not size_line:
                    raise Unreachable("the API server closed the stream mid-chunk")
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    return
                data = await asyncio.wait_for(self.reader.readexactly(size + 2), read_timeout)
                yield data[:-2]
        elif "content-length" in self.headers:
            yield await asyncio.wait_for(self.reader.readexactly(int(self.headers["content-length"])), read_timeout)
        else:
            while data := await asyncio.wait_for(self.reader.read(65536), read_timeout):
                yield data

    async def body(self, read_timeout: float) -> bytes:
        return b"".join([chunk async for chunk in self.chunks(read_timeout)])

    async def lines(self, read_timeout: float) -> AsyncIterator[Obj]:
        buffer = b""
        async for chunk in self.chunks(read_timeout):
            *lines, buffer = (buffer + chunk).split(b"\n")
            if len(buffer) > MAX_LINE:
                raise Unreachable("a watch event larger than 16 MiB")
            for line in lines:
                if line.strip():
                    yield json.loads(line)

    def close(self) -> None:
        """At once: a stream to end early may be one that stalled, whose TLS goodbye would never be answered."""
        self.writer.transport.abort()


async def _connect(client: KubeClient, path: str, query: dict[str, str], timeout: float,
                   headers: dict[str, str]) -> Response:
    host, port, tls, host_header, target = server_target(client.creds.server, path, query)
    context: ssl.SSLContext | None = client.tls_context() if tls else None
    reader, writer = await asyncio.wait_for(asyncio.open_connection(
        host, port, ssl=context, server_hostname=host if tls else None, limit=MAX_LINE), timeout)
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, seconds in (("TCP_KEEPIDLE", KEEPALIVE_IDLE), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                                ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), seconds)
    try:
        head = [f"GET {target} HTTP/1.1", f"Host: {host_header}", "Connection: close",
                *(f"{k}: {v}" for k, v in headers.items())]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        status_line = await asyncio.wait_for(reader.readline(), timeout)
        parts = status_line.decode("latin-1").split(" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            raise Unreachable(f"GET {path}: not an HTTP answer: {status_line[:80]!r}")
        fields: dict[str, str] = {}
        while (line := await asyncio.wait_for(reader.readline(), timeout)) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            fields[name.strip().lower()] = value.strip()
        return Response(reader, writer, int(parts[1]), fields)
    except BaseException:
        writer.transport.abort()
        raise


async def open_request(client: KubeClient, path: str, query: dict[str, str], timeout: float) -> Response:
    """A GET whose status and headers have arrived; a 401 answered with a token from a file is retried once with
    the file read again. Raises Unreachable when the API server cannot be reached or answers nothing."""
    sent = client.auth_headers()
    try:
        response = await _connect(client, path, query, timeout, sent)
        if response.status == 401:
            retry = client.reauthorized(sent)
            if retry is not None:
                response.close()
                response = await _connect(client, path, query, timeout, retry)
    except (TimeoutError, OSError, ssl.SSLError, asyncio.IncompleteReadError, ValueError) as exc:
        raise Unreachable(f"GET {path}: {exc or type(exc).__name__}") from exc
    return response


async def raise_for_status(response: Response, path: str, timeout: float) -> None:
    if response.status < 400:
        return
    with contextlib.suppress(Exception):
        body = await response.body(timeout)
    try:
        status = json.loads(body)
    except (ValueError, UnboundLocalError):
        status = {}
    status = status if isinstance(status, dict) else {}
    response.close()
    raise KubeError(response.status, str(status.get("reason") or ""), str(status.get("message") or path), status)


async def get_json(client: KubeClient, path: str, query: dict[str, str], timeout: float) -> Any:
    """One GET (a LIST) on a connection of its own; its decoded JSON answer."""
    response = await open_request(client, path, query, timeout)
    try:
        await raise_for_status(response, path, timeout)
        try:
            return json.loads(await response.body(timeout))
        except (TimeoutError, OSError, ssl.SSLError, asyncio.IncompleteReadError, ValueError) as exc:
            raise Unreachable(f"GET {path}: {exc or type(exc).__name__}") from exc
    finally:
        response.close()


async def watch_events(client: KubeClient, path: str, query: dict[str, str], read_timeout: float,
                       opened: Any = None) -> AsyncIterator[Obj]:
    """The events of one watch request, until the server ends it; `opened(response)` gets the open response (to
    close it from elsewhere). Raises Unreachable or KubeError."""
    response = await open_request(client, path, {**query, "watch": "true"}, client.timeout)
    try:
        await raise_for_status(response, path, client.timeout)
        if opened is not None:
            opened(response)
        try:
            async for event in response.lines(read_timeout):
                yield event
        except (TimeoutError, OSError, ssl.SSLError, asyncio.IncompleteReadError, ValueError) as exc:
            raise Unreachable(f"watch {path}: {exc or type(exc).__name__}") from exc
    finally:
        response.close()
