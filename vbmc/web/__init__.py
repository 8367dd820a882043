"""The BMC in a browser: its page, and its consoles as WebSockets.

The page (`assets`: `/` and `/ui/...`) is a Redfish client of its own BMC, as OpenBMC's web UI is: it logs in with a
Redfish session, follows the EventService's SSE stream and calls the same resources any client calls. Besides
Redfish it uses only the consoles (`consoles`: `/consoles/serial` and `/consoles/screen`), which any WebSocket client
can use with a session token too (the System's SerialConsole.WebSocket.ConsoleURI says where).

`WebFront` is what vbmc/redfish/server.py's RedfishFront hands what is not Redfish: GETs of the page's files, and
every WebSocket. It imports `machine` (the consoles' hubs), `access` (throttle, audit) and `redfish` (sessions).
"""

from __future__ import annotations

from typing import Any

from . import assets
from .consoles import SCREEN_URI, SERIAL_URI, Consoles

__all__ = ["SCREEN_URI", "SERIAL_URI", "Consoles", "WebFront"]


class WebFront:
    """The page's files and the consoles of one BMC, in front of its Redfish app (an ASGI app for the websocket
    scopes, and `http` for the page's GETs; both on the event loop)."""

    def __init__(self, consoles: Consoles, *, require_tls: bool = False) -> None:
        self.consoles = consoles
        self.require_tls = require_tls

    def serves(self, scope: dict[str, Any]) -> bool:
        return scope["method"] in ("GET", "HEAD") and assets.serves(scope["path"])

    async def http(self, scope: dict[str, Any], send: Any) -> None:
        https_only = self.require_tls and scope.get("scheme") != "https"
        status, headers, body = assets.answer(scope["path"], scope["headers"], https_only)
        headers = [*headers, (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body,
                    "more_body": False})

    async def websocket(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.consoles(scope, receive, send)
