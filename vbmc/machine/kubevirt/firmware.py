"""The VM's firmware as JSON patch operations: boot mode (UEFI or BIOS) and UEFI secure boot.

Pure functions of the VM; the backend sends what they return. KubeVirt's rules, from its VM admitter
(pkg/virt-api/webhooks/validating-webhook/admitters/vmi-create-admitter.go, validateDomainSpec):
- a bootloader `efi` without `secureBoot` means secure boot ON (secureBootEnabled: SecureBoot == nil || *SecureBoot);
- secure boot requires SMM (`features.smm`, enabled unless `enabled: false`), or the VM is refused: "... has EFI
  SecureBoot enabled. SecureBoot requires SMM, which is currently disabled."
So the BMC always writes `secureBoot` explicitly, and turns SMM on whenever it turns secure boot on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..model import BootMode
from .vmstate import boot_mode, secure_boot, template_spec

Obj = dict[str, Any]
DOMAIN = "/spec/template/spec/domain"


@dataclass(frozen=True)
class Firmware:
    mode: BootMode
    secure_boot: bool

    @classmethod
    def of(cls, vm: Obj) -> Firmware:
        spec = template_spec(vm)
        return cls(boot_mode(spec), secure_boot(spec))

    def as_status(self) -> Obj:
        return {"mode": str(self.mode), "secureBoot": self.secure_boot}

    @classmethod
    def from_status(cls, record: Obj) -> Firmware:
        return cls(BootMode(record.get("mode", "UEFI")), bool(record.get("secureBoot", False)))


def smm_enabled(spec: Obj) -> bool:
    smm = ((spec.get("domain") or {}).get("features") or {}).get("smm")
    return isinstance(smm, dict) and smm.get("enabled", True) is not False


def firmware_ops(vm: Obj, want: Firmware) -> list[Obj]:
    """Operations that give the VM `want` (nothing when it has it already, with an explicit bootloader)."""
    spec = template_spec(vm)
    domain = spec.get("domain") or {}
    firmware = domain.get("firmware")
    bootloader = (firmware or {}).get("bootloader") if isinstance(firmware, dict) else None
    if Firmware.of(vm) == want and bootloader:
        return []
    ops: list[Obj] = []
    if want.mode == BootMode.UEFI and boot_mode(spec) == BootMode.UEFI and isinstance(bootloader, dict):
        ops.append({"op": "add", "path": f"{DOMAIN}/firmware/bootloader/efi/secureBoot", "value": want.secure_boot})
    else:
        value: Obj = {"efi": {"secureBoot": want.secure_boot}} if want.mode == BootMode.UEFI else {"bios": {}}
        if not isinstance(firmware, dict):
            ops.append({"op": "add", "path": f"{DOMAIN}/firmware", "value": {"bootloader": value}})
        else:
            ops.append({"op": "add", "path": f"{DOMAIN}/firmware/bootloader", "value": value})
    if want.mode == BootMode.UEFI and want.secure_boot and not smm_enabled(spec):
        ops += smm_ops(domain)
    return ops


def smm_ops(domain: Obj) -> list[Obj]:
    features = domain.get("features")
    if not isinstance(features, dict):
        return [{"op": "add", "path": f"{DOMAIN}/features", "value": {"smm": {"enabled": True}}}]
    if not isinstance(features.get("smm"), dict):
        return [{"op": "add", "path": f"{DOMAIN}/features/smm", "value": {"enabled": True}}]
    return [{"op": "add", "path": f"{DOMAIN}/features/smm/enabled", "value": True}]


def mode_firmware(vm: Obj, mode: BootMode) -> Firmware:
    """The firmware a switch to `mode` gives: the mode's own secure-boot setting kept when the mode does not
    change; off when switching to UEFI (BIOS has none to carry over); none under BIOS."""
    current = Firmware.of(vm)
    if current.mode == mode:
        return current
    return Firmware(mode, False)
