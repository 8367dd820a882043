"""What a BMC reports about a KubeVirt VM, computed from the VM and VMI objects (pure functions)."""

from __future__ import annotations

import datetime
import re
import uuid
from collections.abc import Mapping
from typing import Any

from ..model import BootMode, Disk, Health, HealthState, Inventory, Nic, PcieDevice, PowerState

Obj = dict[str, Any]

# KubeVirt's namespace for firmware UUIDs it derives from the VM name (CalculateLegacyUUID).
FIRMWARE_UUID_NAMESPACE = uuid.UUID("6a1a24a1-4061-4607-8bf4-a3963d0c5895")

_ON = {"Running", "Migrating"}
_POWERING_OFF = {"Stopping", "Terminating"}
_POWERING_ON = {"Starting", "Provisioning", "WaitingForVolumeBinding", "WaitingForReceiver"}
_OFF = {"Stopped", "CrashLoopBackOff", "DataVolumeError", "ErrorPvcNotFound", ""}
# Error states in which the VM should run but cannot (yet): powering on, with a Warning.
_START_ERRORS = {"ErrorUnschedulable", "ErrImagePull", "ImagePullBackOff", "ErrorDataVolumeNotFound", "Unknown"}
_VOLUME_ERRORS = {"DataVolumeError", "ErrorPvcNotFound"}


def _conditions(obj: Obj | None) -> dict[str, Obj]:
    return {c.get("type", ""): c for c in ((obj or {}).get("status") or {}).get("conditions") or []}


def is_paused(vmi: Obj | None) -> bool:
    return _conditions(vmi).get("Paused", {}).get("status") == "True"


def printable_status(vm: Obj) -> str:
    return str((vm.get("status") or {}).get("printableStatus") or "")


def _vmi_active(vmi: Obj | None) -> bool:
    """A VMI that exists and has not finished (KubeVirt's IsFinal: Succeeded or Failed)."""
    return vmi is not None and ((vmi.get("status") or {}).get("phase") or "") not in ("Succeeded", "Failed")


def meant_to_run(vm: Obj, vmi: Obj | None) -> bool:
    """Whether KubeVirt will run the VM without anyone asking again: a VMI is there, or its run strategy (or a
    queued start request) tells virt-controller to create one. KubeVirt's VM controller holds that request while
    the VM's DataVolumes import (pkg/virt-controller/watch/vm/vm.go, handleDataVolumes: no VMI until every
    dataVolumeTemplates entry has Succeeded), so the request, in the VM's status, is the intent to power on."""
    if _vmi_active(vmi) and not ((vmi or {}).get("metadata") or {}).get("deletionTimestamp"):
        return True
    spec = vm.get("spec") or {}
    strategy = spec.get("runStrategy") or ("Always" if spec.get("running") else "Halted")
    phase = ((vmi or {}).get("status") or {}).get("phase")
    if strategy == "Always":
        return True
    if strategy == "RerunOnFailure":
        return phase != "Succeeded"  # a guest that shut itself down stays off
    if strategy == "Once":
        return vmi is None
    requests = (vm.get("status") or {}).get("stateChangeRequests") or []
    return bool(requests) and requests[-1].get("action") == "Start"


def power_state(vm: Obj, vmi: Obj | None) -> PowerState:
    """The power state a BMC reports. KubeVirt's printableStatus says what the VM is doing, not whether it is meant
    to run: a stopped VM whose medium imports is "Provisioning" as much as one waiting for it to boot. Only a VM
    that KubeVirt will start is powering on; any other is off, whatever its DataVolumes do."""
    status = printable_status(vm)
    if status == "Paused" or (status in _ON and is_paused(vmi)):
        return PowerState.PAUSED
    if status in _ON:
        return PowerState.ON
    if status in _POWERING_OFF:
        return PowerState.POWERING_OFF
    if status == "Starting":
        # KubeVirt prints Starting only for a VMI that exists and is not running yet, or one it is about to create
        # (vm.go isVirtualMachineStatusStarting). The VM's watch may deliver that before the VMI's watch delivers
        # the VMI, with the start request already consumed: the VM itself says it is powering on.
        return PowerState.POWERING_ON
    if status in _POWERING_ON or status in _START_ERRORS or status in ("Stopped", ""):
        return PowerState.POWERING_ON if meant_to_run(vm, vmi) else PowerState.OFF
    if status in _VOLUME_ERRORS and _vmi_active(vmi):
        return PowerState.POWERING_ON  # a VMI held by a volume that cannot be had: starting, with a Warning
    return PowerState.OFF


