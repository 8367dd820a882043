"""The pooled agent (`kubevbmc agent --pool`, vbmc/agent/pool.py): one process serving many BMCs, each at its own ports
with its own credentials and certificate, reconfigured from its pool file without touching the members that did
not change. One pool process (memory backend) serves the module; ipmitool, pyghmi, sushy and requests drive it.
The pool config's parsing and the reconcile plan are tested as pure functions first."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from pyghmi.ipmi import command as pyghmi_command

from vbmc.agent.bmc import BmcSpec
from vbmc.agent.pool import PoolConfigError, parse_pool, plan, secret_pool_json
from vbmc.machine import PowerState
from vbmc.machine.memory import MemoryMachine

from ..support.agents import free_port, ipmitool_argv, stop_process
from ..support.cluster import REPO, STOP_DEADLINE, wait_for

MEMBERS = 20


# ---- the pool config (pure)


def entry(i: int, **changes: Any) -> dict[str, Any]:
    doc = {"name": f"bmc-{i:02d}", "vm": f"vm-{i:02d}", "username": f"user{i:02d}", "password": f"pass-{i:02d}",
           "ipmiPort": 20000 + i, "httpPort": 30000 + i, "httpsPort": 0, "ipmi": True, "redfish": True,
           "requireTLS": False, "tlsCert": "", "tlsKey": "", "subscriptionsSecret": ""}
    doc.update(changes)
    return doc


def pool_json(*entries: dict[str, Any]) -> bytes:
    return json.dumps({"members": list(entries)}).encode()


def test_parse_pool_reads_every_field_and_sorts_by_name() -> None:
    members = parse_pool(pool_json(entry(2, httpsPort=40002, tlsCert="C", tlsKey="K", requireTLS=True,
                                         subscriptionsSecret="s"), entry(1, ipmi=False, redfish=False)))
    assert [m.name for m in members] == ["bmc-01", "bmc-02"]
    assert members[1] == BmcSpec(name="bmc-02", vm="vm-02", username="user02", password="pass-02",
                                    ipmi_port=20002, http_port=30002, https_port=40002, ipmi=True, redfish=True,
                                    require_tls=True, tls_cert="C", tls_key="K", subscriptions_secret="s")
    assert members[1].serves_https and not members[0].serves_https
    assert (members[0].ipmi, members[0].redfish) == (False, False)


def test_parse_pool_takes_optional_fields_absent_and_ignores_unknown_keys() -> None:
    doc = entry(1, extra="from a newer controller")
    for key in ("httpsPort", "requireTLS", "tlsCert", "tlsKey", "subscriptionsSecret"):
        del doc[key]
    (member,) = parse_pool(pool_json(doc))
    assert (member.https_port, member.require_tls, member.tls_cert, member.subscriptions_secret) == (0, False, "", "")


def test_a_member_with_empty_credentials_is_left_out_and_the_others_kept() -> None:
    left_out: list[str] = []
    members = parse_pool(pool_json(entry(1, password=""), entry(2), entry(3, username="")), left_out)
    assert [m.name for m in members] == ["bmc-02"]
    assert left_out == ["member bmc-01 is left out: its user name or password is empty",
                        "member bmc-03 is left out: its user name or password is empty"]


def test_parse_pool_accepts_an_empty_pool() -> None:
    assert parse_pool(b'{"members": []}') == ()


def _without(key: str) -> dict[str, Any]:
    doc = entry(1)
    del doc[key]
    return doc


@pytest.mark.parametrize(("raw", "problem"), [
    (b"{not json", "not JSON"),
    (b"[]", "expected"),
    (b'{"members": {}}', "expected"),
    (b'{"members": [3]}', "members[0] is not an object"),
    (pool_json(_without("password")), "password is missing"),
    (pool_json(_without("httpPort")), "httpPort is missing"),
    (pool_json(_without("ipmi")), "ipmi is missing"),
    (pool_json(entry(1, ipmiPort="20001")), "ipmiPort must be a number, not a string"),
    (pool_json(entry(1, httpPort=True)), "httpPort must be a number, not a boolean"),
    (pool_json(entry(1, redfish="true")), "redfish must be a boolean, not a string"),
    (pool_json(entry(1, httpPort=70000)), "httpPort 70000 is not a port"),
    (pool_json(entry(1, ipmiPort=0)), "ipmiPort 0 is not a port"),
    (pool_json(entry(1, name="Not_A_Name")), "not a Kubernetes object name"),
    (pool_json(entry(1, vm="a/b")), "not a usable VM name"),
    (pool_json(entry(1), entry(1, ipmiPort=1, httpPort=2)), "the name bmc-01 is in the pool twice"),
    (pool_json(entry(1), entry(2, vm="vm-01")), "the VM vm-01 is in the pool twice"),
    (pool_json(entry(1), entry(2, httpPort=30001)), "both have TCP port 30001"),
    (pool_json(entry(1), entry(2, ipmiPort=20001)), "both have UDP port 20001"),
    (pool_json(entry(1, httpsPort=40000, tlsCert="C", tlsKey="K"), entry(2, httpPort=40000)),
     "both have TCP port 40000"),
])
def test_parse_pool_refuses_a_config_it_cannot_use_whole(raw: bytes, problem: str) -> None:
    with pytest.raises(PoolConfigError, match=re.escape(problem)):
        parse_pool(raw)


def test_a_refused_config_does_not_repeat_a_secret_value() -> None:
    with pytest.raises(PoolConfigError) as refused:
        parse_pool(pool_json(entry(1, password=123456789)))
    assert "password must be a string, not a number" in str(refused.value)
    assert "123456789" not in str(refused.value)


@pytest.mark.parametrize(("flags", "problem"), [
    (["--backend", "memory"], "exactly one of --pool-secret"),
    (["--backend", "memory", "--pool-secret", "s"], "--pool-secret needs the kubevirt backend"),
    (["--pool-file", "f", "--pool-secret", "s", "--namespace", "n"], "exactly one of --pool-secret"),
    (["--pool-secret", "s"], "--namespace is required"),
])
def test_the_pool_flags_are_checked(flags: list[str], problem: str, capsys: pytest.CaptureFixture[str]) -> None:
    from vbmc.cli import main

    assert main(["agent", "--pool", "p", *flags]) == 2
    assert problem in capsys.readouterr().err


def test_ports_of_listeners_that_are_off_may_repeat() -> None:
    members = parse_pool(pool_json(entry(1, ipmi=False), entry(2, ipmiPort=20001), entry(3, httpsPort=30002)))
    assert len(members) == 3  # no IPMI for bmc-01, no HTTPS (no certificate) for bmc-03


def test_plan_touches_only_what_changed() -> None:
    a, b, c = (parse_pool(pool_json(entry(i)))[0] for i in (1, 2, 3))
    b2 = parse_pool(pool_json(entry(2, password="new")))[0]
    steps = plan({"bmc-01": a, "bmc-02": b, "bmc-03": c}, [a, b2, parse_pool(pool_json(entry(4)))[0]])
    assert steps.stop == ("bmc-02", "bmc-03")
    assert [m.name for m in steps.start] == ["bmc-02", "bmc-04"]
    assert plan({"bmc-01": a}, [a]).stop == () and plan({"bmc-01": a}, [a]).start == ()


def test_secret_pool_json_decodes_the_secret_data() -> None:
    raw = pool_json(entry(1))
    assert secret_pool_json({"data": {"pool.json": base64.b64encode(raw).decode()}}) == raw
    assert secret_pool_json({"data": {}}) is None
    with pytest.raises(PoolConfigError, match="not base64"):
        secret_pool_json({"data": {"pool.json": "%%%"}})


def test_lazy_url_builders_still_build_urls() -> None:
    """The pool compiles werkzeug's URL builders on first use (memory); url_for must answer as before."""
    from flask import Flask, url_for

    from vbmc.agent.runtime import lazy_url_builders

    lazy_url_builders()
    app = Flask("t")

    @app.route("/redfish/v1/Systems/<system>")
    def system(system: str) -> str:
        return system

    with app.test_request_context():
        assert url_for("system", system="vm-1") == "/redfish/v1/Systems/vm-1"
        assert url_for("system", system="vm-1", x="y") == "/redfish/v1/Systems/vm-1?x=y"


