"""Rendering of Redfish resources: pure functions from the Machine's values to JSON-ready dicts.

Nothing here reads the Machine or the request; the routes gather the values and the app serialises. Property
names and enum values follow DMTF's schema bundle DSP8010 2025.4 (the versions in SCHEMAS)."""

from __future__ import annotations

import uuid as uuidlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from ..access.audit import redact_url
from ..machine import (
    UPLOAD_SCHEME,
    BootOverride,
    BootTarget,
    Disk,
    Health,
    HealthState,
    Identify,
    Inventory,
    MediaState,
    PcieDevice,
    PowerState,
    ResetType,
    SecureBoot,
    VirtualMedia,
)
from ..machine.eventlog import LogRecord
from .sessions import Session, Viewer

ROOT = "/redfish/v1"
METADATA = f"{ROOT}/$metadata"
REDFISH_VERSION = "1.20.0"

# Schema namespace -> version used in @odata.type (the newest in the bundle the validators read).
SCHEMAS: dict[str, str] = {
    "ServiceRoot": "v1_20_0",
    "ComputerSystem": "v1_27_0",
    "Manager": "v1_24_0",
    "Chassis": "v1_28_0",
    "VirtualMedia": "v1_6_5",
    "SessionService": "v1_2_0",
    "Session": "v1_8_0",
    "AccountService": "v1_18_1",
    "ManagerAccount": "v1_14_1",
    "Role": "v1_3_3",
    "EthernetInterface": "v1_12_4",
    "Processor": "v1_22_0",
    "Memory": "v1_23_0",
    "SimpleStorage": "v1_3_2",
    "Storage": "v1_21_0",
    "Drive": "v1_22_0",
    "ManagerNetworkProtocol": "v1_12_0",
    "SecureBoot": "v1_1_2",
    "StorageController": "v1_11_0",
    "Task": "v1_7_4",
    "TaskService": "v1_3_0",
    "Volume": "v1_10_2",
    "EventService": "v1_12_0",
    "EventDestination": "v1_16_0",
    "Event": "v1_13_0",
    "LogService": "v1_9_0",
    "LogEntry": "v1_21_0",
    "Power": "v1_7_3",
    "Thermal": "v1_7_3",
    "Bios": "v1_2_3",
    "AttributeRegistry": "v1_4_0",
    "MessageRegistryFile": "v1_1_5",
    "UpdateService": "v1_17_0",
    "SoftwareInventory": "v1_13_0",
    "PCIeDevice": "v1_21_0",
    "PCIeFunction": "v1_7_0",
}
COLLECTIONS = ("ComputerSystemCollection", "ManagerCollection", "ChassisCollection", "VirtualMediaCollection",
               "SessionCollection", "ManagerAccountCollection", "RoleCollection", "EthernetInterfaceCollection",
               "ProcessorCollection", "MemoryCollection", "SimpleStorageCollection", "StorageCollection",
               "StorageControllerCollection", "VolumeCollection", "TaskCollection",
               "DriveCollection", "EventDestinationCollection", "LogServiceCollection", "LogEntryCollection",
               "PCIeDeviceCollection", "PCIeFunctionCollection",
               "MessageRegistryFileCollection", "SoftwareInventoryCollection")
# Referenced by the schemas above (annotations, shared types); $metadata lists them too.
SUPPORT_SCHEMAS = ("Resource", "RedfishExtensions", "Message", "Privileges", "Settings")

ROLES: dict[str, tuple[str, ...]] = {
    "Administrator": ("Login", "ConfigureManager", "ConfigureUsers", "ConfigureSelf", "ConfigureComponents"),
    "Operator": ("Login", "ConfigureSelf", "ConfigureComponents"),
    "ReadOnly": ("Login", "ConfigureSelf"),
}
ACCOUNT_ID = "1"
EVENT_SERVICE = f"{ROOT}/EventService"
SUBSCRIPTIONS = f"{EVENT_SERVICE}/Subscriptions"
SSE_URI = f"{EVENT_SERVICE}/SSE"
SUBMIT_TEST_EVENT = f"{EVENT_SERVICE}/Actions/EventService.SubmitTestEvent"
STORAGE_ID = "1"
# This service's OEM extension (Oem.KubeVBMC): its types, as docs/reference.md describes them and the CSDL in
# tests/redfish/data/csdl/KubeVBMC_v1.xml defines them for DMTF's Service Validator.
OEM_SESSION = "#KubeVBMC.v1_0_0.Session"
OEM_MANAGER = "#KubeVBMC.v1_0_0.Manager"


def odata_type(name: str) -> str:
    if name in SCHEMAS:
        return f"#{name}.{SCHEMAS[name]}.{name}"
    return f"#{name}.{name}"


def schema_uri(name: str) -> str:
    """Where a client finds the JSON schema (the Link: rel=describedby header)."""
    if name in SCHEMAS:
        return f"http://redfish.dmtf.org/schemas/v1/{name}.{SCHEMAS[name]}.json"
    return f"http://redfish.dmtf.org/schemas/v1/{name}.json"


def link(path: str) -> dict[str, str]:
    return {"@odata.id": path}


def resource_head(kind: str, path: str, id_: str | None, name: str) -> dict[str, Any]:
    doc: dict[str, Any] = {"@odata.id": path, "@odata.type": odata_type(kind),
                           "@odata.context": f"{METADATA}#{kind}.{kind}"}
    if id_ is not None:
        doc["Id"] = id_
    doc["Name"] = name
    return doc


def collection(kind: str, path: str, name: str, members: Iterable[str]) -> dict[str, Any]:
    ids = [link(m) for m in members]
    doc = resource_head(kind, path, None, name)
    doc["Members@odata.count"] = len(ids)
    doc["Members"] = ids
    return doc


def _status(health: HealthState = HealthState.OK, state: str = "Enabled") -> dict[str, str]:
    return {"State": state, "Health": health.value, "HealthRollup": health.value}


