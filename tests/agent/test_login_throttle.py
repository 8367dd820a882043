"""Password guessing is slowed per source address and never locks the owner out: the throttle's rules as tables,
Redfish Basic auth and session login through the Flask app (each request from an address of our choosing), and
an agent on kubesim that records a LoginThrottled Warning Event and counts failures on /metrics.

The IPMI (RAKP) side is in tests/ipmi/test_hostile.py."""

from __future__ import annotations

import base64
import http.client
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from flask.testing import FlaskClient
from kubernetes import client

from vbmc.access.throttle import FREE_FAILURES, MAX_DELAY, Engaged, LoginThrottle, lockout, source_key
from vbmc.machine.memory import MemoryMachine
from vbmc.redfish import create_app

from ..ipmi.client import Console
from ..support.agents import USER as AGENT_USER
from ..support.agents import AgentProcess, agent_for_vm
from ..support.cluster import Sim, call, wait_for

USER, PASSWORD = "admin", "s3cret-Passw0rd"
ATTACKER, OWNER = "192.0.2.66", "192.0.2.10"
SYSTEM = "/redfish/v1/Systems/vm-throttle"
SESSIONS = "/redfish/v1/SessionService/Sessions"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- the rules


@pytest.mark.parametrize(("failures", "seconds"), [
    (1, 0), (FREE_FAILURES, 0), (FREE_FAILURES + 1, 1), (FREE_FAILURES + 2, 2), (FREE_FAILURES + 3, 4),
    (FREE_FAILURES + 7, 64 if MAX_DELAY > 64 else MAX_DELAY), (FREE_FAILURES + 1000, MAX_DELAY),
])
def test_lockout_doubles_after_the_free_failures_up_to_a_ceiling(failures: int, seconds: float) -> None:
    assert lockout(failures) == seconds


@pytest.mark.parametrize(("address", "key"), [
    ("192.0.2.1", "192.0.2.1"),
    ("::ffff:192.0.2.1", "192.0.2.1"),  # a dual-stack socket's view of an IPv4 client
    ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
    ("2001:db8:1:2:ffff::1", "2001:db8:1:2::/64"),  # the same host hopping within its /64
    ("fe80::1%eth0", "fe80::/64"),
    ("not-an-address", "not-an-address"),
])
def test_sources_are_addresses_and_ipv6_hosts_count_per_64(address: str, key: str) -> None:
    assert source_key(address) == key


def test_a_locked_out_source_waits_and_others_do_not() -> None:
    clock = Clock()
    throttle = LoginThrottle(clock=clock)
    for _ in range(FREE_FAILURES):
        assert throttle.failed(ATTACKER, "redfish-basic") == 0
    assert throttle.retry_after(ATTACKER) == 0
    assert throttle.failed(ATTACKER, "redfish-basic") == 1
    assert throttle.retry_after(ATTACKER) == 1
    assert throttle.retry_after(OWNER) == 0
    clock.now += 1
    assert throttle.retry_after(ATTACKER) == 0  # it may try again: once
    assert throttle.failed(ATTACKER, "redfish-basic") == 2


def test_a_success_forgets_the_failures() -> None:
    throttle = LoginThrottle()
    for _ in range(FREE_FAILURES):
        throttle.failed(OWNER, "ipmi")
    throttle.succeeded(OWNER)
    assert throttle.sources() == 0
    assert throttle.failed(OWNER, "ipmi") == 0  # a fresh budget


def test_old_failures_are_forgotten() -> None:
    clock = Clock()
    throttle = LoginThrottle(clock=clock, forget_after=600)
    for _ in range(FREE_FAILURES):
        throttle.failed(OWNER, "ipmi")
    clock.now += 601
    assert throttle.failed(OWNER, "ipmi") == 0


def test_memory_is_bounded_by_dropping_the_stalest_sources() -> None:
    clock = Clock()
    throttle = LoginThrottle(clock=clock, max_sources=100)
    for i in range(1000):
        clock.now += 0.001
        throttle.failed(f"10.0.{i // 256}.{i % 256}", "redfish-basic")
    assert throttle.sources() == 100
    for _ in range(FREE_FAILURES):
        throttle.failed("10.0.3.231", "redfish-basic")  # the last to fail: its first failure is remembered
        throttle.failed("10.0.0.0", "redfish-basic")  # the first: forgotten, so it starts afresh
    assert throttle.retry_after("10.0.3.231") > 0
    assert throttle.retry_after("10.0.0.0") == 0


