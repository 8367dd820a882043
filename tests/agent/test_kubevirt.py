"""Every mapping of DESIGN.md section 3, driven by real clients through an agent on kubesim.

Each test starts a VM (runStrategy Halted, as users create them), its VirtualMachineBMC and an agent process,
then speaks IPMI (ipmitool, freeipmi, pyghmi) or Redfish (sushy) to the agent and checks what happened to the VM
and its VMI in the cluster.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import sushy
from kubernetes import client
from pyghmi.ipmi import command as pyghmi_command

from ..support.agents import PASSWORD, USER, AgentProcess, agent_for_vm, sushy_at
from ..support.cluster import Sim, call, wait_for
from ..support.vms import boot_orders, get_vm, get_vmi, make_bmc, make_vm, printable, running_vmi_uid


@pytest.fixture
def agent(sim: Sim, api: client.ApiClient, namespace: str, bmc_crd: None) -> Iterator[AgentProcess]:
    with agent_for_vm(sim, api, namespace) as process:
        yield process



def power_on(agent: AgentProcess, api: client.ApiClient, ns: str) -> str:
    result = agent.ipmitool("power", "on")
    assert result.returncode == 0, result.stderr
    return str(wait_for(lambda: running_vmi_uid(api, ns), timeout=10, what="a running VMI"))


def interface_boot_order(vmi: dict[str, Any] | None) -> int | None:
    assert vmi is not None
    return vmi["spec"]["domain"]["devices"]["interfaces"][0].get("bootOrder")


# ---- ipmitool


def test_ipmitool_power_on_brings_the_vm_to_running(agent: AgentProcess, api: client.ApiClient,
                                                    namespace: str) -> None:
    assert "Chassis Power is off" in agent.ipmitool("power", "status").stdout
    power_on(agent, api, namespace)
    vm = get_vm(api, namespace)
    assert vm["spec"]["runStrategy"] == "Manual"
    wait_for(lambda: printable(api, namespace) == "Running", timeout=5, what="Running")
    assert "Chassis Power is on" in agent.ipmitool("power", "status", cipher="3").stdout


def test_ipmitool_with_a_wrong_password_fails_and_changes_nothing(agent: AgentProcess, api: client.ApiClient,
                                                                  namespace: str) -> None:
    before = get_vm(api, namespace)["metadata"]["resourceVersion"]
    result = subprocess.run(["ipmitool", "-v", "-I", "lanplus", "-H", "127.0.0.1", "-p", str(agent.ipmi_port),
                             "-U", USER, "-P", "wrong", "power", "on"], capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    # An authentication error from the BMC, not a timeout ("no response from RAKP ...").
    assert "RAKP 2 HMAC is invalid" in result.stderr, result.stderr
    assert get_vm(api, namespace)["metadata"]["resourceVersion"] == before
    assert get_vmi(api, namespace) is None


def test_ipmitool_power_off_forces_the_vm_off(agent: AgentProcess, api: client.ApiClient, namespace: str) -> None:
    power_on(agent, api, namespace)
    assert agent.ipmitool("power", "off").returncode == 0
    wait_for(lambda: printable(api, namespace) == "Stopped", timeout=3, what="Stopped at once")
    assert get_vm(api, namespace)["spec"]["runStrategy"] == "Manual"


def test_ipmitool_power_soft_shuts_the_guest_down(agent: AgentProcess, api: client.ApiClient,
                                                  namespace: str) -> None:
    power_on(agent, api, namespace)
    assert agent.ipmitool("power", "soft").returncode == 0
    wait_for(lambda: printable(api, namespace) in ("Stopping", "Stopped"), timeout=3, what="shutting down")
    wait_for(lambda: printable(api, namespace) == "Stopped", timeout=5, what="Stopped")
    # the agent answers from its watch cache, which hears of Stopped a moment after the API server says so
    wait_for(lambda: "Chassis Power is off" in agent.ipmitool("power", "status").stdout, timeout=5,
             what="the BMC to read off")


def test_ipmitool_power_reset_resets_the_vmi_in_place(agent: AgentProcess, api: client.ApiClient,
                                                      namespace: str) -> None:
    uid = power_on(agent, api, namespace)
    assert agent.ipmitool("power", "reset").returncode == 0
    assert running_vmi_uid(api, namespace) == uid


def test_ipmitool_power_cycle_starts_a_new_vmi(agent: AgentProcess, api: client.ApiClient, namespace: str) -> None:
    uid = power_on(agent, api, namespace)
    assert agent.ipmitool("power", "cycle").returncode == 0
    wait_for(lambda: running_vmi_uid(api, namespace) not in ("", uid), timeout=10, what="a new running VMI")


def test_ipmitool_power_cycle_of_an_off_vm_starts_it(agent: AgentProcess, api: client.ApiClient,
                                                     namespace: str) -> None:
    assert agent.ipmitool("power", "cycle").returncode == 0
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="a running VMI")


def test_ipmitool_power_diag_is_refused_and_changes_nothing(agent: AgentProcess, api: client.ApiClient,
                                                            namespace: str) -> None:
    uid = power_on(agent, api, namespace)
    result = agent.ipmitool("power", "diag")
    assert result.returncode != 0 and "Invalid data field" in result.stderr
    assert running_vmi_uid(api, namespace) == uid


def test_ipmitool_bootdev_pxe_boots_the_next_vmi_from_the_interface_then_the_disk(
        agent: AgentProcess, api: client.ApiClient, namespace: str) -> None:
    first = power_on(agent, api, namespace)
    assert agent.ipmitool("chassis", "bootdev", "pxe", "options=efiboot").returncode == 0
    assert "Boot Device Selector : Force PXE" in agent.ipmitool("chassis", "bootparam", "get", "5").stdout
    assert agent.ipmitool("power", "cycle").returncode == 0
    second = wait_for(lambda: (u := running_vmi_uid(api, namespace)) not in ("", first) and u, timeout=10,
                      what="the PXE boot")
    assert interface_boot_order(get_vmi(api, namespace)) == 1
    # The Once override is consumed: the template goes back to its original order (no bootOrder: the disk).
    wait_for(lambda: boot_orders(get_vm(api, namespace))["default"] is None, timeout=5, what="the order restored")
    # the agent clears its override record (the VirtualMachineBMC's status) after it restores the VM's order
    wait_for(lambda: "Boot Device Selector : No override" in agent.ipmitool("chassis", "bootparam", "get", "5").stdout,
             timeout=5, what="the override cleared")
    assert agent.ipmitool("power", "cycle").returncode == 0
    wait_for(lambda: running_vmi_uid(api, namespace) not in ("", first, second), timeout=10, what="the next boot")
    assert interface_boot_order(get_vmi(api, namespace)) is None


@pytest.mark.parametrize("command", [
    ("chassis", "bootdev", "pxe"),
    ("raw", "0x00", "0x08", "0x05", "0xa0", "0x04", "0", "0", "0"),  # Ironic's form: the completion code shows
])
def test_ipmitool_bootdev_succeeds_within_the_ipmi_deadline(agent: AgentProcess, api: client.ApiClient,
                                                            namespace: str, command: tuple[str, ...]) -> None:
    # ipmitool exits 0 from `chassis bootdev` even when the BMC answers 0xC0, so look at what it prints.
    # A write that took longer than the IPMI deadline would have been answered Node busy (0xC0): "rsp=0xc0"
    result = agent.ipmitool(*command)
    assert result.returncode == 0 and "failed" not in result.stderr and "rsp=" not in result.stderr, result.stderr
    assert boot_orders(get_vm(api, namespace))["default"] == 1
    assert "Boot Device Selector : Force PXE" in agent.ipmitool("chassis", "bootparam", "get", "5").stdout
    # A second override (the record already exists) is within the deadline too, and so is clearing it.
    result = agent.ipmitool("chassis", "bootdev", "disk", "options=persistent")
    assert result.returncode == 0 and not result.stderr, result.stderr
    result = agent.ipmitool("chassis", "bootdev", "none")
    assert result.returncode == 0 and not result.stderr, result.stderr
    assert boot_orders(get_vm(api, namespace)) == {"root": None, "cdrom": None, "default": None}


def test_ipmitool_persistent_bootdev_survives_boots(agent: AgentProcess, api: client.ApiClient,
                                                    namespace: str) -> None:
    assert agent.ipmitool("chassis", "bootdev", "cdrom", "options=persistent,efiboot").returncode == 0
    power_on(agent, api, namespace)
    vmi = get_vmi(api, namespace)
    assert vmi is not None
    assert {d["name"]: d.get("bootOrder") for d in vmi["spec"]["domain"]["devices"]["disks"]}["cdrom"] == 1
    assert "Options apply to all future boots" in agent.ipmitool("chassis", "bootparam", "get", "5").stdout


# ---- freeipmi and pyghmi


def test_freeipmi_ipmipower_drives_the_vm(agent: AgentProcess, api: client.ApiClient, namespace: str) -> None:
    def ipmipower(*args: str) -> str:
        return subprocess.run(["ipmipower", "-D", "LAN_2_0", "-h", f"127.0.0.1:{agent.ipmi_port}", "-u", USER,
                               "-p", PASSWORD, *args], capture_output=True, text=True, timeout=30).stdout

    assert "127.0.0.1: off" in ipmipower("--stat")
    assert "127.0.0.1: ok" in ipmipower("--on")
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="running")
    assert "127.0.0.1: ok" in ipmipower("--off")
    wait_for(lambda: printable(api, namespace) == "Stopped", timeout=5, what="Stopped")


def test_pyghmi_client_powers_the_vm_on(agent: AgentProcess, api: client.ApiClient, namespace: str) -> None:
    ipmi = pyghmi_command.Command(bmc="127.0.0.1", userid=USER, password=PASSWORD, port=agent.ipmi_port)
    try:
        assert ipmi.get_power()["powerstate"] == "off"
        ipmi.set_power("on")
        wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="running")
        assert ipmi.get_power()["powerstate"] == "on"
    finally:
        ipmi.ipmi_session.logout()


# ---- sushy (Ironic's Redfish library)


@pytest.fixture
def system(agent: AgentProcess) -> Iterator[Any]:
    """The VM's System through sushy with session login; the session is closed while the agent still runs."""
    with sushy_at(agent.url) as root:
        yield root.get_system("/redfish/v1/Systems/vm")


