"""BIOS settings, boot progress and firmware versions, in BMC terms: what a machine's setup screen would offer.

Each attribute is a setting of the machine that its next boot applies (KubeVirt: a field of the VM template, read
at the next VMI's creation), so a change is pending until the next power-on or reset, as on a physical server.
This module is pure: the attribute registry (names, types, allowed values, defaults), the check of a requested
change against the settings it lands on (a refusal says why), and the values the backends report. Which VM field
each attribute is lives in the backend (vbmc/machine/kubevirt/bios.py); docs/reference.md lists them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .errors import InvalidRequest

ENABLED, DISABLED = "Enabled", "Disabled"
UEFI, BIOS = "Uefi", "Bios"
SWITCH = (ENABLED, DISABLED)

Value = str | int | bool


@dataclass(frozen=True)
class Attribute:
    """One attribute of the registry (Redfish AttributeRegistry's Attributes[])."""

    name: str
    display: str
    help: str
    values: tuple[str, ...] = SWITCH  # an Enumeration's values; () for a String
    default: Value | None = None  # what a machine that states nothing gets (KubeVirt's defaults); None: none
    read_only: bool = False

    @property
    def type(self) -> str:
        return "Enumeration" if self.values else "String"


ATTRIBUTES: tuple[Attribute, ...] = (
    Attribute("BootMode", "Boot mode", "The firmware the machine boots: Uefi (OVMF) or Bios (SeaBIOS).",
              (UEFI, BIOS), BIOS),
    Attribute("SecureBoot", "UEFI secure boot", "UEFI secure boot with the Microsoft keys enrolled. Needs the boot "
              "mode Uefi and SMM (turned on with it unless Smm is Disabled in the same request).", default=DISABLED),
    Attribute("Smm", "System Management Mode", "The processors' System Management Mode (secure boot needs it).",
              default=DISABLED),
    Attribute("TpmDevice", "TPM device", "An emulated TPM 2.0 device.", default=DISABLED),
    Attribute("SerialPort", "Serial port", "The serial port (COM1): the serial console and IPMI Serial over LAN "
              "attach to it.", default=ENABLED),
    Attribute("SerialConsoleRedirection", "BIOS output on the serial port", "SeaBIOS writes its output to the "
              "serial port too; a setting of the boot mode Bios only.", default=DISABLED),
    Attribute("MachineType", "Machine type", "The emulated chipset (read-only).", (), read_only=True),
    Attribute("SystemUuid", "System UUID", "The SMBIOS system UUID (read-only).", (), read_only=True),
    Attribute("SystemSerialNumber", "System serial number", "The SMBIOS serial number (read-only).", (),
              read_only=True),
)
BY_NAME = {a.name: a for a in ATTRIBUTES}
WRITABLE = tuple(a.name for a in ATTRIBUTES if not a.read_only)
DEFAULTS: dict[str, Value] = {a.name: a.default for a in ATTRIBUTES if a.default is not None}

REGISTRY_ID = "KubeVBMCBiosAttributes.1.0.0"  # Bios.AttributeRegistry: the registry's Id
REGISTRY_NAME = "KubeVBMCBiosAttributes.1.0"  # MessageRegistryFile.Registry: name, major and minor version


class RefusedSetting(InvalidRequest):
    """A requested value that cannot be applied; `attribute` names it, `kind` says how (Redfish message key)."""

    def __init__(self, attribute: str, kind: str, reason: str, value: Any = None, other: str = "") -> None:
        super().__init__(reason)
        self.attribute = attribute
        self.kind = kind  # "unknown", "read-only", "not-in-list", "conflict"
        self.value = value
        self.other = other  # for a conflict: the attribute it conflicts with


def check(current: Mapping[str, Value], requested: Mapping[str, Any]) -> dict[str, Value]:
    """The settings `requested` leads to from `current`, checked: raises RefusedSetting with the reason when a value
    is unknown, read-only, not allowed, or cannot be applied together with the others. SecureBoot Enabled turns Smm
    on when the request does not say otherwise (KubeVirt refuses secure boot without SMM)."""
    for name, value in requested.items():
        attribute = BY_NAME.get(name)
        if attribute is None:
            raise RefusedSetting(name, "unknown", f"{name} is not an attribute of this BIOS "
                                                  f"(see the attribute registry {REGISTRY_ID})")
        if attribute.read_only:
            raise RefusedSetting(name, "read-only", f"{name} is read-only: {attribute.help}")
        if value not in attribute.values:
            raise RefusedSetting(name, "not-in-list", f"{name} takes {' or '.join(attribute.values)}", value)
    result = dict(current) | dict(requested)
    # A switch of the boot mode takes the other firmware's settings with it, unless the request states them.
    if result.get("BootMode") == BIOS and "SecureBoot" not in requested:
        result["SecureBoot"] = DISABLED  # SeaBIOS has no secure boot
    if result.get("BootMode") == UEFI and "SerialConsoleRedirection" not in requested:
        result["SerialConsoleRedirection"] = DISABLED  # bios.useSerial goes with the bios bootloader
    if result.get("SecureBoot") == ENABLED:
        if result.get("BootMode") != UEFI:
            raise RefusedSetting("SecureBoot", "conflict", "SecureBoot needs the boot mode Uefi: set BootMode to "
                                 "Uefi in the same request, or first", ENABLED, "BootMode")
        if result.get("Smm") != ENABLED:
            if requested.get("Smm") == DISABLED:
                raise RefusedSetting("Smm", "conflict", "secure boot needs SMM: KubeVirt refuses a VM with secure "
                                     "boot and SMM disabled", DISABLED, "SecureBoot")
            result["Smm"] = ENABLED
    if result.get("SerialConsoleRedirection") == ENABLED and result.get("BootMode") != BIOS:
        raise RefusedSetting("SerialConsoleRedirection", "conflict", "SerialConsoleRedirection is a SeaBIOS setting "
                             "(bios.useSerial): it needs the boot mode Bios", ENABLED, "BootMode")
    if result.get("SerialConsoleRedirection") == ENABLED and result.get("SerialPort") == DISABLED:
        # libvirt's serial graphics adapter needs a serial port: "need at least one serial port to use SGA"
        raise RefusedSetting("SerialConsoleRedirection", "conflict", "SerialConsoleRedirection writes to the serial "
                             "port: it needs SerialPort Enabled", ENABLED, "SerialPort")
    return result


def factory_defaults() -> dict[str, Value]:
    """What Bios.ResetBios asks for: every writable attribute at its default (KubeVirt's, for a VM that states
    nothing)."""
    return {name: DEFAULTS[name] for name in WRITABLE}


class BootProgressState(StrEnum):
    """Redfish BootProgressTypes this service reports (ComputerSystem v1_13_0)."""

    NONE = "None"
    PRIMARY_PROCESSOR = "PrimaryProcessorInitializationStarted"
    HARDWARE_COMPLETE = "SystemHardwareInitializationComplete"
    OS_BOOT_STARTED = "OSBootStarted"
    OS_RUNNING = "OSRunning"


@dataclass(frozen=True)
class BootProgress:
    state: BootProgressState = BootProgressState.NONE
    since: str | None = None  # RFC 3339 time the state was reached, when known


@dataclass(frozen=True)
class SettingsResult:
    """The last application of pending settings: when, and what each message said (Severity OK when applied)."""

    time: str
    messages: tuple[tuple[str, str, str], ...] = ()  # (severity, attribute or "", text)


@dataclass(frozen=True)
class BiosState:
    """The BIOS as a BMC reports it: the settings in force for the next boot, the pending ones (applied at the
    next power-on or reset), the result of the last application."""

    current: tuple[tuple[str, Value], ...]
    pending: tuple[tuple[str, Value], ...] = ()
    applied: SettingsResult | None = None
    reset_pending: bool = False  # a ResetBios waits for the next boot

    @property
    def attributes(self) -> dict[str, Value]:
        return dict(self.current)

    @property
    def pending_attributes(self) -> dict[str, Value]:
        return dict(self.pending)


@dataclass(frozen=True)
class FirmwareImage:
    """A firmware the machine or its BMC runs (Redfish SoftwareInventory)."""

    id: str
    name: str
    version: str | None
    description: str = ""
    updateable: bool = False
    related: tuple[str, ...] = field(default=())  # "system", "manager": what runs it


def firmware_name(mode: str, secure_boot: bool) -> str:
    """The firmware a KubeVirt VM boots: SeaBIOS for BIOS, OVMF (edk2) for UEFI, its secure-boot build with secure
    boot (virt-launcher's /usr/share/OVMF/OVMF_CODE.secboot.fd)."""
    if mode == UEFI:
        return "OVMF (edk2), secure boot build" if secure_boot else "OVMF (edk2)"
    return "SeaBIOS"
