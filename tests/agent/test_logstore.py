"""A BMC's SEL and audit trail kept in a ConfigMap (issue 31 item 1, vbmc/agent/logstore.py): an agent killed with
SIGKILL and started again shows every entry a client had seen, through ipmitool and Redfish, and numbers new ones
on; a pooled member keeps its own; nothing is written at rest; a full log stays bounded; an API server that does not
answer leaves the agent answering, and what it logged meanwhile is written once it answers again.

The merge and the documents are tested as pure functions first."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from vbmc.access.audit import FIELDS, Entry, Trail, TrailState
from vbmc.agent import logstore
from vbmc.agent.logstore import LogKeeper, audit_document, config_map, read_sel, read_trail, sel_document
from vbmc.machine.eventlog import CAPACITY, NEVER, LogRecord, SelState, SystemEventLog
from vbmc.machine.events import Event
from vbmc.machine.kubevirt.client import KubeClient, load_credentials

from ..support.agents import LOG_DIR, PASSWORD, USER, AgentProcess, free_port, ipmitool_at, redfish_at, running_agent
from ..support.cluster import REPO, Sim, bmc_sim, call, wait_for
from ..support.vms import make_bmc, make_vm
from .test_idle import agent_requests

SYSTEM = "/redfish/v1/Systems/vm"
RESET = f"{SYSTEM}/Actions/ComputerSystem.Reset"
SEL = f"{SYSTEM}/LogServices/SEL"
AUDIT = "/redfish/v1/Managers/BMC/LogServices/AuditLog"
LOG_MAP = "vm-virtbmc-log"
ADD_SEL_ENTRY = ("raw", "0x0a", "0x44", "0x00", "0x00", "0x02", "0x00", "0x00", "0x00", "0x00", "0x41", "0x00",
                 "0x04", "0x12", "0x09", "0x6f", "0x00", "0xff", "0xff")
HANG = 60.0  # deadlines that only catch a hang

pytestmark = pytest.mark.usefixtures("bmc_crd")


# ---- the merge and the documents (pure)


def power(to: str, seq: int = 1) -> Event:
    return Event(seq, "PowerStateChanged", f"power state changed to {to}", "Normal", 1000.0 + seq,
                 {"from": "Off", "to": to})


def test_what_is_logged_before_the_kept_log_is_read_is_numbered_after_it() -> None:
    kept_log = SystemEventLog()
    for seq in (1, 2, 3):
        kept_log.record(power("On", seq))
    kept = kept_log.state()
    here = SystemEventLog()
    here.record(power("Off", 9))
    merged = here.adopt(kept, SelState())
    assert [r.record_id for r in merged.records] == [1, 2, 3, 4]
    assert merged.records[-1].message == "power state changed to Off" and merged.next_id == 5
    assert here.state() == merged


def test_a_client_entry_renumbered_carries_its_new_record_id_in_its_bytes() -> None:
    kept = SelState(next_id=0xFFFE)
    here = SystemEventLog()
    here.add_raw(lambda record_id, stamp: record_id.to_bytes(2, "little") + bytes(14))
    (record,) = here.adopt(kept, SelState()).records
    assert record.record_id == 0xFFFE and record.raw[:2] == b"\xfe\xff"
    assert here.state().next_id == 1  # IPMI's record IDs wrap past FFFEh


def test_a_clear_done_here_clears_the_kept_records_too() -> None:
    here = SystemEventLog()
    here.record(power("On"))
    synced = here.state()
    kept = SelState((*synced.records, LogRecord(2, 5, "PowerStateChanged", "another writer's")), 3, 5)
    here.clear()
    here.record(power("Off", 2))
    merged = here.adopt(kept, synced)
    assert [(r.record_id, r.message) for r in merged.records] == [(3, "power state changed to Off")]
    assert merged.erased != NEVER


def test_another_writers_records_and_this_ones_are_both_kept() -> None:
    here = SystemEventLog()
    here.record(power("On"))
    synced = here.state()
    here.record(power("Off", 2))  # here: 1 On, 2 Off; there: 1 On, 2 Paused
    theirs = SelState((*synced.records, LogRecord(2, 7, "PowerStateChanged", "paused", detail={"to": "Paused"})), 3)
    merged = here.adopt(theirs, synced)
    assert [r.message for r in merged.records] == ["power state changed to On", "paused", "power state changed to Off"]
    assert [r.record_id for r in merged.records] == [1, 2, 3]


def test_a_full_sel_adopting_more_overflows() -> None:
    here = SystemEventLog(capacity=2)
    here.record(power("On"))
    merged = here.adopt(SelState(tuple(LogRecord(i, 1, "", "kept") for i in (1, 2)), 3), SelState())
    assert len(merged.records) == 2 and merged.overflow


def test_the_trail_numbers_on_from_the_kept_one_and_drops_the_oldest_past_capacity() -> None:
    kept = TrailState(tuple(Entry(i, float(i), {"action": f"kept {i}"}, False) for i in (7, 8, 9)), 10)
    here = Trail(capacity=4)
    here.add({"action": "here 1"}, False)
    here.add({"action": "here 2"}, True)
    merged = here.adopt(kept, TrailState())
    assert [(e.entry_id, e.fields["action"]) for e in merged.entries] == [
        (8, "kept 8"), (9, "kept 9"), (10, "here 1"), (11, "here 2")]
    assert merged.next_id == 12 and here.entries()[-1].warning


def test_the_documents_read_back_what_was_written() -> None:
    log = SystemEventLog()
    log.record(power("On"))
    log.add_raw(lambda record_id, stamp: record_id.to_bytes(2, "little") + bytes(range(14)))
    log.clear()
    log.record(power("Paused", 3))
    trail = Trail()
    trail.add({"protocol": "ipmi", "source": "10.0.0.7", "user": "admin", "session": "0x1", "action": "power_on",
               "vm": "vm", "result": "ok", "duration_ms": 12.5}, False)
    assert read_sel(sel_document(log.state())) == log.state()
    assert read_trail(audit_document(trail.state())) == trail.state()


def test_full_logs_with_the_longest_values_fit_in_a_config_map() -> None:
    """256 SEL records and 512 audit entries whose every text is as long as anything could make it, in the
    characters that take the most room (astral plane: 12 bytes each once escaped twice, quotes, control
    characters): the ConfigMap as sent stays under the API server's 1 MiB."""
    worst = "\U0001f600\"\\\x01" * 600
    log = SystemEventLog()
    for seq in range(CAPACITY):
        log.record(Event(seq + 1, "VirtualMediaInserted", worst, "Warning" + worst, 1e9,
                         {f"k{i}{worst}": worst for i in range(20)}))
    trail = Trail()
    for _ in range(trail.capacity):
        trail.add({k: worst for k in FIELDS} | {"duration_ms": 1e300}, True)
    assert len(log) == CAPACITY and len(trail.entries()) == trail.capacity
    owner = {"apiVersion": "bmc.kubevirt.io/v1beta1", "kind": "VirtualMachineBMC",
             "metadata": {"name": "b" * 253, "uid": str(uuid.uuid4())}}
    body = config_map("n" * 63, "m" * 253, owner, log.state(), trail.state())
    body["metadata"]["resourceVersion"] = "9" * 20
    size = len(json.dumps(body).encode())
    assert size < 1024 * 1024, size
    assert len(read_sel(body["data"]["sel.json"]).records) == CAPACITY  # cut, not dropped


