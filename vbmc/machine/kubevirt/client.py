"""A small Kubernetes API client for the agent: JSON requests and watches over urllib3.

The agent makes a handful of calls (a watch on its VM and VMI, subresource PUTs, patches, Events), and its whole
budget is 60 MB: importing the official client's generated models alone costs about 33 MB (measured: 46.8 MB
for flask + pyghmi + gunicorn + urllib3, 63.5 MB once `kubernetes.client` is imported). So the agent speaks
REST with urllib3, which the official client itself uses underneath, and reads the same kubeconfig files.

Credentials that rotate: a bound ServiceAccount token is rewritten by the kubelet before it expires, and a CA
bundle can be replaced. As client-go does (transport/token_source.go: cachingTokenSource), a token that comes
from a file (in-cluster, or a kubeconfig user's `tokenFile`) is read again at most every REFRESH_SECONDS and at
once when the server answers 401 (the request is then retried once with the new token); the CA file is read on
the same schedule and, when its content changed, new connections use a TLS context built from it. A request
costs a clock read, not a file read.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import ssl
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import urllib3
import yaml

from . import console

log = logging.getLogger(__name__)

Obj = dict[str, Any]
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# client-go re-reads a token file every minute (cachingTokenSource); the kubelet rewrites a bound token at 80% of
# its lifetime (at least 10 minutes), so the old one stays valid for minutes after the new one is written.
REFRESH_SECONDS = 60.0


class KubeError(Exception):
    """The API server answered with an error Status."""

    def __init__(self, status: int, reason: str, message: str, body: Any = None) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.body = body


class Unreachable(Exception):
    """The API server could not be reached or did not answer in time."""


@dataclass
class Credentials:
    server: str
    token: str = ""
    token_file: str = ""  # read again while running (in-cluster token, kubeconfig `tokenFile`)
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    # A kubeconfig's inline `-data`: kept in memory, never written to a file that would outlive the process.
    ca_data: bytes = b""
    cert_data: bytes = b""
    key_data: bytes = b""
    insecure: bool = False
    namespace: str = "default"


def load_credentials(kubeconfig: str | None = None) -> Credentials:
    """From `kubeconfig`, else $KUBECONFIG, else the in-cluster service account."""
    path = kubeconfig or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    if path:
        return _from_kubeconfig(path)
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise Unreachable("no kubeconfig (KUBECONFIG unset) and not running in a cluster")
    token_file = os.path.join(SERVICE_ACCOUNT_DIR, "token")
    token = read_token(token_file)
    namespace = "default"
    ns_file = os.path.join(SERVICE_ACCOUNT_DIR, "namespace")
    if os.path.exists(ns_file):
        with open(ns_file, encoding="utf-8") as fh:
            namespace = fh.read().strip()
    host = f"[{host}]" if ":" in host else host
    return Credentials(f"https://{host}:{port}", token=token, token_file=token_file,
                       ca_file=os.path.join(SERVICE_ACCOUNT_DIR, "ca.crt"), namespace=namespace)


def _from_kubeconfig(path: str) -> Credentials:
    with open(path, encoding="utf-8") as fh:
        config = yaml.safe_load(fh) or {}
    contexts = {c["name"]: c.get("context") or {} for c in config.get("contexts") or []}
    context = contexts.get(config.get("current-context", ""), {})
    clusters = {c["name"]: c.get("cluster") or {} for c in config.get("clusters") or []}
    users = {u["name"]: u.get("user") or {} for u in config.get("users") or []}
    cluster = clusters.get(context.get("cluster", ""), {})
    user = users.get(context.get("user", ""), {})
    if not cluster.get("server"):
        raise Unreachable(f"kubeconfig {path}: the current context names no cluster server")
    base = os.path.dirname(os.path.abspath(path))
    creds = Credentials(cluster["server"], namespace=context.get("namespace") or "default",
                        insecure=bool(cluster.get("insecure-skip-tls-verify")))
    creds.ca_file, creds.ca_data = _material(cluster, "certificate-authority", base)
    creds.cert_file, creds.cert_data = _material(user, "client-certificate", base)
    creds.key_file, creds.key_data = _material(user, "client-key", base)
    creds.token = user.get("token") or ""
    if not creds.token and user.get("tokenFile"):
        # client-go resolves a relative tokenFile against the kubeconfig's directory, as the other file names.
        creds.token_file = str(os.path.join(base, user["tokenFile"]))
        creds.token = read_token(creds.token_file)
    return creds


def read_token(path: str) -> str:
    """A bearer token file's content. Raises Unreachable (naming the file) when it is missing or empty."""
    try:
        with open(path, encoding="utf-8") as fh:
            token = fh.read().strip()
    except OSError as exc:
        raise Unreachable(f"token file {path}: {exc.strerror or exc}") from exc
    if not token:
        raise Unreachable(f"token file {path} is empty")
    return token


