"""A loopback image server for virtual media tests (the agent checks an image before it inserts it)."""

from __future__ import annotations

import http.server
import ssl
import threading
from pathlib import Path
from typing import Any


class ImageServer:
    """A loopback image server, as the agent and kubesim's CDI may contact: HEAD states `size`; a ranged GET answers
    206 with the total (as CDI's probe and the agent's check read it); `/missing...` is 404; `/broken` states a size
    but fails every GET with a 500."""

    def __init__(self, size: int, tls: tuple[Path, Path] | None = None) -> None:
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                if self.path.startswith("/missing"):
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(outer.size))
                self.end_headers()

            def do_GET(self) -> None:
                if self.path.startswith(("/missing", "/broken")):
                    self.send_error(404 if self.path.startswith("/missing") else 500)
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes 0-0/{outer.size}")
                self.send_header("Content-Length", "1")
                self.end_headers()
                self.wfile.write(b"\0")

        self.size = size
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        scheme = "http"
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(tls[0]), str(tls[1]))
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.base = f"{scheme}://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