@dataclass(frozen=True)
class Ids:
    """The URIs of this service's resources, computed once."""

    system_id: str
    manager_id: str
    chassis_id: str

    @property
    def systems(self) -> str:
        return f"{ROOT}/Systems"

    @property
    def system(self) -> str:
        return f"{ROOT}/Systems/{self.system_id}"

    @property
    def managers(self) -> str:
        return f"{ROOT}/Managers"

    @property
    def manager(self) -> str:
        return f"{ROOT}/Managers/{self.manager_id}"

    @property
    def chassis_collection(self) -> str:
        return f"{ROOT}/Chassis"

    @property
    def chassis(self) -> str:
        return f"{ROOT}/Chassis/{self.chassis_id}"


def service_uuid(machine_uuid: str) -> str:
    """The service's own UUID: stable per VM, different from the system's."""
    return str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"kubevbmc:redfish:{machine_uuid}"))


def manager_uuid(machine_uuid: str) -> str:
    return str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"kubevbmc:manager:{machine_uuid}"))


# ---- service root and OData documents


def service_root(ids: Ids, uuid: str, product: str, version: str) -> dict[str, Any]:
    doc = resource_head("ServiceRoot", f"{ROOT}/", "RootService", "Root Service")
    doc.update({
        "RedfishVersion": REDFISH_VERSION,
        "UUID": uuid,
        "Vendor": "KubeVBMC",
        "Product": product,
        "ServiceIdentification": version,
        "Systems": link(ids.systems),
        "Managers": link(ids.managers),
        "Chassis": link(ids.chassis_collection),
        "SessionService": link(f"{ROOT}/SessionService"),
        "AccountService": link(f"{ROOT}/AccountService"),
        "EventService": link(EVENT_SERVICE),
        "Links": {"Sessions": link(f"{ROOT}/SessionService/Sessions")},
        "ProtocolFeaturesSupported": PROTOCOL_FEATURES,
        "Tasks": link(TASK_SERVICE),
        "Registries": link(f"{ROOT}/Registries"),
        "UpdateService": link(f"{ROOT}/UpdateService"),
    })
    return doc


# What the service implements of DSP0266's protocol features, truthfully: no query parameters (each one is
# answered 501, vbmc/redfish/app.py), no deep operations; several requests at a time, yes. (The SSE stream's own
# `$filter` is described by the EventService's SSEFilterPropertiesSupported, not here.)
PROTOCOL_FEATURES: dict[str, Any] = {
    "ExpandQuery": {"ExpandAll": False, "Levels": False, "Links": False, "NoLinks": False},
    "SelectQuery": False,
    "FilterQuery": False,
    "OnlyMemberQuery": False,
    "ExcerptQuery": False,
    "TopSkipQuery": False,
    "IncludeOriginOfConditionQuery": False,
    "DeepOperations": {"DeepPATCH": False, "DeepPOST": False},
    "MultipleHTTPRequests": True,
}


def redfish_version() -> dict[str, str]:
    return {"v1": f"{ROOT}/"}


def odata_service(ids: Ids) -> dict[str, Any]:
    singletons = [("Service", f"{ROOT}/"), ("Systems", ids.systems), ("Managers", ids.managers),
                  ("Chassis", ids.chassis_collection), ("SessionService", f"{ROOT}/SessionService"),
                  ("AccountService", f"{ROOT}/AccountService"), ("Sessions", f"{ROOT}/SessionService/Sessions"),
                  ("EventService", EVENT_SERVICE), ("TaskService", TASK_SERVICE),
                  ("Registries", f"{ROOT}/Registries"), ("UpdateService", f"{ROOT}/UpdateService")]
    return {"@odata.context": METADATA,
            "value": [{"name": n, "kind": "Singleton", "url": u} for n, u in singletons]}


def metadata_xml() -> str:
    """The CSDL document at /redfish/v1/$metadata: a reference to every schema this service uses."""
    refs = []
    for name in sorted([*SCHEMAS, *COLLECTIONS, *SUPPORT_SCHEMAS]):
        includes = [f'    <edmx:Include Namespace="{name}"/>']
        if name in SCHEMAS:
            includes.append(f'    <edmx:Include Namespace="{name}.{SCHEMAS[name]}"/>')
        if name == "RedfishExtensions":
            includes = ['    <edmx:Include Namespace="RedfishExtensions.v1_0_0" Alias="Redfish"/>']
        if name == "Resource":
            includes.append('    <edmx:Include Namespace="Resource.v1_0_0"/>')
        refs.append(f'  <edmx:Reference Uri="http://redfish.dmtf.org/schemas/v1/{name}_v1.xml">\n'
                    + "\n".join(includes) + "\n  </edmx:Reference>")
    return ('<?xml version="1.0" encoding="UTF-8"?>\n'
            '<edmx:Edmx xmlns:edmx="http://docs.oasis-open.org/odata/ns/edmx" Version="4.0">\n'
            + "\n".join(refs) + "\n"
            '  <edmx:DataServices>\n'
            '    <Schema xmlns="http://docs.oasis-open.org/odata/ns/edm" Namespace="Service">\n'
            f'      <EntityContainer Name="Service" Extends="ServiceRoot.{SCHEMAS["ServiceRoot"]}.ServiceContainer"/>\n'
            '    </Schema>\n'
            '  </edmx:DataServices>\n'
            '</edmx:Edmx>\n')


# ---- the system and what hangs off it


def _system_state(power: PowerState) -> str:
    return "Starting" if power == PowerState.POWERING_ON else "Enabled"


