"""The Machine model: one small interface, in BMC terms, that both protocol frontends speak.

IPMI and Redfish translate their requests into these calls and render the answers and the typed errors in
their own protocol; backends (`KubeVirtMachine`, `MemoryMachine`) implement them. Nothing here knows about IPMI,
Redfish or KubeVirt.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from ..access import audit
from .errors import BackendUnavailable as BackendUnavailable
from .errors import ConsoleUnavailable as ConsoleUnavailable
from .errors import ImageUnusable as ImageUnusable
from .errors import InvalidRequest as InvalidRequest
from .errors import MachineError as MachineError
from .errors import Unsupported as Unsupported
from .eventlog import SystemEventLog
from .events import POWER_STATE_CHANGED, EventBus

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .bios import BiosState, BootProgress, FirmwareImage

log = logging.getLogger("vbmc.machine")


class PowerState(StrEnum):
    ON = "On"
    OFF = "Off"
    POWERING_ON = "PoweringOn"
    POWERING_OFF = "PoweringOff"
    PAUSED = "Paused"


class ResetType(StrEnum):
    """Redfish ResetType names; IPMI chassis control maps onto a subset."""

    ON = "On"
    FORCE_ON = "ForceOn"
    FORCE_OFF = "ForceOff"
    GRACEFUL_SHUTDOWN = "GracefulShutdown"
    GRACEFUL_RESTART = "GracefulRestart"
    FORCE_RESTART = "ForceRestart"
    POWER_CYCLE = "PowerCycle"
    PUSH_POWER_BUTTON = "PushPowerButton"
    NMI = "Nmi"
    PAUSE = "Pause"
    RESUME = "Resume"


class BootTarget(StrEnum):
    NONE = "None"
    PXE = "Pxe"
    HDD = "Hdd"
    CD = "Cd"
    BIOS_SETUP = "BiosSetup"
    UEFI_HTTP = "UefiHttp"


class BootEnabled(StrEnum):
    DISABLED = "Disabled"
    ONCE = "Once"
    CONTINUOUS = "Continuous"


class BootMode(StrEnum):
    UEFI = "UEFI"
    LEGACY = "Legacy"


class HealthState(StrEnum):
    OK = "OK"
    WARNING = "Warning"
    CRITICAL = "Critical"


class MediaState(StrEnum):
    EJECTED = "Ejected"
    INSERTING = "Inserting"  # the image is being imported
    INSERTED = "Inserted"
    FAILED = "Failed"
    ABSENT = "Absent"  # the slot has no drive behind it (a VM without a cdrom disk): nothing can be inserted


@dataclass(frozen=True)
class BootOverride:
    target: BootTarget = BootTarget.NONE
    enabled: BootEnabled = BootEnabled.DISABLED
    mode: BootMode = BootMode.UEFI
    # UefiHttp: the image the firmware boots (Redfish HttpBootUri); "" for any other target. Backends boot it as
    # sushy-tools does on libvirt: imported into the virtual CD and booted from there.
    http_boot_uri: str = ""


@dataclass(frozen=True)
class Identify:
    """The chassis identify indicator (a physical BMC's blue LED): Redfish LocationIndicatorActive, IPMI chassis
    identify. `until` is when it goes off by itself (time.time() seconds; IPMI's interval), None when it stays on
    until turned off; `blinking` as Redfish's IndicatorLED tells Lit from Blinking (IPMI's identify blinks)."""

    active: bool = False
    until: float | None = None
    blinking: bool = False


@dataclass(frozen=True)
class SecureBoot:
    """UEFI secure boot as a BMC reports it: what the next boot will use, what the running boot used."""

    enabled: bool = False  # the next boot's setting (KubeVirt: the VM template)
    current: bool | None = None  # the running boot's (KubeVirt: the VMI's spec); None while the machine is off
    uefi: bool = True  # secure boot exists only under UEFI firmware


@dataclass(frozen=True)
class Health:
    state: HealthState = HealthState.OK
    message: str = ""


@dataclass(frozen=True)
class VirtualMedia:
    slot: str = "Cd"  # later also "Usb"
    image: str = ""
    inserted: bool = False
    write_protected: bool = True
    state: MediaState = MediaState.EJECTED
    message: str = ""
    progress: int | None = None  # percent of the import done, while INSERTING (None: not known)


# The Image of a medium uploaded from a client's disk (Machine.upload_media): "upload:" and its file name,
# percent-encoded as in a URI ("upload:debian-13.iso").
UPLOAD_SCHEME = "upload:"


class MediaUpload(Protocol):
    """A medium on its way from a client's disk into a slot (Machine.upload_media): its bytes are written in order,
    then it is finished (the medium is inserted) or aborted (nothing of it is left). Blocking calls, each bounded in
    time; one thread at a time."""

    def write(self, data: bytes) -> None:
        """The next bytes of the image; raises MachineError when the upload cannot go on (it is then aborted)."""

    def finish(self) -> VirtualMedia:
        """All bytes are written: insert the medium as insert_media does; the slot as it is then."""

    def abort(self) -> None:
        """Give up (the client went away): remove whatever the upload created; the slot is as it was before."""


@dataclass(frozen=True)
class Nic:
    name: str
    mac: str
    link_up: bool | None = None  # None: the backend cannot tell apart from power (up while the machine runs)
    model: str = "virtio"  # the emulated device (KubeVirt's interfaces[].model)


@dataclass(frozen=True)
class PcieDevice:
    """A device on the machine's PCI(e) bus as its definition gives it: a NIC, a disk controller, a GPU or a
    passed-through host device. Vendor and device IDs only where the emulated model fixes them (virtio, e1000...);
    "" where nothing states them (a host device's are the host's, which KubeVirt does not report)."""

    id: str
    name: str
    device_class: str  # DMTF PCIeFunction DeviceClass: NetworkController, MassStorageController, DisplayController...
    model: str
    vendor_id: str = ""  # "0x1af4"
    device_id: str = ""
    manufacturer: str = ""
    address: str = ""  # the guest PCI address when the definition pins it ("0000:81:01.0")


@dataclass(frozen=True)
class Disk:
    name: str
    kind: str = "disk"  # disk or cdrom
    size_bytes: int | None = None  # None: not known (a containerDisk), never a guess
    bus: str = ""  # virtio, sata, scsi, usb (KubeVirt's disk bus)
    created: bool = False  # added through the BMC (create_disk), so it may delete it again (delete_disk)


@dataclass(frozen=True)
class Inventory:
    uuid: str
    name: str
    serial: str = ""
    cpu_sockets: int = 1
    cpu_cores: int = 1
    cpu_threads: int = 1
    memory_bytes: int = 0
    nics: tuple[Nic, ...] = ()
    disks: tuple[Disk, ...] = ()
    firmware: BootMode = BootMode.UEFI
    secure_boot: bool = False
    architecture: str = "amd64"  # KubeVirt's spec.architecture: amd64, arm64, s390x, ppc64le
    model: str = ""  # the instancetype, else the machine type (q35)
    cpu_model: str = ""  # the vCPU model as the definition names it (host-passthrough, Skylake-Server...); "": unstated
    pcie_devices: tuple[PcieDevice, ...] = ()

    @property
    def cpu_count(self) -> int:
        return self.cpu_sockets * self.cpu_cores * self.cpu_threads


class Tally:
    """A count that any thread may add to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self) -> None:
        with self._lock:
            self.value += 1


