"""What a BMC reports about a KubeVirt VM, computed from the VM and VMI objects (pure functions)."""

from __future__ import annotations

import datetime
import re
import uuid
from typing import Any

from .machine import BootMode, Disk, Health, HealthState, Inventory, Nic, PowerState

Obj = dict[str, Any]

# KubeVirt's namespace for firmware UUIDs it derives from the VM name (CalculateLegacyUUID).
FIRMWARE_UUID_NAMESPACE = uuid.UUID("6a1a24a1-4061-4607-8bf4-a3963d0c5895")

_ON = {"Running", "Migrating"}
_POWERING_OFF = {"Stopping", "Terminating"}
_POWERING_ON = {"Starting", "Provisioning", "WaitingForVolumeBinding", "WaitingForReceiver"}
_OFF = {"Stopped", "CrashLoopBackOff", "DataVolumeError", "ErrorPvcNotFound", ""}
# Error states in which the VM should run but cannot (yet): powering on, with a Warning.
_START_ERRORS = {"ErrorUnschedulable", "ErrImagePull", "ImagePullBackOff", "ErrorDataVolumeNotFound", "Unknown"}


def _conditions(obj: Obj | None) -> dict[str, Obj]:
    return {c.get("type", ""): c for c in ((obj or {}).get("status") or {}).get("conditions") or []}


def is_paused(vmi: Obj | None) -> bool:
    return _conditions(vmi).get("Paused", {}).get("status") == "True"


def printable_status(vm: Obj) -> str:
    return str((vm.get("status") or {}).get("printableStatus") or "")


def power_state(vm: Obj, vmi: Obj | None) -> PowerState:
    status = printable_status(vm)
    if status == "Paused" or (status in _ON and is_paused(vmi)):
        return PowerState.PAUSED
    if status in _ON:
        return PowerState.ON
    if status in _POWERING_OFF:
        return PowerState.POWERING_OFF
    if status in _POWERING_ON or status in _START_ERRORS:
        return PowerState.POWERING_ON
    return PowerState.OFF


def health(vm: Obj) -> Health:
    status = printable_status(vm)
    if status in _START_ERRORS or status in ("CrashLoopBackOff", "DataVolumeError", "ErrorPvcNotFound"):
        failure = _conditions(vm).get("Failure", {})
        return Health(HealthState.WARNING, failure.get("message") or f"VM status is {status}")
    return Health()


_QUANTITY = re.compile(r"^([0-9.]+)([KMGTPE]i?|[mk]?)$")
_FACTORS = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
            "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60, "m": 1}


def quantity_bytes(value: Any) -> int:
    """A Kubernetes quantity ("2Gi", "512M", 1073741824) in bytes; 0 when absent or unreadable."""
    if isinstance(value, (int, float)):
        return int(value)
    m = _QUANTITY.match(str(value or "").strip())
    if not m:
        return 0
    number = float(m.group(1))
    if m.group(2) == "m":
        return int(number / 1000)
    return int(number * _FACTORS[m.group(2)])


def template_spec(vm: Obj) -> Obj:
    return ((vm.get("spec") or {}).get("template") or {}).get("spec") or {}


def boot_mode(spec: Obj) -> BootMode:
    bootloader = ((spec.get("domain") or {}).get("firmware") or {}).get("bootloader") or {}
    # No bootloader means BIOS, KubeVirt's default.
    return BootMode.UEFI if "efi" in bootloader else BootMode.LEGACY


def secure_boot(spec: Obj) -> bool:
    efi = (((spec.get("domain") or {}).get("firmware") or {}).get("bootloader") or {}).get("efi")
    # KubeVirt enables secure boot by default when EFI is used.
    return isinstance(efi, dict) and efi.get("secureBoot", True) is not False


def system_uuid(vm: Obj, vmi: Obj | None) -> str:
    for spec in ((vmi or {}).get("spec") or {}, template_spec(vm)):
        value = ((spec.get("domain") or {}).get("firmware") or {}).get("uuid")
        if value:
            return str(value)
    return str(uuid.uuid5(FIRMWARE_UUID_NAMESPACE, str((vm.get("metadata") or {}).get("name") or "")))


def inventory(vm: Obj, vmi: Obj | None) -> Inventory:
    spec = template_spec(vm)
    domain = spec.get("domain") or {}
    cpu = domain.get("cpu") or {}
    memory = quantity_bytes((domain.get("memory") or {}).get("guest")) or quantity_bytes(
        ((domain.get("resources") or {}).get("requests") or {}).get("memory"))
    seen_macs = {i.get("name"): i.get("mac") for i in ((vmi or {}).get("status") or {}).get("interfaces") or []}
    devices = domain.get("devices") or {}
    nics = tuple(Nic(i["name"], str(i.get("macAddress") or seen_macs.get(i["name"]) or ""))
                 for i in devices.get("interfaces") or [])
    disks = tuple(Disk(d["name"], "cdrom" if "cdrom" in d else "disk") for d in devices.get("disks") or [])
    meta = vm.get("metadata") or {}
    firmware = domain.get("firmware") or {}
    return Inventory(
        uuid=system_uuid(vm, vmi), name=str(meta.get("name") or ""),
        serial=str(firmware.get("serial") or meta.get("uid") or ""),
        cpu_sockets=int(cpu.get("sockets") or 1), cpu_cores=int(cpu.get("cores") or 1),
        cpu_threads=int(cpu.get("threads") or 1), memory_bytes=memory, nics=nics, disks=disks,
        firmware=boot_mode(spec), secure_boot=secure_boot(spec),
    )


def running_since(vmi: Obj | None) -> float | None:
    """When the VMI started running (its Running phase transition, else its creation), as time.time() seconds."""
    if not vmi:
        return None
    status = vmi.get("status") or {}
    stamps = [t.get("phaseTransitionTimestamp") for t in status.get("phaseTransitionTimestamps") or []
              if t.get("phase") == "Running"]
    stamp = stamps[-1] if stamps else (vmi.get("metadata") or {}).get("creationTimestamp")
    if not stamp:
        return None
    try:
        return datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
