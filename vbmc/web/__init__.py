"""The BMC in a browser: its page, and its consoles as WebSockets.

The page (`assets`: `/` and `/ui/...`) is a Redfish client of its own BMC, as OpenBMC's web UI is: it logs in with a
Redfish session, follows the EventService's SSE stream and calls the same resources any client calls. Besides
Redfish it uses only the consoles (`consoles`: `/consoles/serial` and `/consoles/screen`), which any WebSocket client
can use with a session token too (the System's SerialConsole.WebSocket.ConsoleURI says where), and the upload of an
ISO from the operator's disk into a virtual media slot (`upload`: `POST /ui/media/<slot>/upload`, streamed on).

`WebFront` is what vbmc/redfish/server.py's RedfishFront hands what is not Redfish: GETs of the page's files, the
uploads' POSTs, and every WebSocket. It imports `machine` (the consoles' hubs, the uploads' Machine), `access`
(throttle, audit) and `redfish` (sessions, error bodies).

Over plain HTTP, while the BMC serves HTTPS, the page answers 308 to its HTTPS address (`assets.https_location`):
a login form is never offered where the password would cross the network in the clear, whether or not the BMC
requires TLS of its Redfish clients. The consoles and the Redfish API are not redirected (their plain-HTTP rules are
their own).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from typing import Any

from . import assets
from .consoles import SCREEN_URI, SERIAL_URI, Consoles
from .upload import MediaUploads

__all__ = ["SCREEN_URI", "SERIAL_URI", "Consoles", "MediaUploads", "WebFront"]


class WebFront:
    """The page's files and the consoles of one BMC, in front of its Redfish app (an ASGI app for the websocket
    scopes, and `http` for the page's GETs; both on the event loop)."""

    def __init__(self, consoles: Consoles, *, require_tls: bool = False,
                 https_port: Callable[[], int] | None = None, uploads: MediaUploads | None = None) -> None:
        """`https_port`: the port of the BMC's HTTPS listener while it is open, else 0 (then no redirect);
        `uploads`: the page's virtual media uploads (`upload`), None without them."""
        self.consoles = consoles
        self.uploads = uploads
        self.require_tls = require_tls
        self.https_port = https_port or (lambda: 0)

    def serves(self, scope: dict[str, Any]) -> bool:
        return scope["method"] in ("GET", "HEAD") and assets.serves(scope["path"])

    async def http(self, scope: dict[str, Any], send: Any) -> None:
        plain = scope.get("scheme") != "https"
        https_port = self.https_port() if plain else 0
        if https_port:
            status, headers, body = self._redirect(scope, https_port)
        else:
            status, headers, body = assets.answer(scope["path"], scope["headers"], self.require_tls and plain)
        headers = [*headers, (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body,
                    "more_body": False})

    @staticmethod
    def _redirect(scope: dict[str, Any], https_port: int) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        host = next((v for k, v in scope["headers"] if k.lower() == b"host"), b"").decode("latin-1")
        query = scope.get("query_string") or b""
        target = scope.get("raw_path") or scope["path"].encode()
        if query:
            target += b"?" + query
        # As received, but never a byte a Location header cannot carry (RFC 3986: percent-encoded).
        shown = urllib.parse.quote(target, safe="/?&=%:@!$'()*+,;~-._")
        server = scope.get("server") or ("", 0)
        location = assets.https_location(host, (server[0], server[1]), shown, https_port)
        if location is None:
            return 400, [(b"content-type", b"text/plain; charset=utf-8"), *assets.SECURITY_HEADERS], \
                b"The Host header does not name this BMC.\n"
        return assets.redirect(location)

    def takes_body(self, scope: dict[str, Any]) -> bool:
        """A request whose body this front reads itself as it arrives, whatever its size (a media upload)."""
        return self.uploads is not None and self.uploads.serves(scope)

    async def stream(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert self.uploads is not None
        await self.uploads(scope, receive, send)

    async def websocket(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.consoles(scope, receive, send)
