"""The BMC's logs and its own reset, through an agent (memory backend) serving IPMI and Redfish: the SEL is one record
with two views (ipmitool's `sel` and Redfish's SEL LogService), the Manager's audit trail says who did what, and a
Manager.Reset ends every session, IPMI's too, answers 503 for a moment and leaves the VM alone."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests

from ..ipmi.client import Console
from ..support.agents import PASSWORD, USER, AgentProcess, running_agent
from ..support.cluster import wait_for

SYSTEM = "/redfish/v1/Systems/vm"
RESET = f"{SYSTEM}/Actions/ComputerSystem.Reset"
SEL = f"{SYSTEM}/LogServices/SEL"
AUDIT = "/redfish/v1/Managers/BMC/LogServices/AuditLog"
MANAGER_RESET = "/redfish/v1/Managers/BMC/Actions/Manager.Reset"
GET_DEVICE_ID = (0x06, 0x01)


@pytest.fixture
def agent() -> Iterator[AgentProcess]:
    with running_agent("--backend", "memory", "--vm", "vm") as process:
        yield process


def entries(agent: AgentProcess, log: str) -> list[dict[str, Any]]:
    status, body = agent.redfish("GET", f"{log}/Entries")
    assert status == 200, body
    return list(body["Members"])


def sel_lines(agent: AgentProcess) -> list[str]:
    result = agent.ipmitool("sel", "elist")
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if "|" in line]


def test_the_sel_is_one_record_with_two_views(agent: AgentProcess) -> None:
    for reset in ("On", "ForceOff"):
        assert agent.redfish("POST", RESET, {"ResetType": reset})[0] == 204
    wait_for(lambda: len(entries(agent, SEL)) == 2, timeout=5, what="two SEL entries")
    shown = entries(agent, SEL)
    assert [e["EntryType"] for e in shown] == ["SEL", "SEL"]
    assert "from Off to On" in shown[0]["Message"] and "from On to Off" in shown[1]["Message"]
    lines = sel_lines(agent)
    assert len(lines) == 2 and all("ACPI Pwr State" in line for line in lines)
    assert [int(line.split("|")[0], 16) for line in lines] == [int(e["Id"]) for e in shown]  # the same records

    # an entry an IPMI client adds is in Redfish's view too
    assert agent.ipmitool("raw", "0x0a", "0x44", "0x00", "0x00", "0x02", "0x00", "0x00", "0x00", "0x00", "0x41",
                          "0x00", "0x04", "0x12", "0x09", "0x6f", "0x00", "0xff", "0xff").returncode == 0
    added = entries(agent, SEL)[-1]
    assert "An IPMI client added this SEL entry" in added["Message"]

    # clearing either view clears the record
    status, service = agent.redfish("GET", SEL)
    assert status == 200
    assert service["Actions"]["#LogService.ClearLog"]["target"] == f"{SEL}/Actions/LogService.ClearLog"
    assert agent.redfish("POST", f"{SEL}/Actions/LogService.ClearLog", {})[0] == 204
    assert entries(agent, SEL) == [] and sel_lines(agent) == []
    assert agent.redfish("POST", RESET, {"ResetType": "On"})[0] == 204
    wait_for(lambda: len(sel_lines(agent)) == 1, timeout=5, what="a new SEL entry")
    assert agent.ipmitool("sel", "clear").returncode == 0
    wait_for(lambda: entries(agent, SEL) == [], timeout=5, what="the SEL cleared through IPMI")


def test_the_audit_log_says_who_did_what_and_every_refusal(agent: AgentProcess) -> None:
    assert agent.redfish("POST", RESET, {"ResetType": "On"})[0] == 204
    assert agent.ipmitool("chassis", "power", "off").returncode == 0
    wrong = requests.get(f"{agent.url}{SYSTEM}", auth=(USER, "wrong"), timeout=5)
    assert wrong.status_code == 401
    messages = [e["Message"] for e in entries(agent, AUDIT)]
    assert any(m.startswith(f"POST {RESET} by user {USER} through redfish") and m.endswith(": 204")
               for m in messages), messages
    assert any("chassis_control" in m and "through ipmi" in m for m in messages), messages
    refused = [e for e in entries(agent, AUDIT) if "wrong user name or password" in e["Message"]]
    assert refused and refused[0]["Severity"] == "Warning"
    assert not any(m.startswith("GET ") for m in messages)  # reads are not recorded
    assert agent.redfish("POST", f"{AUDIT}/Actions/LogService.ClearLog", {})[0] == 204
    assert [e["Message"] for e in entries(agent, AUDIT)] == [
        f"POST {AUDIT}/Actions/LogService.ClearLog by user {USER} through redfish from 127.0.0.1: 204"]


def test_a_manager_reset_ends_every_session_for_a_moment_and_leaves_the_vm_alone(agent: AgentProcess) -> None:
    assert agent.redfish("POST", RESET, {"ResetType": "On"})[0] == 204
    login = requests.post(f"{agent.url}/redfish/v1/SessionService/Sessions",
                          json={"UserName": USER, "Password": PASSWORD}, timeout=5)
    token = login.headers["X-Auth-Token"]
    status, manager = agent.redfish("GET", "/redfish/v1/Managers/BMC")
    assert status == 200
    assert manager["Actions"]["#Manager.Reset"]["ResetType@Redfish.AllowableValues"] == ["ForceRestart",
                                                                                          "GracefulRestart"]
    assert agent.redfish("POST", MANAGER_RESET, {"ResetType": "PowerCycle"})[0] == 400
    with Console(("127.0.0.1", agent.ipmi_port)) as console:
        assert console.login(USER, PASSWORD) == (4, 0)
        assert console.request(*GET_DEVICE_ID) is not None

        assert agent.redfish("POST", MANAGER_RESET, {"ResetType": "ForceRestart"})[0] == 204

        busy = requests.get(f"{agent.url}{SYSTEM}", auth=(USER, PASSWORD), timeout=5)
        assert busy.status_code == 503 and int(busy.headers["Retry-After"]) >= 1
        wait_for(lambda: console.request(*GET_DEVICE_ID) is None, timeout=5, what="the IPMI session to end")
    wait_for(lambda: agent.redfish("GET", SYSTEM)[0] == 200, timeout=10, what="the service to answer again")
    assert requests.get(f"{agent.url}{SYSTEM}", headers={"X-Auth-Token": token}, timeout=5).status_code == 401
    assert agent.redfish("GET", SYSTEM)[1]["PowerState"] == "On"  # the VM was not touched
    assert "Chassis Power is on" in agent.ipmitool("chassis", "power", "status").stdout  # a new session works


def test_the_managers_interface_is_the_service_clients_reach_it_through(agent: AgentProcess) -> None:
    status, interfaces = agent.redfish("GET", "/redfish/v1/Managers/BMC/EthernetInterfaces")
    assert status == 200 and len(interfaces["Members"]) == 1
    status, nic = agent.redfish("GET", interfaces["Members"][0]["@odata.id"])
    assert nic["MACAddress"] is None and nic["SpeedMbps"] is None  # a Service has none: nothing invented
    assert nic["InterfaceEnabled"] is True and nic["LinkStatus"] == "LinkUp"
    assert nic["IPv4Addresses"] == []  # the memory backend knows no Service address (kubevirt: its ClusterIP)


def test_power_and_thermal_report_no_readings(agent: AgentProcess) -> None:
    assert agent.redfish("GET", "/redfish/v1/Chassis/vm/Power")[1]["PowerControl"] == []
    thermal = agent.redfish("GET", "/redfish/v1/Chassis/vm/Thermal")[1]
    assert thermal["Fans"] == [] and thermal["Temperatures"] == []


def test_the_managers_interface_shows_the_services_cluster_ip() -> None:
    from vbmc.redfish import resources

    nic = resources.manager_interface(resources.Ids("vm", "BMC", "vm"), "vm-virtbmc", "vm-virtbmc.ns.svc", "10.96.0.7")
    assert nic["IPv4Addresses"] == [{"Address": "10.96.0.7", "SubnetMask": "255.255.255.255",
                                     "AddressOrigin": "Static", "Gateway": None}]
    assert (nic["HostName"], nic["FQDN"]) == ("vm-virtbmc", "vm-virtbmc.ns.svc")