# ---- a pool process


def self_signed(common_name: str) -> tuple[str, str]:
    """(certificate PEM, key PEM) for 127.0.0.1, self-signed."""
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM).decode(), key_pem.decode()


@dataclass
class Member:
    index: int
    ipmi_port: int
    http_port: int
    password: str
    https_port: int = 0
    cert: str = ""
    key: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"bmc-{self.index:02d}"

    @property
    def vm(self) -> str:
        return f"vm-{self.index:02d}"

    @property
    def user(self) -> str:
        return f"user{self.index:02d}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def system(self) -> str:
        return f"{self.url}/redfish/v1/Systems/{self.vm}"

    def entry(self) -> dict[str, Any]:
        return entry(self.index, username=self.user, password=self.password, ipmiPort=self.ipmi_port,
                     httpPort=self.http_port, httpsPort=self.https_port, tlsCert=self.cert, tlsKey=self.key,
                     **self.extra)

    def ipmitool(self, *args: str, user: str | None = None, password: str | None = None,
                 retries: str = "2") -> subprocess.CompletedProcess[str]:
        argv = ipmitool_argv("127.0.0.1", self.ipmi_port, "-R", retries, "-N", "1", *args,
                             user=user or self.user, password=password or self.password)
        return subprocess.run(argv, capture_output=True, text=True, timeout=30)

    def get(self, path: str = "", auth: tuple[str, str] | None = None, **kwargs: Any) -> requests.Response:
        return requests.get(f"{self.system}{path}", auth=auth or (self.user, self.password), timeout=5, **kwargs)