def test_sushy_boot_once_pxe_then_disk(agent: AgentProcess, system: Any, api: client.ApiClient,
        namespace: str) -> None:
    system.reset_system(sushy.ResetType.ON)
    first = wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="running")
    system.set_system_boot_options(sushy.BootSource.PXE, enabled=sushy.BootSourceOverrideEnabled.ONCE,
                                   mode=sushy.BootSourceOverrideMode.UEFI)
    system.refresh()
    assert system.boot.enabled == sushy.BootSourceOverrideEnabled.ONCE
    assert system.boot.target == sushy.BootSource.PXE
    system.reset_system(sushy.ResetType.FORCE_RESTART)
    second = wait_for(lambda: (u := running_vmi_uid(api, namespace)) not in ("", first) and u, timeout=10,
                      what="the PXE boot")
    assert interface_boot_order(get_vmi(api, namespace)) == 1

    def consumed() -> bool:
        system.refresh()
        return bool(system.boot.enabled == sushy.BootSourceOverrideEnabled.DISABLED)

    wait_for(consumed, timeout=5, what="the Once override to be consumed")
    system.reset_system(sushy.ResetType.FORCE_RESTART)  # nothing pending: a reset in place, from disk
    assert running_vmi_uid(api, namespace) == second
    assert interface_boot_order(get_vmi(api, namespace)) == 1, "a reset keeps the running domain"
    system.reset_system(sushy.ResetType.POWER_CYCLE)
    wait_for(lambda: running_vmi_uid(api, namespace) not in ("", first, second), timeout=10, what="next boot")
    assert interface_boot_order(get_vmi(api, namespace)) is None


