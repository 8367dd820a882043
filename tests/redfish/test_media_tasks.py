"""Virtual media as tasks: InsertMedia checks the image (refusing at once one that cannot be had), sizes its import,
answers 202 with a Task that follows CDI, and a power-on during an import is kept and boots with the medium.
Against an agent on kubesim, with sushy and plain HTTP clients."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import sushy
from kubernetes import client

from vbmc.machine.kubevirt import imagecheck

from ..support.agents import (
    PASSWORD,
    USER,
    AgentProcess,
    agent_for_vm,
    running_agent,
    sushy_at,
    write_serving_certificate,
)
from ..support.cluster import Sim, call, start_sim, wait_for
from ..support.images import ImageServer
from ..support.vms import get_vmi, running_vmi_uid

GI = 2**30
INSERT = "/redfish/v1/Managers/BMC/VirtualMedia/Cd/Actions/VirtualMedia.InsertMedia"
CD = "/redfish/v1/Managers/BMC/VirtualMedia/Cd"
DVS = "/apis/cdi.kubevirt.io/v1beta1/namespaces/{ns}/datavolumes"


@pytest.fixture
def images() -> Iterator[ImageServer]:
    server = ImageServer(3 * GI)
    yield server
    server.close()


@pytest.fixture
def agent(sim: Sim, api: client.ApiClient, namespace: str, bmc_crd: None) -> Iterator[AgentProcess]:
    with agent_for_vm(sim, api, namespace) as process:
        yield process


def insert(agent: AgentProcess, url: str) -> tuple[int, dict[str, Any], str]:
    resp = requests.post(f"{agent.url}{INSERT}", json={"Image": url}, auth=(USER, PASSWORD), timeout=10)
    return resp.status_code, resp.json(), resp.headers.get("Location", "")


def task_of(agent: AgentProcess, location: str) -> dict[str, Any]:
    return dict(requests.get(f"{agent.url}{location}", auth=(USER, PASSWORD), timeout=5).json())


def event_reasons(api: client.ApiClient, ns: str) -> list[str]:
    return [e["reason"] for e in call(api, "GET", f"/api/v1/namespaces/{ns}/events").body["items"]]


def datavolumes(api: client.ApiClient, ns: str) -> list[dict[str, Any]]:
    return list(call(api, "GET", DVS.format(ns=ns)).body["items"])


def test_a_good_image_is_sized_and_its_task_completes_with_progress(
        agent: AgentProcess, api: client.ApiClient, namespace: str, images: ImageServer) -> None:
    status, task, location = insert(agent, f"{images.base}/boot.iso")
    assert status == 202 and location.startswith("/redfish/v1/TaskService/Tasks/")
    assert task["TaskState"] in ("Running", "Completed")
    (dv,) = datavolumes(api, namespace)
    # 3 GiB over CDI's 5.5% filesystem overhead, plus 5%: the claim holds the image
    assert dv["spec"]["storage"]["resources"]["requests"]["storage"] == imagecheck.quantity(
        imagecheck.claim_size(imagecheck.ImageInfo(3 * GI)))
    seen: list[int] = []

    def completed() -> bool:
        current = task_of(agent, location)
        seen.append(current["PercentComplete"])
        return bool(current["TaskState"] == "Completed")

    wait_for(completed, timeout=10, what="the import to complete")
    assert seen[-1] == 100 and seen == sorted(seen)
    shown = requests.get(f"{agent.url}{CD}", auth=(USER, PASSWORD), timeout=5).json()
    assert shown["Inserted"] is True and shown["Image"].endswith("/boot.iso")
    tasks = requests.get(f"{agent.url}/redfish/v1/TaskService/Tasks", auth=(USER, PASSWORD), timeout=5).json()
    assert {"@odata.id": location} in tasks["Members"]
    wait_for(lambda: "VirtualMediaImported" in event_reasons(api, namespace), timeout=5, what="the import's Event")
    assert "Virtual CD" in agent.ipmitool("sel", "elist").stdout  # the import's end is in the SEL


@pytest.mark.parametrize(("path", "size", "reason"), [
    ("/missing.iso", 3 * GI, "answered 404"),
    ("/boot.iso", 100 * GI, "more than this BMC imports"),
])
def test_a_missing_or_too_large_image_is_refused_at_once_and_creates_nothing(
        agent: AgentProcess, api: client.ApiClient, namespace: str, images: ImageServer, path: str, size: int,
        reason: str) -> None:
    images.size = size
    status, body, location = insert(agent, f"{images.base}{path}")
    assert status == 400 and location == ""
    error = body["error"]
    assert error["@Message.ExtendedInfo"][0]["MessageId"].endswith(".ActionParameterValueError")
    assert reason in error["message"] and f"{images.base}{path}" in error["message"]
    assert datavolumes(api, namespace) == []
    shown = requests.get(f"{agent.url}{CD}", auth=(USER, PASSWORD), timeout=5).json()
    assert shown["Inserted"] is False
    tasks = requests.get(f"{agent.url}/redfish/v1/TaskService/Tasks", auth=(USER, PASSWORD), timeout=5).json()
    assert tasks["Members"] == []


def test_sushy_hears_a_mistyped_image_url_as_an_error_naming_it(agent: AgentProcess, images: ImageServer) -> None:
    with sushy_at(agent.url) as root:
        media = root.get_manager("/redfish/v1/Managers/BMC").virtual_media.get_member(CD)
        with pytest.raises(sushy.exceptions.BadRequestError) as raised:
            media.insert_media(f"{images.base}/missing-boto.iso")  # a mistyped boot_iso: the server has no such file
    assert "missing-boto.iso" in str(raised.value) and "404" in str(raised.value)


def test_an_import_cdi_fails_ends_the_task_in_an_exception_and_the_slot_empty(
        agent: AgentProcess, api: client.ApiClient, namespace: str, images: ImageServer) -> None:
    status, _, location = insert(agent, f"{images.base}/broken")  # HEAD says fine; CDI's GET gets a 500
    assert status == 202
    wait_for(lambda: task_of(agent, location)["TaskState"] == "Exception", timeout=10, what="the failure")
    assert "500" in task_of(agent, location)["Messages"][0]["Message"]
    shown = requests.get(f"{agent.url}{CD}", auth=(USER, PASSWORD), timeout=5).json()
    assert shown["Inserted"] is False and shown["Status"]["Health"] == "Warning"
    wait_for(lambda: "VirtualMediaFailed" in event_reasons(api, namespace), timeout=5, what="the failure's Event")


def test_power_on_straight_after_an_insert_boots_with_the_medium(
        agent: AgentProcess, api: client.ApiClient, namespace: str, images: ImageServer) -> None:
    with sushy_at(agent.url) as root:
        system = root.get_system("/redfish/v1/Systems/vm")
        media = root.get_manager("/redfish/v1/Managers/BMC").virtual_media.get_member(CD)
        media.insert_media(f"{images.base}/boot.iso")
        system.reset_system(sushy.ResetType.ON)  # waits for the import (0.3 s on the session's kubesim)
        wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="the boot")
        volumes = {v["name"]: v for v in (get_vmi(api, namespace) or {})["spec"]["volumes"]}
        assert "dataVolume" in volumes["cdrom"]


@pytest.fixture
def slow_imports(tmp_path: Path) -> Iterator[tuple[Sim, client.ApiClient]]:
    """A kubesim whose imports take 10 s (real ones take tens of seconds), with the VirtualMachineBMC CRD and a
    namespace `m`: long enough that a held power-on is seen held on a busy machine."""
    from ..support.cluster import install_bmc_crd

    slow = start_sim(tmp_path / "sim", "--import-delay", "10", "--vm-start-delay", "0.2")
    try:
        api = slow.api()
        install_bmc_crd(api)
        client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="m")))
        yield slow, api
    finally:
        slow.stop()


def power_state(agent: AgentProcess) -> str:
    return str(agent.redfish("GET", "/redfish/v1/Systems/vm")[1]["PowerState"])


def test_a_halted_vm_whose_medium_imports_is_off(slow_imports: tuple[Sim, client.ApiClient],
                                                 images: ImageServer) -> None:
    slow, api = slow_imports
    with agent_for_vm(slow, api, "m") as agent:
        status, _, location = insert(agent, f"{images.base}/boot.iso")
        assert status == 202
        vm = call(api, "GET", "/apis/kubevirt.io/v1/namespaces/m/virtualmachines/vm").body
        wait_for(lambda: call(api, "GET", "/apis/kubevirt.io/v1/namespaces/m/virtualmachines/vm").body.get(
            "status", {}).get("printableStatus") == "Provisioning", timeout=5, what="KubeVirt to print Provisioning")
        assert vm["spec"].get("runStrategy", "Halted") == "Halted"
        assert power_state(agent) == "Off"
        assert "Chassis Power is off" in agent.ipmitool("chassis", "power", "status").stdout
        wait_for(lambda: task_of(agent, location)["TaskState"] == "Completed", timeout=15, what="the import")
        assert power_state(agent) == "Off" and get_vmi(api, "m") is None


@pytest.mark.parametrize("client_kind", ["redfish", "ipmi"])
def test_a_power_on_during_an_import_is_kept_and_boots_from_the_medium(
        slow_imports: tuple[Sim, client.ApiClient], images: ImageServer, client_kind: str) -> None:
    slow, api = slow_imports
    with agent_for_vm(slow, api, "m") as agent:
        status, _, location = insert(agent, f"{images.base}/boot.iso")
        assert status == 202
        if client_kind == "redfish":
            resp = requests.post(f"{agent.url}/redfish/v1/Systems/vm/Actions/ComputerSystem.Reset",
                                 json={"ResetType": "On"}, auth=(USER, PASSWORD), timeout=10)
            assert resp.status_code == 204, resp.text
        else:
            assert agent.ipmitool("chassis", "power", "on").returncode == 0
        assert task_of(agent, location)["TaskState"] == "Running"  # accepted while the medium imports
        # the agent reads from its watch caches, a moment behind its own write
        wait_for(lambda: power_state(agent) == "PoweringOn", what="the held power-on to read PoweringOn")
        vmi = get_vmi(api, "m")
        assert vmi is None or vmi.get("status", {}).get("phase", "Pending") == "Pending"  # held, nothing booted
        wait_for(lambda: running_vmi_uid(api, "m"), timeout=20, what="the VM to boot once the medium is in")
        assert task_of(agent, location)["TaskState"] == "Completed"
        volumes = {v["name"]: v for v in (get_vmi(api, "m") or {})["spec"]["volumes"]}
        assert volumes["cdrom"]["dataVolume"] == {"name": "vm-cdrom"}  # in the domain from its first instruction
        # KubeVirt's VM controller prints Running after the VMI runs, and the agent's watch hears of it after that
        wait_for(lambda: power_state(agent) == "On", timeout=5, what="the System to read On")


def test_a_power_on_held_by_an_import_that_fails_boots_without_the_medium(
        slow_imports: tuple[Sim, client.ApiClient], images: ImageServer) -> None:
    slow, api = slow_imports
    with agent_for_vm(slow, api, "m") as agent:
        status, _, location = insert(agent, f"{images.base}/broken")  # HEAD says fine; CDI's GET gets a 500
        assert status == 202
        assert agent.redfish("POST", "/redfish/v1/Systems/vm/Actions/ComputerSystem.Reset",
                             {"ResetType": "On"})[0] == 204
        # kept, not lost (read from the agent's caches, a moment behind its write; On once the import has failed)
        wait_for(lambda: power_state(agent) in ("PoweringOn", "On"), what="the power-on to be kept")
        wait_for(lambda: running_vmi_uid(api, "m"), timeout=20, what="the VM to boot once the import failed")
        assert task_of(agent, location)["TaskState"] == "Exception"
        shown = agent.redfish("GET", CD)[1]
        assert shown["Inserted"] is False and shown["Status"]["Health"] == "Warning"
        # KubeVirt's VM controller prints Running after the VMI runs, and the agent's watch hears of it after that
        wait_for(lambda: power_state(agent) == "On", timeout=5, what="the System to read On")


def test_a_held_power_on_survives_an_agent_restart(slow_imports: tuple[Sim, client.ApiClient],
                                                  images: ImageServer) -> None:
    # The intent is in the cluster (the VMI KubeVirt holds), not in the agent: a new agent finds the failed import
    # and lets the VM boot, as the first one would have.
    slow, api = slow_imports
    with agent_for_vm(slow, api, "m") as agent:
        assert insert(agent, f"{images.base}/broken")[0] == 202
        assert agent.redfish("POST", "/redfish/v1/Systems/vm/Actions/ComputerSystem.Reset",
                             {"ResetType": "On"})[0] == 204
    wait_for(lambda: (call(api, "GET", DVS.format(ns="m") + "/vm-cdrom").body.get("status") or {}).get("phase")
             == "Failed", timeout=10, what="the import to fail with no agent")
    vmi = get_vmi(api, "m")
    assert vmi is not None and vmi["status"].get("phase") == "Pending"  # held: nothing booted
    with running_agent("--namespace", "m", "--vm", "vm", "--vmbmc", "vm", env={"KUBECONFIG": slow.kubeconfig}) as again:
        wait_for(lambda: running_vmi_uid(api, "m"), timeout=20, what="the new agent to let the VM boot")
        # KubeVirt's VM controller prints Running after the VMI runs, and the agent's watch hears of it after that
        wait_for(lambda: power_state(again) == "On", timeout=5, what="the System to read On")


def test_a_power_off_during_a_held_power_on_leaves_the_vm_off(
        slow_imports: tuple[Sim, client.ApiClient], images: ImageServer) -> None:
    slow, api = slow_imports
    with agent_for_vm(slow, api, "m") as agent:
        status, _, location = insert(agent, f"{images.base}/boot.iso")
        assert status == 202
        assert agent.ipmitool("chassis", "power", "on").returncode == 0
        wait_for(lambda: power_state(agent) == "PoweringOn", what="the held power-on to read PoweringOn")
        assert agent.ipmitool("chassis", "power", "off").returncode == 0
        wait_for(lambda: power_state(agent) == "Off", timeout=5, what="the VM to be off")
        wait_for(lambda: task_of(agent, location)["TaskState"] == "Completed", timeout=15, what="the import")
        # KubeVirt has seen the import end (the VM no longer prints Provisioning) and started nothing.
        wait_for(lambda: call(api, "GET", "/apis/kubevirt.io/v1/namespaces/m/virtualmachines/vm").body.get(
            "status", {}).get("printableStatus") == "Stopped", timeout=5, what="KubeVirt to see the import end")
        assert get_vmi(api, "m") is None and power_state(agent) == "Off"


def test_a_private_ca_image_imports_with_the_configured_bundle(
        agent: AgentProcess, api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    cert, key = write_serving_certificate(tmp_path)
    server = ImageServer(GI, tls=(cert, key))
    try:
        status, body, _ = insert(agent, f"{server.base}/boot.iso")
        assert status == 400 and "not trusted" in body["error"]["message"]
        pem = cert.read_text()
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "image-ca"}, "data": {"ca.crt": pem}}
        assert call(api, "POST", f"/api/v1/namespaces/{namespace}/configmaps", cm).status == 201
        reply = call(api, "PATCH", f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{namespace}/virtualmachinebmcs/vm",
                     {"spec": {"redfish": {"virtualMedia": {"tls": {"caBundleConfigMapRef": {"name": "image-ca"}}}}}},
                     content_type="application/merge-patch+json")
        assert reply.status == 200, reply.body

        def inserted() -> bool:
            code, current, location = insert(agent, f"{server.base}/boot.iso")
            return bool(code == 202 and current["TaskState"] != "Exception" and location)

        wait_for(inserted, timeout=10, what="the agent to see the CA bundle")
        (dv,) = datavolumes(api, namespace)
        assert dv["spec"]["source"]["http"]["certConfigMap"] == "image-ca"
        wait_for(lambda: (datavolumes(api, namespace)[0].get("status") or {}).get("phase") == "Succeeded",
                 timeout=10, what="CDI to import it with the bundle")
    finally:
        server.close()


def test_a_patch_to_an_unusable_image_keeps_the_medium_that_is_in(
        agent: AgentProcess, api: client.ApiClient, namespace: str, images: ImageServer) -> None:
    status, _, location = insert(agent, f"{images.base}/boot.iso")
    assert status == 202
    wait_for(lambda: task_of(agent, location)["TaskState"] == "Completed", timeout=10, what="the first medium")
    etag = requests.get(f"{agent.url}{CD}", auth=(USER, PASSWORD), timeout=5).headers["ETag"]
    resp = requests.patch(f"{agent.url}{CD}", json={"Image": f"{images.base}/missing.iso"}, auth=(USER, PASSWORD),
                          headers={"If-Match": etag}, timeout=10)  # OpenShift's BMC check mounts this way
    assert resp.status_code == 400 and "404" in resp.json()["error"]["message"]
    shown = requests.get(f"{agent.url}{CD}", auth=(USER, PASSWORD), timeout=5).json()
    assert shown["Inserted"] is True and shown["Image"].endswith("/boot.iso")
    assert [dv["spec"]["source"]["http"]["url"] for dv in datavolumes(api, namespace)] == [f"{images.base}/boot.iso"]