_taken: set[tuple[int, int]] = set()


def port(kind: int = socket.SOCK_STREAM) -> int:
    """A free port not handed out before in this module (free_port alone may give the same one twice)."""
    while (kind, number := free_port(kind)) in _taken:
        pass
    _taken.add((kind, number))
    return number


def new_member(index: int, https: bool = False) -> Member:
    member = Member(index, port(socket.SOCK_DGRAM), port(), f"pass-{index:02d}")
    if https:
        member.https_port = port()
        member.cert, member.key = self_signed(f"bmc-{index:02d}")
    return member


class PoolProcess:
    """A pool agent process: with the memory backend and a pool file, or (`source`) other flags and environment
    (the kubevirt backend and a pool Secret)."""

    def __init__(self, directory: Path, members: list[Member],
                 source: tuple[list[str], dict[str, str]] | None = None, pass_fds: tuple[int, ...] = ()) -> None:
        self.directory = directory
        self.members = members
        self.file = directory / "pool.json"
        self.port = port()
        flags, env = source or (["--backend", "memory", "--pool-file", str(self.file)], {})
        if source is None:
            self.write()
        self.log_path = directory / "pool.log"
        self.log = open(self.log_path, "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vbmc", "agent", "--pool", "test", *flags, "--address", "127.0.0.1",
             "--redfish-address", f"127.0.0.1:{self.port}", "--log-level", "info"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **env}, pass_fds=pass_fds)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write(self, raw: bytes | None = None) -> None:
        """The pool file, replaced whole (the agent never reads half of it)."""
        tmp = self.file.with_suffix(".tmp")
        tmp.write_bytes(raw if raw is not None else pool_json(*(m.entry() for m in self.members)))
        os.replace(tmp, self.file)

    def ready(self) -> bool:
        try:
            return requests.get(f"{self.url}/readyz", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def metric(self, name: str) -> float:
        text = requests.get(f"{self.url}/metrics", timeout=5).text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        assert match is not None, text
        return float(match.group(1))

    def output(self) -> str:
        return self.log_path.read_text()

    def stop(self, timeout: float = STOP_DEADLINE) -> int:
        return stop_process(self.proc, self.log, timeout)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolProcess]:
    members = [new_member(i, https=i in (0, 1)) for i in range(MEMBERS)]
    process = PoolProcess(tmp_path_factory.mktemp("pool"), members)
    try:
        wait_for(process.ready, timeout=20, what="the pool to be ready")
        yield process
    finally:
        assert process.stop() == 0, process.output()[-3000:]


def each(members: list[Member], check: Any) -> list[Any]:
    with ThreadPoolExecutor(8) as workers:
        return list(workers.map(check, members))


def test_every_member_answers_ipmitool_with_its_own_credentials(pool: PoolProcess) -> None:
    results = each(pool.members, lambda m: m.ipmitool("power", "status"))
    for member, result in zip(pool.members, results, strict=True):
        assert result.stdout.strip() == "Chassis Power is off", (member.name, result.stderr)