@dataclass(frozen=True)
class ConsoleAccess:
    """The consoles a BMC serves beside Redfish, as the System and the Manager advertise them: IPMI SOL, the serial
    console as a WebSocket at `serial_uri` (relative to the service: ws:// or wss:// as the service is reached),
    the screen (KVM over IP) as a WebSocket at `screen_uri`, each with at most `max_sessions` web viewers."""

    ipmi_sol: bool
    serial_uri: str
    screen_uri: str
    max_sessions: int


def system_consoles(access: ConsoleAccess | None, has_serial: bool, has_screen: bool) -> dict[str, Any]:
    """The System's GraphicalConsole and SerialConsole (ComputerSystem v1_13_0 HostGraphicalConsole and
    HostSerialConsole; SerialConsole.WebSocket since v1_26_0): what the machine has and the BMC serves."""
    if access is None:
        return {}
    serial = has_serial and bool(access.serial_uri)
    return {
        "GraphicalConsole": {"ServiceEnabled": has_screen and bool(access.screen_uri),
                             "MaxConcurrentSessions": access.max_sessions, "ConnectTypesSupported": ["KVMIP"]},
        "SerialConsole": {
            # The web viewers and IPMI SOL's one payload instance, all on the one serial line.
            "MaxConcurrentSessions": access.max_sessions + int(access.ipmi_sol),
            "IPMI": {"ServiceEnabled": has_serial and access.ipmi_sol},
            "WebSocket": {"ServiceEnabled": serial, "ConsoleURI": access.serial_uri, "Interactive": True},
        },
    }


def manager_consoles(access: ConsoleAccess | None, has_screen: bool) -> dict[str, Any]:
    """The Manager's GraphicalConsole (Manager v1_0_0): the BMC's KVM over IP."""
    if access is None:
        return {}
    return {"GraphicalConsole": {"ServiceEnabled": has_screen and bool(access.screen_uri),
                                 "MaxConcurrentSessions": access.max_sessions, "ConnectTypesSupported": ["KVMIP"]}}


