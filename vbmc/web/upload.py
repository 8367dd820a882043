"""Virtual media from the operator's disk: the page streams a local ISO into a slot, which the VM then has as its CD.

`POST /ui/media/<slot>/upload?name=<file name>` on the page's own origin, with `X-Auth-Token: <Redfish session
token>`, `Content-Type: application/octet-stream` and `Content-Length`; the body is the file's bytes, as the browser
sends a File with XMLHttpRequest. The request needs what InsertMedia needs (a live session: this BMC's one account
has every privilege); a browser's Origin, when sent, must be this BMC's.

The body goes on as it arrives, CHUNK bytes at a time (one chunk being sent while the next is read), to the Machine's
upload (vbmc/machine/kubevirt: CDI's upload proxy, into a DataVolume made as InsertMedia makes one): the agent's
memory holds about two chunks whatever the file's size. Before anything is created, the first bytes must be an ISO
9660 image ("CD001" at byte 32769, the volume descriptor of sector 16; UDF bridge and El Torito images have it too).

Answers, each refusal with the Redfish error body the Redfish service gives for the same condition (vbmc/redfish/
errors.py: a Base registry MessageId; `error.message` is the registry's text and why, which the page shows):
- 201 `{"Image": "upload:<file name>", "Inserted": true}` once the medium is in the VM (the file name percent-encoded
  in Image, as in a URI); Redfish's VirtualMedia then shows it (ConnectedVia Applet, TransferMethod Upload).
- 400 no `name`; 401 no session (or not a live one); 403 not over HTTPS when the BMC requires it, or a page of
  another origin; 404 no such slot; 409 a medium is in ("eject it first") or being uploaded; 411 no Content-Length
  (or a chunked body); 413 larger than the agent's --media-max-size; 415 not an ISO 9660 image, or a Content-Type
  that is no file's bytes; 429 a source locked out by failed logins; 400 ActionNotSupported for a slot without a
  drive; 502 CDI refused or failed the upload; 503 CDI cannot be reached (Retry-After).
- A client that goes away midway (the page's Cancel aborts the request), or sends nothing for STALL seconds, ends
  the upload: what it created is removed and the slot is as it was. An eject during the upload ends it too.
Every upload, refused or not, is one audit line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qs

from ..access import audit
from ..access.throttle import LoginThrottle
from ..machine import (
    BackendUnavailable,
    ImageUnusable,
    InvalidRequest,
    Machine,
    MachineError,
    MediaUpload,
    Unsupported,
)
from ..redfish.errors import RedfishError
from ..redfish.sessions import SessionStore
from .consoles import same_origin

log = logging.getLogger("vbmc.web")
T = TypeVar("T")

UPLOAD_PATH = re.compile(r"^/ui/media/(?P<slot>[A-Za-z0-9_-]{1,32})/upload$")
CHUNK = 1 << 20  # bytes handed to the Machine at a time
ISO_MAGIC, ISO_MAGIC_AT = b"CD001", 32769  # ECMA-119 8.1: the standard identifier of sector 16's volume descriptor
HEAD = ISO_MAGIC_AT + len(ISO_MAGIC)  # bytes read before anything is created
STALL = 60.0  # seconds without a byte from the client before the upload is given up
LINGER, LINGER_BYTES = 2.0, 16 << 20  # after an early refusal: read on this long, so the client sees the answer
MAX_NAME = 255
# What a browser sends as a File's type, or the page's explicit octet-stream; a form or text is not a file's bytes.
FILE_TYPES = ("", "application/octet-stream", "application/x-iso9660-image", "application/x-cd-image",
              "application/vnd.efi.iso")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class Refusal:
    status: int
    text: str  # why: the detail after the registry's text in error.message, and the audit line's
    key: str = "GeneralError"  # the Base registry MessageId's key
    args: tuple[object, ...] = ()
    headers: tuple[tuple[bytes, bytes], ...] = ()

    def error(self) -> RedfishError:
        return RedfishError(self.status, self.key, *self.args, detail=self.text)

    def body(self) -> bytes:
        """The answer's body, as the Redfish service renders a RedfishError (vbmc/redfish/app.py)."""
        return json.dumps(self.error().body(), separators=(",", ":")).encode()


