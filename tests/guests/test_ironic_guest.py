"""OpenStack Ironic deploys real guests through the BMC: its virtual-media deploy (the `redfish` hardware type,
`redfish-virtual-media` boot, `ramdisk` deploy) inserts the test guest's ISO and the guest really boots it; its PXE
deploy (the `ipmi` hardware type, `pxe` boot) sets the boot device through ipmitool and powers on, and the guest
really boots from the network (the firmware's PXE, then the boot server's loader and kernel). Both are read on
the guests' serial lines."""

from __future__ import annotations

import contextlib
import shutil
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client

from ..ironic.test_ironic import Files
from ..sim.test_console import endpoint
from ..support.agents import PASSWORD, USER, AgentProcess, running_agent
from ..support.cluster import Sim, install_bmc_crd, start_sim
from ..support.guests import SerialTap, build_guest_images, guest_vm, sim_flags
from ..support.ironic import IronicProcess
from ..support.vms import make_bmc
from .conftest import BOOTED

pytestmark = pytest.mark.timeout(900)
NS = "metal-guests"
# Node names: not "vmedia" (GET /v1/nodes/vmedia is Ironic's virtual media API, a 404 for a node of that name)
MACS = {"cd-node": "02:00:0b:00:00:01", "net-node": "02:00:0b:00:00:02"}


@dataclass
class Lab:
    sim: Sim
    ironic: IronicProcess
    files: Files
    agents: dict[str, AgentProcess]
    taps: dict[str, SerialTap]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    images = build_guest_images()
    workdir = tmp_path_factory.mktemp("ironic-guests")
    files = Files(workdir / "ironic" / "httpboot")
    for name in ("guest.iso", "netboot/vmlinuz", "netboot/initrd.img"):
        shutil.copyfile(images / name, files.root / Path(name).name)
    with contextlib.ExitStack() as stack:
        stack.callback(files.close)
        sim = start_sim(workdir / "sim", *sim_flags(images))
        stack.callback(sim.stop)
        api = sim.api()
        install_bmc_crd(api)
        client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NS)))
        kube = endpoint(sim.kubeconfig)
        agents, taps = {}, {}
        for name, mac in MACS.items():
            guest_vm(api, NS, name, mac=mac)  # a fixed MAC, as Ironic's ports need
            make_bmc(api, NS, name)
            agents[name] = stack.enter_context(running_agent("--namespace", NS, "--vm", name, "--vmbmc", name,
                                                             env={"KUBECONFIG": sim.kubeconfig}))
            taps[name] = SerialTap(kube.url, kube.token, kube.tls, NS, name)
            stack.callback(taps[name].close)
        # Started last, so stopped first (before the agents it drives)
        ironic = IronicProcess(workdir / "ironic", files.port, power_state_change_timeout=60)
        stack.callback(ironic.stop)
        yield Lab(sim, ironic, files, agents, taps)


def deploy(lab: Lab, name: str, driver: str) -> None:
    ironic, agent = lab.ironic.client, lab.agents[name]
    if driver == "ipmi":
        ironic.enroll(name, "ipmi", {
            "ipmi_address": "127.0.0.1", "ipmi_port": agent.ipmi_port, "ipmi_username": USER,
            "ipmi_password": PASSWORD, "deploy_kernel": f"{lab.files.base}/vmlinuz",
            "deploy_ramdisk": f"{lab.files.base}/initrd.img"},
            boot_interface="pxe", deploy_interface="ramdisk", inspect_interface="no-inspect",
            management_interface="ipmitool", power_interface="ipmitool")
        instance_info = {"kernel": f"{lab.files.base}/vmlinuz", "ramdisk": f"{lab.files.base}/initrd.img",
                         "image_source": f"{lab.files.base}/vmlinuz"}
    else:
        ironic.enroll(name, "redfish", {
            "redfish_address": agent.url, "redfish_system_id": f"/redfish/v1/Systems/{name}",
            "redfish_username": USER, "redfish_password": PASSWORD, "redfish_verify_ca": False},
            boot_interface="redfish-virtual-media", deploy_interface="ramdisk", inspect_interface="no-inspect",
            management_interface="redfish", power_interface="redfish")
        instance_info = {"boot_iso": f"{lab.files.base}/guest.iso"}
    ironic.provision(name, "manage")
    ironic.wait_provision(name, "manageable", timeout=120)
    ironic.provision(name, "provide")
    ironic.wait_provision(name, "available", timeout=120)
    ironic.patch(f"/v1/nodes/{name}", [{"op": "add", "path": f"/instance_info/{k}", "value": v}
                                       for k, v in instance_info.items()])
    if driver == "ipmi":
        ironic.post("/v1/ports", {"node_uuid": ironic.node(name)["uuid"], "address": MACS[name],
                                  "pxe_enabled": True})
    ironic.provision(name, "active")
    ironic.wait_provision(name, "active", timeout=300)


@pytest.fixture(scope="module")
def deployed(lab: Lab) -> dict[str, tuple[int, str]]:
    """Both deploys at once, as Ironic's conductor runs them: per node, where its serial line stood before the
    deploy and the error that stopped it ("" when it reached active)."""
    marks = {name: lab.taps[name].mark() for name in MACS}

    def run(name: str, driver: str) -> str:
        try:
            deploy(lab, name, driver)
        except Exception as exc:  # reported by the node's test
            return f"{exc}\n{traceback.format_exc(limit=3)}"
        return ""

    with ThreadPoolExecutor(max_workers=2) as pool:
        errors = dict(zip(MACS, pool.map(run, MACS, ["redfish", "ipmi"]), strict=True))
    return {name: (marks[name], errors[name]) for name in MACS}


def test_ironic_virtual_media_deploy_boots_its_iso_in_the_guest(lab: Lab, deployed: dict[str, tuple[int, str]]) \
        -> None:
    since, error = deployed["cd-node"]
    assert not error, error
    after = lab.taps["cd-node"].expect(BOOTED.format("iso"), since)
    # undeploy: Ironic ejects the ISO and powers the node off
    lab.ironic.client.provision("cd-node", "deleted")
    lab.ironic.client.wait_provision("cd-node", "available", timeout=300)
    assert "booted from network" not in lab.taps["cd-node"].text(after)


def test_ironic_pxe_deploy_through_ipmi_boots_the_guest_from_the_network(
        lab: Lab, deployed: dict[str, tuple[int, str]]) -> None:
    since, error = deployed["net-node"]
    assert not error, error
    # Ironic's default boot mode is UEFI: `chassis bootdev pxe options=efiboot`, so OVMF's network boot
    after = lab.taps["net-node"].expect(BOOTED.format("network"), since)
    lab.taps["net-node"].expect(r"KUBEVBMC-GUEST: firmware uefi", after)
