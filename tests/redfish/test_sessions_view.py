"""What the BMC's page builds its sessions view and BMC information on, through real HTTP: the SessionService's
timeout (PATCH by an administrator, within DMTF's bounds, at once for every session, audited), the sessions with who,
where, what kind and which consoles (and which one is the caller's), ending another's session, the Manager's
certificate and endpoints (Oem.KubeVBMC), and the page's redirect to HTTPS."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from vbmc.machine.memory import MemoryMachine
from vbmc.redfish import accounts
from vbmc.redfish.app import create_app
from vbmc.redfish.managers import certificate, requested_host
from vbmc.redfish.resources import ConsoleAccess
from vbmc.redfish.server import ThreadedServer
from vbmc.redfish.sessions import SessionStore
from vbmc.web import assets

from ..support.agents import PASSWORD, USER, AgentProcess, free_port, running_agent, write_serving_certificate
from ..support.cluster import wait_for
from .test_redfish import FakeClock

SERVICE = "/redfish/v1/SessionService"
SESSIONS = f"{SERVICE}/Sessions"
MANAGER = "/redfish/v1/Managers/BMC"
AUDIT = f"{MANAGER}/LogServices/AuditLog/Entries"
CSDL = Path(__file__).parent / "data" / "csdl"
FINGERPRINT = re.compile(r"^([0-9A-F]{2}:){31}[0-9A-F]{2}$")


@dataclass
class Service:
    url: str
    clock: FakeClock
    sessions: SessionStore

    def call(self, method: str, path: str, token: str | None = None, **kw: Any) -> requests.Response:
        if token is None:
            kw.setdefault("auth", (USER, PASSWORD))
        else:
            kw["headers"] = {**kw.get("headers", {}), "X-Auth-Token": token}
        return requests.request(method, self.url + path, timeout=5, **kw)

    def login(self, **headers: str) -> tuple[str, str]:
        """(token, session URI) of a new session."""
        resp = requests.post(self.url + SESSIONS, json={"UserName": USER, "Password": PASSWORD}, headers=headers,
                             timeout=5)
        assert resp.status_code == 201, resp.text
        return resp.headers["X-Auth-Token"], resp.headers["Location"]

    def audit_messages(self) -> list[str]:
        return [e["Message"] for e in self.call("GET", AUDIT).json()["Members"]]


@pytest.fixture
def service() -> Iterator[Service]:
    clock = FakeClock()
    app = create_app(MemoryMachine("vm1"), USER, PASSWORD, clock=clock, consoles=ConsoleAccess(
        ipmi_sol=True, serial_uri="/consoles/serial", screen_uri="/consoles/screen", max_sessions=4))
    with ThreadedServer(app) as server:
        yield Service(server.url, clock, app.extensions["vbmc.sessions"])


@pytest.fixture
def read_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every caller has the ReadOnly role (no account has it today: the one account is an Administrator)."""
    monkeypatch.setattr(accounts, "role_of", lambda svc, user: "ReadOnly")


def message_ids(resp: requests.Response) -> list[str]:
    return [m["MessageId"].rsplit(".", 1)[1] for m in resp.json()["error"]["@Message.ExtendedInfo"]]


# ---- SessionService.SessionTimeout


def test_the_session_timeout_is_shown_with_an_etag_and_set_by_patch_with_if_match(service: Service) -> None:
    got = service.call("GET", SERVICE)
    assert got.json()["SessionTimeout"] == 1800
    etag = got.headers["ETag"]
    stale = service.call("PATCH", SERVICE, json={"SessionTimeout": 600}, headers={"If-Match": '"other"'})
    assert stale.status_code == 412 and service.call("GET", SERVICE).json()["SessionTimeout"] == 1800
    done = service.call("PATCH", SERVICE, json={"SessionTimeout": 600}, headers={"If-Match": etag})
    assert done.status_code == 200 and done.json()["SessionTimeout"] == 600
    assert done.headers["ETag"] != etag
    assert service.call("GET", SERVICE).json()["SessionTimeout"] == 600
    assert service.call("PATCH", SERVICE, json={"SessionTimeout": 900}).status_code == 200  # If-Match is optional


@pytest.mark.parametrize("value", [29, 86401, 0, -1])
def test_a_session_timeout_outside_dmtfs_bounds_is_400_and_changes_nothing(service: Service, value: int) -> None:
    resp = service.call("PATCH", SERVICE, json={"SessionTimeout": value})
    assert resp.status_code == 400 and message_ids(resp) == ["PropertyValueOutOfRange"]
    assert "between 30 and 86400 seconds" in resp.json()["error"]["message"]
    assert resp.json()["error"]["@Message.ExtendedInfo"][0]["RelatedProperties"] == ["#/SessionTimeout"]
    assert service.call("GET", SERVICE).json()["SessionTimeout"] == 1800


