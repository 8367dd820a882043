"""CDI's upload from the agent's side: where the upload proxy is, an upload token for one claim, and one upload
streamed to the proxy as its bytes arrive (what `virtctl image-upload` does, pkg/virtctl/imageupload).

Where the proxy is, first found first:
- the agent's --cdi-upload-proxy (a URL, or a host[:port] taken as https) and --cdi-upload-proxy-ca (a PEM file);
- the CDIConfig `config`: `status.uploadProxyURL` (CDI writes there the host of an Ingress or Route of the proxy, or
  spec.uploadProxyURLOverride; a host without scheme is https) and `status.uploadProxyCA` (the CA that verifies
  it). The CDIConfig is cluster-scoped: an agent whose namespaced Role cannot read it (403) goes on to
- CDI's Service, `https://cdi-uploadproxy.cdi.svc` (port 443 to the proxy's 8443).
Without a CA from the first two, the proxy's certificate is verified against the system's CAs and the cluster's (the
kubeconfig's or the service account's). CDI's own proxy certificate is signed by CDI's `cdi-uploadproxy-signer`, whose
bundle is the ConfigMap `cdi-uploadproxy-signer-bundle` (key `ca-bundle.crt`) in CDI's namespace: an agent that goes
to the Service needs that bundle as --cdi-upload-proxy-ca.

The upload is CDI's synchronous one (`POST /v1beta1/upload`, `Authorization: Bearer <token>`, a Content-Length): the
proxy answers 200 once the image is written into the claim. Memory: nothing is buffered here, each write goes to the
socket as it comes.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

from .client import KubeClient, KubeError, Unreachable

CDI_CONFIG = "/apis/cdi.kubevirt.io/v1beta1/cdiconfigs/config"
TOKEN_REQUESTS = "/apis/upload.cdi.kubevirt.io/v1beta1/namespaces/{namespace}/uploadtokenrequests"
DEFAULT_PROXY = "https://cdi-uploadproxy.cdi.svc"
UPLOAD_PATH = "/v1beta1/upload"  # CDI's synchronous upload: answered once the image is in the claim
CONNECT_TIMEOUT = 10.0
SEND_TIMEOUT = 60.0  # one write to the proxy (it reads as fast as it writes into the claim)
ANSWER_TIMEOUT = 600.0  # the proxy's answer after the last byte (CDI validates and, for qcow2, converts first)


class UploadError(Exception):
    """CDI refused or failed the upload; the message says why, in words."""


class ProxyUnreachable(UploadError):
    """The upload proxy could not be reached (or stopped answering): worth trying again later."""


@dataclass(frozen=True)
class ProxySettings:
    """The agent's flags: where the upload proxy is and what CA verifies it ("": found as the module says)."""

    url: str = ""
    ca_file: str = ""


@dataclass(frozen=True)
class Proxy:
    url: str  # scheme://host[:port][/prefix]
    ca_pem: str  # "" : the system's CAs only


def proxy_url(given: str) -> str:
    """A proxy address as CDI publishes one (`host[:port]`, as virtctl takes it: https) or a URL, as a URL."""
    given = given.strip().rstrip("/")
    return given if "://" in given else f"https://{given}"


def find_proxy(client: KubeClient, settings: ProxySettings) -> Proxy:
    """Where the upload proxy is and the CA that verifies it (see the module's docstring)."""
    url = settings.url
    ca = ""
    if settings.ca_file:
        with open(settings.ca_file, encoding="utf-8") as fh:
            ca = fh.read()
    if not url:
        try:
            config = client.request("GET", CDI_CONFIG, timeout=2.0)
        except (KubeError, Unreachable):
            config = None  # not readable with a namespaced Role (403), or no CDI: its Service
        status = (config.get("status") or {}) if isinstance(config, dict) else {}
        if status.get("uploadProxyURL"):
            url = str(status["uploadProxyURL"])
            ca = ca or str(status.get("uploadProxyCA") or "")
    if not ca:
        ca = _cluster_ca(client)
    return Proxy(proxy_url(url or DEFAULT_PROXY), ca)


def _cluster_ca(client: KubeClient) -> str:
    creds = client.creds
    if creds.ca_data and b"-----BEGIN" in creds.ca_data:
        return creds.ca_data.decode("ascii", errors="replace")
    if creds.ca_file and os.path.exists(creds.ca_file):
        with open(creds.ca_file, encoding="ascii", errors="replace") as fh:
            return fh.read()
    return ""


