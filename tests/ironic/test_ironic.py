"""OpenStack Ironic, a real consumer, drives agents on kubesim through whole workflows, as Metal3 runs it: enroll,
manage, inspect (the values checked against each VM's spec), provide, deploy (virtual media with the `ramdisk`
deploy interface, secure boot, RAID), reboot, power off and on, undeploy; with the `redfish` and `ipmi` hardware
types, imports that take as long as real ones (40 s), VMs of the shapes users have, and a mistyped image URL.
A node undeployed and deployed again ejects its ISO and inserts it again: imported once. (Not `rebuild`, which
Ironic 39.0.0 answers with a 500 whatever the BMC: `auto_lessee` unbound for a rebuild in
ironic/conductor/deployments.py.)

One Ironic process and one kubesim serve the module; every node's workflow runs at once on its own thread
(`workflows`), recording what it saw; the tests then assert on those records, one concern each."""

from __future__ import annotations

import contextlib
import http.server
import threading
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from ..support.agents import PASSWORD, USER, AgentProcess, running_agent
from ..support.cluster import Sim, call, install_bmc_crd, start_sim, wait_for
from ..support.images import ImageServer
from ..support.ironic import IronicError, IronicProcess
from ..support.vms import boot_orders, get_vm, get_vmi, make_bmc

# The first test waits for every workflow (the module fixture): minutes, more than the suite's 300 s per test.
pytestmark = pytest.mark.timeout(900)

GI = 2**30
NS = "metal"
# Seconds an ISO or disk image import takes, longer than Ironic waits for a node to reach the power state it asked
# for: a BMC that reported the VM off until it ran (until its ISO was in) would fail the deploy, whatever the load.
IMPORT_DELAY = "40"
POWER_TIMEOUT = 30
Obj = dict[str, Any]


# ---- the VMs: the shapes users have


def vm_manifest(name: str, *, disks: list[tuple[str, Obj]], nics: int, memory_gi: int, cpu: tuple[int, int, int],
                efi: Obj | None = None, templates: list[Obj] | None = None) -> Obj:
    """A Halted VM with `disks` (name, volume source) on virtio, a sata cdrom, `nics` bridged interfaces with fixed
    MACs (KubeVirt gives an interface without one a new MAC at every start: Ironic's ports need fixed ones)."""
    sockets, cores, threads = cpu
    domain: Obj = {
        "cpu": {"sockets": sockets, "cores": cores, "threads": threads},
        "memory": {"guest": f"{memory_gi}Gi"},
        "devices": {
            "disks": [{"name": d, "disk": {"bus": "virtio"}} for d, _ in disks] + [
                {"name": "cdrom", "cdrom": {"bus": "sata"}}],
            "interfaces": [{"name": f"nic{i}", "bridge": {}, "macAddress": mac(name, i)} for i in range(nics)]}}
    if efi is not None:
        domain["firmware"] = {"bootloader": {"efi": efi}}
        domain["features"] = {"smm": {"enabled": True}}
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": name}, "spec": {
        "runStrategy": "Halted", "dataVolumeTemplates": templates or [],
        "template": {"spec": {
            "domain": domain,
            "networks": [{"name": f"nic{i}", "multus": {"networkName": "provisioning"}} for i in range(nics)],
            "volumes": [{"name": d, **source} for d, source in disks]}}}}


def mac(vm: str, index: int) -> str:
    return f"02:00:{sum(vm.encode()) % 256:02x}:00:00:{index + 1:02x}"


def disk_template(name: str, size: str, url: str) -> Obj:
    return {"metadata": {"name": name}, "spec": {"source": {"http": {"url": url}},
                                                 "storage": {"resources": {"requests": {"storage": size}}}}}


def claim(name: str, size: str) -> Obj:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}}


