"""The page's files, served from the package on the event loop: `/` is the page, `/ui/...` its scripts, styles and
the third-party code it uses (vbmc/web/static/vendor/, each with its licence; vendor.json says where each file came
from). Nothing is fetched from elsewhere: the Content-Security-Policy allows the agent's own origin only.

Every answer carries the headers that keep the page to itself: the CSP (no inline script, no other origin, no
framing), nosniff, no referrer. Files are read once, on the first request for any of them, and answered with an
ETag (a page reloaded after an agent upgrade gets the new files; an unchanged one costs a 304).

Over plain HTTP, a BMC that serves HTTPS sends the page's requests there (`https_location`: 308 to the same host
and path); the Redfish API and the consoles keep their own plain-HTTP rules (vbmc/redfish/accounts.py,
vbmc/web/consoles.py).
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from importlib import resources

PAGE = "/"
PREFIX = "/ui/"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".mjs": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
                 ".png": "image/png", ".svg": "image/svg+xml", ".txt": "text/plain; charset=utf-8",
                 ".json": "application/json"}
# Scripts only from the agent, no inline script, nothing from elsewhere. 'self' in connect-src covers ws: and wss:
# to the same host (CSP Level 3). One relaxation: xterm.js (6.0) writes its cell sizes and colours into <style>
# elements it creates, which style-src-elem must allow ('unsafe-inline' there: CSS, never script; the page puts no
# markup of anyone's into the document, only text). Style attributes stay refused (style-src-attr falls back to
# style-src 'self'); xterm.js and noVNC set style properties from script, which CSP does not govern.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; style-src-elem 'self' 'unsafe-inline'; "
       "img-src 'self' data: blob:; font-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")
SECURITY_HEADERS = [(b"content-security-policy", CSP.encode()), (b"x-content-type-options", b"nosniff"),
                    (b"referrer-policy", b"no-referrer"), (b"x-frame-options", b"DENY"),
                    (b"cross-origin-opener-policy", b"same-origin")]
HTTPS_ONLY = (b"<!doctype html><html lang=en><meta charset=utf-8><title>KubeVBMC</title>"
              b"<p>This BMC takes credentials over HTTPS only (spec.redfish.requireTLS): open this address with "
              b"https://.</p></html>")

# The Service's HTTPS port (controller/desired.py maps it to the agent's): where a client that came through the
# Service's HTTP port goes for HTTPS.
SERVICE_HTTPS_PORT = 443
# A Host header as RFC 9110 7.2 has it, reduced to what names this BMC: a DNS name or IPv4 address, or a bracketed
# IPv6 address, and an optional port. Anything else is not echoed into a Location.
_HOST = re.compile(r"^(?P<name>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}))(?::(?P<port>[0-9]{1,5}))?$")


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: bytes


@functools.cache
def _files() -> dict[str, Asset]:
    root = resources.files("vbmc.web") / "static"
    found: dict[str, Asset] = {}

    def walk(node: resources.abc.Traversable, prefix: str) -> None:
        for child in node.iterdir():
            if child.is_dir():
                walk(child, f"{prefix}{child.name}/")
                continue
            suffix = "." + child.name.rsplit(".", 1)[-1] if "." in child.name else ""
            if child.name.startswith(".") or suffix not in CONTENT_TYPES:
                continue
            body = child.read_bytes()
            etag = b'"' + hashlib.sha256(body).hexdigest()[:20].encode() + b'"'
            found[prefix + child.name] = Asset(body, CONTENT_TYPES[suffix], etag)

    walk(root, "")
    return found


def find(path: str) -> Asset | None:
    """The asset at a request path, None for any other path."""
    if path == PAGE:
        return _files().get("index.html")
    if path.startswith(PREFIX) and ".." not in path:
        return _files().get(path[len(PREFIX):])
    return None


def serves(path: str) -> bool:
    return path == PAGE or path.startswith(PREFIX)


def https_location(host: str, local: tuple[str, int], target: str, https_port: int,
                   service_https_port: int = SERVICE_HTTPS_PORT) -> str | None:
    """Where a plain-HTTP request for the page goes instead: the same host and target (path and query) on HTTPS.

    `host` is the request's Host header, `local` the (address, port) of the listener it came to. A client that
    named the listener's own port reached the agent directly (its pod address, loopback, a port-forward of that
    port) and goes to the agent's HTTPS port, `https_port`; any other came through the Service (port 80) and goes to
    the Service's HTTPS port. None when the Host header is not a host name or address (nothing is echoed)."""
    if not host:
        host = f"[{local[0]}]" if ":" in local[0] else local[0]
        host = f"{host}:{local[1]}"
    found = _HOST.match(host)
    if found is None:
        return None
    port = int(found["port"]) if found["port"] else 80
    to = https_port if port == local[1] else service_https_port
    authority = found["name"] if to == 443 else f"{found['name']}:{to}"
    return f"https://{authority}{target}"


def redirect(location: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """308 (method and body kept, RFC 9110 15.4.9), not cached: a BMC whose HTTPS goes away must not stay
    redirected in a browser."""
    headers = [(b"location", location.encode()), (b"cache-control", b"no-store"),
               (b"content-type", b"text/plain; charset=utf-8"), *SECURITY_HEADERS]
    return 308, headers, b"This page is served over HTTPS.\n"


def answer(path: str, headers: list[tuple[bytes, bytes]], https_only: bool) -> tuple[int, list[tuple[bytes, bytes]],
                                                                                     bytes]:
    """(status, headers, body) for a GET of `path` (`https_only`: a plain-HTTP request to a BMC that takes
    credentials over HTTPS only, which gets no login form)."""
    if https_only:
        return 403, [(b"content-type", b"text/html; charset=utf-8"), *SECURITY_HEADERS], HTTPS_ONLY
    asset = find(path)
    if asset is None:
        return 404, [(b"content-type", b"text/plain; charset=utf-8"), *SECURITY_HEADERS], b"not found\n"
    common = [(b"etag", asset.etag), (b"cache-control", b"no-cache"), *SECURITY_HEADERS]
    if any(k.lower() == b"if-none-match" and asset.etag in v for k, v in headers):
        return 304, common, b""
    return 200, [(b"content-type", asset.content_type.encode()), *common], asset.body
