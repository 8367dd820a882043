"""UEFI secure boot (Redfish SecureBoot) and boot overrides that leave no lasting firmware change.

What the VM boots with is what the BMC reports: the VM template is the next boot, the VMI the current one."""

from __future__ import annotations

import base64
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import sushy
from kubernetes import client

from vbmc.machine import BootEnabled, BootMode, BootOverride, BootTarget, InvalidRequest, ResetType
from vbmc.machine.kubevirt.firmware import Firmware, firmware_ops, mode_firmware
from vbmc.machine.memory import MemoryMachine

from ..support.agents import PASSWORD, USER, AgentProcess, agent_for_vm, sushy_at
from ..support.cluster import Sim, call, wait_for
from ..support.vms import get_vm, get_vmi, running_vmi_uid

VMS = "/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachines"
SECURE_BOOT = "/redfish/v1/Systems/vm/SecureBoot"


def firmware_of(obj: dict[str, Any] | None, *, template: bool = True) -> dict[str, Any]:
    spec = ((obj or {}).get("spec") or {})
    if template:
        spec = (spec.get("template") or {}).get("spec") or {}
    return (spec.get("domain") or {}).get("firmware") or {}


def bootloader(obj: dict[str, Any] | None, *, template: bool = True) -> dict[str, Any]:
    return firmware_of(obj, template=template).get("bootloader") or {}


@pytest.fixture
def agent(sim: Sim, api: client.ApiClient, namespace: str, bmc_crd: None) -> Iterator[AgentProcess]:
    with agent_for_vm(sim, api, namespace) as process:
        yield process


@pytest.fixture
def system(agent: AgentProcess) -> Iterator[Any]:
    with sushy_at(agent.url) as root:
        yield root.get_system("/redfish/v1/Systems/vm")


def uefi(api: client.ApiClient, ns: str, secure_boot: bool) -> None:
    """Give the test VM UEFI firmware (with SMM when secure boot is on, as KubeVirt requires) behind the BMC's back."""
    domain: dict[str, Any] = {"firmware": {"bootloader": {"efi": {"secureBoot": secure_boot}}}}
    if secure_boot:
        domain["features"] = {"smm": {"enabled": True}}
    reply = call(api, "PATCH", f"{VMS.format(ns=ns)}/vm", {"spec": {"template": {"spec": {"domain": domain}}}},
                 content_type="application/merge-patch+json")
    assert reply.status == 200, reply.body


# ---- kubesim refuses what KubeVirt refuses


def test_kubevirt_refuses_secure_boot_without_smm(api: client.ApiClient, namespace: str) -> None:
    vm = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "sb"},
          "spec": {"runStrategy": "Halted", "template": {"spec": {"domain": {
              "devices": {}, "firmware": {"bootloader": {"efi": {}}}}}}}}  # secureBoot unset: on
    reply = call(api, "POST", VMS.format(ns=namespace), vm)
    assert reply.status == 422
    assert reply.body["message"] == (
        'admission webhook "virtualmachine-validator.kubevirt.io" denied the request: spec.template.spec.domain '
        "has EFI SecureBoot enabled. SecureBoot requires SMM, which is currently disabled.")
    vm["spec"]["template"]["spec"]["domain"]["features"] = {"smm": {}}
    assert call(api, "POST", VMS.format(ns=namespace), vm).status == 201


# ---- SecureBoot through sushy (Ironic's library) against an agent on kubesim


def test_sushy_enables_secure_boot_with_smm_from_the_next_boot(agent: AgentProcess, system: Any,
                                                               api: client.ApiClient, namespace: str) -> None:
    uefi(api, namespace, secure_boot=False)
    secure = system.secure_boot
    wait_for(lambda: (secure.refresh(), secure.enabled)[1] is False, timeout=5, what="UEFI without secure boot")
    assert secure.current_boot is None  # off: no current boot
    secure.set_enabled(True)
    domain = get_vm(api, namespace)["spec"]["template"]["spec"]["domain"]
    assert domain["firmware"]["bootloader"]["efi"]["secureBoot"] is True
    assert domain["features"]["smm"]["enabled"] is True  # KubeVirt refuses secure boot without SMM
    events = call(api, "GET", f"/api/v1/namespaces/{namespace}/events").body["items"]
    assert any(e["reason"] == "SecureBootEnabled" and "SMM" in e["message"] for e in events)

    system.reset_system(sushy.ResetType.ON)
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="the VM to run")
    assert bootloader(get_vmi(api, namespace), template=False)["efi"]["secureBoot"] is True
    # the agent's VMI watch hears of the running VMI a moment after the API server says so
    wait_for(lambda: (secure.refresh(), (secure.enabled, secure.current_boot))[1]
             == (True, sushy.SecureBootCurrentBoot.ENABLED), timeout=5, what="the current boot secure")
    assert secure.mode == sushy.SecureBootMode.USER

    secure.set_enabled(False)  # the next boot; the running one keeps what it booted with
    secure.refresh()
    assert (secure.enabled, secure.current_boot) == (False, sushy.SecureBootCurrentBoot.ENABLED)
    assert bootloader(get_vm(api, namespace))["efi"]["secureBoot"] is False


