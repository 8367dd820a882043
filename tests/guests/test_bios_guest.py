"""A real guest behind the BMC: kubesim runs the VM as QEMU (SeaBIOS, under KVM where the host's KVM runs it), and
ipmitool, freeipmi and Redfish clients drive it through an agent. What the firmware and the guest print on the
serial line is the verdict: the device they really booted, the medium the URL served, the ACPI power-off."""

from __future__ import annotations

import contextlib
import signal
import ssl
from collections.abc import Iterator
from pathlib import Path

import pexpect
import pytest
import websocket
from kubernetes import client

from vbmc.web import SCREEN_URI

from ..agent.test_web_consoles import https_login
from ..ipmi.test_sol import OPERATIONAL
from ..sim.test_console import endpoint
from ..support.agents import AgentProcess, free_port, ipmitool_argv, write_serving_certificate
from ..support.cluster import HANG_DEADLINE, Sim, bmc_sim, call, wait_for
from ..support.guests import BOOT_DEADLINE, GUEST_PASSWORD, SHELL, SerialTap, guest_vm, qemu_processes, sim_flags
from ..support.rfb import rfb_over
from ..support.vms import get_vmi, printable
from .conftest import BOOTED, CD, SYSTEM, agent_for, boot_once, eject, insert, ipmi, redfish, reset


@pytest.fixture
def agent(own_sim: Sim, api: client.ApiClient, namespace: str) -> Iterator[AgentProcess]:
    yield from agent_for(own_sim, api, namespace, "bios")


def vmi_uid(api: client.ApiClient, ns: str) -> str:
    vmi = get_vmi(api, ns)
    return str(vmi["metadata"]["uid"]) if vmi and (vmi.get("status") or {}).get("phase") == "Running" else ""


def power_on_to_disk(agent: AgentProcess, tap: SerialTap) -> int:
    since = tap.mark()
    ipmi(agent, "power", "on")
    after = tap.expect(r"SeaBIOS \(version", since)
    return tap.expect(BOOTED.format("disk"), after)


def test_ipmi_boot_devices_once_and_persistent_as_the_firmware_boots_them(
        agent: AgentProcess, tap: SerialTap, api: client.ApiClient, namespace: str) -> None:
    after = power_on_to_disk(agent, tap)
    uid = vmi_uid(api, namespace)
    assert len(qemu_processes(uid)) == 1  # one QEMU per VMI
    # PXE once: iPXE (the NIC's boot ROM, there only with a boot order) loads the boot server's script
    ipmi(agent, "chassis", "bootdev", "pxe")
    ipmi(agent, "power", "reset")
    after = tap.expect(r"iPXE", after)
    after = tap.expect(BOOTED.format("network"), after)
    # Once: the boot after that is the disk's again, and no ROM runs
    ipmi(agent, "power", "reset")
    after = tap.expect(r"SeaBIOS \(version", after)
    after = tap.expect(BOOTED.format("disk"), after)
    assert "iPXE" not in tap.text(after)
    # A CD-ROM first and persistent, with no disc in the drive: SeaBIOS tries it, then the next device
    ipmi(agent, "chassis", "bootdev", "cdrom", "options=persistent")
    ipmi(agent, "power", "reset")
    after = tap.expect(r"(?i)Boot failed: Could not read from CDROM", after)
    after = tap.expect(BOOTED.format("disk"), after)
    assert "booted from network" not in tap.text(after)
    # power off: the VMI's QEMU is killed
    current = vmi_uid(api, namespace)
    ipmi(agent, "power", "off")
    wait_for(lambda: not qemu_processes(current), HANG_DEADLINE, what="QEMU gone after power off")


def test_redfish_boots_the_iso_the_url_serves_once_and_a_blank_one_falls_through(
        agent: AgentProcess, tap: SerialTap, media: str) -> None:
    insert(agent, f"{media}/guest.iso")
    boot_once(agent, "Cd")
    since = tap.mark()
    reset(agent, "On")
    after = tap.expect(BOOTED.format("iso"), since)
    # The medium is the bytes the URL served: the guest reads its own ISO's command line
    after = tap.login(after)
    tap.send(b"cat /proc/cmdline\r")
    after = tap.expect(r"kubevbmc\.medium=iso", after, HANG_DEADLINE)
    # Once: the next boot is the disk's, the ISO still in the drive
    reset(agent, "ForceRestart")
    after = tap.expect(BOOTED.format("disk"), after)
    assert redfish(agent, "GET", CD).json()["Inserted"] is True
    # Ejected while the guest runs, then an ISO that is not bootable: the firmware goes on to the disk
    eject(agent)
    insert(agent, f"{media}/blank.iso")
    boot_once(agent, "Cd")
    reset(agent, "ForceRestart")
    after = tap.expect(r"(?i)Boot failed: (not a bootable disk|could not read)", after)
    text = tap.text(after)
    tap.expect(BOOTED.format("disk"), after)
    assert "booted from iso" not in text