def health(vm: Obj) -> Health:
    status = printable_status(vm)
    if status in _START_ERRORS or status in _VOLUME_ERRORS or status == "CrashLoopBackOff":
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


def inventory(vm: Obj, vmi: Obj | None, claims: Mapping[str, Obj] | None = None) -> Inventory:
    """The VM as a BMC inventories it; `claims` are the PersistentVolumeClaims its volumes name, by name (their
    capacity sizes the disks)."""
    spec = template_spec(vm)
    domain = spec.get("domain") or {}
    cpu = domain.get("cpu") or {}
    memory = quantity_bytes((domain.get("memory") or {}).get("guest")) or quantity_bytes(
        ((domain.get("resources") or {}).get("requests") or {}).get("memory"))
    seen_macs = {i.get("name"): i.get("mac") for i in ((vmi or {}).get("status") or {}).get("interfaces") or []}
    devices = domain.get("devices") or {}
    nics = tuple(Nic(i["name"], str(i.get("macAddress") or seen_macs.get(i["name"]) or ""),
                     link_up(i, vmi), str(i.get("model") or "virtio"))
                 for i in devices.get("interfaces") or [] if i.get("state") != "absent")
    sizes = disk_sizes(vm, vmi, claims or {})
    created = set(created_disks(vm))
    disks = tuple(_disk(d, sizes.get(str(d["name"])), str(d["name"]) in created) for d in devices.get("disks") or [])
    meta = vm.get("metadata") or {}
    firmware = domain.get("firmware") or {}
    return Inventory(
        uuid=system_uuid(vm, vmi), name=str(meta.get("name") or ""),
        serial=str(firmware.get("serial") or meta.get("uid") or ""),
        cpu_sockets=int(cpu.get("sockets") or 1), cpu_cores=int(cpu.get("cores") or 1),
        cpu_threads=int(cpu.get("threads") or 1), memory_bytes=memory, nics=nics, disks=disks,
        firmware=boot_mode(spec), secure_boot=secure_boot(spec),
        architecture=str(spec.get("architecture") or ((vmi or {}).get("spec") or {}).get("architecture")
                         or "amd64"),
        model=model(vm, vmi),
        cpu_model=cpu_model(vm, vmi),
        pcie_devices=pcie_devices(vm, vmi),
    )


def link_up(interface: Obj, vmi: Obj | None) -> bool:
    """An interface's link as KubeVirt shows it: up while a running VMI lists it in its status (virt-handler reports
    the domain's interfaces there); down when the VM is not running, or its VMI does not have it (not plugged yet,
    or being unplugged)."""
    status = (vmi or {}).get("status") or {}
    if status.get("phase") != "Running":
        return False
    return any(i.get("name") == interface.get("name") for i in status.get("interfaces") or [])


def cpu_model(vm: Obj, vmi: Obj | None) -> str:
    """The vCPU model the VM runs (its VMI's, where virt-api wrote the cluster's default in) or asks for; "" when
    neither names one."""
    for spec in ((vmi or {}).get("spec") or {}, template_spec(vm)):
        value = ((spec.get("domain") or {}).get("cpu") or {}).get("model")
        if value:
            return str(value)
    return ""


# The PCI IDs of the devices QEMU emulates for KubeVirt's models (QEMU's include/hw/pci/pci_ids.h; virtio 1.x
# non-transitional IDs are 0x1040 + the virtio device type, the transitional ones KubeVirt uses with
# useVirtioTransitional are 0x1000 + the legacy index).
VIRTIO_VENDOR = "0x1af4"
_VIRTIO = {"net": ("0x1041", "0x1000"), "blk": ("0x1042", "0x1001"), "scsi": ("0x1048", "0x1004")}
_NIC_MODELS = {"e1000": ("0x8086", "0x100e", "Intel"), "e1000e": ("0x8086", "0x10d3", "Intel"),
               "rtl8139": ("0x10ec", "0x8139", "Realtek"), "ne2k_pci": ("0x10ec", "0x8029", "Realtek"),
               "pcnet": ("0x1022", "0x2000", "AMD")}