@pytest.mark.parametrize("value", [30, 86400])
def test_the_bounds_themselves_are_accepted(service: Service, value: int) -> None:
    assert service.call("PATCH", SERVICE, json={"SessionTimeout": value}).json()["SessionTimeout"] == value


@pytest.mark.parametrize("body, expected", [({"SessionTimeout": "600"}, "PropertyValueTypeError"),
                                            ({"SessionTimeout": True}, "PropertyValueTypeError"),
                                            ({"SessionTimeout": 600.5}, "PropertyValueTypeError"),
                                            ({"ServiceEnabled": False}, "PropertyNotWritable"),
                                            ({"Bogus": 1}, "PropertyUnknown")])
def test_a_wrong_session_service_patch_names_the_problem(service: Service, body: dict[str, Any],
                                                          expected: str) -> None:
    resp = service.call("PATCH", SERVICE, json=body)
    assert resp.status_code == 400 and message_ids(resp) == [expected]
    assert service.call("GET", SERVICE).json()["SessionTimeout"] == 1800


def test_a_shorter_timeout_ends_idle_sessions_at_once(service: Service) -> None:
    idle, _ = service.login()
    active, _ = service.login()
    service.clock.now += 100  # both idle 100 s: alive under 1800 s
    assert service.call("GET", SERVICE, token=active).status_code == 200
    assert service.call("PATCH", SERVICE, token=active, json={"SessionTimeout": 60}).status_code == 200
    assert service.call("GET", SERVICE, token=idle).status_code == 401  # idle 100 s > 60 s: ended
    assert service.call("GET", SERVICE, token=active).status_code == 200
    service.clock.now += 61
    assert service.call("GET", SERVICE, token=active).status_code == 401


def test_changing_the_timeout_is_audited_with_before_and_after(service: Service) -> None:
    token, location = service.login()
    assert service.call("PATCH", SERVICE, token=token, json={"SessionTimeout": 300}).status_code == 200
    session_id = location.rsplit("/", 1)[1]
    lines = [m for m in service.audit_messages() if m.startswith(f"PATCH {SERVICE} ")]
    assert lines == [f"PATCH {SERVICE} by user {USER} through redfish from 127.0.0.1: SessionTimeout 1800 s -> 300 s"]
    assert service.sessions.get(session_id) is not None


def test_a_read_only_role_cannot_change_the_timeout(service: Service, read_only: None) -> None:
    resp = service.call("PATCH", SERVICE, json={"SessionTimeout": 600})
    assert resp.status_code == 403 and message_ids(resp) == ["InsufficientPrivilege"]
    assert "ConfigureManager" in resp.json()["error"]["message"]
    assert service.call("GET", SERVICE).json()["SessionTimeout"] == 1800


def test_the_one_account_is_an_administrator_and_the_roles_decide() -> None:
    assert accounts.allowed("Administrator", "ConfigureManager")
    assert not accounts.allowed("ReadOnly", "ConfigureManager")
    assert not accounts.allowed("Operator", "ConfigureManager")
    assert accounts.allowed("ReadOnly", "ConfigureSelf")
    assert not accounts.allowed("NoSuchRole", "Login")


# ---- sessions: who, where, what kind, which consoles


@pytest.mark.parametrize("header, kind", [(None, "Redfish"), ("page", "WebUI"), ("Page ", "WebUI"),
                                          ("curl", "Redfish")])
def test_the_session_type_says_whether_the_page_logged_in(service: Service, header: str | None, kind: str) -> None:
    token, location = service.login(**({"X-KubeVBMC-Client": header} if header is not None else {}))
    assert service.call("GET", location, token=token).json()["SessionType"] == kind


def test_every_session_sees_every_session_and_which_is_its_own(service: Service) -> None:
    page, page_uri = service.login(**{"X-KubeVBMC-Client": "page"})
    script, script_uri = service.login()
    members = service.call("GET", SESSIONS, token=script).json()["Members"]
    assert members == [{"@odata.id": page_uri}, {"@odata.id": script_uri}]
    theirs = service.call("GET", page_uri, token=script).json()
    assert theirs["UserName"] == USER and theirs["ClientOriginIPAddress"] == "127.0.0.1"
    assert theirs["SessionType"] == "WebUI" and re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00$",
                                                          theirs["CreatedTime"])
    assert theirs["Oem"]["KubeVBMC"]["Current"] is False
    assert service.call("GET", script_uri, token=script).json()["Oem"]["KubeVBMC"]["Current"] is True
    assert service.call("GET", page_uri, token=page).json()["Oem"]["KubeVBMC"]["Current"] is True
    assert service.call("GET", page_uri).json()["Oem"]["KubeVBMC"]["Current"] is False  # Basic: no session of its own


