"""An idle agent costs the API server nothing; a read costs at most one request (issue 21).

Counted by kubesim's apiserver_request_total (as kube-apiserver's /metrics counts them), with the agent the only
client: while nobody talks to its BMC for longer than the staleness bound, it makes no request at all (its watches
are renewed every half hour); the first read after that confirms its cache with one LIST, and the reads right after
it cost nothing. Probes (the kubelet's, Prometheus' scrape, an RMCP ping) are not reads and cost nothing either
(issue 29). bench/idle.py measures the same for 20 agents, probed as the kubelet probes them, next to the
informer-style figure."""

from __future__ import annotations

import http.client
import re
import socket
import struct
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from vbmc.machine.kubevirt.watch import CONFIRM_TIMEOUT, STALE_AFTER

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


def test_a_request_starts_the_confirmation_before_it_is_authenticated(quiet_sim: Sim, agent: AgentProcess) -> None:
    """A client's credentials are checked on a worker thread, after its body: the agent starts the confirming LIST
    as soon as the request's head is whole, so the first read after a quiet spell finds it done or under way."""
    api = quiet_sim.api()
    time.sleep(STALE_AFTER + 2)  # quiet past the bound
    before = agent_requests(api)
    with socket.create_connection(("127.0.0.1", agent.http_port), timeout=5) as conn:
        conn.sendall(b"GET /redfish/v1/Systems/vm HTTP/1.1\r\nHost: bmc\r\nConnection: close\r\n\r\n")
        conn.settimeout(5)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 401"), reply[:80]  # no credentials: refused, the cache confirmed all the same
    wait_for(lambda: since(before, agent_requests(api)) == {("GET", "virtualmachines", "200"): 1},
             timeout=5, what="the cache confirmed for the request")
    assert agent.redfish("GET", "/redfish/v1/Systems/vm")[0] == 200
    assert since(before, agent_requests(api)) == {("GET", "virtualmachines", "200"): 1}


PRESENCE_PING = bytes([6, 0, 0xFF, 6]) + struct.pack(">IBBBB", 4542, 0x80, 0x5A, 0, 0)  # RMCP/ASF, tag 0x5A


def probe_like_the_kubelet(agent: AgentProcess) -> None:
    """One round of what asks an agent on a clock, not as a client: the kubelet's httpGet probes (/readyz,
    /healthz, as kube-probe sends them), its tcpSocket probe (a connection that sends nothing), Prometheus'
    scrape of /metrics, and a monitor's RMCP presence ping."""
    for path in ("/readyz", "/healthz", "/metrics"):
        conn = http.client.HTTPConnection("127.0.0.1", agent.http_port, timeout=5)
        try:
            conn.request("GET", path, headers={"User-Agent": "kube-probe/1.36"})
            response = conn.getresponse()
            response.read()
            assert response.status == 200, (path, response.status)
        finally:
            conn.close()
    with socket.create_connection(("127.0.0.1", agent.http_port), timeout=5):
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.settimeout(5)
        udp.sendto(PRESENCE_PING, ("127.0.0.1", agent.ipmi_port))
        assert udp.recv(512)[8] == 0x40  # the Presence Pong


def test_probes_do_not_confirm_the_cache_and_the_first_real_read_does(quiet_sim: Sim, agent: AgentProcess) -> None:
    """The kubelet probes every agent every few seconds, Prometheus scrapes it: if they counted as clients, a fleet
    quiet past the bound would LIST its VMs at the probes' rate (issue 29: 0.1 requests/s per agent)."""
    api = quiet_sim.api()
    time.sleep(STALE_AFTER + 2)  # quiet past the bound: the next client confirms the cache
    before = agent_requests(api)
    # The kubelet's schedule, compressed (a round every 0.1 s), for longer than a confirmation may take
    # (CONFIRM_TIMEOUT): one that the probes started would have been counted by now.
    rounds, ends = 0, time.monotonic() + CONFIRM_TIMEOUT + 1
    while rounds < 100 and time.monotonic() < ends:
        probe_like_the_kubelet(agent)
        rounds += 1
        time.sleep(0.1)
    probed = since(before, agent_requests(api))
    assert probed == {}, f"{rounds} rounds of probes made the agent ask the API server: {probed}"

    status, system = agent.redfish("GET", "/redfish/v1/Systems/vm")
    assert status == 200 and system["PowerState"] == "Off"
    # The first real read confirms the cache as it would have without the probes: one list of the VM by name.
    assert since(before, agent_requests(api)) == {("GET", "virtualmachines", "200"): 1}