def test_every_member_answers_redfish_with_its_own_credentials(pool: PoolProcess) -> None:
    for member, resp in zip(pool.members, each(pool.members, lambda m: m.get()), strict=True):
        assert resp.status_code == 200, member.name
        assert (resp.json()["Id"], resp.json()["PowerState"]) == (member.vm, "Off")


def test_another_members_credentials_are_refused(pool: PoolProcess) -> None:
    a, b = pool.members[2], pool.members[3]
    result = a.ipmitool("power", "status", user=b.user, password=b.password, retries="1")
    assert result.returncode != 0
    assert "RAKP" in result.stderr or "Unable to establish IPMI v2" in result.stderr, result.stderr
    assert a.get(auth=(b.user, b.password)).status_code == 401
    assert a.get(auth=(a.user, b.password)).status_code == 401
    assert a.get().status_code == 200


def test_sushy_logs_in_to_a_member(pool: PoolProcess) -> None:
    import sushy
    from sushy import auth as sushy_auth

    member = pool.members[4]
    with sushy_auth.SessionAuth(member.user, member.password) as auth:
        root = sushy.Sushy(f"{member.url}/redfish/v1", auth=auth)
        system = root.get_system(f"/redfish/v1/Systems/{member.vm}")
        assert (system.identity, system.power_state) == (member.vm, sushy.POWER_STATE_OFF)


def test_power_on_of_one_member_leaves_the_others_off(pool: PoolProcess) -> None:
    a, b = pool.members[5], pool.members[6]
    assert "Chassis Power Control: Up/On" in a.ipmitool("power", "on").stdout
    wait_for(lambda: a.get().json()["PowerState"] == "On", what="member A on")
    assert b.get().json()["PowerState"] == "Off"
    assert b.ipmitool("power", "status").stdout.strip() == "Chassis Power is off"
    assert a.ipmitool("power", "status").stdout.strip() == "Chassis Power is on"
    reset = requests.post(f"{a.system}/Actions/ComputerSystem.Reset", json={"ResetType": "ForceOff"},
                          auth=(a.user, a.password), timeout=5)
    assert reset.status_code in (200, 202, 204)