def test_sol_shows_the_firmware_and_the_guest_through_pause_reset_and_an_acpi_power_off(
        agent: AgentProcess, api: client.ApiClient, namespace: str, own_sim: Sim) -> None:
    command = ipmitool_argv("127.0.0.1", agent.ipmi_port, "sol", "activate")
    child = pexpect.spawn(command[0], command[1:], timeout=BOOT_DEADLINE)
    try:
        child.expect_exact(OPERATIONAL)
        ipmi(agent, "power", "on")
        child.expect(r"SeaBIOS \(version")
        child.expect_exact(BOOTED.format("disk"))
        child.expect_exact("kubevbmc-guest login: ")
        child.send("root\r")
        child.expect_exact("Password: ")
        child.send(GUEST_PASSWORD + "\r")
        child.expect_exact(SHELL.decode())
        child.send("echo $((6*7)); cat /sys/class/dmi/id/sys_vendor\r")
        child.expect(r"\r\n42\r\nKubeVirt\r\n", timeout=HANG_DEADLINE)
        uid = vmi_uid(api, namespace)
        # Paused: what is typed waits, and is answered once the guest runs again
        reset(agent, "Pause")
        wait_for(lambda: redfish(agent, "GET", SYSTEM).json()["PowerState"] == "Paused", HANG_DEADLINE,
                 what="Paused")
        child.send("echo resu''med\r")
        reset(agent, "Resume")
        child.expect(r"\r\nresumed\r\n", timeout=HANG_DEADLINE)
        # A reset: the same VMI and QEMU, the firmware from the start
        ipmi(agent, "power", "reset")
        child.expect(r"SeaBIOS \(version")
        child.expect_exact("kubevbmc-guest login: ")
        assert vmi_uid(api, namespace) == uid and len(qemu_processes(uid)) == 1
        # power soft: the ACPI power button, which the guest's acpid turns into a clean power-off
        ipmi(agent, "power", "soft")
        child.expect(r"reboot: Power down")
        wait_for(lambda: not qemu_processes(uid), HANG_DEADLINE, what="QEMU to end with the guest")
        wait_for(lambda: "off" in ipmi(agent, "power", "status"), HANG_DEADLINE, what="power off")
        assert printable(api, namespace) == "Stopped"
        # kubesim saw the guest power itself off; its grace period (60 s) never ran out
        log = [line for line in own_sim.log.read_text().splitlines() if f"vmi {namespace}/vm:" in line]
        assert any("the guest powered off" in line for line in log), log
        assert not any("grace period over" in line for line in log), log
    finally:
        child.kill(signal.SIGKILL)
        child.close()


def test_the_guests_own_reboot_keeps_its_vmi_and_its_power_off_follows_the_run_strategy(
        api: client.ApiClient, namespace: str, tap: SerialTap) -> None:
    guest_vm(api, namespace, run_strategy="Always")
    after = tap.login(tap.expect(BOOTED.format("disk")))
    uid = wait_for(lambda: vmi_uid(api, namespace), HANG_DEADLINE, what="the VMI running")
    # `reboot` inside the guest: the firmware again, in the same VMI and the same QEMU
    tap.send(b"reboot\r")
    after = tap.expect(r"SeaBIOS \(version", after)
    after = tap.login(tap.expect(BOOTED.format("disk"), after))
    assert vmi_uid(api, namespace) == uid and len(qemu_processes(uid)) == 1
    # `poweroff` under Always: the VMI ends and a new one starts
    tap.send(b"poweroff\r")
    after = tap.expect(r"reboot: Power down", after)
    second = wait_for(lambda: (u := vmi_uid(api, namespace)) != uid and u, BOOT_DEADLINE, what="a new VMI")
    assert not qemu_processes(uid)
    after = tap.login(tap.expect(BOOTED.format("disk"), after))
    # under Manual: the VMI ends (Succeeded) and the VM stays off
    reply = call(api, "PATCH", f"/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachines/vm",
                 {"spec": {"runStrategy": "Manual"}}, content_type="application/merge-patch+json")
    assert reply.status == 200, reply.body
    tap.send(b"poweroff\r")
    tap.expect(r"reboot: Power down", after)
    wait_for(lambda: printable(api, namespace) == "Stopped", HANG_DEADLINE, what="the VM stopped")
    wait_for(lambda: not qemu_processes(second), HANG_DEADLINE, what="its QEMU gone")
    vmi = get_vmi(api, namespace)
    assert vmi is None or vmi["status"]["phase"] == "Succeeded"


