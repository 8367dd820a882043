"""KubeVirtMachine against kubesim: power, boot overrides and virtual media as KubeVirt API calls."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from vbmc.ipmi.server import WRITE_DEADLINE
from vbmc.machine import (
    BackendUnavailable,
    BootEnabled,
    BootMode,
    BootOverride,
    BootTarget,
    InvalidRequest,
    MediaState,
    PowerState,
    ResetType,
    Unsupported,
)
from vbmc.machine.kubevirt.client import Credentials, KubeClient, load_credentials, merge_patched
from vbmc.machine.kubevirt.machine import KubeVirtMachine

from ..support.cluster import Sim, call, wait_for
from ..support.vms import boot_orders, get_vm, get_vmi, make_bmc, make_vm, running_vmi_uid


@pytest.fixture
def machine_factory(sim: Sim, namespace: str, bmc_crd: None) -> Iterator[Any]:
    made: list[KubeVirtMachine] = []

    def make(vmbmc: str = "vm", vm: str = "vm") -> KubeVirtMachine:
        m = KubeVirtMachine(KubeClient(load_credentials(sim.kubeconfig)), namespace, vm, vmbmc)
        m.start()
        assert m.wait_ready(5)
        made.append(m)
        return m

    yield make
    for m in made:
        m.stop()


@pytest.fixture
def machine(api: client.ApiClient, namespace: str, machine_factory: Any) -> KubeVirtMachine:
    """A KubeVirtMachine for a VM with runStrategy Manual and its VirtualMachineBMC."""
    make_vm(api, namespace, run_strategy="Manual")
    make_bmc(api, namespace)
    made: KubeVirtMachine = machine_factory()
    return made


def test_power_on_from_halted_switches_to_manual_and_records_an_event(api: client.ApiClient, namespace: str,
                                                                      machine_factory: Any) -> None:
    make_vm(api, namespace)
    make_bmc(api, namespace)
    machine = machine_factory()
    assert machine.power_state() == PowerState.OFF
    machine.reset(ResetType.ON)
    assert get_vm(api, namespace)["spec"]["runStrategy"] == "Manual"
    wait_for(lambda: machine.power_state() == PowerState.ON, timeout=5, what="the VM to run")
    events = call(api, "GET", f"/api/v1/namespaces/{namespace}/events").body["items"]
    assert any(e["reason"] == "RunStrategyManual" and e["involvedObject"]["kind"] == "VirtualMachineBMC"
               for e in events)


def test_power_on_when_already_on_makes_no_call(api: client.ApiClient, namespace: str,
                                                machine: KubeVirtMachine) -> None:
    machine.reset(ResetType.ON)
    wait_for(lambda: machine.power_state() == PowerState.ON, timeout=5, what="running")
    before = get_vm(api, namespace)["metadata"]["resourceVersion"]
    machine.reset(ResetType.ON)
    assert get_vm(api, namespace)["metadata"]["resourceVersion"] == before


def test_force_off_and_graceful_shutdown_stop_the_vm(api: client.ApiClient, namespace: str,
                                                     machine: KubeVirtMachine) -> None:
    machine.reset(ResetType.ON)
    wait_for(lambda: machine.power_state() == PowerState.ON, timeout=5, what="running")
    machine.reset(ResetType.FORCE_OFF)
    wait_for(lambda: machine.power_state() == PowerState.OFF, timeout=5, what="stopped")
    assert get_vm(api, namespace)["spec"]["runStrategy"] == "Manual"
    machine.reset(ResetType.FORCE_OFF)  # already off: success
    machine.reset(ResetType.ON)
    wait_for(lambda: machine.power_state() == PowerState.ON, timeout=5, what="running again")
    machine.reset(ResetType.GRACEFUL_SHUTDOWN)
    wait_for(lambda: machine.power_state() == PowerState.OFF, timeout=5, what="shut down")


def test_nmi_is_unsupported_and_restart_of_an_off_vm_is_refused(api: client.ApiClient, namespace: str,
                                                                 machine: KubeVirtMachine) -> None:
    with pytest.raises(Unsupported):
        machine.reset(ResetType.NMI)
    with pytest.raises(InvalidRequest):
        machine.reset(ResetType.FORCE_RESTART)
    assert ResetType.NMI not in machine.supported_reset_types()


def test_force_restart_resets_the_vmi_in_place(api: client.ApiClient, namespace: str,
                                               machine: KubeVirtMachine) -> None:
    machine.reset(ResetType.ON)
    uid = wait_for(lambda: running_vmi_uid(api, namespace), timeout=5, what="running VMI")
    machine.reset(ResetType.FORCE_RESTART)
    assert running_vmi_uid(api, namespace) == uid


def test_boot_once_applies_to_the_next_boot_and_is_then_reverted(api: client.ApiClient, namespace: str,
                                                                 machine: KubeVirtMachine) -> None:
    machine.reset(ResetType.ON)
    first = wait_for(lambda: running_vmi_uid(api, namespace), timeout=5, what="running VMI")
    machine.set_boot_override(BootOverride(BootTarget.PXE, BootEnabled.ONCE, BootMode.UEFI))
    assert boot_orders(get_vm(api, namespace)) == {"root": 2, "cdrom": 3, "default": 1}
    assert machine.boot_override().enabled == BootEnabled.ONCE  # still pending: the running VMI predates it
    record = call(api, "GET", f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{namespace}/virtualmachinebmcs/vm")
    assert record.body["status"]["bootOverride"]["vmiUID"] == first

    machine.reset(ResetType.FORCE_RESTART)  # an override is pending: a new VMI, not a reset in place
    second = wait_for(lambda: (u := running_vmi_uid(api, namespace)) != first and u, timeout=8, what="new VMI")
    vmi = get_vmi(api, namespace)
    assert vmi is not None
    assert {i["name"]: i.get("bootOrder") for i in vmi["spec"]["domain"]["devices"]["interfaces"]} == {"default": 1}
    wait_for(lambda: machine.boot_override().enabled == BootEnabled.DISABLED, timeout=5, what="Once consumed")
    assert boot_orders(get_vm(api, namespace)) == {"root": None, "cdrom": None, "default": None}
    assert second


def test_boot_override_returns_once_its_record_is_stored(api: client.ApiClient, namespace: str,
                                                         machine: KubeVirtMachine) -> None:
    started = time.monotonic()
    machine.set_boot_override(BootOverride(BootTarget.PXE, BootEnabled.ONCE, BootMode.UEFI))
    assert time.monotonic() - started < WRITE_DEADLINE / 2
    assert machine.boot_override() == BootOverride(BootTarget.PXE, BootEnabled.ONCE, BootMode.UEFI)
    bmc = call(api, "GET", f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{namespace}/virtualmachinebmcs/vm").body
    # No device had a bootOrder: the merge patch's nulls are not stored, the maps stay (empty).
    assert bmc["status"]["bootOverride"]["originalOrder"] == {"disks": {}, "interfaces": {}}

    started = time.monotonic()
    machine.set_boot_override(BootOverride(BootTarget.CD, BootEnabled.CONTINUOUS, BootMode.UEFI))
    machine.set_boot_override(BootOverride(BootTarget.NONE, BootEnabled.DISABLED, BootMode.UEFI))
    assert time.monotonic() - started < WRITE_DEADLINE
    assert machine.boot_override().enabled == BootEnabled.DISABLED
    assert boot_orders(get_vm(api, namespace)) == {"root": None, "cdrom": None, "default": None}


@pytest.mark.parametrize(("target", "patch", "stored"), [
    (None, {"a": 1}, {"a": 1}),
    ({"a": 1, "b": 2}, {"a": None}, {"b": 2}),
    ({"s": {"r": {"x": 1}}}, {"s": {"r": {"d": {"root": None, "cd": 2}}}}, {"s": {"r": {"x": 1, "d": {"cd": 2}}}}),
    ({"s": {"r": {"x": 1}}}, {"s": {"r": None}}, {"s": {}}),
    ({"a": [1, 2]}, {"a": [None]}, {"a": [None]}),  # lists are replaced whole, nulls and all
])
def test_merge_patch_stores_what_rfc_7386_says(target: Any, patch: Any, stored: Any) -> None:
    assert merge_patched(target, patch) == stored


def test_boot_once_survives_an_agent_restart(api: client.ApiClient, namespace: str, machine_factory: Any) -> None:
    make_vm(api, namespace, run_strategy="Manual")
    make_bmc(api, namespace)
    first_agent = machine_factory()
    first_agent.set_boot_override(BootOverride(BootTarget.CD, BootEnabled.ONCE, BootMode.UEFI))
    first_agent.stop()
    second_agent = machine_factory()
    assert second_agent.boot_override() == BootOverride(BootTarget.CD, BootEnabled.ONCE, BootMode.UEFI)
    second_agent.reset(ResetType.ON)
    wait_for(lambda: second_agent.boot_override().enabled == BootEnabled.DISABLED, timeout=8, what="consumed")
    assert boot_orders(get_vm(api, namespace))["cdrom"] is None


def test_boot_continuous_persists_across_boots(api: client.ApiClient, namespace: str,
                                               machine: KubeVirtMachine) -> None:
    machine.set_boot_override(BootOverride(BootTarget.CD, BootEnabled.CONTINUOUS, BootMode.UEFI))
    machine.reset(ResetType.ON)
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=5, what="running")
    machine.reset(ResetType.POWER_CYCLE)
    wait_for(lambda: machine.power_state() == PowerState.ON, timeout=8, what="running after the cycle")
    assert machine.boot_override() == BootOverride(BootTarget.CD, BootEnabled.CONTINUOUS, BootMode.UEFI)
    assert boot_orders(get_vm(api, namespace))["cdrom"] == 1
    machine.set_boot_override(BootOverride(BootTarget.NONE, BootEnabled.DISABLED, BootMode.UEFI))
    assert boot_orders(get_vm(api, namespace))["cdrom"] is None


def test_boot_mode_switches_the_bootloader(api: client.ApiClient, namespace: str, machine: KubeVirtMachine) -> None:
    machine.set_boot_override(BootOverride(BootTarget.HDD, BootEnabled.CONTINUOUS, BootMode.LEGACY))
    firmware = get_vm(api, namespace)["spec"]["template"]["spec"]["domain"]["firmware"]
    assert "bios" in firmware["bootloader"]
    wait_for(lambda: machine.boot_override().mode == BootMode.LEGACY, timeout=3, what="legacy")
    machine.set_boot_override(BootOverride(BootTarget.HDD, BootEnabled.CONTINUOUS, BootMode.UEFI))
    firmware = get_vm(api, namespace)["spec"]["template"]["spec"]["domain"]["firmware"]
    assert "efi" in firmware["bootloader"]


def test_virtual_media_insert_and_eject(api: client.ApiClient, namespace: str, machine: KubeVirtMachine,
                                       image_server: Any) -> None:
    image = f"{image_server.base}/installer.iso"
    machine.insert_media(image)
    volumes = get_vm(api, namespace)["spec"]["template"]["spec"]["volumes"]
    # The VM is off: the medium is part of its next start (not hotplugged: tests/redfish/test_media_tasks.py)
    assert {"name": "cdrom", "dataVolume": {"name": "vm-cdrom"}} in volumes
    wait_for(lambda: machine.virtual_media().state == MediaState.INSERTED, timeout=5, what="imported")
    assert machine.virtual_media().image == image
    with pytest.raises(InvalidRequest):
        machine.insert_media(f"{image_server.base}/other.iso")
    machine.eject_media()
    assert not machine.virtual_media().inserted
    assert all(v["name"] != "cdrom" for v in get_vm(api, namespace)["spec"]["template"]["spec"]["volumes"])
    # The imported DataVolume is kept a while for an insert of the same image (Ironic ejects before inserting):
    # tests/redfish/test_ironic_habits_kubevirt.py


def test_a_medium_goes_into_a_running_vm_by_hotplug(api: client.ApiClient, namespace: str, machine: KubeVirtMachine,
                                                    image_server: Any) -> None:
    machine.reset(ResetType.ON)
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="the VM to run")
    machine.insert_media(f"{image_server.base}/installer.iso")
    volumes = get_vm(api, namespace)["spec"]["template"]["spec"]["volumes"]
    assert {"name": "cdrom", "dataVolume": {"name": "vm-cdrom", "hotpluggable": True}} in volumes
    wait_for(lambda: any(v["name"] == "cdrom" for v in (get_vmi(api, namespace) or {})["spec"].get("volumes", [])),
             timeout=10, what="the medium to be hotplugged into the running VMI")
    assert machine.power_state() == PowerState.ON


def test_virtual_media_without_a_cdrom_is_a_clear_error(api: client.ApiClient, namespace: str,
                                                        machine_factory: Any) -> None:
    make_vm(api, namespace, cdrom=False)
    make_bmc(api, namespace)
    machine = machine_factory()
    no_cdrom = "the VM has no cdrom disk: add an empty cdrom disk to its template to use virtual media"
    assert machine.media_slots() == ("Cd",)  # the slot is there, like a physical BMC's virtual CD ...
    media = machine.virtual_media()
    assert (media.state, media.message, media.inserted) == (MediaState.ABSENT, no_cdrom, False)  # ... with no drive
    with pytest.raises(Unsupported) as raised:
        machine.insert_media("http://images.example.com/installer.iso")
    assert str(raised.value) == no_cdrom
    with pytest.raises(Unsupported):
        machine.eject_media()
    dv = call(api, "GET", f"/apis/cdi.kubevirt.io/v1beta1/namespaces/{namespace}/datavolumes/vm-cdrom")
    assert dv.status == 404


def test_unreachable_api_server_is_backend_unavailable_within_two_seconds(tmp_path: Path) -> None:
    machine = KubeVirtMachine(KubeClient(Credentials("https://127.0.0.1:1", token="x"), timeout=0.5),
                              "default", "vm")
    machine.start()
    began = time.monotonic()
    with pytest.raises(BackendUnavailable):
        machine.power_state()
    with pytest.raises(BackendUnavailable):
        machine.reset(ResetType.ON)
    assert time.monotonic() - began < 2
    machine.stop()


def test_power_on_right_after_a_power_off_starts_the_vm_again(api: client.ApiClient, namespace: str,
                                                              machine: KubeVirtMachine) -> None:
    machine.reset(ResetType.ON)
    first = wait_for(lambda: running_vmi_uid(api, namespace), timeout=5, what="running")
    machine.reset(ResetType.FORCE_OFF)
    assert machine.power_state() in (PowerState.POWERING_OFF, PowerState.OFF)  # a read after the call sees it
    machine.reset(ResetType.ON)  # no wait in between: the old VMI may still be shutting down
    wait_for(lambda: running_vmi_uid(api, namespace) not in ("", first), timeout=8, what="running again")