def test_https_presents_the_members_own_certificate(pool: PoolProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    for member, other in ((pool.members[0], pool.members[1]), (pool.members[1], pool.members[0])):
        presented = ssl.get_server_certificate(("127.0.0.1", member.https_port), timeout=5)
        assert ssl.PEM_cert_to_DER_cert(presented) == ssl.PEM_cert_to_DER_cert(member.cert)
        cafile = pool.directory / f"{member.name}.crt"
        cafile.write_text(member.cert)
        url = f"https://127.0.0.1:{member.https_port}/redfish/v1/Systems/{member.vm}"
        assert requests.get(url, auth=(member.user, member.password), verify=str(cafile), timeout=5).json()[
            "Id"] == member.vm
        wrong = pool.directory / f"{other.name}.crt"
        wrong.write_text(other.cert)
        with pytest.raises(requests.exceptions.SSLError):
            requests.get(url, verify=str(wrong), timeout=5)
    assert pool.members[2].https_port == 0


def login(member: Member) -> str:
    resp = requests.post(f"{member.url}/redfish/v1/SessionService/Sessions", timeout=5,
                         json={"UserName": member.user, "Password": member.password})
    assert resp.status_code == 201, resp.text
    return resp.headers["X-Auth-Token"]


def with_token(member: Member, token: str) -> int:
    return requests.get(member.system, headers={"X-Auth-Token": token}, timeout=5).status_code


def ipmi_starts(pool: PoolProcess, member: Member) -> int:
    return pool.output().count(f"ipmi server started vm={member.vm} ")


def test_adding_a_member_restarts_nothing(pool: PoolProcess) -> None:
    kept = pool.members[7]
    session = pyghmi_command.Command(bmc="127.0.0.1", userid=kept.user, password=kept.password,
                                     port=kept.ipmi_port)
    try:
        assert session.get_power()["powerstate"] == "off"
        token = login(kept)
        pid = pool.proc.pid
        added = new_member(MEMBERS)
        pool.members.append(added)
        pool.write()
        wait_for(lambda: added.get().status_code == 200, what="the 21st member's Redfish")
        assert added.ipmitool("power", "status").stdout.strip() == "Chassis Power is off"
        assert session.get_power()["powerstate"] == "off"  # the same IPMI session, still open
        assert with_token(kept, token) == 200  # the same Redfish session
        assert pool.proc.pid == pid and pool.proc.poll() is None
        assert ipmi_starts(pool, kept) == 1
        assert pool.metric("kubevbmc_agent_pool_members") == MEMBERS + 1
    finally:
        session.ipmi_session.logout()


def test_removing_a_member_closes_its_ports(pool: PoolProcess) -> None:
    removed = pool.members.pop()
    pool.write()

    def refused() -> bool:
        try:
            requests.get(removed.system, auth=(removed.user, removed.password), timeout=2)
        except requests.ConnectionError:
            return True
        return False

    wait_for(refused, timeout=5, what="the removed member's HTTP port to close")
    wait_for(lambda: removed.ipmitool("power", "status", retries="1").returncode != 0, timeout=5,
             what="the removed member's IPMI port to close")
    assert pool.members[8].get().status_code == 200
    wait_for(lambda: pool.metric("kubevbmc_agent_pool_members") == MEMBERS, timeout=5, what="20 members")


def test_changing_a_password_restarts_only_that_member(pool: PoolProcess) -> None:
    changed, other = pool.members[9], pool.members[10]
    other_token = login(other)
    old = changed.password
    changed.password = "a-new-pass"
    pool.write()
    wait_for(lambda: changed.get().status_code == 200, timeout=5, what="the new password to be taken")
    assert changed.get(auth=(changed.user, old)).status_code == 401
    assert changed.ipmitool("power", "status").stdout.strip() == "Chassis Power is off"
    refused = changed.ipmitool("power", "status", password=old, retries="1")
    assert refused.returncode != 0
    assert with_token(other, other_token) == 200
    assert (ipmi_starts(pool, changed), ipmi_starts(pool, other)) == (2, 1)


@pytest.mark.parametrize("raw", [
    b'{"members": [',
    pool_json(_without("password")),
    pool_json(entry(1, httpPort=31000), entry(2, httpPort=31000)),
], ids=["bad-json", "missing-field", "duplicate-ports"])
def test_a_malformed_pool_file_changes_nothing(pool: PoolProcess, raw: bytes) -> None:
    rejected = pool.metric("kubevbmc_agent_pool_config_rejected_total")
    applied = pool.metric("kubevbmc_agent_pool_config_applied_total")
    starts = pool.output().count("member started")
    pool.write(raw)
    try:
        wait_for(lambda: pool.metric("kubevbmc_agent_pool_config_rejected_total") == rejected + 1, timeout=5,
                 what="the agent to refuse the file")
        assert "the pool config is not valid, nothing changes" in pool.output()
        assert pool.metric("kubevbmc_agent_pool_members") == MEMBERS
        for member in (pool.members[11], pool.members[-1]):
            assert member.get().status_code == 200
            assert member.ipmitool("power", "status").stdout.strip() == "Chassis Power is off"
    finally:
        pool.write()
    # The good file again: read and applied, and no member (re)started.
    wait_for(lambda: pool.metric("kubevbmc_agent_pool_config_applied_total") == applied + 1, timeout=5,
             what="the good file to be read again")
    assert pool.output().count("member started") == starts


def test_the_pool_port_answers_probes_and_metrics_and_nothing_else(pool: PoolProcess) -> None:
    assert requests.get(f"{pool.url}/healthz", timeout=5).status_code == 200
    assert requests.get(f"{pool.url}/readyz", timeout=5).status_code == 200
    member = pool.members[12]
    failures = pool.metric('kubevbmc_login_failures_total{protocol="redfish-basic"}')
    assert member.get(auth=(member.user, "wrong")).status_code == 401
    assert pool.metric('kubevbmc_login_failures_total{protocol="redfish-basic"}') == failures + 1
    assert pool.metric("kubevbmc_agent_pool_members_serving") == MEMBERS
    assert requests.get(f"{pool.url}/redfish/v1", timeout=5).status_code == 404
    assert requests.get(f"{pool.url}/redfish/v1/Systems/{member.vm}", auth=(member.user, member.password),
                        timeout=5).status_code == 404
    # A member's own port answers its probes and metrics, as a dedicated agent's does.
    assert requests.get(f"{member.url}/readyz", timeout=5).status_code == 200
    assert "kubevbmc_login_failures_total" in requests.get(f"{member.url}/metrics", timeout=5).text


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"BLAH\r\n\r\n", 400),
    (b"GET /redfish/v1/" + b"a" * 5000 + b" HTTP/1.1\r\nHost: bmc\r\n\r\n", 414),
    (b"GET /redfish/v1 HTTP/1.1\r\nHost: bmc\r\nX-Huge: " + b"b" * 40000 + b"\r\n\r\n", 431),
    (b"POST /redfish/v1/SessionService/Sessions HTTP/1.1\r\nHost: bmc\r\nContent-Length: 10000000\r\n\r\n", 413),
], ids=["request-line", "long-uri", "huge-headers", "huge-body"])
def test_a_member_refuses_malformed_requests_as_a_dedicated_agent(pool: PoolProcess, request_bytes: bytes,
                                                                   status: int, tls: bool) -> None:
    from ..redfish.test_hostile_http import raw_exchange, redfish_error

    member = pool.members[0]
    got, headers, body = raw_exchange(member.https_port if tls else member.http_port, request_bytes, tls=tls)
    assert got == status, body
    assert headers["content-type"].startswith("application/json")
    assert redfish_error(body)["code"] == "Base.1.19.GeneralError"
    assert member.get().status_code == 200