# ---- an agent on kubesim


def config_map_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{namespace}/configmaps/{LOG_MAP}"


def kept(api: client.ApiClient, namespace: str) -> tuple[SelState, TrailState] | None:
    reply = call(api, "GET", config_map_path(namespace))
    if reply.status == 404:
        return None
    data = reply.body["data"]
    return read_sel(data.get("sel.json")), read_trail(data.get("audit.json"))


def members(agent: Any, log: str) -> list[dict[str, Any]]:
    status, body = agent.redfish("GET", f"{log}/Entries")
    assert status == 200, body
    return list(body["Members"])


def shown(agent: Any, log: str) -> list[tuple[str, str]]:
    return [(e["Id"], e["Message"]) for e in members(agent, log)]


def sel_lines(agent: Any) -> list[str]:
    result = agent.ipmitool("sel", "elist")
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if "|" in line]


def sel_info(agent: Any) -> dict[str, str]:
    """`ipmitool sel info`'s entry count, last addition and overflow."""
    result = agent.ipmitool("sel", "info")
    assert result.returncode == 0, result.stderr
    fields = dict(line.split(":", 1) for line in result.stdout.splitlines() if ":" in line)
    return {k.strip(): v.strip() for k, v in fields.items() if k.strip() in ("Entries", "Last Add Time", "Overflow")}


