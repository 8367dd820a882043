"""Sessions and accounts: who may talk to the service (authentication on every request), the SessionService and
its sessions (login, logout, the sessions view), and the read-only AccountService (the one account comes from the
VirtualMachineBMC's Secret).

Privileges are Redfish's (resources.ROLES): the one account is an Administrator, so it may do everything; a
caller of another role (none exists today) is refused with 403 InsufficientPrivilege where `require` says so.
Changing SessionService.SessionTimeout and ending another's session need ConfigureManager; ending one's own
session needs ConfigureSelf; every session may read every session (Login)."""

from __future__ import annotations

import hmac
import json
import logging
import time

from flask import Blueprint, Response, g, request

from ..access import audit
from . import payloads, resources
from .errors import RedfishError, not_found
from .resources import ROOT
from .service import REALM, Rendered, Service
from .sessions import Session

SESSIONS = f"{ROOT}/SessionService/Sessions"
SESSION_MEMBERS = f"{SESSIONS}/Members"  # DSP0266 "Session login": a POST here creates a session too
LOGINS = frozenset((SESSIONS, SESSION_MEMBERS))
# Reachable without credentials (DSP0266 13.3.1: the service root, $metadata and the OData service document;
# POST to Sessions is how a client logs in).
PUBLIC = frozenset(("/redfish", ROOT, f"{ROOT}/odata", f"{ROOT}/$metadata"))
# SessionService.SessionTimeout's bounds in DMTF's schema (Validation.Minimum and Maximum): a service shall take any
# value between them.
TIMEOUT_MIN, TIMEOUT_MAX = 30, 86400
# The header the BMC's page sends with its login: its sessions show as SessionType WebUI. A label a client gives
# itself, nothing more: it grants nothing.
CLIENT_HEADER = "X-KubeVBMC-Client"


def role_of(svc: Service, user: str) -> str:
    """The Redfish role of an authenticated user: the account of the VirtualMachineBMC's Secret is the
    Administrator (AccountService/Accounts/1); anyone else, should one ever authenticate, the least role."""
    return "Administrator" if hmac.compare_digest(user.encode(), svc.username.encode()) else "ReadOnly"


def allowed(role: str, privilege: str) -> bool:
    return privilege in resources.ROLES.get(role, ())


def require(svc: Service, privilege: str) -> None:
    """403 InsufficientPrivilege unless the caller's role has `privilege`."""
    role = role_of(svc, g.get("user") or "")
    if not allowed(role, privilege):
        raise RedfishError(403, "InsufficientPrivilege",
                           detail=f"This needs the {privilege} privilege, which the {role} role does not have.")


def session_type(header: str | None) -> str:
    """Session.SessionType of a login: WebUI when the BMC's page logs in (CLIENT_HEADER: page), else Redfish."""
    return "WebUI" if (header or "").strip().lower() == "page" else "Redfish"


def authenticate(svc: Service) -> None:
    """Before every request: a public resource, a session token, or HTTP Basic credentials; else 401."""
    audit.bind(audit.Actor("redfish", request.remote_addr or ""))
    if request.method != "GET":
        g.started = time.perf_counter()
    path = request.path
    if svc.require_tls and request.scheme != "https" and (
            "X-Auth-Token" in request.headers or "Authorization" in request.headers
            or (path in LOGINS and request.method == "POST")):
        # Credentials over plain HTTP are refused before they are looked at: nothing is compared, nothing is
        # counted against the address; the client is told where to go instead.
        raise RedfishError(403, "GeneralError", detail=(
            "This BMC accepts credentials over HTTPS only (spec.redfish.requireTLS): use https:// (Metal3: "
            "redfish:// or redfish+https://)."))
    if path in PUBLIC or (path in LOGINS and request.method == "POST"):
        return
    token = request.headers.get("X-Auth-Token")
    if token is not None:
        # A session token is not a password (24 random bytes): not throttled, so a client whose session
        # expired is not locked out for sending it a few more times.
        session = svc.store.authenticate(token)
        if session is None:
            g.audited = True
            audit.record("login", svc.ids.system_id, "denied: unknown or expired session token",
                         level=logging.WARNING, trail=svc.machine.audit_trail)
            raise RedfishError(401, "NoValidSession", headers={"WWW-Authenticate": REALM})
        g.user = session.username
        g.session_id = session.id
        audit.bind(audit.Actor("redfish", request.remote_addr or "", session.username, session.id))
        return
    header = request.headers.get("Authorization")
    if header is None:
        raise RedfishError(401, "NoValidSession", headers={"WWW-Authenticate": REALM})
    svc.refuse_if_throttled("redfish-basic")
    if hmac.compare_digest(header.encode(), svc.basic_header):
        svc.throttle.succeeded(request.remote_addr or "")
        g.user = svc.username
        audit.bind(audit.Actor("redfish", request.remote_addr or "", svc.username))
        return
    auth = request.authorization
    if auth is not None and auth.type == "basic" and svc.check_password(auth.username or "", auth.password or ""):
        svc.throttle.succeeded(request.remote_addr or "")
        g.user = auth.username
        audit.bind(audit.Actor("redfish", request.remote_addr or "", auth.username or ""))
        return
    if auth is None or auth.type != "basic":
        raise RedfishError(401, "NoValidSession", headers={"WWW-Authenticate": REALM})  # no password offered
    raise svc.login_failed("redfish-basic", audit.attempted_user(auth.username or "", svc.username))