@dataclass
class Shape:
    """One VM, how Ironic drives it, and what its inspection must find (local_gb: Ironic's rule, the smallest
    disk of at least 4 GiB, less one GiB; 0 when none has a size)."""

    name: str
    manifest: Obj
    driver: str = "redfish"
    local_gb: int = 0
    claims: list[Obj] = field(default_factory=list)
    secure_boot: bool = False
    raid: bool = False
    bios: bool = False  # Ironic's redfish bios interface: list, apply through manual cleaning, factory reset
    boot_interface: str = "redfish-virtual-media"  # redfish-https: UEFI HTTP boot (Metal3's redfish-uefihttp://)
    identify: bool = False  # Ironic's indicator API lights and reads identify
    redeploy: bool = False  # undeployed (the ISO ejected) and deployed again with the same ISO: imported once
    boot_iso: str = "boot.iso"

    @property
    def spec(self) -> Obj:
        return dict(self.manifest["spec"]["template"]["spec"])

    @property
    def memory_mb(self) -> int:
        return int(self.spec["domain"]["memory"]["guest"].removesuffix("Gi")) * 1024

    @property
    def cpus(self) -> int:
        cpu = self.spec["domain"]["cpu"]
        return int(cpu["sockets"] * cpu["cores"] * cpu["threads"])

    @property
    def macs(self) -> set[str]:
        return {i["macAddress"] for i in self.spec["domain"]["devices"]["interfaces"]}


def shapes(images: str) -> list[Shape]:
    container = {"containerDisk": {"image": "quay.io/containerdisks/fedora:latest"}}
    return [
        # A containerDisk only: no disk size is stated anywhere, so Ironic sees a disk-less node.
        Shape("containerdisk", vm_manifest("containerdisk", disks=[("root", container)], nics=1, memory_gi=2,
                                           cpu=(1, 2, 1)), local_gb=0, bios=True),
        # A root disk from a dataVolumeTemplates entry, imported (IMPORT_DELAY) before the VM can start.
        Shape("dvtemplate", vm_manifest(
            "dvtemplate", disks=[("root", {"dataVolume": {"name": "dvtemplate-root"}})], nics=1, memory_gi=4,
            cpu=(2, 2, 1), templates=[disk_template("dvtemplate-root", "20Gi", f"{images}/disk.img")]),
            local_gb=19),
        # A plain claim, an emptyDisk too small to count (< 4 GiB), a containerDisk, two NICs.
        Shape("plainclaim", vm_manifest(
            "plainclaim", disks=[("root", container), ("data", {"persistentVolumeClaim": {"claimName": "pc-data"}}),
                                 ("scratch", {"emptyDisk": {"capacity": "2Gi"}})],
            nics=2, memory_gi=2, cpu=(1, 1, 2)), claims=[claim("pc-data", "8Gi")], local_gb=7, identify=True,
            redeploy=True),
        # Several disks and NICs, UEFI with secure boot, and Ironic's redfish RAID interface.
        Shape("many", vm_manifest(
            "many", disks=[("root", {"dataVolume": {"name": "many-root"}}),
                           ("data", {"persistentVolumeClaim": {"claimName": "many-data"}}), ("tools", container)],
            nics=3, memory_gi=8, cpu=(2, 4, 2), efi={"secureBoot": True},
            templates=[disk_template("many-root", "30Gi", f"{images}/disk.img")]),
            claims=[claim("many-data", "6Gi")], local_gb=5, secure_boot=True, raid=True),
        # A mistyped boot ISO: the deploy must fail, saying why.
        Shape("mistyped", vm_manifest("mistyped", disks=[("root", container)], nics=1, memory_gi=1,
                                      cpu=(1, 1, 1)), boot_iso="missing-bot.iso"),
        # UEFI HTTP boot (Ironic's redfish-https boot interface): the boot ISO is imported into the cdrom and booted.
        Shape("httpboot", vm_manifest("httpboot", disks=[("root", container)], nics=1, memory_gi=1, cpu=(1, 1, 1),
                                      efi={"secureBoot": False}), boot_interface="redfish-https"),
        # IPMI: power and boot device (PXE, the ramdisk deploy's kernel and ramdisk).
        Shape("ipmi", vm_manifest("ipmi", disks=[("root", container)], nics=1, memory_gi=1, cpu=(1, 1, 1)),
              driver="ipmi"),
    ]


# ---- the environment: kubesim with slow imports, images, one Ironic, an agent per VM


