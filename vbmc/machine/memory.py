"""MemoryMachine: a Machine kept in memory, for protocol tests and protocol benchmarks (like sushy-tools' fake
driver). It follows the same rules as the KubeVirt backend where a client can tell: a Once boot override is
consumed by the next boot, power actions on a machine in the wrong state are no-ops or errors as on KubeVirt."""

from __future__ import annotations

import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from urllib.parse import urlsplit

from ..access.audit import redact_url
from . import bios as bios_model
from .model import (
    BootEnabled,
    BootMode,
    BootOverride,
    BootTarget,
    ConsoleUnavailable,
    Disk,
    Health,
    Identify,
    InvalidRequest,
    Inventory,
    Machine,
    MediaState,
    Nic,
    PcieDevice,
    PowerState,
    ResetType,
    SecureBoot,
    SerialConsole,
    Unsupported,
    VirtualMedia,
)

SUPPORTED_RESETS = (ResetType.ON, ResetType.FORCE_ON, ResetType.FORCE_OFF, ResetType.GRACEFUL_SHUTDOWN,
                    ResetType.GRACEFUL_RESTART, ResetType.FORCE_RESTART, ResetType.POWER_CYCLE,
                    ResetType.PUSH_POWER_BUTTON, ResetType.PAUSE, ResetType.RESUME)
SUPPORTED_TARGETS = (BootTarget.NONE, BootTarget.PXE, BootTarget.HDD, BootTarget.CD, BootTarget.UEFI_HTTP)
# The KubeVirt backend's words, so that the frontends' tests see what a user of a VM without a cdrom disk sees.
NO_CDROM = "the VM has no cdrom disk: add an empty cdrom disk to its template to use virtual media"
NO_HTTP_BOOT_URI = ("UefiHttp needs HttpBootUri: this BMC boots the image at that URI (imported into the virtual CD); "
                    "there is no DHCP-provided boot URI to fall back on")


def http_boot_cd_busy(image: str) -> str:
    return (f"the virtual CD holds {redact_url(image)}: UEFI HTTP boot imports its image into that drive; eject the "
            "medium first")