def test_sushy_force_off_and_graceful_shutdown(agent: AgentProcess, system: Any, api: client.ApiClient,
        namespace: str) -> None:
    system.reset_system(sushy.ResetType.ON)
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="running")
    system.reset_system(sushy.ResetType.FORCE_OFF)
    wait_for(lambda: printable(api, namespace) == "Stopped", timeout=3, what="stopped at once")
    system.reset_system(sushy.ResetType.ON)
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="running again")
    system.reset_system(sushy.ResetType.GRACEFUL_SHUTDOWN)
    wait_for(lambda: printable(api, namespace) == "Stopped", timeout=5, what="shut down")


def test_sushy_graceful_restart_soft_reboots_in_place(agent: AgentProcess, system: Any, api: client.ApiClient,
        namespace: str) -> None:
    system.reset_system(sushy.ResetType.ON)
    uid = wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="running")
    system.reset_system(sushy.ResetType.GRACEFUL_RESTART)
    assert running_vmi_uid(api, namespace) == uid


def test_redfish_push_power_button_pause_and_resume(agent: AgentProcess, api: client.ApiClient,
                                                    namespace: str) -> None:
    action = "/redfish/v1/Systems/vm/Actions/ComputerSystem.Reset"
    assert agent.redfish("POST", action, {"ResetType": "PushPowerButton"})[0] in (200, 202, 204)
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="running")
    assert agent.redfish("POST", action, {"ResetType": "Pause"})[0] in (200, 202, 204)
    wait_for(lambda: printable(api, namespace) == "Paused", timeout=5, what="Paused")
    # the agent's watch hears of Paused a moment after the API server says so
    wait_for(lambda: agent.redfish("GET", "/redfish/v1/Systems/vm")[1]["PowerState"] == "Paused", timeout=5,
             what="the System to read Paused")
    assert agent.redfish("POST", action, {"ResetType": "Resume"})[0] in (200, 202, 204)
    wait_for(lambda: printable(api, namespace) == "Running", timeout=5, what="Running")
    assert agent.redfish("POST", action, {"ResetType": "PushPowerButton"})[0] in (200, 202, 204)
    wait_for(lambda: printable(api, namespace) == "Stopped", timeout=5, what="Stopped")


