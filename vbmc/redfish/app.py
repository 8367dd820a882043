"""The Redfish service as a Flask app: one blueprint per resource family over one shared Service context.

- `service`: the context (machine, URIs, credentials, sessions, cached renderings) and the response helpers;
- `accounts`: authentication of every request, SessionService and sessions, AccountService;
- `systems`: the ComputerSystem, Reset, boot override and the inventory under it;
- `managers`: the Manager (its Reset, NetworkProtocol, EthernetInterfaces), the Chassis (its Drives, Power, Thermal);
- `media`: virtual media (from the Manager and from the System);
- `events`: the EventService, its subscriptions, SubmitTestEvent and the SSE stream;
- `logs`: the System's SEL and the Manager's audit trail, as LogServices.
This module holds what is not a resource family: the service root and OData documents, error rendering, and the
audit line per action. Rendering lives in `resources`, request bodies in `payloads`, error bodies in `errors`."""

from __future__ import annotations

import functools
import json
import logging
import re
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from flask import Blueprint, Flask, Response, g, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from ..access import audit
from ..access.throttle import LoginThrottle
from ..machine import BackendUnavailable, Machine, MachineError, Unsupported
from . import accounts, bios, events, logs, managers, media, resources, systems, tasks, updateservice
from .errors import RedfishError, not_found
from .eventservice import EventService, SubscriptionStore
from .resources import ROOT, SSE_URI, Ids
from .service import JSON_TYPE, ODATA_HEADERS, Service
from .sessions import SessionStore

log = logging.getLogger("vbmc.redfish")

try:
    from importlib.metadata import version as _dist_version

    VERSION = _dist_version("kubevbmc")
except Exception:  # not installed as a distribution (a source checkout): still a valid version string
    VERSION = "0.0.0"

ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
DEFAULT_PORTS = {"HTTP": 80, "HTTPS": 443, "IPMI": 623}  # what the agent's Service exposes (DESIGN.md 5)
FAMILIES = (accounts, tasks, systems, managers, media, events, logs, bios, updateservice)


def create_app(machine: Machine, username: str, password: str, *, system_id: str | None = None,
               manager_id: str = "BMC", chassis_id: str | None = None, session_timeout: int = 1800,
               clock: Callable[[], float] = time.monotonic, version: str = VERSION,
               ports: Mapping[str, int] | None = None, host_name: str | None = None,
               fqdn: str | None = None, bmc_uuid: str | None = None,
               throttle: LoginThrottle | None = None, subscriptions: SubscriptionStore | None = None,
               event_ca_file: str = "", require_tls: bool = False,
               consoles: resources.ConsoleAccess | None = None, tls_cert: str = "") -> Flask:
    """A Redfish service for one machine, with one account (`username`/`password`, HTTP Basic or sessions).

    `system_id` defaults to the machine's name (stable for a VM); `session_timeout` is the inactivity timeout
    in seconds; `clock` is injectable so that tests can expire sessions without waiting. `ports` are the
    ports clients reach the BMC on (the Service's), shown in the Manager's NetworkProtocol. `bmc_uuid` seeds
    the service and manager UUIDs (default: the machine's UUID). `throttle` slows password guessing per source
    address (vbmc/access/throttle.py); the agent shares one with its IPMI server. `subscriptions` keeps the
    EventService's subscriptions (default: in memory; the agent's is a Secret); `event_ca_file` adds CA
    certificates to the system's for HTTPS event destinations. `consoles` are the consoles the agent serves beside
    Redfish, which the System and the Manager advertise (GraphicalConsole, SerialConsole). `tls_cert` is the PEM
    certificate (chain) the agent serves HTTPS with, which the Manager describes ("" without HTTPS)."""
    if system_id is None or bmc_uuid is None:
        # Without both, the machine must answer now; the agent passes both so it can start before its VM exists.
        inventory = machine.inventory()
        system_id = system_id or inventory.name
        bmc_uuid = bmc_uuid or inventory.uuid
    chassis_id = chassis_id or system_id
    for value in (system_id, manager_id, chassis_id):
        if not ID_PATTERN.match(value):
            raise ValueError(f"not a usable Redfish Id: {value!r}")
    svc = Service(
        machine=machine, ids=Ids(system_id, manager_id, chassis_id), username=username, password=password,
        store=SessionStore(session_timeout, clock), throttle=throttle if throttle is not None else LoginThrottle(),
        version=version, ports=dict(DEFAULT_PORTS if ports is None else ports),
        host_name=host_name or socket.gethostname(), fqdn=fqdn, service_uuid=resources.service_uuid(bmc_uuid),
        manager_uuid=resources.manager_uuid(bmc_uuid), session_timeout=session_timeout, require_tls=require_tls,
        consoles=consoles, tls_cert=tls_cert)
    ids = svc.ids
    svc.events = EventService(machine.events, system=ids.system, system_name=ids.system_id,
                              media_base=f"{ids.manager}/VirtualMedia", store=subscriptions, ca_file=event_ca_file)
    svc.events.start()

    app = Flask("vbmc.redfish")
    app.config["MAX_CONTENT_LENGTH"] = 64 * 1024
    _strip_trailing_slash(app)
    _errors_and_audit(app, svc)

    @app.before_request
    def resetting() -> None:
        # First of all: a BMC being reset (Manager.Reset) answers nothing for a moment, not even a login.
        wait = svc.resetting()
        if wait:
            raise RedfishError(503, "ServiceTemporarilyUnavailable", wait, headers={"Retry-After": str(wait)},
                               detail="The BMC is being reset.")

    app.register_blueprint(_service_root(svc))
    for family in FAMILIES:
        app.register_blueprint(family.blueprint(svc))
    _protocol_checks(app)  # after authentication (accounts): a client without credentials learns nothing more
    app.extensions["vbmc.sessions"] = svc.store
    app.extensions["vbmc.service"] = svc
    app.extensions["vbmc.events"] = svc.events
    return app