def test_a_session_shows_the_consoles_it_has_open(service: Service) -> None:
    token, location = service.login()
    session = service.sessions.get(location.rsplit("/", 1)[1])
    assert session is not None
    assert service.call("GET", location, token=token).json()["Oem"]["KubeVBMC"]["Consoles"] == []
    serial = service.sessions.open_console(session, "serial", "10.0.0.7")
    service.sessions.open_console(session, "screen", "10.0.0.8")
    consoles = service.call("GET", location, token=token).json()["Oem"]["KubeVBMC"]["Consoles"]
    assert [(c["Console"], c["ClientOriginIPAddress"]) for c in consoles] == [("serial", "10.0.0.7"),
                                                                           ("screen", "10.0.0.8")]
    assert all(re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00$", c["Since"]) for c in consoles)
    service.sessions.close_console(session, serial)
    consoles = service.call("GET", location, token=token).json()["Oem"]["KubeVBMC"]["Consoles"]
    assert [c["Console"] for c in consoles] == ["screen"]


def test_an_administrator_ends_another_session_and_the_audit_says_who_ended_whose(service: Service) -> None:
    admin, admin_uri = service.login()
    other, other_uri = service.login(**{"X-KubeVBMC-Client": "page"})
    session = service.sessions.get(other_uri.rsplit("/", 1)[1])
    assert session is not None
    service.sessions.open_console(session, "serial", "10.0.0.7")
    assert service.call("DELETE", other_uri, token=admin).status_code == 204
    assert service.call("GET", SESSIONS, token=other).status_code == 401
    assert service.call("GET", other_uri, token=admin).status_code == 404
    assert service.sessions.get(session.id) is None  # what the consoles look at, every second, to close
    admin_id, other_id = admin_uri.rsplit("/", 1)[1], session.id
    entries = service.call("GET", AUDIT).json()["Members"]
    ended = [e["Message"] for e in entries if e["Message"].startswith(f"DELETE {other_uri} ")]
    assert ended == [f"DELETE {other_uri} by user {USER} through redfish from 127.0.0.1: ended session {other_id} "
                     f"of user {USER} from 127.0.0.1 (1 console open)"]
    assert service.sessions.get(admin_id) is not None
    assert service.call("DELETE", other_uri, token=admin).status_code == 404  # already gone


def test_logging_out_is_deleting_ones_own_session(service: Service) -> None:
    token, location = service.login()
    assert service.call("DELETE", location, token=token).status_code == 204
    assert service.call("GET", SESSIONS, token=token).status_code == 401
    assert not [m for m in service.audit_messages() if "ended session" in m]


def test_a_read_only_role_may_look_and_log_out_but_not_end_another_session(service: Service,
                                                                           read_only: None) -> None:
    mine, mine_uri = service.login()
    other, other_uri = service.login()
    assert service.call("GET", other_uri, token=mine).status_code == 200
    refused = service.call("DELETE", other_uri, token=mine)
    assert refused.status_code == 403 and message_ids(refused) == ["InsufficientPrivilege"]
    assert service.call("GET", SESSIONS, token=other).status_code == 200  # still alive
    assert service.call("DELETE", mine_uri, token=mine).status_code == 204


def test_the_oem_extension_validates_against_its_schema(tmp_path: Path) -> None:
    """DMTF's Service Validator with the OEM schema (tests/redfish/data/csdl/KubeVBMC_v1.xml): a certificate, a
    session with consoles; every Oem.KubeVBMC property passes, none warns or fails."""
    cert, _ = write_serving_certificate(tmp_path)
    app = create_app(MemoryMachine("vm1"), USER, PASSWORD, tls_cert=cert.read_text(), consoles=ConsoleAccess(
        ipmi_sol=True, serial_uri="/consoles/serial", screen_uri="/consoles/screen", max_sessions=4))
    store = app.extensions["vbmc.sessions"]
    session = store.create(USER, "10.0.0.7", "WebUI")
    store.open_console(session, "screen", "10.0.0.7")
    with ThreadedServer(app) as server:
        done = subprocess.run([str(Path(sys.executable).parent / "rf_service_validator"), "--ip", server.url, "-u",
                               USER, "-p", PASSWORD, "--authtype", "Session", "--schema_directory", str(CSDL),
                               "--skipschema", "--logdir", str(tmp_path)],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path)
    log = next(tmp_path.rglob("*Debug*.log")).read_text()
    assert "FAIL - " not in log, re.findall(r"FAIL - .*", log) or done.stdout[-2000:]
    assert not re.findall(r"WARN - /Oem\S*", log)
    for prop in ("/Oem/KubeVBMC/TLS/CertificateFingerprintSHA256", "/Oem/KubeVBMC/TLS/CAFingerprintSHA256",
                 "/Oem/KubeVBMC/TLS/NotAfter", "/Oem/KubeVBMC/Endpoints/Redfish/0", "/Oem/KubeVBMC/Endpoints/IPMI",
                 "/Oem/KubeVBMC/Endpoints/Page", "/Oem/KubeVBMC/Current", "/Oem/KubeVBMC/Consoles/0/Console",
                 "/Oem/KubeVBMC/Consoles/0/ClientOriginIPAddress", "/Oem/KubeVBMC/Consoles/0/Since"):
        assert f"PASS - {prop} " in log, f"{prop} was not validated"


# ---- the Manager: certificate and endpoints


def fingerprint_of(cert: x509.Certificate) -> str:
    digest = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest().upper()
    return ":".join(digest[i:i + 2] for i in range(0, len(digest), 2))


@dataclass
class TlsAgent:
    agent: AgentProcess
    https: str
    https_port: int
    cert: Path


@pytest.fixture
def tls_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TlsAgent]:
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    cert, key = write_serving_certificate(tmp_path)
    port = free_port()
    with running_agent("--backend", "memory", "--vm", "vm", "--redfish-tls-address", f"127.0.0.1:{port}",
                       "--tls-cert", str(cert), "--tls-key", str(key)) as process:
        https = f"https://127.0.0.1:{port}"
        wait_for(lambda: requests.get(f"{https}/redfish/v1", verify=str(cert), timeout=2).ok, timeout=10,
                 what="the agent's HTTPS listener")
        yield TlsAgent(process, https, port, cert)


