"""Pooled agents on kubesim: 20 VirtualMachineBMCs naming one pool are served by one agent pod, each at its own
Service address with its own credentials and certificate; a 21st joins without restarting anything; a BMC moves
between the pool and a dedicated agent both ways."""

from __future__ import annotations

import base64
import json
import ssl
import subprocess
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from ..support.agents import USER
from ..support.cluster import call, install_bmc_crd, start_sim, wait_for
from ..support.controllers import ControllerProcess, condition

NS = "pool"
POOL = "lab"
MEMBERS = 20
BMCS = f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{NS}/virtualmachinebmcs"


def password(i: int) -> str:
    return f"secret-{i:02d}-pw"


def add_member(api: client.ApiClient, i: int, pool: str = POOL) -> None:
    name = f"vm{i:02d}"
    vm = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": name},
          "spec": {"runStrategy": "Halted", "template": {"spec": {
              "domain": {"devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}]},
                         "resources": {"requests": {"memory": "1Gi"}}},
              "volumes": [{"name": "root", "containerDisk": {"image": "quay.io/containerdisks/fedora"}}]}}}}
    assert call(api, "POST", f"/apis/kubevirt.io/v1/namespaces/{NS}/virtualmachines", vm).status == 201
    secret = {"metadata": {"name": f"{name}-auth"}, "stringData": {"username": USER, "password": password(i)}}
    assert call(api, "POST", f"/api/v1/namespaces/{NS}/secrets", secret).status == 201
    bmc = {"apiVersion": "bmc.kubevirt.io/v1beta1", "kind": "VirtualMachineBMC", "metadata": {"name": name},
           "spec": {"virtualMachineRef": {"name": name}, "authSecretRef": {"name": f"{name}-auth"},
                    **({"agentPool": pool} if pool else {})}}
    reply = call(api, "POST", BMCS, bmc)
    assert reply.status == 201, reply.body


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[client.ApiClient, ControllerProcess]]:
    work = tmp_path_factory.mktemp("pool")
    sim = start_sim(work / "sim", "--bookmark-interval", "0.5", "--vm-start-delay", "0.3")
    api = sim.api()
    install_bmc_crd(api)
    assert call(api, "POST", "/api/v1/namespaces", {"metadata": {"name": NS}}).status == 201
    controller = ControllerProcess(sim.kubeconfig, work / "controller.log")
    for i in range(MEMBERS):
        add_member(api, i)
    wait_for(lambda: len(ready_bmcs(api)) == MEMBERS, timeout=120, interval=0.5, what="20 pooled BMCs Ready")
    yield api, controller
    controller.stop()
    sim.stop()


def bmcs(api: client.ApiClient) -> dict[str, dict[str, Any]]:
    return {b["metadata"]["name"]: b for b in call(api, "GET", BMCS).body["items"]}


def ready_bmcs(api: client.ApiClient) -> list[str]:
    return [n for n, b in bmcs(api).items() if condition(b, "Ready").get("status") == "True"]


def deployments(api: client.ApiClient) -> list[dict[str, Any]]:
    return list(call(api, "GET", f"/apis/apps/v1/namespaces/{NS}/deployments").body["items"])


def pods(api: client.ApiClient) -> list[dict[str, Any]]:
    return [p for p in call(api, "GET", f"/api/v1/namespaces/{NS}/pods").body["items"]
            if not p["metadata"].get("deletionTimestamp")]


def ipmitool(host: str, pw: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ipmitool", "-I", "lanplus", "-C", "17", "-H", host, "-U", USER, "-P", pw, "-R", "2",
                           "-N", "1", *args], capture_output=True, text=True, timeout=30)


def ca_of(api: client.ApiClient, vm: str) -> bytes:
    secret = call(api, "GET", f"/api/v1/namespaces/{NS}/secrets/{vm}-virtbmc-tls").body
    return base64.b64decode(secret["data"]["ca.crt"])


def redfish_system(api: client.ApiClient, bmc: dict[str, Any], pw: str) -> tuple[int, Any]:
    """GET of the member's System over HTTPS, verifying the server's certificate against the member's own CA."""
    vm = bmc["spec"]["virtualMachineRef"]["name"]
    context = ssl.create_default_context(cadata=ca_of(api, vm).decode())
    token = base64.b64encode(f"{USER}:{pw}".encode()).decode()
    request = urllib.request.Request(bmc["status"]["endpoints"]["redfish"], headers={"Authorization": f"Basic {token}"})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None


