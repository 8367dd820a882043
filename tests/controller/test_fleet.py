"""Rolling a new agent template through a fleet of 20 BMCs on kubesim: canary first, batches, a halt on an agent
that does not become ready, the rollout resumed by a corrected template, all across controller restarts.

kubesim's kubelet runs only the project's own image (`kubevbmc:<any tag>`): any other stays in ErrImagePull, as an
image that cannot be pulled does on a real node."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from ..support.agents import PASSWORD, USER
from ..support.cluster import call, install_bmc_crd, start_sim, wait_for
from ..support.controllers import ControllerProcess, condition, get_bmc, ipmitool, settle
from ..support.vms import make_vm

FLEET = 20
BATCH = 5  # --rollout-batch 25% of 20
BAD_IMAGE = "registry.invalid/kubevbmc-agent:broken"
# The timeout leaves room for five agents starting at once on a busy two-core machine.
FLAGS = ("--rollout-batch", "25%", "--rollout-timeout", "15s", "--resync", "300")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, client.ApiClient, str, Path]]:
    work = tmp_path_factory.mktemp("fleet")
    sim = start_sim(work / "sim", "--bookmark-interval", "0.5", "--vm-start-delay", "0.3")
    api = sim.api()
    install_bmc_crd(api)
    ns = "fleet"
    assert call(api, "POST", "/api/v1/namespaces", {"metadata": {"name": ns}}).status == 201
    for i in range(FLEET):
        make_vm(api, ns, f"vm{i:02d}", cdrom=False)
        reply = call(api, "POST", f"/api/v1/namespaces/{ns}/secrets",
                     {"metadata": {"name": f"vm{i:02d}-auth"}, "stringData": {"username": USER, "password": PASSWORD}})
        assert reply.status == 201, reply.body
        body = {"apiVersion": "bmc.kubevirt.io/v1beta1", "kind": "VirtualMachineBMC",
                "metadata": {"name": f"vm{i:02d}"},
                "spec": {"virtualMachineRef": {"name": f"vm{i:02d}"}, "authSecretRef": {"name": f"vm{i:02d}-auth"}}}
        assert call(api, "POST", f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{ns}/virtualmachinebmcs",
                    body).status == 201
    yield sim, api, ns, work
    sim.stop()


def agents(api: client.ApiClient, ns: str) -> list[dict[str, Any]]:
    """The agent Deployments, from one LIST: a consistent snapshot."""
    return list(call(api, "GET", f"/apis/apps/v1/namespaces/{ns}/deployments").body["items"])


def image(deployment: dict[str, Any]) -> str:
    return str(deployment["spec"]["template"]["spec"]["containers"][0]["image"])


def ready(deployment: dict[str, Any]) -> bool:
    status = deployment.get("status") or {}
    return (status.get("observedGeneration") == deployment["metadata"]["generation"]
            and status.get("readyReplicas") == 1 and status.get("updatedReplicas") == 1
            and status.get("replicas") == 1)


def bmcs(api: client.ApiClient, ns: str) -> list[dict[str, Any]]:
    return list(call(api, "GET", f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{ns}/virtualmachinebmcs").body["items"])


def all_ready(api: client.ApiClient, ns: str) -> bool:
    items = bmcs(api, ns)
    return len(items) == FLEET and all(condition(b, "Ready").get("status") == "True" for b in items)


def warnings(api: client.ApiClient, ns: str) -> dict[str, int]:
    """Warning Events by reason, counting repeats."""
    counts: dict[str, int] = {}
    for e in call(api, "GET", f"/api/v1/namespaces/{ns}/events").body["items"]:
        if e.get("type") == "Warning":
            counts[e["reason"]] = counts.get(e["reason"], 0) + int(e.get("count") or 1)
    return counts


def controller(sim: Any, work: Path, name: str, agent_image: str) -> ControllerProcess:
    # --agent-image comes after the ControllerProcess default, so it wins (argparse keeps the last).
    return ControllerProcess(sim.kubeconfig, work / f"{name}.log", *FLAGS, "--agent-image", agent_image)


# One scenario of several steps, each waiting with its own deadline: 90 s on an idle machine, minutes on a busy one
@pytest.mark.timeout(900)
def test_a_bad_image_updates_one_agent_halts_and_a_good_one_rolls_all_in_batches(fleet: Any) -> None:
    sim, api, ns, work = fleet
    first = controller(sim, work, "controller-dev", "kubevbmc:dev")
    try:
        wait_for(lambda: all_ready(api, ns), timeout=180, interval=0.5, what="20 BMCs Ready on kubevbmc:dev")
        assert first.metric("kubevbmc_controller_agents") == FLEET
        assert first.metric("kubevbmc_controller_agents_outdated") == 0
        assert all(condition(b, "AgentUpToDate").get("status") == "True" for b in bmcs(api, ns))
    finally:
        assert first.stop() == 0

    # An image that cannot run: exactly one agent (the canary) takes it, does not become ready, and halts the rollout.
    bad = controller(sim, work, "controller-bad", BAD_IMAGE)
    try:
        def halted() -> list[dict[str, Any]] | None:
            items = bmcs(api, ns)
            held = [b for b in items if condition(b, "AgentUpToDate").get("reason") == "RolloutHalted"]
            return items if len(held) == FLEET - 1 else None

        items = wait_for(halted, timeout=90, interval=0.5, what="the rollout halted on 19 BMCs")
        assert items is not None
        deployments = agents(api, ns)
        updated = [d for d in deployments if image(d) == BAD_IMAGE]
        assert len(updated) == 1, [d["metadata"]["name"] for d in updated]
        canary = updated[0]["metadata"]["name"]
        canary_bmc = next(b for b in items if f"{b['metadata']['name']}-virtbmc" == canary)
        # The canary's BMC says why it is down; the others keep their old, working agents and say why they wait.
        assert condition(canary_bmc, "Ready")["reason"] == "ProgressDeadlineExceeded"
        for b in items:
            if b is canary_bmc:
                continue
            assert condition(b, "Ready")["status"] == "True", b["metadata"]["name"]
            held = condition(b, "AgentUpToDate")
            assert held["status"] == "False" and f"{ns}/{canary}" in held["message"], held
        assert bad.metric("kubevbmc_controller_rollout_halted") == 1
        assert bad.metric("kubevbmc_controller_agents_outdated") == FLEET - 1

        def halted_warnings() -> int:
            events = call(api, "GET", f"/api/v1/namespaces/{ns}/events").body["items"]
            return sum(1 for e in events if e.get("reason") == "RolloutHalted" and e.get("type") == "Warning")

        # Events are posted off the reconcile path (controller/events.py), one at a time, after the statuses
        wait_for(lambda: halted_warnings() >= FLEET - 1, timeout=30, what="a RolloutHalted Warning per held BMC")
        # A BMC on an old agent still answers IPMI.
        other = next(b for b in items if b is not canary_bmc)
        host = other["status"]["clusterIP"]
        assert "Chassis Power is" in ipmitool(host, "power", "status").stdout

        # Halted means halted: nothing more is updated while the canary stays down.
        settle(3)
        assert sum(1 for d in agents(api, ns) if image(d) == BAD_IMAGE) == 1

        # A change to a waiting BMC's own inputs applies at once, with the image it already runs.
        name = other["metadata"]["name"]
        before = next(d for d in agents(api, ns) if d["metadata"]["name"] == f"{name}-virtbmc")
        new_password = "rotated-" + PASSWORD
        reply = call(api, "PATCH", f"/api/v1/namespaces/{ns}/secrets/{name}-auth",
                     {"data": {"password": base64.b64encode(new_password.encode()).decode()}},
                     content_type="application/merge-patch+json")
        assert reply.status == 200, reply.body

        def rotated() -> dict[str, Any] | None:
            d = next(d for d in agents(api, ns) if d["metadata"]["name"] == f"{name}-virtbmc")
            changed = d["metadata"]["generation"] > before["metadata"]["generation"]
            return d if changed and ready(d) else None

        after = wait_for(rotated, timeout=60, interval=0.5, what="the rotated BMC's agent restarted")
        assert after is not None
        assert image(after) == "kubevbmc:dev"
        assert sum(1 for d in agents(api, ns) if image(d) == BAD_IMAGE) == 1
    finally:
        assert bad.stop() == 0

    # A corrected image resumes by itself: the broken canary first, then batches, each once the updated are ready.
    # The canary's old verdict (ProgressDeadlineExceeded, kept by the deployment controller until the new
    # ReplicaSet progresses) is not the new canary's: no halt, no Warning, until the new canary itself fails.
    warnings_before = warnings(api, ns)
    good = controller(sim, work, "controller-v2", "kubevbmc:v2")
    try:
        samples = 0
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            deployments = agents(api, ns)
            updated = [d for d in deployments if image(d) == "kubevbmc:v2"]
            updated_ready = [d for d in updated if ready(d)]
            samples += 1
            assert good.metric("kubevbmc_controller_rollout_halted") == 0, "a halt declared on the old verdict"
            assert len(updated) - len(updated_ready) <= BATCH, [d["metadata"]["name"] for d in updated]
            if not updated_ready:
                assert len(updated) <= 1, "more than the canary before any updated agent was ready"
            if updated and len(updated) < FLEET:
                assert canary in {d["metadata"]["name"] for d in updated}, "the broken agent is not fixed first"
            if len(updated_ready) == FLEET and all_ready(api, ns):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the rollout to kubevbmc:v2 did not finish: {len(updated)} updated, "
                                 f"{len(updated_ready)} ready")
        assert samples > 5
        assert all(condition(b, "AgentUpToDate").get("status") == "True" for b in bmcs(api, ns))
        wait_for(lambda: good.metric("kubevbmc_controller_rollout_halted") == 0
                 and good.metric("kubevbmc_controller_agents_outdated") == 0, what="the metrics of a finished rollout")
        host = get_bmc(api, ns, "vm00")["status"]["clusterIP"]
        assert "Chassis Power is" in ipmitool(host, "power", "status").stdout
        assert warnings(api, ns) == warnings_before

        # An agent that breaks at the fleet's own revision (a certificate it cannot load) is its BMC's problem, not
        # a halt: nothing is outdated, nothing held back.
        bad_tls = {"metadata": {"name": "vm05-bad-tls"}, "type": "Opaque",
                   "stringData": {"tls.crt": "not a certificate", "tls.key": "not a key"}}
        assert call(api, "POST", f"/api/v1/namespaces/{ns}/secrets", bad_tls).status == 201
        reply = call(api, "PATCH", f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{ns}/virtualmachinebmcs/vm05",
                     {"spec": {"redfish": {"tls": {"secretRef": {"name": "vm05-bad-tls"}}}}},
                     content_type="application/merge-patch+json")
        assert reply.status == 200, reply.body
        wait_for(lambda: condition(get_bmc(api, ns, "vm05"), "Ready").get("reason") == "ProgressDeadlineExceeded",
                 timeout=90, interval=0.5, what="vm05's broken agent past its deadline")
        settle(2)
        assert good.metric("kubevbmc_controller_rollout_halted") == 0
        assert good.metric("kubevbmc_controller_agents_outdated") == 0
        assert condition(get_bmc(api, ns, "vm06"), "Ready")["status"] == "True"
        assert "is halted" not in good.log_path.read_text()
    finally:
        assert good.stop() == 0