def _service_root(svc: Service) -> Blueprint:
    """The service root, the versions document and the OData service and metadata documents."""
    bp = Blueprint("root", __name__)
    route, ids = svc.route, svc.ids
    metadata = _metadata()

    @route(bp, "/redfish")
    def versions() -> Response:
        return svc.static("versions", "ServiceRoot", resources.redfish_version)

    @route(bp, ROOT)
    def service_root() -> Response:
        return svc.static("root", "ServiceRoot", lambda: resources.service_root(
            ids, svc.service_uuid, "KubeVBMC", svc.version))

    @route(bp, f"{ROOT}/odata")
    def odata() -> Response:
        rendered = svc.cache.get("odata", "ServiceRoot", None, lambda: resources.odata_service(ids))
        return Response(rendered.body, headers=ODATA_HEADERS, content_type=JSON_TYPE)

    @route(bp, f"{ROOT}/$metadata")
    def csdl() -> Response:
        return Response(metadata, headers=ODATA_HEADERS, content_type="application/xml; charset=utf-8")

    return bp


@functools.cache
def _metadata() -> bytes:
    """The $metadata document: the same for every BMC of a process (9 KB each, else)."""
    return resources.metadata_xml().encode()


# Redfish-defined query parameters that do not start with "$" but that a client relies on when it sends them: refused
# like the "$" ones rather than ignored, so that nobody takes a whole collection for the excerpt it asked for.
REDFISH_QUERY = frozenset(("only", "excerpt", "includeoriginofcondition"))
QUERY_ALLOWED = {SSE_URI: frozenset(("$filter",))}  # the SSE stream's own filter (vbmc/redfish/events.py)


def _protocol_checks(app: Flask) -> None:
    """DSP0266's request rules that hold for every resource: OData-Version, query parameters, Content-Type."""

    @app.before_request
    def protocol() -> None:
        version = request.headers.get("OData-Version")
        if version is not None and version.strip() != "4.0":
            # DSP0266 "Request headers": reject an unsupported OData-Version with 412.
            raise RedfishError(412, "HeaderInvalid", f"OData-Version: {version}",
                               detail="This service supports OData-Version 4.0.")
        if request.args:  # the hot path has none: one truth test
            allowed = QUERY_ALLOWED.get(request.path, frozenset())
            for name in request.args:
                if (name.startswith("$") or name.lower() in REDFISH_QUERY) and name not in allowed:
                    # DSP0266 "Query parameters": 501 for an unsupported query parameter that starts with "$";
                    # others are ignored.
                    raise RedfishError(501, "QueryParameterUnsupported", name)
        content_type = request.headers.get("Content-Type")
        if content_type is not None and request.method in ("POST", "PATCH", "PUT") and \
                request.mimetype != "application/json" and \
                (request.content_length or "chunked" in request.headers.get("Transfer-Encoding", "")):
            # DSP0266 "Request headers": a body in another media type is 415; an empty one has no media type to
            # refuse (curl -d '' labels it form data). A body without a Content-Type is read as JSON (scripts that
            # send one without the header keep working).
            raise RedfishError(415, "HeaderInvalid", f"Content-Type: {content_type}",
                               detail="Request bodies must be application/json.")


