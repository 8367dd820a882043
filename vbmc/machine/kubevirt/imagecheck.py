"""Before a medium is inserted: is the image there, and how large is it?

One HEAD (falling back to a ranged GET of one byte when the server refuses HEAD or states no size), a short
timeout, no body downloaded. The answer sizes the import's claim (CDI writes the image into a PVC that must hold
it); a refusal (404, unreachable, an untrusted certificate, too large) is told to the client at once, in words, instead
of a DataVolume that fails minutes later out of its sight."""

from __future__ import annotations

import base64
import http.client
import math
import ssl
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit, urlunsplit

from ...access.audit import redact_url

TIMEOUT = 3.0
MAX_REDIRECTS = 5
MIB = 2**20
GIB = 2**30
# CDI's default filesystem overhead (CDIConfig filesystemOverhead.global): a Filesystem-mode claim holds 5.5% less.
FILESYSTEM_OVERHEAD = 0.055
HEADROOM = 1.05  # plus 5%, so that a server's rounding or a small growth does not fail the import
MIN_CLAIM = GIB
DEFAULT_CLAIM = 2 * GIB  # when the server states no size


class ImageProblem(Exception):
    """Why the image cannot be imported, in a sentence a client can act on."""


@dataclass(frozen=True)
class ImageInfo:
    size: int | None  # bytes; None when the server does not say


def check(url: str, ca_pem: str = "", timeout: float = TIMEOUT) -> ImageInfo:
    """HEAD the image (a ranged GET when HEAD tells nothing); raise ImageProblem when it cannot be imported."""
    shown = redact_url(url)
    for _ in range(MAX_REDIRECTS + 1):
        status, headers = _ask("HEAD", url, ca_pem, timeout, shown)
        if status in (301, 302, 303, 307, 308) and headers.get("location"):
            url = urljoin(url, headers["location"])
            continue
        if status in (405, 501) or (status == 200 and not headers.get("content-length")):
            status, headers = _ask("GET", url, ca_pem, timeout, shown, {"Range": "bytes=0-0"})
            if status in (301, 302, 303, 307, 308) and headers.get("location"):
                url = urljoin(url, headers["location"])
                continue
        if status >= 400:
            raise ImageProblem(f"the image server answered {status} for {shown}")
        return ImageInfo(_size(status, headers))
    raise ImageProblem(f"{shown} redirects more than {MAX_REDIRECTS} times")


def claim_size(info: ImageInfo, block: bool = False) -> int:
    """The storage request that holds the image: its size over the filesystem overhead (none in Block mode), plus
    headroom, in whole MiB; at least MIN_CLAIM; DEFAULT_CLAIM when the size is unknown."""
    if info.size is None:
        return DEFAULT_CLAIM
    need = info.size / (1.0 if block else 1 - FILESYSTEM_OVERHEAD) * HEADROOM
    return max(MIN_CLAIM, math.ceil(need / MIB) * MIB)


def quantity(size: int) -> str:
    return f"{size // GIB}Gi" if size % GIB == 0 else f"{math.ceil(size / MIB)}Mi"


def _size(status: int, headers: dict[str, str]) -> int | None:
    if status == 206:  # Content-Range: bytes 0-0/12345
        total = headers.get("content-range", "").rpartition("/")[2]
        return int(total) if total.isdigit() else None
    length = headers.get("content-length", "")
    return int(length) if length.isdigit() else None


def _ask(method: str, url: str, ca_pem: str, timeout: float, shown: str,
         extra: dict[str, str] | None = None) -> tuple[int, dict[str, str]]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ImageProblem(f"{shown} is not an http or https URL")
    if not url.isascii():  # http.client sends ASCII only (UnicodeEncodeError); a redirect's Location may be anything
        raise ImageProblem(f"{shown} contains a character that is not ASCII: percent-encode it (é is %C3%A9)")
    headers = {"User-Agent": "kubevbmc-agent", "Accept": "*/*", **(extra or {})}
    if parts.username is not None:
        user_pass = f"{parts.username}:{parts.password or ''}".encode()
        headers["Authorization"] = "Basic " + base64.b64encode(user_pass).decode()
    host = parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        context = ssl.create_default_context()
        if ca_pem:
            context.load_verify_locations(cadata=ca_pem)
        conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=context)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    path = urlunsplit(("", "", parts.path or "/", parts.query, ""))
    try:
        conn.request(method, path, headers=headers)
        response = conn.getresponse()
        response.read(1 if method == "GET" else 0)
        return response.status, {k.lower(): v for k, v in response.getheaders()}
    except ssl.SSLCertVerificationError as exc:
        raise ImageProblem(f"the image server's certificate is not trusted ({exc.verify_message}): give the "
                           "VirtualMachineBMC the CA in spec.redfish.virtualMedia.tls.caBundleConfigMapRef") from None
    except (OSError, http.client.HTTPException) as exc:
        raise ImageProblem(f"the image server for {shown} cannot be reached: {exc}") from None
    finally:
        conn.close()