class MemoryMachine(Machine):
    def __init__(self, name: str = "vm", uuid: str | None = None, power: PowerState = PowerState.OFF,
                 has_cdrom: bool = True) -> None:
        self._lock = threading.Lock()
        self._power = power
        self._override = BootOverride()
        self._secure_boot = False  # the next boot's
        self._booted_secure = False  # the running boot's
        self._before_once: tuple[BootMode, bool] | None = None  # the firmware a Once override changed
        self._started: float | None = time.time() if power == PowerState.ON else None
        self._boots = 0  # how many times the machine has booted, so tests can see what a boot consumed
        self._last_boot_target = BootTarget.HDD
        self._media = VirtualMedia()
        self._http_medium = False  # the medium was put in by UEFI HTTP boot, not by a client
        self._bios_flags: dict[str, bios_model.Value] = {
            "Smm": bios_model.DISABLED, "TpmDevice": bios_model.DISABLED, "SerialPort": bios_model.ENABLED,
            "SerialConsoleRedirection": bios_model.DISABLED}
        self._bios_pending: dict[str, bios_model.Value] = {}
        self._bios_reset_pending = False
        self._bios_applied: bios_model.SettingsResult | None = None
        self._has_cdrom = has_cdrom
        self._line: MemoryConsole | None = None  # the attached serial console, hung up by a power off or reset
        self.console_input = bytearray()  # everything written to the serial port
        disks = [Disk("rootdisk", "disk", 10 * 2**30)]
        if has_cdrom:
            disks.append(Disk("cdrom", "cdrom"))
        self._identify = Identify()
        # What the KubeVirt backend reports of a VM of this shape (vmstate.pcie_devices): a virtio NIC, a virtio-blk
        # disk, the q35 machine's AHCI controller behind the cdrom.
        pcie = [PcieDevice("nic-default", "Interface default", "NetworkController", "virtio", "0x1af4", "0x1041",
                           "Red Hat"),
                PcieDevice("disk-rootdisk", "Disk controller of rootdisk", "MassStorageController", "virtio-blk",
                           "0x1af4", "0x1042", "Red Hat")]
        if has_cdrom:
            pcie.append(PcieDevice("sata", "SATA controller", "MassStorageController", "ICH9 AHCI", "0x8086",
                                   "0x2922", "Intel"))
        self._inventory = Inventory(
            uuid=uuid or str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"kubevbmc:{name}")), name=name,
            serial=name, cpu_sockets=1, cpu_cores=2, cpu_threads=1, memory_bytes=2 * 2**30,
            nics=(Nic("default", "02:00:00:00:00:01"),), disks=tuple(disks), firmware=BootMode.UEFI,
            cpu_model="host-model", pcie_devices=tuple(pcie))
        self.notify_changed(power)  # the power state the event bus compares the next one with

    # ---- power

    def power_state(self) -> PowerState:
        return self._power

    def health(self) -> Health:
        return Health()

    def supported_reset_types(self) -> tuple[ResetType, ...]:
        return SUPPORTED_RESETS

    def reset(self, reset_type: ResetType) -> None:
        if reset_type not in SUPPORTED_RESETS:
            raise Unsupported(f"reset type {reset_type} is not supported: KubeVirt has no NMI")
        started = self._started
        with self._lock:
            on = self._power in (PowerState.ON, PowerState.PAUSED, PowerState.POWERING_ON)
            if reset_type in (ResetType.ON, ResetType.FORCE_ON):
                if not on:
                    self._boot()
            elif reset_type in (ResetType.FORCE_OFF, ResetType.GRACEFUL_SHUTDOWN):
                self._power, self._started = PowerState.OFF, None
            elif reset_type == ResetType.PUSH_POWER_BUTTON:
                if on:
                    self._power, self._started = PowerState.OFF, None
                else:
                    self._boot()
            elif reset_type in (ResetType.FORCE_RESTART, ResetType.GRACEFUL_RESTART, ResetType.POWER_CYCLE):
                if not on and reset_type != ResetType.POWER_CYCLE:
                    raise InvalidRequest("the machine is off: a restart needs it on")
                self._boot()
            elif reset_type == ResetType.PAUSE:
                if self._power != PowerState.ON:
                    raise InvalidRequest("only a running machine can be paused")
                self._power = PowerState.PAUSED
            elif reset_type == ResetType.RESUME:
                if self._power != PowerState.PAUSED:
                    raise InvalidRequest("the machine is not paused")
                self._power = PowerState.ON
        if self._power == PowerState.OFF or self._started != started:
            self._hang_up("the machine powered off" if self._power == PowerState.OFF else "the machine was reset")
        self.notify_changed(self._power)

    def _boot(self) -> None:
        self._power = PowerState.ON
        self._started = time.time()
        self._boots += 1
        override = self._override
        if override.enabled != BootEnabled.DISABLED and override.target != BootTarget.NONE:
            self._last_boot_target = override.target
        else:
            self._last_boot_target = BootTarget.HDD
        self._apply_bios()  # pending BIOS settings take effect at the boot, before the firmware starts
        self._booted_secure = self._secure_boot and self._inventory.firmware == BootMode.UEFI
        if override.enabled == BootEnabled.ONCE:
            # A Once override is consumed by the boot it applied to, and so is the firmware it changed.
            self._restore_firmware()
            self._override = BootOverride(BootTarget.NONE, BootEnabled.DISABLED, self._inventory.firmware)
            self.events.publish("BootOverrideConsumed", f"boot once from {override.target} applied")

    def _set_firmware(self, mode: BootMode) -> None:
        if mode != self._inventory.firmware:
            self._secure_boot = False  # the KubeVirt backend's rule: BIOS has no secure boot to carry over
            self._inventory = replace(self._inventory, firmware=mode, secure_boot=False)

    def _restore_firmware(self) -> None:
        if self._before_once is not None:
            mode, secure = self._before_once
            self._before_once = None
            self._secure_boot = secure
            self._inventory = replace(self._inventory, firmware=mode, secure_boot=secure)

    # ---- secure boot

    def secure_boot(self) -> SecureBoot:
        running = self._power != PowerState.OFF
        return SecureBoot(self._secure_boot, self._booted_secure if running else None,
                          self._inventory.firmware == BootMode.UEFI)

    def set_secure_boot(self, enabled: bool) -> None:
        with self._lock:
            if self._inventory.firmware != BootMode.UEFI:
                raise InvalidRequest("secure boot needs UEFI firmware and the machine boots with BIOS: set the "
                                     "boot mode to UEFI first")
            if enabled == self._secure_boot:
                return
            self._secure_boot = enabled
            self._inventory = replace(self._inventory, secure_boot=enabled)
        self.events.publish("SecureBootEnabled" if enabled else "SecureBootDisabled",
                            f"{'enabled' if enabled else 'disabled'} UEFI secure boot from the next boot on")

    def running_since(self) -> float | None:
        return self._started if self._power != PowerState.OFF else None

    # ---- BIOS settings (vbmc/machine/bios_model.py): pending until the next boot

    def _bios_current(self) -> dict[str, bios_model.Value]:
        uefi = self._inventory.firmware == BootMode.UEFI
        return {"BootMode": bios_model.UEFI if uefi else bios_model.BIOS,
                "SecureBoot": bios_model.ENABLED if uefi and self._secure_boot else bios_model.DISABLED,
                **self._bios_flags, "MachineType": "q35", "SystemUuid": self._inventory.uuid,
                "SystemSerialNumber": self._inventory.serial}

    def bios(self) -> bios_model.BiosState:
        return bios_model.BiosState(tuple(self._bios_current().items()), tuple(self._bios_pending.items()),
                              self._bios_applied, self._bios_reset_pending)

    def set_bios(self, attributes: Mapping[str, object]) -> None:
        with self._lock:
            bios_model.check(self._bios_current(), {**self._bios_pending, **attributes})
            self._bios_pending.update(attributes)  # type: ignore[arg-type]  # checked above

    def reset_bios(self) -> None:
        with self._lock:
            self._bios_pending = bios_model.factory_defaults()
            self._bios_reset_pending = True

    def _apply_bios(self) -> None:
        pending, self._bios_pending, self._bios_reset_pending = self._bios_pending, {}, False
        if not pending:
            return
        stamp = datetime.now(UTC).isoformat(timespec="seconds")
        try:
            wanted = bios_model.check(self._bios_current(), pending)
        except bios_model.RefusedSetting as exc:
            self._bios_applied = bios_model.SettingsResult(stamp, (("Critical", exc.attribute, str(exc)),))
            return
        self._set_firmware(BootMode.UEFI if wanted["BootMode"] == bios_model.UEFI else BootMode.LEGACY)
        self._secure_boot = wanted["SecureBoot"] == bios_model.ENABLED
        self._inventory = replace(self._inventory, secure_boot=self._secure_boot)
        for name in self._bios_flags:
            self._bios_flags[name] = wanted[name]
        self._bios_applied = bios_model.SettingsResult(stamp, tuple(("OK", name, f"{name} set to {value}")
                                                              for name, value in pending.items()))

    def boot_progress(self) -> bios_model.BootProgress:
        if self._power == PowerState.OFF or self._started is None:
            return bios_model.BootProgress()
        since = datetime.fromtimestamp(self._started, UTC).isoformat(timespec="seconds")
        return bios_model.BootProgress(bios_model.BootProgressState.OS_BOOT_STARTED, since)

    def firmware_images(self) -> tuple[bios_model.FirmwareImage, ...]:
        uefi = self._inventory.firmware == BootMode.UEFI
        name = bios_model.firmware_name(bios_model.UEFI if uefi else bios_model.BIOS, self._secure_boot)
        return (bios_model.FirmwareImage("BIOS", name, None, "The machine's firmware.", related=("system",)),)


    # ---- serial console: a line that tests write the machine's output to (write_console)

    def has_serial_console(self) -> bool:
        return True

    def open_console(self, output: Callable[[bytes], None], closed: Callable[[str], None]) -> SerialConsole:
        if self._power == PowerState.OFF:
            raise ConsoleUnavailable("VMI is not running")
        line = MemoryConsole(self, output, closed)
        with self._lock:
            previous, self._line = self._line, line
        if previous is not None:
            previous.hang_up("another console attached")
        return line

    def write_console(self, data: bytes) -> bool:
        """What the machine writes to its serial port; False when no console is attached (the bytes are lost)."""
        line = self._line
        if line is None:
            return False
        line.output(data)
        return True

    def _hang_up(self, reason: str) -> None:
        with self._lock:
            line, self._line = self._line, None
        if line is not None:
            line.hang_up(reason)

    @property
    def boots(self) -> int:
        return self._boots

    @property
    def last_boot_target(self) -> BootTarget:
        return self._last_boot_target

    # ---- boot

    def boot_override(self) -> BootOverride:
        return replace(self._override, mode=self._inventory.firmware)

    def supported_boot_targets(self) -> tuple[BootTarget, ...]:
        # UefiHttp only where it can happen: UEFI firmware, and a CD drive for the image (as on KubeVirt).
        if self._inventory.firmware == BootMode.UEFI and self._has_cdrom:
            return SUPPORTED_TARGETS
        return tuple(t for t in SUPPORTED_TARGETS if t != BootTarget.UEFI_HTTP)

    def set_boot_override(self, override: BootOverride) -> None:
        if override.target not in SUPPORTED_TARGETS:
            raise Unsupported(f"boot target {override.target} is not supported")
        if override.target == BootTarget.CD and not self._has_cdrom:
            raise InvalidRequest("the machine has no CD-ROM drive")
        http = override.target == BootTarget.UEFI_HTTP and override.enabled != BootEnabled.DISABLED
        if http and override.mode != BootMode.UEFI:
            raise InvalidRequest("UEFI HTTP boot needs UEFI mode")
        if http and not override.http_boot_uri:
            raise InvalidRequest(NO_HTTP_BOOT_URI)
        with self._lock:
            # UEFI HTTP boot as the KubeVirt backend does it: the image goes into the virtual CD, which boots.
            ours = self._media.inserted and self._http_medium  # a medium HTTP boot put in (even one consumed)
            if http and self._media.inserted and not ours and self._media.image != override.http_boot_uri:
                raise InvalidRequest(http_boot_cd_busy(self._media.image))
            leaving = self._override.target == BootTarget.UEFI_HTTP and not http
            if ours and ((http and self._media.image != override.http_boot_uri) or leaving):
                self._media, self._http_medium = VirtualMedia(self._media.slot), False
            if http and not self._media.inserted:
                self._media = VirtualMedia("Cd", override.http_boot_uri, True, True, MediaState.INSERTED)
                self._http_medium = True
            if not http:
                override = replace(override, http_boot_uri="")
            before = (self._inventory.firmware, self._secure_boot)
            if override.enabled == BootEnabled.DISABLED or override.target == BootTarget.NONE:
                if self._before_once is not None:
                    self._restore_firmware()
                else:
                    self._set_firmware(override.mode)
            else:
                self._set_firmware(override.mode)
                if override.enabled == BootEnabled.ONCE:
                    if self._before_once is None and before != (self._inventory.firmware, self._secure_boot):
                        self._before_once = before
                else:
                    self._before_once = None  # a persistent override keeps the firmware it chose
            self._override = replace(override, mode=self._inventory.firmware)
        self.events.publish("BootOverrideSet", f"boot from {override.target} ({override.enabled}, {override.mode})")

    # ---- inventory

    def inventory(self) -> Inventory:
        return self._inventory

    def create_disk(self, size_bytes: int) -> str:
        with self._lock:
            taken = {d.name for d in self._inventory.disks}
            name = next(f"disk{n}" for n in range(1, len(taken) + 2) if f"disk{n}" not in taken)
            self._inventory = replace(self._inventory, disks=(*self._inventory.disks,
                                                              Disk(name, "disk", size_bytes, "virtio", True)))
            return name

    def delete_disk(self, name: str) -> None:
        with self._lock:
            if not any(d.name == name and d.created for d in self._inventory.disks):
                raise InvalidRequest(f"the disk {name} is part of the VM's own definition: only disks added through "
                                     "this BMC can be deleted")
            self._inventory = replace(self._inventory, disks=tuple(d for d in self._inventory.disks if d.name != name))

    # ---- virtual media

    def virtual_media(self, slot: str = "Cd") -> VirtualMedia:
        self._check_slot(slot)
        if not self._has_cdrom:
            return VirtualMedia(slot, state=MediaState.ABSENT, message=NO_CDROM)
        return self._media

    def insert_media(self, image: str, slot: str = "Cd", write_protected: bool = True) -> None:
        self._check_drive(slot)
        parts = urlsplit(image)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise InvalidRequest(f"image must be an http or https URL: {image!r}")
        with self._lock:
            if self._media.inserted and self._media.image == image:
                return  # a retried insert of the same image (Ironic retries on 5xx): it is in, nothing to do
            if self._media.inserted:
                raise InvalidRequest("a medium is already inserted: eject it first")
            self._media = VirtualMedia(slot, image, True, write_protected, MediaState.INSERTED)
            self._http_medium = False
        self.events.publish("VirtualMediaInserted", f"inserted {redact_url(image)} into {slot}", slot=slot)

    def identify(self) -> Identify:
        found = self._identify
        if found.active and found.until is not None and found.until <= time.time():
            return Identify()
        return found

    def set_identify(self, active: bool, seconds: int | None = None, blinking: bool = False) -> None:
        timed = bool(active and seconds)
        self._identify = Identify(active, time.time() + (seconds or 0) if timed else None,
                                  active and (blinking or timed))
        self.events.publish("IdentifyOn" if active else "IdentifyOff",
                            "identify indicator " + ("lit" + (f" for {seconds} s" if seconds else "") if active
                                                     else "turned off"))

    def eject_media(self, slot: str = "Cd") -> None:
        self._check_drive(slot)
        with self._lock:
            inserted = self._media.inserted
            self._media = VirtualMedia(slot)
        if inserted:
            self.events.publish("VirtualMediaEjected", f"ejected the medium from {slot}", slot=slot)

    def _check_slot(self, slot: str) -> None:
        if slot not in self.media_slots():
            raise InvalidRequest(f"no virtual media slot {slot!r}")

    def _check_drive(self, slot: str) -> None:
        self._check_slot(slot)
        if not self._has_cdrom:
            raise Unsupported(NO_CDROM)


class MemoryConsole:
    """MemoryMachine's serial line: input is recorded in `console_input`, output comes from write_console."""

    def __init__(self, machine: MemoryMachine, output: Callable[[bytes], None], closed: Callable[[str], None]) -> None:
        self._machine = machine
        self.output = output
        self._closed = closed
        self._open = True

    def send(self, data: bytes) -> None:
        if not self._open:
            raise ConsoleUnavailable("the line was hung up")
        self._machine.console_input += data

    def close(self) -> None:
        self._open = False
        if self._machine._line is self:
            self._machine._line = None

    def hang_up(self, reason: str) -> None:
        if self._open:
            self._open = False
            self._closed(reason)
