"""Sessions and accounts: who may talk to the service (authentication on every request), the SessionService and
its sessions (login, logout), and the read-only AccountService (the one account comes from the
VirtualMachineBMC's Secret)."""

from __future__ import annotations

import hmac
import logging
import time

from flask import Blueprint, Response, g, request

from ..access import audit
from . import payloads, resources
from .errors import RedfishError, not_found
from .resources import ROOT
from .service import REALM, Service

SESSIONS = f"{ROOT}/SessionService/Sessions"
SESSION_MEMBERS = f"{SESSIONS}/Members"  # DSP0266 "Session login": a POST here creates a session too
LOGINS = frozenset((SESSIONS, SESSION_MEMBERS))
# Reachable without credentials (DSP0266 13.3.1: the service root, $metadata and the OData service document;
# POST to Sessions is how a client logs in).
PUBLIC = frozenset(("/redfish", ROOT, f"{ROOT}/odata", f"{ROOT}/$metadata"))


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
    raise svc.login_failed("redfish-basic", auth.username or "")


def blueprint(svc: Service) -> Blueprint:
    bp = Blueprint("accounts", __name__)
    route, store = svc.route, svc.store
    bp.before_app_request(lambda: authenticate(svc))

    # ---- sessions

    @route(bp, f"{ROOT}/SessionService")
    def session_service() -> Response:
        return svc.static("session_service", "SessionService",
                          lambda: resources.session_service(int(svc.session_timeout)))

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
            raise svc.login_failed("redfish-session", creds.UserName)
        svc.throttle.succeeded(request.remote_addr or "")
        session = store.create(creds.UserName, request.remote_addr or "")
        g.user = creds.UserName
        audit.bind(audit.Actor("redfish", request.remote_addr or "", creds.UserName, session.id))
        location = f"{SESSIONS}/{session.id}"
        return svc.send_doc("Session", resources.session(session), 201,
                            headers={"X-Auth-Token": session.token, "Location": location})

    @route(bp, f"{SESSIONS}/<session_id>", ("GET", "DELETE"))
    def session(session_id: str) -> Response:
        found = store.get(session_id)
        if found is None:
            raise not_found(request.path)
        if request.method == "DELETE":
            store.delete(session_id)
            return svc.no_content()
        return svc.send_doc("Session", resources.session(found))

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
