"""The HTTP face of kubesim: Kubernetes REST paths, discovery, watches and Status errors."""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

import yaml
from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Ping, TextMessage
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import LocalProtocolError, generate_accept_token

from . import errors, podlogs, printers, protobuf
from .resources import ResourceType
from .selectors import field_matcher, label_matcher, selected_name
from .store import APPLY, Event, Store, decode_continue, encode_continue, encoded, encoded_list_item, list_item

_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

log = logging.getLogger(__name__)
Obj = dict[str, Any]

KUBE_VERSION = {"major": "1", "minor": "36", "gitVersion": "v1.36.0-kubesim", "gitCommit": "kubesim",
                "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.25",
                "compiler": "gc", "platform": "linux/amd64"}
OPEN_PATHS = {"/version", "/healthz", "/readyz", "/livez"}
_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


class StreamPeer(Protocol):
    """The far end of a WebSocket subresource (a VMI's serial line): bytes in, bytes out, until it ends."""

    reason: str  # why take() returned None: the close frame's reason

    def fileno(self) -> int:
        """Readable whenever take() may have something new."""
        ...

    def take(self) -> bytes | None:
        """Output since the last take (b"" if none); None once the stream has ended."""
        ...

    def feed(self, data: bytes) -> None: ...

    def close(self) -> None: ...


@dataclass
class Stream:
    """A subresource served as a WebSocket on GET (virt-api's `virtualmachineinstances/console` and `vnc`)."""

    name: str  # resource/sub
    kind: str
    subprotocols: tuple[str, ...]  # the ones the server speaks, chosen from what the client offers
    # connect(namespace, name, query) checks the request (raising an ApiError, answered before any upgrade) and
    # returns what opens the stream once the upgrade is answered.
    connect: Callable[[str, str, dict[str, str]], Callable[[], StreamPeer]]


@dataclass
class SubresourceAPI:
    """An aggregated API group that serves only subresources (KubeVirt's subresources.kubevirt.io)."""

    group: str
    version: str
    resources: list[tuple[str, str, bool]]  # (resource/sub, kind, namespaced)
    # handle(method, namespace, resource, name, sub, body) -> (code, object)
    handle: Callable[[str, str, str, str, str, Any], tuple[int, Any]]
    streams: list[Stream] = field(default_factory=list)  # namespaced, GET only
    # Kinds that are only ever created, by a POST to their namespaced collection (CDI's uploadtokenrequests):
    # resource -> kind. handle() gets them with an empty name and sub.
    creates: dict[str, str] = field(default_factory=dict)

    def stream(self, resource: str, sub: str) -> Stream | None:
        return next((s for s in self.streams if s.name == f"{resource}/{sub}"), None)