AHCI = ("0x8086", "0x2922")  # q35's ICH9 AHCI controller, where KubeVirt's sata disks and cdroms sit


def pcie_devices(vm: Obj, vmi: Obj | None) -> tuple[PcieDevice, ...]:
    """The VM's PCI devices as its definition (the running VMI's, else the template) names them: its NICs, its disk
    controllers (a virtio-blk device per virtio disk, one virtio-scsi controller for the scsi disks, the machine's
    AHCI controller for sata ones), its GPUs and passed-through host devices. Nothing else: what the machine type
    adds by itself (bridges, the USB controller) the definition does not state."""
    spec = ((vmi or {}).get("spec") or {}) if (vmi or {}).get("spec") else template_spec(vm)
    devices = (spec.get("domain") or {}).get("devices") or {}
    transitional = 1 if devices.get("useVirtioTransitional") else 0
    found: list[PcieDevice] = []
    for nic in devices.get("interfaces") or []:
        if nic.get("state") == "absent":
            continue
        name = str(nic.get("name"))
        address = str(nic.get("pciAddress") or "")
        if "sriov" in nic:
            found.append(PcieDevice(f"nic-{name}", f"SR-IOV interface {name}", "NetworkController",
                                    "SR-IOV virtual function", address=address))
            continue
        model_name = str(nic.get("model") or "virtio")
        if model_name == "virtio":
            vendor, device, maker = VIRTIO_VENDOR, _VIRTIO["net"][transitional], "Red Hat"
        else:
            vendor, device, maker = _NIC_MODELS.get(model_name, ("", "", ""))
        found.append(PcieDevice(f"nic-{name}", f"Interface {name}", "NetworkController", model_name, vendor,
                                device, maker, address))
    buses = [str((d.get(kind) or {}).get("bus") or ("sata" if kind == "cdrom" else "virtio"))
             for d in devices.get("disks") or [] for kind in ("disk", "cdrom", "lun") if kind in d]
    for disk in devices.get("disks") or []:
        kind = next((k for k in ("disk", "lun") if k in disk), None)
        if kind and str((disk.get(kind) or {}).get("bus") or "virtio") == "virtio":
            name = str(disk.get("name"))
            found.append(PcieDevice(f"disk-{name}", f"Disk controller of {name}", "MassStorageController",
                                    "virtio-blk", VIRTIO_VENDOR, _VIRTIO["blk"][transitional], "Red Hat"))
    if "scsi" in buses:
        found.append(PcieDevice("scsi", "SCSI controller", "MassStorageController", "virtio-scsi", VIRTIO_VENDOR,
                                _VIRTIO["scsi"][transitional], "Red Hat"))
    if "sata" in buses:
        found.append(PcieDevice("sata", "SATA controller", "MassStorageController", "ICH9 AHCI", *AHCI, "Intel"))
    for gpu in devices.get("gpus") or []:
        found.append(PcieDevice(f"gpu-{gpu.get('name')}", f"GPU {gpu.get('name')}", "DisplayController",
                                str(gpu.get("deviceName") or "")))
    for host in devices.get("hostDevices") or []:
        found.append(PcieDevice(f"hostdev-{host.get('name')}", f"Host device {host.get('name')}", "Other",
                                str(host.get("deviceName") or "")))
    return tuple(found)


def _disk(disk: Obj, size: int | None, created: bool = False) -> Disk:
    kind = next((k for k in ("cdrom", "disk", "lun") if k in disk), "disk")
    bus = str((disk.get(kind) or {}).get("bus") or ("sata" if kind == "cdrom" else "virtio"))
    return Disk(str(disk["name"]), "cdrom" if kind == "cdrom" else "disk", size, bus, created)


MANAGED_BY = ("app.kubernetes.io/managed-by", "kubevbmc")


def created_disks(vm: Obj) -> list[str]:
    """The disks the BMC added (create_disk): their volume's DataVolume is a dataVolumeTemplates entry it labelled."""
    ours = {str((t.get("metadata") or {}).get("name")) for t in (vm.get("spec") or {}).get("dataVolumeTemplates") or []
            if ((t.get("metadata") or {}).get("labels") or {}).get(MANAGED_BY[0]) == MANAGED_BY[1]}
    return [str(v.get("name")) for v in template_spec(vm).get("volumes") or []
            if ((v.get("dataVolume") or {}).get("name") or None) in ours]