@dataclass(frozen=True)
class Caller:
    """An upload request that may go on to its session: the slot and the token it offers."""

    slot: str
    token: str


@dataclass(frozen=True)
class Upload:
    """What is to be uploaded: the file's name and size."""

    name: str
    size: int


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def is_iso9660(head: bytes) -> bool:
    """Whether an image's first bytes are an ISO 9660 file system's (a pure function)."""
    return head[ISO_MAGIC_AT:HEAD] == ISO_MAGIC


def caller(path: str, scheme: str, headers: Iterable[tuple[bytes, bytes]], require_tls: bool) -> Caller | Refusal:
    """Who asks to upload where, before any session is looked at (a pure function)."""
    match = UPLOAD_PATH.match(path)
    if match is None:
        return Refusal(404, f"Nothing to upload to at {path[:200]}.", "ResourceMissingAtURI", (path[:200],))
    headers = list(headers)
    if require_tls and scheme != "https":
        return Refusal(403, "This BMC accepts credentials over HTTPS only (spec.redfish.requireTLS): upload over "
                            "https://.")
    if not same_origin(_header(headers, b"origin"), scheme, _header(headers, b"host")):
        return Refusal(403, "The page that sent this upload is not this BMC's (Origin).")
    token = _header(headers, b"x-auth-token") or ""
    if not token:
        return Refusal(401, "No Redfish session: send the session's token as X-Auth-Token.", "NoValidSession")
    return Caller(match.group("slot"), token)


def upload_of(query: bytes, headers: Iterable[tuple[bytes, bytes]], max_size: int) -> Upload | Refusal:
    """The file to upload, from the query (`name`) and the headers, or why not (a pure function)."""
    headers = list(headers)
    names = parse_qs(query.decode("latin-1"), keep_blank_values=True).get("name") or [""]
    name = names[-1].rsplit("/", 1)[-1].rsplit("\\", 1)[-1].strip()
    if not name:
        return Refusal(400, "Say which file this is: ?name=<file name>.", "QueryParameterValueFormatError",
                       ("", "name"))
    if len(name) > MAX_NAME or any(c < " " or c == "\x7f" for c in name):
        return Refusal(400, f"The file name is longer than {MAX_NAME} characters or has control characters.",
                       "QueryParameterValueFormatError", (name[:MAX_NAME], "name"))
    media_type = (_header(headers, b"content-type") or "").split(";", 1)[0].strip().lower()
    if media_type not in FILE_TYPES:
        return Refusal(415, f"{name}: send the file's bytes as application/octet-stream, not {media_type}.",
                       "HeaderInvalid", (f"Content-Type: {media_type}",))
    length = _header(headers, b"content-length")
    if length is None or (_header(headers, b"transfer-encoding") or "").lower() not in ("", "identity"):
        return Refusal(411, f"{name}: the upload needs a Content-Length (the file's size).")
    if not length.strip().isdigit():
        return Refusal(400, "The Content-Length header is not a number.", "HeaderInvalid", ("Content-Length",))
    size = int(length)
    if size > max_size:
        return Refusal(413, f"{name} is {size / 2**30:.1f} GiB, more than this BMC takes "
                            f"({max_size / 2**30:.0f} GiB, the agent's --media-max-size).")
    if size < HEAD:
        return Refusal(415, f"{name} is not an ISO 9660 image: {size} bytes is too small to be one.")
    return Upload(name, size)


class _Gone(Exception):
    """The client went away, or stopped sending, before the whole body was in."""


