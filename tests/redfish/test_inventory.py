"""Out-of-band inspection, as Ironic does it through sushy: architecture, cores, memory, every disk's size and every
MAC, read from a VM defined with those values on kubesim; and what the inventory does not know stays absent."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sushy
from kubernetes import client

from vbmc.machine.kubevirt import vmstate
from vbmc.redfish import resources

from ..support.agents import AgentProcess, running_agent, sushy_at
from ..support.cluster import Sim, call, wait_for
from ..support.vms import make_bmc, running_vmi_uid

GI = 2**30


def inspected_vm(api: client.ApiClient, ns: str, architecture: str = "amd64") -> None:
    """A VM with a topology, memory, a 20Gi DataVolume disk, a 5Gi claim, a containerDisk, a cdrom and two NICs."""
    data = {"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume", "metadata": {"name": "data"},
            "spec": {"source": {"blank": {}}, "storage": {"resources": {"requests": {"storage": "5Gi"}}}}}
    assert call(api, "POST", f"/apis/cdi.kubevirt.io/v1beta1/namespaces/{ns}/datavolumes", data).status == 201
    vm = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "vm"}, "spec": {
        "runStrategy": "Halted",
        "dataVolumeTemplates": [{"metadata": {"name": "vm-root"}, "spec": {
            "source": {"blank": {}}, "storage": {"resources": {"requests": {"storage": "20Gi"}}}}}],
        "template": {"spec": {
            "architecture": architecture,
            "domain": {
                "cpu": {"sockets": 2, "cores": 4, "threads": 2},
                "memory": {"guest": "6Gi"},
                "devices": {
                    "disks": [{"name": "root", "disk": {"bus": "virtio"}}, {"name": "data", "disk": {"bus": "sata"}},
                              {"name": "tools", "disk": {"bus": "scsi"}}, {"name": "cdrom", "cdrom": {"bus": "sata"}}],
                    "interfaces": [{"name": "default", "masquerade": {}, "macAddress": "02:00:00:00:10:01"},
                                   {"name": "prov", "bridge": {}, "macAddress": "02:00:00:00:10:02"}]}},
            "networks": [{"name": "default", "pod": {}}, {"name": "prov", "multus": {"networkName": "prov"}}],
            "volumes": [{"name": "root", "dataVolume": {"name": "vm-root"}},
                        {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
                        {"name": "tools", "containerDisk": {"image": "quay.io/containerdisks/tools"}}]}}}}
    reply = call(api, "POST", f"/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachines", vm)
    assert reply.status == 201, reply.body


@pytest.fixture
def agent(sim: Sim, api: client.ApiClient, namespace: str, bmc_crd: None) -> Iterator[AgentProcess]:
    inspected_vm(api, namespace)
    make_bmc(api, namespace)
    with running_agent("--namespace", namespace, "--vm", "vm", "--vmbmc", "vm",
                       env={"KUBECONFIG": sim.kubeconfig}) as process:
        yield process


@pytest.fixture
def system(agent: AgentProcess) -> Iterator[Any]:
    with sushy_at(agent.url) as root:
        yield root.get_system("/redfish/v1/Systems/vm")


def test_ironic_style_inspection_reads_what_the_vm_is(system: Any, api: client.ApiClient, namespace: str) -> None:
    # off: what the VM asks for
    cpus = system.processors.get_members()
    assert len(cpus) == 2  # one Processor per socket
    assert {(c.processor_architecture, c.instruction_set) for c in cpus} == {
        (sushy.ProcessorArchitecture.X86, sushy.InstructionSet.X86_64)}
    assert sum(c.total_cores for c in cpus) == 8 and sum(c.total_threads for c in cpus) == 16
    assert system.memory_summary.size_gib == 6
    assert system.model == "q35" and system.manufacturer == "KubeVirt"
    assert system.ethernet_interfaces.summary.keys() == {"02:00:00:00:10:01", "02:00:00:00:10:02"}
    # off: the bound claims' capacity; the containerDisk's size is stated nowhere: a SimpleStorage device with no
    # size (sushy drops it), and neither a Drive nor a Volume (where Ironic compares sizes)
    def sizes() -> list[int]:
        system.simple_storage.refresh(force=True)
        for member in system.simple_storage.get_members():
            member.refresh(force=True)
        return sorted(system.simple_storage.disks_sizes_bytes)

    wait_for(lambda: sizes() == [5 * GI, 20 * GI], timeout=10, what="the claims to be bound")
    devices = {d.name: d.capacity_bytes for m in system.simple_storage.get_members() for d in m.devices}
    assert devices == {"root": 20 * GI, "data": 5 * GI, "tools": None}  # a cdrom is not a disk
    storage = system.storage.get_members()[0]
    by_name = {d.identity: d for d in storage.drives}
    assert set(by_name) == {"root", "data"}
    assert (by_name["root"].protocol, by_name["data"].protocol) == (sushy.Protocol.PCIe, sushy.Protocol.SATA)
    assert storage.volumes.volumes_sizes_bytes == [5 * GI, 20 * GI]  # what Ironic's local_gb compares
    assert storage.controllers.get_members()[0].identity == resources.CONTROLLER_ID

    # running: the same sizes, from the claims (and the VMI's view of them)
    system.reset_system(sushy.ResetType.ON)
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=15, what="the VM to run")
    assert sizes() == [5 * GI, 20 * GI]
    volumes = {v.identity: v.capacity_bytes for v in storage.volumes.get_members()}
    assert volumes == {"root": 20 * GI, "data": 5 * GI}


@pytest.mark.parametrize(("arch", "expected"), [("amd64", ("x86", "x86-64", "q35")),
                                                ("arm64", ("ARM", "ARM-A64", "virt")),
                                                ("s390x", ("OEM", "OEM", "s390-ccw-virtio"))])
def test_architecture_and_model_come_from_the_vm(arch: str, expected: tuple[str, str, str]) -> None:
    vm = {"metadata": {"name": "vm"}, "spec": {"template": {"spec": {"architecture": arch, "domain": {}}}}}
    inv = vmstate.inventory(vm, None)
    ids = resources.Ids("vm", "BMC", "vm")
    cpu = resources.processor(ids, inv, 0)
    assert (cpu["ProcessorArchitecture"], cpu["InstructionSet"], inv.model) == expected


def test_an_instancetype_is_the_model_and_unknown_sizes_stay_absent() -> None:
    vm = {"metadata": {"name": "vm"}, "spec": {"instancetype": {"name": "u1.large"}, "template": {"spec": {
        "domain": {"devices": {"disks": [{"name": "a", "disk": {}}, {"name": "b", "disk": {}}]}},
        "volumes": [{"name": "a", "containerDisk": {"image": "x"}}, {"name": "b", "emptyDisk": {"capacity": "2Gi"}}]}}}}
    inv = vmstate.inventory(vm, None)
    assert inv.model == "u1.large"
    assert [(d.name, d.size_bytes) for d in inv.disks] == [("a", None), ("b", 2 * GI)]


def test_ironics_raid_interface_creates_and_deletes_single_drive_raid0_volumes(
        agent: AgentProcess, api: client.ApiClient, namespace: str) -> None:
    volumes = "/redfish/v1/Systems/vm/Storage/1/Volumes"
    collection = agent.redfish("GET", volumes)[1]
    assert collection["@Redfish.OperationApplyTimeSupport"] == {"SupportedValues": ["OnReset"]}
    before = call(api, "GET", f"/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachines/vm").body
    for bad in ({"CapacityBytes": 0}, {"CapacityBytes": GI, "RAIDType": "RAID1"}, {"RAIDType": "RAID0"},
                {"CapacityBytes": GI, "RAIDType": "None"},
                {"CapacityBytes": GI, "RAIDType": "RAID0", "Links": {"Drives": [
                    {"@odata.id": "/redfish/v1/Chassis/vm/Drives/root"},
                    {"@odata.id": "/redfish/v1/Chassis/vm/Drives/data"}]}},
                {"CapacityBytes": GI, "Links": {"Drives": [{"@odata.id": "/redfish/v1/Chassis/vm/Drives/nope"}]}},
                {"CapacityBytes": GI, "@Redfish.OperationApplyTime": "Immediate"}):
        assert agent.redfish("POST", volumes, bad)[0] == 400, bad
    status, refused = agent.redfish("POST", volumes, {"CapacityBytes": GI, "RAIDType": "RAID5"})
    assert "RAID5" in refused["error"]["message"] and "RAID0" in refused["error"]["message"]
    after = call(api, "GET", f"/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachines/vm").body
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]  # nothing changed
    controller = agent.redfish("GET", "/redfish/v1/Systems/vm/Storage/1/Controllers/1")[1]
    assert controller["SupportedRAIDTypes"] == ["RAID0"]

    # what Ironic's RAID interface posts (raid.py, _construct_volume_payload), on a drive it chose
    status, created = agent.redfish("POST", volumes, {
        "CapacityBytes": 10 * GI, "RAIDType": "RAID0", "Name": "data-volume",
        "Links": {"Drives": [{"@odata.id": "/redfish/v1/Chassis/vm/Drives/root"}]},
        "@Redfish.OperationApplyTime": "OnReset"})
    assert status == 201 and created["Id"] == "disk1" and created["CapacityBytes"] == 10 * GI
    assert created["RAIDType"] == "RAID0"
    vm = call(api, "GET", f"/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachines/vm").body
    template = next(t for t in vm["spec"]["dataVolumeTemplates"] if t["metadata"]["name"] == "vm-disk1")
    assert template["spec"]["storage"]["resources"]["requests"]["storage"] == "10Gi"
    assert {"name": "disk1", "disk": {"bus": "virtio"}} in vm["spec"]["template"]["spec"]["domain"]["devices"]["disks"]
    assert {"name": "disk1", "dataVolume": {"name": "vm-disk1"}} in vm["spec"]["template"]["spec"]["volumes"]
    members = {m["@odata.id"] for m in agent.redfish("GET", volumes)[1]["Members"]}
    assert f"{volumes}/disk1" in members
    root = agent.redfish("GET", f"{volumes}/root")[1]
    assert "RAIDType" not in root  # the VM's own disk: not a volume this controller made

    # delete_configuration deletes the volumes with a RAIDType: only the one it made
    assert agent.redfish("DELETE", f"{volumes}/root")[0] == 400
    assert agent.redfish("DELETE", f"{volumes}/disk1", {"@Redfish.OperationApplyTime": "OnReset"})[0] == 204
    vm = call(api, "GET", f"/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachines/vm").body
    assert all(t["metadata"]["name"] != "vm-disk1" for t in vm["spec"].get("dataVolumeTemplates", []))
    assert all(v["name"] != "disk1" for v in vm["spec"]["template"]["spec"]["volumes"])
    wait_for(lambda: call(api, "GET", f"/apis/cdi.kubevirt.io/v1beta1/namespaces/{namespace}/datavolumes/vm-disk1"
                          ).status == 404, timeout=5, what="the disk's DataVolume to go")