class Files:
    """A loopback HTTP server of real (small) files: the kernel and ramdisk Ironic's PXE boot downloads, and
    Ironic's http_root."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        handler = partial(_QuietHandler, directory=str(root))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.root = root
        self.port = self.server.server_address[1]
        self.base = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


@dataclass
class Lab:
    sim: Sim
    api: client.ApiClient
    ironic: IronicProcess
    images: ImageServer
    files: Files
    agents: dict[str, AgentProcess]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    workdir = tmp_path_factory.mktemp("ironic-lab")
    images = ImageServer(GI)
    files = Files(workdir / "ironic" / "httpboot")
    for name in ("kernel", "ramdisk"):
        (files.root / name).write_bytes(b"\0" * 4096)
    with contextlib.ExitStack() as stack:
        stack.callback(images.close)
        stack.callback(files.close)
        sim = start_sim(workdir / "sim", "--import-delay", IMPORT_DELAY, "--vm-start-delay", "1")
        stack.callback(sim.stop)
        api = sim.api()
        install_bmc_crd(api)
        client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NS)))
        agents: dict[str, AgentProcess] = {}
        for shape in shapes(images.base):
            for c in shape.claims:
                client.CoreV1Api(api).create_namespaced_persistent_volume_claim(NS, c)
            reply = call(api, "POST", f"/apis/kubevirt.io/v1/namespaces/{NS}/virtualmachines", shape.manifest)
            assert reply.status == 201, reply.body
            make_bmc(api, NS, shape.name)
            # An ejected ISO is kept for a deploy of the same one (120 s by default): longer here, so that how long
            # the undeploy and the next deploy take on a loaded machine does not decide what the test sees.
            agent = stack.enter_context(running_agent("--namespace", NS, "--vm", shape.name, "--vmbmc", shape.name,
                                                      "--keep-ejected-media", "900",
                                                      env={"KUBECONFIG": sim.kubeconfig}))
            agents[shape.name] = agent
        # Started last, so stopped first: an Ironic that outlived the agents would retry its Redfish calls against
        # closed ports until its graceful shutdown timed out.
        ironic = IronicProcess(workdir / "ironic", files.port, power_state_change_timeout=POWER_TIMEOUT)
        stack.callback(ironic.stop)
        yield Lab(sim, api, ironic, images, files, agents)


# ---- one node's whole workflow


@dataclass
class Record:
    """What one node's workflow saw, step by step; `failed` holds the first error and where."""

    steps: dict[str, Any] = field(default_factory=dict)
    failed: str = ""
    took: float = 0.0

    def step(self, name: str) -> Any:
        if name not in self.steps:
            pytest.fail(f"the workflow stopped before '{name}': {self.failed}")
        return self.steps[name]


def enroll(lab: Lab, shape: Shape) -> None:
    agent = lab.agents[shape.name]
    ironic = lab.ironic.client
    if shape.driver == "ipmi":
        ironic.enroll(shape.name, "ipmi", {
            "ipmi_address": "127.0.0.1", "ipmi_port": agent.ipmi_port, "ipmi_username": USER,
            "ipmi_password": PASSWORD, "deploy_kernel": f"{lab.files.base}/kernel",
            "deploy_ramdisk": f"{lab.files.base}/ramdisk"},
            boot_interface="pxe", deploy_interface="ramdisk", inspect_interface="no-inspect",
            management_interface="ipmitool", power_interface="ipmitool")
        return
    ironic.enroll(shape.name, "redfish", {
        "redfish_address": agent.url, "redfish_system_id": f"/redfish/v1/Systems/{shape.name}",
        "redfish_username": USER, "redfish_password": PASSWORD, "redfish_verify_ca": False},
        boot_interface=shape.boot_interface, deploy_interface="ramdisk", inspect_interface="redfish",
        management_interface="redfish", power_interface="redfish",
        raid_interface="redfish" if shape.raid else "no-raid", bios_interface="redfish" if shape.bios else "no-bios")


def vmi_uid(lab: Lab, name: str) -> str:
    vmi = get_vmi(lab.api, NS, name)
    running = vmi is not None and vmi.get("status", {}).get("phase") == "Running"
    return str(vmi["metadata"]["uid"]) if running and vmi else ""


def bios_settings(lab: Lab, name: str) -> dict[str, Obj]:
    """`baremetal node bios setting list --long`: what Ironic cached from the Bios and its attribute registry."""
    return {s["name"]: s for s in lab.ironic.client.get(f"/v1/nodes/{name}/bios?detail=True")["bios"]}


