"""A BMC whose node is lost, as a cluster loses one: the controller's agent (dedicated, or a pool's for all its
members), evicted after its node loss toleration (--agent-node-loss-toleration, the chart's
agent.nodeLossTolerationSeconds), answers IPMI and Redfish again at the same Service address from another node,
while the pod on the lost node stays Terminating.

kubesim runs two nodes with a node monitor grace period of 2 s (tests/sim/test_nodes.py holds it to Kubernetes'
node lifecycle and taint eviction controllers); the controller gives its agents a toleration of 3 s. How long the
BMC is dark is bench/nodeloss.py's figure; here the order of events is read from the objects' timestamps.
"""

from __future__ import annotations

import base64
import json
import ssl
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from kubesim.objects import parse_time

from ..support.agents import PASSWORD, USER
from ..support.cluster import Sim, call, install_bmc_crd, start_sim, wait_for
from ..support.controllers import ControllerProcess, apply_bmc, get_bmc, ipmitool, is_ready, make_secret, pods
from ..support.vms import make_vm

NS = "lost"
TOLERATION = 3
GRACE = 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Sim, client.ApiClient]]:
    work = tmp_path_factory.mktemp("node-loss")
    sim = start_sim(work / "sim", "--nodes", "2", "--node-monitor-grace-period", str(GRACE),
                    "--bookmark-interval", "0.5", "--vm-start-delay", "0.3")
    api = sim.api()
    install_bmc_crd(api)
    assert call(api, "POST", "/api/v1/namespaces", {"metadata": {"name": NS}}).status == 201
    controller = ControllerProcess(sim.kubeconfig, work / "controller.log",
                                   "--agent-node-loss-toleration", str(TOLERATION))
    yield sim, api
    controller.stop()
    sim.stop()


def agent_pods(api: client.ApiClient, ns: str = NS) -> list[dict[str, Any]]:
    return [p for p in pods(api, ns) if p["metadata"].get("labels", {}).get("app.kubernetes.io/name") ==
            "kubevbmc-agent"]


def serving(api: client.ApiClient, ns: str = NS) -> list[dict[str, Any]]:
    """The agent pods that are Ready and not being deleted."""
    return [p for p in agent_pods(api, ns) if not p["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))]


def redfish_power_state(ip: str, vm: str = "vm") -> str:
    insecure = ssl.create_default_context()
    insecure.check_hostname = False
    insecure.verify_mode = ssl.CERT_NONE
    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    request = urllib.request.Request(f"https://{ip}/redfish/v1/Systems/{vm}",
                                     headers={"Authorization": f"Basic {token}"})
    with urllib.request.urlopen(request, context=insecure, timeout=5) as resp:
        return str(json.loads(resp.read())["PowerState"])


def answers_ipmi(ip: str) -> bool:
    result = ipmitool(ip, "power", "status")
    return result.returncode == 0 and "Chassis Power is off" in result.stdout


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in obj["status"]["conditions"] if c["type"] == kind)


def test_a_dedicated_bmc_whose_node_is_lost_answers_again_from_another_node(
        cluster: tuple[Sim, client.ApiClient]) -> None:
    sim, api = cluster
    make_vm(api, NS)
    make_secret(api, NS)
    apply_bmc(api, NS)
    wait_for(lambda: is_ready(api, NS), timeout=40, what="the BMC to be Ready")
    ip = get_bmc(api, NS)["status"]["clusterIP"]
    [first] = serving(api)
    assert [t["tolerationSeconds"] for t in first["spec"]["tolerations"]] == [TOLERATION, TOLERATION]
    assert wait_for(lambda: answers_ipmi(ip), what="IPMI through the Service")
    assert wait_for(lambda: redfish_power_state(ip), what="Redfish through the Service") == "Off"
    lost = first["spec"]["nodeName"]

    sim.power_off_node(lost)

    # Another agent, on the other node, answers both protocols at the same address.
    replacement = wait_for(lambda: [p for p in serving(api) if p["metadata"]["name"] != first["metadata"]["name"]],
                           what="a replacement agent Ready")[0]
    assert replacement["spec"]["nodeName"] != lost
    assert wait_for(lambda: answers_ipmi(ip), what="IPMI from the replacement")
    assert wait_for(lambda: redfish_power_state(ip), what="Redfish from the replacement") == "Off"
    wait_for(lambda: is_ready(api, NS), what="the BMC Ready again")

    # The agent on the lost node was evicted no sooner than its toleration after the node was tainted unreachable,
    # and is still Terminating: nobody on that node can confirm it is gone.
    node = call(api, "GET", f"/api/v1/nodes/{lost}").body
    assert condition(node, "Ready")["status"] == "Unknown"
    [taint] = [t for t in node["spec"]["taints"] if t["effect"] == "NoExecute"]
    assert taint["key"] == "node.kubernetes.io/unreachable"
    evicted = call(api, "GET", f"/api/v1/namespaces/{NS}/pods/{first['metadata']['name']}").body
    assert evicted["metadata"]["deletionTimestamp"]
    assert parse_time(condition(evicted, "DisruptionTarget")["lastTransitionTime"]) >= \
        parse_time(taint["timeAdded"]) + TOLERATION

    sim.power_on_node(lost)
    wait_for(lambda: [p["metadata"]["name"] for p in agent_pods(api)] == [replacement["metadata"]["name"]],
             what="the powered-on node to finish the evicted agent")
    assert answers_ipmi(ip)


def test_a_pool_whose_node_is_lost_serves_every_member_again_from_another_node(
        cluster: tuple[Sim, client.ApiClient]) -> None:
    sim, api = cluster
    ns = "lost-pool"
    assert call(api, "POST", "/api/v1/namespaces", {"metadata": {"name": ns}}).status == 201
    members = ["vm-a", "vm-b"]
    for vm in members:
        make_vm(api, ns, vm)
        make_secret(api, ns, f"{vm}-auth")
        apply_bmc(api, ns, vm, vm=vm, secret=f"{vm}-auth", agentPool="lab")
    wait_for(lambda: all(is_ready(api, ns, vm) for vm in members), timeout=60, what="both pooled BMCs Ready")
    ips = {vm: get_bmc(api, ns, vm)["status"]["clusterIP"] for vm in members}
    [first] = serving(api, ns)
    assert [t["tolerationSeconds"] for t in first["spec"]["tolerations"]] == [TOLERATION, TOLERATION]

    sim.power_off_node(first["spec"]["nodeName"])

    replacement = wait_for(lambda: [p for p in serving(api, ns) if p["metadata"]["name"] != first["metadata"]["name"]],
                           what="a replacement pool agent Ready")[0]
    assert replacement["spec"]["nodeName"] != first["spec"]["nodeName"]
    for vm, ip in ips.items():
        assert wait_for(lambda ip=ip: answers_ipmi(ip), what=f"IPMI of {vm} from the replacement")
        assert wait_for(lambda ip=ip, vm=vm: redfish_power_state(ip, vm), what=f"Redfish of {vm}") == "Off"
    evicted = call(api, "GET", f"/api/v1/namespaces/{ns}/pods/{first['metadata']['name']}").body
    assert evicted["metadata"]["deletionTimestamp"]  # Terminating on the lost node

    sim.power_on_node(first["spec"]["nodeName"])
    wait_for(lambda: [p["metadata"]["name"] for p in agent_pods(api, ns)] == [replacement["metadata"]["name"]],
             what="the powered-on node to finish the evicted pool agent")