def test_stalled_connections_to_one_member_leave_the_others_serving(pool: PoolProcess) -> None:
    stalled_at, other = pool.members[14], pool.members[15]
    stalled = [socket.create_connection(("127.0.0.1", stalled_at.http_port), timeout=5) for _ in range(20)]
    try:
        for conn in stalled:
            conn.sendall(b"GET /redfish/v1 HTTP/1.1\r\nHo")  # and nothing more
        # Answered within the client's timeout (5 s), while the stalled requests wait for theirs (the same 5 s)
        assert other.get().status_code == 200
        assert stalled_at.get().status_code == 200
    finally:
        for conn in stalled:
            conn.close()


# ---- members that cannot start, and members with a protocol off


def test_a_member_that_cannot_start_is_retried_and_holds_up_no_other(tmp_path: Path) -> None:
    busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    blocked = new_member(1)
    blocked.http_port = busy.getsockname()[1]
    bad_pem = new_member(2, https=True)
    bad_pem.cert = "-----BEGIN CERTIFICATE-----\nnot a certificate\n-----END CERTIFICATE-----\n"
    no_redfish, no_ipmi = new_member(3), new_member(4)
    no_redfish.extra, no_ipmi.extra = {"redfish": False}, {"ipmi": False}
    process = PoolProcess(tmp_path, [blocked, bad_pem, no_redfish, no_ipmi])
    try:
        wait_for(process.ready, timeout=20, what="the pool to be ready despite two members failing")
        assert blocked.ipmitool("power", "status").stdout.strip() == "Chassis Power is off"
        assert bad_pem.get().status_code == 200  # HTTP serves; HTTPS does not
        with pytest.raises(requests.ConnectionError):
            requests.get(f"https://127.0.0.1:{bad_pem.https_port}/redfish/v1", verify=False, timeout=2)
        out = process.output()
        assert f"member bmc-01 cannot serve HTTP: 127.0.0.1:{blocked.http_port}" in out
        assert "member bmc-02 cannot serve HTTPS" in out
        # Redfish off: 404 ServiceDisabled, IPMI on; IPMI off: no answer, Redfish on.
        off = requests.get(no_redfish.system, auth=(no_redfish.user, no_redfish.password), timeout=5)
        assert off.status_code == 404
        assert off.json()["error"]["@Message.ExtendedInfo"][0]["MessageId"].endswith("ServiceDisabled")
        assert no_redfish.ipmitool("power", "status").stdout.strip() == "Chassis Power is off"
        assert no_ipmi.get().status_code == 200
        assert no_ipmi.ipmitool("power", "status", retries="1").returncode != 0
        assert process.metric("kubevbmc_agent_pool_members_serving") == 2
        busy.close()  # the port frees: the member's next retry takes it
        wait_for(lambda: blocked.get().status_code == 200, timeout=10, interval=0.2, what="the retry to bind")
        assert process.metric("kubevbmc_agent_pool_member_start_failures_total") >= 2
    finally:
        busy.close()
        assert process.stop() == 0


def test_sigterm_stops_a_pool(tmp_path: Path) -> None:
    process = PoolProcess(tmp_path, [new_member(i) for i in range(10)])
    try:
        wait_for(process.ready, timeout=20, what="the pool to be ready")
        assert process.members[0].ipmitool("power", "status").returncode == 0
        assert process.stop(timeout=STOP_DEADLINE) == 0  # exit 0, not killed
    finally:
        process.stop()