def kill(agent: AgentProcess) -> None:
    agent.proc.send_signal(signal.SIGKILL)
    agent.proc.wait(timeout=HANG)


def agent_args(namespace: str) -> tuple[str, ...]:
    return ("--namespace", namespace, "--vm", "vm", "--vmbmc", "vm", "--log-config-map", LOG_MAP)


def test_the_sel_and_the_audit_trail_outlive_a_sigkill_and_number_on(sim: Sim, api: client.ApiClient,
                                                                       namespace: str) -> None:
    make_vm(api, namespace)
    make_bmc(api, namespace)
    ipmi_port = free_port(socket.SOCK_DGRAM)
    with running_agent(*agent_args(namespace), env={"KUBECONFIG": sim.kubeconfig}, ipmi_port=ipmi_port) as first:
        assert first.ipmitool("chassis", "power", "on").returncode == 0
        wait_for(lambda: len(members(first, SEL)) == 1, timeout=HANG, what="the power-on's SEL entry")
        added = first.ipmitool(*ADD_SEL_ENTRY)
        assert added.returncode == 0, added.stderr
        assert first.redfish("POST", RESET, {"ResetType": "ForceOff"})[0] == 204
        wait_for(lambda: len(members(first, SEL)) == 3, timeout=HANG, what="the power-off's SEL entry")
        sel_before, lines_before, audit_before = shown(first, SEL), sel_lines(first), shown(first, AUDIT)
        info_before = sel_info(first)
        assert len(lines_before) == 3 and len(audit_before) >= 2  # power on (IPMI), sel add, ForceOff (Redfish)
        kill(first)  # what was read is kept: no grace for a last write

    with running_agent(*agent_args(namespace), env={"KUBECONFIG": sim.kubeconfig}, ipmi_port=ipmi_port) as second:
        assert shown(second, SEL) == sel_before
        assert sel_lines(second) == lines_before
        assert sel_info(second) == info_before  # the entries, the last addition's time
        audit_after = shown(second, AUDIT)
        assert audit_after[:len(audit_before)] == audit_before

        assert second.redfish("POST", RESET, {"ResetType": "On"})[0] == 204
        wait_for(lambda: len(members(second, SEL)) == 4, timeout=HANG, what="a new SEL entry")
        newest = members(second, SEL)[-1]
        assert int(newest["Id"]) == int(sel_before[-1][0]) + 1 and "to On" in newest["Message"]
        assert int(sel_lines(second)[-1].split("|")[0], 16) == int(newest["Id"])
        audit_ids = [int(i) for i, _ in shown(second, AUDIT)]
        assert audit_ids == sorted(set(audit_ids)) and audit_ids[-1] > int(audit_before[-1][0])

        # a clear is kept too, with its time; numbering goes on after it
        assert second.redfish("POST", f"{SEL}/Actions/LogService.ClearLog", {})[0] == 204
        kill(second)
    with running_agent(*agent_args(namespace), env={"KUBECONFIG": sim.kubeconfig}, ipmi_port=ipmi_port) as third:
        assert members(third, SEL) == []
        info = third.ipmitool("sel", "info")
        assert "Entries          : 0" in info.stdout and "Last Del Time" in info.stdout, info.stdout
        assert "Not Available" not in info.stdout.split("Last Del Time")[1].splitlines()[0]
        assert third.ipmitool(*ADD_SEL_ENTRY).returncode == 0
        assert int(members(third, SEL)[0]["Id"]) == int(newest["Id"]) + 1


