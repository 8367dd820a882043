"""JSON requests and watch streams through the official client's transport (its kubeconfig, TLS and auth).

The controller works on plain dicts, not the generated models: the caches hold thousands of objects, the desired
children are dicts, and server-side apply takes a dict. So it uses the official client's ApiClient for what it is
good at (configuration, credentials, connection pool) and does the (de)serialisation itself.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import urllib3
import yaml
from kubernetes import client, config
from kubernetes.config import incluster_config
from urllib3.util.wait import wait_for_read

log = logging.getLogger(__name__)

Obj = dict[str, Any]
APPLY = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"


class ApiError(Exception):
    """The API server answered with an error Status (or could not be reached: status 0)."""

    def __init__(self, status: int, reason: str, message: str, name: str = "") -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.name = name  # the Status's details.name: the object the error is about, when there is one

    @property
    def routine(self) -> bool:
        """What a level-triggered controller meets in the normal run of things and retries: an object deleted or
        changed by someone else since the cache showed it (404 naming the object, 409 Conflict). A 404 naming no
        object (a resource type the server does not serve) is not one."""
        return (self.status == 404 and bool(self.name)) or self.status == 409


class TokenFile:
    """A bearer token read from a file that the kubelet rewrites as the token rotates: read again at most every
    `period` seconds (client-go's cachingTokenSource: every minute) and at once by `read` (after a 401). It is
    the configuration's `refresh_api_key_hook`, which the official client calls for every request's auth.

    The official client re-reads an in-cluster token every minute but cannot be told to at once, and never
    re-reads a kubeconfig user's `tokenFile` (client-go does both)."""

    def __init__(self, path: str, period: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.period = period
        self._clock = clock
        self._lock = threading.Lock()
        self.token = ""
        self._due = 0.0
        self.read()

    def read(self) -> bool:
        """Read the file now; True when the token changed. A file that is gone or empty keeps the token read
        before (with a warning), as client-go keeps its cached token when a refresh fails."""
        with self._lock:
            self._due = self._clock() + self.period
            try:
                with open(self.path, encoding="utf-8") as fh:
                    token = fh.read().strip()
            except OSError as exc:
                if not self.token:
                    raise config.ConfigException(f"token file {self.path}: {exc.strerror or exc}") from exc
                log.warning("token file %s: %s; keeping the token read before", self.path, exc.strerror or exc)
                return False
            if not token:
                if not self.token:
                    raise config.ConfigException(f"token file {self.path} is empty")
                log.warning("token file %s is empty; keeping the token read before", self.path)
                return False
            changed, self.token = token != self.token, token
            return changed

    def __deepcopy__(self, memo: dict[int, Any]) -> TokenFile:
        # Configurations are deep-copied (Configuration.set_default, ApiClient()); every copy shares the one
        # source, as they share the official loaders' hook functions.
        return self

    def __call__(self, configuration: client.Configuration) -> None:
        if self._clock() >= self._due:
            self.read()
        configuration.api_key["BearerToken"] = f"Bearer {self.token}"
        configuration.api_key_prefix.pop("BearerToken", None)


def connect(kubeconfig: str = "") -> client.ApiClient:
    """From `kubeconfig`, else $KUBECONFIG / ~/.kube/config, else the in-cluster service account."""
    if kubeconfig:
        return _with_token_file(config.new_client_from_config(config_file=kubeconfig), kubeconfig)
    try:
        return connect_in_cluster()
    except config.ConfigException:
        path = os.path.expanduser(config.KUBE_CONFIG_DEFAULT_LOCATION.split(os.pathsep)[0])
        return _with_token_file(config.new_client_from_config(), path)


def connect_in_cluster(environ: Mapping[str, str] = os.environ,
                       token_file: str = incluster_config.SERVICE_TOKEN_FILENAME,
                       ca_file: str = incluster_config.SERVICE_CERT_FILENAME) -> client.ApiClient:
    """The pod's service account, its token read again as it rotates. Raises ConfigException outside a pod."""
    configuration = client.Configuration()
    incluster_config.InClusterConfigLoader(token_file, ca_file, try_refresh_token=False,
                                           environ=environ).load_and_set(configuration)
    configuration.refresh_api_key_hook = TokenFile(token_file)  # type: ignore[assignment]  # stub says None
    return client.ApiClient(configuration)


def _with_token_file(api_client: client.ApiClient, kubeconfig: str) -> client.ApiClient:
    """A kubeconfig whose current user names a `tokenFile` (and no `token`): that file read again as it rotates."""
    try:
        with open(kubeconfig, encoding="utf-8") as fh:
            loaded = yaml.safe_load(fh) or {}
    except OSError:
        return api_client
    contexts = {c.get("name"): c.get("context") or {} for c in loaded.get("contexts") or []}
    users = {u.get("name"): u.get("user") or {} for u in loaded.get("users") or []}
    user = users.get(contexts.get(loaded.get("current-context"), {}).get("user"), {})
    if user.get("tokenFile") and not user.get("token"):
        path = os.path.join(os.path.dirname(os.path.abspath(kubeconfig)), user["tokenFile"])
        api_client.configuration.refresh_api_key_hook = TokenFile(path)
    return api_client


def _request(method: str, target: str, host: str, headers: dict[str, str], body: bytes | None) -> bytes:
    """An HTTP/1.1 request, head and body."""
    fields = {"Host": host, **headers, **({"Content-Length": str(len(body))} if body is not None else {})}
    lines = [f"{method} {target} HTTP/1.1", *(f"{k}: {v}" for k, v in fields.items())]
    if any(c in line for line in lines for c in "\r\n"):
        raise ValueError(f"line break in a request line or header: {lines!r}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


class KubeApi:
    """Requests on the official client's connection pool, configuration and credentials.

    Its generic request path (parameter serialisation, and a credential refresh that rebuilds the configuration
    on every call) cost more CPU than the request itself at scale (bench/controller.py); here the Authorization
    header is refreshed through the same hook at most every AUTH_TTL seconds, as client-go caches credentials.

    Requests (not watches) go over one kept-alive connection per thread, made by the client's own pool (so with
    its TLS settings and client certificate); each request is written at once and its response read by the
    standard library's http.client. urllib3's pool, retry and response layers on top cost about 0.3 ms of CPU
    per request, about as much as the rest of the request (measured at 1,000 VirtualMachineBMCs in
    bench/controller.py). Behind a proxy, requests take urllib3's path.
    """

    AUTH_TTL = 10.0

    def __init__(self, api_client: client.ApiClient, on_write: Any = None) -> None:
        self.api_client = api_client
        self.on_write = on_write  # called with (verb, path) after each successful write, for metrics
        self._base = str(api_client.configuration.host).rstrip("/")
        self._pool = api_client.rest_client.pool_manager
        self._direct = not isinstance(self._pool, urllib3.ProxyManager)
        self._prefix = urllib.parse.urlsplit(self._base).path  # a server URL may carry a path
        self._host = urllib.parse.urlsplit(self._base).netloc
        self._local = threading.local()
        self._auth_lock = threading.Lock()
        self._auth: dict[str, str] = {}
        self._auth_until = 0.0

    def _headers(self, content_type: str) -> dict[str, str]:
        now = time.monotonic()
        if now >= self._auth_until:
            with self._auth_lock:
                if now >= self._auth_until:
                    setting = self.api_client.configuration.auth_settings().get("BearerToken")
                    self._auth = {setting["key"]: setting["value"]} if setting and setting.get("value") else {}
                    self._auth_until = now + self.AUTH_TTL
        return {**self.api_client.default_headers, "Accept": "application/json", "Content-Type": content_type,
                **self._auth}

    def _url(self, path: str, query: dict[str, str] | None) -> str:
        return self._base + path + ("?" + urllib.parse.urlencode(query) if query else "")

    def request(self, method: str, path: str, body: Any = None, *, query: dict[str, str] | None = None,
                content_type: str = "application/json", timeout: float = 15.0) -> Obj:
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        try:
            headers = self._headers(content_type)
            status, reason, raw = self._exchange(method, path, query, data, headers, timeout)
            if status == 401 and self._token_renewed(headers):
                status, reason, raw = self._exchange(method, path, query, data, self._headers(content_type),
                                                     timeout)
        except Exception as exc:  # socket, TLS and HTTP errors: the server could not be reached
            raise ApiError(0, "Unreachable", f"{method} {path}: {exc}") from exc
        try:
            payload: Any = json.loads(raw) if raw else {}
        except ValueError:
            payload = {"message": raw.decode(errors="replace")}
        if status >= 400:
            payload = payload if isinstance(payload, dict) else {}
            details = payload.get("details") if isinstance(payload.get("details"), dict) else {}
            raise ApiError(status, str(payload.get("reason") or reason), str(payload.get("message") or reason),
                           str(details.get("name") or ""))
        if method != "GET" and self.on_write is not None:
            self.on_write(method, path)
        return payload if isinstance(payload, dict) else {}

    def _exchange(self, method: str, path: str, query: dict[str, str] | None, data: bytes | None,
                  headers: dict[str, str], timeout: float) -> tuple[int, str, bytes]:
        if self._direct:
            target = self._prefix + path + ("?" + urllib.parse.urlencode(query) if query else "")
            return self._send(method, target, data, headers, timeout)
        resp = self._pool.request(method, self._url(path, query), body=data, headers=headers,
                                  timeout=urllib3.Timeout(total=timeout), retries=False, preload_content=True)
        return resp.status, resp.reason or "", resp.data or b""

    def _token_renewed(self, sent: dict[str, str]) -> bool:
        """After a 401: a token from a file is read again at once (client-go does too). True when the headers
        now carry another token than the rejected request did: worth one retry."""
        hook = self.api_client.configuration.refresh_api_key_hook
        if not isinstance(hook, TokenFile):
            return False
        hook.read()
        with self._auth_lock:
            self._auth_until = 0.0
        return self._headers("application/json").get("authorization") != sent.get("authorization")

    def _send(self, method: str, target: str, body: bytes | None, headers: dict[str, str],
              timeout: float) -> tuple[int, str, bytes]:
        """One request on this thread's connection. A connection the server closed while idle (it is readable:
        EOF) is replaced before use, as urllib3 checks before reusing one; one that fails is dropped."""
        kept: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if kept is not None and kept.sock is not None and wait_for_read(kept.sock, timeout=0.0):
            kept.close()
            kept = None
        conn = kept or self._pool.connection_from_url(self._base)._new_conn()
        assert isinstance(conn, http.client.HTTPConnection)  # urllib3's connections are http.client's
        self._local.conn = conn
        conn.timeout = timeout
        try:
            if conn.sock is None:
                conn.connect()
            assert conn.sock is not None
            conn.sock.settimeout(timeout)
            # The request goes out in one write. http.client sends the head and the body apart: two TLS
            # records, and the server wakes twice for one request.
            conn.sock.sendall(_request(method, target, self._host, headers, body))
            resp = http.client.HTTPResponse(conn.sock, method=method)
            resp.begin()
            data = resp.read()
            if resp.will_close:
                conn.close()
                self._local.conn = None
            return resp.status, resp.reason, data
        except BaseException:
            conn.close()
            self._local.conn = None
            raise

    def stream(self, path: str, query: dict[str, str], read_timeout: float) -> Iterator[Obj]:
        """The events of one watch request until the server ends it."""
        url = self._url(path, {**query, "watch": "true"})
        try:
            headers = self._headers("application/json")
            resp = self._pool.request("GET", url, headers=headers, retries=False, preload_content=False,
                                      timeout=urllib3.Timeout(connect=10, read=read_timeout))
            if resp.status == 401 and self._token_renewed(headers):
                resp.drain_conn()
                resp.release_conn()
                resp = self._pool.request("GET", url, headers=self._headers("application/json"), retries=False,
                                          preload_content=False, timeout=urllib3.Timeout(connect=10, read=read_timeout))
        except Exception as exc:
            raise ApiError(0, "Unreachable", f"watch {path}: {exc}") from exc
        try:
            if resp.status >= 400:
                try:
                    status = json.loads(resp.read())
                except ValueError:
                    status = {}
                raise ApiError(resp.status, str(status.get("reason", "")), str(status.get("message", "")))
            buffer = b""
            for chunk in resp.stream(65536):
                *lines, buffer = (buffer + chunk).split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)
        except ApiError:
            raise
        except Exception as exc:
            raise ApiError(0, "Unreachable", f"watch {path}: {exc}") from exc
        finally:
            resp.release_conn()