def request_token(client: KubeClient, namespace: str, claim: str) -> str:
    """An upload token for `claim` (CDI's UploadTokenRequest: the claim is not looked at until the upload)."""
    body = {"apiVersion": "upload.cdi.kubevirt.io/v1beta1", "kind": "UploadTokenRequest",
            "metadata": {"name": claim, "namespace": namespace}, "spec": {"pvcName": claim}}
    try:
        answer = client.request("POST", TOKEN_REQUESTS.format(namespace=namespace), body, timeout=5.0)
    except KubeError as exc:
        raise UploadError(f"CDI gave no upload token: {exc.message}") from exc
    except Unreachable as exc:
        raise ProxyUnreachable(f"CDI gave no upload token: {exc}") from exc
    token = ((answer or {}).get("status") or {}).get("token") if isinstance(answer, dict) else None
    if not token:
        raise UploadError("CDI's answer to the UploadTokenRequest holds no token")
    return str(token)


class ProxyStream:
    """One upload to the proxy: the request line and headers at once, the body as it is written, the answer at the
    end. Blocking, each step bounded in time."""

    def __init__(self, proxy: Proxy, token: str, size: int) -> None:
        parts = urlsplit(proxy.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UploadError(f"the upload proxy address {proxy.url!r} is not an http(s) URL")
        self.where = proxy.url
        conn: http.client.HTTPConnection
        if parts.scheme == "https":
            context = ssl.create_default_context()
            if proxy.ca_pem:
                context.load_verify_locations(cadata=proxy.ca_pem)
            conn = http.client.HTTPSConnection(parts.hostname, parts.port or 443, timeout=CONNECT_TIMEOUT,
                                               context=context)
        else:
            conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=CONNECT_TIMEOUT)
        self.conn = conn
        try:
            conn.connect()
        except ssl.SSLCertVerificationError as exc:
            conn.close()
            raise ProxyUnreachable(f"the certificate of CDI's upload proxy at {self.where} is not trusted "
                                   f"({exc.verify_message}): give the agent CDI's CA with --cdi-upload-proxy-ca (the "
                                   "ConfigMap cdi-uploadproxy-signer-bundle in CDI's namespace)") from None
        except OSError as exc:
            conn.close()
            raise ProxyUnreachable(f"CDI's upload proxy at {self.where} cannot be reached: {exc}") from None
        assert conn.sock is not None
        conn.sock.settimeout(SEND_TIMEOUT)
        conn.putrequest("POST", parts.path.rstrip("/") + UPLOAD_PATH, skip_accept_encoding=True)
        for name, value in (("Authorization", f"Bearer {token}"), ("Content-Type", "application/octet-stream"),
                            ("Content-Length", str(size)), ("User-Agent", "kubevbmc-agent")):
            conn.putheader(name, value)
        try:
            conn.endheaders()
        except OSError as exc:
            conn.close()
            raise ProxyUnreachable(f"CDI's upload proxy at {self.where} cannot be reached: {exc}") from None

    def send(self, data: bytes) -> None:
        try:
            self.conn.send(data)
        except OSError as exc:
            # The proxy may have answered before the whole body (a refusal): its answer says why.
            raise self._refusal() or ProxyUnreachable(
                f"CDI's upload proxy at {self.where} stopped taking the image: {exc}") from None

    def answer(self) -> None:
        """The proxy's answer once the whole body is sent: returns on 200, raises with its reason otherwise."""
        refusal = self._refusal(ANSWER_TIMEOUT, required=True)
        if refusal is not None:
            raise refusal

    def _refusal(self, timeout: float = 2.0, required: bool = False) -> UploadError | None:
        """The proxy's answer as an error (None for 200, or when no answer can be read and none is `required`)."""
        try:
            if self.conn.sock is not None:
                self.conn.sock.settimeout(timeout)
            response = self.conn.getresponse()
            text = response.read(2048).decode(errors="replace").strip()
        except (OSError, http.client.HTTPException) as exc:
            if not required:
                return None
            if isinstance(exc, TimeoutError | socket.timeout):
                return ProxyUnreachable(f"CDI's upload proxy at {self.where} did not answer within "
                                        f"{timeout:.0f} s of the image's last byte")
            return ProxyUnreachable(f"CDI's upload proxy at {self.where} closed the upload without an answer: {exc}")
        if response.status == 200:
            return None
        reason = f": {text}" if text else ""
        if response.status in (502, 503, 504):
            return ProxyUnreachable(f"CDI's upload proxy answered {response.status}{reason}")
        return UploadError(f"CDI's upload proxy answered {response.status}{reason}")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.conn.sock is not None:
                self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()