# ---- a pool past 1,024 descriptors


LARGE_POOL = 280  # memory backend: two descriptors a member (its UDP socket and HTTP listener)
INHERITED = 600  # descriptors the pool process starts with, so that its last members' sockets are numbered past 1,024
IPMI_THREADS_AT_REST = 40  # the pool's threads, whatever its size: one IPMI loop and its workers, not one per member


class CpuAtRest:
    """The pool process's CPU use (utime + stime) since the previous look, for a wait on "at rest"."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.last = (time.monotonic(), self.used())

    def used(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def __call__(self) -> bool:
        """Whether the last second (at least) took under 5% of a core."""
        now, used = time.monotonic(), self.used()
        then, before = self.last
        if now - then < 1.0:
            return False
        self.last = (now, used)
        return (used - before) / (now - then) < 0.05


def threads_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^Threads:\s+(\d+)$", status, re.MULTILINE)
    assert match is not None
    return int(match.group(1))


def test_a_pool_raises_its_soft_descriptor_limit_to_the_hard_one() -> None:
    import resource

    from vbmc.agent.command import raise_descriptor_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"the hard descriptor limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # a container's usual soft limit
    try:
        raise_descriptor_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == (hard if hard != resource.RLIM_INFINITY else 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def answers_ipmi(member: Member) -> bool:
    """A login and Get Chassis Status, from a console in this process (hundreds of ipmitool runs take long)."""
    from vbmc.ipmi import codec

    from ..ipmi.client import Console

    with Console(("127.0.0.1", member.ipmi_port), timeout=2.0) as console:
        if console.login(member.user, member.password) != (4, 0):
            return False
        answer = console.request(codec.NETFN_CHASSIS, codec.GET_CHASSIS_STATUS, attempts=3)
    return answer is not None and answer.payload[6] == 0


def sockets_of(pid: int) -> dict[int, str]:
    """The process's socket descriptors: number -> "socket:[inode]"."""
    found = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{name}")
            if target.startswith("socket:"):
                found[int(name)] = target
    return found


def test_a_pool_past_1024_descriptors_answers_every_member_and_rests(tmp_path: Path) -> None:
    members = [new_member(i) for i in range(LARGE_POOL)]
    inherited = [os.open(os.devnull, os.O_RDONLY) for _ in range(INHERITED)]
    try:
        process = PoolProcess(tmp_path, members, pass_fds=tuple(inherited))
    finally:
        for fd in inherited:
            os.close(fd)
    try:
        wait_for(process.ready, timeout=60, interval=0.2, what="the large pool to be ready")
        sockets = sockets_of(process.proc.pid)
        assert max(sockets) > 1024  # what the test is about: members' sockets numbered past select's limit
        assert len(sockets) <= 2 * LARGE_POOL + 30  # a member's UDP socket and HTTP listener, no wake pair
        assert threads_of(process.proc.pid) <= IPMI_THREADS_AT_REST  # Redfish workers come on use
        silent = [m.name for m, answered in zip(members, each(members, answers_ipmi), strict=True) if not answered]
        assert silent == []
        # Every member answered IPMI (eight at a time) and the threads did not grow with the members: the process's
        # IPMI loop took each member's turn on one of its few workers.
        assert threads_of(process.proc.pid) <= IPMI_THREADS_AT_REST
        # At rest it costs nothing: no member's thread spins (a ValueError from select.select looped on, before).
        wait_for(CpuAtRest(process.proc.pid), timeout=30, interval=0.5, what="the pool at rest")
        assert "Traceback" not in process.output() and "ERROR" not in process.output()
    finally:
        assert process.stop(timeout=10) == 0, process.output()[-3000:]


# ---- on kubesim: the pool Secret and the kubevirt backend


def put_pool_secret(api: Any, namespace: str, members: list[Member]) -> None:
    from ..support.cluster import call

    body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "pool-test"},
            "data": {"pool.json": base64.b64encode(pool_json(*(m.entry() for m in members))).decode()}}
    path = f"/api/v1/namespaces/{namespace}/secrets"
    reply = call(api, "PUT", f"{path}/pool-test", body)
    if reply.status == 404:
        reply = call(api, "POST", path, body)
    assert reply.status in (200, 201), reply.body


