"""What every Redfish resource family shares: the Service context.

One `Service` per app holds the machine, the URIs (`Ids`), the credentials and login throttle, the session store,
the cache of renderings, and the response helpers every route uses (`send`, `send_doc`, `no_content`,
`check_if_match`, `body`). Each family is a module that builds a Flask blueprint from the Service (`systems`,
`managers`, `media`, `accounts`, ...): the routes stay thin, call the Machine and render with `resources`.

The hot path (GET of the System) renders and serialises only when the Machine's values changed: each resource body
is cached with its ETag, keyed by the values it was rendered from."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flask import Blueprint, Response, g, request

from ..access import audit
from ..access.throttle import LoginThrottle
from ..machine import Machine
from ..machine.events import MANAGER_RESET
from . import payloads, resources
from .errors import RedfishError
from .eventservice import EventService
from .resources import ConsoleAccess, Ids
from .sessions import SessionStore
from .taskstore import TaskStore

JSON_TYPE = "application/json; charset=utf-8"
REALM = 'Basic realm="KubeVBMC", charset="UTF-8"'
ODATA_HEADERS = {"OData-Version": "4.0", "Cache-Control": "no-cache"}
RESET_WINDOW = 3.0  # seconds a Manager.Reset keeps the Redfish service answering 503

View = Callable[..., Response]


@dataclass(frozen=True)
class Rendered:
    body: bytes
    etag: str
    kind: str  # schema name, for the Link header


def etag_of(body: bytes) -> str:
    return '"' + hashlib.blake2b(body, digest_size=8).hexdigest() + '"'


class RenderCache:
    """The last rendering of each resource and the key it was rendered from."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[Hashable, Rendered]] = {}

    def get(self, name: str, kind: str, key: Hashable, build: Callable[[], dict[str, Any]]) -> Rendered:
        hit = self._entries.get(name)
        if hit is not None and hit[0] == key:
            return hit[1]
        body = json.dumps(build(), separators=(",", ":")).encode()
        rendered = Rendered(body, etag_of(body), kind)
        self._entries[name] = (key, rendered)  # a single assignment: safe for concurrent readers
        return rendered


class LinkHeaders(dict[str, str]):
    """schema name -> its `Link: <...>; rel=describedby` value, built once per schema."""

    def __missing__(self, kind: str) -> str:
        value = self[kind] = f"<{resources.schema_uri(kind)}>; rel=describedby"
        return value