class MediaUploads:
    """The upload endpoint of one BMC (see the module's docstring): an ASGI app for its POSTs, on the event loop, the
    Machine's blocking calls on threads of its own."""

    def __init__(self, machine: Machine, store: SessionStore, throttle: LoginThrottle, vm: str, *,
                 require_tls: bool = False, stall: float = STALL) -> None:
        self.machine = machine
        self.store = store
        self.throttle = throttle
        self.vm = vm
        self.require_tls = require_tls
        self.stall = stall
        # Machine calls block (the API server, the upload proxy): never on the event loop, never on the Redfish
        # workers. One upload at a time per slot, so two threads are plenty.
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"upload-{vm}")

    def serves(self, scope: Scope) -> bool:
        return scope["method"] == "POST" and UPLOAD_PATH.match(scope["path"]) is not None

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        source = str((scope.get("client") or ("", 0))[0])
        actor = audit.Actor("web", source)
        action = "upload virtual media"
        started = time.monotonic()
        decided = caller(scope["path"], scope.get("scheme", "http"), scope["headers"], self.require_tls)
        if isinstance(decided, Refusal):
            return await self._refuse(send, receive, decided, action, actor)
        wait = self.throttle.retry_after(source)
        if wait > 0:
            self.throttle.refused("web-upload")
            seconds = max(1, math.ceil(wait))
            # As the Redfish service's lockout (Service.refuse_if_throttled).
            return await self._refuse(send, receive, Refusal(429, "Too many failed logins from this address.",
                                                             "ServiceTemporarilyUnavailable", (seconds,),
                                                             ((b"retry-after", str(seconds).encode()),)),
                                      action, actor)
        session = self.store.authenticate(decided.token)
        if session is None:
            return await self._refuse(send, receive, Refusal(401, "No live Redfish session for this token.",
                                                             "NoValidSession"), action, actor)
        actor = audit.Actor("web", source, session.username, session.id)
        if decided.slot not in self.machine.media_slots():
            path = scope["path"]
            return await self._refuse(send, receive, Refusal(404, f"This BMC has no virtual media slot "
                                                                  f"{decided.slot}.", "ResourceMissingAtURI",
                                                             (path,)), action, actor)
        wanted = upload_of(scope.get("query_string") or b"", scope["headers"], self.machine.media_max_size)
        if isinstance(wanted, Refusal):
            return await self._refuse(send, receive, wanted, action, actor)
        action = f"upload {wanted.name} into {decided.slot}"
        try:
            result = await self._upload(decided.slot, wanted, receive, actor)
        except _Gone as gone:
            audit.record(action, self.vm, f"cancelled: {gone}", time.monotonic() - started, actor=actor,
                         level=logging.WARNING, trail=self.machine.audit_trail)
            return
        if isinstance(result, Refusal):
            return await self._refuse(send, receive, result, action, actor, time.monotonic() - started)
        audit.record(action, self.vm, f"inserted ({wanted.size} bytes)", time.monotonic() - started, actor=actor,
                     trail=self.machine.audit_trail)
        body = json.dumps({"Image": result, "Inserted": True}).encode()
        await send({"type": "http.response.start", "status": 201,
                    "headers": [(b"content-type", b"application/json; charset=utf-8"),
                                (b"content-length", str(len(body)).encode()), (b"cache-control", b"no-store")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _upload(self, slot: str, wanted: Upload, receive: Receive, actor: audit.Actor) -> str | Refusal:
        """The body, checked then streamed into the Machine's upload; the Image inserted, or a refusal."""
        head = await self._read(receive, HEAD)
        if not is_iso9660(bytes(head[:HEAD])):
            return Refusal(415, f"{wanted.name} is not an ISO 9660 image (no CD001 at byte {ISO_MAGIC_AT}): only "
                                "CD and DVD images can be inserted.")
        try:
            upload = await self._in_thread(actor, self.machine.upload_media, slot, wanted.name, wanted.size)
        except MachineError as exc:
            return refusal_for(exc, wanted.name)
        try:
            await self._stream(upload, head, wanted.size, receive, actor)
            media = await self._in_thread(actor, upload.finish)
        except _Gone:
            await self._in_thread(actor, upload.abort)
            raise
        except MachineError as exc:
            await self._in_thread(actor, upload.abort)
            return refusal_for(exc, wanted.name)
        except BaseException:
            await asyncio.shield(self._in_thread(actor, upload.abort))
            raise
        return media.image

    async def _stream(self, upload: MediaUpload, head: bytearray, size: int, receive: Receive,
                      actor: audit.Actor) -> None:
        """The whole body to `upload`: one chunk written (on a thread) while the next is read."""
        pending: asyncio.Future[None] | None = None
        buffer, received = head, len(head)
        try:
            while True:
                more = received < size
                if len(buffer) >= CHUNK or not more:
                    if pending is not None:
                        await pending
                    # Handed over as it is (never changed again): a new buffer takes the next chunk.
                    pending = asyncio.ensure_future(self._in_thread(actor, upload.write, buffer))
                    buffer = bytearray()
                if not more:
                    break
                piece = await self._next(receive)
                received += len(piece)
                buffer += piece
            if pending is not None:
                await pending
                pending = None
        finally:
            if pending is not None:
                # The client went away (or the Machine refused) while a write was under way: let it end first.
                with contextlib.suppress(Exception):
                    await asyncio.shield(pending)

    async def _read(self, receive: Receive, at_least: int) -> bytearray:
        data = bytearray()
        while len(data) < at_least:
            data += await self._next(receive)
        return data

    async def _next(self, receive: Receive) -> bytes:
        """The next piece of the body (b"" never: the end of the body before Content-Length is a client gone)."""
        try:
            async with asyncio.timeout(self.stall):  # no task per piece, as wait_for would make
                message = await receive()
        except TimeoutError:
            raise _Gone(f"no byte for {self.stall:.0f} s") from None
        if message["type"] == "http.disconnect":
            raise _Gone("the client went away")
        piece: bytes = message.get("body", b"")
        if not piece and not message.get("more_body", False):
            raise _Gone("the body ended before its Content-Length")
        return piece

    def _in_thread(self, actor: audit.Actor, call: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        def run() -> T:
            audit.bind(actor)  # the Machine's Events name who did it
            return call(*args)

        return asyncio.get_running_loop().run_in_executor(self.executor, run)

    async def _refuse(self, send: Send, receive: Receive, refusal: Refusal, action: str, actor: audit.Actor,
                      took: float = 0.0) -> None:
        audit.record(action, self.vm, f"refused {refusal.status}: {refusal.text}", took, actor=actor,
                     level=logging.WARNING, trail=self.machine.audit_trail)
        body = refusal.body()
        await send({"type": "http.response.start", "status": refusal.status,
                    "headers": [(b"content-type", b"application/json; charset=utf-8"),
                                (b"content-length", str(len(body)).encode()), (b"connection", b"close"),
                                (b"cache-control", b"no-store"), *refusal.headers]})
        # The whole answer goes out now; its end (which closes the connection) only after reading on for a moment.
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await self._linger(receive)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _linger(self, receive: Receive) -> None:
        """Read on (and drop) what the client still sends, briefly: closing a connection with unread bytes resets it,
        and a client that is still sending the file (a browser sends it all before it reads the answer) would then
        get the reset instead of the answer."""
        deadline = time.monotonic() + LINGER
        drained = 0
        with contextlib.suppress(TimeoutError):
            while drained < LINGER_BYTES:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                message = await asyncio.wait_for(receive(), left)
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    return
                drained += len(message.get("body", b""))


def refusal_for(exc: MachineError, name: str) -> Refusal:
    """A Machine's refusal as the upload's answer."""
    text = str(exc)
    if isinstance(exc, Unsupported):
        return Refusal(400, text, "ActionNotSupported", ("VirtualMedia.InsertMedia",))
    if isinstance(exc, ImageUnusable):
        return Refusal(413, text)
    if isinstance(exc, InvalidRequest):
        return Refusal(409, text, "ResourceInUse")
    if isinstance(exc, BackendUnavailable):
        return Refusal(503, text, "ServiceTemporarilyUnavailable", (exc.retry_after,),
                       ((b"retry-after", str(exc.retry_after).encode()),))
    return Refusal(502, f"The upload of {name} into the cluster failed: {text}")