def system(ids: Ids, power: PowerState, health: Health, boot: BootOverride, targets: Sequence[BootTarget],
           resets: Sequence[ResetType], inv: Inventory, has_media: bool,
           consoles: Mapping[str, Any] | None = None, identify: Identify | None = None,
           firmware: Mapping[str, Any] | None = None) -> dict[str, Any]:
    path = ids.system
    doc = resource_head("ComputerSystem", path, ids.system_id, inv.name)
    doc.update({
        "SystemType": "Virtual",
        "Manufacturer": "KubeVirt",
        "Model": inv.model or "KubeVirt VirtualMachine",
        "SerialNumber": inv.serial,
        "HostName": inv.name,
        "UUID": inv.uuid,
        "PowerState": power.value,
        "Status": _status(health.state, _system_state(power)),
        "Boot": {
            "BootSourceOverrideEnabled": boot.enabled.value,
            "BootSourceOverrideTarget": boot.target.value,
            "BootSourceOverrideTarget@Redfish.AllowableValues": [t.value for t in targets],
            "BootSourceOverrideMode": boot.mode.value,
            "BootSourceOverrideMode@Redfish.AllowableValues": ["UEFI", "Legacy"],
            # Always there (null when unset): sushy writes HttpBootUri only where the service shows it.
            "HttpBootUri": redact_url(boot.http_boot_uri) or None,
        },
        "ProcessorSummary": {"Count": inv.cpu_sockets, "CoreCount": inv.cpu_sockets * inv.cpu_cores,
                             "LogicalProcessorCount": inv.cpu_count},
        # Exact: MiB / 1024 is a binary fraction. (sushy reads it as a whole number of GiB, so Ironic's memory_mb
        # is in whole GiB: docs/troubleshooting.md.)
        "MemorySummary": {"TotalSystemMemoryGiB": inv.memory_bytes // 2**20 / 1024},
        "Processors": link(f"{path}/Processors"),
        "Memory": link(f"{path}/Memory"),
        "EthernetInterfaces": link(f"{path}/EthernetInterfaces"),
        "SimpleStorage": link(f"{path}/SimpleStorage"),
        "Storage": link(f"{path}/Storage"),
        "SecureBoot": link(f"{path}/SecureBoot"),
        "LogServices": link(f"{path}/LogServices"),
        "PCIeDevices": [link(p) for p in pcie_device_paths(ids, inv)],
        "PCIeDevices@odata.count": len(inv.pcie_devices),
        "Links": {"Chassis": [link(ids.chassis)], "ManagedBy": [link(ids.manager)]},
        "Actions": {"#ComputerSystem.Reset": {
            "target": f"{path}/Actions/ComputerSystem.Reset",
            # KubeVirt has no NMI: never advertise it, whatever a backend lists.
            "ResetType@Redfish.AllowableValues": [r.value for r in resets if r != ResetType.NMI],
        }},
    })
    if inv.cpu_model:
        doc["ProcessorSummary"]["Model"] = inv.cpu_model
    doc.update(indicator(identify or Identify()))
    if has_media:
        doc["VirtualMedia"] = link(f"{path}/VirtualMedia")
    doc.update(consoles or {})
    doc.update(firmware or {})  # Bios, BiosVersion, BootProgress (vbmc/redfish/bios.py)
    if health.state != HealthState.OK and health.message:
        doc["Description"] = health.message
    return doc


def secure_boot(ids: Ids, state: SecureBoot) -> dict[str, Any]:
    """UEFI secure boot: SecureBootEnable is the next boot's setting, SecureBootCurrentBoot the running boot's
    (null while the system is off: there is no current boot). KubeVirt boots secure-boot VMs with OVMF's variable
    store that has the platform keys enrolled (UserMode), others with an empty one (SetupMode). No ResetKeys:
    KubeVirt has no key management."""
    doc = resource_head("SecureBoot", f"{ids.system}/SecureBoot", "SecureBoot", "UEFI Secure Boot")
    booted = state.enabled if state.current is None else state.current
    doc.update({
        "SecureBootEnable": state.enabled,
        "SecureBootCurrentBoot": None if state.current is None else ("Enabled" if state.current else "Disabled"),
        "SecureBootMode": "UserMode" if booted and state.uefi else "SetupMode",
    })
    if not state.uefi:
        doc["Description"] = ("The system boots with BIOS firmware: secure boot needs UEFI "
                              "(Boot.BootSourceOverrideMode).")
    return doc


def indicator(identify: Identify) -> dict[str, Any]:
    """Identify as the System and the Chassis show it: LocationIndicatorActive, and the deprecated IndicatorLED for
    clients older than it (Lit, or Blinking as it was asked for or IPMI's timed identify blinks)."""
    led = ("Blinking" if identify.blinking else "Lit") if identify.active else "Off"
    return {"LocationIndicatorActive": identify.active, "IndicatorLED": led}


def ethernet_interface(ids: Ids, name: str, mac: str, power: PowerState,
                       link_up: bool | None = None) -> dict[str, Any]:
    """LinkStatus: what the backend knows of the link (KubeVirt: the running VMI lists the interface), else up while
    the machine runs."""
    doc = resource_head("EthernetInterface", f"{ids.system}/EthernetInterfaces/{name}", name, f"Interface {name}")
    up = power in (PowerState.ON, PowerState.PAUSED) if link_up is None else link_up
    # A virtio NIC has no link speed: SpeedMbps is null (unknown) rather than an invented number.
    doc.update({"MACAddress": mac, "PermanentMACAddress": mac, "InterfaceEnabled": True, "SpeedMbps": None,
                "LinkStatus": "LinkUp" if up else "LinkDown", "Status": _status()})
    return doc


# KubeVirt's spec.architecture -> DMTF's (ProcessorArchitecture, InstructionSet).
ARCHITECTURES = {"amd64": ("x86", "x86-64"), "arm64": ("ARM", "ARM-A64"), "ppc64le": ("Power", "PowerISA"),
                 "s390x": ("OEM", "OEM")}


def processors(ids: Ids, inv: Inventory) -> list[str]:
    return [f"{ids.system}/Processors/CPU{i}" for i in range(inv.cpu_sockets)]


def processor(ids: Ids, inv: Inventory, index: int) -> dict[str, Any]:
    doc = resource_head("Processor", f"{ids.system}/Processors/CPU{index}", f"CPU{index}", f"vCPU socket {index}")
    architecture, instruction_set = ARCHITECTURES.get(inv.architecture, ("OEM", "OEM"))
    doc.update({"Socket": f"CPU {index}", "ProcessorType": "CPU", "ProcessorArchitecture": architecture,
                "InstructionSet": instruction_set, "TotalCores": inv.cpu_cores,
                "TotalThreads": inv.cpu_cores * inv.cpu_threads, "TotalEnabledCores": inv.cpu_cores,
                "Status": _status()})
    if inv.cpu_model:
        doc["Model"] = inv.cpu_model  # KubeVirt's cpu.model: a libvirt CPU model, host-model or host-passthrough
    return doc


# ---- PCIe devices: under the Chassis (PCIeDevice v1_4_0 on), listed by the System (ComputerSystem.PCIeDevices)


def pcie_device_paths(ids: Ids, inv: Inventory) -> list[str]:
    return [f"{ids.chassis}/PCIeDevices/{d.id}" for d in inv.pcie_devices]


def pcie_device(ids: Ids, dev: PcieDevice) -> dict[str, Any]:
    """One device, one function: what the VM's definition states of it, nothing more (no slot, no lanes)."""
    path = f"{ids.chassis}/PCIeDevices/{dev.id}"
    doc = resource_head("PCIeDevice", path, dev.id, dev.name)
    doc.update({"DeviceType": "SingleFunction", "Model": dev.model, "Status": _status(),
                "PCIeFunctions": link(f"{path}/PCIeFunctions"),
                "Links": {"Chassis": [link(ids.chassis)]}})
    if dev.manufacturer:
        doc["Manufacturer"] = dev.manufacturer
    if dev.address:
        doc["Description"] = f"At the guest PCI address {dev.address}, as the VM's definition pins it."
    return doc


def pcie_function(ids: Ids, dev: PcieDevice) -> dict[str, Any]:
    path = f"{ids.chassis}/PCIeDevices/{dev.id}/PCIeFunctions/0"
    doc = resource_head("PCIeFunction", path, "0", f"{dev.name}, function 0")
    doc.update({"FunctionId": 0, "FunctionType": "Physical", "DeviceClass": dev.device_class, "Status": _status(),
                "Links": {"PCIeDevice": link(f"{ids.chassis}/PCIeDevices/{dev.id}")}})
    if dev.vendor_id and dev.device_id:
        doc.update({"VendorId": dev.vendor_id, "DeviceId": dev.device_id})
    if dev.id.startswith("nic-"):
        doc["Links"]["EthernetInterfaces"] = [link(f"{ids.system}/EthernetInterfaces/{dev.id.removeprefix('nic-')}")]
    return doc


MEMORY_ID = "DIMM0"


def memory(ids: Ids, inv: Inventory) -> dict[str, Any]:
    doc = resource_head("Memory", f"{ids.system}/Memory/{MEMORY_ID}", MEMORY_ID, "Guest memory")
    doc.update({"MemoryType": "DRAM", "CapacityMiB": inv.memory_bytes // 2**20, "Status": _status()})
    return doc


def disks(inv: Inventory) -> list[Disk]:
    return [d for d in inv.disks if d.kind == "disk"]


def sized_disks(inv: Inventory) -> list[Disk]:
    """The disks whose size is known. Where a client chooses among sizes, a disk of unknown size is left out
    rather than shown with a null: sushy keeps a Volume's null CapacityBytes, and Ironic's inspection then
    compares it with numbers (TypeError: local_gb fails); Ironic's RAID interface sizes its free space from the
    Drives. SimpleStorage lists every disk: sushy drops a null size there."""
    return [d for d in disks(inv) if d.size_bytes is not None]


def simple_storage(ids: Ids, inv: Inventory) -> dict[str, Any]:
    doc = resource_head("SimpleStorage", f"{ids.system}/SimpleStorage/{STORAGE_ID}", STORAGE_ID, "Virtual disks")
    doc.update({"Devices": [{"Name": d.name, "CapacityBytes": d.size_bytes, "Manufacturer": "KubeVirt",
                             "Model": f"{d.bus or 'virtio'} disk", "Status": _status()} for d in disks(inv)],
                "Status": _status()})
    return doc


def drive_paths(ids: Ids, inv: Inventory) -> list[str]:
    # Drives belong to the Chassis: /Systems/{id}/Storage/{id}/Drives/{id} is deprecated since Storage v1_13.
    return [f"{ids.chassis}/Drives/{d.name}" for d in sized_disks(inv)]


def storage(ids: Ids, inv: Inventory) -> dict[str, Any]:
    path = f"{ids.system}/Storage/{STORAGE_ID}"
    doc = resource_head("Storage", path, STORAGE_ID, "Virtual disks")
    drives = [link(p) for p in drive_paths(ids, inv)]
    doc.update({"Drives@odata.count": len(drives), "Drives": drives, "Status": _status(),
                "Controllers": link(f"{path}/Controllers"), "Volumes": link(f"{path}/Volumes")})
    return doc


# KubeVirt disk bus -> DMTF Protocol. virtio-blk and virtio-scsi are PCIe devices on the VM's bus.
PROTOCOLS = {"virtio": "PCIe", "scsi": "PCIe", "sata": "SATA", "usb": "USB"}
CONTROLLER_ID = "1"
# A VM's disk is one volume on one drive, as a hardware controller exposes a single disk as a RAID0 volume; the
# controller can make a new one (a new blank disk) and nothing else: no mirror, no parity, no span.
RAID_TYPES = ("RAID0",)
# A created disk is in the VM from its next boot on, a deleted one gone from then: both OnReset.
VOLUME_APPLY_TIMES = ("OnReset",)


def storage_controller(ids: Ids, inv: Inventory) -> dict[str, Any]:
    """The VM's disk controllers as one: what its disks are attached through, making single-drive RAID0 volumes."""
    path = f"{ids.system}/Storage/{STORAGE_ID}/Controllers/{CONTROLLER_ID}"
    doc = resource_head("StorageController", path, CONTROLLER_ID, "Virtual disk controller")
    protocols = sorted({PROTOCOLS.get(d.bus, "PCIe") for d in disks(inv)})
    doc.update({"Status": _status(), "SupportedControllerProtocols": ["PCIe"],
                "SupportedDeviceProtocols": protocols, "SupportedRAIDTypes": list(RAID_TYPES)})
    return doc


def volume_paths(ids: Ids, inv: Inventory) -> list[str]:
    return [f"{ids.system}/Storage/{STORAGE_ID}/Volumes/{d.name}" for d in sized_disks(inv)]


def volume_collection(ids: Ids, inv: Inventory) -> dict[str, Any]:
    doc = collection("VolumeCollection", f"{ids.system}/Storage/{STORAGE_ID}/Volumes", "Volumes",
                     volume_paths(ids, inv))
    doc["@Redfish.OperationApplyTimeSupport"] = {"SupportedValues": list(VOLUME_APPLY_TIMES)}
    return doc


def volume(ids: Ids, disk: Disk, created: bool = False) -> dict[str, Any]:
    """A disk as a volume of one drive. RAIDType RAID0 only for the volumes this controller made (and may delete
    again); the VM's own disks are not RAID volumes, and Ironic's RAID interface leaves volumes without a
    RAIDType alone (update_raid_config, delete_configuration)."""
    doc = resource_head("Volume", f"{ids.system}/Storage/{STORAGE_ID}/Volumes/{disk.name}", disk.name, disk.name)
    doc.update({"CapacityBytes": disk.size_bytes, "Status": _status(),
                "Links": {"Drives": [link(f"{ids.chassis}/Drives/{disk.name}")]}})
    if created:
        doc["RAIDType"] = "RAID0"
    return doc


def drive(ids: Ids, disk: Disk) -> dict[str, Any]:
    """MediaType: DMTF has no value for a virtual disk; SSD says what Ironic asks it for (not rotational: no seek
    time of its own). Protocol: the disk's bus."""
    doc = resource_head("Drive", f"{ids.chassis}/Drives/{disk.name}", disk.name, f"Disk {disk.name}")
    doc.update({"CapacityBytes": disk.size_bytes, "MediaType": "SSD", "Protocol": PROTOCOLS.get(disk.bus, "PCIe"),
                "Manufacturer": "KubeVirt", "Model": f"{disk.bus or 'virtio'} disk", "Status": _status()})
    return doc


# ---- tasks

TASK_SERVICE = f"{ROOT}/TaskService"
TASKS = f"{TASK_SERVICE}/Tasks"


def task_service() -> dict[str, Any]:
    doc = resource_head("TaskService", TASK_SERVICE, "TaskService", "Task Service")
    doc.update({"ServiceEnabled": True, "CompletedTaskOverWritePolicy": "Oldest",
                "LifeCycleEventOnTaskStateChange": False, "Status": _status(), "Tasks": link(TASKS)})
    return doc


def task(task: Any) -> dict[str, Any]:
    """A virtual media insert as a Task (vbmc/redfish/tasks.py)."""
    doc = resource_head("Task", f"{TASKS}/{task.id}", task.id, f"Insert {task.shown_image} into {task.slot}")
    failed = task.state == "Exception"
    doc.update({
        "TaskState": task.state,
        "TaskStatus": "Warning" if failed else "OK",
        "StartTime": _iso(task.started),
        "PercentComplete": task.percent,
        "Messages": [{"MessageId": "Base.1.19.GeneralError" if failed else "Base.1.19.Success",
                      "Message": task.message or "The image is being imported.",
                      "Severity": "Warning" if failed else "OK"}],
    })
    if task.ended is not None:
        doc["EndTime"] = _iso(task.ended)
    return doc


def _iso(seconds: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S+00:00")


# ---- virtual media


def virtual_media(base: str, media: VirtualMedia) -> dict[str, Any]:
    """`base` is the collection the medium is reached through (the Manager's or the System's)."""
    path = f"{base}/{media.slot}"
    doc = resource_head("VirtualMedia", path, media.slot, f"Virtual {media.slot}")
    if media.state == MediaState.ABSENT:
        # A slot with no drive behind it: "Absent" is Redfish's "a location where a device can be installed".
        # No actions are offered, and the Description says what is missing.
        doc.update({"MediaTypes": ["CD", "DVD"], "Image": None, "ImageName": None, "ConnectedVia": "NotConnected",
                    "Inserted": False, "WriteProtected": media.write_protected, "Status": {"State": "Absent"},
                    "Description": media.message})
        return doc
    image = redact_url(media.image) or None  # an image URL's user and password are never shown
    failed = media.state == MediaState.FAILED
    # A medium uploaded from a client (the web page): "upload:<file name>", connected through that application.
    uploaded = bool(image and image.startswith(UPLOAD_SCHEME))
    name = unquote(image[len(UPLOAD_SCHEME):]) if image and uploaded else \
        image.rsplit("/", 1)[-1].split("?", 1)[0] if image else None
    doc.update({
        "MediaTypes": ["CD", "DVD"],
        "Image": image,
        "ImageName": name,
        "ConnectedVia": "Applet" if uploaded else "URI" if media.inserted else "NotConnected",
        "Inserted": media.inserted,
        "WriteProtected": media.write_protected,
        "TransferMethod": "Upload" if uploaded else "Stream",
        "TransferProtocolType": None if uploaded else (image.split(":", 1)[0].upper() if image else None),
        "Status": _status(HealthState.WARNING if failed else HealthState.OK,
                          "Starting" if media.state == MediaState.INSERTING else "Enabled"),
        "Actions": {
            "#VirtualMedia.InsertMedia": {"target": f"{path}/Actions/VirtualMedia.InsertMedia",
                                          # What CDI's importer fetches (Ironic picks from this list).
                                          "TransferProtocolType@Redfish.AllowableValues": list(TRANSFER_PROTOCOLS)},
            "#VirtualMedia.EjectMedia": {"target": f"{path}/Actions/VirtualMedia.EjectMedia"},
        },
    })
    if media.message:
        doc["Description"] = media.message
    return doc


TRANSFER_PROTOCOLS = ("HTTP", "HTTPS")


# ---- manager and chassis


# What resetting a BMC means for an agent (vbmc/redfish/logs.py, reset): every session ends and the service answers
# 503 for a moment; the VM is not touched. Graceful or forced, the agent restarts its service the same way.
MANAGER_RESETS = ("ForceRestart", "GracefulRestart")


def manager(ids: Ids, uuid: str, version: str, has_media: bool,
            consoles: Mapping[str, Any] | None = None, oem: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The BMC: the agent (FirmwareVersion is its version); `oem` is what Oem.KubeVBMC says of it (`manager_oem`)."""
    path = ids.manager
    doc = resource_head("Manager", path, ids.manager_id, "KubeVBMC virtual BMC")
    doc.update({
        "ManagerType": "BMC",
        "UUID": uuid,
        "Manufacturer": "KubeVBMC",
        "Model": "KubeVBMC agent",
        "FirmwareVersion": version,
        "PowerState": "On",
        "Status": _status(),
        "NetworkProtocol": link(f"{path}/NetworkProtocol"),
        "EthernetInterfaces": link(f"{path}/EthernetInterfaces"),
        "LogServices": link(f"{path}/LogServices"),
        "Links": {"ManagerForServers": [link(ids.system)], "ManagerForChassis": [link(ids.chassis)],
                  "ManagerInChassis": link(ids.chassis)},
        "Actions": {"#Manager.Reset": {"target": f"{path}/Actions/Manager.Reset",
                                       "ResetType@Redfish.AllowableValues": list(MANAGER_RESETS)}},
    })
    if has_media:
        doc["VirtualMedia"] = link(f"{path}/VirtualMedia")
    doc.update(consoles or {})
    if oem is not None:
        doc["Oem"] = {"KubeVBMC": {"@odata.type": OEM_MANAGER, **oem}}
    return doc


@dataclass(frozen=True)
class Certificate:
    """What a client checks of the certificate the BMC serves HTTPS with (vbmc/redfish/managers.py reads it)."""

    fingerprint: str  # SHA-256 of the leaf's DER, "AB:CD:..." as `openssl x509 -fingerprint -sha256` prints it
    ca_fingerprint: str | None  # the chain's CA, when the served chain includes it
    not_after: str  # ISO 8601


def manager_oem(host: str, ports: Mapping[str, int], page: bool, tls: Certificate | None) -> dict[str, Any]:
    """The Manager's Oem.KubeVBMC: the HTTPS certificate (null without HTTPS) and where the BMC is reached at
    `host` on the Service's `ports` (HTTPS first; `page`: the agent serves its page beside Redfish)."""
    bracketed = f"[{host}]" if ":" in host else host

    def url(scheme: str, path: str) -> str:
        port = ports[scheme.upper()]
        default = {"http": 80, "https": 443}[scheme]
        return f"{scheme}://{bracketed}{'' if port == default else f':{port}'}{path}"

    schemes = [s for s in ("https", "http") if s.upper() in ports]
    return {
        "TLS": None if tls is None else {"CertificateFingerprintSHA256": tls.fingerprint,
                                         "CAFingerprintSHA256": tls.ca_fingerprint, "NotAfter": tls.not_after},
        "Endpoints": {
            "Redfish": [url(s, ROOT) for s in schemes],
            "IPMI": f"{bracketed}:{ports['IPMI']}" if "IPMI" in ports else None,
            "Page": url(schemes[0], "/") if page and schemes else None,
        },
    }


def chassis(ids: Ids, inv: Inventory, power: PowerState, health: Health,
            identify: Identify | None = None) -> dict[str, Any]:
    doc = resource_head("Chassis", ids.chassis, ids.chassis_id, f"{inv.name} chassis")
    on = power in (PowerState.ON, PowerState.PAUSED, PowerState.POWERING_OFF)
    doc.update({
        # A virtual machine has no enclosure; "Other" is the honest ChassisType.
        "ChassisType": "Other",
        "Manufacturer": "KubeVirt",
        "Model": inv.model or "KubeVirt VirtualMachine",
        "SerialNumber": inv.serial,
        # The VM is its own enclosure: the chassis has the system's UUID (the VM's firmware UUID).
        "UUID": inv.uuid,
        "PowerState": "On" if on else "Off",
        "Status": _status(health.state),
        **indicator(identify or Identify()),
        "PCIeDevices": link(f"{ids.chassis}/PCIeDevices"),
        "Drives": link(f"{ids.chassis}/Drives"),
        "Power": link(f"{ids.chassis}/Power"),
        "Thermal": link(f"{ids.chassis}/Thermal"),
        "Links": {"ComputerSystems": [link(ids.system)], "ManagedBy": [link(ids.manager)],
                  "ManagersInChassis": [link(ids.manager)]},
    })
    return doc


def power(ids: Ids) -> dict[str, Any]:
    """A VM has no power supply, no meter and no cap: no PowerControl, no PowerSupplies, nothing measured, nothing
    invented. (Power and Thermal are deprecated for PowerSubsystem and ThermalSubsystem; the OCP baseline and
    Ironic's profile still read them.)"""
    doc = resource_head("Power", f"{ids.chassis}/Power", "Power", "Power")
    doc.update({"Description": "A virtual machine draws no power of its own that anything measures or limits.",
                "PowerControl": [], "PowerSupplies": []})
    return doc


def thermal(ids: Ids) -> dict[str, Any]:
    """A VM has no fan and no temperature sensor: empty lists, not readings made up."""
    doc = resource_head("Thermal", f"{ids.chassis}/Thermal", "Thermal", "Thermal")
    doc.update({"Description": "A virtual machine has no fans and no temperature sensors.", "Fans": [],
                "Temperatures": [], "Status": _status()})
    return doc


def manager_interface(ids: Ids, host_name: str, fqdn: str | None, address: str) -> dict[str, Any]:
    """How clients reach the BMC: the Kubernetes Service's address and names (the agent's pod address changes with
    every restart). A Service has no MAC, no link speed and no gateway of its own: those are null, not invented;
    its ClusterIP is one address (a /32), assigned by the cluster (Static to the BMC: nothing it can change)."""
    doc = resource_head("EthernetInterface", f"{ids.manager}/EthernetInterfaces/{MANAGER_NIC}", MANAGER_NIC,
                        "Kubernetes Service")
    doc.update({
        "Description": "The Service clients reach this BMC through.",
        "MACAddress": None, "PermanentMACAddress": None, "SpeedMbps": None, "InterfaceEnabled": True,
        "LinkStatus": "LinkUp", "Status": _status(), "HostName": host_name, "FQDN": fqdn,
        "NameServers": [], "DHCPv4": {"DHCPEnabled": False}, "DHCPv6": {"OperatingMode": "Disabled"},
        "IPv4Addresses": [{"Address": address, "SubnetMask": "255.255.255.255", "AddressOrigin": "Static",
                           "Gateway": None}] if address else [],
    })
    return doc


MANAGER_NIC = "Service"


# ---- logs: the system event log (SEL) and the BMC's audit trail

SEL_LOG = "SEL"
AUDIT_LOG = "AuditLog"


def log_service(path: str, id_: str, name: str, description: str, entry_type: str, capacity: int,
                overwrite: str, now: float) -> dict[str, Any]:
    doc = resource_head("LogService", path, id_, name)
    doc.update({
        "Description": description, "MaxNumberOfRecords": capacity, "OverWritePolicy": overwrite,
        "DateTime": _iso(now), "DateTimeLocalOffset": "+00:00", "ServiceEnabled": True, "LogEntryType": entry_type,
        "Status": _status(), "Entries": link(f"{path}/Entries"),
        "Actions": {"#LogService.ClearLog": {"target": f"{path}/Actions/LogService.ClearLog"}},
    })
    return doc


def sel_entry(base: str, record: LogRecord) -> dict[str, Any]:
    """A system event log record; an entry an IPMI client added is shown as the bytes it added."""
    doc = resource_head("LogEntry", f"{base}/Entries/{record.record_id}", str(record.record_id),
                        f"SEL entry {record.record_id}")
    message = record.message or f"An IPMI client added this SEL entry: {record.raw.hex(' ')}."
    doc.update({"EntryType": "SEL", "Created": _iso(record.stamp), "Message": message,
                "Severity": "Warning" if record.kind == "Warning" else "OK"})
    return doc


def audit_entry(base: str, entry: Any) -> dict[str, Any]:
    """An audit record: who did what, through which protocol, from where, and how it ended."""
    f = entry.fields
    doc = resource_head("LogEntry", f"{base}/Entries/{entry.entry_id}", str(entry.entry_id),
                        f"Audit entry {entry.entry_id}")
    who = f"user {f['user']}" if f.get("user", "-") != "-" else "no user"
    doc.update({"EntryType": "Event", "Created": _iso(entry.stamp),
                "Message": f"{f['action']} by {who} through {f['protocol']} from {f['source']}: {f['result']}",
                "Severity": "Warning" if entry.warning else "OK"})
    return doc


def network_protocol(ids: Ids, host_name: str, fqdn: str | None, ports: dict[str, int]) -> dict[str, Any]:
    """The ports clients reach this BMC on (the Service's, not the pod's unprivileged ones)."""
    doc = resource_head("ManagerNetworkProtocol", f"{ids.manager}/NetworkProtocol", "NetworkProtocol",
                        "Manager Network Protocol")
    doc.update({"HostName": host_name, "FQDN": fqdn, "Status": _status()})
    for protocol in ("HTTP", "HTTPS", "IPMI"):
        port = ports.get(protocol)
        doc[protocol] = {"ProtocolEnabled": port is not None, "Port": port}
    return doc


# ---- sessions and accounts


def session_service(timeout: int) -> dict[str, Any]:
    doc = resource_head("SessionService", f"{ROOT}/SessionService", "SessionService", "Session Service")
    doc.update({"ServiceEnabled": True, "SessionTimeout": timeout, "Status": _status(),
                "Sessions": link(f"{ROOT}/SessionService/Sessions")})
    return doc


def session(s: Session, viewers: Sequence[Viewer] = (), current: bool = False) -> dict[str, Any]:
    """A session: who (UserName), from where (ClientOriginIPAddress), since when, through what (SessionType: Redfish,
    or WebUI for the BMC's page), and under Oem.KubeVBMC the consoles it has open and whether it is the caller's."""
    doc = resource_head("Session", f"{ROOT}/SessionService/Sessions/{s.id}", s.id, f"Session {s.id}")
    doc.update({"UserName": s.username, "Password": None, "SessionType": s.kind, "CreatedTime": s.created})
    if s.origin:
        doc["ClientOriginIPAddress"] = s.origin
    doc["Oem"] = {"KubeVBMC": {
        "@odata.type": OEM_SESSION,
        "Current": current,
        "Consoles": [{"Console": v.console, "ClientOriginIPAddress": v.origin, "Since": v.since} for v in viewers],
    }}
    return doc


def account_service() -> dict[str, Any]:
    doc = resource_head("AccountService", f"{ROOT}/AccountService", "AccountService", "Account Service")
    doc.update({"ServiceEnabled": True, "LocalAccountAuth": "Enabled", "Status": _status(),
                "Accounts": link(f"{ROOT}/AccountService/Accounts"),
                "Roles": link(f"{ROOT}/AccountService/Roles")})
    return doc


def account(username: str) -> dict[str, Any]:
    doc = resource_head("ManagerAccount", f"{ROOT}/AccountService/Accounts/{ACCOUNT_ID}", ACCOUNT_ID, "User Account")
    doc.update({"UserName": username, "RoleId": "Administrator", "Enabled": True, "Locked": False,
                "Password": None, "AccountTypes": ["Redfish", "IPMI"],
                "Links": {"Role": link(f"{ROOT}/AccountService/Roles/Administrator")}})
    return doc


def role(role_id: str) -> dict[str, Any]:
    doc = resource_head("Role", f"{ROOT}/AccountService/Roles/{role_id}", role_id, f"{role_id} role")
    doc.update({"RoleId": role_id, "IsPredefined": True, "AssignedPrivileges": list(ROLES[role_id])})
    return doc


# ---- events


def event_service(attempts: int, interval: int, prefixes: Sequence[str], types: Sequence[str]) -> dict[str, Any]:
    doc = resource_head("EventService", EVENT_SERVICE, "EventService", "Event Service")
    doc.update({
        "ServiceEnabled": True,
        "Status": _status(),
        "DeliveryRetryAttempts": attempts,
        "DeliveryRetryIntervalSeconds": interval,
        "EventFormatTypes": ["Event"],
        "RegistryPrefixes": list(prefixes),
        "ResourceTypes": list(types),
        "ServerSentEventUri": SSE_URI,
        # $filter on the SSE URI: RegistryPrefix, ResourceType and OriginResource, with eq, or and and.
        "SSEFilterPropertiesSupported": {"EventFormatType": False, "MessageId": False,
                                         "MetricReportDefinition": False, "OriginResource": True,
                                         "RegistryPrefix": True, "ResourceType": True,
                                         "SubordinateResources": False},
        "Subscriptions": link(SUBSCRIPTIONS),
        "Actions": {"#EventService.SubmitTestEvent": {"target": SUBMIT_TEST_EVENT}},
    })
    return doc


def event_destination(sub: Any) -> dict[str, Any]:
    """`sub` is a vbmc.eventservice.Subscription. HttpHeaders are never shown (DSP0266: empty in responses)."""
    doc = resource_head("EventDestination", f"{SUBSCRIPTIONS}/{sub.id}", sub.id, f"Event subscription {sub.id}")
    origins = [link(o) for o in sub.origin_resources]
    enabled = sub.state == "Enabled"
    doc.update({
        "Destination": sub.destination,
        "Context": sub.context,
        "Protocol": "Redfish",
        "SubscriptionType": "RedfishEvent",
        "EventFormatType": "Event",
        "RegistryPrefixes": list(sub.registry_prefixes),
        "ResourceTypes": list(sub.resource_types),
        "OriginResources": origins,
        "OriginResources@odata.count": len(origins),
        "HttpHeaders": [],
        "VerifyCertificate": sub.verify_certificate,
        "DeliveryRetryPolicy": sub.retry_policy,
        "Status": {"State": "Enabled" if enabled else "Disabled", "Health": "OK" if enabled else "Warning"},
    })
    if not enabled:
        doc["Description"] = ("Suspended: deliveries failed after every retry. Delete this subscription and "
                              "create it again to resume.")
    return doc