def test_secure_boot_under_bios_is_a_conflict_that_changes_nothing(agent: AgentProcess,
                                                                   api: client.ApiClient, namespace: str) -> None:
    before = get_vm(api, namespace)["metadata"]["resourceVersion"]
    status, body = agent.redfish("PATCH", SECURE_BOOT, {"SecureBootEnable": True})
    assert status == 409
    assert body["error"]["@Message.ExtendedInfo"][0]["MessageId"].endswith(".PropertyValueConflict")
    assert "set the boot mode to UEFI first" in body["error"]["message"]
    assert get_vm(api, namespace)["metadata"]["resourceVersion"] == before
    status, shown = agent.redfish("GET", SECURE_BOOT)
    assert status == 200 and shown["SecureBootEnable"] is False and "BIOS" in shown["Description"]
    status, body = agent.redfish("PATCH", SECURE_BOOT, {"SecureBootEnable": "yes"})
    assert status == 400


def test_secure_boot_patch_honours_if_match(agent: AgentProcess, api: client.ApiClient, namespace: str) -> None:
    uefi(api, namespace, secure_boot=False)
    wait_for(lambda: agent.redfish("GET", SECURE_BOOT)[1].get("Description") is None, timeout=5, what="UEFI")
    def patch(etag: str) -> int:
        req = urllib.request.Request(f"{agent.url}{SECURE_BOOT}", data=b'{"SecureBootEnable": true}',
                                     method="PATCH", headers={"If-Match": etag, "Content-Type": "application/json",
                                                              "Authorization": basic()})
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    assert patch('"stale"') == 412
    assert bootloader(get_vm(api, namespace))["efi"]["secureBoot"] is False
    with urllib.request.urlopen(urllib.request.Request(f"{agent.url}{SECURE_BOOT}",
                                                       headers={"Authorization": basic()}), timeout=5) as resp:
        etag = resp.headers["ETag"]
    assert patch(etag) == 200
    assert bootloader(get_vm(api, namespace))["efi"]["secureBoot"] is True


def basic() -> str:
    return "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()


# ---- boot overrides: a one-time firmware change lasts one boot


def test_ipmitool_plain_bootdev_pxe_boots_bios_once_then_the_vm_is_uefi_again(
        agent: AgentProcess, api: client.ApiClient, namespace: str) -> None:
    uefi(api, namespace, secure_boot=True)
    wait_for(lambda: agent.redfish("GET", SECURE_BOOT)[1]["SecureBootEnable"] is True, timeout=5, what="UEFI")
    assert agent.ipmitool("chassis", "bootdev", "pxe").returncode == 0  # the legacy (PC compatible) bit
    assert "bios" in bootloader(get_vm(api, namespace))
    assert agent.ipmitool("chassis", "power", "on").returncode == 0
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="the PXE boot")
    assert "bios" in bootloader(get_vmi(api, namespace), template=False)  # this boot is the legacy one
    # consumed: the firmware comes back with the boot order, secure boot included
    wait_for(lambda: "efi" in bootloader(get_vm(api, namespace)), timeout=5, what="UEFI restored")
    assert bootloader(get_vm(api, namespace))["efi"]["secureBoot"] is True
    # the agent clears its override record (the VirtualMachineBMC's status) after it restores the VM's firmware
    wait_for(lambda: (boot := agent.redfish("GET", "/redfish/v1/Systems/vm")[1]["Boot"])["BootSourceOverrideEnabled"]
             == "Disabled" and boot["BootSourceOverrideMode"] == "UEFI", timeout=5, what="the override cleared")
    assert agent.redfish("GET", SECURE_BOOT)[1]["SecureBootEnable"] is True


def test_bootdev_pxe_with_efiboot_keeps_the_firmware(agent: AgentProcess, api: client.ApiClient,
                                                     namespace: str) -> None:
    uefi(api, namespace, secure_boot=True)
    wait_for(lambda: agent.redfish("GET", SECURE_BOOT)[1]["SecureBootEnable"] is True, timeout=5, what="UEFI")
    assert agent.ipmitool("chassis", "bootdev", "pxe", "options=efiboot").returncode == 0
    assert bootloader(get_vm(api, namespace)) == {"efi": {"secureBoot": True}}


