"""The management systems' own IPMI command lines against an agent on kubesim, where power matters: MAAS's
(freeipmi: ipmi-chassis-config and ipmipower, canonical/maas src/provisioningserver/drivers/power/ipmi.py),
Tinkerbell's bmclib ipmitool provider (bmc-toolbox/bmclib internal/ipmi/ipmi.go), and what a script sees right after
a command: `power status` after `power on`, the SEL, POH, the restart cause and the LAN address."""

from __future__ import annotations

import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from ..support.agents import PASSWORD, USER, AgentProcess, agent_for_vm
from ..support.cluster import Sim, bmc_sim, call, wait_for
from ..support.vms import get_vm, get_vmi, printable, running_vmi_uid

SUBRESOURCES = "/apis/subresources.kubevirt.io/v1/namespaces/{ns}/virtualmachines/vm/{action}"


@pytest.fixture
def agent(sim: Sim, api: client.ApiClient, namespace: str, bmc_crd: None) -> Iterator[AgentProcess]:
    with agent_for_vm(sim, api, namespace) as process:
        yield process



def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"{result.args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


# ---- power status right after power on


@pytest.fixture(scope="module")
def slow_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    """A cluster whose VMs take 2 s from start to Running, as a real one takes longer still."""
    with bmc_sim(tmp_path_factory.mktemp("kubesim-slow"), "--vm-start-delay", "2", "--vm-stop-delay", "0.5",
                 "--bookmark-interval", "0.5") as s:
        yield s


def test_power_status_says_on_right_after_power_on_while_redfish_says_powering_on(slow_sim: Sim) -> None:
    api = slow_sim.api()
    ns = f"t-{uuid.uuid4().hex[:8]}"
    client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    with agent_for_vm(slow_sim, api, ns) as agent:
        assert "Chassis Power is off" in ok(agent.ipmitool("power", "status"))
        assert "Chassis Power Control: Up/On" in ok(agent.ipmitool("power", "on"))
        assert "Chassis Power is on" in ok(agent.ipmitool("power", "status"))  # at once, the VM still starting
        status, system = agent.redfish("GET", "/redfish/v1/Systems/vm")
        assert status == 200 and system["PowerState"] == "PoweringOn"  # Redfish stays truthful
        assert printable(api, ns) != "Running"
        wait_for(lambda: printable(api, ns) == "Running", timeout=10, what="Running")
        assert "Chassis Power is on" in ok(agent.ipmitool("power", "status"))
        assert "Chassis Power Control: Down/Off" in ok(agent.ipmitool("power", "off"))
        wait_for(lambda: printable(api, ns) == "Stopped", timeout=10, what="Stopped")
        # the agent's watch hears of Stopped a moment after the API server says so
        wait_for(lambda: "Chassis Power is off" in ok(agent.ipmitool("power", "status")), timeout=5, what="off")


def test_a_vm_started_elsewhere_reads_off_until_it_runs(slow_sim: Sim) -> None:
    api = slow_sim.api()
    ns = f"t-{uuid.uuid4().hex[:8]}"
    client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    with agent_for_vm(slow_sim, api, ns) as agent:
        reply = call(api, "PUT", SUBRESOURCES.format(ns=ns, action="start"), {})
        assert reply.status == 202, reply.body
        wait_for(lambda: printable(api, ns) not in ("Stopped", ""), timeout=5, what="starting")
        assert "Chassis Power is off" in ok(agent.ipmitool("power", "status"))  # nobody pressed this BMC's button
        wait_for(lambda: "Chassis Power is on" in ok(agent.ipmitool("power", "status")), timeout=10, what="on")
        assert "System restart cause: unknown" in ok(agent.ipmitool("chassis", "restart_cause"))


# ---- SEL, POH, restart cause, sensors and LAN on a real power cycle


