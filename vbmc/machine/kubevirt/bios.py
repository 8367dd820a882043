"""BIOS settings of a KubeVirt VM: each attribute of vbmc/machine/bios.py read from and written to a field of the VM
template, which KubeVirt applies when it creates the next VMI; boot progress and firmware from the VMI.

Pure functions of the VM and VMI; the backend sends the patches they return.

Where pending settings live: in an annotation on the VirtualMachine (PENDING), with the result of the last
application (APPLIED). A pending setting is a request about the VM's next boot, not an observation, so it is not
status; it belongs with the object it will change: it survives an agent restart (the agent reads it from its VM
watch), a VirtualMachineBMC deleted and created again, and a pooled agent taking the BMC over; `kubectl get vm -o
yaml` shows it beside the template it will change; the agent already may patch its VM (one JSON patch applies the
settings, removes the annotation and records the result together, guarded by a `test` of the annotation); and an
annotation is metadata: writing it neither bumps the VM's generation nor marks it RestartRequired."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from ..bios import (
    BIOS,
    DISABLED,
    ENABLED,
    UEFI,
    BiosState,
    BootProgress,
    BootProgressState,
    FirmwareImage,
    SettingsResult,
    Value,
    firmware_name,
)
from ..model import BootMode
from .firmware import smm_enabled
from .vmstate import boot_mode, secure_boot, system_uuid, template_spec

Obj = dict[str, Any]
PENDING = "bmc.kubevirt.io/bios-pending"
APPLIED = "bmc.kubevirt.io/bios-applied"
DOMAIN = "/spec/template/spec/domain"
# KubeVirt's default machine type per architecture (virt-config: DefaultAMD64MachineType, DefaultARM64MachineType).
MACHINE_TYPES = {"amd64": "q35", "arm64": "virt", "s390x": "s390-ccw-virtio", "ppc64le": "pseries"}


def _domain(spec: Obj) -> Obj:
    return spec.get("domain") or {}


def _bootloader(spec: Obj) -> Obj:
    return ((_domain(spec).get("firmware") or {}).get("bootloader")) or {}


def _switch(on: bool) -> str:
    return ENABLED if on else DISABLED


def current(vm: Obj, vmi: Obj | None = None) -> dict[str, Value]:
    """The attributes as the VM template states them (the next boot's), KubeVirt's defaults where it states none."""
    spec = template_spec(vm)
    domain = _domain(spec)
    devices = domain.get("devices") or {}
    uefi = boot_mode(spec) == BootMode.UEFI
    bios = _bootloader(spec).get("bios")
    firmware = domain.get("firmware") or {}
    architecture = str(spec.get("architecture") or "amd64")
    return {
        "BootMode": UEFI if uefi else BIOS,
        "SecureBoot": _switch(uefi and secure_boot(spec)),
        "Smm": _switch(smm_enabled(spec)),
        "TpmDevice": _switch(isinstance(devices.get("tpm"), dict) and devices["tpm"].get("enabled") is not False),
        "SerialPort": _switch(devices.get("autoattachSerialConsole") is not False),
        "SerialConsoleRedirection": _switch(not uefi and isinstance(bios, dict) and bios.get("useSerial") is True),
        "MachineType": str((domain.get("machine") or {}).get("type") or MACHINE_TYPES.get(architecture, "q35")),
        "SystemUuid": system_uuid(vm, vmi),
        "SystemSerialNumber": str(firmware.get("serial") or ((vm.get("metadata") or {}).get("uid") or "")),
    }


def _add(obj: Obj, path: list[str], value: Any) -> list[Obj]:
    """An `add` of `value` at `path` under `obj` (the VM), creating the missing parents in the same operation."""
    node: Any = obj
    for i, key in enumerate(path[:-1]):
        child = node.get(key) if isinstance(node, dict) else None
        if not isinstance(child, dict):
            nested: Any = value
            for k in reversed(path[i + 1:]):
                nested = {k: nested}
            return [{"op": "add", "path": "/" + "/".join(path[:i + 1]), "value": nested}]
        node = child
    return [{"op": "add", "path": "/" + "/".join(path), "value": value}]


def _remove(obj: Obj, path: list[str]) -> list[Obj]:
    node: Any = obj
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return []
        node = node[key]
    return [{"op": "remove", "path": "/" + "/".join(path)}]


def template_ops(vm: Obj, wanted: dict[str, Value]) -> list[Obj]:
    """JSON patch operations that give the VM template the settings `wanted` (checked by bios.check); nothing for
    an attribute already as wanted."""
    have = current(vm)
    domain = ["spec", "template", "spec", "domain"]
    ops: list[Obj] = []
    spec = template_spec(vm)
    loader = _bootloader(spec)
    firmware_changed = any(wanted[k] != have[k] for k in ("BootMode", "SecureBoot", "SerialConsoleRedirection"))
    if firmware_changed:
        if wanted["BootMode"] == UEFI:
            efi = dict(loader.get("efi") or {}) if isinstance(loader.get("efi"), dict) else {}
            efi["secureBoot"] = wanted["SecureBoot"] == ENABLED  # explicit: KubeVirt's default is on
            value: Obj = {"efi": efi}
        else:
            value = {"bios": {"useSerial": True} if wanted["SerialConsoleRedirection"] == ENABLED else {}}
        ops += _add(vm, [*domain, "firmware", "bootloader"], value)
    if wanted["Smm"] != have["Smm"]:
        ops += _add(vm, [*domain, "features", "smm", "enabled"], wanted["Smm"] == ENABLED)
    if wanted["TpmDevice"] != have["TpmDevice"]:
        ops += (_add(vm, [*domain, "devices", "tpm"], {}) if wanted["TpmDevice"] == ENABLED
                else _remove(vm, [*domain, "devices", "tpm"]))
    if wanted["SerialPort"] != have["SerialPort"]:
        ops += _add(vm, [*domain, "devices", "autoattachSerialConsole"], wanted["SerialPort"] == ENABLED)
    return ops


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def vm_annotations(vm: Obj) -> Obj:
    return (vm.get("metadata") or {}).get("annotations") or {}


def pending(vm: Obj) -> dict[str, Value]:
    """The pending settings the annotation holds; {} when none (or unreadable: a hand edit gone wrong is ignored)."""
    try:
        found = json.loads(vm_annotations(vm).get(PENDING) or "{}")
    except ValueError:
        return {}
    settings = found.get("attributes") if isinstance(found, dict) else None
    return {str(k): v for k, v in settings.items()} if isinstance(settings, dict) else {}


def reset_pending(vm: Obj) -> bool:
    try:
        found = json.loads(vm_annotations(vm).get(PENDING) or "{}")
    except ValueError:
        return False
    return isinstance(found, dict) and found.get("reset") is True


def applied(vm: Obj) -> SettingsResult | None:
    try:
        found = json.loads(vm_annotations(vm).get(APPLIED) or "null")
    except ValueError:
        return None
    if not isinstance(found, dict) or not isinstance(found.get("time"), str):
        return None
    messages = tuple((str(m.get("severity", "OK")), str(m.get("attribute", "")), str(m.get("message", "")))
                     for m in found.get("messages") or [] if isinstance(m, dict))
    return SettingsResult(found["time"], messages)


def state(vm: Obj, vmi: Obj | None) -> BiosState:
    return BiosState(tuple(current(vm, vmi).items()), tuple(pending(vm).items()), applied(vm), reset_pending(vm))


def pending_ops(vm: Obj, settings: dict[str, Value] | None, reset: bool = False) -> list[Obj]:
    """Operations that set the pending annotation to `settings` (None or {}: remove it), guarded by a `test` of
    what the agent last read, so that two writers do not lose each other's settings."""
    ops: list[Obj] = []
    notes = vm_annotations(vm)
    path = f"/metadata/annotations/{_escape(PENDING)}"
    if PENDING in notes:
        ops.append({"op": "test", "path": path, "value": notes[PENDING]})
    if settings:
        value = json.dumps({"attributes": settings, **({"reset": True} if reset else {})}, sort_keys=True)
        ops += _annotation_op(vm, PENDING, value)
    elif PENDING in notes:
        ops.append({"op": "remove", "path": path})
    return ops


def result_ops(vm: Obj, result: SettingsResult) -> list[Obj]:
    value = json.dumps({"time": result.time, "messages": [{"severity": s, "attribute": a, "message": m}
                                                          for s, a, m in result.messages]}, sort_keys=True)
    return _annotation_op(vm, APPLIED, value)


def _annotation_op(vm: Obj, key: str, value: str) -> list[Obj]:
    if not isinstance((vm.get("metadata") or {}).get("annotations"), dict):
        return [{"op": "add", "path": "/metadata/annotations", "value": {key: value}}]
    return [{"op": "add", "path": f"/metadata/annotations/{_escape(key)}", "value": value}]


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _transition(vmi: Obj, phase: str) -> str | None:
    for entry in reversed((vmi.get("status") or {}).get("phaseTransitionTimestamps") or []):
        if entry.get("phase") == phase and entry.get("phaseTransitionTimestamp"):
            return str(entry["phaseTransitionTimestamp"])
    return None


def boot_progress(vmi: Obj | None) -> BootProgress:
    """What KubeVirt shows of a boot: no VMI (or a finished one), nothing; the VMI Scheduled (its pod runs,
    virt-handler starts the domain), the processors starting; Running (the domain runs: the firmware hands over to
    the boot loader within about a second, and KubeVirt cannot see further), OSBootStarted; the guest agent
    connected (condition AgentConnected), OSRunning."""
    status = (vmi or {}).get("status") or {}
    phase = status.get("phase")
    if vmi is None or phase not in ("Scheduled", "Running"):
        return BootProgress()
    if phase == "Scheduled":
        return BootProgress(BootProgressState.PRIMARY_PROCESSOR, _transition(vmi, "Scheduled"))
    for cond in status.get("conditions") or []:
        if cond.get("type") == "AgentConnected" and cond.get("status") == "True":
            return BootProgress(BootProgressState.OS_RUNNING,
                                str(cond.get("lastTransitionTime") or "") or _transition(vmi, "Running"))
    return BootProgress(BootProgressState.OS_BOOT_STARTED, _transition(vmi, "Running"))


def launcher_version(vmi: Obj | None) -> str | None:
    """The virt-launcher image the running VMI's firmware comes from (status.launcherContainerImageVersion): each
    KubeVirt release ships its SeaBIOS and OVMF builds in it. KubeVirt reports no firmware version of its own."""
    image = str(((vmi or {}).get("status") or {}).get("launcherContainerImageVersion") or "")
    return image or None


def firmware_images(vm: Obj, vmi: Obj | None) -> tuple[FirmwareImage, ...]:
    """The firmware the VM boots: the running VMI's (its spec is the domain it booted), else the template's."""
    running = vmi is not None and ((vmi.get("status") or {}).get("phase") == "Running")
    spec = (vmi or {}).get("spec") or {} if running else template_spec(vm)
    uefi = boot_mode(spec) == BootMode.UEFI
    name = firmware_name(UEFI if uefi else BIOS, uefi and secure_boot(spec))
    version = launcher_version(vmi) if running else None
    return (FirmwareImage("BIOS", name, version, "The VM's firmware, from KubeVirt's virt-launcher image"
                          + ("" if running else " (the next boot's: the VM is not running)"), related=("system",)),)