def bios_workflow(lab: Lab, shape: Shape, record: Record) -> None:
    """The settings Ironic cached at manage; then one manual cleaning without the ramdisk that applies a setting
    (Ironic patches Bios/Settings, reboots, polls BootProgress and the attributes) and factory-resets them the same
    way: the VM is watched in between for the setting (one cleaning: a second would cost its start and end again)."""
    ironic, name = lab.ironic.client, shape.name
    listed = bios_settings(lab, name)
    ironic.provision(name, "clean", disable_ramdisk=True, clean_steps=[
        {"interface": "bios", "step": "apply_configuration",
         "args": {"settings": [{"name": "SerialConsoleRedirection", "value": "Enabled"}]}},
        {"interface": "bios", "step": "factory_reset"}])

    def serial_redirected() -> Obj | None:
        vm = get_vm(lab.api, NS, name)
        loader = (vm["spec"]["template"]["spec"]["domain"].get("firmware") or {}).get("bootloader") or {}
        return vm if (loader.get("bios") or {}).get("useSerial") is True else None

    applied = wait_for(serial_redirected, timeout=180, interval=0.5, what=f"{name}'s VM to get bios.useSerial")
    ironic.wait_provision(name, "manageable", timeout=240)
    record.steps["bios"] = {"listed": listed, "applied": {"vm": applied},
                            "reset": {"vm": get_vm(lab.api, NS, name), "settings": bios_settings(lab, name)}}


def identify_workflow(lab: Lab, shape: Shape, record: Record) -> None:
    """`baremetal node indicator list/set/get`: the System's and the Chassis' identify, lit then read, and where it
    is kept (an annotation on the VM, so that it outlives the agent); then turned off."""
    ironic, name = lab.ironic.client, shape.name
    base = f"/v1/nodes/{name}/management/indicators"
    listed = {i["component"]: i for i in ironic.get(base)["indicators"]}
    system = listed["system"]["name"]
    ironic.put(f"{base}/{system}", {"state": "on"})  # ironic.common.indicator_states
    record.steps["identify"] = {"listed": listed, "system": ironic.get(f"{base}/{system}")["state"],
                                "chassis": ironic.get(f"{base}/{listed['chassis']['name']}")["state"],
                                "vm": get_vm(lab.api, NS, name)}
    ironic.put(f"{base}/{system}", {"state": "off"})
    record.steps["identify"]["off"] = ironic.get(f"{base}/{system}")["state"]


def medium(lab: Lab, name: str) -> Obj:
    return call(lab.api, "GET", f"/apis/cdi.kubevirt.io/v1beta1/namespaces/{NS}/datavolumes/{name}-cdrom").body