def test_the_bmc_reads_follow_the_vm_on_kubesim(agent: AgentProcess, api: client.ApiClient,
                                                namespace: str) -> None:
    ok(agent.ipmitool("power", "on"))
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="a running VMI")
    assert "chassis power control command" in ok(agent.ipmitool("chassis", "restart_cause"))
    assert "POH Counter  : 0 days, 0 hours" in ok(agent.ipmitool("chassis", "poh"))
    wait_for(lambda: "S0/G0: working" in ok(agent.ipmitool("sdr", "elist")), timeout=5, what="the ACPI sensor")
    reply = call(api, "PUT", SUBRESOURCES.format(ns=namespace, action="stop"), {})  # kubectl/virtctl stop
    assert reply.status == 202, reply.body
    wait_for(lambda: printable(api, namespace) == "Stopped", timeout=10, what="Stopped")
    def acpi_events() -> list[str]:
        return [line.split("|")[4].strip() for line in ok(agent.ipmitool("sel", "elist")).splitlines()
                if "ACPI Pwr State" in line]

    # the agent's watch sees the VM stop a moment after the API server says so
    wait_for(lambda: acpi_events()[-1:] == ["S5/G2: soft-off"], timeout=5, what="the power-off SEL entry")
    assert acpi_events() == ["S0/G0: working", "S5/G2: soft-off"]
    fru = ok(agent.ipmitool("fru", "print", "0"))
    uid = get_vm(api, namespace)["metadata"]["uid"]
    assert re.search(rf"Product Serial\s+: {uid}", fru)  # no firmware serial: the VM's UID


def test_lan_print_reports_the_service_address_from_the_virtualmachinebmc(agent: AgentProcess,
                                                                         api: client.ApiClient,
                                                                         namespace: str) -> None:
    path = f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{namespace}/virtualmachinebmcs/vm"

    def shown() -> str:
        found = re.search(r"IP Address\s+: (\S+)", ok(agent.ipmitool("lan", "print", "1")))
        return found.group(1) if found else ""

    def recorded() -> str:
        return str(((call(api, "GET", path).body or {}).get("status") or {}).get("clusterIP") or "")

    if not recorded():  # no controller in this run has given the BMC a Service: the agent's own address
        assert shown() == "127.0.0.1"
        reply = call(api, "PATCH", f"{path}/status", {"status": {"clusterIP": "127.2.200.7"}},
                     content_type="application/merge-patch+json")
        assert reply.status == 200, reply.body
    wait_for(lambda: shown() == recorded() != "", timeout=5, what="the Service address from the status")


# ---- MAAS

MAAS_CONFIG = """\
Section Chassis_Boot_Flags
        Boot_Flags_Persistent                         No
        BIOS_Boot_Type                                %s
        Boot_Device                                   PXE
EndSection
"""


def maas(agent: AgentProcess, tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    """A command as MAAS's IPMI power driver builds it: workaround flags, driver, host, user, password, cipher
    suite, privilege level (its defaults: opensesspriv, LAN_2_0, suite 3, OPERATOR)."""
    return subprocess.run([tool, "-W", "opensesspriv", "--driver-type", "LAN_2_0", "-h",
                           f"127.0.0.1:{agent.ipmi_port}", "-u", USER, "-p", PASSWORD, "-I", "3", "-l", "OPERATOR",
                           *args], capture_output=True, text=True, timeout=60)


def maas_state(result: subprocess.CompletedProcess[str]) -> str:
    """What MAAS reads from ipmipower's output (`:\\s*(on|off)`, else the whole output)."""
    ok(result)
    match = re.search(r":\s*(on|off)", result.stdout)
    return result.stdout if match is None else match.group(1)


def vmi_boots_from_the_network(vmi: dict[str, Any] | None) -> bool:
    assert vmi is not None
    return bool(vmi["spec"]["domain"]["devices"]["interfaces"][0].get("bootOrder") == 1)


@pytest.mark.parametrize(("boot_type", "bootloader"), [("EFI", "efi"), ("PC-COMPATIBLE", "bios")])
def test_maas_power_driver_command_lines(agent: AgentProcess, api: client.ApiClient, namespace: str,
                                         tmp_path: Path, boot_type: str, bootloader: str) -> None:
    assert maas_state(maas(agent, "ipmipower", "--stat")) == "off"
    # power on: the chassis config (PXE next boot, the boot type), then cycle or on
    config = tmp_path / "maas.cfg"
    config.write_text(MAAS_CONFIG % boot_type)
    result = maas(agent, "ipmi-chassis-config", "--commit", "--filename", str(config))
    ok(result)
    assert "password invalid" not in result.stderr
    checkout = ok(maas(agent, "ipmi-chassis-config", "--checkout", "-S", "Chassis_Boot_Flags"))
    assert re.search(rf"BIOS_Boot_Type\s+{boot_type}", checkout) and re.search(r"Boot_Device\s+PXE", checkout)
    assert "ok" in maas_state(maas(agent, "ipmipower", "--cycle", "--on-if-off"))
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="a running VMI")
    assert vmi_boots_from_the_network(get_vmi(api, namespace))
    # the boot MAAS asked for ran with the firmware it asked for (a one-time change: the VM's template gets its
    # own back once the boot is consumed, docs/reference.md "A one-time firmware change lasts one boot")
    firmware = get_vmi(api, namespace)["spec"]["domain"].get("firmware") or {}  # type: ignore[index]
    assert bootloader in (firmware.get("bootloader") or {})
    assert maas_state(maas(agent, "ipmipower", "--stat")) == "on"
    # power off, soft: an ACPI shutdown
    assert "ok" in maas_state(maas(agent, "ipmipower", "--soft"))
    wait_for(lambda: printable(api, namespace) == "Stopped", timeout=10, what="Stopped")
    # the agent's watch hears of Stopped a moment after the API server says so
    wait_for(lambda: maas_state(maas(agent, "ipmipower", "--stat")) == "off", timeout=5, what="off")
    # power on again (cycle of an off machine powers it on), then the hard power off
    assert "ok" in maas_state(maas(agent, "ipmipower", "--cycle", "--on-if-off"))
    wait_for(lambda: printable(api, namespace) == "Running", timeout=10, what="Running")
    assert "ok" in maas_state(maas(agent, "ipmipower", "--off"))
    wait_for(lambda: printable(api, namespace) == "Stopped", timeout=10, what="Stopped")
    wait_for(lambda: maas_state(maas(agent, "ipmipower", "--stat")) == "off", timeout=5, what="off")


