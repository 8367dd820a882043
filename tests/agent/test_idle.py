"""An idle agent costs the API server nothing; a read costs at most one request (issue 21).

Counted by kubesim's apiserver_request_total (as kube-apiserver's /metrics counts them), with the agent the only
client: while nobody talks to its BMC for longer than the staleness bound, it makes no request at all (its watches
are renewed every half hour); the first read after that confirms its cache with one LIST, and the reads right after
it cost nothing. bench/idle.py measures the same for 20 agents next to the informer-style figure."""

from __future__ import annotations

import re
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from vbmc.machine.kubevirt.watch import STALE_AFTER

from ..support.agents import AgentProcess, running_agent
from ..support.cluster import Sim, bmc_sim, call, wait_for
from ..support.vms import make_bmc, make_vm


@pytest.fixture(scope="module")
def quiet_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    """A kubesim whose only client is the agent under test."""
    with bmc_sim(tmp_path_factory.mktemp("idle-sim"), "--bookmark-interval", "60") as sim:
        yield sim


def agent_requests(api: client.ApiClient) -> dict[tuple[str, str, str], float]:
    """apiserver_request_total by (verb, resource, code), health checks left out."""
    counts: dict[tuple[str, str, str], float] = {}
    for line in str(call(api, "GET", "/metrics", headers={"Accept": "text/plain"}).body).splitlines():
        if line.startswith("apiserver_request_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            if labels["resource"]:
                key = (labels["verb"], labels["resource"], labels["code"])
                counts[key] = counts.get(key, 0) + float(line.rsplit(" ", 1)[1])
    return counts


def since(before: dict[Any, float], after: dict[Any, float]) -> dict[Any, float]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


@pytest.fixture
def agent(quiet_sim: Sim) -> Iterator[AgentProcess]:
    """An agent serving a VM of its own namespace on the quiet kubesim, ready, its cache read once."""
    api = quiet_sim.api()
    ns = f"idle-{uuid.uuid4().hex[:6]}"
    assert call(api, "POST", "/api/v1/namespaces", {"metadata": {"name": ns}}).status == 201
    make_vm(api, ns)
    make_bmc(api, ns)
    with running_agent("--namespace", ns, "--vm", "vm", "--vmbmc", "vm",
                       env={"KUBECONFIG": quiet_sim.kubeconfig}) as process:
        assert process.redfish("GET", "/redfish/v1/Systems/vm")[0] == 200
        yield process


def test_an_idle_agent_makes_no_request_and_a_read_after_the_bound_makes_one(quiet_sim: Sim,
                                                                             agent: AgentProcess) -> None:
    api = quiet_sim.api()
    before = agent_requests(api)
    time.sleep(STALE_AFTER + 2)  # idle past the bound: nothing asks, nothing is asked
    idle = since(before, agent_requests(api))
    assert idle == {}, f"an idle agent made requests: {idle}"

    status, system = agent.redfish("GET", "/redfish/v1/Systems/vm")
    assert status == 200 and system["PowerState"] == "Off"
    first = since(before, agent_requests(api))
    # The cache confirmed, for the whole BMC: one list of the VM by name (which kube-apiserver counts as a GET).
    assert first == {("GET", "virtualmachines", "200"): 1}, first

    for _ in range(5):
        assert agent.redfish("GET", "/redfish/v1/Systems/vm")[0] == 200
        assert "Chassis Power is off" in agent.ipmitool("power", "status").stdout
    assert since(before, agent_requests(api)) == first, "reads within the bound asked the API server again"


def test_a_connection_starts_the_confirmation_before_its_request_arrives(quiet_sim: Sim,
                                                                         agent: AgentProcess) -> None:
    """A client's TLS handshake and request take as long as the confirming LIST: the agent starts it when the
    connection is accepted, so the first read after a quiet spell finds it done or under way."""
    api = quiet_sim.api()
    time.sleep(STALE_AFTER + 2)
    before = agent_requests(api)
    with socket.create_connection(("127.0.0.1", agent.http_port), timeout=5) as conn:
        # Nothing sent yet: the accepted connection alone asks the API server to confirm the cache.
        wait_for(lambda: since(before, agent_requests(api)) == {("GET", "virtualmachines", "200"): 1},
                 timeout=5, what="the cache confirmed on accept")
        conn.sendall(b"GET /redfish/v1/Systems/vm HTTP/1.1\r\nHost: bmc\r\nConnection: close\r\n\r\n")
        conn.settimeout(5)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 401"), reply[:80]  # no credentials: still nothing more asked
    assert agent.redfish("GET", "/redfish/v1/Systems/vm")[0] == 200
    assert since(before, agent_requests(api)) == {("GET", "virtualmachines", "200"): 1}
