"""Boot overrides as KubeVirt boot orders, and what a BMC reports about a VM: table-driven, no cluster."""

from __future__ import annotations

from typing import Any

import pytest

from vbmc.machine import BootMode, BootTarget, InvalidRequest, PowerState, Unsupported
from vbmc.machine.kubevirt import bootorder, vmstate


def vm(disks: list[dict[str, Any]], interfaces: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "vm"}, "spec": {"template": {"spec": {"domain": {"devices": {
        "disks": disks, "interfaces": interfaces or []}}}}}}


ROOT = {"name": "root", "disk": {}}
DATA = {"name": "data", "disk": {}}
CD = {"name": "cd", "cdrom": {}}
NIC = {"name": "default", "masquerade": {}}


@pytest.mark.parametrize(("devices", "target", "disks", "interfaces"), [
    # No bootOrder anywhere: the target first, then the disks as declared.
    (([ROOT, CD], [NIC]), BootTarget.PXE, {"root": 2, "cd": 3}, {"default": 1}),
    (([ROOT, CD], [NIC]), BootTarget.CD, {"root": 2, "cd": 1}, {"default": None}),
    (([ROOT, DATA], []), BootTarget.HDD, {"root": 1, "data": 2}, {}),
    # An existing order is kept after the target.
    (([{**ROOT, "bootOrder": 2}, {**CD, "bootOrder": 1}], [{**NIC, "bootOrder": 3}]), BootTarget.HDD,
     {"root": 1, "cd": 2}, {"default": 3}),
    # Devices outside the original order stay outside it.
    (([{**ROOT, "bootOrder": 1}, DATA, CD], [NIC]), BootTarget.PXE, {"root": 2, "data": None, "cd": None},
     {"default": 1}),
    # Hdd means the first disk in the original boot order, not the first declared.
    (([{**DATA, "bootOrder": 2}, {**ROOT, "bootOrder": 1}], []), BootTarget.HDD, {"root": 1, "data": 2}, {}),
])
def test_override_order_puts_the_target_first(devices: tuple[list[Any], list[Any]], target: BootTarget,
                                              disks: dict[str, int | None], interfaces: dict[str, int | None]) -> None:
    machine = vm(*devices)
    order = bootorder.override_order(machine, target, bootorder.current_order(machine))
    assert order.disks == disks and order.interfaces == interfaces
    numbers = [n for n in (*order.disks.values(), *order.interfaces.values()) if n is not None]
    assert sorted(numbers) == list(range(1, len(numbers) + 1))


@pytest.mark.parametrize(("devices", "target", "error"), [
    (([ROOT], []), BootTarget.PXE, InvalidRequest),
    (([ROOT], [NIC]), BootTarget.CD, InvalidRequest),
    (([ROOT, CD], [NIC]), BootTarget.BIOS_SETUP, Unsupported),
    (([ROOT, CD], [NIC]), BootTarget.UEFI_HTTP, Unsupported),
])
def test_override_to_a_missing_device_is_refused(devices: tuple[list[Any], list[Any]], target: BootTarget,
                                                 error: type[Exception]) -> None:
    machine = vm(*devices)
    with pytest.raises(error):
        bootorder.override_order(machine, target, bootorder.current_order(machine))


def test_order_patch_guards_each_change_with_a_test_of_the_device_name() -> None:
    machine = vm([{**ROOT, "bootOrder": 1}, CD], [NIC])
    order = bootorder.DeviceOrder({"root": None, "cd": 1}, {"default": None})
    ops = bootorder.order_patch(machine, order)
    base = "/spec/template/spec/domain/devices/disks"
    assert ops == [
        {"op": "test", "path": f"{base}/0/name", "value": "root"}, {"op": "remove", "path": f"{base}/0/bootOrder"},
        {"op": "test", "path": f"{base}/1/name", "value": "cd"}, {"op": "add", "path": f"{base}/1/bootOrder",
                                                                  "value": 1},
    ]