# ---- Tinkerbell bmclib (Rufio)


def bmclib(agent: AgentProcess, cipher: str, *command: str) -> str:
    """One ipmitool run as bmclib's ipmitool provider makes it: the password in IPMITOOL_PASSWORD (-E) and nothing
    else in the environment, -N 5, the cipher suite it is trying."""
    result = subprocess.run(["/usr/bin/ipmitool", "-I", "lanplus", "-U", USER, "-E", "-N", "5", "-H", "127.0.0.1",
                             "-p", str(agent.ipmi_port), "-C", cipher, *command], capture_output=True, text=True,
                            timeout=60, env={"IPMITOOL_PASSWORD": PASSWORD})
    assert result.returncode == 0, f"{command}: {result.stdout}{result.stderr}"
    return result.stdout + result.stderr  # bmclib reads the combined output


@pytest.mark.parametrize("cipher", ["17", "3"])  # bmclib tries 17 then falls back to 3 (older releases: 3, 17)
def test_bmclib_ipmitool_provider(agent: AgentProcess, api: client.ApiClient, namespace: str, cipher: str) -> None:
    assert "Chassis Power is off" in bmclib(agent, cipher, "chassis", "power", "status")  # IsOn
    assert "Set Boot Device to pxe" in bmclib(agent, cipher, "chassis", "bootdev", "pxe", "options=efiboot")
    assert bmclib(agent, cipher, "chassis", "power", "on").startswith("Chassis Power Control: Up/On")
    assert bmclib(agent, cipher, "chassis", "power", "status").startswith("Chassis Power is on")  # at once
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="a running VMI")
    assert vmi_boots_from_the_network(get_vmi(api, namespace))
    assert bmclib(agent, cipher, "chassis", "power", "reset").startswith("Chassis Power Control: Reset")
    assert bmclib(agent, cipher, "chassis", "power", "cycle").startswith("Chassis Power Control: Cycle")
    assert bmclib(agent, cipher, "channel", "getciphers", "ipmi").startswith("ID   IANA")
    wait_for(lambda: printable(api, namespace) == "Running", timeout=10, what="Running after the cycle")
    assert "Chassis Power Control: Down/Off" in bmclib(agent, cipher, "chassis", "power", "off")
    wait_for(lambda: printable(api, namespace) == "Stopped", timeout=10, what="Stopped")
    # the agent's watch hears of Stopped a moment after the API server says so
    wait_for(lambda: bmclib(agent, cipher, "chassis", "power", "status").startswith("Chassis Power is off"),
             timeout=5, what="off")
