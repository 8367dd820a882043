"""BIOS settings (Bios, Bios/Settings, the attribute registry), boot progress and the firmware inventory.

Each attribute is a field of the VM template that KubeVirt applies when it creates the next VMI: a change is pending
(an annotation on the VM) until the next power-on or reset through the BMC, which writes it into the template first.
sushy (Ironic's library) drives them as Ironic's `redfish` bios interface does: on the memory backend for the
protocol, against an agent on kubesim for what changes in the VM."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonpatch
import pytest
import sushy
from kubernetes import client

from vbmc.machine import ResetType
from vbmc.machine import bios as machine_bios
from vbmc.machine.bios import BIOS, DISABLED, ENABLED, UEFI, BootProgressState, RefusedSetting
from vbmc.machine.kubevirt import bios as kvbios
from vbmc.machine.memory import MemoryMachine
from vbmc.redfish.app import create_app
from vbmc.redfish.server import ThreadedServer

from ..support.agents import PASSWORD, USER, AgentProcess, agent_for_vm, running_agent, sushy_at
from ..support.cluster import Sim, wait_for
from ..support.vms import get_vm, get_vmi, running_vmi_uid

SYSTEM = "/redfish/v1/Systems/vm"
BIOS_PATH = f"{SYSTEM}/Bios"
KUBEVIRT_DEFAULTS = {"BootMode": BIOS, "SecureBoot": DISABLED, "Smm": DISABLED, "TpmDevice": DISABLED,
                     "SerialPort": ENABLED, "SerialConsoleRedirection": DISABLED}


# ---- the rules: pure functions


@pytest.mark.parametrize(("current", "requested", "refused"), [
    ({"BootMode": BIOS}, {"SecureBoot": ENABLED}, "SecureBoot needs the boot mode Uefi"),
    ({"BootMode": BIOS}, {"BootMode": UEFI, "SecureBoot": ENABLED, "Smm": DISABLED}, "secure boot needs SMM"),
    ({"BootMode": UEFI}, {"SerialConsoleRedirection": ENABLED}, "needs the boot mode Bios"),
    ({}, {"SerialConsoleRedirection": ENABLED, "SerialPort": DISABLED}, "needs SerialPort Enabled"),
    ({}, {"MachineType": "pc"}, "MachineType is read-only"),
    ({}, {"Hyperthreading": ENABLED}, "not an attribute of this BIOS"),
    ({}, {"TpmDevice": "On"}, "TpmDevice takes Enabled or Disabled"),
])
def test_a_value_that_cannot_be_applied_is_refused_with_the_reason(current: dict[str, Any], requested: dict[str, Any],
                                                                   refused: str) -> None:
    with pytest.raises(RefusedSetting, match=refused):
        machine_bios.check(KUBEVIRT_DEFAULTS | current, requested)


def test_secure_boot_brings_smm_and_a_switch_to_bios_drops_secure_boot() -> None:
    settings = machine_bios.check(KUBEVIRT_DEFAULTS, {"BootMode": UEFI, "SecureBoot": ENABLED})
    assert (settings["SecureBoot"], settings["Smm"]) == (ENABLED, ENABLED)
    back = machine_bios.check(settings, {"BootMode": BIOS})
    assert back["SecureBoot"] == DISABLED and back["Smm"] == ENABLED


def vm(domain: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "vm", "uid": "u1"}, "spec": {"template": {"spec": {"domain": domain}}}}


def patched(obj: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON patch applied as the API server applies it (RFC 6902: kubesim's library)."""
    return dict(jsonpatch.apply_patch(obj, ops))


@pytest.mark.parametrize(("domain", "wanted", "expect"), [
    # a VM that states nothing: KubeVirt's defaults
    ({"devices": {}}, {"BootMode": UEFI, "SecureBoot": ENABLED},
     {"firmware": {"bootloader": {"efi": {"secureBoot": True}}}, "features": {"smm": {"enabled": True}},
      "devices": {}}),
    ({"devices": {}}, {"TpmDevice": ENABLED, "SerialConsoleRedirection": ENABLED},
     {"firmware": {"bootloader": {"bios": {"useSerial": True}}}, "devices": {"tpm": {}}}),
    ({"firmware": {"uuid": "x", "bootloader": {"efi": {"secureBoot": True, "persistent": True}}},
      "features": {"smm": {"enabled": True}}, "devices": {"tpm": {}}},
     {"SecureBoot": DISABLED, "Smm": DISABLED, "TpmDevice": DISABLED, "SerialPort": DISABLED},
     {"firmware": {"uuid": "x", "bootloader": {"efi": {"secureBoot": False, "persistent": True}}},
      "features": {"smm": {"enabled": False}}, "devices": {"autoattachSerialConsole": False}}),
])
def test_each_attribute_is_a_field_of_the_vm_template(domain: dict[str, Any], wanted: dict[str, Any],
                                                      expect: dict[str, Any]) -> None:
    before = vm(domain)
    settings = machine_bios.check(kvbios.current(before), wanted)
    after = patched(before, kvbios.template_ops(before, settings))
    assert after["spec"]["template"]["spec"]["domain"] == expect
    assert {k: kvbios.current(after)[k] for k in wanted} == wanted


