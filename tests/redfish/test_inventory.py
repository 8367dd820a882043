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
    # the DataVolume template's request; the claim is known once a VMI has bound it; the containerDisk never
    assert system.simple_storage.disks_sizes_bytes == [20 * GI]
    storage = system.storage.get_members()[0]
    by_name = {d.identity: d for d in storage.drives}
    assert set(by_name) == {"root", "data", "tools"}  # a cdrom is not a drive
    assert by_name["root"].capacity_bytes == 20 * GI and by_name["tools"].capacity_bytes is None
    assert (by_name["root"].protocol, by_name["data"].protocol) == (sushy.Protocol.PCIe, sushy.Protocol.SATA)

    # running: the bound claims' capacity, as the VMI reports it
    system.reset_system(sushy.ResetType.ON)
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=15, what="the VM to run")

    def sizes() -> list[int]:
        system.simple_storage.refresh(force=True)
        for member in system.simple_storage.get_members():
            member.refresh(force=True)
        return sorted(system.simple_storage.disks_sizes_bytes)

    wait_for(lambda: sizes() == [5 * GI, 20 * GI], timeout=10, what="the claim's capacity")
    assert storage.controllers.get_members()[0].identity == resources.CONTROLLER_ID
    volumes = {v.identity: v.capacity_bytes for v in storage.volumes.get_members()}
    assert volumes == {"root": 20 * GI, "data": 5 * GI, "tools": None}


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


def test_ironics_raid_interface_creates_a_volume_as_a_blank_disk_for_the_next_boot(
        agent: AgentProcess, api: client.ApiClient, namespace: str) -> None:
    volumes = "/redfish/v1/Systems/vm/Storage/1/Volumes"
    collection = agent.redfish("GET", volumes)[1]
    assert collection["@Redfish.OperationApplyTimeSupport"] == {"SupportedValues": ["OnReset"]}
    before = call(api, "GET", f"/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachines/vm").body
    for bad in ({"CapacityBytes": 0}, {"CapacityBytes": GI, "RAIDType": "RAID1"}, {"RAIDType": "None"}):
        assert agent.redfish("POST", volumes, bad)[0] == 400, bad
    after = call(api, "GET", f"/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachines/vm").body
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]  # nothing changed

    status, created = agent.redfish("POST", volumes, {"CapacityBytes": 10 * GI, "RAIDType": "None"})
    assert status == 201 and created["Id"] == "disk1" and created["CapacityBytes"] == 10 * GI
    vm = call(api, "GET", f"/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachines/vm").body
    template = next(t for t in vm["spec"]["dataVolumeTemplates"] if t["metadata"]["name"] == "vm-disk1")
    assert template["spec"]["storage"]["resources"]["requests"]["storage"] == "10Gi"
    assert {"name": "disk1", "disk": {"bus": "virtio"}} in vm["spec"]["template"]["spec"]["domain"]["devices"]["disks"]
    assert {"name": "disk1", "dataVolume": {"name": "vm-disk1"}} in vm["spec"]["template"]["spec"]["volumes"]
    members = {m["@odata.id"] for m in agent.redfish("GET", volumes)[1]["Members"]}
    assert f"{volumes}/disk1" in members