# Reads a backend refused (BackendUnavailable) because its view of the machine may be out of date, in this process:
# the agent's kubevbmc_agent_stale_reads_total, what an alert on an agent cut off from its API server watches (the
# agent stays ready meanwhile, answering busy).
STALE_READS = Tally()


class SerialConsole(Protocol):
    """An open line to a running machine: its serial port (Machine.open_console) or its screen (open_screen)."""

    def send(self, data: bytes) -> None:
        """Write to the line; raises ConsoleUnavailable when the line has gone away."""

    def close(self) -> None:
        """Hang up; no callback follows."""


class Machine(abc.ABC):
    """A machine as a BMC sees it. Reads are cheap (from a cache); writes may raise the errors above."""

    media_max_size: int = 64 * 2**30  # the largest image virtual media takes (the agent's --media-max-size)

    @abc.abstractmethod
    def power_state(self) -> PowerState: ...

    @abc.abstractmethod
    def health(self) -> Health: ...

    @abc.abstractmethod
    def reset(self, reset_type: ResetType) -> None:
        """Perform a power action (raises Unsupported for Nmi and anything not in supported_reset_types)."""

    @abc.abstractmethod
    def supported_reset_types(self) -> tuple[ResetType, ...]: ...

    @abc.abstractmethod
    def boot_override(self) -> BootOverride: ...

    @abc.abstractmethod
    def set_boot_override(self, override: BootOverride) -> None: ...

    @abc.abstractmethod
    def supported_boot_targets(self) -> tuple[BootTarget, ...]: ...

    @abc.abstractmethod
    def inventory(self) -> Inventory: ...

    @abc.abstractmethod
    def virtual_media(self, slot: str = "Cd") -> VirtualMedia:
        """The medium in a slot; state ABSENT, with the reason as message, when the slot has no drive."""

    @abc.abstractmethod
    def insert_media(self, image: str, slot: str = "Cd", write_protected: bool = True) -> None:
        """Insert an image; raises Unsupported when the slot has no drive, InvalidRequest when one is in."""

    @abc.abstractmethod
    def eject_media(self, slot: str = "Cd") -> None:
        """Eject the medium (nothing in: nothing to do); raises Unsupported when the slot has no drive."""

    @property
    def events(self) -> EventBus:
        """What happened to this machine (vbmc/machine/events.py): the frontends' SEL and EventService follow it."""
        bus = self.__dict__.get("_event_bus")
        if bus is None:
            bus = self.__dict__.setdefault("_event_bus", EventBus())  # setdefault: one bus even when two race
        return bus

    @property
    def event_log(self) -> SystemEventLog:
        """The system event log (vbmc/machine/eventlog.py): IPMI's SEL and Redfish's SEL LogService show it. It
        follows the event bus from its first use, with what the bus's history still holds from before."""
        found = self.__dict__.get("_event_log")
        if found is None:
            found = self.__dict__.setdefault("_event_log", SystemEventLog())
        found.follow(self.events)
        return found

    @property
    def audit_trail(self) -> audit.Trail:
        """Who did what to this machine through its BMC, recently (vbmc/access/audit.py): the frontends record into
        it, Redfish's Manager shows it as a LogService."""
        found = self.__dict__.get("_audit_trail")
        if found is None:
            found = self.__dict__.setdefault("_audit_trail", audit.Trail())
        return found

    def record_event(self, reason: str, message: str, kind: str = "Normal") -> None:
        """Tell the machine's owners (KubeVirt: a Kubernetes Event on the VirtualMachineBMC) and the event bus; best
        effort, may take up to a second, so callers on a protocol's serving thread hand it to another thread.
        Default: the bus and a log line."""
        self.events.publish(reason, message, kind)
        log.info("event %s %s: %s", kind, reason, message)

    def notify_changed(self, power: PowerState | None = None) -> None:
        """Backends call this when their view of the machine may have changed (a watch event, a write), with the
        power state when they know it: publishes PowerStateChanged when it is not the one last seen. Cheap: one
        read of the cached state."""
        if power is None:
            try:
                power = self.power_state()
            except MachineError:
                return  # nothing trustworthy to compare (a stale cache, a VM not there yet)
        lock = self.__dict__.setdefault("_observed_lock", threading.Lock())
        with lock:
            before = self.__dict__.get("_observed_power")
            self.__dict__["_observed_power"] = power
        if before is not None and before != power:
            self.events.publish(POWER_STATE_CHANGED, f"power state changed from {before} to {power}",
                                **{"from": str(before), "to": str(power)})

    def client_arrived(self) -> None:
        """A client has just reached the BMC (an IPMI packet, a Redfish request): a backend whose next read may need
        a round trip first (KubeVirt: caches silent for longer than the staleness bound) starts it now, in the
        background, so that the read does not wait for all of it. Must not block; the default has nothing to do."""
        return None

    def report_serving(self, serving: bool, message: str) -> None:
        """Tell the machine's owner whether the BMC in front of it serves everything it should: a pool member's
        own readiness, which the pool's pod cannot show (it stays ready while any member serves). Blocking; the
        default has nobody to tell but the log."""
        log.debug("machine %s: %s", "serving" if serving else "not serving", message or "every listener up")

    def secure_boot(self) -> SecureBoot:
        """UEFI secure boot; the default reads the inventory and claims no running boot."""
        inventory = self.inventory()
        return SecureBoot(inventory.secure_boot, None, inventory.firmware == BootMode.UEFI)

    def set_secure_boot(self, enabled: bool) -> None:
        """Enable or disable secure boot from the next boot on; raises InvalidRequest under BIOS firmware."""
        raise Unsupported("this machine cannot change secure boot")

    # BIOS settings, boot progress and firmware inventory: vbmc/machine/bios.py.

    def bios(self) -> BiosState:
        """The BIOS settings: in force for the next boot, pending (applied at the next power-on or reset), and the
        result of the last application."""
        raise Unsupported("this machine has no BIOS settings")

    def set_bios(self, attributes: Mapping[str, object]) -> None:
        """Make `attributes` pending for the next power-on or reset (merged with what is pending); raises
        bios.RefusedSetting, saying why, for a value that cannot be applied."""
        raise Unsupported("this machine has no BIOS settings")

    def reset_bios(self) -> None:
        """Make every writable attribute's default pending for the next power-on or reset (Bios.ResetBios)."""
        raise Unsupported("this machine has no BIOS settings")

    def boot_progress(self) -> BootProgress:
        """How far the machine's boot has got, as the backend can see it."""
        from .bios import BootProgress

        return BootProgress()

    def firmware_images(self) -> tuple[FirmwareImage, ...]:
        """The firmware the machine boots (its BIOS), as far as the backend knows it."""
        return ()

    def check_image(self, image: str) -> int | None:
        """Whether `image` can be inserted (raises ImageUnusable with the reason) and its size when known. Default:
        nothing to check."""
        return None

    def upload_media(self, slot: str, name: str, size: int) -> MediaUpload:
        """Begin a medium of `size` bytes that a client sends from its disk (file `name`) into `slot`; nothing is
        inserted until it is finished. Raises Unsupported when the slot has no drive (or the machine cannot take
        uploads), InvalidRequest when a medium is in (or on its way), ImageUnusable when it is too large."""
        raise Unsupported("this machine cannot take a medium uploaded from a client")

    def create_disk(self, size_bytes: int) -> str:
        """Add a blank disk of `size_bytes` that the machine gets at its next boot (Ironic's RAID interface creates
        volumes); its name. Default: Unsupported."""
        raise Unsupported("this machine cannot add disks")

    def delete_disk(self, name: str) -> None:
        """Remove a disk that create_disk added, from the next boot on; InvalidRequest for any other disk."""
        raise Unsupported("this machine cannot remove disks")

    def media_slots(self) -> tuple[str, ...]:
        """The virtual media slots the BMC has, like the virtual CD of a physical BMC: present whether or not the
        machine has a drive behind them (see virtual_media)."""
        return ("Cd",)

    def running_since(self) -> float | None:
        """When the running instance of the machine started (time.time() seconds; KubeVirt: the VMI's), None when
        it is not running or the backend cannot tell. IPMI's power-on-hours counter reads it."""
        return None

    def has_serial_console(self) -> bool:
        """Whether the machine has a serial port a console can attach to (KubeVirt: unless the VM sets
        `autoattachSerialConsole: false`)."""
        return False

    def open_console(self, output: Callable[[bytes], None], closed: Callable[[str], None]) -> SerialConsole:
        """Attach to the running machine's serial port. `output` gets what the machine writes and `closed` is called
        once, with the reason, when the line goes away (the machine stopped or was reset); both from another thread.
        Raises ConsoleUnavailable when the machine is not running or the backend refuses."""
        raise Unsupported("this machine has no serial console")

    def has_screen(self) -> bool:
        """Whether the machine has a graphics device whose screen a viewer can attach to (KubeVirt: unless the VM
        sets `autoattachGraphicsDevice: false`)."""
        return False

    def open_screen(self, output: Callable[[bytes], None], closed: Callable[[str], None]) -> SerialConsole:
        """Attach to the running machine's screen: the line carries RFB 3.8 (RFC 6143) as the machine's VNC server
        speaks it, from its ProtocolVersion on. `output` and `closed` as for open_console. Raises
        ConsoleUnavailable when the machine is not running, its screen is in use elsewhere or the backend
        refuses."""
        raise Unsupported("this machine has no screen")

    def identify(self) -> Identify:
        """The chassis identify indicator; the default has none (always off)."""
        return Identify()

    def set_identify(self, active: bool, seconds: int | None = None, blinking: bool = False) -> None:
        """Light the identify indicator (for `seconds`, blinking, else until turned off, lit or `blinking`) or turn it
        off. Kept where it survives the BMC's restart (KubeVirt: an annotation on the VM). Default: Unsupported."""
        raise Unsupported("this machine has no identify indicator")

    def service_address(self) -> str:
        """The address clients reach the BMC at, when the backend knows it (KubeVirt: the VirtualMachineBMC's
        status.clusterIP); "" otherwise, and the frontend uses the address it listens on."""
        return ""