def test_warnings_are_rate_limited_per_source_and_overall() -> None:
    clock = Clock()
    engaged: list[Engaged] = []
    throttle = LoginThrottle(clock=clock, on_engaged=engaged.append)
    for _ in range(FREE_FAILURES + 50):
        throttle.failed(ATTACKER, "redfish-session", "root")
    assert engaged == [Engaged(ATTACKER, "redfish-session", "root", FREE_FAILURES + 1, 1.0)]
    for i in range(100):  # a hundred more sources locked out within the same minute
        for _ in range(FREE_FAILURES + 1):
            throttle.failed(f"198.51.100.{i}", "ipmi")
    assert 1 < len(engaged) <= 10
    clock.now += 61
    throttle.failed(ATTACKER, "redfish-session", "root")
    assert engaged[-1].source == ATTACKER


def test_metrics_count_failures_and_refusals_without_naming_anyone() -> None:
    throttle = LoginThrottle()
    for _ in range(FREE_FAILURES + 1):
        throttle.failed(ATTACKER, "redfish-basic", "root")
    throttle.refused("redfish-basic")
    text = throttle.metrics()
    assert f'kubevbmc_login_failures_total{{protocol="redfish-basic"}} {FREE_FAILURES + 1}' in text
    assert 'kubevbmc_login_throttled_total{protocol="redfish-basic"} 1' in text
    assert "kubevbmc_login_lockouts_total 1" in text
    assert ATTACKER not in text and "root" not in text


# ---- Redfish


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def redfish(clock: Clock) -> FlaskClient:
    machine = MemoryMachine("vm-throttle")
    app = create_app(machine, USER, PASSWORD, throttle=LoginThrottle(clock=clock))
    return app.test_client()


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def get_system(redfish: FlaskClient, source: str, password: str) -> Any:
    return redfish.get(SYSTEM, headers=basic(USER, password), environ_base={"REMOTE_ADDR": source})


def login(redfish: FlaskClient, source: str, password: str) -> Any:
    return redfish.post(SESSIONS, json={"UserName": USER, "Password": password},
                        environ_base={"REMOTE_ADDR": source})


def test_a_thousand_wrong_basic_logins_are_refused_after_a_few_without_checking(redfish: FlaskClient) -> None:
    statuses = [get_system(redfish, ATTACKER, f"guess-{i}").status_code for i in range(1000)]
    assert statuses[:FREE_FAILURES + 1] == [401] * (FREE_FAILURES + 1)
    assert set(statuses[FREE_FAILURES + 1:]) == {429}
    refused = get_system(redfish, ATTACKER, PASSWORD)  # the right password, from the locked-out address
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "1"
    assert refused.json["error"]["@Message.ExtendedInfo"][0]["MessageId"].endswith("ServiceTemporarilyUnavailable")
    assert get_system(redfish, OWNER, PASSWORD).status_code == 200  # the owner, elsewhere, at once


def test_the_lockout_runs_out_and_doubles_with_the_next_failure(redfish: FlaskClient, clock: Clock) -> None:
    for i in range(FREE_FAILURES + 1):
        get_system(redfish, ATTACKER, f"guess-{i}")
    clock.now += 1.0
    assert get_system(redfish, ATTACKER, "guess-again").status_code == 401
    assert get_system(redfish, ATTACKER, PASSWORD).headers["Retry-After"] == "2"
    clock.now += 2.0
    assert get_system(redfish, ATTACKER, PASSWORD).status_code == 200


def test_wrong_session_logins_are_throttled_like_basic_ones(redfish: FlaskClient) -> None:
    statuses = [login(redfish, ATTACKER, f"guess-{i}").status_code for i in range(50)]
    assert statuses[:FREE_FAILURES + 1] == [401] * (FREE_FAILURES + 1)
    assert set(statuses[FREE_FAILURES + 1:]) == {429}
    assert login(redfish, ATTACKER, PASSWORD).status_code == 429
    assert login(redfish, OWNER, PASSWORD).status_code == 201