def test_the_pages_screen_is_the_guests_own_screen(
        own_sim: Sim, api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    """The BMC page's screen (the agent's screen WebSocket, an RFB server fed by the VMI's `vnc`, which is QEMU's
    VNC server): what the guest draws on its console shows there."""
    cert, key = write_serving_certificate(tmp_path)
    https = free_port()
    with contextlib.ExitStack() as stack:
        agent = stack.enter_context(contextlib.contextmanager(agent_for)(
            own_sim, api, namespace, "bios", "--redfish-tls-address", f"127.0.0.1:{https}", "--tls-cert", str(cert),
            "--tls-key", str(key)))
        kube = endpoint(own_sim.kubeconfig)
        tap = SerialTap(kube.url, kube.token, kube.tls, namespace)
        stack.callback(tap.close)
        after = tap.login(power_on_to_disk(agent, tap))
        tls = ssl.create_default_context(cafile=str(cert))
        status, _, headers = https_login(f"https://127.0.0.1:{https}", tls)
        assert status == 201
        screen = websocket.create_connection(f"wss://127.0.0.1:{https}{SCREEN_URI}", sslopt={"context": tls},
                                             subprotocols=["binary", f"x-auth-token.{headers['X-Auth-Token']}"],
                                             timeout=10)
        stack.callback(screen.close)

        viewer = rfb_over(screen)
        viewer.handshake()
        assert (viewer.width, viewer.height) == (720, 400)  # QEMU's VGA in text mode: 80x25 cells of 9x16

        def lit_share() -> float:
            viewer.refresh(timeout=HANG_DEADLINE)
            return viewer.lit() / (viewer.width * viewer.height)

        tap.send(b"printf '\\033[2J\\033[H' > /dev/tty1\r")  # the guest clears its screen
        wait_for(lambda: lit_share() < 0.01, HANG_DEADLINE, what="a blank screen")
        tap.send(b"for i in $(seq 24); do printf '%080d' 8; done > /dev/tty1\r")  # and fills it with 0s and 8s
        wait_for(lambda: lit_share() > 0.15, HANG_DEADLINE, what="the screen filled")
        tap.expect(SHELL, after, HANG_DEADLINE)


def test_no_qemu_outlives_its_vm_or_a_killed_kubesim(
        tmp_path: Path, images: Path, namespace: str) -> None:
    with bmc_sim(tmp_path / "sim", *sim_flags(images)) as sim:
        api = sim.api()
        call(api, "POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
        # A short grace period: deleted before its guest is up, the firmware ignores the power button
        guest_vm(api, namespace, "vm", run_strategy="Always", grace=3)
        wait_for(lambda: vmi_uid(api, namespace), BOOT_DEADLINE, what="the VMI running")
        uid = vmi_uid(api, namespace)
        wait_for(lambda: qemu_processes(uid), HANG_DEADLINE, what="its QEMU")
        # the VM deleted: its QEMU goes (the ACPI shutdown, or the kill at the end of the grace period)
        assert call(api, "DELETE", f"/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachines/vm").status == 200
        wait_for(lambda: not qemu_processes(uid), HANG_DEADLINE * 2, what="QEMU gone with the VM")
        guest_vm(api, namespace, "second", run_strategy="Always", grace=3)
        wait_for(lambda: vmi_uid_named(api, namespace, "second"), BOOT_DEADLINE, what="a second VMI running")
        second = vmi_uid_named(api, namespace, "second")
        wait_for(lambda: qemu_processes(second), HANG_DEADLINE, what="its QEMU")
        # kubesim killed outright: no chance to stop anything, and still no QEMU survives it
        sim.process.send_signal(signal.SIGKILL)
        sim.process.wait(HANG_DEADLINE)
        wait_for(lambda: not qemu_processes(second), HANG_DEADLINE, what="QEMU gone with kubesim")


def vmi_uid_named(api: client.ApiClient, ns: str, name: str) -> str:
    vmi = get_vmi(api, ns, name)
    return str(vmi["metadata"]["uid"]) if vmi and (vmi.get("status") or {}).get("phase") == "Running" else ""