def test_sushy_virtual_media_inserts_a_datavolume_on_the_cdrom(agent: AgentProcess, system: Any, api: client.ApiClient,
        namespace: str, image_server: Any) -> None:
    image = f"{image_server.base}/installer.iso"
    media = system.virtual_media.get_members()[0]
    media.insert_media(image, inserted=True, write_protected=True)
    volumes = get_vm(api, namespace)["spec"]["template"]["spec"]["volumes"]
    # The VM is off: the medium is part of its next start (not hotplugged: tests/redfish/test_media_tasks.py)
    assert {"name": "cdrom", "dataVolume": {"name": "vm-cdrom"}} in volumes
    dv = call(api, "GET", f"/apis/cdi.kubevirt.io/v1beta1/namespaces/{namespace}/datavolumes/vm-cdrom").body
    assert dv["spec"]["source"]["http"]["url"] == image
    assert dv["metadata"]["ownerReferences"][0]["kind"] == "VirtualMachineBMC"
    media.refresh()
    assert media.inserted and media.image == image
    media.eject_media()
    volumes = get_vm(api, namespace)["spec"]["template"]["spec"]["volumes"]
    assert all(v["name"] != "cdrom" for v in volumes)


def test_redfish_insert_media_on_a_vm_without_a_cdrom_says_why(sim: Sim, api: client.ApiClient, namespace: str,
                                                                bmc_crd: None) -> None:
    make_vm(api, namespace, cdrom=False)
    make_bmc(api, namespace)
    agent = AgentProcess("--namespace", namespace, "--vm", "vm", "--vmbmc", "vm", env={"KUBECONFIG": sim.kubeconfig})
    try:
        wait_for(agent.ready, timeout=20, what="the agent to be ready")
        status, cd = agent.redfish("GET", "/redfish/v1/Systems/vm/VirtualMedia/Cd")
        assert status == 200 and cd["Status"] == {"State": "Absent"}
        action = "/redfish/v1/Systems/vm/VirtualMedia/Cd/Actions/VirtualMedia.InsertMedia"
        status, answer = agent.redfish("POST", action, {"Image": "http://images.example.com/installer.iso",
                                                        "Inserted": True})
        assert status == 400
        assert answer["error"]["@Message.ExtendedInfo"][0]["MessageId"] == "Base.1.19.ActionNotSupported"
        assert answer["error"]["message"].endswith(
            "the VM has no cdrom disk: add an empty cdrom disk to its template to use virtual media")
        assert call(api, "GET", f"/apis/cdi.kubevirt.io/v1beta1/namespaces/{namespace}/datavolumes").body["items"] == []
    finally:
        agent.stop()


def test_sushy_inventory_matches_the_vm(agent: AgentProcess, system: Any, api: client.ApiClient,
        namespace: str) -> None:
    power_on(agent, api, namespace)
    vmi = get_vmi(api, namespace)
    assert vmi is not None
    assert system.uuid == vmi["spec"]["domain"]["firmware"]["uuid"]
    assert system.memory_summary.size_gib == 1
    nics = system.ethernet_interfaces.summary
    assert set(nics) == {i["mac"] for i in vmi["status"]["interfaces"]}