def test_nothing_is_written_at_rest_and_a_burst_makes_few_writes(sim: Sim, api: client.ApiClient,
                                                                 namespace: str) -> None:
    make_vm(api, namespace)
    make_bmc(api, namespace)

    def writes() -> float:
        counts = agent_requests(api)
        return sum(n for (verb, resource, _), n in counts.items()
                   if resource == "configmaps" and verb in ("POST", "PUT", "PATCH"))

    with running_agent(*agent_args(namespace), env={"KUBECONFIG": sim.kubeconfig}) as agent:
        burst = 20
        before = writes()
        for _ in range(burst):  # Redfish session logins, each an audit entry nobody reads yet
            status, body = agent.redfish("POST", "/redfish/v1/SessionService/Sessions",
                                         {"UserName": USER, "Password": PASSWORD})
            assert status == 201, body
        wait_for(lambda: kept(api, namespace) is not None
                 and len(kept(api, namespace)[1].entries) >= burst, timeout=HANG,  # type: ignore[index]
                 what="the burst kept")
        made = writes() - before
        assert 1 <= made < burst / 2, made
        at_rest = writes()
        time.sleep(3 * logstore.BATCH_SECONDS)  # idle for several batch windows: nothing asks, nothing is written
        assert writes() == at_rest


def test_two_writers_of_one_config_map_lose_nothing(sim: Sim, api: client.ApiClient, namespace: str) -> None:
    """Two agents for one BMC for a while (a move into a pool, a node lost with its pod running): each writes with
    the resourceVersion it read, and a conflict merges, so the ConfigMap ends with both's entries, each id once."""
    make_bmc(api, namespace)
    owner = call(api, "GET", f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{namespace}/virtualmachinebmcs/vm").body
    kube = KubeClient(load_credentials(sim.kubeconfig))
    logs = [(SystemEventLog(), Trail()) for _ in range(2)]
    for n, (sel, trail) in enumerate(logs):
        LogKeeper(kube, namespace, LOG_MAP, sel, trail, owner=lambda: owner, who=f"writer {n}", batch=0.01).start()
    for i in range(10):
        for n, (sel, trail) in enumerate(logs):
            sel.record(power("On", i + 1))
            trail.add({"action": f"writer {n} entry {i}"}, False)
    for sel, trail in logs:
        sel.settle()
        trail.settle()

    def both_kept() -> tuple[SelState, TrailState] | None:
        found = kept(api, namespace)
        return found if found is not None and len(found[1].entries) == 20 and len(found[0].records) == 20 else None

    sel_kept, trail_kept = wait_for(both_kept, timeout=HANG, what="both writers' entries kept")
    assert sorted(str(e.fields["action"]) for e in trail_kept.entries) == sorted(
        f"writer {n} entry {i}" for n in (0, 1) for i in range(10))
    assert [e.entry_id for e in trail_kept.entries] == list(range(1, 21))
    assert [r.record_id for r in sel_kept.records] == list(range(1, 21))
    kube.close()


def test_a_config_map_of_that_name_that_is_not_the_agents_is_left_alone(
        sim: Sim, api: client.ApiClient, namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    theirs = {"metadata": {"name": LOG_MAP}, "data": {"sel.json": "someone else's"}}
    assert call(api, "POST", f"/api/v1/namespaces/{namespace}/configmaps", theirs).status == 201
    kube = KubeClient(load_credentials(sim.kubeconfig))
    sel, trail = SystemEventLog(), Trail()
    LogKeeper(kube, namespace, LOG_MAP, sel, trail, owner=lambda: {}, who="agent", batch=0.01).start()
    trail.add({"action": "power_on"}, False)
    trail.settle()  # does not wait: the write is refused
    assert [e.fields["action"] for e in trail.entries()] == ["power_on"]  # kept in memory
    assert call(api, "GET", config_map_path(namespace)).body["data"] == {"sel.json": "someone else's"}
    assert any("is not managed by kubevbmc" in r.getMessage() for r in caplog.records)
    kube.close()


def test_a_sigterm_keeps_what_nobody_has_read_yet(sim: Sim, api: client.ApiClient, namespace: str) -> None:
    make_vm(api, namespace)
    make_bmc(api, namespace)
    with running_agent(*agent_args(namespace), env={"KUBECONFIG": sim.kubeconfig}) as agent:
        status, _ = agent.redfish("POST", "/redfish/v1/SessionService/Sessions",
                                  {"UserName": USER, "Password": PASSWORD})
        assert status == 201
        assert agent.stop() == 0  # within the batch window: written on the way out
    stored = kept(api, namespace)
    assert stored is not None and [e.fields["action"] for e in stored[1].entries][-1].startswith("POST")


def pool_agent(sim: Sim, namespace: str, pool_file: Path, own_port: int) -> subprocess.Popen[bytes]:
    log = open((LOG_DIR or Path("/tmp")) / f"pool-{own_port}.log", "w")  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-m", "vbmc", "agent", "--pool", "p", "--pool-file", str(pool_file), "--namespace",
         namespace, "--address", "127.0.0.1", "--redfish-address", f"127.0.0.1:{own_port}"],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "KUBECONFIG": sim.kubeconfig})


