"""The Redfish service as a Flask app: routes translate HTTP into Machine calls and back.

Rendering lives in `resources`, request bodies in `payloads`, error bodies in `errors`, sessions in `sessions`.
The hot path (GET of the System) renders and serialises only when the Machine's values changed: each resource
body is cached with its ETag, keyed by the values it was rendered from."""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import re
import socket
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from .. import audit
from ..machine import (
    BackendUnavailable,
    BootEnabled,
    BootMode,
    BootOverride,
    BootTarget,
    InvalidRequest,
    Inventory,
    Machine,
    MachineError,
    ResetType,
    Unsupported,
)
from ..throttle import LoginThrottle
from . import payloads, resources
from .errors import RedfishError, not_found
from .resources import ROOT, Ids
from .sessions import SessionStore

log = logging.getLogger("vbmc.redfish")

try:
    from importlib.metadata import version as _dist_version

    VERSION = _dist_version("kubevbmc")
except Exception:  # not installed as a distribution (a source checkout): still a valid version string
    VERSION = "0.0.0"

SESSIONS = f"{ROOT}/SessionService/Sessions"
# Reachable without credentials (DSP0266 13.3.1: the service root, $metadata and the OData service document;
# POST to Sessions is how a client logs in).
PUBLIC = frozenset(("/redfish", ROOT, f"{ROOT}/odata", f"{ROOT}/$metadata"))
ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
JSON_TYPE = "application/json; charset=utf-8"
DEFAULT_PORTS = {"HTTP": 80, "HTTPS": 443, "IPMI": 623}  # what the agent's Service exposes (DESIGN.md 5)
REALM = 'Basic realm="KubeVBMC", charset="UTF-8"'


@dataclass(frozen=True)
class Rendered:
    body: bytes
    etag: str
    kind: str  # schema name, for the Link header


def _etag(body: bytes) -> str:
    return '"' + hashlib.blake2b(body, digest_size=8).hexdigest() + '"'