def test_the_manager_shows_the_served_certificate_as_openssl_fingerprints_it(tls_agent: TlsAgent) -> None:
    chain = x509.load_pem_x509_certificates(tls_agent.cert.read_bytes())
    manager = requests.get(f"{tls_agent.https}{MANAGER}", auth=(USER, PASSWORD), verify=str(tls_agent.cert),
                           timeout=5).json()
    tls = manager["Oem"]["KubeVBMC"]["TLS"]
    assert tls["CertificateFingerprintSHA256"] == fingerprint_of(chain[0])
    openssl = subprocess.run(["openssl", "x509", "-noout", "-fingerprint", "-sha256", "-in", str(tls_agent.cert)],
                             capture_output=True, text=True, timeout=10, check=True).stdout  # the first certificate
    assert openssl.strip().split("=", 1)[1] == tls["CertificateFingerprintSHA256"]
    assert tls["CAFingerprintSHA256"] == fingerprint_of(chain[1])
    assert tls["NotAfter"] == chain[0].not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%S+00:00")
    assert manager["FirmwareVersion"]


def test_the_manager_shows_the_endpoints_and_the_protocols_served(tls_agent: TlsAgent) -> None:
    got = requests.get(f"{tls_agent.agent.url}{MANAGER}", auth=(USER, PASSWORD), timeout=5).json()
    # The memory backend knows no Service address: the host the client named, on the Service's ports.
    assert got["Oem"]["KubeVBMC"]["Endpoints"] == {
        "Redfish": ["https://127.0.0.1/redfish/v1", "http://127.0.0.1/redfish/v1"], "IPMI": "127.0.0.1:623",
        "Page": "https://127.0.0.1/"}
    protocols = requests.get(f"{tls_agent.agent.url}{MANAGER}/NetworkProtocol", auth=(USER, PASSWORD),
                             timeout=5).json()
    assert [protocols[p]["ProtocolEnabled"] for p in ("HTTP", "HTTPS", "IPMI")] == [True, True, True]


def test_without_tls_the_manager_has_no_certificate_and_no_https() -> None:
    with running_agent("--backend", "memory", "--vm", "vm") as agent:
        got = requests.get(f"{agent.url}{MANAGER}", auth=(USER, PASSWORD), timeout=5).json()["Oem"]["KubeVBMC"]
        protocols = requests.get(f"{agent.url}{MANAGER}/NetworkProtocol", auth=(USER, PASSWORD), timeout=5).json()
        page = requests.get(f"{agent.url}/", timeout=5, allow_redirects=False)
    assert got["TLS"] is None
    assert got["Endpoints"] == {"Redfish": ["http://127.0.0.1/redfish/v1"], "IPMI": "127.0.0.1:623",
                                "Page": "http://127.0.0.1/"}
    assert protocols["HTTPS"] == {"ProtocolEnabled": False, "Port": None}
    # ... and its page is served over plain HTTP, as before
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")