class Member:
    def __init__(self, http_port: int, ipmi_port: int) -> None:
        self.url = f"http://127.0.0.1:{http_port}"
        self.ipmi_port = ipmi_port

    def redfish(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return redfish_at(self.url, method, path, body)

    def ipmitool(self, *args: str) -> subprocess.CompletedProcess[str]:
        return ipmitool_at("127.0.0.1", self.ipmi_port, *args)


@pytest.fixture
def pool_file(tmp_path: Path) -> Path:
    return tmp_path / "pool.json"


def test_a_pooled_member_keeps_its_log_across_a_sigkill(sim: Sim, api: client.ApiClient, namespace: str,
                                                        pool_file: Path) -> None:
    make_vm(api, namespace)
    make_bmc(api, namespace)
    member = Member(free_port(), free_port(socket.SOCK_DGRAM))
    pool_file.write_text(json.dumps({"members": [{
        "name": "vm", "vm": "vm", "username": USER, "password": PASSWORD, "ipmiPort": member.ipmi_port,
        "httpPort": int(member.url.rsplit(":", 1)[1]), "ipmi": True, "redfish": True, "logConfigMap": LOG_MAP}]}))
    before: list[tuple[str, str]] = []
    for round_ in (1, 2):
        proc = pool_agent(sim, namespace, pool_file, free_port())
        try:
            wait_for(lambda: member.redfish("GET", SYSTEM)[0] == 200 and member.ipmitool("sel", "info").returncode == 0,
                     timeout=HANG, what="the member serving")
            if round_ == 1:
                assert member.ipmitool(*ADD_SEL_ENTRY).returncode == 0
                assert member.redfish("POST", RESET, {"ResetType": "On"})[0] == 204
                wait_for(lambda: len(members(member, SEL)) == 2, timeout=HANG, what="the power-on's SEL entry")
                before = shown(member, SEL)
                audit_before = shown(member, AUDIT)
                assert audit_before
            else:
                assert shown(member, SEL) == before
                assert shown(member, AUDIT)[:len(audit_before)] == audit_before
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=HANG)
    owner = call(api, "GET", f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{namespace}/virtualmachinebmcs/vm").body
    stored = call(api, "GET", config_map_path(namespace)).body
    assert stored["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
    assert stored["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kubevbmc"


def test_a_full_log_read_back_stays_bounded_and_numbers_on(sim: Sim, api: client.ApiClient, namespace: str) -> None:
    make_vm(api, namespace)
    make_bmc(api, namespace)
    owner = call(api, "GET", f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{namespace}/virtualmachinebmcs/vm").body
    full_sel = SelState(tuple(LogRecord(i, 1_700_000_000 + i, "PowerStateChanged", f"kept {i}",
                                        detail={"to": "On"}) for i in range(1, CAPACITY + 1)), CAPACITY + 1,
                        1_700_000_000 + CAPACITY)
    full_trail = TrailState(tuple(Entry(i, 1.7e9 + i, {k: "-" for k in FIELDS} | {"action": f"kept {i}"}, False)
                                  for i in range(1001, 1001 + 512)), 1001 + 512)
    body = config_map(namespace, LOG_MAP, owner, full_sel, full_trail)
    assert call(api, "POST", f"/api/v1/namespaces/{namespace}/configmaps", body).status == 201

    with running_agent(*agent_args(namespace), env={"KUBECONFIG": sim.kubeconfig}) as agent:
        assert len(members(agent, SEL)) == CAPACITY
        added = agent.ipmitool(*ADD_SEL_ENTRY)
        assert added.returncode != 0, added.stdout  # 0xC4: out of space
        info = agent.ipmitool("sel", "info")
        assert f"Entries          : {CAPACITY}" in info.stdout and "Overflow         : true" in info.stdout
        trail = members(agent, AUDIT)
        assert len(trail) == 512 and int(trail[-1]["Id"]) > 1512  # the sel add's own entry, after the kept ones
        now = kept(api, namespace)
        assert now is not None
        sel, audit = now
        assert len(sel.records) == CAPACITY and sel.overflow
        assert len(audit.entries) == 512 and audit.entries[0].entry_id > 1001


@pytest.fixture
def own_sim(tmp_path: Path) -> Iterator[Sim]:
    """A kubesim this test freezes."""
    with bmc_sim(tmp_path / "sim") as sim:
        try:
            yield sim
        finally:
            os.kill(sim.process.pid, signal.SIGCONT)


def test_an_api_server_that_does_not_answer_leaves_the_agent_answering_and_the_entry_is_written_later(
        own_sim: Sim) -> None:
    api = own_sim.api()
    namespace = "frozen"
    assert call(api, "POST", "/api/v1/namespaces", {"metadata": {"name": namespace}}).status == 201
    make_vm(api, namespace)
    make_bmc(api, namespace)
    with running_agent(*agent_args(namespace), env={"KUBECONFIG": own_sim.kubeconfig}) as agent:
        assert agent.ipmitool(*ADD_SEL_ENTRY).returncode == 0
        wait_for(lambda: kept(api, namespace) is not None, timeout=HANG, what="the first entry kept")

        os.kill(own_sim.process.pid, signal.SIGSTOP)
        try:
            # The answers do not wait for the API server (a settle waits SETTLE_WAIT at most, then none while
            # the writes fail): what is logged is shown from memory.
            assert agent.ipmitool(*ADD_SEL_ENTRY).returncode == 0
            wait_for(lambda: "cannot keep its SEL and audit trail" in agent.output(), timeout=HANG,
                     what="the failed write logged")
            assert agent.ipmitool(*ADD_SEL_ENTRY).returncode == 0
            assert len(members(agent, SEL)) == 3
        finally:
            os.kill(own_sim.process.pid, signal.SIGCONT)
        shown_sel = shown(agent, SEL)
        wait_for(lambda: len(kept(api, namespace)[0].records) == 3,  # type: ignore[index]
                 timeout=HANG, what="the entries logged while the API server was away, written")
        wait_for(lambda: "kept again" in agent.output(), timeout=HANG, what="the recovery logged")
        assert agent.output().count("cannot keep its SEL and audit trail") == 1  # once, not once per retry
        kill(agent)
    with running_agent(*agent_args(namespace), env={"KUBECONFIG": own_sim.kubeconfig}) as again:
        assert shown(again, SEL) == shown_sel