@pytest.mark.parametrize(("vmi", "state"), [
    (None, BootProgressState.NONE),
    ({"status": {"phase": "Scheduling"}}, BootProgressState.NONE),
    ({"status": {"phase": "Scheduled"}}, BootProgressState.PRIMARY_PROCESSOR),
    ({"status": {"phase": "Running"}}, BootProgressState.OS_BOOT_STARTED),
    ({"status": {"phase": "Running", "conditions": [{"type": "AgentConnected", "status": "True"}]}},
     BootProgressState.OS_RUNNING),
    ({"status": {"phase": "Succeeded"}}, BootProgressState.NONE),
])
def test_boot_progress_is_what_kubevirt_shows(vmi: dict[str, Any] | None, state: BootProgressState) -> None:
    assert kvbios.boot_progress(vmi).state == state


# ---- sushy against the memory backend


@pytest.fixture
def memory() -> Iterator[tuple[MemoryMachine, Any]]:
    machine = MemoryMachine("vm")
    with ThreadedServer(create_app(machine, USER, PASSWORD)) as server, sushy_at(server.url) as root:
        yield machine, root


def test_sushy_lists_the_attributes_with_the_registry_read_only_marked(memory: tuple[MemoryMachine, Any]) -> None:
    _, root = memory
    bios = root.get_system(SYSTEM).bios
    assert bios.attributes["BootMode"] == UEFI and bios.attributes["MachineType"] == "q35"
    registry = {a.name: a for a in bios.get_attribute_registry().registry_entries.attributes}
    assert set(registry) == set(bios.attributes)
    assert registry["MachineType"].read_only and not registry["SecureBoot"].read_only
    assert [v["ValueName"] for v in registry["BootMode"].allowable_values] == [UEFI, BIOS]
    assert registry["SerialPort"].reset_required
    assert bios.supported_apply_times == [sushy.ApplyTime.ON_RESET]


def test_settings_wait_for_the_next_boot_and_report_their_result(memory: tuple[MemoryMachine, Any]) -> None:
    machine, root = memory
    system = root.get_system(SYSTEM)
    bios = system.bios
    bios.set_attributes({"SecureBoot": ENABLED, "TpmDevice": ENABLED}, apply_time=sushy.ApplyTime.ON_RESET)
    bios.refresh()
    assert bios.pending_attributes == {"SecureBoot": ENABLED, "TpmDevice": ENABLED}
    assert bios.attributes["SecureBoot"] == DISABLED  # not before the boot
    assert bios.update_status.status == sushy.resources.settings.NO_UPDATES

    system.reset_system(sushy.ResetType.ON)
    bios = root.get_system(SYSTEM).bios
    assert (bios.attributes["SecureBoot"], bios.attributes["Smm"], bios.attributes["TpmDevice"]) == (
        ENABLED, ENABLED, ENABLED)
    assert bios.pending_attributes == {}
    assert bios.update_status.status == sushy.resources.settings.UPDATE_SUCCESS
    assert machine.secure_boot().current is True


def test_a_refused_value_changes_nothing_and_says_why(memory: tuple[MemoryMachine, Any]) -> None:
    machine, root = memory
    bios = root.get_system(SYSTEM).bios
    with pytest.raises(sushy.exceptions.BadRequestError, match="needs the boot mode Bios"):
        bios.set_attributes({"SerialConsoleRedirection": ENABLED})
    with pytest.raises(sushy.exceptions.BadRequestError, match="read-only"):
        bios.set_attributes({"SystemUuid": "0"})
    assert machine.bios().pending == ()


def test_reset_bios_makes_kubevirts_defaults_pending(memory: tuple[MemoryMachine, Any]) -> None:
    machine, root = memory
    system = root.get_system(SYSTEM)
    system.bios.reset_bios()
    bios = root.get_system(SYSTEM).bios
    assert bios.pending_attributes == KUBEVIRT_DEFAULTS
    system.reset_system(sushy.ResetType.ON)
    assert {k: v for k, v in machine.bios().attributes.items() if k in KUBEVIRT_DEFAULTS} == KUBEVIRT_DEFAULTS


def test_boot_progress_and_the_firmware_inventory(memory: tuple[MemoryMachine, Any]) -> None:
    machine, root = memory
    system = root.get_system(SYSTEM)
    assert system.boot_progress.last_state == sushy.BootProgressStates.NONE
    assert system.bios_version == "OVMF (edk2)"
    machine.reset(ResetType.ON)
    system.refresh()
    assert system.boot_progress.last_state == sushy.BootProgressStates.OS_BOOT_STARTED
    assert system.boot_progress.last_state_updated_at is not None
    update = root.get_update_service()
    firmware = {f.identity: f for f in update.firmware_inventory.get_members()}
    assert firmware["BIOS"].name == "OVMF (edk2)" and firmware["BIOS"].updateable is False
    assert firmware["BMC"].version
    with pytest.raises(sushy.exceptions.BadRequestError, match="comes with KubeVirt's virt-launcher image"):
        root._conn.post("/redfish/v1/UpdateService/Actions/UpdateService.SimpleUpdate",
                        data={"ImageURI": "http://example.com/bios.bin"})