@dataclass
class Service:
    """The context every resource family's blueprint is built from."""

    machine: Machine
    ids: Ids
    username: str
    password: str
    store: SessionStore
    throttle: LoginThrottle
    version: str
    ports: Mapping[str, int]
    host_name: str
    fqdn: str | None
    service_uuid: str
    manager_uuid: str
    session_timeout: int
    require_tls: bool = False  # refuse credentials that come over plain HTTP (spec.redfish.requireTLS)
    consoles: ConsoleAccess | None = None  # the consoles served beside Redfish (the agent's vbmc/web)
    tls_cert: str = field(default="", repr=False)  # PEM: the certificate (chain) HTTPS is served with, "" without
    reset_until: float = 0.0  # time.monotonic() until which a Manager.Reset keeps the service answering 503
    events: EventService | None = None  # vbmc/redfish/eventservice.py: subscriptions, delivery, SSE
    tasks: TaskStore = field(default_factory=lambda: TaskStore())
    cache: RenderCache = field(default_factory=RenderCache)
    links: LinkHeaders = field(default_factory=LinkHeaders)
    allow: dict[str, str] = field(default_factory=dict)  # endpoint -> Allow header value

    def reset_manager(self, reset_type: str) -> None:
        """Manager.Reset, as an agent can mean it: every Redfish session ends, the service answers 503 for
        RESET_WINDOW seconds, and the machine's bus says so (the IPMI frontend ends its sessions too; the
        VirtualMachineBMC gets an Event). The VM is not touched."""
        self.store.clear()
        self.reset_until = time.monotonic() + RESET_WINDOW
        machine = self.machine

        def announce() -> None:  # may take a second (a Kubernetes Event): not on the request's thread
            machine.record_event(MANAGER_RESET, f"the BMC was reset ({reset_type}): its sessions ended; the VM was "
                                                "not touched")

        threading.Thread(target=announce, daemon=True).start()

    def resetting(self) -> int:
        """Seconds left (rounded up) in a reset's window; 0 when the service answers."""
        left = self.reset_until - time.monotonic()
        return int(left) + 1 if left > 0 else 0

    def __post_init__(self) -> None:
        user_b, password_b = self.username.encode(), self.password.encode()
        self._user_b, self._password_b = user_b, password_b
        # The Authorization header a client with the right credentials sends: compared as a whole first, so the
        # common case costs one constant-time comparison and no parsing.
        self.basic_header = ("Basic " + base64.b64encode(user_b + b":" + password_b).decode()).encode()

    # ---- routes

    def route(self, bp: Blueprint, rule: str, methods: Iterable[str] = ("GET",),
              endpoint: str = "") -> Callable[[View], View]:
        """Register a view on a blueprint and remember its Allow header (HEAD comes with GET)."""
        methods = tuple(methods)

        def register(view: View) -> View:
            name = endpoint or view.__name__
            bp.add_url_rule(rule, name, view, methods=list(methods))
            shown = {*methods, "HEAD"} if "GET" in methods else set(methods)
            # Interned: every BMC of a pool has the same endpoints, and these strings once (14 KB a BMC, else).
            self.allow[sys.intern(f"{bp.name}.{name}")] = sys.intern(", ".join(sorted(shown)))
            return view

        return register

    # ---- responses

    def send(self, rendered: Rendered, status: int = 200, etag: bool = False,
             headers: dict[str, str] | None = None, messages: list[dict[str, Any]] | None = None) -> Response:
        """`etag`: the resource can be written (DSP0266: an ETag on every GET of a resource a client may PATCH, so
        that it can send If-Match); `messages`: what a partly applied PATCH did not apply, in the body's
        `@Message.ExtendedInfo`."""
        head = [("OData-Version", "4.0"), ("Cache-Control", "no-cache"), ("Link", self.links[rendered.kind])]
        rule = request.url_rule
        if rule is not None and rule.endpoint in self.allow:
            head.append(("Allow", self.allow[rule.endpoint]))
        if etag:
            head.append(("ETag", rendered.etag))
            if status == 200 and request.method == "GET" and self._not_modified(rendered.etag):
                # RFC 9110 13.1.2 (DSP0266 lists If-None-Match): the client's copy is current.
                return Response(status=304, headers=head)
        if headers:
            head.extend(headers.items())
        body = rendered.body
        if messages:
            doc = json.loads(body)
            doc["@Message.ExtendedInfo"] = messages
            body = json.dumps(doc, separators=(",", ":")).encode()
        return Response(body, status=status, headers=head, content_type=JSON_TYPE)

    def send_doc(self, kind: str, doc: dict[str, Any], status: int = 200,
                 headers: dict[str, str] | None = None, etag: bool = False,
                 messages: list[dict[str, Any]] | None = None) -> Response:
        body = json.dumps(doc, separators=(",", ":")).encode()
        return self.send(Rendered(body, etag_of(body) if etag else "", kind), status, etag=etag, headers=headers,
                         messages=messages)

    def static(self, name: str, kind: str, build: Callable[[], dict[str, Any]]) -> Response:
        """A resource that never changes while the app runs: rendered once."""
        return self.send(self.cache.get(name, kind, None, build))

    @staticmethod
    def no_content() -> Response:
        return Response(status=204, headers=ODATA_HEADERS)

    # ---- requests

    @staticmethod
    def body() -> dict[str, Any]:
        return payloads.load_json(request.get_data(cache=False))

    @staticmethod
    def _not_modified(etag: str) -> bool:
        header = request.headers.get("If-None-Match")
        if not header:
            return False
        # If-None-Match compares weakly (RFC 9110 13.1.2): W/"x" matches "x".
        tags = {t.strip().removeprefix("W/") for t in header.split(",")}
        return "*" in tags or etag in tags

    @staticmethod
    def check_if_match(current: Rendered) -> None:
        header = request.headers.get("If-Match")
        if header is None:
            return
        tags = [t.strip() for t in header.split(",")]
        # If-Match compares strongly (RFC 9110 13.1.1): a weak tag never matches, whatever it names.
        if "*" in tags or current.etag in tags:
            return
        raise RedfishError(412, "PreconditionFailed", headers={"ETag": current.etag})

    # ---- credentials

    def check_password(self, user: str, given: str) -> bool:
        # Compare both, always, in constant time: no timing hint about which one was wrong.
        ok_user = hmac.compare_digest(user.encode(), self._user_b)
        ok_password = hmac.compare_digest(given.encode(), self._password_b)
        return ok_user and ok_password

    def refuse_if_throttled(self, protocol: str) -> None:
        """A source locked out after failed logins gets 429 with Retry-After before its credentials are looked
        at: neither a right nor a wrong password changes the answer, so the lockout tells a guesser nothing."""
        wait = self.throttle.retry_after(request.remote_addr or "")
        if wait > 0:
            self.throttle.refused(protocol)
            seconds = max(1, math.ceil(wait))
            raise RedfishError(429, "ServiceTemporarilyUnavailable", seconds,
                               detail="Too many failed logins from this address.",
                               headers={"Retry-After": str(seconds)})

    def login_failed(self, protocol: str, user: str) -> RedfishError:
        """The one place a Redfish login is decided to have failed (Basic auth or session login): counted
        against the source address, logged, and answered 401."""
        client = request.remote_addr or ""
        self.throttle.failed(client, protocol, user)
        g.audited = True  # one audit line, this one, not the request's too
        audit.record("login", self.ids.system_id, f"denied: {protocol}: wrong user name or password",
                     actor=audit.Actor("redfish", client, user), level=logging.WARNING, trail=self.machine.audit_trail)
        detail = "The user name or password is incorrect." if protocol == "redfish-session" else ""
        return RedfishError(401, "NoValidSession", detail=detail, headers={"WWW-Authenticate": REALM})