class ApiServer:
    def __init__(self, store: Store, tokens: dict[str, str], bookmark_interval: float = 60.0,
                 tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls
        self.store = store
        self.tokens = tokens
        self.bookmark_interval = bookmark_interval
        self.subresource_apis: dict[tuple[str, str], SubresourceAPI] = {}
        # pods/log: the kubelet's captured output of a container, by (namespace, pod, pod uid, container).
        self.container_logs: Callable[[str, str, str, str], podlogs.ContainerLog | None] | None = None
        # kubesim's admin API, for admin_user only: (node, power on?) switches a node's power (Cluster.power_off_node);
        # node_report() says which nodes have power and how many heartbeat writes their kubelets made.
        self.node_power: Callable[[str, bool], None] | None = None
        self.node_report: Callable[[], dict[str, Any]] | None = None
        self.admin_user = ""
        self.requests = 0
        # apiserver_request_total: requests by (verb, group, version, resource, subresource, scope, code).
        self.request_counts: dict[tuple[str, ...], int] = {}
        self._counts_lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def count_request(self, labels: tuple[str, ...]) -> None:
        with self._counts_lock:
            self.request_counts[labels] = self.request_counts.get(labels, 0) + 1

    def metrics(self) -> bytes:
        """kube-apiserver's apiserver_request_total, in its Prometheus text format and with its labels (a request is
        counted when it ends, a watch too), so that whatever counts what clients cost a real API server counts
        them here alike. component is "apiserver" for resource requests, "" for the others (whose path is their
        subresource); system_client names kube-apiserver's own components, never a kubesim client. Observed on
        kube-apiserver v1.36 (tests/sim/test_api.py)."""
        with self._counts_lock:
            counts = sorted(self.request_counts.items())
        lines = ["# HELP apiserver_request_total [STABLE] Counter of apiserver requests broken out for each verb, "
                 "dry run value, group, version, resource, scope, component, and HTTP response code.",
                 "# TYPE apiserver_request_total counter"]
        for (verb, group, version, resource, subresource, scope, code), count in counts:
            component = "apiserver" if resource else ""
            lines.append(f'apiserver_request_total{{code="{code}",component="{component}",dry_run="",group="{group}",'
                         f'resource="{resource}",scope="{scope}",subresource="{subresource}",system_client="",'
                         f'verb="{verb}",version="{version}"}} {count}')
        return ("\n".join(lines) + "\n").encode()

    def add_subresource_api(self, api: SubresourceAPI) -> None:
        self.subresource_apis[(api.group, api.version)] = api

    def start(self, host: str, port: int) -> tuple[str, int]:
        server = self

        class Handler(_Handler):
            api = server

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True
            request_queue_size = 256

        self._httpd = Server((host, port), Handler)
        if self.tls is not None:
            # The handshake happens in the handler's thread (on first read), not in the accept loop.
            self._httpd.socket = self.tls.wrap_socket(self._httpd.socket, server_side=True,
                                                      do_handshake_on_connect=False)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="kubesim-http", daemon=True)
        self._thread.start()
        addr = self._httpd.server_address
        return str(addr[0]), int(addr[1])

    def stop(self) -> None:
        self._stopping.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    # ---- discovery

    def _groups(self) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        for rtype in self.store.types():
            if rtype.group:
                versions = groups.setdefault(rtype.group, [])
                for v in rtype.served_versions:
                    if v not in versions:
                        versions.append(v)
        for group, version in self.subresource_apis:
            groups.setdefault(group, [])
            if version not in groups[group]:
                groups[group].append(version)
        return groups

    def api_group(self, group: str, versions: list[str]) -> Obj:
        ordered = sorted(versions, key=_version_priority)
        return {"name": group, "versions": [{"groupVersion": f"{group}/{v}", "version": v} for v in ordered],
                "preferredVersion": {"groupVersion": f"{group}/{ordered[0]}", "version": ordered[0]}}

    def group_list(self) -> Obj:
        return {"kind": "APIGroupList", "apiVersion": "v1",
                "groups": [self.api_group(g, vs) for g, vs in sorted(self._groups().items())]}

    def resource_list(self, group: str, version: str) -> Obj | None:
        resources: list[Obj] = []
        found = False
        for rtype in sorted(self.store.types(), key=lambda t: t.plural):
            if rtype.group != group or version not in rtype.served_versions:
                continue
            found = True
            entry = {"name": rtype.plural, "singularName": rtype.singular, "namespaced": rtype.namespaced,
                     "kind": rtype.kind, "verbs": _VERBS}
            if rtype.short_names:
                entry["shortNames"] = list(rtype.short_names)
            if rtype.categories:
                entry["categories"] = list(rtype.categories)
            resources.append(entry)
            if rtype.status_subresource:
                resources.append({"name": f"{rtype.plural}/status", "singularName": "", "namespaced":
                                  rtype.namespaced, "kind": rtype.kind, "verbs": ["get", "patch", "update"]})
            if rtype.key == "/pods":  # its own subresource, which RBAC rules name apart from pods
                resources.append({"name": "pods/log", "singularName": "", "namespaced": True, "kind": "Pod",
                                  "verbs": ["get"]})
        sub = self.subresource_apis.get((group, version))
        if sub is not None:
            found = True
            for name, kind, namespaced in sub.resources:
                resources.append({"name": name, "singularName": "", "namespaced": namespaced, "kind": kind,
                                  "verbs": ["put"]})
            for stream in sub.streams:
                resources.append({"name": stream.name, "singularName": "", "namespaced": True,
                                  "kind": stream.kind, "verbs": ["get"]})
            for name, kind in sub.creates.items():
                resources.append({"name": name, "singularName": name.removesuffix("s"), "namespaced": True,
                                  "kind": kind, "verbs": ["create"]})
        if not found:
            return None
        gv = f"{group}/{version}" if group else version
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}

    # ---- OpenAPI v3: only what clients look for (kubectl checks that PATCH takes fieldValidation, so it
    # validates on the server instead of needing full schemas on the client).

    def _group_versions(self) -> list[tuple[str, str]]:
        out = {(t.group, v) for t in self.store.types() for v in t.served_versions}
        return sorted(out)

    def openapi_root(self) -> Obj:
        paths = {}
        for group, version in self._group_versions():
            key = f"apis/{group}/{version}" if group else f"api/{version}"
            paths[key] = {"serverRelativeURL": f"/openapi/v3/{key}"}
        return {"paths": paths}

    def openapi_group(self, key: str) -> Obj | None:
        parts = key.split("/")
        if parts[0] == "api" and len(parts) == 2:
            group, version = "", parts[1]
        elif parts[0] == "apis" and len(parts) == 3:
            group, version = parts[1], parts[2]
        else:
            return None
        paths: Obj = {}
        prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
        params = [{"name": name, "in": "query", "schema": {"type": "string", "uniqueItems": True}}
                  for name in ("dryRun", "fieldManager", "fieldValidation", "force")]
        for rtype in self.store.types():
            if rtype.group != group or version not in rtype.served_versions:
                continue
            gvk = {"group": group, "version": version, "kind": rtype.kind}
            scope = "/namespaces/{namespace}" if rtype.namespaced else ""
            item = f"{prefix}{scope}/{rtype.plural}/{{name}}"
            paths[item] = {
                "get": {"x-kubernetes-action": "get", "x-kubernetes-group-version-kind": gvk},
                "put": {"x-kubernetes-action": "put", "x-kubernetes-group-version-kind": gvk,
                        "parameters": params},
                "patch": {"x-kubernetes-action": "patch", "x-kubernetes-group-version-kind": gvk,
                          "parameters": params},
                "delete": {"x-kubernetes-action": "delete", "x-kubernetes-group-version-kind": gvk},
            }
            paths[f"{prefix}{scope}/{rtype.plural}"] = {
                "get": {"x-kubernetes-action": "list", "x-kubernetes-group-version-kind": gvk},
                "post": {"x-kubernetes-action": "post", "x-kubernetes-group-version-kind": gvk,
                         "parameters": params},
            }
        if not paths:
            return None
        return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": KUBE_VERSION["gitVersion"]},
                "paths": paths, "components": {"schemas": {}}}


def _version_priority(version: str) -> tuple[int, int, int]:
    """Kubernetes version priority: GA > beta > alpha, then higher numbers first."""
    import re
    m = re.match(r"^v(\d+)(?:(alpha|beta)(\d+))?$", version)
    if not m:
        return (3, 0, 0)
    major, level, minor = int(m.group(1)), m.group(2), int(m.group(3) or 0)
    rank = {None: 0, "beta": 1, "alpha": 2}[level]
    return (rank, -major, -minor)


