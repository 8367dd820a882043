"""UEFI HTTP boot, identify, the PCIe inventory and virtual media as Ironic inserts it, on KubeVirt (kubesim): what
each does to the VirtualMachine and its media. (Through Redfish on the memory backend: test_ironic_habits.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from vbmc.machine import BootEnabled, BootMode, BootOverride, BootTarget, InvalidRequest, MediaState, ResetType
from vbmc.machine.kubevirt.client import KubeClient, load_credentials
from vbmc.machine.kubevirt.machine import KubeVirtMachine

from ..support.agents import AgentProcess, agent_for_vm, running_agent
from ..support.cluster import Sim, call, wait_for
from ..support.vms import boot_orders, get_vm, get_vmi, make_bmc, make_vm, running_vmi_uid

VMS = "/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachines"
DVS = "/apis/cdi.kubevirt.io/v1beta1/namespaces/{ns}/datavolumes"


def datavolume(api: client.ApiClient, ns: str, name: str = "vm-cdrom") -> dict[str, Any] | None:
    reply = call(api, "GET", f"{DVS.format(ns=ns)}/{name}")
    return reply.body if reply.status == 200 and not reply.body["metadata"].get("deletionTimestamp") else None


def uefi(api: client.ApiClient, ns: str) -> None:
    reply = call(api, "PATCH", f"{VMS.format(ns=ns)}/vm", {"spec": {"template": {"spec": {"domain": {
        "firmware": {"bootloader": {"efi": {"secureBoot": False}}}}}}}}, content_type="application/merge-patch+json")
    assert reply.status == 200, reply.body


@pytest.fixture
def machine(sim: Sim, api: client.ApiClient, namespace: str, bmc_crd: None) -> Iterator[KubeVirtMachine]:
    make_vm(api, namespace, run_strategy="Manual")
    make_bmc(api, namespace)
    made = KubeVirtMachine(KubeClient(load_credentials(sim.kubeconfig)), namespace, "vm", "vm", keep_ejected=2.0)
    made.start()
    assert made.wait_ready(5)
    yield made
    made.stop()


# ---- UEFI HTTP boot: the image imported into the cdrom, which the override boots


def test_uefi_http_is_offered_only_for_a_uefi_vm(api: client.ApiClient, namespace: str,
                                                 machine: KubeVirtMachine) -> None:
    assert BootTarget.UEFI_HTTP not in machine.supported_boot_targets()  # BIOS, KubeVirt's default
    uefi(api, namespace)
    wait_for(lambda: BootTarget.UEFI_HTTP in machine.supported_boot_targets(), timeout=5, what="UEFI")


def test_uefi_http_boot_once_imports_the_image_and_boots_it(api: client.ApiClient, namespace: str,
                                                            machine: KubeVirtMachine, image_server: Any) -> None:
    uefi(api, namespace)
    wait_for(lambda: BootTarget.UEFI_HTTP in machine.supported_boot_targets(), timeout=5, what="UEFI")
    image = f"{image_server.base}/deploy.iso"
    machine.set_boot_override(BootOverride(BootTarget.UEFI_HTTP, BootEnabled.ONCE, BootMode.UEFI, image))
    dv = datavolume(api, namespace)
    assert dv and dv["spec"]["source"]["http"]["url"] == image
    assert dv["metadata"]["annotations"] == {"bmc.kubevirt.io/http-boot": "true"}
    assert boot_orders(get_vm(api, namespace))["cdrom"] == 1
    assert machine.boot_override().http_boot_uri == image
    record = call(api, "GET", f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{namespace}/virtualmachinebmcs/vm").body
    assert record["status"]["bootOverride"]["httpBootUri"] == image
    machine.reset(ResetType.ON)
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="the VM to run")
    volumes = {v["name"]: v for v in (get_vmi(api, namespace) or {})["spec"]["volumes"]}
    assert volumes["cdrom"]["dataVolume"] == {"name": "vm-cdrom"}  # in the domain from its first instruction
    # Once: consumed by that boot, the order restored; the image stays in the drive for the running system
    wait_for(lambda: machine.boot_override().enabled == BootEnabled.DISABLED, timeout=5, what="the revert")
    assert boot_orders(get_vm(api, namespace))["cdrom"] is None
    assert machine.virtual_media().image == image
    # Continuous with another image (Ironic's prepare_instance): the medium HTTP boot put in is replaced
    other = f"{image_server.base}/instance.iso"
    machine.set_boot_override(BootOverride(BootTarget.UEFI_HTTP, BootEnabled.CONTINUOUS, BootMode.UEFI, other))
    assert machine.virtual_media().image == other
    # and leaving UEFI HTTP boot ejects it
    machine.set_boot_override(BootOverride(BootTarget.HDD, BootEnabled.CONTINUOUS, BootMode.UEFI))
    assert not machine.virtual_media().inserted


def test_uefi_http_boot_leaves_a_clients_medium_alone(api: client.ApiClient, namespace: str,
                                                      machine: KubeVirtMachine, image_server: Any) -> None:
    uefi(api, namespace)
    wait_for(lambda: BootTarget.UEFI_HTTP in machine.supported_boot_targets(), timeout=5, what="UEFI")
    machine.insert_media(f"{image_server.base}/mine.iso")
    with pytest.raises(InvalidRequest, match="eject the medium first"):
        machine.set_boot_override(BootOverride(BootTarget.UEFI_HTTP, BootEnabled.ONCE, BootMode.UEFI,
                                               f"{image_server.base}/deploy.iso"))
    assert machine.virtual_media().image == f"{image_server.base}/mine.iso"
    assert machine.boot_override().target == BootTarget.NONE


# ---- identify: an annotation on the VM


def test_identify_is_an_annotation_on_the_vm(api: client.ApiClient, namespace: str,
                                             machine: KubeVirtMachine) -> None:
    generation = get_vm(api, namespace)["metadata"]["generation"]
    machine.set_identify(True)
    vm = get_vm(api, namespace)
    assert vm["metadata"]["annotations"]["bmc.kubevirt.io/identify"] == "on"
    assert vm["metadata"]["generation"] == generation  # metadata only: no RestartRequired
    assert machine.identify().active and machine.identify().until is None
    machine.set_identify(True, 15)  # IPMI chassis identify's interval
    assert machine.identify().until is not None and machine.identify().blinking
    machine.set_identify(False)
    assert "bmc.kubevirt.io/identify" not in (get_vm(api, namespace)["metadata"].get("annotations") or {})
    assert not machine.identify().active


# ---- the PCIe inventory and the links


def test_pcie_devices_and_link_state_follow_the_vm(api: client.ApiClient, namespace: str,
                                                   machine: KubeVirtMachine) -> None:
    inv = machine.inventory()
    assert {(d.id, d.device_class, d.model) for d in inv.pcie_devices} == {
        ("nic-default", "NetworkController", "virtio"), ("disk-root", "MassStorageController", "virtio-blk"),
        ("sata", "MassStorageController", "ICH9 AHCI")}
    assert [n.link_up for n in inv.nics] == [False]  # off
    machine.reset(ResetType.ON)
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="the VM to run")
    wait_for(lambda: [n.link_up for n in machine.inventory().nics] == [True], timeout=5, what="the link")


# ---- virtual media as Ironic inserts it: eject first, retries


def test_eject_then_insert_of_the_same_image_imports_it_once(api: client.ApiClient, namespace: str,
                                                             machine: KubeVirtMachine, image_server: Any) -> None:
    image = f"{image_server.base}/boot.iso"
    machine.insert_media(image)
    first = datavolume(api, namespace)
    assert first
    machine.insert_media(image)  # a retry of the same insert: accepted, nothing new
    machine.eject_media()
    machine.eject_media()  # Ironic ejects before every insert, empty or not
    assert not machine.virtual_media().inserted
    machine.insert_media(image)
    again = datavolume(api, namespace)
    assert again and again["metadata"]["uid"] == first["metadata"]["uid"]  # no second import
    assert machine.virtual_media().image == image
    # another image after an eject: the kept one is replaced
    machine.eject_media()
    machine.insert_media(f"{image_server.base}/other.iso")
    replaced = datavolume(api, namespace)
    assert replaced and replaced["metadata"]["uid"] != first["metadata"]["uid"]
    # an ejected medium is kept for a while only (keep_ejected: 2 s here, 120 s in the agent)
    machine.eject_media()
    wait_for(lambda: datavolume(api, namespace) is None, timeout=8, what="the ejected medium to go")
    assert machine.virtual_media().state == MediaState.EJECTED


# ---- through an agent: identify outlives it


@pytest.fixture
def agent(sim: Sim, api: client.ApiClient, namespace: str, bmc_crd: None) -> Iterator[AgentProcess]:
    with agent_for_vm(sim, api, namespace) as process:
        yield process


def test_identify_set_through_redfish_survives_an_agent_restart(sim: Sim, api: client.ApiClient, namespace: str,
                                                                agent: AgentProcess) -> None:
    status, shown = agent.redfish("PATCH", "/redfish/v1/Chassis/vm", {"LocationIndicatorActive": True})
    assert status == 200 and shown["IndicatorLED"] == "Lit"
    agent.stop()
    with running_agent("--namespace", namespace, "--vm", "vm", "--vmbmc", "vm",
                       env={"KUBECONFIG": sim.kubeconfig}) as again:
        status, system = again.redfish("GET", "/redfish/v1/Systems/vm")
        assert status == 200 and system["LocationIndicatorActive"] is True
        status, devices = again.redfish("GET", "/redfish/v1/Chassis/vm/PCIeDevices")
        assert status == 200 and devices["Members@odata.count"] == 3