def test_restoring_the_recorded_order_round_trips() -> None:
    machine = vm([{**ROOT, "bootOrder": 1}, CD], [NIC])
    original = bootorder.current_order(machine)
    assert bootorder.DeviceOrder.from_status(original.as_status()) == original


def test_supported_targets_follow_the_devices() -> None:
    assert bootorder.supported_targets(vm([ROOT], [])) == (BootTarget.NONE, BootTarget.HDD)
    assert bootorder.supported_targets(vm([ROOT, CD], [NIC])) == (
        BootTarget.NONE, BootTarget.PXE, BootTarget.HDD, BootTarget.CD)
    uefi = vm([ROOT, CD], [NIC])
    uefi["spec"]["template"]["spec"]["domain"]["firmware"] = {"bootloader": {"efi": {}}}
    # UEFI HTTP boot: under UEFI, into the cdrom (the image is imported there)
    assert bootorder.supported_targets(uefi)[-1] == BootTarget.UEFI_HTTP
    del uefi["spec"]["template"]["spec"]["domain"]["devices"]["disks"][1]
    assert BootTarget.UEFI_HTTP not in bootorder.supported_targets(uefi)


@pytest.mark.parametrize(("printable", "paused", "expected"), [
    ("Running", False, PowerState.ON),
    ("Running", True, PowerState.PAUSED),
    ("Paused", True, PowerState.PAUSED),
    ("Migrating", False, PowerState.ON),
    ("Stopping", False, PowerState.POWERING_OFF),
    ("Terminating", False, PowerState.POWERING_OFF),
    ("Starting", False, PowerState.POWERING_ON),
    ("Provisioning", False, PowerState.POWERING_ON),
    ("WaitingForVolumeBinding", False, PowerState.POWERING_ON),
    ("ErrorUnschedulable", False, PowerState.POWERING_ON),
    ("Stopped", False, PowerState.OFF),
    ("CrashLoopBackOff", False, PowerState.OFF),
    ("DataVolumeError", False, PowerState.OFF),
    ("ErrorPvcNotFound", False, PowerState.OFF),
])
def test_power_state_follows_printable_status(printable: str, paused: bool, expected: PowerState) -> None:
    # A VMI exists unless the VM is off (tests/machine/test_vmstate.py: what a VM without one reports).
    vmi = {"status": {"conditions": [{"type": "Paused", "status": "True"}]}} if paused else {"status": {}}
    if expected == PowerState.OFF:
        vmi = None
    assert vmstate.power_state({"status": {"printableStatus": printable}}, vmi) == expected


def test_inventory_reads_the_template_and_the_vmi_macs() -> None:
    machine = vm([ROOT, CD], [NIC])
    spec = machine["spec"]["template"]["spec"]
    spec["domain"].update(cpu={"cores": 2, "sockets": 2}, memory={"guest": "2Gi"},
                          firmware={"uuid": "1b4e28ba-2fa1-11d2-883f-0016d3cca427", "bootloader": {"efi": {}}})
    vmi = {"status": {"interfaces": [{"name": "default", "mac": "52:54:00:aa:bb:cc"}]}}
    inv = vmstate.inventory(machine, vmi)
    assert inv.uuid == "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
    assert (inv.cpu_count, inv.memory_bytes) == (4, 2 * 2**30)
    assert inv.nics[0].mac == "52:54:00:aa:bb:cc"
    assert [d.kind for d in inv.disks] == ["disk", "cdrom"]
    assert inv.firmware == BootMode.UEFI and inv.secure_boot


@pytest.mark.parametrize(("quantity", "expected"), [("1Gi", 2**30), ("512Mi", 512 * 2**20), ("2G", 2 * 10**9),
                                                    (1024, 1024), ("bogus", 0), (None, 0)])
def test_quantities(quantity: Any, expected: int) -> None:
    assert vmstate.quantity_bytes(quantity) == expected
