"""What a BMC reads from a KubeVirt VM (vbmc/machine/kubevirt/vmstate.py): its power state, whatever its
DataVolumes do, and the size of each disk, from what the cluster states (pure functions, table-driven)."""

from __future__ import annotations

from typing import Any

import pytest

from vbmc.machine import PowerState
from vbmc.machine.kubevirt import vmstate

Obj = dict[str, Any]
GI = 2**30


def vm(printable: str, strategy: str = "Manual", requests: list[str] | None = None, **spec: Any) -> Obj:
    status: Obj = {"printableStatus": printable}
    if requests:
        status["stateChangeRequests"] = [{"action": a} for a in requests]
    return {"metadata": {"name": "vm"}, "spec": {"runStrategy": strategy, **spec}, "status": status}


def vmi(phase: str) -> Obj:
    return {"metadata": {"name": "vm", "uid": "u1"}, "status": {"phase": phase}}


@pytest.mark.parametrize(("the_vm", "the_vmi", "expected"), [
    # A medium importing into a VM that nobody started: KubeVirt prints Provisioning, the machine is off.
    (vm("Provisioning", "Halted"), None, PowerState.OFF),
    (vm("Provisioning", "Manual"), None, PowerState.OFF),
    (vm("Provisioning", "Manual", ["Stop"]), None, PowerState.OFF),
    # Started and held by its volumes: powering on until it runs.
    (vm("Provisioning", "Manual"), vmi("Pending"), PowerState.POWERING_ON),
    (vm("Provisioning", "Manual", ["Start"]), None, PowerState.POWERING_ON),
    (vm("Provisioning", "Always"), None, PowerState.POWERING_ON),
    (vm("WaitingForVolumeBinding", "Halted"), None, PowerState.OFF),
    (vm("Starting", "Manual"), vmi("Scheduling"), PowerState.POWERING_ON),
    # The start request consumed and the VMI created, before the VMI's watch has delivered it (two streams, no
    # order between them): not a moment of "off" (a spurious power-off in the SEL and the EventService).
    (vm("Starting", "Manual"), None, PowerState.POWERING_ON),
    # A start request not yet acted on, and run strategies that start the VM by themselves.
    (vm("Stopped", "Manual"), None, PowerState.OFF),
    (vm("Stopped", "Manual", ["Start"]), None, PowerState.POWERING_ON),
    (vm("Stopped", "Always"), vmi("Succeeded"), PowerState.POWERING_ON),
    (vm("Stopped", "RerunOnFailure"), vmi("Succeeded"), PowerState.OFF),
    (vm("Stopped", "RerunOnFailure"), vmi("Failed"), PowerState.POWERING_ON),
    (vm("Stopped", "Once"), vmi("Succeeded"), PowerState.OFF),
    (vm("", "Halted", running=None), None, PowerState.OFF),
    # A volume that cannot be had: off, unless a VMI waits for it.
    (vm("DataVolumeError", "Manual"), None, PowerState.OFF),
    (vm("DataVolumeError", "Manual"), vmi("Pending"), PowerState.POWERING_ON),
    (vm("ErrImagePull", "Halted"), None, PowerState.OFF),
    (vm("Running", "Manual"), vmi("Running"), PowerState.ON),
    (vm("Stopping", "Manual"), vmi("Running"), PowerState.POWERING_OFF),
    (vm("CrashLoopBackOff", "Always"), None, PowerState.OFF),
])
def test_power_state_follows_whether_the_vm_is_meant_to_run(the_vm: Obj, the_vmi: Obj | None,
                                                            expected: PowerState) -> None:
    assert vmstate.power_state(the_vm, the_vmi) == expected


def sized_vm(*volumes: Obj, templates: tuple[Obj, ...] = ()) -> Obj:
    return {"metadata": {"name": "vm"}, "spec": {"dataVolumeTemplates": list(templates), "template": {"spec": {
        "domain": {"devices": {"disks": [{"name": v["name"], "disk": {}} for v in volumes]}},
        "volumes": list(volumes)}}}}


def claim(phase: str, capacity: str) -> Obj:
    return {"status": {"phase": phase, "capacity": {"storage": capacity}}}


def template(name: str, request: str) -> Obj:
    return {"metadata": {"name": name}, "spec": {"storage": {"resources": {"requests": {"storage": request}}}}}


def volume_status(name: str, **fields: Any) -> Obj:
    return {"status": {"phase": "Running", "volumeStatus": [{"name": name, **fields}]}}


@pytest.mark.parametrize(("the_vm", "the_vmi", "claims", "expected"), [
    # A bound claim's capacity, whether or not the VM runs, over what its template asked for.
    (sized_vm({"name": "root", "dataVolume": {"name": "vm-root"}}, templates=(template("vm-root", "10Gi"),)), None,
     {"vm-root": claim("Bound", "12Gi")}, {"root": 12 * GI}),
    (sized_vm({"name": "data", "persistentVolumeClaim": {"claimName": "data"}}), None,
     {"data": claim("Bound", "7Gi")}, {"data": 7 * GI}),
    # A claim not bound yet states nothing: the template's request, else no size.
    (sized_vm({"name": "root", "dataVolume": {"name": "vm-root"}}, templates=(template("vm-root", "10Gi"),)), None,
     {"vm-root": claim("Pending", "")}, {"root": 10 * GI}),
    (sized_vm({"name": "data", "persistentVolumeClaim": {"claimName": "data"}}), None, {}, {}),
    # The running VMI's view of a claim the agent could not read.
    (sized_vm({"name": "data", "persistentVolumeClaim": {"claimName": "data"}}),
     volume_status("data", persistentVolumeClaimInfo={"capacity": {"storage": "5Gi"}}), {}, {"data": 5 * GI}),
    # What virt-handler measured of an image it built (cloud-init), and what the VM asks of an emptyDisk.
    (sized_vm({"name": "ci", "cloudInitNoCloud": {"userData": "#cloud-config"}}),
     volume_status("ci", size=374784), {}, {"ci": 374784}),
    (sized_vm({"name": "scratch", "emptyDisk": {"capacity": "2Gi"}}), None, {}, {"scratch": 2 * GI}),
    # A containerDisk: no size anywhere, running or not.
    (sized_vm({"name": "root", "containerDisk": {"image": "quay.io/containerdisks/fedora"}}),
     volume_status("root", target="vda"), {}, {}),
])
def test_disk_sizes_come_from_what_the_cluster_states(the_vm: Obj, the_vmi: Obj | None, claims: dict[str, Obj],
                                                      expected: dict[str, int]) -> None:
    assert vmstate.disk_sizes(the_vm, the_vmi, claims) == expected