def blueprint(svc: Service) -> Blueprint:
    bp = Blueprint("accounts", __name__)
    route, store = svc.route, svc.store
    bp.before_app_request(lambda: authenticate(svc))

    # ---- sessions

    def rendered_session_service() -> Rendered:
        timeout = int(store.timeout)
        return svc.cache.get("session_service", "SessionService", timeout,
                             lambda: resources.session_service(timeout))

    @route(bp, f"{ROOT}/SessionService", ("GET", "PATCH"))
    def session_service() -> Response:
        if request.method == "PATCH":
            return patch_session_service()
        return svc.send(rendered_session_service(), etag=True)

    def patch_session_service() -> Response:
        require(svc, "ConfigureManager")
        current = rendered_session_service()
        svc.check_if_match(current)
        patch, refused = payloads.parse_partial_patch(payloads.SessionServicePatch, svc.body(),
                                                      json.loads(current.body))
        timeout = patch.SessionTimeout
        if timeout is not None:
            if not TIMEOUT_MIN <= timeout <= TIMEOUT_MAX:
                raise RedfishError(400, "PropertyValueOutOfRange", timeout, "SessionTimeout",
                                   related="#/SessionTimeout",
                                   detail=f"It must be between {TIMEOUT_MIN} and {TIMEOUT_MAX} seconds.")
            before = int(store.timeout)
            store.set_timeout(timeout)  # every session, at its next request (or its console's next look)
            svc.session_timeout = timeout
            g.audited = True  # this line says more than the request's would
            took = time.perf_counter() - g.get("started", time.perf_counter())
            audit.record(f"PATCH {request.path}", svc.ids.system_id, f"SessionTimeout {before} s -> {timeout} s",
                         took, trail=svc.machine.audit_trail)
        return svc.send(rendered_session_service(), etag=True, messages=refused)

    @route(bp, SESSIONS, ("GET", "POST"))
    def sessions() -> Response:
        if request.method == "POST":
            return login()
        members = [f"{SESSIONS}/{s.id}" for s in store.list()]
        return svc.send_doc("SessionCollection", resources.collection("SessionCollection", SESSIONS, "Sessions",
                                                                      members))

    @route(bp, SESSION_MEMBERS, ("POST",))
    def session_members() -> Response:
        return login()

    def login() -> Response:
        doc = svc.body()
        creds = payloads.parse_patch(payloads.SessionCreate, {k: v for k, v in doc.items()
                                                              if k in ("UserName", "Password")}, {})
        svc.refuse_if_throttled("redfish-session")
        if not svc.check_password(creds.UserName, creds.Password):
            raise svc.login_failed("redfish-session", audit.attempted_user(creds.UserName, svc.username))
        svc.throttle.succeeded(request.remote_addr or "")
        session = store.create(creds.UserName, request.remote_addr or "", session_type(request.headers.get(
            CLIENT_HEADER)))
        g.user = creds.UserName
        audit.bind(audit.Actor("redfish", request.remote_addr or "", creds.UserName, session.id))
        location = f"{SESSIONS}/{session.id}"
        return svc.send_doc("Session", resources.session(session, current=True), 201,
                            headers={"X-Auth-Token": session.token, "Location": location})

    @route(bp, f"{SESSIONS}/<session_id>", ("GET", "DELETE"))
    def session(session_id: str) -> Response:
        found = store.get(session_id)
        if found is None:
            raise not_found(request.path)
        own = found.id == g.get("session_id")
        if request.method == "DELETE":
            return end_session(found, own)
        return svc.send_doc("Session", resources.session(found, store.viewers(found), own))

    def end_session(found: Session, own: bool) -> Response:
        """Log out (one's own session), or end another's: an administrator's right, audited as who ended whose.
        Its consoles close within a second (vbmc/web/consoles.py looks at their session)."""
        if own:
            require(svc, "ConfigureSelf")
            store.delete(found.id)
            return svc.no_content()
        require(svc, "ConfigureManager")
        consoles = len(store.viewers(found))
        if not store.delete(found.id):
            raise not_found(request.path)  # ended meanwhile (logged out, expired)
        g.audited = True
        took = time.perf_counter() - g.get("started", time.perf_counter())
        audit.record(f"DELETE {request.path}", svc.ids.system_id,
                     f"ended session {found.id} of user {found.username} from {found.origin or 'an unknown address'}"
                     f" ({consoles} console{'' if consoles == 1 else 's'} open)", took, trail=svc.machine.audit_trail)
        return svc.no_content()

    # ---- accounts (read-only: the one account comes from the VirtualMachineBMC's Secret)

    @route(bp, f"{ROOT}/AccountService")
    def account_service() -> Response:
        return svc.static("account_service", "AccountService", resources.account_service)

    @route(bp, f"{ROOT}/AccountService/Accounts")
    def accounts() -> Response:
        path = f"{ROOT}/AccountService/Accounts"
        return svc.static("accounts", "ManagerAccountCollection", lambda: resources.collection(
            "ManagerAccountCollection", path, "Accounts", [f"{path}/{resources.ACCOUNT_ID}"]))

    @route(bp, f"{ROOT}/AccountService/Accounts/{resources.ACCOUNT_ID}")
    def account() -> Response:
        # A ManagerAccount is a writable resource in the schema: its GET carries an ETag (DSP0266), even here, where
        # the one account comes from a Secret and a PATCH is refused.
        return svc.send(svc.cache.get("account", "ManagerAccount", None, lambda: resources.account(svc.username)),
                        etag=True)

    @route(bp, f"{ROOT}/AccountService/Roles")
    def roles() -> Response:
        path = f"{ROOT}/AccountService/Roles"
        return svc.static("roles", "RoleCollection", lambda: resources.collection(
            "RoleCollection", path, "Roles", [f"{path}/{r}" for r in resources.ROLES]))

    @route(bp, f"{ROOT}/AccountService/Roles/<role_id>")
    def role(role_id: str) -> Response:
        if role_id not in resources.ROLES:
            raise not_found(request.path)
        return svc.static(f"role:{role_id}", "Role", lambda: resources.role(role_id))

    return bp