def workflow(lab: Lab, shape: Shape, record: Record) -> None:
    ironic, name = lab.ironic.client, shape.name
    enroll(lab, shape)
    ironic.provision(name, "manage")
    record.steps["manage"] = ironic.wait_provision(name, "manageable", timeout=120)
    if shape.driver == "redfish":
        ironic.provision(name, "inspect")
        node = ironic.wait_provision(name, "manageable", timeout=180)
        record.steps["inspect"] = {"properties": node["properties"],
                                   "inventory": ironic.get(f"/v1/nodes/{name}/inventory")["inventory"],
                                   "ports": {p["address"] for p in ironic.get(f"/v1/ports?node={name}")["ports"]}}
    if shape.bios:
        bios_workflow(lab, shape, record)
    ironic.provision(name, "provide")
    ironic.wait_provision(name, "available", timeout=120)

    # deploy: the ramdisk boots from the ISO (redfish: virtual media) or the kernel and ramdisk (ipmi: PXE)
    if shape.driver == "ipmi":
        instance_info = {"kernel": f"{lab.files.base}/kernel", "ramdisk": f"{lab.files.base}/ramdisk",
                         "image_source": f"{lab.files.base}/kernel"}
    else:
        instance_info = {"boot_iso": f"{lab.images.base}/{shape.boot_iso}"}
    ops = [{"op": "add", "path": f"/instance_info/{k}", "value": v} for k, v in instance_info.items()]
    if shape.secure_boot:
        ops.append({"op": "add", "path": "/instance_info/capabilities", "value": {"secure_boot": "true",
                                                                                  "boot_mode": "uefi"}})
        ops.append({"op": "add", "path": "/properties/capabilities", "value": "secure_boot:true,boot_mode:uefi"})
    ironic.patch(f"/v1/nodes/{name}", ops)
    if shape.driver == "ipmi":
        # Not inspected (that needs a ramdisk in the guest): its port is enrolled, as an operator would.
        node_uuid = ironic.node(name)["uuid"]
        ironic.post("/v1/ports", {"node_uuid": node_uuid, "address": sorted(shape.macs)[0], "pxe_enabled": True})
    deploy_steps: list[Obj] = []
    if shape.raid:
        # Metal3's hardwareRAIDVolumes: the RAID interface's apply_configuration as a deploy step.
        # Priority above the deploy step's (100): the volume exists before the deploy boots the VM.
        deploy_steps.append({"interface": "raid", "step": "apply_configuration", "priority": 150, "args": {
            "raid_config": {"logical_disks": [{"size_gb": 10, "raid_level": "0", "is_root_volume": False}]},
            "create_nonroot_volumes": True, "delete_existing": True}})
    ironic.provision(name, "active", **({"deploy_steps": deploy_steps} if deploy_steps else {}))
    if shape.boot_iso.startswith("missing"):
        node = ironic.wait_provision(name, "deploy failed", timeout=180)
        # Ironic powers a node off after a failed deploy, and a power action clears last_error: the reason stays in
        # the node's history (API 1.78).
        history = [e["event"] for e in ironic.get(f"/v1/nodes/{name}/history?detail=true")["history"]]
        record.steps["deploy"] = {"node": node, "history": history}
        return
    node = ironic.wait_provision(name, "active", timeout=240)
    record.steps["deploy"] = {"node": node}
    if shape.raid:
        record.steps["raid"] = {"raid_config": node["raid_config"], "vm": get_vm(lab.api, NS, name)}
    uid = wait_for(lambda: vmi_uid(lab, name), timeout=120, interval=0.5, what=f"{name} to run")
    record.steps["running"] = {"vmi": get_vmi(lab.api, NS, name), "vm": get_vm(lab.api, NS, name)}
    if shape.driver == "redfish":
        record.steps["running"]["medium"] = medium(lab, name)

    ironic.power(name, "rebooting")
    ironic.wait_power(name, "power on", timeout=120)
    rebooted = wait_for(lambda: (u := vmi_uid(lab, name)) != uid and u, timeout=120, interval=0.5,
                        what=f"{name} to reboot")
    record.steps["reboot"] = {"before": uid, "after": rebooted}

    ironic.power(name, "power off")
    ironic.wait_power(name, "power off", timeout=120)
    record.steps["power off"] = {"vmi": get_vmi(lab.api, NS, name)}
    ironic.power(name, "power on")
    ironic.wait_power(name, "power on", timeout=120)
    record.steps["power on"] = {"uid": wait_for(lambda: vmi_uid(lab, name), timeout=120, interval=0.5,
                                                what=f"{name} to run again")}
    ironic.provision(name, "deleted")
    node = ironic.wait_provision(name, "available", timeout=240)
    record.steps["undeploy"] = {"node": node, "vm": get_vm(lab.api, NS, name)}
    if shape.redeploy:
        # The undeploy wiped instance_info: the same ISO is given again, as a user deploying the node again would.
        ironic.patch(f"/v1/nodes/{name}", [{"op": "add", "path": f"/instance_info/{k}", "value": v}
                                           for k, v in instance_info.items()])
        ironic.provision(name, "active")
        ironic.wait_provision(name, "active", timeout=240)
        wait_for(lambda: vmi_uid(lab, name), timeout=120, interval=0.5, what=f"{name} to run after its redeploy")
        record.steps["redeploy"] = {"medium": medium(lab, name), "vmi": get_vmi(lab.api, NS, name)}
        ironic.provision(name, "deleted")
        ironic.wait_provision(name, "available", timeout=240)
    if shape.identify:
        identify_workflow(lab, shape, record)


@pytest.fixture(scope="module")
def workflows(lab: Lab) -> dict[str, Record]:
    """Every node's whole workflow, all at once (each on its own thread), as Ironic's conductor runs them."""
    records = {s.name: Record() for s in shapes(lab.images.base)}

    def run(shape: Shape) -> None:
        record = records[shape.name]
        began = time.monotonic()
        try:
            workflow(lab, shape, record)
        except Exception as exc:  # recorded: each test reports the step it needs
            uuid = ""
            with contextlib.suppress(IronicError):
                uuid = lab.ironic.client.node(shape.name)["uuid"]
            record.failed = (f"{exc}\n{traceback.format_exc(limit=3)}\nIronic's warnings and errors:\n"
                             f"{lab.ironic.log_tail(15, uuid) if uuid else ''}")
        record.took = time.monotonic() - began

    with ThreadPoolExecutor(max_workers=len(records)) as pool:
        list(pool.map(run, shapes(lab.images.base)))
    return records