def _material(section: Obj, key: str, base: str) -> tuple[str, bytes]:
    """A kubeconfig's file reference, or its inline `-data` (decoded, in memory)."""
    if section.get(f"{key}-data"):
        return "", base64.b64decode(section[f"{key}-data"])
    if section.get(key):
        return str(os.path.join(base, section[key])), b""
    return "", b""


def _load_client_cert(context: ssl.SSLContext, creds: Credentials) -> None:
    """The client certificate and key into `context`. OpenSSL loads a chain from files only: inline data goes
    through a private directory that is removed as soon as it is loaded, whatever happens."""
    if not (creds.cert_data or creds.key_data):
        if creds.cert_file:
            context.load_cert_chain(creds.cert_file, creds.key_file or None)
        return
    with tempfile.TemporaryDirectory(prefix="kubevbmc-") as directory:  # mode 0700
        paths = []
        for name, data, path in (("tls.crt", creds.cert_data, creds.cert_file),
                                 ("tls.key", creds.key_data, creds.key_file)):
            if data:
                path = os.path.join(directory, name)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
            paths.append(path)
        context.load_cert_chain(paths[0], paths[1] or None)


def _read_ca(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _tls_context(creds: Credentials, ca: bytes | None) -> ssl.SSLContext:
    """TLS for the API server: trusting `ca` (PEM or DER; the system's CAs when None), with the client
    certificate if there is one. Raises ssl.SSLError/OSError for a CA or key that does not load."""
    cadata: str | bytes | None = ca
    if ca is not None and b"-----BEGIN" in ca:
        cadata = ca.decode("ascii", errors="replace")
    context = ssl.create_default_context(cadata=cadata)
    if creds.insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    _load_client_cert(context, creds)
    return context


class KubeClient:
    """JSON requests and watches with the credentials of `creds`, re-reading a token file and a CA file as they
    rotate (see the module's docstring). Safe to share between threads."""

    def __init__(self, creds: Credentials, timeout: float = 5.0, maxsize: int = 4,
                 refresh_seconds: float = REFRESH_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.creds = creds
        self.timeout = timeout
        self._maxsize = maxsize
        self._clock = clock
        self._refresh_seconds = refresh_seconds
        self._lock = threading.Lock()
        self._tls = creds.server.startswith("https")
        self._ca = (_read_ca(creds.ca_file) if creds.ca_file else creds.ca_data or None) if self._tls else None
        self._pool = self._new_pool(self._ca)
        self._base_headers = {"Accept": "application/json", "User-Agent": "kubevbmc-agent"}
        self._headers = self._with_token(creds.token)
        self._rereads = bool(creds.token_file) or (self._tls and bool(creds.ca_file))
        self._context: ssl.SSLContext | None = None
        self._context_ca: bytes | None = None
        self._due = clock() + refresh_seconds

    def _new_pool(self, ca: bytes | None) -> urllib3.PoolManager:
        kwargs: dict[str, Any] = {"maxsize": self._maxsize, "retries": False, "block": False}
        if self._tls:
            kwargs["ssl_context"] = _tls_context(self.creds, ca)
        return urllib3.PoolManager(**kwargs)

    def _with_token(self, token: str) -> dict[str, str]:
        return {**self._base_headers, **({"Authorization": f"Bearer {token}"} if token else {})}

    def _current(self) -> tuple[urllib3.PoolManager, dict[str, str]]:
        """The pool and headers for the next request: a clock read, and the files read again when due."""
        if self._rereads and self._clock() >= self._due:
            self.refresh()
        return self._pool, self._headers

    def refresh(self) -> bool:
        """Read the token file and the CA file again now. True when the token changed. A file that cannot be
        read (or a CA that does not load) leaves the credentials as they were, with a warning."""
        with self._lock:
            self._due = self._clock() + self._refresh_seconds
            changed = False
            if self.creds.token_file:
                try:
                    token = read_token(self.creds.token_file)
                except Unreachable as exc:
                    log.warning("kube: %s; keeping the token read before", exc)
                    token = self.creds.token
                if token != self.creds.token:
                    self.creds.token = token
                    self._headers = self._with_token(token)
                    changed = True
                    log.info("kube: read a new token from %s", self.creds.token_file)
            if self._tls and self.creds.ca_file:
                try:
                    ca = _read_ca(self.creds.ca_file)
                    pool = self._new_pool(ca) if ca != self._ca else None
                except (OSError, ssl.SSLError) as exc:
                    log.warning("kube: CA file %s: %s; keeping the CA read before", self.creds.ca_file, exc)
                    pool = None
                if pool is not None:
                    # Connections already open (a watch) finish on the old pool; new ones verify with the new CA.
                    old, self._pool, self._ca = self._pool, pool, ca
                    old.clear()
                    log.info("kube: read a new CA bundle from %s", self.creds.ca_file)
            return changed

    def _retry_unauthorized(self, sent: dict[str, str]) -> dict[str, str] | None:
        """After a 401: the token file read again at once (client-go does too); the headers to retry with when
        they now carry another token than the rejected request did, else None."""
        if not self.creds.token_file:
            return None  # a fixed token cannot get better by asking again
        self.refresh()
        headers = self._headers
        return headers if headers.get("Authorization") != sent.get("Authorization") else None

    def _url(self, path: str, query: dict[str, str] | None) -> str:
        url = self.creds.server.rstrip("/") + path
        return f"{url}?{urlencode(query)}" if query else url

    def request(self, method: str, path: str, body: Any = None, *, query: dict[str, str] | None = None,
                content_type: str = "application/json", timeout: float | None = None) -> Any:
        """One request; the decoded JSON answer. Raises KubeError for error codes, Unreachable otherwise.
        A 401 with a token from a file is retried once, with the token read again."""
        pool, auth = self._current()
        data = None
        extra: dict[str, str] = {}
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            extra["Content-Type"] = content_type
        url = self._url(path, query)
        resp = self._send(pool, method, url, data, {**auth, **extra}, timeout, path)
        if resp.status == 401:
            retry = self._retry_unauthorized(auth)
            if retry is not None:
                resp = self._send(self._pool, method, url, data, {**retry, **extra}, timeout, path)
        payload: Any = None
        if resp.data:
            try:
                payload = json.loads(resp.data)
            except ValueError:
                payload = resp.data.decode(errors="replace")
        if resp.status >= 400:
            status = payload if isinstance(payload, dict) else {}
            raise KubeError(resp.status, str(status.get("reason") or resp.reason),
                            str(status.get("message") or payload or resp.reason), payload)
        return payload

    def websocket(self, path: str, output: Callable[[bytes], None], closed: Callable[[str], None], name: str, *,
                  query: dict[str, str] | None = None, timeout: float | None = None) -> console.WebSocketStream:
        """A console WebSocket (console.py: driven by the process's stream loop, hub.Hub; `output` and
        `closed` called there) to `path`. Raises KubeError with the server's Status when it refuses the upgrade (a
        401 with a token from a file is retried once, with the token read again), Unreachable otherwise."""
        _, auth = self._current()
        tls = _tls_context(self.creds, self._ca) if self._tls else None
        for attempt in (1, 2):
            headers = [(k, v) for k, v in auth.items() if k in ("Authorization", "User-Agent")]
            try:
                return console.connect(self.creds.server, path, query, tls, headers, output, closed, name,
                                       timeout or self.timeout)
            except console.Refused as exc:
                retry = self._retry_unauthorized(auth) if exc.status == 401 and attempt == 1 else None
                if retry is not None:
                    auth = retry
                    continue
                try:
                    status = json.loads(exc.body or b"{}")
                except ValueError:
                    status = {}
                status = status if isinstance(status, dict) else {}
                text = exc.body.decode("utf-8", "replace").strip() if exc.body and not status else ""
                raise KubeError(exc.status, str(status.get("reason") or ""),
                                str(status.get("message") or text or f"HTTP {exc.status}"), status) from exc
            except (console.HandshakeFailed, OSError, ssl.SSLError, TimeoutError) as exc:
                raise Unreachable(f"GET {path} (WebSocket): {exc or type(exc).__name__}") from exc
        raise AssertionError("unreachable")

    def _send(self, pool: urllib3.PoolManager, method: str, url: str, data: bytes | None, headers: dict[str, str],
              timeout: float | None, path: str) -> urllib3.BaseHTTPResponse:
        try:
            return pool.request(method, url, body=data, headers=headers,
                                timeout=urllib3.Timeout(total=timeout or self.timeout))
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise Unreachable(f"{method} {path}: {exc}") from exc

    # ---- for the watches' own connections (streams.py)

    def tls_context(self) -> ssl.SSLContext:
        """The TLS context of a new connection: the CA of the moment, the client certificate if any."""
        with self._lock:
            if self._context is None or self._context_ca is not self._ca:
                self._context, self._context_ca = _tls_context(self.creds, self._ca), self._ca
            return self._context

    def auth_headers(self) -> dict[str, str]:
        """The headers of the next request (the token of the moment)."""
        return dict(self._current()[1])

    def reauthorized(self, sent: dict[str, str]) -> dict[str, str] | None:
        """After a 401 to a request sent with `sent`: the headers to retry it with, or None (see request)."""
        return self._retry_unauthorized(sent)

    def close(self) -> None:
        self._pool.clear()


def merge_patched(target: Any, patch: Any) -> Any:
    """What the API server stores after a JSON merge patch (RFC 7386): objects merge key by key, a null deletes
    its key (so a null inside the patch never reaches the stored object), anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patched(merged.get(key), value)
    return merged
