"""The audit trail (issue 11, deliverable 6): every state-changing command and every failed login is one
structured log line (protocol, source, user, session, action, VM, result, duration), and every change of the VM
an Event on the VirtualMachineBMC naming the protocol and the source address. Never a secret."""

from __future__ import annotations

import base64
import json
import logging
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from vbmc.access import audit
from vbmc.agent.logs import JsonFormatter

from ..support.agents import PASSWORD, USER, AgentProcess, agent_for_vm
from ..support.cluster import Sim, call, wait_for

SYSTEM = "/redfish/v1/Systems/vm"


@pytest.fixture
def agent(sim: Sim, api: client.ApiClient, namespace: str, bmc_crd: None) -> Iterator[AgentProcess]:
    with agent_for_vm(sim, api, namespace, "--log-format", "json") as process:
        yield process


def audit_lines(agent: AgentProcess) -> list[dict[str, Any]]:
    lines = []
    for text in agent.output().splitlines():
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if isinstance(line, dict) and line.get("logger") == "vbmc.audit":
            lines.append(line)
    return lines


def audited(agent: AgentProcess, **want: Any) -> list[dict[str, Any]]:
    return [line for line in audit_lines(agent) if all(line.get(k) == v for k, v in want.items())]


def events(api: client.ApiClient, ns: str, reason: str) -> list[dict[str, Any]]:
    items = call(api, "GET", f"/api/v1/namespaces/{ns}/events").body["items"]
    return [e for e in items if e.get("reason") == reason]


def request(agent: AgentProcess, method: str, path: str, body: Any = None, user: str = USER,
            password: str = PASSWORD) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    head = {"Content-Type": "application/json"}
    if user:
        head["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    req = urllib.request.Request(f"{agent.url}{path}", data=data, method=method, headers=head)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers)


def test_an_ipmi_power_command_is_one_audit_line_and_an_event_naming_protocol_and_source(
        agent: AgentProcess, api: client.ApiClient, namespace: str) -> None:
    assert agent.ipmitool("power", "on").returncode == 0
    line = wait_for(lambda: audited(agent, protocol="ipmi", result="ok"), what="the audit line")
    assert len(line) == 1  # one line for one command (reads are not audited at info)
    record = line[0]
    assert record["action"] == "chassis_control:On"
    assert record["source"].startswith("127.0.0.1:") and record["user"] == USER and record["vm"] == "vm"
    assert record["session"].startswith("0x") and isinstance(record["duration_ms"], float)
    event = wait_for(lambda: events(api, namespace, "PowerAction"), what="the PowerAction Event")[0]
    assert event["involvedObject"]["kind"] == "VirtualMachineBMC"
    assert "through ipmi from 127.0.0.1:" in event["message"] and f"(user {USER})" in event["message"]
    assert PASSWORD not in agent.output()


def test_a_redfish_boot_override_and_reset_are_audited_with_the_session(agent: AgentProcess, api: client.ApiClient,
                                                                        namespace: str) -> None:
    status, head = request(agent, "POST", "/redfish/v1/SessionService/Sessions",
                           {"UserName": USER, "Password": PASSWORD}, user="")
    assert status == 201
    token, location = head["X-Auth-Token"], head["Location"]
    session_id = location.rsplit("/", 1)[1]
    req = urllib.request.Request(f"{agent.url}{SYSTEM}", method="PATCH", headers={
        "X-Auth-Token": token, "Content-Type": "application/json"}, data=json.dumps(
        {"Boot": {"BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Once"}}).encode())
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200
    patch = wait_for(lambda: audited(agent, action=f"PATCH {SYSTEM}"), what="the PATCH's audit line")
    assert len(patch) == 1 and patch[0]["session"] == session_id and patch[0]["user"] == USER
    assert patch[0]["protocol"] == "redfish" and patch[0]["source"] == "127.0.0.1" and patch[0]["result"] == "200"
    event = wait_for(lambda: events(api, namespace, "BootOverrideSet"), what="the BootOverrideSet Event")[0]
    assert "Pxe" in event["message"] and "through redfish from 127.0.0.1 (user admin)" in event["message"]
    login = audited(agent, action="POST /redfish/v1/SessionService/Sessions")
    assert len(login) == 1 and login[0]["session"] == session_id and login[0]["result"] == "201"
    assert token not in agent.output() and PASSWORD not in agent.output()


def test_every_failed_login_is_one_audit_line_without_the_password(agent: AgentProcess) -> None:
    wrong = "wrong-Passw0rd"
    assert request(agent, "GET", SYSTEM, password=wrong)[0] == 401
    assert request(agent, "POST", f"{SYSTEM}/Actions/ComputerSystem.Reset", {"ResetType": "On"},
                   password=wrong)[0] == 401
    assert request(agent, "POST", "/redfish/v1/SessionService/Sessions", {"UserName": USER, "Password": wrong},
                   user="")[0] == 401
    assert request(agent, "GET", SYSTEM, user="")[0] == 401  # no credentials at all: not a login attempt
    result = agent.ipmitool("power", "status")
    assert result.returncode == 0
    # A wrong IPMI user name is refused in RAKP 2. (A wrong password is only seen when the client says so in RAKP 3:
    # ipmitool finds RAKP 2 wrong and gives up without a word, so the BMC never learns of it.)
    denied = subprocess.run(["ipmitool", "-I", "lanplus", "-C", "17", "-H", "127.0.0.1", "-p", str(agent.ipmi_port),
                             "-U", "intruder", "-P", wrong, "-R", "1", "-N", "1", "power", "status"],
                            capture_output=True, text=True, timeout=30)
    assert denied.returncode != 0

    def four_failed_logins() -> list[dict[str, Any]] | None:
        found = audited(agent, action="login")
        return found if len(found) >= 4 else None

    logins = wait_for(four_failed_logins, what="four failed-login lines")
    assert [line["protocol"] for line in logins] == ["redfish", "redfish", "redfish", "ipmi"]
    assert all(line["result"].startswith("denied") and line["level"] == "warning" for line in logins)
    # A user name that is not the BMC's is not written (it may be a password typed in the wrong field).
    assert [line["user"] for line in logins] == [USER, USER, USER, audit.UNKNOWN_USER]
    assert "intruder" not in agent.output()
    assert wrong not in agent.output()
    # The 401 of the POST is its failed login, not a second line for the action.
    assert not audited(agent, action=f"POST {SYSTEM}/Actions/ComputerSystem.Reset")


def test_an_audit_line_as_text_and_as_json(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="vbmc.audit"):
        audit.record("power on", "vm", "ok", 0.0123,
                     actor=audit.Actor("ipmi", "10.0.0.7:623", "admin\nforged=line", "0x01020304"))
    (record,) = caplog.records
    text = record.getMessage()
    assert "\n" not in text  # a hostile user name cannot forge a second line
    assert text.startswith("audit protocol=ipmi source=10.0.0.7:623 user='admin\\nforged=line' session=0x01020304")
    line = json.loads(JsonFormatter().format(record))
    assert {k: line[k] for k in audit.FIELDS} == {
        "protocol": "ipmi", "source": "10.0.0.7:623", "user": "admin\nforged=line", "session": "0x01020304",
        "action": "power on", "vm": "vm", "result": "ok", "duration_ms": 12.3}
