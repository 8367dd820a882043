"""UEFI guests behind the BMC: OVMF (under KVM where the host's KVM runs it, else QEMU's TCG) with the VM's own
variable store; secure boot with Microsoft's keys enrolled and SMM on, set through Redfish: Debian's signed chain
(shim, GRUB, kernel) boots, the unsigned ISO is refused by the firmware; a UEFI network boot through IPMI's
`options=efiboot`; UEFI HTTP boot (Redfish's `UefiHttp` with `HttpBootUri`) boots the image at the URI."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client

from ..support.agents import AgentProcess
from ..support.cluster import Sim, wait_for
from ..support.guests import SerialTap
from ..support.vms import get_vm, get_vmi
from .conftest import BOOTED, SYSTEM, agent_for, boot_once, eject, insert, ipmi, redfish, reset

# Secure boot refusing a loader: OVMF's boot manager reports the load failing with EFI_SECURITY_VIOLATION,
# "Access Denied" (MdeModulePkg BdsDxe: "BdsDxe: failed to load Boot0001 ...: Access Denied").
REFUSED = r"Access Denied|Security Violation"


@pytest.fixture
def efi_agent(own_sim: Sim, api: client.ApiClient, namespace: str) -> Iterator[AgentProcess]:
    yield from agent_for(own_sim, api, namespace, "efi")


def test_secure_boot_boots_the_signed_chain_and_ovmf_refuses_the_unsigned_iso(
        efi_agent: AgentProcess, tap: SerialTap, media: str, api: client.ApiClient, namespace: str) -> None:
    reply = redfish(efi_agent, "PATCH", f"{SYSTEM}/SecureBoot", {"SecureBootEnable": True})
    assert reply.status_code in (200, 204), reply.text
    domain = get_vm(api, namespace)["spec"]["template"]["spec"]["domain"]
    assert domain["firmware"]["bootloader"]["efi"]["secureBoot"] is True
    insert(efi_agent, f"{media}/signed.iso")
    boot_once(efi_agent, "Cd", "UEFI")
    since = tap.mark()
    reset(efi_agent, "On")
    after = tap.expect(BOOTED.format("signed-iso"), since)
    after = tap.expect(r"KUBEVBMC-GUEST: firmware uefi secureboot on", after)
    vmi = get_vmi(api, namespace)
    assert vmi is not None and vmi["spec"]["domain"]["features"]["smm"].get("enabled", True) is not False
    assert redfish(efi_agent, "GET", f"{SYSTEM}/SecureBoot").json()["SecureBootCurrentBoot"] == "Enabled"
    # The unsigned ISO (GRUB from grub-mkrescue): OVMF will not run its loader
    eject(efi_agent)
    insert(efi_agent, f"{media}/guest.iso")
    boot_once(efi_agent, "Cd", "UEFI")
    reset(efi_agent, "ForceRestart")
    after = tap.expect(REFUSED, after)
    assert "booted from iso" not in tap.text(after)


def test_without_secure_boot_ovmf_boots_the_unsigned_iso(
        efi_agent: AgentProcess, tap: SerialTap, media: str) -> None:
    insert(efi_agent, f"{media}/guest.iso")
    boot_once(efi_agent, "Cd", "UEFI")
    since = tap.mark()
    reset(efi_agent, "On")
    after = tap.expect(BOOTED.format("iso"), since)
    tap.expect(r"KUBEVBMC-GUEST: firmware uefi secureboot off", after)
    assert redfish(efi_agent, "GET", f"{SYSTEM}/SecureBoot").json()["SecureBootCurrentBoot"] == "Disabled"


def test_ipmi_bootdev_pxe_efiboot_boots_the_uefi_network_loader(efi_agent: AgentProcess, tap: SerialTap) -> None:
    ipmi(efi_agent, "chassis", "bootdev", "pxe", "options=efiboot")
    since = tap.mark()
    ipmi(efi_agent, "power", "on")
    after = tap.expect(BOOTED.format("network"), since)
    tap.expect(r"KUBEVBMC-GUEST: firmware uefi", after)


def test_uefi_http_boot_boots_the_image_at_its_uri(efi_agent: AgentProcess, tap: SerialTap, media: str) -> None:
    """As Ironic's redfish-https boot interface sets it: no medium inserted first; the image at HttpBootUri is what
    OVMF boots, once."""
    reply = redfish(efi_agent, "PATCH", SYSTEM, {"Boot": {
        "BootSourceOverrideTarget": "UefiHttp", "BootSourceOverrideEnabled": "Once",
        "HttpBootUri": f"{media}/guest.iso"}})
    assert reply.status_code in (200, 204), reply.text
    since = tap.mark()
    reset(efi_agent, "On")
    after = tap.expect(BOOTED.format("iso"), since)
    tap.expect(r"KUBEVBMC-GUEST: firmware uefi", after)
    # once: the boot consumed the override
    wait_for(lambda: redfish(efi_agent, "GET", SYSTEM).json()["Boot"]["BootSourceOverrideEnabled"] == "Disabled",
             60, what="the UefiHttp override consumed by the boot")