# A WebSocket connection: how long a send may wait for a client that reads nothing, how long a close waits for
# the client's close frame, and how often the loop looks at whether the server is stopping.
_WS_SEND_TIMEOUT = 10.0
_WS_CLOSE_TIMEOUT = 1.0
_WS_TICK = 0.25


def _readable(objects: list[Any], timeout: float) -> list[Any]:
    """Those of `objects` (sockets, or anything with a fileno) that are readable, closed or failed within `timeout`
    seconds. poll, not select.select: kubesim holds thousands of descriptors (a Service's listeners, watches), and
    select.select refuses any numbered 1,024 or more."""
    poller = select.poll()
    for thing in objects:
        poller.register(thing, select.POLLIN)
    ready = {fd for fd, _ in poller.poll(timeout * 1000)}  # POLLHUP and POLLERR come whether asked for or not
    return [thing for thing in objects if thing.fileno() in ready]


def run_websocket(sock: socket.socket, peer: StreamPeer, stopping: threading.Event) -> None:
    """Carry a stream over an upgraded connection (wsproto for the framing): what the peer produces goes out as
    binary messages, binary and text messages from the client go to the peer, pings get pongs. It ends when the
    client closes (or goes), the peer ends (close 1000 with its reason) or the server stops (close 1001); a
    close from this side waits briefly for the client's before the connection is dropped.

    One thread does both directions (select on the socket and the peer), so a TLS socket is never read and
    written at once."""
    ws = Connection(ConnectionType.SERVER)
    sock.settimeout(_WS_SEND_TIMEOUT)
    closing_since: float | None = None

    def send(data: bytes) -> None:
        if data:
            sock.sendall(data)

    def close(code: int, reason: str) -> float:
        if ws.state is ConnectionState.OPEN:
            send(ws.send(CloseConnection(code=code, reason=reason)))
        return time.monotonic()

    try:
        while True:
            if closing_since is None and stopping.is_set():
                closing_since = close(CloseReason.GOING_AWAY, "kubesim is shutting down")
            if closing_since is not None and time.monotonic() - closing_since > _WS_CLOSE_TIMEOUT:
                return
            waiting: list[Any] = [sock] if closing_since is not None else [sock, peer]
            buffered = isinstance(sock, ssl.SSLSocket) and sock.pending()  # decrypted bytes poll cannot see
            ready = [sock] if buffered else _readable(waiting, _WS_TICK)
            if sock in ready:
                data = sock.recv(65536)
                ws.receive_data(data or None)
                for event in ws.events():
                    if isinstance(event, BytesMessage):
                        peer.feed(bytes(event.data))
                    elif isinstance(event, TextMessage):
                        peer.feed(event.data.encode())
                    elif isinstance(event, Ping):
                        send(ws.send(event.response()))
                    elif isinstance(event, CloseConnection):
                        # The client's close (answered in kind), its reply to ours, or a protocol error (1002).
                        if ws.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
                            send(ws.send(event.response()))
                        return
                if not data:
                    return
            if peer in ready and closing_since is None:
                out = peer.take()
                if out is None:
                    closing_since = close(CloseReason.NORMAL_CLOSURE, peer.reason[:120])
                elif out:
                    send(ws.send(BytesMessage(data=out)))
    except (OSError, LocalProtocolError) as exc:  # the client went, stalled, or broke the protocol
        log.debug("websocket: %s", exc)


_MAX_LINE = 65536  # http.client's limits
_MAX_HEADERS = 100


class _Fields(dict[str, str]):
    """Request headers by lower-cased name; repeated ones joined with commas, as HTTP allows."""

    def add(self, name: str, value: str) -> None:
        key = name.lower()
        self[key] = f"{self[key]}, {value}" if key in self else value

    def get(self, name: str, default: str = "") -> str:  # type: ignore[override]
        return dict.get(self, name.lower(), default)


