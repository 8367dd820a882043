"""An agent whose API server stops answering stops answering from its cache (issue 10, deliverable 5).

kubesim runs as its own process with a kube-apiserver's bookmark interval (60 s), an agent process watches a VM
in it, and the test freezes kubesim with SIGSTOP: its sockets stay open and nothing answers, like an API server
that hangs. Within the staleness bound the agent's reads turn into IPMI 0xC0 (node busy) and Redfish 503 with
Retry-After; after SIGCONT they answer the VM's state again. Real clients throughout: ipmitool and HTTP.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from vbmc.watchcache import STALE_AFTER, same_state

from .agents import PASSWORD, USER, AgentProcess
from .conftest import BMC_CRD, Sim, call, start_sim, wait_for
from .vms import make_bmc, make_vm

FREEZE_DEADLINE = 3 * STALE_AFTER  # generous: the bound is STALE_AFTER, the machine is shared and noisy
THAW_DEADLINE = 15.0


@dataclass
class HttpReply:
    status: int
    headers: dict[str, str]
    body: Any


def get(agent: AgentProcess, path: str) -> HttpReply:
    request = urllib.request.Request(f"{agent.url}{path}", headers={
        "Authorization": "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            status, headers, raw = resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        status, headers, raw = exc.code, dict(exc.headers), exc.read()
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        body = raw.decode(errors="replace")
    return HttpReply(status, {k.lower(): v for k, v in headers.items()}, body)


def chassis_status(agent: AgentProcess) -> subprocess.CompletedProcess[str]:
    """Get Chassis Status as a raw command, so the completion code is in ipmitool's message."""
    return agent.ipmitool("raw", "0x00", "0x01")


@pytest.fixture(scope="module")
def slow_bookmark_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    """A kubesim of its own (this module freezes it), bookmarking idle watches once a minute like kube-apiserver."""
    sim = start_sim(tmp_path_factory.mktemp("stale-sim"), "--bookmark-interval", "60")
    try:
        api = sim.api()
        reply = call(api, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                     yaml.safe_load(BMC_CRD.read_text()))
        assert reply.status == 201, reply.body
        wait_for(lambda: call(api, "GET", "/apis/bmc.kubevirt.io/v1beta1").status == 200, what="CRD served")
        yield sim
    finally:
        os.kill(sim.process.pid, signal.SIGCONT)
        sim.stop()


@pytest.fixture
def agent(slow_bookmark_sim: Sim) -> Iterator[AgentProcess]:
    api = slow_bookmark_sim.api()
    namespace = f"t-{uuid.uuid4().hex[:8]}"
    client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    make_vm(api, namespace)
    make_bmc(api, namespace)
    process = AgentProcess("--namespace", namespace, "--vm", "vm", "--vmbmc", "vm",
                           env={"KUBECONFIG": slow_bookmark_sim.kubeconfig})
    try:
        wait_for(process.ready, timeout=20, what="the agent to be ready")
        yield process
    finally:
        os.kill(slow_bookmark_sim.process.pid, signal.SIGCONT)
        process.stop()
        with contextlib.suppress(client.ApiException):
            client.CoreV1Api(api).delete_namespace(namespace)


@contextlib.contextmanager
def frozen(sim: Sim) -> Iterator[None]:
    os.kill(sim.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(sim.process.pid, signal.SIGCONT)


def first_times(checks: dict[str, Callable[[], bool]], deadline: float) -> dict[str, float]:
    """Seconds until each check first held, polling them in turn until all have or `deadline` passes."""
    started = time.monotonic()
    seen: dict[str, float] = {}
    while len(seen) < len(checks) and time.monotonic() - started < deadline:
        for name, check in checks.items():
            if name not in seen and check():
                seen[name] = time.monotonic() - started
        time.sleep(0.1)
    missing = sorted(set(checks) - set(seen))
    assert not missing, f"not within {deadline} s: {missing} (the others after {seen})"
    return seen


# ---- the freshness decision


@pytest.mark.parametrize(("cached", "listed", "same"), [
    (None, None, True),
    ({"metadata": {"resourceVersion": "7"}}, {"metadata": {"resourceVersion": "7"}}, True),
    ({"metadata": {"resourceVersion": "7"}}, {"metadata": {"resourceVersion": "9"}}, False),
    ({"metadata": {"resourceVersion": "9"}}, {"metadata": {"resourceVersion": "7"}}, False),
    ({"metadata": {"resourceVersion": "7"}}, None, False),  # deleted, and the watch has not said so
    (None, {"metadata": {"resourceVersion": "7"}}, False),  # created, and the watch has not said so
    ({"metadata": {}}, {"metadata": {}}, False),  # nothing to compare proves nothing
])
def test_a_probe_confirms_the_cache_only_when_it_shows_the_same_object(cached: Any, listed: Any,
                                                                        same: bool) -> None:
    assert same_state(cached, listed) is same


# ---- a frozen API server


def test_a_frozen_api_server_makes_reads_busy_and_a_thawed_one_serves_them_again(
        agent: AgentProcess, slow_bookmark_sim: Sim, tmp_path: Path) -> None:
    system = "/redfish/v1/Systems/vm"
    assert "Chassis Power is off" in agent.ipmitool("power", "status").stdout
    assert get(agent, system).body["PowerState"] == "Off"

    with frozen(slow_bookmark_sim):
        stale = first_times({
            "Redfish 503": lambda: get(agent, system).status == 503,
            "IPMI 0xC0": lambda: "rsp=0xc0" in chassis_status(agent).stderr,
        }, FREEZE_DEADLINE)
        reply = get(agent, system)
        assert reply.status == 503
        assert int(reply.headers["retry-after"]) > 0
        info = reply.body["error"]["@Message.ExtendedInfo"][0]
        assert info["MessageId"].startswith("Base.") and info["MessageId"].endswith(".ServiceTemporarilyUnavailable")
        assert "not heard from the Kubernetes API server" in json.dumps(reply.body)
        status = agent.ipmitool("power", "status")
        assert status.returncode != 0 and "Chassis Power is" not in status.stdout
        # What does not depend on the VM still answers, and the agent stays ready: the endpoint keeps serving
        # busy answers instead of vanishing from its Service (docs/reference.md, "Agent").
        assert get(agent, "/redfish/v1").status == 200
        assert agent.ready()

    back = first_times({
        "Redfish 200": lambda: get(agent, system).status == 200,
        "IPMI power status": lambda: "Chassis Power is off" in agent.ipmitool("power", "status").stdout,
    }, THAW_DEADLINE)
    assert get(agent, system).body["PowerState"] == "Off"
    print(f"\nfreeze -> first stale answer: {stale}; thaw -> first good answer: {back}")