def test_clearing_a_once_override_restores_the_firmware(agent: AgentProcess, api: client.ApiClient,
                                                        namespace: str) -> None:
    uefi(api, namespace, secure_boot=False)
    wait_for(lambda: "efi" in bootloader(get_vm(api, namespace)), timeout=5, what="UEFI")
    assert agent.ipmitool("chassis", "bootdev", "pxe").returncode == 0
    assert "bios" in bootloader(get_vm(api, namespace))
    status, _ = agent.redfish("PATCH", "/redfish/v1/Systems/vm", {"Boot": {"BootSourceOverrideEnabled": "Disabled"}})
    assert status == 200
    assert bootloader(get_vm(api, namespace)) == {"efi": {"secureBoot": False}}


def test_a_continuous_legacy_override_keeps_bios_after_the_boot(agent: AgentProcess, api: client.ApiClient,
                                                                namespace: str) -> None:
    uefi(api, namespace, secure_boot=False)
    wait_for(lambda: "efi" in bootloader(get_vm(api, namespace)), timeout=5, what="UEFI")
    status, _ = agent.redfish("PATCH", "/redfish/v1/Systems/vm", {"Boot": {
        "BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Continuous",
        "BootSourceOverrideMode": "Legacy"}})
    assert status == 200
    assert agent.ipmitool("chassis", "power", "on").returncode == 0
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="the boot")
    assert "bios" in bootloader(get_vmi(api, namespace), template=False)
    assert "bios" in bootloader(get_vm(api, namespace))  # persistent: the VM stays BIOS


# ---- the same rules in the memory backend and the pure firmware operations


def test_memory_machine_restores_the_firmware_a_once_override_changed() -> None:
    machine = MemoryMachine("vm")
    machine.set_secure_boot(True)
    machine.set_boot_override(BootOverride(BootTarget.PXE, BootEnabled.ONCE, BootMode.LEGACY))
    assert machine.inventory().firmware == BootMode.LEGACY and not machine.secure_boot().uefi
    with pytest.raises(InvalidRequest):
        machine.set_secure_boot(True)  # under BIOS
    machine.reset(ResetType.ON)
    assert machine.secure_boot().current is False  # this boot was the BIOS one
    assert machine.boot_override() == BootOverride(BootTarget.NONE, BootEnabled.DISABLED, BootMode.UEFI)
    assert machine.secure_boot().enabled is True  # back for the next boot
    machine.set_boot_override(BootOverride(BootTarget.PXE, BootEnabled.CONTINUOUS, BootMode.LEGACY))
    machine.reset(ResetType.FORCE_RESTART)
    assert machine.inventory().firmware == BootMode.LEGACY  # persistent: kept


VM_UEFI_SB = {"spec": {"template": {"spec": {"domain": {
    "firmware": {"bootloader": {"efi": {}}}, "features": {"smm": {}}}}}}}
VM_BIOS_BARE = {"spec": {"template": {"spec": {"domain": {}}}}}
VM_UEFI_NO_SMM = {"spec": {"template": {"spec": {"domain": {
    "firmware": {"bootloader": {"efi": {"secureBoot": False}}}}}}}}
DOMAIN = "/spec/template/spec/domain"


@pytest.mark.parametrize(("vm", "want", "ops"), [
    (VM_UEFI_SB, Firmware(BootMode.UEFI, True), []),  # already so
    (VM_UEFI_SB, Firmware(BootMode.UEFI, False),
     [{"op": "add", "path": f"{DOMAIN}/firmware/bootloader/efi/secureBoot", "value": False}]),
    (VM_UEFI_SB, Firmware(BootMode.LEGACY, False),
     [{"op": "add", "path": f"{DOMAIN}/firmware/bootloader", "value": {"bios": {}}}]),
    (VM_BIOS_BARE, Firmware(BootMode.UEFI, True),
     [{"op": "add", "path": f"{DOMAIN}/firmware", "value": {"bootloader": {"efi": {"secureBoot": True}}}},
      {"op": "add", "path": f"{DOMAIN}/features", "value": {"smm": {"enabled": True}}}]),
    (VM_UEFI_NO_SMM, Firmware(BootMode.UEFI, True),
     [{"op": "add", "path": f"{DOMAIN}/firmware/bootloader/efi/secureBoot", "value": True},
      {"op": "add", "path": f"{DOMAIN}/features", "value": {"smm": {"enabled": True}}}]),
])
def test_firmware_operations(vm: dict[str, Any], want: Firmware, ops: list[dict[str, Any]]) -> None:
    assert firmware_ops(vm, want) == ops


def test_a_mode_switch_keeps_secure_boot_only_within_uefi() -> None:
    assert mode_firmware(VM_UEFI_SB, BootMode.UEFI) == Firmware(BootMode.UEFI, True)
    assert mode_firmware(VM_UEFI_SB, BootMode.LEGACY) == Firmware(BootMode.LEGACY, False)
    assert mode_firmware(VM_BIOS_BARE, BootMode.UEFI) == Firmware(BootMode.UEFI, False)