def pool_log(api: client.ApiClient) -> str:
    (pod,) = [p for p in pods(api) if p["metadata"].get("labels", {}).get("bmc.kubevirt.io/pool") == POOL]
    reply = call(api, "GET", f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}/log",
                 headers={"Accept": "text/plain"})
    assert reply.status == 200
    return str(reply.body)


def pool_members(api: client.ApiClient) -> list[str]:
    secret = call(api, "GET", f"/api/v1/namespaces/{NS}/secrets/{POOL}-virtbmc-pool").body
    return [m["name"] for m in json.loads(base64.b64decode(secret["data"]["pool.json"]))["members"]]


def role_vms(api: client.ApiClient) -> list[str]:
    role = call(api, "GET", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles/{POOL}-virtbmc-pool").body
    return next(r["resourceNames"] for r in role["rules"] if r["resources"] == ["virtualmachines"])


def test_twenty_pooled_bmcs_are_one_pod_and_each_answers_with_its_own_credentials(pool: Any) -> None:
    api, _ = pool
    agents = deployments(api)
    assert [d["metadata"]["name"] for d in agents] == [f"{POOL}-virtbmc-pool"]
    assert len(pods(api)) == 1
    assert role_vms(api) == [f"vm{i:02d}" for i in range(MEMBERS)]
    found = bmcs(api)
    hosts = set()
    for i in range(MEMBERS):
        bmc = found[f"vm{i:02d}"]
        host = bmc["status"]["clusterIP"]
        hosts.add(host)
        assert bmc["status"]["endpoints"]["ipmi"] == f"{host}:623"
        assert "agent pool lab" in condition(bmc, "AgentReady")["message"]
        result = ipmitool(host, password(i), "power", "status")
        assert "Chassis Power is off" in result.stdout, (bmc["metadata"]["name"], result.stderr)
        # Another member's password is not this one's.
        refused = ipmitool(host, password((i + 1) % MEMBERS), "power", "status")
        assert refused.returncode != 0 and "Chassis Power" not in refused.stdout
        code, system = redfish_system(api, bmc, password(i))
        assert code == 200 and system["Id"] == f"vm{i:02d}", (code, system)
        assert redfish_system(api, bmc, password((i + 1) % MEMBERS))[0] == 401
    assert len(hosts) == MEMBERS  # each its own Service address
    # Each member started once: none joined the pool's Secret before its certificate was issued (its entry would
    # have changed, and the agent restarted it).
    log = pool_log(api)
    for i in range(MEMBERS):
        assert log.count(f"pool: member started name=vm{i:02d} ") == 1, log
    assert "pool: member stopped" not in log
    # At rest, each member's own readiness is on its BMC, written once (by the pool's agent, apart from the pod's
    # readiness that made the BMCs Ready: vbmc/agent/runtime.py _report_serving).
    wait_for(lambda: all(b["status"].get("agent") == {"serving": True, "message": ""}
                         for n, b in bmcs(api).items() if n in found), timeout=10, what="every member serving")


def test_members_power_states_are_their_own(pool: Any) -> None:
    api, _ = pool
    found = bmcs(api)
    one, two = found["vm03"]["status"]["clusterIP"], found["vm04"]["status"]["clusterIP"]
    assert "Up/On" in ipmitool(one, password(3), "power", "on").stdout
    wait_for(lambda: "Chassis Power is on" in ipmitool(one, password(3), "power", "status").stdout, timeout=20,
             what="vm03 on")
    assert "Chassis Power is off" in ipmitool(two, password(4), "power", "status").stdout
    assert "Down/Off" in ipmitool(one, password(3), "power", "off").stdout


def test_a_twenty_first_member_restarts_nothing(pool: Any) -> None:
    api, _ = pool
    (pod,) = pods(api)
    (before,) = deployments(api)
    add_member(api, MEMBERS)
    def joined() -> dict[str, Any] | None:
        b = bmcs(api).get(f"vm{MEMBERS}")
        return b if b is not None and condition(b, "Ready").get("status") == "True" else None

    bmc = wait_for(joined, timeout=60, interval=0.3, what="the 21st BMC Ready")
    assert bmc is not None
    host = bmc["status"]["clusterIP"]
    wait_for(lambda: "Chassis Power is off" in ipmitool(host, password(MEMBERS), "power", "status").stdout,
             timeout=20, what="the 21st BMC answering IPMI")
    assert redfish_system(api, bmc, password(MEMBERS))[0] == 200
    (after,) = deployments(api)
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert after["spec"]["template"] == before["spec"]["template"]
    (same,) = pods(api)
    assert same["metadata"]["uid"] == pod["metadata"]["uid"]
    assert all(c.get("restartCount", 0) == 0 for c in same["status"]["containerStatuses"])
    assert f"vm{MEMBERS}" in role_vms(api) and f"vm{MEMBERS}" in pool_members(api)


def test_a_member_that_cannot_serve_is_not_ready_and_the_others_stay_ready(pool: Any) -> None:
    api, _ = pool
    bad = {"metadata": {"name": "vm03-bad-tls"}, "type": "Opaque",
           "stringData": {"tls.crt": "not a certificate", "tls.key": "not a key"}}
    assert call(api, "POST", f"/api/v1/namespaces/{NS}/secrets", bad).status == 201
    reply = call(api, "PATCH", f"{BMCS}/vm03", {"spec": {"redfish": {"tls": {"secretRef": {"name": "vm03-bad-tls"}}}}},
                 content_type="application/merge-patch+json")
    assert reply.status == 200, reply.body
    try:
        def refused() -> dict[str, Any] | None:
            b = bmcs(api)["vm03"]
            return b if condition(b, "Ready").get("reason") == "MemberNotServing" else None

        bmc = wait_for(refused, timeout=30, interval=0.3, what="vm03 not Ready: its certificate does not load")
        assert bmc is not None and condition(bmc, "Ready")["status"] == "False"
        assert "HTTPS" in condition(bmc, "Ready")["message"], condition(bmc, "Ready")
        others = [b for n, b in bmcs(api).items() if n != "vm03" and b["spec"].get("agentPool") == POOL]
        assert others and all(condition(b, "Ready")["status"] == "True" for b in others)
        (pod,) = pods(api)
        assert all(c.get("ready") for c in pod["status"]["containerStatuses"])  # the pool's pod serves the others
        # Its IPMI still answers: only what cannot serve is down.
        host = bmc["status"]["clusterIP"]
        assert "Chassis Power is" in ipmitool(host, password(3), "power", "status").stdout
    finally:
        reply = call(api, "PATCH", f"{BMCS}/vm03", {"spec": {"redfish": {"tls": None}}},
                     content_type="application/merge-patch+json")
        assert reply.status == 200, reply.body
    wait_for(lambda: condition(bmcs(api)["vm03"], "Ready").get("status") == "True", timeout=30, interval=0.3,
             what="vm03 Ready again with its generated certificate")


def test_a_bmc_moves_to_a_dedicated_agent_and_back(pool: Any) -> None:
    api, _ = pool
    name = "vm05"
    patch: dict[str, Any] = {"spec": {"agentPool": None}}
    assert call(api, "PATCH", f"{BMCS}/{name}", patch, content_type="application/merge-patch+json").status == 200
    wait_for(lambda: any(d["metadata"]["name"] == f"{name}-virtbmc" for d in deployments(api)), timeout=30,
             what="the dedicated agent Deployment")

    def dedicated_ready() -> bool:
        b = bmcs(api)[name]
        return (condition(b, "Ready").get("status") == "True" and "agent pool" not in condition(b, "AgentReady")
                .get("message", "") and name not in pool_members(api))

    wait_for(dedicated_ready, timeout=60, interval=0.3, what="vm05 Ready on its own agent")
    host = bmcs(api)[name]["status"]["clusterIP"]
    wait_for(lambda: "Chassis Power is" in ipmitool(host, password(5), "power", "status").stdout, timeout=20,
             what="vm05 answering from its own agent")
    assert name not in role_vms(api)

    patch = {"spec": {"agentPool": POOL}}
    assert call(api, "PATCH", f"{BMCS}/{name}", patch, content_type="application/merge-patch+json").status == 200
    wait_for(lambda: not any(d["metadata"]["name"] == f"{name}-virtbmc" for d in deployments(api))
             and name in pool_members(api), timeout=30, what="back in the pool, the dedicated agent gone")
    wait_for(lambda: "agent pool lab" in condition(bmcs(api)[name], "AgentReady").get("message", "")
             and condition(bmcs(api)[name], "Ready").get("status") == "True", timeout=30, what="vm05 Ready in the pool")
    wait_for(lambda: "Chassis Power is" in ipmitool(host, password(5), "power", "status").stdout, timeout=20,
             what="vm05 answering from the pool again")
    for kind in ("serviceaccounts", "secrets"):
        assert call(api, "GET", f"/api/v1/namespaces/{NS}/{kind}/{POOL}-virtbmc-pool").status == 200


def test_the_pool_goes_with_its_last_member(pool: Any) -> None:
    api, _ = pool
    other = "solo"
    add_member(api, 30, pool=other)
    wait_for(lambda: any(d["metadata"]["name"] == f"{other}-virtbmc-pool" for d in deployments(api)), timeout=30,
             what="the second pool")
    # Its only member leaves for a dedicated agent: the pool's objects are deleted.
    patch: dict[str, Any] = {"spec": {"agentPool": None}}
    assert call(api, "PATCH", f"{BMCS}/vm30", patch, content_type="application/merge-patch+json").status == 200
    wait_for(lambda: not any(d["metadata"]["name"] == f"{other}-virtbmc-pool" for d in deployments(api))
             and call(api, "GET", f"/api/v1/namespaces/{NS}/secrets/{other}-virtbmc-pool").status == 404,
             timeout=30, what="the emptied pool deleted")


def test_a_pool_name_the_schema_refuses_is_refused_by_the_api_server(pool: Any) -> None:
    api, _ = pool
    for bad in ("Lab", "lab_1", "-lab", "x" * 41):
        body = {"apiVersion": "bmc.kubevirt.io/v1beta1", "kind": "VirtualMachineBMC", "metadata": {"name": "bad"},
                "spec": {"virtualMachineRef": {"name": "vm00"}, "authSecretRef": {"name": "vm00-auth"},
                         "agentPool": bad}}
        reply = call(api, "POST", BMCS, body)
        assert reply.status == 422 and "agentPool" in json.dumps(reply.body), (bad, reply.body)


def test_a_new_agent_image_rolls_the_pool_as_one_agent(pool: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    api, controller = pool
    (before,) = [p for p in pods(api) if p["metadata"].get("labels", {}).get("bmc.kubevirt.io/pool") == POOL]
    assert controller.stop() == 0
    upgraded = ControllerProcess(controller.kubeconfig, tmp_path_factory.mktemp("v2") / "controller.log",
                                 "--agent-image", "kubevbmc:v2")
    try:
        def rolled() -> bool:
            (deployment,) = [d for d in deployments(api) if d["metadata"]["name"] == f"{POOL}-virtbmc-pool"]
            members = [b for b in bmcs(api).values() if b["spec"].get("agentPool") == POOL]
            return (deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "kubevbmc:v2"
                    and all(condition(b, "Ready").get("status") == "True"
                            and condition(b, "AgentUpToDate").get("status") == "True"
                            and "kubevbmc:v2" in condition(b, "AgentUpToDate").get("message", "") for b in members))

        wait_for(rolled, timeout=90, interval=0.5, what="the pool on kubevbmc:v2, every member Ready")
        pool_pods = [p for p in pods(api) if p["metadata"].get("labels", {}).get("bmc.kubevirt.io/pool") == POOL]
        assert len(pool_pods) == 1 and pool_pods[0]["metadata"]["uid"] != before["metadata"]["uid"]
        host = bmcs(api)["vm07"]["status"]["clusterIP"]
        wait_for(lambda: "Chassis Power is" in ipmitool(host, password(7), "power", "status").stdout, timeout=20,
                 what="a member answering from the upgraded pool")
    finally:
        assert upgraded.stop() == 0