def claim_name(volume: Obj) -> str:
    """The PersistentVolumeClaim behind a volume: a dataVolume's claim has the DataVolume's name (CDI creates it
    so), a persistentVolumeClaim names its own; "" for any other source."""
    source = volume.get("dataVolume") or volume.get("persistentVolumeClaim") or {}
    return str(source.get("name") or source.get("claimName") or "") if isinstance(source, dict) else ""


def claim_names(vm: Obj) -> list[str]:
    """The claims the VM's volumes name, in the order of its volumes."""
    return [name for name in (claim_name(v) for v in template_spec(vm).get("volumes") or []) if name]


def bound_capacity(claim: Obj | None) -> int:
    """A claim's size as the cluster states it: status.capacity of a Bound claim (what its volume holds, which may
    be more than it asked for); 0 when it is not bound."""
    status = (claim or {}).get("status") or {}
    if status.get("phase") != "Bound":
        return 0
    return quantity_bytes((status.get("capacity") or {}).get("storage"))


def disk_sizes(vm: Obj, vmi: Obj | None, claims: Mapping[str, Obj] | None = None) -> dict[str, int]:
    """volume name -> bytes, from what the cluster states, first found wins:
    1. a bound claim's status.capacity (`claims`, read whether or not the VM runs);
    2. the running VMI's volumeStatus: persistentVolumeClaimInfo.capacity (what virt-controller read from the
       claim), or `size` (what virt-handler measured of the image file; it does so for the ISO volumes it builds:
       cloud-init, configMap, secret... pkg/virt-handler/vm.go, updateIsoSizeStatus);
    3. what the VM asks for: its dataVolumeTemplates' storage request, an emptyDisk's or a hostDisk's capacity.
    A containerDisk's size is stated nowhere (KubeVirt reports none, running or not): absent, never a guess."""
    claims = claims or {}
    spec = template_spec(vm)
    requested: dict[str, int] = {}
    for template in (vm.get("spec") or {}).get("dataVolumeTemplates") or []:
        dv_spec = template.get("spec") or {}
        claim = dv_spec.get("storage") or dv_spec.get("pvc") or {}
        size = quantity_bytes(((claim.get("resources") or {}).get("requests") or {}).get("storage"))
        if size:
            requested[str((template.get("metadata") or {}).get("name"))] = size
    running: dict[str, int] = {}
    for status in ((vmi or {}).get("status") or {}).get("volumeStatus") or []:
        capacity = quantity_bytes(((status.get("persistentVolumeClaimInfo") or {}).get("capacity") or {})
                                  .get("storage")) or quantity_bytes(status.get("size"))
        if capacity:
            running[str(status.get("name"))] = capacity
    sizes: dict[str, int] = {}
    for volume in spec.get("volumes") or []:
        name = str(volume.get("name"))
        claim = claim_name(volume)
        size = (bound_capacity(claims.get(claim)) if claim else 0) or running.get(name) or requested.get(claim) \
            or quantity_bytes((volume.get("emptyDisk") or {}).get("capacity")) \
            or quantity_bytes((volume.get("hostDisk") or {}).get("capacity"))
        if size:
            sizes[name] = size
    return sizes


def model(vm: Obj, vmi: Obj | None) -> str:
    """What a VM honestly is, as a model name: its instancetype, else its machine type (KubeVirt's default q35 on
    amd64, virt on arm64, s390-ccw-virtio on s390x)."""
    instancetype = (vm.get("spec") or {}).get("instancetype") or {}
    if instancetype.get("name"):
        return str(instancetype["name"])
    for spec in (template_spec(vm), (vmi or {}).get("spec") or {}):
        machine_type = ((spec.get("domain") or {}).get("machine") or {}).get("type")
        if machine_type:
            return str(machine_type)
    arch = template_spec(vm).get("architecture") or "amd64"
    return {"arm64": "virt", "s390x": "s390-ccw-virtio", "ppc64le": "pseries"}.get(str(arch), "q35")


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