def _errors_and_audit(app: Flask, svc: Service) -> None:
    """Every error as a Redfish error body; one audit line per action."""

    @app.errorhandler(RedfishError)
    def redfish_error(exc: RedfishError) -> Response:
        body = json.dumps(exc.body(), separators=(",", ":")).encode()
        return Response(body, status=exc.status, headers={**ODATA_HEADERS, **exc.headers}, content_type=JSON_TYPE)

    @app.errorhandler(MachineError)
    def machine_error(exc: MachineError) -> Response:
        return redfish_error(_from_machine_error(exc, request.path))

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Response:
        code = exc.code or 500
        if code == 404:
            return redfish_error(not_found(request.path))
        if isinstance(exc, MethodNotAllowed):
            methods = ", ".join(sorted(set(exc.valid_methods or ()) - {"OPTIONS"}))
            return redfish_error(RedfishError(405, "OperationNotAllowed", headers={"Allow": methods}))
        if code == 413:
            return redfish_error(RedfishError(413, "GeneralError", detail="The request body is too large."))
        return redfish_error(RedfishError(code, "GeneralError", detail=exc.description or ""))

    @app.errorhandler(Exception)
    def unexpected_error(exc: Exception) -> Response:
        # A bug, never the answer to input (the fuzz tests hold that): a Redfish 500 and one log line saying
        # where, instead of Flask's HTML page and multi-line traceback.
        log.error("redfish unexpected error: %s on %s %s at %s", _one_line(exc), request.method, request.path,
                  _origin(exc))
        return redfish_error(RedfishError(500, "GeneralError", detail="An internal error occurred."))

    @app.after_request
    def log_action(response: Response) -> Response:
        if request.method not in ("GET", "HEAD", "OPTIONS") and not g.get("audited"):
            # One audit line per action (vbmc/access/audit.py), the same fields as the IPMI frontend's.
            took = time.perf_counter() - g.get("started", time.perf_counter())
            audit.record(f"{request.method} {request.path}", svc.ids.system_id, str(response.status_code), took,
                         level=logging.INFO if response.status_code < 400 else logging.WARNING,
                         trail=svc.machine.audit_trail)
        return response


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())[:200]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _origin(exc: BaseException) -> str:
    """The innermost frame an exception was raised in, as file:line in function."""
    tb = exc.__traceback__
    if tb is None:
        return "?"
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return f"{code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno} in {code.co_name}"


def _from_machine_error(exc: MachineError, path: str) -> RedfishError:
    if isinstance(exc, BackendUnavailable):
        return RedfishError(503, "ServiceTemporarilyUnavailable", exc.retry_after, detail=str(exc),
                            headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, Unsupported):
        if "/Actions/" in path:
            return RedfishError(400, "ActionNotSupported", path.rsplit("/", 1)[-1], detail=str(exc))
        return RedfishError(400, "GeneralError", detail=str(exc))
    # InvalidRequest and anything else a backend raises: the machine's state does not allow it now.
    return RedfishError(409, "ResourceInUse", detail=str(exc))


def _strip_trailing_slash(app: Flask) -> None:
    """`/redfish/v1/` and `/redfish/v1` name the same resource (DSP0266 6.3); so does every other URI."""
    wsgi = app.wsgi_app

    def strip(environ: dict[str, Any], start_response: Any) -> Any:
        path = environ.get("PATH_INFO", "")
        if len(path) > 1 and path.endswith("/"):
            environ["PATH_INFO"] = path.rstrip("/") or "/"
        return wsgi(environ, start_response)

    app.wsgi_app = strip  # type: ignore[method-assign]

