"""The whole thing from the image, as a cluster runs it: kubesim's container kubelet runs the controller of the Helm
chart (its Deployment, under the chart's ServiceAccount) and every agent the controller makes, each a podman
container of the image `make image` built. A user's workflow against them: a VirtualMachineBMC, ipmitool and Redfish
at its Service address, power on, the serial console over SOL, a controller restart, an agent rollout to a second
image tag, and a pooled agent serving several BMCs."""

from __future__ import annotations

import base64
import json
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pexpect
import pytest

from ..support.cluster import REPO, Sim, call, wait_for
from ..support.containers import IMAGE, REPOSITORY, TAG, podman, start_container_sim
from ..support.controllers import (
    PASSWORD,
    USER,
    apply_bmc,
    condition,
    deployment,
    get_bmc,
    ipmitool,
    is_ready,
    make_secret,
    pods,
)
from ..support.vms import make_vm, printable

CHART = REPO / "charts" / "kubevbmc"
RELEASE, RELEASE_NS = "kubevbmc", "kubevbmc-system"
SECOND_TAG = "rollout"
OPERATIONAL = "[SOL Session operational.  Use ~? for help]"
PROMPT = "vm login: "


def values(agent_tag: str = TAG) -> dict[str, Any]:
    """The chart's values for the image in the node's storage (IfNotPresent: no registry is asked)."""
    return {"image": {"repository": REPOSITORY, "tag": TAG, "pullPolicy": "IfNotPresent"},
            "agent": {"image": {"repository": REPOSITORY, "tag": agent_tag, "pullPolicy": "IfNotPresent"},
                      "rollout": {"batch": "100%", "timeout": "2m"}}}


