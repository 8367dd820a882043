"""A small Kubernetes API client for the agent: JSON requests and watches over urllib3.

The agent makes a handful of calls (a watch on its VM and VMI, subresource PUTs, patches, Events), and its whole
budget is 60 MB: importing the official client's generated models alone costs about 33 MB (measured: 46.8 MB
for flask + pyghmi + gunicorn + urllib3, 63.5 MB once `kubernetes.client` is imported). So the agent speaks
REST with urllib3, which the official client itself uses underneath, and reads the same kubeconfig files.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import urllib3
import yaml

Obj = dict[str, Any]
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


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
    with open(os.path.join(SERVICE_ACCOUNT_DIR, "token"), encoding="utf-8") as fh:
        token = fh.read().strip()
    namespace = "default"
    ns_file = os.path.join(SERVICE_ACCOUNT_DIR, "namespace")
    if os.path.exists(ns_file):
        with open(ns_file, encoding="utf-8") as fh:
            namespace = fh.read().strip()
    host = f"[{host}]" if ":" in host else host
    return Credentials(f"https://{host}:{port}", token=token, ca_file=os.path.join(SERVICE_ACCOUNT_DIR, "ca.crt"),
                       namespace=namespace)


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
        with open(user["tokenFile"], encoding="utf-8") as fh:
            creds.token = fh.read().strip()
    return creds


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


class KubeClient:
    def __init__(self, creds: Credentials, timeout: float = 5.0, maxsize: int = 4) -> None:
        self.creds = creds
        self.timeout = timeout
        kwargs: dict[str, Any] = {"maxsize": maxsize, "retries": False, "block": False}
        if creds.server.startswith("https"):
            context = ssl.create_default_context(cafile=creds.ca_file or None,
                                                 cadata=creds.ca_data.decode() if creds.ca_data else None)
            if creds.insecure:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            _load_client_cert(context, creds)
            kwargs["ssl_context"] = context
        self._pool = urllib3.PoolManager(**kwargs)
        self._headers = {"Accept": "application/json", "User-Agent": "kubevbmc-agent"}
        if creds.token:
            self._headers["Authorization"] = f"Bearer {creds.token}"

    def _url(self, path: str, query: dict[str, str] | None) -> str:
        url = self.creds.server.rstrip("/") + path
        return f"{url}?{urlencode(query)}" if query else url

    def request(self, method: str, path: str, body: Any = None, *, query: dict[str, str] | None = None,
                content_type: str = "application/json", timeout: float | None = None) -> Any:
        """One request; the decoded JSON answer. Raises KubeError for error codes, Unreachable otherwise."""
        headers = dict(self._headers)
        data = None
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            headers["Content-Type"] = content_type
        try:
            resp = self._pool.request(method, self._url(path, query), body=data, headers=headers,
                                      timeout=urllib3.Timeout(total=timeout or self.timeout))
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise Unreachable(f"{method} {path}: {exc}") from exc
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

    def stream(self, path: str, query: dict[str, str], read_timeout: float,
               opened: Callable[[urllib3.BaseHTTPResponse], None] | None = None) -> Iterator[Obj]:
        """The events of one watch request, until the server ends it. Raises Unreachable/KubeError.
        `opened` gets the response, whose `shutdown()` ends a read blocked in another thread."""
        try:
            resp = self._pool.request("GET", self._url(path, {**query, "watch": "true"}),
                                      headers=self._headers, preload_content=False,
                                      timeout=urllib3.Timeout(connect=self.timeout, read=read_timeout))
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise Unreachable(f"watch {path}: {exc}") from exc
        if opened is not None:
            opened(resp)
        try:
            if resp.status >= 400:
                body = resp.read()
                try:
                    status = json.loads(body)
                except ValueError:
                    status = {}
                raise KubeError(resp.status, status.get("reason", ""), status.get("message", ""), status)
            buffer = b""
            for chunk in resp.stream(65536):
                *lines, buffer = (buffer + chunk).split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise Unreachable(f"watch {path}: {exc}") from exc
        finally:
            resp.release_conn()

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