def by_name(lab: Lab) -> dict[str, Shape]:
    return {s.name: s for s in shapes(lab.images.base)}


INSPECTED = ["containerdisk", "dvtemplate", "plainclaim", "many"]


# ---- inspection


@pytest.mark.parametrize("name", INSPECTED)
def test_redfish_inspection_finds_what_the_vm_is(lab: Lab, workflows: dict[str, Record], name: str) -> None:
    shape = by_name(lab)[name]
    inspected = workflows[name].step("inspect")
    properties, inventory = inspected["properties"], inspected["inventory"]
    assert properties["memory_mb"] == shape.memory_mb
    assert properties["cpu_arch"] == "x86_64"
    assert inventory["cpu"]["count"] == shape.cpus  # sockets x cores x threads: the Processors' TotalThreads
    assert properties["local_gb"] == shape.local_gb
    assert {i["mac_address"] for i in inventory["interfaces"]} == shape.macs
    assert inspected["ports"] == shape.macs  # one Ironic port per NIC


# ---- deploy, power, undeploy


@pytest.mark.parametrize("name", ["containerdisk", "dvtemplate", "plainclaim", "many", "ipmi"])
def test_ironic_deploys_and_the_vm_runs_from_its_boot_device(lab: Lab, workflows: dict[str, Record],
                                                            name: str) -> None:
    shape = by_name(lab)[name]
    running = workflows[name].step("running")
    orders = boot_orders(running["vm"])
    volumes = {v["name"]: v for v in running["vmi"]["spec"]["volumes"]}
    if shape.driver == "redfish":
        # booted from the ISO, in the domain from its first instruction (not hotplugged after it)
        assert volumes["cdrom"]["dataVolume"] == {"name": f"{name}-cdrom"}
        assert orders["cdrom"] == 1
        # Ironic was told "on" at once: the deploy reached active though the ISO took longer to import than Ironic
        # waits for a power state (POWER_TIMEOUT < IMPORT_DELAY)
        assert workflows[name].step("deploy")["node"]["provision_state"] == "active"
    else:
        assert min((o for o in orders.values() if o), default=None) == orders["nic0"]  # PXE first


@pytest.mark.parametrize("name", ["containerdisk", "dvtemplate", "plainclaim", "many", "httpboot", "ipmi"])
def test_reboot_and_power_off_and_on_reach_the_vm(workflows: dict[str, Record], name: str) -> None:
    record = workflows[name]
    reboot = record.step("reboot")
    assert reboot["after"] and reboot["after"] != reboot["before"]
    vmi = record.step("power off")["vmi"]
    assert vmi is None or vmi.get("status", {}).get("phase") in ("Succeeded", "Failed")
    assert record.step("power on")["uid"] not in (reboot["before"], reboot["after"])


@pytest.mark.parametrize("name", ["containerdisk", "dvtemplate", "plainclaim", "many"])
def test_undeploy_ejects_the_iso_and_leaves_the_node_available(workflows: dict[str, Record], name: str) -> None:
    undeployed = workflows[name].step("undeploy")
    assert undeployed["node"]["provision_state"] == "available"
    volumes = undeployed["vm"]["spec"]["template"]["spec"]["volumes"]
    assert all(v["name"] != "cdrom" for v in volumes), volumes


def test_secure_boot_is_enabled_for_the_deploy(workflows: dict[str, Record]) -> None:
    firmware = workflows["many"].step("running")["vmi"]["spec"]["domain"]["firmware"]
    assert firmware["bootloader"]["efi"].get("secureBoot", True) is True


def test_the_raid_interface_creates_a_single_drive_raid0_volume(workflows: dict[str, Record]) -> None:
    raid = workflows["many"].step("raid")
    (logical,) = raid["raid_config"]["logical_disks"]
    assert logical["raid_level"] == "0" and logical["size_gb"] == 10
    templates = {t["metadata"]["name"]: t for t in raid["vm"]["spec"]["dataVolumeTemplates"]}
    created = [t for n, t in templates.items() if n.startswith("many-disk")]
    assert [t["spec"]["storage"]["resources"]["requests"]["storage"] for t in created] == ["10Gi"]