@pytest.fixture(scope="module")
def cluster(kubevbmc_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    sim = start_container_sim(tmp_path_factory.mktemp("containers"))
    yield sim
    sim.stop()


@pytest.fixture(scope="module")
def release(cluster: Sim) -> Iterator[helm.Config]:
    with helm.Config(kubeconfig_path=cluster.kubeconfig, namespace=RELEASE_NS) as cfg:
        installed = cfg.install(CHART, RELEASE, values(), create_namespace=True, wait="watcher", timeout=120)
        assert installed["status"] == "deployed"
        yield cfg


@pytest.fixture(scope="module")
def second_tag(kubevbmc_image: str) -> Iterator[str]:
    """The same image under a second tag, for a rollout (as a release would publish a new version)."""
    tagged = f"{REPOSITORY}:{SECOND_TAG}"
    done = podman().call("tag", kubevbmc_image, tagged)
    assert done.returncode == 0, done.stderr
    yield tagged
    podman().call("untag", kubevbmc_image, tagged)


def create_namespace(sim: Sim, name: str) -> None:
    reply = call(sim.api(), "POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    assert reply.status == 201, reply.body


def running_pods(sim: Sim, ns: str) -> list[dict[str, Any]]:
    return [p for p in pods(sim.api(), ns) if p.get("status", {}).get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")]


def ready_container(pod: dict[str, Any]) -> dict[str, Any] | None:
    [status] = pod["status"].get("containerStatuses") or [{}]
    return status if status.get("ready") else None


def controller_pod(sim: Sim) -> dict[str, Any] | None:
    found = [p for p in running_pods(sim, RELEASE_NS) if ready_container(p)]
    return found[0] if len(found) == 1 else None


def bmc_with_vm(sim: Sim, ns: str, name: str = "vm", **spec: Any) -> None:
    api = sim.api()
    make_vm(api, ns, name)
    make_secret(api, ns, f"{name}-auth")
    apply_bmc(api, ns, name, name, f"{name}-auth", **spec)


def redfish_get(bmc: dict[str, Any], api: Any, ns: str, path: str) -> dict[str, Any]:
    """A Redfish GET at the BMC's HTTPS address, the certificate verified against the CA the controller issued."""
    tls = call(api, "GET", f"/api/v1/namespaces/{ns}/secrets/{bmc['spec']['virtualMachineRef']['name']}-virtbmc-tls")
    context = ssl.create_default_context(cadata=base64.b64decode(tls.body["data"]["ca.crt"]).decode())
    context.check_hostname = False  # the certificate names the Service's DNS names; here it is reached by address
    request = urllib.request.Request(f"https://{bmc['status']['clusterIP']}{path}", headers={
        "Authorization": "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()})
    with urllib.request.urlopen(request, timeout=10, context=context) as resp:
        return dict(json.loads(resp.read()))


def test_the_charts_controller_runs_from_the_image_under_its_service_account(cluster: Sim,
                                                                             release: helm.Config) -> None:
    pod = wait_for(lambda: controller_pod(cluster), timeout=60, what="the controller pod to be ready")
    assert pod["spec"]["serviceAccountName"] == RELEASE
    status = ready_container(pod)
    assert status is not None and status["containerID"].startswith("podman://k8s_controller_")
    assert status["image"] == IMAGE and status["imageID"]
    log = call(cluster.api(), "GET", f"/api/v1/namespaces/{RELEASE_NS}/pods/{pod['metadata']['name']}/log").body
    assert "caches synced" in log


def test_a_bmc_answers_ipmitool_redfish_and_sol_from_its_agent_container(cluster: Sim,
                                                                          release: helm.Config) -> None:
    api = cluster.api()
    create_namespace(cluster, "lab")
    bmc_with_vm(cluster, "lab")
    wait_for(lambda: is_ready(api, "lab"), timeout=90, what="the BMC to be Ready")
    [agent] = running_pods(cluster, "lab")
    status = ready_container(agent)
    assert status is not None and status["containerID"].startswith("podman://k8s_agent_")
    assert agent["spec"]["securityContext"]["fsGroup"] == 65532  # it reads its TLS key as user 65532
    bmc = get_bmc(api, "lab")
    address = bmc["status"]["clusterIP"]

    off = ipmitool(address, "power", "status")
    assert "Chassis Power is off" in off.stdout, off.stderr
    sol = pexpect.spawn("ipmitool", ["-I", "lanplus", "-C", "17", "-H", address, "-U", USER, "-P", PASSWORD,
                                     "sol", "activate"], timeout=30)
    try:
        sol.expect_exact(OPERATIONAL)
        on = ipmitool(address, "power", "on")
        assert on.returncode == 0 and "Up/On" in on.stdout, on.stderr
        wait_for(lambda: printable(api, "lab") == "Running", timeout=30, what="the VM to run")
        sol.expect_exact("SeaBIOS (version kubesim)")  # the VM's serial console, through the agent container
        sol.expect_exact(PROMPT)
    finally:
        sol.close(force=True)
    system = redfish_get(bmc, api, "lab", "/redfish/v1/Systems/vm")
    assert system["PowerState"] == "On"


def test_the_controller_comes_back_after_its_pod_is_deleted_and_reconciles(cluster: Sim,
                                                                           release: helm.Config) -> None:
    api = cluster.api()
    first = wait_for(lambda: controller_pod(cluster), timeout=60, what="the controller pod")
    reply = call(api, "DELETE", f"/api/v1/namespaces/{RELEASE_NS}/pods/{first['metadata']['name']}")
    assert reply.status == 200, reply.body
    wait_for(lambda: (pod := controller_pod(cluster)) and pod["metadata"]["uid"] != first["metadata"]["uid"],
             timeout=90, what="a new controller pod, ready")
    create_namespace(cluster, "after-restart")
    bmc_with_vm(cluster, "after-restart")
    wait_for(lambda: is_ready(api, "after-restart"), timeout=90, what="a BMC made by the new controller to be Ready")


def test_an_upgrade_rolls_the_agents_to_a_second_image_tag(cluster: Sim, release: helm.Config,
                                                           second_tag: str) -> None:
    api = cluster.api()
    create_namespace(cluster, "rollout")
    bmc_with_vm(cluster, "rollout")
    wait_for(lambda: is_ready(api, "rollout"), timeout=90, what="the BMC to be Ready")

    upgraded = release.upgrade(CHART, RELEASE, values(agent_tag=SECOND_TAG), wait="watcher", timeout=120)
    assert upgraded["status"] == "deployed"

    def rolled() -> bool:
        found = deployment(api, "rollout")
        if not found or found["spec"]["template"]["spec"]["containers"][0]["image"] != second_tag:
            return False
        running = running_pods(cluster, "rollout")
        return len(running) == 1 and running[0]["spec"]["containers"][0]["image"] == second_tag \
            and ready_container(running[0]) is not None

    wait_for(rolled, timeout=120, what=f"the agent to run {second_tag}")
    wait_for(lambda: is_ready(api, "rollout") and second_tag in condition(
        get_bmc(api, "rollout"), "AgentUpToDate").get("message", ""), timeout=60, what="AgentUpToDate")
    power = ipmitool(get_bmc(api, "rollout")["status"]["clusterIP"], "power", "status")
    assert "Chassis Power is off" in power.stdout, power.stderr


def test_a_pooled_agent_container_serves_several_bmcs(cluster: Sim, release: helm.Config) -> None:
    api = cluster.api()
    create_namespace(cluster, "pooled")
    names = ("vm-a", "vm-b", "vm-c")
    for name in names:
        bmc_with_vm(cluster, "pooled", name, agentPool="rack")
    wait_for(lambda: all(is_ready(api, "pooled", n) for n in names), timeout=120, what="every pooled BMC Ready")
    [agent] = running_pods(cluster, "pooled")  # one container for all three
    assert agent["metadata"]["name"].startswith("rack-virtbmc-pool-")
    assert ready_container(agent) is not None
    for name in names:
        address = get_bmc(api, "pooled", name)["status"]["clusterIP"]
        on = ipmitool(address, "power", "on")
        assert on.returncode == 0, on.stderr
    for name in names:
        wait_for(lambda n=name: printable(api, "pooled", n) == "Running", timeout=30, what=f"{name} to run")


def test_no_container_is_left_when_kubesim_stops(kubevbmc_image: str, tmp_path: Path) -> None:
    sim = start_container_sim(tmp_path / "short-lived")
    try:
        create_namespace(sim, "brief")
        reply = call(sim.api(), "POST", "/api/v1/namespaces/brief/pods", {
            "metadata": {"name": "sleeper"}, "spec": {"containers": [
                {"name": "main", "image": IMAGE, "imagePullPolicy": "Never",
                 "command": ["/opt/kubevbmc/bin/python", "-c", "import time; time.sleep(600)"]}]}})
        assert reply.status == 201, reply.body
        wait_for(lambda: running_pods(sim, "brief"), timeout=60, what="the pod to run")
    finally:
        pid = sim.process.pid
        assert sim.stop() == 0
    left = podman().call("ps", "--all", "--filter", f"label=io.kubesim.pid={pid}", "--format", "{{.Names}}")
    assert left.returncode == 0 and left.stdout.strip() == "", left.stdout


def test_containers_a_killed_kubesim_left_behind_are_removed_by_the_next_one(kubevbmc_image: str,
                                                                             tmp_path: Path) -> None:
    first = start_container_sim(tmp_path / "killed")

    def left(state: str = "") -> list[str]:
        status = ["--filter", f"status={state}"] if state else []
        found = podman().call("ps", "--all", "--filter", f"label=io.kubesim.pid={first.process.pid}", *status,
                              "--format", "{{.Names}}")
        assert found.returncode == 0, found.stderr
        return found.stdout.split()

    try:
        create_namespace(first, "brief")
        reply = call(first.api(), "POST", "/api/v1/namespaces/brief/pods", {
            "metadata": {"name": "sleeper"}, "spec": {"containers": [
                {"name": "main", "image": IMAGE, "imagePullPolicy": "Never",
                 "command": ["/opt/kubevbmc/bin/python", "-c", "import time; time.sleep(600)"]}]}})
        assert reply.status == 201, reply.body
        wait_for(lambda: len(left("running")) == 1, timeout=60, what="the pod's container to run")
    finally:
        first.process.kill()  # no chance to stop its containers
        first.process.wait(timeout=30)

    assert len(left("running")) == 1, "the container outlived its kubesim"
    second = start_container_sim(tmp_path / "next")
    try:
        assert left() == []
    finally:
        second.stop()