@pytest.mark.parametrize("pem", ["", "not a certificate"])
def test_an_unreadable_certificate_is_no_certificate(pem: str) -> None:
    assert certificate(pem) is None


def test_a_chain_without_its_ca_has_no_ca_fingerprint(tmp_path: Path) -> None:
    cert, _ = write_serving_certificate(tmp_path)
    leaf_only = x509.load_pem_x509_certificates(cert.read_bytes())[0].public_bytes(serialization.Encoding.PEM)
    facts = certificate(leaf_only.decode())
    assert facts is not None and facts.ca_fingerprint is None and FINGERPRINT.match(facts.fingerprint)


@pytest.mark.parametrize("authority, host", [("10.0.0.5", "10.0.0.5"), ("bmc.example:8080", "bmc.example"),
                                             ("[fd00::5]:80", "fd00::5"), ("[fd00::5]", "fd00::5"),
                                             ("<script>", ""), ("a b", ""), ("", "")])
def test_the_endpoints_use_only_a_host_a_url_can_carry(authority: str, host: str) -> None:
    assert requested_host(authority) == host


# ---- the page over plain HTTP redirects to HTTPS


def test_the_page_over_http_redirects_to_https_and_redfish_does_not(tls_agent: TlsAgent) -> None:
    http, port = tls_agent.agent.url, tls_agent.https_port
    for path in ("/", "/ui/app.js", "/ui/app.js?v=1"):
        resp = requests.get(f"{http}{path}", timeout=5, allow_redirects=False)
        assert resp.status_code == 308, path
        assert resp.headers["Location"] == f"https://127.0.0.1:{port}{path}"
        assert resp.headers["Cache-Control"] == "no-store"
    assert requests.head(f"{http}/", timeout=5, allow_redirects=False).status_code == 308
    followed = requests.get(f"{http}/", timeout=5, verify=str(tls_agent.cert))
    assert followed.status_code == 200 and followed.url == f"https://127.0.0.1:{port}/"
    assert followed.headers["Content-Type"].startswith("text/html")
    # Through the Service (its port 80, not the agent's): to the Service's HTTPS port, 443.
    via_service = requests.get(f"{http}/", headers={"Host": "bmc.example"}, timeout=5, allow_redirects=False)
    assert via_service.headers["Location"] == "https://bmc.example/"
    bad_host = requests.get(f"{http}/", headers={"Host": "evil\\x"}, timeout=5, allow_redirects=False)
    assert bad_host.status_code == 400 and "Location" not in bad_host.headers
    # The Redfish API keeps its documented plain-HTTP behaviour; the consoles are not the page.
    root = requests.get(f"{http}/redfish/v1", timeout=5, allow_redirects=False)
    assert root.status_code == 200 and root.json()["@odata.id"] == "/redfish/v1/"
    system = requests.get(f"{http}/redfish/v1/Systems/vm", auth=(USER, PASSWORD), timeout=5, allow_redirects=False)
    assert system.status_code == 200
    assert requests.get(f"{http}/consoles/serial", timeout=5, allow_redirects=False).status_code != 308


@pytest.mark.parametrize("host, local, target, expected", [
    ("127.0.0.1:8080", ("127.0.0.1", 8080), "/", "https://127.0.0.1:8443/"),  # the agent's own port
    ("10.0.0.5", ("10.1.2.3", 10080), "/ui/a.js?x=1", "https://10.0.0.5/ui/a.js?x=1"),  # through the Service
    ("bmc.example:80", ("10.1.2.3", 10080), "/", "https://bmc.example/"),
    ("[fd00::5]:8080", ("fd00::5", 8080), "/", "https://[fd00::5]:8443/"),
    ("[fd00::5]", ("fd00::9", 10080), "/", "https://[fd00::5]/"),
    ("", ("127.0.0.1", 8080), "/", "https://127.0.0.1:8443/"),  # HTTP/1.0 without Host: the listener's address
    ("evil.example/x", ("127.0.0.1", 8080), "/", None),
    ("a b", ("127.0.0.1", 8080), "/", None),
    ("host:99999x", ("127.0.0.1", 8080), "/", None),
])
def test_where_the_page_redirects(host: str, local: tuple[str, int], target: str, expected: str | None) -> None:
    assert assets.https_location(host, local, target, 8443) == expected