class _Cache:
    """The last rendering of each resource and the key it was rendered from."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[Hashable, Rendered]] = {}

    def get(self, name: str, kind: str, key: Hashable, build: Callable[[], dict[str, Any]]) -> Rendered:
        hit = self._entries.get(name)
        if hit is not None and hit[0] == key:
            return hit[1]
        body = json.dumps(build(), separators=(",", ":")).encode()
        rendered = Rendered(body, _etag(body), kind)
        self._entries[name] = (key, rendered)  # a single assignment: safe for concurrent readers
        return rendered


def create_app(machine: Machine, username: str, password: str, *, system_id: str | None = None,
               manager_id: str = "BMC", chassis_id: str | None = None, session_timeout: int = 1800,
               clock: Callable[[], float] = time.monotonic, version: str = VERSION,
               ports: Mapping[str, int] | None = None, host_name: str | None = None,
               fqdn: str | None = None, bmc_uuid: str | None = None,
               throttle: LoginThrottle | None = None) -> Flask:
    """A Redfish service for one machine, with one account (`username`/`password`, HTTP Basic or sessions).

    `system_id` defaults to the machine's name (stable for a VM); `session_timeout` is the inactivity timeout
    in seconds; `clock` is injectable so that tests can expire sessions without waiting. `ports` are the
    ports clients reach the BMC on (the Service's), shown in the Manager's NetworkProtocol. `bmc_uuid` seeds
    the service and manager UUIDs (default: the machine's UUID). `throttle` slows password guessing per source
    address (vbmc/throttle.py); the agent shares one with its IPMI server."""
    ports = dict(DEFAULT_PORTS if ports is None else ports)
    host_name = host_name or socket.gethostname()
    if system_id is None or bmc_uuid is None:
        # Without both, the machine must answer now; the agent passes both so it can start before its VM exists.
        inventory = machine.inventory()
        system_id = system_id or inventory.name
        bmc_uuid = bmc_uuid or inventory.uuid
    chassis_id = chassis_id or system_id
    for value in (system_id, manager_id, chassis_id):
        if not ID_PATTERN.match(value):
            raise ValueError(f"not a usable Redfish Id: {value!r}")
    ids = Ids(system_id, manager_id, chassis_id)
    store = SessionStore(session_timeout, clock)
    throttle = throttle if throttle is not None else LoginThrottle()
    cache = _Cache()
    user_b, password_b = username.encode(), password.encode()
    service_uuid = resources.service_uuid(bmc_uuid)
    mgr_uuid = resources.manager_uuid(bmc_uuid)
    metadata = resources.metadata_xml().encode()

    app = Flask("vbmc.redfish")
    app.config["MAX_CONTENT_LENGTH"] = 64 * 1024
    _strip_trailing_slash(app)
    allow: dict[str, str] = {}  # endpoint -> Allow header value
    links = _LinkHeaders()

    # ---- plumbing: authentication, responses, errors

    def check_password(user: str, given: str) -> bool:
        # Compare both, always, in constant time: no timing hint about which one was wrong.
        ok_user = hmac.compare_digest(user.encode(), user_b)
        ok_password = hmac.compare_digest(given.encode(), password_b)
        return ok_user and ok_password

    # The Authorization header a client with the right credentials sends: compared as a whole first, so the
    # common case costs one constant-time comparison and no parsing.
    basic_header = "Basic " + base64.b64encode(user_b + b":" + password_b).decode()

    def refuse_if_throttled(protocol: str) -> None:
        """A source locked out after failed logins gets 429 with Retry-After before its credentials are looked
        at: neither a right nor a wrong password changes the answer, so the lockout tells a guesser nothing."""
        wait = throttle.retry_after(request.remote_addr or "")
        if wait > 0:
            throttle.refused(protocol)
            seconds = max(1, math.ceil(wait))
            raise RedfishError(429, "ServiceTemporarilyUnavailable", seconds,
                               detail="Too many failed logins from this address.",
                               headers={"Retry-After": str(seconds)})

    def login_failed(protocol: str, user: str) -> RedfishError:
        """The one place a Redfish login is decided to have failed (Basic auth or session login): counted
        against the source address, logged, and answered 401."""
        client = request.remote_addr or ""
        throttle.failed(client, protocol, user)
        g.audited = True  # one audit line, this one, not the request's too
        audit.record("login", system_id, f"denied: {protocol}: wrong user name or password",
                     actor=audit.Actor("redfish", client, user), level=logging.WARNING)
        detail = "The user name or password is incorrect." if protocol == "redfish-session" else ""
        return RedfishError(401, "NoValidSession", detail=detail, headers={"WWW-Authenticate": REALM})

    @app.before_request
    def authenticate() -> None:
        audit.bind(audit.Actor("redfish", request.remote_addr or ""))
        if request.method != "GET":
            g.started = time.perf_counter()
        path = request.path
        if path in PUBLIC or (path == SESSIONS and request.method == "POST"):
            return
        token = request.headers.get("X-Auth-Token")
        if token is not None:
            # A session token is not a password (24 random bytes): not throttled, so a client whose session
            # expired is not locked out for sending it a few more times.
            session = store.authenticate(token)
            if session is None:
                g.audited = True
                audit.record("login", system_id, "denied: unknown or expired session token", level=logging.WARNING)
                raise RedfishError(401, "NoValidSession", headers={"WWW-Authenticate": REALM})
            g.user = session.username
            g.session_id = session.id
            audit.bind(audit.Actor("redfish", request.remote_addr or "", session.username, session.id))
            return
        header = request.headers.get("Authorization")
        if header is None:
            raise RedfishError(401, "NoValidSession", headers={"WWW-Authenticate": REALM})
        refuse_if_throttled("redfish-basic")
        if hmac.compare_digest(header.encode(), basic_header.encode()):
            throttle.succeeded(request.remote_addr or "")
            g.user = username
            audit.bind(audit.Actor("redfish", request.remote_addr or "", username))
            return
        auth = request.authorization
        if auth is not None and auth.type == "basic" and check_password(auth.username or "", auth.password or ""):
            throttle.succeeded(request.remote_addr or "")
            g.user = auth.username
            audit.bind(audit.Actor("redfish", request.remote_addr or "", auth.username or ""))
            return
        if auth is None or auth.type != "basic":
            raise RedfishError(401, "NoValidSession", headers={"WWW-Authenticate": REALM})  # no password offered
        raise login_failed("redfish-basic", auth.username or "")

    def send(rendered: Rendered, status: int = 200, etag: bool = False,
             headers: dict[str, str] | None = None) -> Response:
        head = [("OData-Version", "4.0"), ("Cache-Control", "no-cache"), ("Link", links[rendered.kind])]
        rule = request.url_rule
        if rule is not None and rule.endpoint in allow:
            head.append(("Allow", allow[rule.endpoint]))
        if etag:
            head.append(("ETag", rendered.etag))
        if headers:
            head.extend(headers.items())
        return Response(rendered.body, status=status, headers=head, content_type=JSON_TYPE)

    def send_doc(kind: str, doc: dict[str, Any], status: int = 200,
                 headers: dict[str, str] | None = None) -> Response:
        body = json.dumps(doc, separators=(",", ":")).encode()
        return send(Rendered(body, "", kind), status, headers=headers)

    def no_content() -> Response:
        return Response(status=204, headers={"OData-Version": "4.0", "Cache-Control": "no-cache"})

    @app.errorhandler(RedfishError)
    def redfish_error(exc: RedfishError) -> Response:
        body = json.dumps(exc.body(), separators=(",", ":")).encode()
        head = {"OData-Version": "4.0", "Cache-Control": "no-cache", **exc.headers}
        return Response(body, status=exc.status, headers=head, content_type=JSON_TYPE)

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
            # One audit line per action (vbmc/audit.py), the same fields as the IPMI frontend's.
            took = time.perf_counter() - g.get("started", time.perf_counter())
            audit.record(f"{request.method} {request.path}", system_id, str(response.status_code), took,
                         level=logging.INFO if response.status_code < 400 else logging.WARNING)
        return response

    def body() -> dict[str, Any]:
        return payloads.load_json(request.get_data(cache=False))

    def check_if_match(current: Rendered) -> None:
        header = request.headers.get("If-Match")
        if header is None:
            return
        tags = [t.strip() for t in header.split(",")]
        # A weak validator of ours is the same tag: the representation is what it was hashed from.
        if "*" in tags or any(t.removeprefix("W/") == current.etag for t in tags):
            return
        raise RedfishError(412, "PreconditionFailed", headers={"ETag": current.etag})

    def route(rule: str, methods: Iterable[str] = ("GET",), endpoint: str = "") -> Callable[
            [Callable[..., Response]], Callable[..., Response]]:
        methods = tuple(methods)

        def register(view: Callable[..., Response]) -> Callable[..., Response]:
            name = endpoint or view.__name__
            app.add_url_rule(rule, name, view, methods=list(methods))
            shown = {*methods, "HEAD"} if "GET" in methods else set(methods)
            allow[name] = ", ".join(sorted(shown))
            return view

        return register

    # ---- renderings, cached by the values they come from

    def rendered_system() -> Rendered:
        key = (machine.power_state(), machine.health(), machine.boot_override(), machine.supported_boot_targets(),
               machine.supported_reset_types(), machine.inventory(), machine.media_slots())
        return cache.get("system", "ComputerSystem", key, lambda: resources.system(
            ids, key[0], key[1], key[2], key[3], key[4], key[5], bool(key[6])))

    def rendered_media(base: str, slot: str) -> Rendered:
        if slot not in machine.media_slots():
            raise not_found(request.path)
        media = machine.virtual_media(slot)
        return cache.get(f"media:{base}:{slot}", "VirtualMedia", media,
                         lambda: resources.virtual_media(base, media))

    def static(name: str, kind: str, build: Callable[[], dict[str, Any]]) -> Response:
        return send(cache.get(name, kind, None, build))

    # ---- service root and OData

    @route("/redfish")
    def versions() -> Response:
        return static("versions", "ServiceRoot", resources.redfish_version)

    @route(ROOT)
    def service_root() -> Response:
        return static("root", "ServiceRoot", lambda: resources.service_root(ids, service_uuid, "KubeVBMC",
                                                                            version))

    @route(f"{ROOT}/odata")
    def odata() -> Response:
        rendered = cache.get("odata", "ServiceRoot", None, lambda: resources.odata_service(ids))
        return Response(rendered.body, headers={"OData-Version": "4.0", "Cache-Control": "no-cache"},
                        content_type=JSON_TYPE)

    @route(f"{ROOT}/$metadata")
    def csdl() -> Response:
        return Response(metadata, headers={"OData-Version": "4.0", "Cache-Control": "no-cache"},
                        content_type="application/xml; charset=utf-8")

    # ---- systems

    @route(ids.systems)
    def systems() -> Response:
        return static("systems", "ComputerSystemCollection", lambda: resources.collection(
            "ComputerSystemCollection", ids.systems, "Computer Systems", [ids.system]))

    @route(ids.system, ("GET", "PATCH"))
    def system() -> Response:
        if request.method == "PATCH":
            return patch_system()
        return send(rendered_system(), etag=True)

    def patch_system() -> Response:
        current = rendered_system()
        check_if_match(current)
        readonly = json.loads(current.body)
        patch = payloads.parse_patch(payloads.SystemPatch, body(), readonly)
        if patch.Boot is not None:
            old = machine.boot_override()
            boot = patch.Boot
            target = old.target
            if boot.BootSourceOverrideTarget is not None:
                allowed = [t.value for t in machine.supported_boot_targets()]
                if boot.BootSourceOverrideTarget not in allowed:
                    raise RedfishError(400, "PropertyValueNotInList", boot.BootSourceOverrideTarget,
                                       "BootSourceOverrideTarget", related="#/Boot/BootSourceOverrideTarget")
                target = BootTarget(boot.BootSourceOverrideTarget)
            enabled = BootEnabled(boot.BootSourceOverrideEnabled) if boot.BootSourceOverrideEnabled else old.enabled
            mode = BootMode(boot.BootSourceOverrideMode) if boot.BootSourceOverrideMode else old.mode
            try:
                machine.set_boot_override(BootOverride(target, enabled, mode))
            except InvalidRequest as exc:
                raise RedfishError(400, "GeneralError", detail=str(exc)) from None
            except Unsupported as exc:
                raise RedfishError(400, "PropertyValueNotInList", target.value, "BootSourceOverrideTarget",
                                   detail=str(exc), related="#/Boot/BootSourceOverrideTarget") from None
        return send(rendered_system(), etag=True)

    @route(f"{ids.system}/Actions/ComputerSystem.Reset", ("POST",))
    def reset() -> Response:
        action = "ComputerSystem.Reset"
        parsed = payloads.parse_action(payloads.ResetAction, body(), action)
        allowed = [r.value for r in machine.supported_reset_types() if r != ResetType.NMI]
        if parsed.ResetType not in allowed:
            raise RedfishError(400, "ActionParameterValueNotInList", parsed.ResetType, "ResetType", action,
                               related="#/ResetType")
        machine.reset(ResetType(parsed.ResetType))
        return no_content()

    @route(f"{ids.system}/EthernetInterfaces")
    def nics() -> Response:
        inv = machine.inventory()
        path = f"{ids.system}/EthernetInterfaces"
        return send(cache.get("nics", "EthernetInterfaceCollection", inv, lambda: resources.collection(
            "EthernetInterfaceCollection", path, "Ethernet Interfaces", [f"{path}/{n.name}" for n in inv.nics])))

    @route(f"{ids.system}/EthernetInterfaces/<name>")
    def nic(name: str) -> Response:
        found = next((n for n in machine.inventory().nics if n.name == name), None)
        if found is None:
            raise not_found(request.path)
        power = machine.power_state()
        return send(cache.get(f"nic:{name}", "EthernetInterface", (found, power),
                              lambda: resources.ethernet_interface(ids, found.name, found.mac, power)))

    @route(f"{ids.system}/Processors")
    def cpus() -> Response:
        inv = machine.inventory()
        return send(cache.get("cpus", "ProcessorCollection", inv, lambda: resources.collection(
            "ProcessorCollection", f"{ids.system}/Processors", "Processors", resources.processors(ids, inv))))

    @route(f"{ids.system}/Processors/<cpu>")
    def cpu(cpu: str) -> Response:
        inv = machine.inventory()
        index = next((i for i in range(inv.cpu_sockets) if cpu == f"CPU{i}"), None)
        if index is None:
            raise not_found(request.path)
        return send_doc("Processor", resources.processor(ids, inv, index))

    @route(f"{ids.system}/Memory")
    def memories() -> Response:
        return static("memories", "MemoryCollection", lambda: resources.collection(
            "MemoryCollection", f"{ids.system}/Memory", "Memory",
            [f"{ids.system}/Memory/{resources.MEMORY_ID}"]))

    @route(f"{ids.system}/Memory/{resources.MEMORY_ID}")
    def memory() -> Response:
        inv = machine.inventory()
        return send(cache.get("memory", "Memory", inv, lambda: resources.memory(ids, inv)))

    def storage_routes(kind: str, title: str, name: str,
                       render: Callable[[Ids, Inventory], dict[str, Any]]) -> None:
        """A storage collection with its one member: SimpleStorage and Storage differ only in the rendering."""
        path = f"{ids.system}/{kind}"

        @route(path, endpoint=f"{name}s")
        def collection() -> Response:
            return static(f"{name}s", f"{kind}Collection", lambda: resources.collection(
                f"{kind}Collection", path, title, [f"{path}/{resources.STORAGE_ID}"]))

        @route(f"{path}/{resources.STORAGE_ID}", endpoint=name)
        def member() -> Response:
            inv = machine.inventory()
            return send(cache.get(name, kind, inv, lambda: render(ids, inv)))

    storage_routes("SimpleStorage", "Simple Storage", "simple_storage", resources.simple_storage)
    storage_routes("Storage", "Storage", "storage", resources.storage)

    @route(f"{ids.chassis}/Drives")
    def drives() -> Response:
        inv = machine.inventory()
        return send(cache.get("drives", "DriveCollection", inv, lambda: resources.collection(
            "DriveCollection", f"{ids.chassis}/Drives", "Drives", resources.drive_paths(ids, inv))))

    @route(f"{ids.chassis}/Drives/<name>")
    def drive(name: str) -> Response:
        for d in resources.disks(machine.inventory()):
            if d.name == name:
                return send_doc("Drive", resources.drive(ids, d.name, d.size_bytes))
        raise not_found(request.path)

    # ---- virtual media, reachable from the Manager and from the System (Ironic and bmclib look there)

    media_bases = {"Managers": f"{ids.manager}/VirtualMedia", "Systems": f"{ids.system}/VirtualMedia"}

    def media_base(owner: str) -> str:
        return media_bases["Managers" if request.path.startswith(ids.manager + "/") else "Systems"]

    for owner_path in (ids.manager, ids.system):
        app.add_url_rule(f"{owner_path}/VirtualMedia", f"media_collection:{owner_path}",
                         lambda owner=owner_path: media_collection(owner), methods=["GET"])
        allow[f"media_collection:{owner_path}"] = "GET, HEAD"
        app.add_url_rule(f"{owner_path}/VirtualMedia/<slot>", f"media:{owner_path}",
                         lambda slot, owner=owner_path: media(owner, slot), methods=["GET", "PATCH"])
        allow[f"media:{owner_path}"] = "GET, HEAD, PATCH"
        app.add_url_rule(f"{owner_path}/VirtualMedia/<slot>/Actions/VirtualMedia.InsertMedia",
                         f"insert:{owner_path}", lambda slot, owner=owner_path: insert_media(owner, slot),
                         methods=["POST"])
        app.add_url_rule(f"{owner_path}/VirtualMedia/<slot>/Actions/VirtualMedia.EjectMedia",
                         f"eject:{owner_path}", lambda slot, owner=owner_path: eject_media(owner, slot),
                         methods=["POST"])

    def media_collection(owner: str) -> Response:
        base = media_base(owner)
        slots = machine.media_slots()
        if not slots:
            raise not_found(request.path)
        return send(cache.get(f"media_collection:{base}", "VirtualMediaCollection", slots,
                              lambda: resources.collection("VirtualMediaCollection", base, "Virtual Media",
                                                           [f"{base}/{s}" for s in slots])))

    def media(owner: str, slot: str) -> Response:
        base = media_base(owner)
        current = rendered_media(base, slot)
        if request.method == "PATCH":
            check_if_match(current)
            patch = payloads.parse_patch(payloads.MediaPatch, body(), json.loads(current.body))
            try:
                if patch.Inserted is False or patch.Image == "":
                    machine.eject_media(slot)
                elif patch.Image is not None:
                    _check_image(patch.Image, "Image", None)
                    if machine.virtual_media(slot).inserted:
                        machine.eject_media(slot)  # PATCHing a new Image replaces the medium, as on a real BMC
                    machine.insert_media(patch.Image, slot,
                                         True if patch.WriteProtected is None else patch.WriteProtected)
                elif patch.Inserted and not machine.virtual_media(slot).inserted:
                    raise RedfishError(400, "PropertyMissing", "Image", related="#/Image")
            except Unsupported as exc:
                # No drive behind the slot (a VM without a cdrom disk): the System's configuration is the conflict.
                name, value = ("Image", patch.Image) if patch.Image else ("Inserted", bool(patch.Inserted))
                raise RedfishError(409, "PropertyValueResourceConflict", name, value, ids.system,
                                   detail=str(exc), related=f"#/{name}") from None
            current = rendered_media(base, slot)
        return send(current, etag=True)

    def check_drive(owner: str, slot: str, action: str) -> None:
        """404 for an unknown slot; ActionNotSupported, before the body is looked at, for one without a drive."""
        shown = json.loads(rendered_media(media_base(owner), slot).body)
        if shown["Status"]["State"] == "Absent":
            raise RedfishError(400, "ActionNotSupported", action, detail=shown.get("Description", ""))

    def insert_media(owner: str, slot: str) -> Response:
        action = "VirtualMedia.InsertMedia"
        check_drive(owner, slot, action)
        parsed = payloads.parse_action(payloads.InsertMediaAction, body(), action)
        for name, value in (("UserName", parsed.UserName), ("Password", parsed.Password)):
            if value:  # refused, never dropped: the import would fail later, with the reason out of sight
                raise RedfishError(400, "ActionParameterNotSupported", name, action, related=f"#/{name}",
                                   detail=IMAGE_CREDENTIALS)
        _check_image(parsed.Image, "Image", action)
        if not parsed.Inserted:
            raise RedfishError(400, "ActionParameterValueNotInList", "false", "Inserted", action,
                               detail="Only Inserted=true is supported.", related="#/Inserted")
        machine.insert_media(parsed.Image, slot, parsed.WriteProtected)
        return no_content()

    def eject_media(owner: str, slot: str) -> Response:
        check_drive(owner, slot, "VirtualMedia.EjectMedia")
        payloads.parse_action(payloads.EjectMediaAction, body(), "VirtualMedia.EjectMedia")
        machine.eject_media(slot)
        return no_content()

    # ---- manager and chassis

    @route(ids.managers)
    def managers() -> Response:
        return static("managers", "ManagerCollection", lambda: resources.collection(
            "ManagerCollection", ids.managers, "Managers", [ids.manager]))

    @route(ids.manager)
    def manager() -> Response:
        has_media = bool(machine.media_slots())
        return send(cache.get("manager", "Manager", has_media,
                              lambda: resources.manager(ids, mgr_uuid, version, has_media)))

    @route(f"{ids.manager}/NetworkProtocol")
    def network_protocol() -> Response:
        return static("network_protocol", "ManagerNetworkProtocol", lambda: resources.network_protocol(
            ids, host_name, fqdn, dict(ports)))

    @route(ids.chassis_collection)
    def chassis_collection() -> Response:
        return static("chassis_collection", "ChassisCollection", lambda: resources.collection(
            "ChassisCollection", ids.chassis_collection, "Chassis", [ids.chassis]))

    @route(ids.chassis)
    def chassis() -> Response:
        key = (machine.inventory(), machine.power_state(), machine.health())
        return send(cache.get("chassis", "Chassis", key, lambda: resources.chassis(ids, *key)))

    # ---- sessions

    @route(f"{ROOT}/SessionService")
    def session_service() -> Response:
        return static("session_service", "SessionService",
                      lambda: resources.session_service(int(session_timeout)))

    @route(SESSIONS, ("GET", "POST"))
    def sessions() -> Response:
        if request.method == "POST":
            return login()
        members = [f"{SESSIONS}/{s.id}" for s in store.list()]
        return send_doc("SessionCollection", resources.collection("SessionCollection", SESSIONS, "Sessions",
                                                                  members))

    def login() -> Response:
        doc = body()
        creds = payloads.parse_patch(payloads.SessionCreate, {k: v for k, v in doc.items()
                                                              if k in ("UserName", "Password")}, {})
        refuse_if_throttled("redfish-session")
        if not check_password(creds.UserName, creds.Password):
            raise login_failed("redfish-session", creds.UserName)
        throttle.succeeded(request.remote_addr or "")
        session = store.create(creds.UserName, request.remote_addr or "")
        g.user = creds.UserName
        audit.bind(audit.Actor("redfish", request.remote_addr or "", creds.UserName, session.id))
        location = f"{SESSIONS}/{session.id}"
        return send_doc("Session", resources.session(session), 201,
                        headers={"X-Auth-Token": session.token, "Location": location})

    @route(f"{SESSIONS}/<session_id>", ("GET", "DELETE"))
    def session(session_id: str) -> Response:
        found = store.get(session_id)
        if found is None:
            raise not_found(request.path)
        if request.method == "DELETE":
            store.delete(session_id)
            return no_content()
        return send_doc("Session", resources.session(found))

    # ---- accounts (read-only: the one account comes from the VirtualMachineBMC's Secret)

    @route(f"{ROOT}/AccountService")
    def account_service() -> Response:
        return static("account_service", "AccountService", resources.account_service)

    @route(f"{ROOT}/AccountService/Accounts")
    def accounts() -> Response:
        path = f"{ROOT}/AccountService/Accounts"
        return static("accounts", "ManagerAccountCollection", lambda: resources.collection(
            "ManagerAccountCollection", path, "Accounts", [f"{path}/{resources.ACCOUNT_ID}"]))

    @route(f"{ROOT}/AccountService/Accounts/{resources.ACCOUNT_ID}")
    def account() -> Response:
        return static("account", "ManagerAccount", lambda: resources.account(username))

    @route(f"{ROOT}/AccountService/Roles")
    def roles() -> Response:
        path = f"{ROOT}/AccountService/Roles"
        return static("roles", "RoleCollection", lambda: resources.collection(
            "RoleCollection", path, "Roles", [f"{path}/{r}" for r in resources.ROLES]))

    @route(f"{ROOT}/AccountService/Roles/<role_id>")
    def role(role_id: str) -> Response:
        if role_id not in resources.ROLES:
            raise not_found(request.path)
        return static(f"role:{role_id}", "Role", lambda: resources.role(role_id))

    app.extensions["vbmc.sessions"] = store
    return app


class _LinkHeaders(dict[str, str]):
    """schema name -> its `Link: <...>; rel=describedby` value, built once per schema."""

    def __missing__(self, kind: str) -> str:
        value = self[kind] = f"<{resources.schema_uri(kind)}>; rel=describedby"
        return value


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


MAX_IMAGE_URL = 2048
# RFC 3986 reg-name, ASCII only (an internationalised host name is given in its punycode form).
_HOST = re.compile(r"^[A-Za-z0-9._~!$&'()*+,;=%-]+$")


def image_url_problem(image: str) -> str | None:
    """Why `image` is not an http(s) URL the importer can fetch, or None when it is one."""
    if len(image) > MAX_IMAGE_URL:
        return f"The image URL is longer than {MAX_IMAGE_URL} characters."
    if any(c <= " " or c == "\x7f" for c in image):
        return "The image URL contains a space or a control character."
    try:
        parts = urlsplit(image)
        host, port = parts.hostname, parts.port  # both parse the authority, and raise on a malformed one
    except ValueError as exc:
        return f"The image URL is malformed: {exc}."
    if parts.scheme not in ("http", "https"):
        return "The image must be an http or https URL."
    if not host:
        return "The image URL has no host."
    if parts.netloc.rpartition("@")[2].startswith("["):
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            return "The image URL's host is not an IPv6 address."
    elif not _HOST.match(host):
        return "The image URL's host is not a valid host name."
    if port == 0:
        return "The image URL's port is out of range."
    return None


IMAGE_CREDENTIALS = (
    "Image credentials are not stored by the BMC (it would have to create Secrets, which its Role cannot limit by "
    "name). Use an image URL that needs none, or put them in the URL (http://user:password@host/image.iso): the "
    "DataVolume then holds them, and the BMC shows the URL without them.")


def _check_image(image: str, name: str, action: str | None) -> None:
    problem = image_url_problem(image)
    if problem is None:
        return
    if action is None:
        raise RedfishError(400, "PropertyValueFormatError", image, name, related=f"#/{name}", detail=problem)
    raise RedfishError(400, "ActionParameterValueFormatError", image, name, action, related=f"#/{name}",
                       detail=problem)


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