def test_a_pool_secret_on_kubesim_drives_each_members_own_vm(sim: Any, api: Any, namespace: str, bmc_crd: None,
                                                              tmp_path: Path) -> None:
    from ..support.vms import make_bmc, make_vm, printable

    members = [new_member(i) for i in range(2)]
    for member in members:
        make_vm(api, namespace, member.vm)
        make_bmc(api, namespace, member.vm)
        member.extra = {"name": member.vm}  # the VirtualMachineBMC is named after its VM
    put_pool_secret(api, namespace, members)
    process = PoolProcess(tmp_path, members, source=(
        ["--namespace", namespace, "--pool-secret", "pool-test"], {"KUBECONFIG": sim.kubeconfig}))
    try:
        wait_for(process.ready, timeout=20, what="the pool to be ready")
        a, b = members
        assert "Up/On" in a.ipmitool("power", "on").stdout
        wait_for(lambda: printable(api, namespace, a.vm) == "Running", timeout=10, what="A running")
        assert printable(api, namespace, b.vm) == "Stopped"
        assert b.get().json()["PowerState"] == "Off"
        # A third member through the Secret: it serves, and nothing else restarts.
        added = new_member(2)
        make_vm(api, namespace, added.vm)
        added.extra = {"name": added.vm}
        members.append(added)
        put_pool_secret(api, namespace, members)
        wait_for(lambda: added.ipmitool("power", "status", retries="1").stdout.strip() == "Chassis Power is off",
                 timeout=10, interval=0.2, what="the added member")
        assert (ipmi_starts(process, a), ipmi_starts(process, b)) == (1, 1)
        assert a.get().json()["PowerState"] == "On"
    finally:
        assert process.stop() == 0, process.output()[-3000:]


# ---- isolation: one member's slow backend, in-process


class HungMachine(MemoryMachine):
    """A MemoryMachine whose power state reads hang while `gate` is closed (a backend that hangs), 30 s at most."""

    def __init__(self, name: str, gate: threading.Event) -> None:
        super().__init__(name=name)
        self.gate = gate

    def power_state(self) -> PowerState:
        self.gate.wait(timeout=30)
        return super().power_state()


def test_one_members_slow_backend_delays_no_other_member(tmp_path: Path) -> None:
    from vbmc.agent.pool import file_source
    from vbmc.agent.runtime import Agent, Settings

    gate = threading.Event()
    gate.set()
    a, b = new_member(0), new_member(1)
    path = tmp_path / "pool.json"
    path.write_bytes(pool_json(a.entry(), b.entry()))
    pool_port = port()
    pool = Agent(Settings(pool="t", namespace="default", address="127.0.0.1",
                             redfish_address=f"127.0.0.1:{pool_port}", backend="memory"))
    pool.new_machine = lambda spec: (  # type: ignore[method-assign]
        HungMachine(spec.vm, gate) if spec.vm == a.vm else MemoryMachine(name=spec.vm))
    runner = threading.Thread(target=asyncio.run, args=(pool.run(file_source(pool, str(path))),), daemon=True)
    runner.start()
    try:
        wait_for(pool.ready, timeout=10, what="the in-process pool")
        gate.clear()
        with ThreadPoolExecutor(8) as clients:
            stuck = [clients.submit(a.get) for _ in range(4)]  # more than A's two worker threads
            stuck_ipmi = clients.submit(a.ipmitool, "power", "status")
            time.sleep(0.2)  # A's requests reach its worker threads (nothing outside shows when)
            # While A's backend hangs, B answers both protocols (a B that waited for A would time out: A's reads
            # hang until the gate opens, after B's checks), and both probes answer.
            assert b.get().json()["PowerState"] == "Off"
            assert b.ipmitool("power", "status").stdout.strip() == "Chassis Power is off"
            assert requests.get(f"http://127.0.0.1:{pool_port}/readyz", timeout=5).status_code == 200
            assert requests.get(f"{a.url}/readyz", timeout=5).status_code == 200  # on A's event loop side
            assert not any(f.done() for f in stuck)  # A is still hung
            gate.set()
            assert all(f.result().status_code == 200 for f in stuck)
            stuck_ipmi.result()
    finally:
        gate.set()
        pool.stop()
        runner.join(timeout=10)
    assert not runner.is_alive()