# ---- against an agent on kubesim: what changes in the VM


@pytest.fixture
def agent(sim: Sim, api: client.ApiClient, namespace: str, bmc_crd: None) -> Iterator[AgentProcess]:
    with agent_for_vm(sim, api, namespace) as process:
        yield process


def template_domain(api: client.ApiClient, namespace: str) -> dict[str, Any]:
    return dict(get_vm(api, namespace)["spec"]["template"]["spec"]["domain"])


def test_pending_settings_survive_an_agent_restart_and_the_power_on_applies_them(
        sim: Sim, agent: AgentProcess, api: client.ApiClient, namespace: str) -> None:
    status, body = agent.redfish("PATCH", f"{BIOS_PATH}/Settings", {
        "Attributes": {"BootMode": UEFI, "SecureBoot": ENABLED},
        "@Redfish.SettingsApplyTime": {"ApplyTime": "OnReset"}})
    assert status == 200, body
    assert body["Attributes"] == {"BootMode": UEFI, "SecureBoot": ENABLED}
    vm = get_vm(api, namespace)
    assert json.loads(vm["metadata"]["annotations"][kvbios.PENDING])["attributes"] == body["Attributes"]
    assert "firmware" not in vm["spec"]["template"]["spec"]["domain"]  # the template waits for the boot

    agent.stop()
    with running_agent("--namespace", namespace, "--vm", "vm", "--vmbmc", "vm",
                       env={"KUBECONFIG": sim.kubeconfig}) as again:
        status, shown = again.redfish("GET", f"{BIOS_PATH}/Settings")
        assert shown["Attributes"] == {"BootMode": UEFI, "SecureBoot": ENABLED}
        assert again.redfish("POST", f"{SYSTEM}/Actions/ComputerSystem.Reset", {"ResetType": "On"})[0] == 204
        domain = template_domain(api, namespace)
        assert domain["firmware"]["bootloader"] == {"efi": {"secureBoot": True}}
        assert domain["features"]["smm"] == {"enabled": True}
        assert kvbios.PENDING not in get_vm(api, namespace)["metadata"]["annotations"]
        wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="the VM to run")
        assert get_vmi(api, namespace)["spec"]["domain"]["firmware"]["bootloader"]["efi"]["secureBoot"] is True
        status, bios = again.redfish("GET", BIOS_PATH)
        assert bios["Attributes"]["SecureBoot"] == ENABLED
        assert [m["MessageSeverity"] for m in bios["@Redfish.Settings"]["Messages"]] == ["OK", "OK"]
        progress = wait_for(lambda: (p := again.redfish("GET", SYSTEM)[1]["BootProgress"])["LastState"]
                            == "OSBootStarted" and p, timeout=5, what="OSBootStarted")
        assert progress["LastStateTime"]
        assert again.redfish("GET", SYSTEM)[1]["BiosVersion"].startswith("OVMF (edk2), secure boot build")


def test_a_restart_with_pending_settings_boots_a_new_vmi_with_them(agent: AgentProcess, api: client.ApiClient,
                                                                    namespace: str) -> None:
    assert agent.redfish("POST", f"{SYSTEM}/Actions/ComputerSystem.Reset", {"ResetType": "On"})[0] == 204
    before = wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="the VM to run")
    with sushy_at(agent.url) as root:
        system = root.get_system(SYSTEM)
        system.bios.set_attributes({"TpmDevice": ENABLED, "SerialConsoleRedirection": ENABLED})
        assert "tpm" not in template_domain(api, namespace)["devices"]
        system.reset_system(sushy.ResetType.FORCE_RESTART)  # a VMI reset keeps its domain: a new VMI instead
        after = wait_for(lambda: (u := running_vmi_uid(api, namespace)) != before and u, timeout=10,
                         what="a new VMI")
        vmi = get_vmi(api, namespace)
        assert vmi is not None and vmi["metadata"]["uid"] == after
        assert vmi["spec"]["domain"]["devices"]["tpm"] == {}
        assert vmi["spec"]["domain"]["firmware"]["bootloader"] == {"bios": {"useSerial": True}}

        system.bios.reset_bios()
        assert root.get_system(SYSTEM).bios.pending_attributes == KUBEVIRT_DEFAULTS
        system.reset_system(sushy.ResetType.FORCE_OFF)
        system.reset_system(sushy.ResetType.ON)
        domain = template_domain(api, namespace)
        assert "tpm" not in domain["devices"] and domain["firmware"]["bootloader"] == {"bios": {}}