def test_basic_and_session_failures_share_one_budget(redfish: FlaskClient) -> None:
    for i in range(FREE_FAILURES):
        assert (login if i % 2 else get_system)(redfish, ATTACKER, f"guess-{i}").status_code == 401
    assert login(redfish, ATTACKER, "guess-last").status_code == 401
    assert get_system(redfish, ATTACKER, PASSWORD).status_code == 429


def test_an_open_session_keeps_working_while_its_address_is_locked_out(redfish: FlaskClient) -> None:
    created = login(redfish, ATTACKER, PASSWORD)
    token = created.headers["X-Auth-Token"]
    for i in range(FREE_FAILURES + 3):
        get_system(redfish, ATTACKER, f"guess-{i}")
    answer = redfish.get(SYSTEM, headers={"X-Auth-Token": token}, environ_base={"REMOTE_ADDR": ATTACKER})
    assert answer.status_code == 200


def test_requests_without_credentials_and_stale_tokens_are_not_failed_logins(redfish: FlaskClient) -> None:
    for _ in range(3 * FREE_FAILURES):
        assert redfish.get(SYSTEM, environ_base={"REMOTE_ADDR": OWNER}).status_code == 401
        assert redfish.get(SYSTEM, headers={"X-Auth-Token": "expired"},
                           environ_base={"REMOTE_ADDR": OWNER}).status_code == 401
    assert get_system(redfish, OWNER, PASSWORD).status_code == 200


# ---- the agent: one budget for IPMI and Redfish, a Warning Event, /metrics


@pytest.fixture
def agent(sim: Sim, api: client.ApiClient, namespace: str, bmc_crd: None) -> Iterator[AgentProcess]:
    with agent_for_vm(sim, api, namespace) as process:
        yield process


def test_the_agent_throttles_over_both_protocols_and_says_so_in_an_event(agent: AgentProcess, api: client.ApiClient,
                                                                         namespace: str) -> None:
    with Console(("127.0.0.1", agent.ipmi_port), "127.0.0.3") as attacker:
        for _ in range(FREE_FAILURES + 1):
            assert attacker.login(AGENT_USER, "wrong-password") == (4, 0x0F)
    # The same address over Redfish is locked out by its IPMI failures: 429 at once, or, should the first lockout
    # (1 s) run out on a loaded machine before the request arrives, within fewer wrong passwords than Redfish alone
    # would need.
    statuses = []
    for password in ("wrong-password", "wrong-password", "wrong-password"):
        connection = http.client.HTTPConnection("127.0.0.1", agent.http_port, timeout=5,
                                                source_address=("127.0.0.3", 0))
        try:
            connection.request("GET", "/redfish/v1/Systems/vm", headers=basic(AGENT_USER, password))
            statuses.append(connection.getresponse().status)
        finally:
            connection.close()
        if statuses[-1] == 429:
            break
    assert statuses[-1] == 429, statuses
    assert agent.ipmitool("power", "status").returncode == 0  # the owner from 127.0.0.1

    def warning() -> dict[str, Any] | None:
        events = call(api, "GET", f"/api/v1/namespaces/{namespace}/events").body["items"]
        return next((e for e in events if e["reason"] == "LoginThrottled"), None)

    event = wait_for(warning, timeout=10, what="a LoginThrottled event")
    assert event["type"] == "Warning"
    assert event["involvedObject"]["kind"] == "VirtualMachineBMC"
    assert "127.0.0.3" in event["message"] and "ipmi" in event["message"]
    assert "wrong-password" not in json.dumps(event)
    with urllib.request.urlopen(f"{agent.url}/metrics", timeout=5) as resp:
        metrics = resp.read().decode()
    assert f'kubevbmc_login_failures_total{{protocol="ipmi"}} {FREE_FAILURES + 1}' in metrics
    assert 'kubevbmc_login_throttled_total{protocol="redfish-basic"} 1' in metrics
    assert 'kubevbmc_login_throttle_sources 1' in metrics
