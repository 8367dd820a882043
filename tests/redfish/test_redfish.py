"""The Redfish frontend as clients see it: real clients (sushy, DMTF's redfish library, redfishtool), DMTF's
validators, and behaviour a client relies on (auth, errors, ETags, 503s, TLS, SIGTERM). Everything runs on
127.0.0.1 against a MemoryMachine; a missing client or validator fails the test, it never skips."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redfish
import requests
import sushy
from sushy import auth as sushy_auth

from vbmc.machine import (
    BackendUnavailable,
    BootEnabled,
    BootMode,
    BootOverride,
    BootTarget,
    Health,
    PowerState,
    ResetType,
)
from vbmc.machine.memory import MemoryMachine
from vbmc.redfish.app import create_app
from vbmc.redfish.resources import ConsoleAccess
from vbmc.redfish.server import ThreadedServer
from vbmc.redfish.sessions import SessionStore

from ..support.agents import free_port, write_serving_certificate
from ..support.cluster import STOP_DEADLINE, wait_for

REPO = Path(__file__).resolve().parent.parent.parent
BIN = Path(sys.executable).parent
# DMTF's schemas (the CSDL files the Service Validator reads for the resources served) and the profiles, in the
# repository (tests/redfish/data/README.md says where each comes from and how to add a schema).
DATA = Path(__file__).parent / "data"
CSDL = DATA / "csdl"
PROFILE = DATA / "OCPBaselineHardwareManagement.v1_0_1.json"  # OCP
IRONIC_PROFILE = DATA / "OpenStackIronicProfile.v1_2_0.json"  # openstack/ironic
USER, PASSWORD = "admin", "s3cret"
SYSTEM = "/redfish/v1/Systems/vm1"
RESET = f"{SYSTEM}/Actions/ComputerSystem.Reset"
CD = "/redfish/v1/Managers/BMC/VirtualMedia/Cd"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Service:
    url: str
    machine: MemoryMachine
    clock: FakeClock
    sessions: SessionStore

    def get(self, path: str, **kw: Any) -> requests.Response:
        kw.setdefault("auth", (USER, PASSWORD))
        return requests.get(self.url + path, timeout=5, **kw)

    def request(self, method: str, path: str, **kw: Any) -> requests.Response:
        kw.setdefault("auth", (USER, PASSWORD))
        return requests.request(method, self.url + path, timeout=5, **kw)


def serve(machine: MemoryMachine, **kw: Any) -> Iterator[Service]:
    clock = FakeClock()
    app = create_app(machine, USER, PASSWORD, session_timeout=60, clock=clock, **kw)
    with ThreadedServer(app) as server:
        yield Service(server.url, machine, clock, app.extensions["vbmc.sessions"])


@pytest.fixture
def service() -> Iterator[Service]:
    yield from serve(MemoryMachine("vm1"))


@pytest.fixture(scope="module")
def shared_service() -> Iterator[Service]:
    """One service for the slow, read-mostly clients (validators), advertising its consoles as the agent's do, with
    something in its logs: a power cycle in the SEL, the actions in the audit trail."""
    machine = MemoryMachine("vm1", power=PowerState.ON)
    machine.event_log  # noqa: B018 -- the log follows the bus from its first use
    for service in serve(machine, consoles=ConsoleAccess(
            ipmi_sol=True, serial_uri="/consoles/serial", screen_uri="/consoles/screen", max_sessions=4)):
        for reset in ("ForceOff", "On"):
            assert service.request("POST", RESET, json={"ResetType": reset}).status_code == 204
        assert len(machine.event_log) == 2
        yield service


def message_ids(resp: requests.Response) -> list[str]:
    return [m["MessageId"].rsplit(".", 1)[1] for m in resp.json()["error"]["@Message.ExtendedInfo"]]


# ---- real clients


def test_sushy_with_session_auth_drives_power_boot_and_media(service: Service) -> None:
    conn = sushy.Sushy(f"{service.url}/redfish/v1",
                       auth=sushy_auth.SessionAuth(USER, PASSWORD))
    system = conn.get_system(SYSTEM)
    assert system.power_state == sushy.PowerState.OFF
    assert len(service.sessions.list()) == 1, "sushy logged in with a session"
    assert sushy.ResetType.NMI not in system.get_allowed_reset_system_values()

    system.set_system_boot_options(sushy.BootSource.PXE, enabled=sushy.BootSourceOverrideEnabled.ONCE,
                                   mode=sushy.BootSourceOverrideMode.UEFI)
    assert service.machine.boot_override() == BootOverride(BootTarget.PXE, BootEnabled.ONCE, BootMode.UEFI)

    system.reset_system(sushy.ResetType.ON)
    system.refresh()
    assert system.power_state == sushy.PowerState.ON
    assert service.machine.last_boot_target == BootTarget.PXE
    assert system.boot.enabled == sushy.BootSourceOverrideEnabled.DISABLED, "the Once override was consumed"

    system.set_system_boot_options(sushy.BootSource.CD, enabled=sushy.BootSourceOverrideEnabled.CONTINUOUS)
    assert service.machine.boot_override().enabled == BootEnabled.CONTINUOUS

    manager = conn.get_manager("/redfish/v1/Managers/BMC")
    media = manager.virtual_media.get_member(CD)
    media.insert_media("http://images.example/boot.iso", inserted=True, write_protected=True)
    media.refresh()
    assert media.inserted is True and media.image == "http://images.example/boot.iso"
    assert service.machine.virtual_media().inserted
    media.eject_media()
    media.refresh()
    assert media.inserted is False and not service.machine.virtual_media().inserted

    conn._conn._auth.close()  # what Ironic does when it drops the client: DELETE the session
    assert service.sessions.list() == []


def test_sushy_with_basic_auth_and_system_virtual_media(service: Service) -> None:
    conn = sushy.Sushy(f"{service.url}/redfish/v1",
                       auth=sushy_auth.BasicAuth(USER, PASSWORD))
    system = conn.get_system()
    assert system.uuid == service.machine.inventory().uuid
    system.reset_system(sushy.ResetType.FORCE_ON)
    system.refresh()
    assert system.power_state == sushy.PowerState.ON
    assert service.sessions.list() == []
    media = system.virtual_media.get_members()[0]  # where newer Ironic and bmclib look
    media.insert_media("https://images.example/live.iso")
    assert service.machine.virtual_media().image == "https://images.example/live.iso"
    media.eject_media()
    assert not service.machine.virtual_media().inserted


def test_sushy_with_wrong_password_is_refused(service: Service) -> None:
    with pytest.raises(sushy.exceptions.AccessError):
        sushy.Sushy(f"{service.url}/redfish/v1",
                    auth=sushy_auth.SessionAuth(USER, "wrong")).get_system(SYSTEM)


def test_dmtf_redfish_library_session_get_post_patch_logout(service: Service) -> None:
    client = redfish.redfish_client(base_url=service.url, username=USER, password=PASSWORD,
                                    default_prefix="/redfish/v1")
    client.login(auth="session")
    assert len(service.sessions.list()) == 1
    got = client.get(SYSTEM)
    assert got.status == 200 and got.dict["PowerState"] == "Off"
    posted = client.post(RESET, body={"ResetType": "On"})
    assert posted.status == 204
    assert service.machine.power_state() == PowerState.ON
    patched = client.patch(SYSTEM, body={"Boot": {"BootSourceOverrideTarget": "Hdd",
                                                   "BootSourceOverrideEnabled": "Continuous"}})
    assert patched.status == 200 and patched.dict["Boot"]["BootSourceOverrideTarget"] == "Hdd"
    client.logout()
    assert service.sessions.list() == []


def test_redfishtool_lists_systems_and_resets(service: Service) -> None:
    host = service.url.removeprefix("http://")
    base = [str(BIN / "redfishtool"), "-r", host, "-u", USER, "-p", PASSWORD, "-S", "Never"]
    listed = subprocess.run([*base, "Systems"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["Members"] == [{"@odata.id": SYSTEM}]
    got = subprocess.run([*base, "-A", "Session", "Systems", "-I", "vm1"], capture_output=True, text=True,
                         timeout=60)
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["UUID"] == service.machine.inventory().uuid
    reset = subprocess.run([*base, "Systems", "-I", "vm1", "reset", "On"], capture_output=True, text=True,
                           timeout=60)
    assert reset.returncode == 0, reset.stderr
    assert service.machine.power_state() == PowerState.ON


# ---- DMTF validators (slow: once per module)

SUMMARY = re.compile(r"\|\s+PASS\s+\|\s+WARN\s+\|\s+FAIL\s+\|\s+NOT TESTED\s+\|\s*\n\+[-+]+\+\s*\n"
                     r"\|\s+(\d+)\s+\|\s+(\d+)\s+\|\s+(\d+)\s+\|\s+(\d+)\s+\|")


@dataclass
class Report:
    passed: int
    warned: int
    failed: int
    output: str
    log: str


def run_validator(args: list[str], logdir: Path) -> Report:
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=logdir)
    output = done.stdout + done.stderr
    found = SUMMARY.search(output)
    assert found, f"no summary in the validator's output:\n{output[-3000:]}"
    logs = list(logdir.rglob("*Debug*.log"))
    assert logs, f"the validator wrote no debug log in {logdir}"
    passed, warned, failed, _ = (int(x) for x in found.groups())
    return Report(passed, warned, failed, output, logs[0].read_text())


@pytest.fixture(scope="module")
def service_validator(shared_service: Service, tmp_path_factory: pytest.TempPathFactory) -> Report:
    assert CSDL.is_dir(), f"the DMTF schema bundle is missing: {CSDL}"
    logdir = tmp_path_factory.mktemp("service-validator")
    # One subscription, so that an EventDestination is validated too (nothing is sent: the validator changes nothing).
    subscribed = shared_service.request("POST", "/redfish/v1/EventService/Subscriptions", json={
        "Destination": "http://127.0.0.1:9/events", "Protocol": "Redfish", "Context": "validator",
        "RegistryPrefixes": ["ResourceEvent"], "OriginResources": [{"@odata.id": SYSTEM}]})
    assert subscribed.status_code == 201, subscribed.text
    return run_validator([str(BIN / "rf_service_validator"), "--ip", shared_service.url, "-u", USER, "-p",
                          PASSWORD, "--authtype", "Session", "--schema_directory", str(CSDL), "--skipschema",
                          "--logdir", str(logdir)], logdir)


@pytest.fixture(scope="module")
def interop_validator(shared_service: Service, tmp_path_factory: pytest.TempPathFactory) -> Report:
    assert PROFILE.is_file(), f"the OCP profile is missing: {PROFILE}"
    logdir = tmp_path_factory.mktemp("interop-validator")
    return run_validator([str(BIN / "rf_interop_validator"), "-u", USER, "-p", PASSWORD, "-r", shared_service.url,
                          "--authtype", "Session", "--logdir", str(logdir), str(PROFILE)], logdir)


@pytest.fixture(scope="module")
def ironic_validator(shared_service: Service, tmp_path_factory: pytest.TempPathFactory) -> Report:
    logdir = tmp_path_factory.mktemp("ironic-validator")
    return run_validator([str(BIN / "rf_interop_validator"), "-u", USER, "-p", PASSWORD, "-r", shared_service.url,
                          "--authtype", "Session", "--logdir", str(logdir), str(IRONIC_PROFILE)], logdir)


def test_interop_validator_with_ironics_profile_reports_no_failures(ironic_validator: Report) -> None:
    assert ironic_validator.failed == 0, re.findall(r"FAIL - .*", ironic_validator.log)
    assert ironic_validator.passed >= 40
    for resource in (SYSTEM, "/redfish/v1/Systems/vm1/SecureBoot", "/redfish/v1/Systems/vm1/Storage/1/Volumes"):
        assert f"Validating {resource}" in ironic_validator.log, f"{resource} was not reached"
    # The Recommended items found absent are those docs/reference.md ("The OCP baseline") explains, and no other.
    absent = set(re.findall(r"SKIP - (\S+) \(\[Not Present\]\)", ironic_validator.log))
    assert absent == {"/TaskService", "/Actions/#SecureBoot.ResetKeys", "/RAIDType", "/@Redfish.Settings/ETag",
                      "/@Redfish.Settings/Messages"}, absent


def test_service_validator_reports_no_failures(service_validator: Report) -> None:
    assert service_validator.failed == 0, re.findall(r"FAIL - .*", service_validator.log)
    assert service_validator.passed > 300
    for resource in (SYSTEM, CD, "/redfish/v1/SessionService/Sessions", "/redfish/v1/AccountService/Roles",
                     "/redfish/v1/Chassis/vm1/Drives/rootdisk", "/redfish/v1/Managers/BMC/NetworkProtocol",
                     "/redfish/v1/EventService", "/redfish/v1/EventService/Subscriptions/"):
        assert f"Validating {resource}" in service_validator.output, f"{resource} was not reached"
    for resource in ("/redfish/v1/Systems/vm1/LogServices/SEL/Entries", "/redfish/v1/Managers/BMC/LogServices/AuditLog",
                     "/redfish/v1/Managers/BMC/EthernetInterfaces/Service", "/redfish/v1/Chassis/vm1/Thermal",
                     "/redfish/v1/Chassis/vm1/PCIeDevices/nic-default/PCIeFunctions/0"):
        assert f"Validating {resource}" in service_validator.output, f"{resource} was not reached"
    for resource in ("/redfish/v1/Systems/vm1/Bios", "/redfish/v1/Systems/vm1/Bios/Settings",
                     "/redfish/v1/Registries/KubeVBMCBiosAttributes.1.0.0", "/redfish/v1/UpdateService",
                     "/redfish/v1/UpdateService/FirmwareInventory/BIOS"):
        assert f"Validating {resource}" in service_validator.output, f"{resource} was not reached"
    for prop in ("/GraphicalConsole/ConnectTypesSupported", "/SerialConsole/WebSocket/ConsoleURI",
                 "/SerialConsole/IPMI/ServiceEnabled"):
        assert f"PASS - {prop} " in service_validator.log, f"{prop} was not validated"
    # The only warnings: deprecated resources clients still read. The Manager's VirtualMedia (sushy and older
    # Ironic), the Chassis' Power and Thermal (the OCP baseline and Ironic's profile ask for them), IndicatorLED on
    # the System and the Chassis (Ironic's indicator API reads and writes it, not LocationIndicatorActive).
    warnings = re.findall(r"WARN - (/\S+)", service_validator.log)
    assert all(w in ("/VirtualMedia", "/Power", "/Thermal", "/@odata.id", "/IndicatorLED") for w in warnings), \
        warnings


# What the OCP baseline asks for that no BMC of a VM can give truthfully (docs/reference.md, "The OCP baseline"):
# the Manager's EthernetInterface is the Kubernetes Service clients reach it through, whose names and address the
# cluster assigns; the BMC cannot take writes to them.
OCP_IMPOSSIBLE = {"/HostName", "/FQDN", "/NameServers", "/IPv4Addresses"}


def test_interop_validator_ocp_baseline_fails_only_on_what_a_vm_cannot_give(interop_validator: Report) -> None:
    failures = re.findall(r"FAIL - (\S+) \(Write\)", interop_validator.log)
    assert set(failures) <= OCP_IMPOSSIBLE, failures
    assert interop_validator.failed == len(failures), re.findall(r"FAIL - .*", interop_validator.log)
    assert interop_validator.passed >= 85
    for resource in ("/redfish/v1/Systems/vm1/LogServices/SEL", "/redfish/v1/Managers/BMC/LogServices/AuditLog",
                     "/redfish/v1/Chassis/vm1/Power"):
        assert f"Validating {resource}" in interop_validator.log, f"{resource} was not reached"


# ---- authentication and sessions


@pytest.mark.parametrize("path", ["/redfish", "/redfish/v1", "/redfish/v1/", "/redfish/v1/odata",
                                  "/redfish/v1/$metadata"])
def test_anonymous_may_read_the_service_root_and_metadata(service: Service, path: str) -> None:
    resp = requests.get(service.url + path, timeout=5)
    assert resp.status_code == 200
    assert resp.headers["OData-Version"] == "4.0"


@pytest.mark.parametrize("path", [SYSTEM, "/redfish/v1/Systems", CD, "/redfish/v1/SessionService/Sessions",
                                  "/redfish/v1/AccountService/Accounts/1", "/redfish/v1/NoSuchThing"])
def test_anonymous_access_elsewhere_is_401_with_a_challenge(service: Service, path: str) -> None:
    resp = requests.get(service.url + path, timeout=5)
    assert resp.status_code == 401
    assert resp.headers["WWW-Authenticate"].startswith("Basic")
    assert message_ids(resp) == ["NoValidSession"]


def test_anonymous_reset_is_refused_and_changes_nothing(service: Service) -> None:
    resp = requests.post(service.url + RESET, json={"ResetType": "On"}, timeout=5)
    assert resp.status_code == 401
    assert service.machine.power_state() == PowerState.OFF


def test_wrong_password_is_401_for_basic_and_for_login(service: Service) -> None:
    assert service.get(SYSTEM, auth=(USER, "nope")).status_code == 401
    assert service.get(SYSTEM, auth=("root", PASSWORD)).status_code == 401
    login = requests.post(service.url + "/redfish/v1/SessionService/Sessions",
                          json={"UserName": USER, "Password": "nope"}, timeout=5)
    assert login.status_code == 401 and "X-Auth-Token" not in login.headers


def test_login_returns_token_and_location_and_the_session_expires_when_idle(service: Service) -> None:
    login = requests.post(service.url + "/redfish/v1/SessionService/Sessions",
                          json={"UserName": USER, "Password": PASSWORD}, timeout=5)
    assert login.status_code == 201
    token, location = login.headers["X-Auth-Token"], login.headers["Location"]
    assert login.json()["@odata.id"] == location and login.json()["Password"] is None
    headers = {"X-Auth-Token": token}
    assert service.get(SYSTEM, auth=None, headers=headers).status_code == 200

    service.clock.now += 59  # activity keeps it alive: SessionTimeout is an inactivity timeout
    assert service.get(SYSTEM, auth=None, headers=headers).status_code == 200
    service.clock.now += 61
    expired = service.get(SYSTEM, auth=None, headers=headers)
    assert expired.status_code == 401 and message_ids(expired) == ["NoValidSession"]
    assert service.get(location).status_code == 404


def test_delete_revokes_a_session(service: Service) -> None:
    login = requests.post(service.url + "/redfish/v1/SessionService/Sessions/",
                          json={"UserName": USER, "Password": PASSWORD}, timeout=5)
    headers = {"X-Auth-Token": login.headers["X-Auth-Token"]}
    listed = service.get("/redfish/v1/SessionService/Sessions", auth=None, headers=headers).json()
    assert listed["Members"] == [{"@odata.id": login.headers["Location"]}]
    deleted = service.request("DELETE", login.headers["Location"], auth=None, headers=headers)
    assert deleted.status_code == 204
    assert service.get(SYSTEM, auth=None, headers=headers).status_code == 401
    assert service.get("/redfish/v1/SessionService/Sessions").json()["Members"] == []


def test_a_bogus_token_is_401_even_with_valid_basic_credentials(service: Service) -> None:
    # The token, when present, is what the client authenticates with (DSP0266 13.3.4).
    assert service.get(SYSTEM, headers={"X-Auth-Token": "forged"}).status_code == 401


def test_account_service_shows_the_one_account_and_roles(service: Service) -> None:
    account = service.get("/redfish/v1/AccountService/Accounts/1").json()
    assert account["UserName"] == USER and account["Password"] is None and account["RoleId"] == "Administrator"
    roles = service.get("/redfish/v1/AccountService/Roles").json()["Members"]
    assert {"@odata.id": "/redfish/v1/AccountService/Roles/Administrator"} in roles
    assert service.request("PATCH", "/redfish/v1/AccountService/Accounts/1",
                           json={"Password": "x"}).status_code == 405


# ---- the system: power, reset, boot


def test_system_shows_model_values(service: Service) -> None:
    service.machine.set_boot_override(BootOverride(BootTarget.CD, BootEnabled.ONCE, BootMode.UEFI))
    resp = service.get(SYSTEM)
    doc = resp.json()
    assert resp.headers["ETag"] and resp.headers["Link"].endswith("rel=describedby")
    assert "PATCH" in resp.headers["Allow"]
    assert doc["PowerState"] == "Off" and doc["UUID"] == service.machine.inventory().uuid
    assert doc["Status"]["Health"] == "OK"
    assert doc["Boot"]["BootSourceOverrideTarget"] == "Cd"
    assert doc["Boot"]["BootSourceOverrideEnabled"] == "Once"
    assert doc["Boot"]["BootSourceOverrideTarget@Redfish.AllowableValues"] == [
        t.value for t in service.machine.supported_boot_targets()]
    allowed = doc["Actions"]["#ComputerSystem.Reset"]["ResetType@Redfish.AllowableValues"]
    assert "Nmi" not in allowed and "ForceOff" in allowed
    assert doc["ProcessorSummary"]["LogicalProcessorCount"] == 2
    assert doc["MemorySummary"]["TotalSystemMemoryGiB"] == 2
    nics = service.get(f"{SYSTEM}/EthernetInterfaces/default").json()
    assert nics["MACAddress"] == "02:00:00:00:00:01"


def test_health_and_power_state_follow_the_machine(service: Service) -> None:
    class Sick(MemoryMachine):
        def health(self) -> Health:
            return Health(state=Health().state.__class__("Warning"), message="DataVolume import failed")

    gen = serve(Sick("vm1", power=PowerState.PAUSED))
    sick = next(gen)
    try:
        doc = sick.get(SYSTEM).json()
        assert doc["Status"]["Health"] == "Warning" and doc["PowerState"] == "Paused"
    finally:
        gen.close()


@pytest.mark.parametrize("body", [{"ResetType": "Explode"}, {"ResetType": "Nmi"}])
def test_unknown_reset_type_is_400_and_changes_nothing(service: Service, body: dict[str, str]) -> None:
    resp = service.request("POST", RESET, json=body)
    assert resp.status_code == 400
    assert message_ids(resp) == ["ActionParameterValueNotInList"]
    assert service.machine.power_state() == PowerState.OFF and service.machine.boots == 0


@pytest.mark.parametrize(("body", "expected"), [
    ({}, "ActionParameterMissing"),
    ({"ResetType": 5}, "ActionParameterValueTypeError"),
    ({"ResetType": "On", "Force": True}, "ActionParameterUnknown"),
])
def test_bad_reset_bodies_name_the_problem(service: Service, body: dict[str, Any], expected: str) -> None:
    resp = service.request("POST", RESET, json=body)
    assert resp.status_code == 400 and message_ids(resp) == [expected]
    assert service.machine.boots == 0


def test_malformed_json_is_400(service: Service) -> None:
    resp = service.request("POST", RESET, data=b"{not json", headers={"Content-Type": "application/json"})
    assert resp.status_code == 400 and message_ids(resp) == ["MalformedJSON"]


def test_reset_in_the_wrong_state_is_409(service: Service) -> None:
    resp = service.request("POST", RESET, json={"ResetType": "ForceRestart"})
    assert resp.status_code == 409 and message_ids(resp) == ["ResourceInUse"]


@pytest.mark.parametrize(("boot", "expected"), [
    ({"BootSourceOverrideTarget": "Floppy"}, "PropertyValueNotInList"),
    ({"BootSourceOverrideTarget": "BiosSetup"}, "PropertyValueNotInList"),  # not in this machine's list
    ({"BootSourceOverrideEnabled": "Sometimes"}, "PropertyValueNotInList"),
    ({"BootSourceOverrideMode": "EFI"}, "PropertyValueNotInList"),
    ({"BootSourceOverrideEnabled": 1}, "PropertyValueTypeError"),
    ({"BootNext": "0001"}, "PropertyUnknown"),
])
def test_patch_with_a_bad_boot_value_is_400(service: Service, boot: dict[str, Any], expected: str) -> None:
    before = service.machine.boot_override()
    resp = service.request("PATCH", SYSTEM, json={"Boot": boot})
    assert resp.status_code == 400 and message_ids(resp) == [expected]
    assert service.machine.boot_override() == before


def test_patch_of_a_read_only_property_is_property_not_writable(service: Service) -> None:
    resp = service.request("PATCH", SYSTEM, json={"PowerState": "On"})
    assert resp.status_code == 400 and message_ids(resp) == ["PropertyNotWritable"]


def test_patch_with_if_match_applies_only_to_the_current_etag(service: Service) -> None:
    etag = service.get(SYSTEM).headers["ETag"]
    stale = service.request("PATCH", SYSTEM, json={"Boot": {"BootSourceOverrideTarget": "Pxe"}},
                            headers={"If-Match": '"stale"'})
    assert stale.status_code == 412 and message_ids(stale) == ["PreconditionFailed"]
    assert service.machine.boot_override().target == BootTarget.NONE
    ok = service.request("PATCH", SYSTEM, headers={"If-Match": etag}, json={"Boot": {
        "BootSourceOverrideTarget": "UefiHttp", "BootSourceOverrideEnabled": "Once",
        "BootSourceOverrideMode": "UEFI", "HttpBootUri": "http://images.example.com/boot.iso"}})
    assert ok.status_code == 200 and ok.headers["ETag"] != etag
    assert service.machine.boot_override() == BootOverride(BootTarget.UEFI_HTTP, BootEnabled.ONCE, BootMode.UEFI,
                                                           "http://images.example.com/boot.iso")
    again = service.request("PATCH", SYSTEM, headers={"If-Match": etag},
                            json={"Boot": {"BootSourceOverrideTarget": "Hdd"}})
    assert again.status_code == 412, "the old ETag no longer matches"


def test_patch_legacy_mode_and_continuous(service: Service) -> None:
    resp = service.request("PATCH", SYSTEM, json={"Boot": {"BootSourceOverrideTarget": "Hdd",
                                                            "BootSourceOverrideEnabled": "Continuous",
                                                            "BootSourceOverrideMode": "Legacy"}})
    assert resp.status_code == 200
    assert service.machine.boot_override() == BootOverride(BootTarget.HDD, BootEnabled.CONTINUOUS,
                                                           BootMode.LEGACY)


# ---- HTTP semantics


def test_unknown_resource_is_404_with_a_redfish_error(service: Service) -> None:
    for path in ("/redfish/v1/Systems/other", "/redfish/v1/Chassis/vm1/Drives/nope",
                 "/redfish/v1/Managers/BMC/VirtualMedia/Floppy"):
        resp = service.get(path)
        assert resp.status_code == 404 and message_ids(resp) == ["ResourceMissingAtURI"], path


def test_wrong_method_is_405_with_allow(service: Service) -> None:
    resp = service.request("DELETE", SYSTEM)
    assert resp.status_code == 405
    assert set(resp.headers["Allow"].split(", ")) >= {"GET", "PATCH"}
    assert message_ids(resp) == ["OperationNotAllowed"]
    assert service.request("PUT", "/redfish/v1/Managers/BMC").headers["Allow"] == "GET, HEAD"


def test_trailing_slash_names_the_same_resource(service: Service) -> None:
    assert service.get(SYSTEM + "/").json()["@odata.id"] == SYSTEM


def test_metadata_references_the_schemas_used(service: Service) -> None:
    xml = requests.get(service.url + "/redfish/v1/$metadata", timeout=5).text
    for namespace in ("ComputerSystem.v1_27_0", "VirtualMedia", "SessionCollection", "ServiceRoot"):
        assert f'Namespace="{namespace}"' in xml
    root = requests.get(service.url + "/redfish/v1/", timeout=5).json()
    for key in ("Systems", "Managers", "Chassis", "SessionService", "AccountService"):
        assert service.get(root[key]["@odata.id"]).status_code == 200, key


def test_backend_unavailable_is_503_with_retry_after_quickly() -> None:
    class Down(MemoryMachine):
        down = False

        def power_state(self) -> PowerState:
            if self.down:
                raise BackendUnavailable("API server unreachable", retry_after=7)
            return super().power_state()

        def reset(self, reset_type: ResetType) -> None:
            raise BackendUnavailable("API server unreachable", retry_after=7)

    machine = Down("vm1")
    gen = serve(machine)
    svc = next(gen)
    try:
        machine.down = True
        started = time.monotonic()
        resp = svc.get(SYSTEM)
        assert time.monotonic() - started < 2
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "7"
        assert message_ids(resp) == ["ServiceTemporarilyUnavailable"]
        posted = svc.request("POST", RESET, json={"ResetType": "On"})
        assert posted.status_code == 503 and posted.headers["Retry-After"] == "7"
    finally:
        gen.close()


# ---- virtual media


def test_insert_media_action_validates_the_image(service: Service) -> None:
    action = f"{CD}/Actions/VirtualMedia.InsertMedia"
    bad = service.request("POST", action, json={"Image": "ftp://x/y.iso"})
    assert bad.status_code == 400 and message_ids(bad) == ["ActionParameterValueFormatError"]
    missing = service.request("POST", action, json={})
    assert missing.status_code == 400 and message_ids(missing) == ["ActionParameterMissing"]
    ok = service.request("POST", action, json={"Image": "http://x/y.iso", "TransferProtocolType": "HTTP"})
    assert ok.status_code == 202 and ok.json()["TaskState"] == "Completed"  # nothing to import in memory
    twice = service.request("POST", action, json={"Image": "http://x/z.iso"})
    assert twice.status_code == 409, "a medium is already inserted"
    doc = service.get(CD).json()
    assert doc["Inserted"] and doc["Image"] == "http://x/y.iso" and doc["ImageName"] == "y.iso"
    assert doc["ConnectedVia"] == "URI"


def test_patch_of_image_and_inserted_as_sushy_does(service: Service) -> None:
    etag = service.get(CD).headers["ETag"]
    resp = service.request("PATCH", CD, headers={"If-Match": etag},
                           json={"Image": "http://x/a.iso", "Inserted": True, "WriteProtected": True})
    assert resp.status_code == 200 and resp.json()["Inserted"] is True
    assert service.machine.virtual_media().image == "http://x/a.iso"
    stale = service.request("PATCH", CD, headers={"If-Match": etag}, json={"Inserted": False})
    assert stale.status_code == 412
    resp = service.request("PATCH", CD, json={"Image": None, "Inserted": False})
    assert resp.status_code == 200 and not service.machine.virtual_media().inserted


NO_CDROM = "the VM has no cdrom disk: add an empty cdrom disk to its template to use virtual media"


@pytest.fixture
def cdromless_service() -> Iterator[Service]:
    yield from serve(MemoryMachine("vm1", has_cdrom=False))


def test_without_a_cdrom_the_cd_slot_is_absent_and_says_why(cdromless_service: Service) -> None:
    svc = cdromless_service
    for owner in (SYSTEM, "/redfish/v1/Managers/BMC"):
        collection = svc.get(svc.get(owner).json()["VirtualMedia"]["@odata.id"]).json()
        assert [m["@odata.id"] for m in collection["Members"]] == [f"{owner}/VirtualMedia/Cd"]
    cd = svc.get(CD).json()
    assert cd["Status"] == {"State": "Absent"}
    assert cd["Inserted"] is False and cd["ConnectedVia"] == "NotConnected"
    assert cd["Description"] == NO_CDROM
    assert "Actions" not in cd  # nothing to insert into: the actions are not offered


def test_insert_media_without_a_cdrom_is_action_not_supported_with_the_reason(cdromless_service: Service) -> None:
    resp = cdromless_service.request("POST", f"{CD}/Actions/VirtualMedia.InsertMedia",
                                     json={"Image": "http://x/y.iso", "Inserted": True})
    assert resp.status_code == 400 and message_ids(resp) == ["ActionNotSupported"]
    error = resp.json()["error"]
    assert error["message"].endswith(NO_CDROM)
    assert error["@Message.ExtendedInfo"][0]["MessageArgs"] == ["VirtualMedia.InsertMedia"]
    eject = cdromless_service.request("POST", f"{CD}/Actions/VirtualMedia.EjectMedia", json={})
    assert eject.status_code == 400 and message_ids(eject) == ["ActionNotSupported"]


def test_sushy_insert_without_a_cdrom_reports_the_reason(cdromless_service: Service) -> None:
    # With no InsertMedia action offered, sushy (Ironic) PATCHes Image instead.
    root = sushy.Sushy(f"{cdromless_service.url}/redfish/v1", auth=sushy_auth.BasicAuth(USER, PASSWORD))
    media = root.get_system(SYSTEM).virtual_media.get_members()[0]
    with pytest.raises(sushy.exceptions.HTTPError) as raised:
        media.insert_media("http://images.example/boot.iso", inserted=True, write_protected=True)
    assert raised.value.status_code == 409
    assert "PropertyValueResourceConflict" in str(raised.value) and NO_CDROM in str(raised.value)
    assert not cdromless_service.machine.virtual_media().inserted


# ---- the agent's server: TLS and plain listeners in one process, hooks, SIGTERM, memory

@dataclass
class Server:
    process: subprocess.Popen[str]
    http: str
    https: str
    cert: Path
    log: Path


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    cert, key = write_serving_certificate(tmp_path)
    http, https = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    log = tmp_path / "server.log"
    # The agent as the controller runs it, with the memory backend and no IPMI: its Redfish server alone.
    proc = subprocess.Popen([sys.executable, "-m", "vbmc", "agent", "--backend", "memory", "--vm", "vm1",
                             "--ipmi-address", "", "--redfish-address", http, "--redfish-tls-address", https,
                             "--tls-cert", str(cert), "--tls-key", str(key)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True, cwd=REPO,  # noqa: SIM115
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "VBMC_USERNAME": USER,
                                 "VBMC_PASSWORD": PASSWORD})
    server = Server(proc, f"http://{http}", f"https://{https}", cert, log)
    try:
        wait_for(lambda: requests.get(server.http + "/redfish/v1", timeout=1).status_code == 200, timeout=20,
                 what=f"the server to answer: {log.read_text() if log.exists() else ''}")
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def memory_kb(pid: int) -> dict[str, int]:
    values = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value, *_ = line.split()
        values[name.rstrip(":")] = int(value)
    return values


def test_server_serves_http_and_https_from_one_process_and_stops_on_sigterm(server: Server) -> None:
    plain = requests.get(server.http + SYSTEM, auth=(USER, PASSWORD), timeout=5)
    assert plain.status_code == 200
    secure = requests.get(server.https + SYSTEM, auth=(USER, PASSWORD), timeout=5, verify=str(server.cert))
    assert secure.status_code == 200 and secure.json()["UUID"] == plain.json()["UUID"]
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(server.https + "/redfish/v1", timeout=5)  # the self-signed cert is not trusted by default
    # A write through one listener is seen through the other: one process, one Machine.
    assert requests.post(server.https + RESET, json={"ResetType": "On"}, auth=(USER, PASSWORD), timeout=5,
                         verify=str(server.cert)).status_code == 204
    assert requests.get(server.http + SYSTEM, auth=(USER, PASSWORD), timeout=5).json()["PowerState"] == "On"
    # Keep-alive: one connection, many requests.
    with requests.Session() as keep:
        keep.auth = (USER, PASSWORD)
        for _ in range(20):
            assert keep.get(server.http + SYSTEM, timeout=5).status_code == 200
    # The probe is the server's own: no credentials, on both listeners.
    assert requests.get(server.http + "/healthz", timeout=5).text == "ok\n"
    assert requests.get(server.https + "/healthz", timeout=5, verify=str(server.cert)).text == "ok\n"

    children = Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children").read_text().split()
    assert children == [], "one process: no master, no worker"
    memory = memory_kb(server.process.pid)
    print(f"\nmemory: Rss {memory['Rss']} kB, Pss {memory['Pss']} kB")
    assert memory["Pss"] < 60 * 1024, f"Redfish alone uses {memory['Pss']} kB of the agent's 60 MB"
    assert "agent: serving vm=" in wait_for(server.log.read_text, what="the start line")

    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=STOP_DEADLINE) == 0, "SIGTERM must stop the server"
    assert "agent: stopped" in server.log.read_text()
    assert "Traceback" not in server.log.read_text()