def test_bios_settings_are_listed_applied_by_cleaning_and_factory_reset(workflows: dict[str, Record]) -> None:
    bios = workflows["containerdisk"].step("bios")
    listed = bios["listed"]
    assert listed["BootMode"]["value"] == "Bios" and listed["BootMode"]["allowable_values"] == ["Uefi", "Bios"]
    assert listed["MachineType"]["read_only"] is True and listed["SerialConsoleRedirection"]["read_only"] is False
    assert listed["SerialConsoleRedirection"]["value"] == "Disabled"

    firmware = bios["applied"]["vm"]["spec"]["template"]["spec"]["domain"]["firmware"]
    assert firmware["bootloader"] == {"bios": {"useSerial": True}}  # SeaBIOS writes to the serial port

    firmware = bios["reset"]["vm"]["spec"]["template"]["spec"]["domain"]["firmware"]
    assert firmware["bootloader"] == {"bios": {}}
    assert bios["reset"]["settings"]["SerialConsoleRedirection"]["value"] == "Disabled"


def test_a_node_with_redfish_https_deploys_and_the_vm_runs_from_the_http_boot_image(
        lab: Lab, workflows: dict[str, Record]) -> None:
    running = workflows["httpboot"].step("running")
    assert workflows["httpboot"].step("deploy")["node"]["provision_state"] == "active"
    # the image at HttpBootUri (Ironic's boot ISO) imported into the cdrom, in the domain from its first instruction
    assert running["medium"]["spec"]["source"]["http"]["url"] == f"{lab.images.base}/boot.iso"
    assert running["medium"]["metadata"]["annotations"]["bmc.kubevirt.io/http-boot"] == "true"
    volumes = {v["name"]: v for v in running["vmi"]["spec"]["volumes"]}
    assert volumes["cdrom"]["dataVolume"] == {"name": "httpboot-cdrom"}
    assert boot_orders(running["vm"])["cdrom"] == 1
    assert "efi" in running["vmi"]["spec"]["domain"]["firmware"]["bootloader"]


@pytest.mark.parametrize("name", INSPECTED)
def test_redfish_inspection_records_the_vms_pcie_devices(lab: Lab, workflows: dict[str, Record], name: str) -> None:
    shape = by_name(lab)[name]
    devices = workflows[name].step("inspect")["inventory"]["pci_devices"]
    nics = [d for d in devices if d["class"] == "NetworkController"]
    assert len(nics) == len(shape.macs)
    assert all((d["vendor_id"], d["product_id"]) == ("0x1af4", "0x1041") for d in nics)  # virtio-net
    storage = [d for d in devices if d["class"] == "MassStorageController"]
    virtio_disks = len(shape.spec["domain"]["devices"]["disks"]) - 1  # all but the sata cdrom
    assert len(storage) == virtio_disks + 1  # a virtio-blk device each, and the AHCI controller of the cdrom
    assert {"vendor_id": "0x8086", "product_id": "0x2922", "class": "MassStorageController"} in storage


def test_the_indicator_api_lights_and_reads_identify(workflows: dict[str, Record]) -> None:
    identify = workflows["plainclaim"].step("identify")
    assert set(identify["listed"]) == {"system", "chassis"}
    assert (identify["system"], identify["chassis"]) == ("on", "on")  # one indicator, seen from both
    assert identify["vm"]["metadata"]["annotations"]["bmc.kubevirt.io/identify"] == "on"  # kept in the cluster
    assert identify["off"] == "off"


def test_a_node_deployed_again_with_its_iso_imports_it_once(workflows: dict[str, Record]) -> None:
    record = workflows["plainclaim"]
    before, after = record.step("running")["medium"], record.step("redeploy")["medium"]
    assert after["metadata"]["uid"] == before["metadata"]["uid"]  # the same DataVolume: no second import
    volumes = {v["name"]: v for v in record.step("redeploy")["vmi"]["spec"]["volumes"]}
    assert volumes["cdrom"]["dataVolume"] == {"name": "plainclaim-cdrom"}


def test_a_mistyped_image_url_fails_the_deploy_with_the_reason(lab: Lab, workflows: dict[str, Record]) -> None:
    failed = workflows["mistyped"].step("deploy")
    assert failed["node"]["provision_state"] == "deploy failed"
    reasons = [e for e in failed["history"] if "missing-bot.iso" in e]
    assert reasons and "answered 404" in reasons[-1], failed["history"]
    assert get_vmi(lab.api, NS, "mistyped") is None  # nothing booted without the medium


def test_every_workflow_ran_to_its_end(workflows: dict[str, Record]) -> None:
    failed = {n: r.failed.splitlines()[0] for n, r in workflows.items() if r.failed}
    assert not failed, failed