class _Handler(BaseHTTPRequestHandler):
    api: ApiServer
    raw_requestline: bytes
    fields: _Fields
    _headers_buffer: list[bytes]  # BaseHTTPRequestHandler's, filled by send_response and send_header
    protocol_version = "HTTP/1.1"
    server_version = "kubesim"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes: without NODELAY, Nagle and delayed ACKs add 40 ms.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def parse_request(self) -> bool:
        """BaseHTTPRequestHandler.parse_request for HTTP/1.x, with the header block read straight into a dict:
        the email parser it uses was a tenth of kubesim's CPU per request at scale."""
        self.command = ""
        self.request_version = self.default_request_version
        self.close_connection = True
        self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        words = self.requestline.split()
        if len(words) != 3 or not words[2].startswith("HTTP/1."):
            self.send_error(HTTPStatus.BAD_REQUEST, f"Bad request syntax ({self.requestline!r})")
            return False
        self.command, self.path, self.request_version = words
        self.fields = _Fields()
        while True:
            line = self.rfile.readline(_MAX_LINE + 1)
            if line in (b"\r\n", b"\n", b""):
                break
            name, colon, value = str(line, "iso-8859-1").partition(":")
            if len(line) > _MAX_LINE or len(self.fields) >= _MAX_HEADERS:
                self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Line too long or too many headers")
                return False
            if not colon or not name.strip():
                self.send_error(HTTPStatus.BAD_REQUEST, f"Bad header line ({line!r})")
                return False
            self.fields.add(name.strip(), value.strip())
        connection = self.fields.get("Connection", "").lower()
        self.close_connection = connection == "close" or (
            self.request_version == "HTTP/1.0" and connection != "keep-alive")
        if self.fields.get("Expect", "").lower() == "100-continue":
            return self.handle_expect_100()
        return True

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s - %s", self.address_string(), format % args)

    _date: tuple[int, str] = (0, "")

    def date_time_string(self, timestamp: float | None = None) -> str:
        """The Date header, formatted once a second rather than on every response."""
        if timestamp is not None:
            return super().date_time_string(timestamp)
        second = int(time.time())
        if _Handler._date[0] != second:
            _Handler._date = (second, super().date_time_string(second))
        return _Handler._date[1]

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    # ---- plumbing

    def send_response(self, code: int, message: str | None = None) -> None:
        self._code = code
        super().send_response(code, message)

    def _serve(self, method: str) -> None:
        self.api.requests += 1
        url = urlsplit(self.path)
        self.query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        self.warnings: list[str] = []
        self._code = 0
        # verb, group, version, resource, subresource, scope. Of the requests that name no resource, kube-apiserver
        # v1.36 counts its health checks (by path), not /metrics, /version, discovery or OpenAPI.
        health = url.path in ("/healthz", "/readyz", "/livez")
        self._request_labels: tuple[str, ...] | None = (method, "", "", "", url.path, "") if health else None
        try:
            self._serve_counted(method, url.path)
        finally:
            if self._code and self._request_labels is not None:
                self.api.count_request((*self._request_labels, str(self._code)))

    def _counted_as(self, method: str, group: str, version: str, resource: str, subresource: str, namespace: str,
                    name: str, watch: bool, custom: bool = False) -> None:
        """The labels kube-apiserver's request metrics give this request. A built-in kind's are its route's
        (endpoints/installer.go: a list or watch is of its namespace, or the cluster); a custom resource's come
        from the request (apiextensions-apiserver: metrics.CleanScope and CanonicalVerb), where a list or watch
        whose field selector requires metadata.name names that object (request.RequestInfoFactory), so a LIST of
        one object by name is a GET of scope "resource". A create is of scope "resource" in both. Observed on
        kube-apiserver v1.36."""
        if method == "GET" and not name and custom:
            name = selected_name(self.query.get("fieldSelector")) or ""
        scope = "resource" if name or method == "POST" else "namespace" if namespace else "cluster"
        verb = method
        if method == "GET":
            verb = "WATCH" if watch else "GET" if scope == "resource" else "LIST"
        elif method == "PATCH" and self.fields.get("Content-Type", "").startswith("application/apply-patch"):
            verb = "APPLY"
        elif method == "DELETE" and not name:
            verb = "DELETECOLLECTION"
        self._request_labels = (verb, group, version, resource, subresource, scope)

    def _serve_counted(self, method: str, url_path: str) -> None:
        try:
            body = self._read_body()
            if url_path not in OPEN_PATHS:
                self._authenticate()
            self._route(method, url_path.rstrip("/") or "/", body)
        except errors.ApiError as exc:
            self._send_json(exc.code, exc.status(), exc.headers)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            self.close_connection = True
        except Exception as exc:
            log.exception("kubesim: %s %s failed", method, self.path)
            self._send_json(500, errors.internal(str(exc)).status())

    def _authenticate(self) -> None:
        header = self.fields.get("Authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if token not in self.api.tokens:
            raise errors.unauthorized()
        self.user = self.api.tokens[token]

    def _read_body(self) -> bytes:
        length = int(self.fields.get("Content-Length") or 0)
        if self.fields.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        return self.rfile.read(length) if length else b""

    def _decode(self, body: bytes, content_type: str) -> Any:
        if not body:
            return None
        if content_type.split(";")[0].strip() == protobuf.MEDIA_TYPE:
            return protobuf.decode(body)
        try:
            if "yaml" in content_type:
                if body.lstrip().startswith(b"{"):  # most apply bodies are JSON, which is YAML too
                    with contextlib.suppress(ValueError):
                        return json.loads(body)
                return yaml.load(body, Loader=_YAML_LOADER)
            return json.loads(body)
        except (ValueError, yaml.YAMLError) as exc:
            raise errors.bad_request(f"the body of the request could not be decoded: {exc}") from None

    def _send_object(self, code: int, obj: Obj) -> None:
        """A stored object, as served at the requested version."""
        out = self._out(obj)
        self._send_json(code, out, data=encoded(obj) if out is obj else None)

    def _send_list(self, rtype: ResourceType, meta: Obj, items: list[Obj]) -> None:
        head = {"kind": f"{rtype.kind}List", "apiVersion": rtype.api_version(self.version), "metadata": meta}
        if self.version != rtype.version and rtype.group:
            return self._send_json(200, {**head, "items": [list_item(rtype, self._out(o)) for o in items]})
        data = json.dumps(head, separators=(",", ":")).encode()[:-1] + b',"items":[' + b",".join(
            encoded_list_item(rtype, o) for o in items) + b"]}"
        self._send_json(200, None, data=data)

    def _send_json(self, code: int, obj: Any, headers: dict[str, str] | None = None, *,
                   data: bytes | None = None) -> None:
        if data is None:
            data = json.dumps(obj, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Audit-Id", "kubesim")
        for warning in self.warnings:
            self.send_header("Warning", '299 - "' + warning.replace('"', '\\"') + '"')
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self._end_with(data)

    def _node_power(self, method: str, path: str) -> None:
        """kubesim's own admin API, which no real API server has, the cluster admin's only: POST
        /kubesim/v1/nodes/{name}/power-off (or power-on) is how a test that runs kubesim as a process loses a node;
        GET /kubesim/v1/nodes says which nodes have power and counts the kubelets' heartbeat writes (their Lease
        renewals and status posts), which a count of the cluster's writes leaves out to see everyone else's."""
        parts = path.split("/")  # "", "kubesim", "v1", "nodes", name, action
        power, report = self.api.node_power, self.api.node_report
        if parts[1:4] != ["kubesim", "v1", "nodes"] or power is None or report is None or not (
                len(parts) == 4 or (len(parts) == 6 and parts[5] in ("power-off", "power-on"))):
            raise errors.ApiError(404, "NotFound", "the server could not find the requested resource")
        if method != ("GET" if len(parts) == 4 else "POST"):
            raise errors.method_not_allowed()
        if self.user != self.api.admin_user:
            raise errors.forbidden(f'User "{self.user}" cannot use kubesim\'s admin API')
        if len(parts) == 4:
            return self._send_json(200, report())
        try:
            power(parts[4], parts[5] == "power-on")
        except KeyError:
            raise errors.not_found("nodes", parts[4]) from None
        self._send_json(200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"})

    def _end_with(self, body: bytes) -> None:
        """end_headers and the body in one write: one TLS record and one TCP segment rather than two, so the
        client wakes once (the headers wait in BaseHTTPRequestHandler's own buffer until then)."""
        self._headers_buffer.append(b"\r\n" + body)
        self.flush_headers()

    # ---- routing

    def _route(self, method: str, path: str, raw: bytes) -> None:
        api = self.api
        if path in ("/healthz", "/readyz", "/livez"):
            data = b"ok"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", "2")
            self._end_with(data)
            return
        if path == "/version":
            return self._send_json(200, KUBE_VERSION)
        if path == "/metrics":
            data = api.metrics()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self._end_with(data)
            return
        if path == "/api":
            host = self.fields.get("Host", "")
            return self._send_json(200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs":
                                         [{"clientCIDR": "0.0.0.0/0", "serverAddress": host}]})
        if path == "/apis":
            return self._send_json(200, api.group_list())
        if path == "/openapi/v3":
            return self._send_json(200, api.openapi_root())
        if path.startswith("/openapi/v3/"):
            doc = api.openapi_group(path[len("/openapi/v3/"):])
            if doc is None:
                raise errors.ApiError(404, "NotFound", "the server could not find the requested resource")
            return self._send_json(200, doc)
        if path.startswith("/openapi/"):
            raise errors.ApiError(404, "NotFound", "the server could not find the requested resource")
        if path.startswith("/kubesim/"):
            return self._node_power(method, path)
        parts = [p for p in path.split("/") if p]
        if parts[0] == "api" and len(parts) >= 2:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[0] == "apis" and len(parts) >= 2:
            if len(parts) == 2:
                versions = api._groups().get(parts[1])
                if versions is None:
                    raise errors.ApiError(404, "NotFound", "the server could not find the requested resource")
                return self._send_json(200, {"kind": "APIGroup", "apiVersion": "v1",
                                             **api.api_group(parts[1], versions)})
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise errors.ApiError(404, "NotFound", "the server could not find the requested resource")
        if not rest:
            listing = api.resource_list(group, version)
            if listing is None:
                raise errors.ApiError(404, "NotFound", "the server could not find the requested resource")
            return self._send_json(200, listing)
        watch = False
        if rest[0] == "watch":
            watch, rest = True, rest[1:]
        namespace = ""
        if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] not in ("status", "finalize"):
            namespace, rest = rest[1], rest[2:]
        resource = rest[0] if rest else ""
        name = rest[1] if len(rest) > 1 else ""
        sub = "/".join(rest[2:])
        watching = watch or (method == "GET" and self.query.get("watch") in ("true", "1", "True"))
        self._counted_as(method, group, version, resource, sub, namespace, name, watching)
        sub_api = api.subresource_apis.get((group, version))
        if sub_api is not None:
            stream = sub_api.stream(resource, sub) if namespace and name else None
            if stream is not None:
                if method != "GET":
                    raise errors.method_not_allowed()
                return self._websocket(stream, namespace, name)
            if method == "POST" and namespace and resource in sub_api.creates and not name:
                body = self._decode(raw, self.fields.get("Content-Type", "application/json"))
                code, out = sub_api.handle(method, namespace, resource, "", "", body)
                return self._send_json(code, out)
            if method != "PUT" or not sub:
                raise errors.method_not_allowed()
            body = self._decode(raw, self.fields.get("Content-Type", "application/json"))
            code, out = sub_api.handle(method, namespace, resource, name, sub, body)
            return self._send_json(code, out) if out is not None else self._send_empty(code)
        rtype = api.store.find_type(group, resource)
        if rtype is None or version not in rtype.served_versions or (bool(namespace) and not rtype.namespaced):
            raise errors.ApiError(404, "NotFound", "the server could not find the requested resource")
        if rtype.schema is not None:
            self._counted_as(method, group, version, resource, sub, namespace, name, watching, custom=True)
        if rtype.key == "/pods" and sub == "log" and namespace and not watch:
            self.version, self.rtype = version, rtype
            if method != "GET":
                raise errors.method_not_allowed()
            return self._pod_log(rtype, namespace, name)
        if sub and (sub != "status" or not rtype.status_subresource) and not (
                rtype.plural == "namespaces" and sub == "finalize"):
            raise errors.ApiError(404, "NotFound", "the server could not find the requested resource")
        if rtype.namespaced and not namespace and name:
            raise errors.ApiError(404, "NotFound", "the server could not find the requested resource")
        self.version = version
        self.rtype = rtype
        if watch or (method == "GET" and not name and self.query.get("watch") in ("true", "1", "True")):
            if name:
                self.query["fieldSelector"] = ",".join(
                    filter(None, [self.query.get("fieldSelector", ""), f"metadata.name={name}"]))
            return self._watch(rtype, namespace)
        handler = {"GET": self._get, "POST": self._create, "PUT": self._update, "PATCH": self._patch,
                   "DELETE": self._delete}[method]
        handler(rtype, namespace, name, sub, raw)

    # ---- verbs

    def _out(self, obj: Obj) -> Obj:
        """An object as served at the requested version."""
        rtype = self.rtype
        if rtype.group and self.version != rtype.version:
            obj = {**obj, "apiVersion": rtype.api_version(self.version)}
        return obj

    def _get(self, rtype: ResourceType, namespace: str, name: str, sub: str, raw: bytes) -> None:
        if name:
            obj = self.api.store.get(rtype, namespace, name)
            if self._wants_table():
                return self._send_json(200, self._table(rtype, [obj], obj["metadata"]["resourceVersion"]))
            return self._send_object(200, obj)
        store = self.api.store
        selector = self.query.get("fieldSelector")
        items, rv = store.list(rtype, namespace, label_matcher(self.query.get("labelSelector")),
                               field_matcher(rtype, selector), selected_name(selector))
        meta: Obj = {"resourceVersion": str(rv)}
        token = self.query.get("continue")
        if token:
            rv, last = decode_continue(token)
            meta["resourceVersion"] = str(rv)
            items = [o for o in items if (o["metadata"].get("namespace", ""), o["metadata"]["name"]) > last]
        limit = int(self.query.get("limit") or 0)
        if limit > 0 and len(items) > limit:
            items = items[:limit]
            tail = items[-1]["metadata"]
            meta["continue"] = encode_continue(int(meta["resourceVersion"]), (tail.get("namespace", ""),
                                                                               tail["name"]))
        if self._wants_table():
            return self._send_json(200, self._table(rtype, items, meta["resourceVersion"], meta.get("continue")))
        self._send_list(rtype, meta, items)

    def _body(self, raw: bytes) -> Obj:
        body = self._decode(raw, self.fields.get("Content-Type", "application/json"))
        if not isinstance(body, dict):
            raise errors.bad_request("the body of the request must be an object")
        return body

    def _write_options(self) -> dict[str, Any]:
        field_validation = self.query.get("fieldValidation", "")
        if field_validation not in ("", "Strict", "Warn", "Ignore"):
            raise errors.bad_request(f'fieldValidation "{field_validation}" is not one of Ignore, Warn, Strict')
        return {"dry_run": self.query.get("dryRun") == "All", "field_validation": field_validation,
                "warnings": self.warnings}

    def _manager(self) -> str:
        manager = self.query.get("fieldManager")
        if manager:
            return manager
        agent = self.fields.get("User-Agent", "unknown")
        return agent.split("/")[0] or "unknown"

    def _check_kind(self, rtype: ResourceType, body: Obj) -> None:
        kind = body.get("kind")
        if kind and kind != rtype.kind:
            raise errors.bad_request(f"the API version in the data ({body.get('apiVersion')}) does not match "
                                     f"the expected API version ({rtype.api_version(self.version)})"
                                     if body.get("apiVersion") != rtype.api_version(self.version) else
                                     f"kind {kind} does not match {rtype.kind}")

    def _create(self, rtype: ResourceType, namespace: str, name: str, sub: str, raw: bytes) -> None:
        if name:
            raise errors.method_not_allowed()
        body = self._body(raw)
        self._check_kind(rtype, body)
        body["apiVersion"] = rtype.api_version()
        obj = self.api.store.create(rtype, body, namespace=namespace, manager=self._manager(),
                                    **self._write_options())
        self._send_object(201, obj)

    def _update(self, rtype: ResourceType, namespace: str, name: str, sub: str, raw: bytes) -> None:
        if not name:
            raise errors.method_not_allowed()
        body = self._body(raw)
        self._check_kind(rtype, body)
        obj = self.api.store.update(rtype, body, namespace=namespace, name=name, subresource=sub,
                                    manager=self._manager(), **self._write_options())
        self._send_object(200, obj)

    def _patch(self, rtype: ResourceType, namespace: str, name: str, sub: str, raw: bytes) -> None:
        if not name:
            raise errors.method_not_allowed()
        content_type = self.fields.get("Content-Type", "").split(";")[0].strip()
        if content_type not in (APPLY, "application/merge-patch+json", "application/strategic-merge-patch+json",
                                "application/json-patch+json"):
            raise errors.unsupported_media_type(content_type)
        body = self._decode(raw, content_type)
        manager = self.query.get("fieldManager", "") if content_type == APPLY else self._manager()
        force = self.query.get("force") in ("true", "1", "True")
        if force and content_type != APPLY:
            raise errors.bad_request("force is only valid for apply patches")
        obj, created = self.api.store.patch(rtype, namespace, name, content_type, body, subresource=sub,
                                            manager=manager, force=force, **self._write_options())
        self._send_object(201 if created else 200, obj)

    def _delete(self, rtype: ResourceType, namespace: str, name: str, sub: str, raw: bytes) -> None:
        opts = self._decode(raw, self.fields.get("Content-Type") or "application/json") if raw else {}
        opts = opts if isinstance(opts, dict) else {}
        propagation = self.query.get("propagationPolicy") or opts.get("propagationPolicy") or ""
        if propagation not in ("", "Background", "Foreground", "Orphan"):
            raise errors.unprocessable(f'propagationPolicy: Unsupported value: "{propagation}"')
        grace = self.query.get("gracePeriodSeconds", opts.get("gracePeriodSeconds"))
        grace_period = int(grace) if grace not in (None, "") else None
        dry_run = self.query.get("dryRun") == "All" or "All" in (opts.get("dryRun") or [])
        store = self.api.store
        if not name:
            items, _ = store.list(rtype, namespace, label_matcher(self.query.get("labelSelector")),
                                  field_matcher(rtype, self.query.get("fieldSelector")))
            deleted = []
            for item in items:
                try:
                    obj, _gone = store.delete(rtype, namespace or item["metadata"].get("namespace", ""),
                                              item["metadata"]["name"], propagation=propagation,
                                              grace_period=grace_period, dry_run=dry_run)
                    deleted.append(obj)
                except errors.ApiError as exc:
                    if exc.code != 404:
                        raise
            return self._send_json(200, {"kind": f"{rtype.kind}List", "apiVersion": rtype.api_version(),
                                         "metadata": {"resourceVersion": str(store.resource_version)},
                                         "items": [list_item(rtype, o) for o in deleted]})
        obj, gone = store.delete(rtype, namespace, name, propagation=propagation, grace_period=grace_period,
                                 preconditions=opts.get("preconditions"), dry_run=dry_run)
        if not gone or rtype.delete_returns_object:
            return self._send_object(200, obj)
        self._send_json(200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                              "details": {"name": name, "group": rtype.group, "kind": rtype.plural,
                                          "uid": obj["metadata"]["uid"]}})

    def _send_empty(self, code: int) -> None:
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    # ---- WebSocket subresources (virt-api's console)

    def _websocket(self, stream: Stream, namespace: str, name: str) -> None:
        """virt-api's websocketStreamRequestHandler: the request is checked first (a Status, as any error), then
        the upgrade (gorilla/websocket's checks and messages), then the stream runs on this connection until
        either end closes it or the server stops."""
        open_peer = stream.connect(namespace, name, self.query)
        key = self._websocket_key()
        offered = [p.strip() for p in self.fields.get("Sec-WebSocket-Protocol").split(",") if p.strip()]
        chosen = next((p for p in offered if p in stream.subprotocols), "")
        peer = open_peer()
        self.close_connection = True  # after the stream, the connection is done
        try:
            self.send_response(HTTPStatus.SWITCHING_PROTOCOLS)
            self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept", generate_accept_token(key.encode()).decode())
            if chosen:
                self.send_header("Sec-WebSocket-Protocol", chosen)
            self.end_headers()
            # RFC 6455 4.1: a client sends no frame before it has the answer, so nothing is left in self.rfile.
            run_websocket(self.connection, peer, self.api._stopping)
        finally:
            peer.close()

    def _websocket_key(self) -> str:
        def has_token(header: str, token: str) -> bool:
            return token in (t.strip().lower() for t in self.fields.get(header).split(","))

        missing = "websocket: the client is not using the websocket protocol: "
        if not has_token("Upgrade", "websocket"):
            raise errors.bad_request(missing + "'websocket' token not found in 'Upgrade' header")
        if not has_token("Connection", "upgrade"):
            raise errors.bad_request(missing + "'upgrade' token not found in 'Connection' header")
        if self.fields.get("Sec-WebSocket-Version").strip() != "13":
            raise errors.bad_request("websocket: unsupported version: 13 not found in 'Sec-Websocket-Version' header")
        key = self.fields.get("Sec-WebSocket-Key").strip()
        try:
            valid = len(base64.b64decode(key, validate=True)) == 16
        except (binascii.Error, ValueError):
            valid = False
        if not valid:
            raise errors.bad_request("websocket: not a websocket handshake: 'Sec-WebSocket-Key' header must be "
                                     "Base64 encoded value of 16-byte length")
        return key

    # ---- pods/log

    def _pod_log(self, rtype: ResourceType, namespace: str, name: str) -> None:
        """A container's output as text/plain; with `follow`, a chunked stream until the container's output ends,
        the client goes or a limit is reached."""
        opts = podlogs.parse_options(self.query, name)
        pod = self.api.store.get(rtype, namespace, name)
        container = podlogs.pick_container(pod, opts.container)
        log_of = self.api.container_logs
        run, found = None, None
        if (pod.get("spec") or {}).get("nodeName") and log_of is not None:
            container_id = podlogs.pick_container_id(pod, container, opts.previous)
            found = log_of(namespace, name, pod["metadata"]["uid"], container)
            run = found.run(container_id) if found is not None else None
        if run is None or found is None:  # not on a node yet, or a container that runs no process (fake kubelet)
            return self._send_text(b"")
        with found.changed:
            lines = podlogs.select(list(run.lines), opts, time.time())
            seen = len(run.lines)
        budget = opts.limit_bytes
        with open(found.path, "rb") as fh:
            if not opts.follow:
                data = b"".join(self._log_line(line, text, opts) for line, text in found.read(lines, fh))
                return self._send_text(data if budget is None else data[:budget])
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Cache-Control", "no-cache, private")
            self.end_headers()
            try:
                while True:
                    data = b"".join(self._log_line(line, text, opts) for line, text in found.read(lines, fh))
                    if budget is not None:
                        data, budget = data[:budget], budget - len(data[:budget])
                    if data:
                        self._chunk(data)
                    if budget == 0:
                        break
                    lines, seen, ended = self._more_lines(found, run, seen)
                    if ended and not lines:
                        break
                self._chunk(b"")
            except (BrokenPipeError, ConnectionResetError, OSError):
                self.close_connection = True

    def _more_lines(self, found: podlogs.ContainerLog, run: podlogs.Run, seen: int) \
            -> tuple[list[podlogs.Line], int, bool]:
        """Lines after the first `seen`, waiting for some; ended once the run's output is closed and all read.
        A client that closed its side (its socket reads as ready) raises ConnectionResetError."""
        while not self.api._stopping.is_set():
            with found.changed:
                if len(run.lines) == seen and not run.ended:
                    found.changed.wait(1.0)
                lines, ended = run.lines[seen:], run.ended
            if lines or ended:
                return lines, seen + len(lines), ended
            if _readable([self.connection], 0):
                raise ConnectionResetError("the client went away")
        return [], seen, True

    @staticmethod
    def _log_line(line: podlogs.Line, text: bytes, opts: podlogs.LogOptions) -> bytes:
        return podlogs.timestamp(line.at).encode() + b" " + text if opts.timestamps else text

    def _send_text(self, data: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self._end_with(data)

    # ---- watch

    def _initial_events(self) -> bool:
        """Watch-list (WatchList, on by default since 1.34): `sendInitialEvents=true` streams the current objects as
        ADDED events, then a bookmark annotated `k8s.io/initial-events-end`; client-go 1.36 informers ask for it.
        The checks are kube-apiserver's validateWatchOptions."""
        send, match = self.query.get("sendInitialEvents"), self.query.get("resourceVersionMatch", "")
        causes = []
        if send is not None and match != "NotOlderThan":
            causes.append({"field": "resourceVersionMatch", "reason": "FieldValueForbidden",
                           "message": "Forbidden: sendInitialEvents requires setting resourceVersionMatch to "
                                      "NotOlderThan"})
        if match and send is None:
            causes.append({"field": "resourceVersionMatch", "reason": "FieldValueForbidden",
                           "message": "Forbidden: resourceVersionMatch is forbidden for watch unless "
                                      "sendInitialEvents is provided"})
        if match and match != "NotOlderThan":
            causes.append({"field": "resourceVersionMatch", "reason": "FieldValueNotSupported",
                           "message": f'Unsupported value: "{match}": supported values: "NotOlderThan"'})
        if causes:
            raise errors.invalid("ListOptions", "", causes, group="meta.k8s.io")
        return send in ("true", "1", "True")

    def _watch(self, rtype: ResourceType, namespace: str) -> None:
        store = self.api.store
        timeout = float(self.query.get("timeoutSeconds") or 1800)
        bookmarks = self.query.get("allowWatchBookmarks") in ("true", "1", "True")
        initial_events = self._initial_events()
        # The initial events are the current state, which is never older than a resourceVersion given with them.
        rv = None if initial_events else self.query.get("resourceVersion") or None
        end_mark = initial_events and bookmarks  # kube-apiserver marks their end only for a watch with bookmarks
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache, private")
        self.end_headers()
        try:
            watcher = store.watch(rtype, namespace, self.query.get("labelSelector"),
                                  self.query.get("fieldSelector"), rv)
        except errors.ApiError as exc:
            self._chunk(json.dumps({"type": "ERROR", "object": exc.status()}).encode() + b"\n")
            self._chunk(b"")
            return
        deadline = time.monotonic() + timeout
        next_bookmark = time.monotonic() + self.api.bookmark_interval
        try:
            while not self.api._stopping.is_set() and not watcher.closed:
                now = time.monotonic()
                if now >= deadline:
                    break
                wait = min(deadline, next_bookmark if bookmarks else deadline, now + 1.0) - now
                if end_mark:
                    wait = 0.0  # only drain what is queued, then mark the end of the initial events
                event = watcher.next(max(wait, 0.01))
                if event is not None:
                    # What else is queued goes out in the same write: under load, one TLS record and one
                    # syscall for many events rather than one each.
                    self._chunk(b"".join(self._event_line(rtype, e) for e in [event, *watcher.drain(255)]))
                    continue
                if end_mark:  # the queue is drained: every initial ADDED event is out
                    end_mark = False
                    mark = {"type": "BOOKMARK", "object": {
                        "kind": rtype.kind, "apiVersion": rtype.api_version(self.version), "metadata": {
                            "resourceVersion": str(watcher.progress_rv),
                            "annotations": {"k8s.io/initial-events-end": "true"}}}}
                    self._chunk(json.dumps(mark).encode() + b"\n")
                    continue
                if bookmarks and time.monotonic() >= next_bookmark:
                    mark = {"type": "BOOKMARK", "object": {
                        "kind": rtype.kind, "apiVersion": rtype.api_version(self.version),
                        "metadata": {"resourceVersion": str(watcher.progress_rv)}}}
                    self._chunk(json.dumps(mark).encode() + b"\n")
                    next_bookmark = time.monotonic() + self.api.bookmark_interval
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.close_connection = True
        finally:
            watcher.close()

    def _event_line(self, rtype: ResourceType, event: Event) -> bytes:
        if self.version == rtype.version:
            return event.line()
        return json.dumps({"type": event.type, "object": self._out(event.obj)}).encode() + b"\n"

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    # ---- tables (kubectl get)

    def _wants_table(self) -> bool:
        accept = self.fields.get("Accept", "")
        return "as=Table" in accept

    def _table(self, rtype: ResourceType, items: list[Obj], rv: str, cont: str | None = None) -> Obj:
        include = self.query.get("includeObject") or "Metadata"
        if include not in ("None", "Metadata", "Object"):
            raise errors.bad_request(f'includeObject: Unsupported value: "{include}": supported values: "None", '
                                     '"Metadata", "Object"')
        if include == "Object":
            items = [self._out(o) for o in items]
        return printers.table(rtype, items, rv, cont, include, time.time())
