"""Real guests: every Running VMI as one QEMU process, built from its spec the way virt-launcher builds its domain.

KubeVirt runs a VMI as a QEMU process that libvirt starts from the domain virt-launcher's converter builds
(pkg/virt-launcher/virtwrap/converter). kubesim starts QEMU itself, with the same devices:

- firmware: `bios` (or none) -> SeaBIOS; `efi` -> OVMF with a variable store of the VM's own; `efi.secureBoot`
  (true unless false) -> OVMF's secure-boot build with Microsoft's keys enrolled, SMM on, and the flash's secure
  mode (libvirt's `<loader secure='yes'>`). The variables are kept per VM while the VM exists when
  `efi.persistent` is true (KubeVirt's persistent EFI), else made afresh for each VMI, as KubeVirt does.
- vCPUs and memory from the spec, capped by kubesim's `guest_cpus` and `guest_memory_mib`;
  `firmware.uuid` and `firmware.serial` in SMBIOS type 1 (manufacturer and family "KubeVirt").
- every disk, CD-ROM and LUN with its bus (virtio -> virtio-blk, sata -> the q35 AHCI, scsi -> virtio-scsi) and
  its `bootOrder` as QEMU's `bootindex`, with `-boot strict=on` (libvirt's per-device boot order): a device
  without one is not tried once any has one. Volumes: a claim or DataVolume -> its file (kubesim/volumes.py); a
  containerDisk -> its local file under a throw-away overlay (`snapshot=on`: the guest's writes are gone with
  the VMI, as a containerDisk's are); an emptyDisk -> a sparse file of its capacity, removed with the VMI. A
  CD-ROM whose volume has no file yet (an import under way) is an empty tray, and gets its medium when the file
  is there (virt-handler changes the medium of the existing drive); removing the volume ejects it.
- the NICs (virtio-net) with their MACs; a NIC with a `bootOrder` gets iPXE's boot ROM, one without none (the
  converter's `<rom enabled='no'/>`). KubeVirt's pod network is QEMU's user-mode network here, isolated
  (`restrict=on`: no packet leaves the host) with masquerade's addresses (10.0.2.0/24, gateway 10.0.2.1, guest
  10.0.2.2) and a boot server: TFTP from kubesim's `netboot_dir`, bootfile `boot.ipxe` for BIOS (iPXE runs the
  script) and `bootx64.efi` for UEFI (OVMF's PXE loads an EFI program).
- the serial port (a socket chardev, as virt-launcher's `serial0`) and a VGA display with QEMU's own VNC server
  (RFB) on a unix socket, as virt-launcher's; virt-api's `console` and `vnc` WebSockets reach them unchanged.
- power: QEMU runs with `-no-shutdown` as under libvirt: a guest that powers off stops, and kubesim then quits
  QEMU and ends the VMI (Succeeded); an ACPI shutdown is QMP `system_powerdown`; a soft reboot presses the power
  button and resets the guest when it has shut down (libvirt's fake reboot); a reset is `system_reset`; pause and
  unpause are `stop` and `cont`. KubeVirt has no NMI API, so nothing sends one.

Accelerator: KVM where `/dev/kvm` can run the firmware, else QEMU's TCG. A host's KVM may run one firmware and not
another (a nested KVM that fails OVMF with "KVM internal error ... emulation failure", or has no SMM for the
secure-boot build), so each firmware kind is probed once: QEMU starts it under KVM with no disk; output from the
firmware (SeaBIOS's debug port, OVMF's serial) means KVM runs it; an internal error, SMM refused or QEMU exiting
means TCG for that kind.

Every QEMU process is started by one long-lived thread with the parent-death signal set, so that QEMU ends with
kubesim even when kubesim is killed; it ends with its VMI (SIGTERM, then SIGKILL) and its files with it.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import logging
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .console import SerialLine
from .cpu import unpinned
from .screen import ACTIVE_SESSION
from .screen import TAKEN_OVER as SCREEN_TAKEN_OVER
from .volumes import VolumeFiles

log = logging.getLogger(__name__)
Obj = dict[str, Any]

QEMU = "qemu-system-x86_64"
OVMF_DIRS = ("/usr/share/OVMF", "/usr/share/edk2/ovmf", "/usr/share/qemu")
BIOS, EFI, EFI_SECURE = "bios", "efi", "efi-secure"
BIOS_BOOTFILE, EFI_BOOTFILE = "boot.ipxe", "bootx64.efi"
PROBE_DEADLINE = 60.0  # a probe that has decided nothing by then is a hang: TCG
START_DEADLINE = 30.0  # QEMU's sockets appear within this, or the launch failed
STOP_DEADLINE = 10.0  # SIGTERM, then SIGKILL
DEFAULT_MEMORY_MIB = 512
_KVM_FAILURES = ("KVM internal error", "emulation failure", "not supported by this hypervisor",
                 "failed to initialize kvm", "Could not access KVM")


def default_guest_dir() -> Path:
    """Where scripts/build-guests.sh puts the test guests (and so where kubesim's boot server and containerDisk
    files are looked for by default)."""
    return Path(os.environ.get("KUBEVBMC_GUESTS") or Path.home() / ".cache" / "kubevbmc" / "guests")


def qemu_installed() -> bool:
    return shutil.which(QEMU) is not None


# ---------------------------------------------------------------- firmware


@dataclass(frozen=True)
class Firmware:
    kind: str  # BIOS, EFI or EFI_SECURE
    code: str = ""  # OVMF's code (read-only flash); "" for SeaBIOS (QEMU's default)
    variables: str = ""  # the template of the variable store


def _first(dirs: tuple[str, ...], names: tuple[str, ...]) -> str:
    for directory in dirs:
        for name in names:
            path = os.path.join(directory, name)
            if os.path.exists(path):
                return path
    return ""


def firmware_kind(spec: Obj) -> str:
    efi = ((((spec.get("domain") or {}).get("firmware") or {}).get("bootloader")) or {}).get("efi")
    if not isinstance(efi, dict):
        return BIOS
    return EFI if efi.get("secureBoot") is False else EFI_SECURE


def find_firmware(kind: str) -> Firmware:
    """The firmware files for `kind`; FileNotFoundError naming the Debian package when they are missing."""
    if kind == BIOS:
        return Firmware(BIOS)
    if kind == EFI:
        code = _first(OVMF_DIRS, ("OVMF_CODE_4M.fd", "OVMF_CODE.fd"))
        variables = _first(OVMF_DIRS, ("OVMF_VARS_4M.fd", "OVMF_VARS.fd"))
    else:
        code = _first(OVMF_DIRS, ("OVMF_CODE_4M.secboot.fd", "OVMF_CODE_4M.ms.fd", "OVMF_CODE.secboot.fd"))
        variables = _first(OVMF_DIRS, ("OVMF_VARS_4M.ms.fd", "OVMF_VARS.ms.fd"))
    if not code or not variables:
        raise FileNotFoundError(f"no OVMF firmware for {kind} guests in {', '.join(OVMF_DIRS)} (Debian: ovmf)")
    return Firmware(kind, code, variables)


# ---------------------------------------------------------------- the accelerator


def kvm_usable() -> bool:
    return os.path.exists("/dev/kvm") and os.access("/dev/kvm", os.R_OK | os.W_OK)


def machine_args(firmware: Firmware, accel: str, variables: str, cpu: str = "") -> list[str]:
    smm = firmware.kind == EFI_SECURE
    args = ["-machine", f"q35,accel={accel}" + (",smm=on" if smm else "")]
    if firmware.kind != BIOS:
        if smm:
            args += ["-global", "driver=cfi.pflash01,property=secure,value=on", "-global", "ICH9-LPC.disable_s3=1"]
        args += ["-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={firmware.code}",
                 "-drive", f"if=pflash,format=raw,unit=1,file={variables}"]
    args += ["-cpu", cpu or ("host" if accel == "kvm" else "max")]
    return args


class _Trial:
    """A QEMU run to learn what the host can do: `firmware` under `accel`, with no NIC and at most a CD-ROM, its
    serial port, SeaBIOS's debug port and QEMU's messages in files."""

    def __init__(self, tmp: str, tag: str, firmware: Firmware, accel: str, cpu: str, cdrom: str = "",
                 cpus: frozenset[int] | None = None) -> None:
        variables = os.path.join(tmp, f"{tag}-vars.fd")
        if firmware.variables:
            shutil.copyfile(firmware.variables, variables)
        self.serial, self.debug, self.errors = (os.path.join(tmp, f"{tag}-{n}") for n in ("serial", "debug", "err"))
        argv = [QEMU, "-nodefaults", "-no-user-config", "-display", "none", "-m", "256",
                *machine_args(firmware, accel, variables, cpu), "-serial", f"file:{self.serial}",
                "-chardev", f"file,id=dbg,path={self.debug}", "-device", "isa-debugcon,iobase=0x402,chardev=dbg"]
        if cdrom:
            argv += ["-drive", f"if=none,id=cd,media=cdrom,readonly=on,format=raw,file={cdrom}",
                     "-device", "ide-cd,bus=ide.0,drive=cd,bootindex=1"]
        self.proc = spawn(argv, self.errors, cpus)  # it too ends with kubesim, however kubesim ends

    def failure(self) -> str:
        """Why QEMU could not run the guest ("" while it runs)."""
        text = Path(self.errors).read_text(errors="replace")
        failure = next((line for line in text.splitlines() if any(f in line for f in _KVM_FAILURES)), "")
        if failure:
            return failure.strip()
        if self.proc.poll() is not None:
            return f"QEMU exited ({self.proc.returncode}): {text.strip()[-200:]}"
        return ""

    def wrote(self, marker: bytes = b"") -> bool:
        """Whether the guest wrote `marker` on its serial port (anything on either port when no marker)."""
        if not marker:
            return any(os.path.exists(p) and os.path.getsize(p) > 0 for p in (self.serial, self.debug))
        try:
            return marker in Path(self.serial).read_bytes()
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def probe_kvm(firmware: Firmware, cpu: str, deadline: float = PROBE_DEADLINE,
              cpus: frozenset[int] | None = None) -> tuple[bool, str]:
    """Whether this host's KVM runs `firmware`, and why not: QEMU starts it under KVM with no disk and no NIC;
    the firmware's first output (SeaBIOS logs on the debug port, OVMF writes to the serial port) decides yes;
    QEMU reporting an internal error or exiting decides no."""
    if not kvm_usable():
        return False, "/dev/kvm is missing or not accessible"
    with tempfile.TemporaryDirectory(prefix="kubesim-kvm-probe-") as tmp:
        trial = _Trial(tmp, "kvm", firmware, "kvm", cpu, cpus=cpus)
        try:
            end = time.monotonic() + deadline
            while time.monotonic() < end:
                failure = trial.failure()
                if failure:
                    return False, failure
                if trial.wrote():
                    return True, ""
                time.sleep(0.05)
            return False, f"the firmware wrote nothing under KVM within {deadline:.0f} s"
        finally:
            trial.stop()


CANARY_MARKER = b"KUBEVBMC-GUEST: booted from"


def canary_image(kind: str) -> str:
    """The test guest a firmware kind's trial boots (scripts/build-guests.sh), "" when there is none."""
    path = default_guest_dir() / ("signed.iso" if kind == EFI_SECURE else "guest.iso")
    return str(path) if path.is_file() else ""


def race_kvm_and_tcg(firmware: Firmware, cpu: str, canary: str, deadline: float = PROBE_DEADLINE * 2,
                     cpus: frozenset[int] | None = None) -> tuple[bool, str]:
    """A host's KVM may run the firmware and still not what the firmware loads (a nested or paravirtual KVM that
    cannot emulate a boot loader's mode switches leaves GRUB hanging with no error). So the canary guest boots
    under KVM and under TCG at once: KVM is kept when it reaches the guest's kernel first; TCG getting there first
    (or KVM failing) means TCG for this firmware. Both are slowed alike on a busy machine."""
    with tempfile.TemporaryDirectory(prefix="kubesim-kvm-race-") as tmp:
        kvm = _Trial(tmp, "kvm", firmware, "kvm", cpu, canary, cpus)
        tcg = _Trial(tmp, "tcg", firmware, "tcg", TCG_CPU_MODEL, canary, cpus)
        try:
            end = time.monotonic() + deadline
            while time.monotonic() < end:
                if kvm.wrote(CANARY_MARKER):
                    return True, ""
                failure = kvm.failure()
                if failure:
                    return False, failure
                if tcg.wrote(CANARY_MARKER):
                    return False, (f"the test guest ({os.path.basename(canary)}) booted under TCG before it did "
                                   f"under KVM (KVM runs the firmware but not what it loads)")
                time.sleep(0.05)
            return False, f"the test guest booted under neither within {deadline:.0f} s"
        finally:
            kvm.stop()
            tcg.stop()


# The CPU models tried under KVM, in order: the host's CPU (KubeVirt's default, host-model, is the host's CPU as
# libvirt can express it), then the same without IA32_ARCH_CAPABILITIES, an MSR a nested KVM may refuse to set
# ("failed to set MSR 0x10a"). Under TCG: QEMU's `max`.
KVM_CPU_MODELS = ("host", "host,-arch-capabilities")
TCG_CPU_MODEL = "max"


@dataclass(frozen=True)
class Acceleration:
    accel: str  # "kvm" or "tcg"
    cpu: str  # QEMU's -cpu
    why: str = ""  # why not KVM


_CACHE_LOCK = threading.Lock()


def _probe_key(kind: str, firmware: Firmware) -> str:
    """What a trial's verdict depends on: the host's kernel and KVM, QEMU, the firmware and the test guest."""
    def stamp(path: str) -> str:
        try:
            status = os.stat(path)
        except OSError:
            return "-"
        return f"{status.st_size}:{int(status.st_mtime)}"

    qemu = shutil.which(QEMU) or QEMU
    kvm = ",".join(sorted(m for m in ("kvm_intel", "kvm_amd", "kvm_pvm") if os.path.exists(f"/sys/module/{m}")))
    parts = [kind, os.uname().release, kvm, str(kvm_usable()), stamp(qemu), stamp(firmware.code),
             stamp(canary_image(kind))]
    return "|".join(parts)


class Accelerators:
    """The accelerator for each firmware kind, probed once (`choice` "auto"), or as configured ("kvm", "tcg")."""

    def __init__(self, choice: str = "auto", cpus: frozenset[int] | None = None) -> None:
        self.choice = choice
        self.cpus = cpus  # where trial runs may run (kubesim's own threads may be pinned to one CPU)
        self._lock = threading.Lock()
        self._decided: dict[str, Acceleration] = {}
        self._locks: dict[str, threading.Lock] = {}

    def for_kind(self, kind: str) -> Acceleration:
        if self.choice == "kvm":
            return Acceleration("kvm", KVM_CPU_MODELS[0])
        if self.choice == "tcg":
            return Acceleration("tcg", TCG_CPU_MODEL, "configured")
        with self._lock:
            kind_lock = self._locks.setdefault(kind, threading.Lock())
        with kind_lock:  # one probe per kind; other launches of it wait for the verdict
            if kind not in self._decided:
                decided = self._probe(kind)
                with self._lock:
                    self._decided[kind] = decided
                log.info("guests: %s firmware runs under %s (-cpu %s)%s", kind, decided.accel, decided.cpu,
                         f"; KVM cannot run it: {decided.why}" if decided.why else "")
            return self._decided[kind]

    def _probe(self, kind: str) -> Acceleration:
        """What the machine's cache says for this host, QEMU and firmware, else a trial (_try), then cached."""
        firmware = find_firmware(kind)
        key = _probe_key(kind, firmware)
        cache = default_guest_dir().parent / "accelerators.json"
        with contextlib.ExitStack() as held:
            with contextlib.suppress(OSError):
                cache.parent.mkdir(parents=True, exist_ok=True)
                # One trial of a kind on the machine at a time: a second kubesim waits for the first one's verdict
                lock = held.enter_context(open(cache.with_name(f".{cache.name}.{kind}.lock"), "w"))
                fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                known = json.loads(cache.read_text())
            except (OSError, ValueError):
                known = {}
            if isinstance(known.get(key), dict):
                entry = known[key]
                return Acceleration(str(entry["accel"]), str(entry["cpu"]), str(entry.get("why", "")) + " (cached)")
            decided = self._try(kind, firmware)
            self._remember(cache, key, decided)
        return decided

    @staticmethod
    def _remember(cache: Path, key: str, decided: Acceleration) -> None:
        with contextlib.suppress(OSError), _CACHE_LOCK, open(cache.with_name(f".{cache.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # other kubesims: read, add, write, one at a time
            try:
                known = json.loads(cache.read_text())
            except (OSError, ValueError):
                known = {}
            known[key] = {"accel": decided.accel, "cpu": decided.cpu, "why": decided.why}
            temporary = cache.with_name(f".{cache.name}.{os.getpid()}")
            temporary.write_text(json.dumps(known, indent=1, sort_keys=True))
            temporary.replace(cache)

    def _try(self, kind: str, firmware: Firmware) -> Acceleration:
        """The firmware alone under KVM (each CPU model in turn); then, where a test guest is at hand, the race of
        a boot under KVM and under TCG (race_kvm_and_tcg)."""
        why = ""
        for cpu in KVM_CPU_MODELS:
            ok, why = probe_kvm(firmware, cpu, cpus=self.cpus)
            if ok:
                canary = canary_image(kind)
                if canary:
                    ok, why = race_kvm_and_tcg(firmware, cpu, canary, cpus=self.cpus)
                return Acceleration("kvm", cpu) if ok else Acceleration("tcg", TCG_CPU_MODEL, why)
            if not kvm_usable():
                break
        return Acceleration("tcg", TCG_CPU_MODEL, why)

    def probe_all(self) -> None:
        """Decide every kind now, in the background, so that the first guests need not wait."""
        for kind in (BIOS, EFI, EFI_SECURE):
            threading.Thread(target=self._probe_quietly, args=(kind,), name=f"probe-{kind}", daemon=True).start()

    def _probe_quietly(self, kind: str) -> None:
        try:
            self.for_kind(kind)
        except FileNotFoundError as exc:
            log.warning("guests: %s", exc)

    def decided(self) -> dict[str, Acceleration]:
        with self._lock:
            return dict(self._decided)


# ---------------------------------------------------------------- the command line


@dataclass
class Attachment:
    """A disk as QEMU gets it: its file (None: an empty CD-ROM tray) and how."""

    name: str
    device: str  # "disk", "cdrom" or "lun"
    bus: str
    path: str | None
    boot_index: int | None
    overlay: bool = False  # a containerDisk: the guest's writes go to a throw-away overlay
    serial: str = ""


def _quantity_bytes(text: Any) -> int | None:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGTPE]i?|[kmgtpe])?\s*", str(text or ""))
    if not match:
        return None
    number, unit = float(match.group(1)), match.group(2) or ""
    powers = {"K": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}
    if not unit:
        return int(number)
    base = 1024 if unit.endswith("i") else 1000
    return int(number * base ** powers[unit[0].upper()])


def memory_mib(spec: Obj, cap: int) -> int:
    domain = spec.get("domain") or {}
    asked = _quantity_bytes(((domain.get("memory") or {}).get("guest"))
                            or ((domain.get("resources") or {}).get("requests") or {}).get("memory"))
    mib = asked // (1024 * 1024) if asked else DEFAULT_MEMORY_MIB
    return max(min(mib, cap), 64)


def vcpus(spec: Obj, cap: int) -> int:
    cpu = (spec.get("domain") or {}).get("cpu") or {}
    count = 1
    for key in ("cores", "sockets", "threads"):
        value = cpu.get(key)
        count *= value if isinstance(value, int) and value > 0 else 1
    return max(min(count, cap), 1)


def qemu_command(*, name: str, spec: Obj, firmware: Firmware, accel: Acceleration, variables: str,
                 disks: list[Attachment],
                 nics: list[tuple[str, str, int | None]], netboot_dir: str, memory_cap: int,
                 cpu_cap: int) -> list[str]:
    """QEMU's command line for a VMI (pure: tests read it). `nics`: (name, MAC, bootOrder) per interface."""
    domain = spec.get("domain") or {}
    devices = domain.get("devices") or {}
    firmware_spec = domain.get("firmware") or {}
    machine = machine_args(firmware, accel.accel, variables, accel.cpu)
    bootloader = firmware_spec.get("bootloader")
    bios = bootloader.get("bios") if isinstance(bootloader, dict) else None
    if isinstance(bios, dict) and bios.get("useSerial"):
        machine[1] += ",graphics=off"  # libvirt's <bios useserial='yes'/>: SeaBIOS writes to the serial port too
    argv = [QEMU, "-name", f"guest={name}", "-nodefaults", "-no-user-config", "-no-shutdown", "-S", *machine,
            "-m", str(memory_mib(spec, memory_cap)), "-smp", str(vcpus(spec, cpu_cap)),
            "-boot", "strict=on",
            "-qmp", "unix:qmp.sock,server=on,wait=off"]
    smbios = "type=1,manufacturer=KubeVirt,product=None,family=KubeVirt"
    if firmware_spec.get("uuid"):
        argv += ["-uuid", str(firmware_spec["uuid"])]
    if firmware_spec.get("serial"):
        smbios += ",serial=" + str(firmware_spec["serial"]).replace(",", ",,")
    argv += ["-smbios", smbios]
    if devices.get("autoattachSerialConsole") is not False:
        argv += ["-chardev", "socket,id=serial0,path=serial.sock,server=on,wait=off",
                 "-serial", "chardev:serial0"]
    if devices.get("autoattachGraphicsDevice") is not False:
        argv += ["-vga", "std", "-vnc", "unix:vnc.sock"]
    else:
        argv += ["-vga", "none", "-display", "none"]
    ahci_port, scsi = 0, False
    for index, disk in enumerate(disks):
        drive = f"drive-{index}"
        options = f"if=none,id={drive}"
        if disk.device == "cdrom":
            options += ",media=cdrom,readonly=on"
        if disk.path is not None:
            options += f",file={disk.path.replace(',', ',,')},format=raw"
            if disk.overlay:
                options += ",snapshot=on"
        argv += ["-drive", options]
        device_id = f"ua-{disk.name}"
        boot = f",bootindex={disk.boot_index}" if disk.boot_index is not None else ""
        serial = f",serial={disk.serial}" if disk.serial and disk.device != "cdrom" else ""
        if disk.bus == "virtio" and disk.device != "cdrom":
            argv += ["-device", f"virtio-blk-pci,drive={drive},id={device_id}{boot}{serial}"]
        elif disk.bus == "scsi":
            if not scsi:
                argv += ["-device", "virtio-scsi-pci,id=scsi0"]
                scsi = True
            kind = "scsi-cd" if disk.device == "cdrom" else "scsi-hd"
            argv += ["-device", f"{kind},bus=scsi0.0,drive={drive},id={device_id}{boot}{serial}"]
        else:  # sata (and anything else QEMU's q35 can hold): the built-in AHCI's ports ide.0 .. ide.5
            kind = "ide-cd" if disk.device == "cdrom" else "ide-hd"
            argv += ["-device", f"{kind},bus=ide.{ahci_port},drive={drive},id={device_id}{boot}{serial}"]
            ahci_port += 1
    efi = firmware.kind != BIOS
    bootfile = EFI_BOOTFILE if efi else BIOS_BOOTFILE
    for index, (iface, mac, boot_order) in enumerate(nics):
        net = f"net{index}"
        netdev = f"user,id={net},restrict=on,net=10.0.2.0/24,host=10.0.2.1,dhcpstart=10.0.2.2"
        if netboot_dir:
            netdev += f",tftp={netboot_dir},bootfile={bootfile}"
        argv += ["-netdev", netdev]
        device = f"virtio-net-pci,netdev={net},mac={mac},id=ua-{iface}"
        if boot_order is not None:
            # QEMU's own choice of iPXE ROM for virtio-net (efi-virtio.rom, from its firmware path: Debian's
            # ipxe-qemu); QEMU loads no ROM given by an absolute path here.
            device += f",bootindex={boot_order}"
        else:
            device += ",romfile="  # the converter's <rom enabled='no'/>
        argv += ["-device", device]
    return argv


# ---------------------------------------------------------------- QMP


class QmpError(Exception):
    pass


class Qmp:
    """A QMP connection: commands answered in order, events handed to `on_event` (on the reader thread)."""

    def __init__(self, path: str, on_event: Callable[[Obj], None], deadline: float = START_DEADLINE) -> None:
        self._sock = _connect_unix(path, deadline)
        self._file = self._sock.makefile("rb")
        self._lock = threading.Lock()
        self._replies: queue.Queue[Obj | None] = queue.Queue()
        self._on_event = on_event
        json.loads(self._file.readline() or b"null")  # the greeting
        threading.Thread(target=self._read, name=f"qmp-{os.path.basename(os.path.dirname(path))}",
                         daemon=True).start()
        self.execute("qmp_capabilities")

    def _read(self) -> None:
        try:
            for raw in self._file:
                message = json.loads(raw)
                if "event" in message:
                    try:
                        self._on_event(message)
                    except Exception:
                        log.exception("QMP event %s", message.get("event"))
                else:
                    self._replies.put(message)
        except (OSError, ValueError):
            pass
        self._replies.put(None)

    def execute(self, command: str, arguments: Obj | None = None, timeout: float = 30.0) -> Any:
        message: Obj = {"execute": command}
        if arguments:
            message["arguments"] = arguments
        with self._lock:
            try:
                self._sock.sendall(json.dumps(message).encode() + b"\n")
                reply = self._replies.get(timeout=timeout)
            except (OSError, queue.Empty) as exc:
                raise QmpError(f"{command}: {exc or 'no answer'}") from None
            if reply is None:
                self._replies.put(None)  # QEMU is gone: every later command fails as well
                raise QmpError(f"{command}: QEMU closed its monitor")
            if "error" in reply:
                raise QmpError(f"{command}: {reply['error'].get('desc')}")
            return reply.get("return")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def _connect_unix(path: str, deadline: float) -> socket.socket:
    """Connect to a unix socket, waiting for it to appear. A path longer than a socket address holds (108 bytes;
    a state directory deep in a long TMPDIR) is reached through a descriptor of its directory."""
    end = time.monotonic() + deadline
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        directory = -1
        try:
            if len(os.fsencode(path)) < 100:
                sock.connect(path)
            else:
                directory = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
                sock.connect(f"/proc/self/fd/{directory}/{os.path.basename(path)}")
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > end:
                raise
            time.sleep(0.02)
        finally:
            if directory >= 0:
                os.close(directory)


# ---------------------------------------------------------------- starting processes


class _Spawner:
    """One long-lived thread starts every QEMU process: the parent-death signal belongs to the thread that forked,
    and this one lives as long as kubesim (a request thread that starts a guest may end at any time)."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], queue.Queue[Any]]] = queue.Queue()
        threading.Thread(target=self._run, name="qemu-spawner", daemon=True).start()

    def _run(self) -> None:
        while True:
            job, answer = self._jobs.get()
            try:
                answer.put((job(), None))
            except Exception as exc:  # handed to the caller
                answer.put((None, exc))

    def call(self, job: Callable[[], Any]) -> Any:
        answer: queue.Queue[Any] = queue.Queue()
        self._jobs.put((job, answer))
        result, error = answer.get()
        if error is not None:
            raise error
        return result


_spawner: _Spawner | None = None
_spawner_lock = threading.Lock()


def _die_with_parent() -> None:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def spawn(argv: list[str], stderr_path: str, cpus: frozenset[int] | None, cwd: str | None = None) \
        -> subprocess.Popen[bytes]:
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = _Spawner()

    def start() -> subprocess.Popen[bytes]:
        with open(stderr_path, "ab") as err, unpinned(cpus):
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err, close_fds=True,
                                    start_new_session=True, preexec_fn=_die_with_parent, cwd=cwd)

    return _spawner.call(start)


# ---------------------------------------------------------------- the node's guests


@dataclass
class GuestConfig:
    state_dir: str
    volumes: VolumeFiles
    accelerators: Accelerators
    # The MAC of an interface without macAddress (namespace, VMI name, interface): the one the VMI's status shows.
    mac_of: Callable[[str, str, str], str]
    netboot_dir: str = ""
    memory_cap: int = DEFAULT_MEMORY_MIB
    cpu_cap: int = 1
    cpus: frozenset[int] | None = None
    # Called (namespace, name, uid, failed) when a guest's QEMU is gone without kubesim ending it: the guest
    # powered itself off (failed=False) or QEMU died (failed=True).
    on_exit: Callable[[str, str, str, bool], None] | None = None


def nvram_path(state_dir: str, namespace: str, name: str) -> str:
    return os.path.join(state_dir, "nvram", namespace, f"{name}_VARS.fd")


def forget_vm(state_dir: str, namespace: str, name: str) -> None:
    """The VM is gone: so is its NVRAM."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(nvram_path(state_dir, namespace, name))


class QemuGuest(SerialLine):
    """A VMI's QEMU process with its serial line and screen. The serial side (one client, output kept while no
    client reads) is SerialLine's; what the guest prints and reads is QEMU's serial port."""

    def __init__(self, namespace: str, name: str, uid: str, config: GuestConfig) -> None:
        super().__init__(namespace, name, uid)
        self.config = config
        self.run_dir = os.path.join(config.state_dir, "vmis", uid)
        self.proc: subprocess.Popen[bytes] | None = None
        self._qmp: Qmp | None = None
        self._serial: socket.socket | None = None
        self._started = threading.Event()
        self._fake_reboot = False
        self._ending = False  # kubesim ends the process (not the guest)
        self._paused_domain = False
        self._media: dict[str, str | None] = {}  # CD-ROM device id -> file inserted
        self._media_lock = threading.Lock()
        self._latest_spec: Obj = {}
        # What virt-handler asked of the domain, done in the order asked, once QEMU runs, by one thread at a time
        self._actions: collections.deque[Callable[[], None]] = collections.deque()
        self._actions_lock = threading.Lock()
        self._acting = False
        self._vnc_peer: VncPeer | None = None
        self.accelerator = ""
        self.failure = ""

    # ---- the guest's side (SerialLine's hooks, called under self._lock)

    def _boot(self, spec: Obj) -> None:
        self._spec = self._latest_spec = spec
        threading.Thread(target=self._launch, args=(spec,), name=f"launch-{self.name}", daemon=True).start()

    def _launch(self, spec: Obj) -> None:
        try:
            self._start(spec)
            self._started.set()
            # A medium whose import ended while QEMU was starting (its VMI's change came before QEMU could take it)
            if self._qmp is not None:
                self._update_media(self._latest_spec)
        except Exception as exc:
            self.failure = str(exc)
            log.warning("vmi %s/%s: QEMU did not start: %s", self.namespace, self.name, exc)
            self._stop_process()
            if self.config.on_exit is not None and not self.ended:
                self.config.on_exit(self.namespace, self.name, self.uid, True)
        finally:
            self._started.set()

    def _start(self, spec: Obj) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        kind = firmware_kind(spec)
        firmware = find_firmware(kind)
        accel = self.config.accelerators.for_kind(kind)
        variables = ""
        if kind != BIOS:
            efi = ((spec.get("domain") or {}).get("firmware") or {}).get("bootloader", {}).get("efi") or {}
            variables = (nvram_path(self.config.state_dir, self.namespace, self.name) if efi.get("persistent")
                         else os.path.join(self.run_dir, "VARS.fd"))
            if not os.path.exists(variables):
                os.makedirs(os.path.dirname(variables), exist_ok=True)
                shutil.copyfile(firmware.variables, variables)
        disks = self._attachments(spec)
        argv = qemu_command(name=f"{self.namespace}_{self.name}", spec=spec, firmware=firmware, accel=accel,
                            variables=variables, disks=disks, nics=self._nics(spec),
                            netboot_dir=self._netboot_dir(), memory_cap=self.config.memory_cap,
                            cpu_cap=self.config.cpu_cap)
        with self._lock:
            if self.ended:
                return
            self.accelerator = accel.accel
            # In its run directory: QEMU's sockets are named relative to it (a socket's path has at most 108 bytes)
            self.proc = spawn(argv, os.path.join(self.run_dir, "qemu.log"), self.config.cpus, cwd=self.run_dir)
        log.info("vmi %s/%s: QEMU %d started (%s firmware, %s)", self.namespace, self.name, self.proc.pid, kind,
                 accel.accel)
        threading.Thread(target=self._wait, name=f"qemu-{self.name}", daemon=True).start()
        self._qmp = Qmp(os.path.join(self.run_dir, "qmp.sock"), self._event)
        devices = (spec.get("domain") or {}).get("devices") or {}
        if devices.get("autoattachSerialConsole") is not False:
            self._serial = _connect_unix(os.path.join(self.run_dir, "serial.sock"), START_DEADLINE)
            threading.Thread(target=self._read_serial, name=f"serial-{self.name}", daemon=True).start()
        self._media = {f"ua-{d.name}": d.path for d in disks if d.device == "cdrom"}
        with self._lock:
            paused = self._paused
        if not paused:
            self._qmp.execute("cont")
        self._paused_domain = paused

    def _netboot_dir(self) -> str:
        configured = self.config.netboot_dir
        if configured:
            return configured
        default = default_guest_dir() / "netboot"
        return str(default) if default.is_dir() else ""

    def _volume_file(self, volume: Obj) -> tuple[str | None, bool]:
        """The file behind a volume and whether it is a containerDisk's (under a throw-away overlay)."""
        volumes = self.config.volumes
        if "containerDisk" in volume:
            image = str((volume.get("containerDisk") or {}).get("image") or "")
            found = volumes.container_disk(image)
            if found is None:
                log.warning("vmi %s/%s: containerDisk %s has no local file: the disk is blank", self.namespace,
                            self.name, image)
                return self._empty_disk(str(volume.get("name")), 1 << 30), False
            return str(found), True
        claim = ((volume.get("persistentVolumeClaim") or {}).get("claimName")
                 or (volume.get("dataVolume") or {}).get("name"))
        if claim:
            path = volumes.claim_file(self.namespace, str(claim))
            return (str(path) if path.exists() else None), False
        if "emptyDisk" in volume:
            size = _quantity_bytes((volume.get("emptyDisk") or {}).get("capacity")) or (1 << 30)
            return self._empty_disk(str(volume.get("name")), size), False
        return None, False

    def _empty_disk(self, name: str, size: int) -> str:
        path = os.path.join(self.run_dir, f"{name}.img")
        if not os.path.exists(path):
            with open(path, "wb") as fh:
                fh.truncate(size)
        return path

    def _attachments(self, spec: Obj) -> list[Attachment]:
        devices = (spec.get("domain") or {}).get("devices") or {}
        volumes = {str(v.get("name")): v for v in spec.get("volumes") or [] if isinstance(v, dict)}
        out = []
        for disk in devices.get("disks") or []:
            if not isinstance(disk, dict):
                continue
            device = next((k for k in ("cdrom", "lun", "disk") if k in disk), "disk")
            bus = str((disk.get(device) or {}).get("bus") or ("sata" if device == "cdrom" else "virtio"))
            volume = volumes.get(str(disk.get("name")))
            path, overlay = self._volume_file(volume) if volume is not None else (None, False)
            if path is None and device != "cdrom":
                continue  # a disk whose volume has no bytes (yet) is not attached; virt-launcher would wait
            order = disk.get("bootOrder")
            out.append(Attachment(str(disk.get("name")), device, bus, path,
                                  order if isinstance(order, int) else None, overlay, str(disk.get("serial") or "")))
        return out

    def _nics(self, spec: Obj) -> list[tuple[str, str, int | None]]:
        out = []
        for iface in ((spec.get("domain") or {}).get("devices") or {}).get("interfaces") or []:
            if not isinstance(iface, dict):
                continue
            name = str(iface.get("name"))
            mac = str(iface.get("macAddress") or self.config.mac_of(self.namespace, self.name, name))
            order = iface.get("bootOrder")
            out.append((name, mac, order if isinstance(order, int) else None))
        return out

    def _read_serial(self) -> None:
        sock = self._serial
        assert sock is not None
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                return
            if not data:
                return
            with self._lock:
                self._emit(data)

    def _input(self, data: bytes) -> None:
        if self._serial is not None:
            with contextlib.suppress(OSError):
                self._serial.sendall(data[:65536])

    def _screen_keys(self, data: bytes) -> None:  # the screen is QEMU's own VNC server
        pass

    def _event(self, message: Obj) -> None:
        event = message.get("event")
        if event == "SHUTDOWN":
            # -no-shutdown: the guest has stopped. libvirt's fake reboot resets it; otherwise QEMU quits.
            if self._fake_reboot:
                self._fake_reboot = False
                log.info("vmi %s/%s: the guest shut down for its soft reboot: reset", self.namespace, self.name)
                threading.Thread(target=self._qmp_quiet, args=("system_reset", "cont"), daemon=True).start()
                return
            log.info("vmi %s/%s: the guest powered off (%s)", self.namespace, self.name,
                     (message.get("data") or {}).get("reason", ""))
            threading.Thread(target=self._qmp_quiet, args=("quit",), daemon=True).start()
        elif event == "RESET":
            log.info("vmi %s/%s: the guest reset", self.namespace, self.name)

    def _qmp_quiet(self, *commands: str) -> None:
        for command in commands:
            try:
                if self._qmp is not None:
                    self._qmp.execute(command)
            except QmpError as exc:
                log.debug("vmi %s/%s: %s", self.namespace, self.name, exc)

    def _wait(self) -> None:
        proc = self.proc
        assert proc is not None
        code = proc.wait()
        with self._lock:
            by_kubesim = self._ending or bool(self.ended)
        if not by_kubesim:
            failed = code != 0
            log.info("vmi %s/%s: QEMU exited (%d)%s", self.namespace, self.name, code,
                     ": " + self._stderr_tail() if failed else "")
            if self.config.on_exit is not None:
                self.config.on_exit(self.namespace, self.name, self.uid, failed)

    def _stderr_tail(self) -> str:
        try:
            return Path(self.run_dir, "qemu.log").read_text(errors="replace").strip()[-300:]
        except OSError:
            return ""

    # ---- power, as virt-handler drives the domain

    def _after_start(self, action: Callable[[], None]) -> None:
        """`action` once QEMU runs, after every action asked before it (a pause and the unpause that follows it
        never swap)."""
        with self._actions_lock:
            self._actions.append(action)
            if self._acting:
                return
            self._acting = True
        threading.Thread(target=self._act, name=f"qmp-{self.name}", daemon=True).start()

    def _act(self) -> None:
        self._started.wait(START_DEADLINE * 2)
        while True:
            with self._actions_lock:
                if not self._actions:
                    self._acting = False
                    return
                action = self._actions.popleft()
            try:
                action()
            except QmpError as exc:
                log.info("vmi %s/%s: %s", self.namespace, self.name, exc)

    def _reboot(self, spec: Obj, soft: bool) -> None:
        if self.ended or self._stopping:
            return
        if soft:
            def powerdown() -> None:
                self._fake_reboot = True
                self._command("system_powerdown")
            self._after_start(powerdown)
        else:
            self._after_start(lambda: self._command("system_reset"))

    def _command(self, command: str, arguments: Obj | None = None) -> Any:
        if self._qmp is None:
            raise QmpError(f"{command}: QEMU is not running")
        return self._qmp.execute(command, arguments)

    def shut_down(self) -> None:
        """The VMI is being deleted: the ACPI power button. The guest powers off, or virt-handler kills QEMU once
        the grace period is over (kill())."""
        with self._lock:
            if self.ended or self._stopping:
                return
            self._stopping = True
        self._after_start(lambda: self._command("system_powerdown"))

    def set_paused(self, paused: bool) -> None:
        with self._lock:
            changed = paused != self._paused
            self._paused = paused
        if changed and self._started.is_set() and self._qmp is not None:
            self._after_start(lambda: self._command("stop" if paused else "cont"))

    def update(self, spec: Obj) -> None:
        """A change of the VMI's spec that reaches the running domain: CD-ROM media inserted or ejected (off the
        caller's thread: the consoles' lock is held)."""
        self._latest_spec = spec
        if not self._started.is_set() or self._qmp is None or self.ended:
            return  # _launch looks at the latest spec once QEMU runs
        self._after_start(lambda: self._update_media(self._latest_spec))

    def _update_media(self, spec: Obj) -> None:
        with self._media_lock:
            self._change_media(spec)

    def _change_media(self, spec: Obj) -> None:
        wanted = {f"ua-{d.name}": d.path for d in self._attachments(spec) if d.device == "cdrom"}
        for device, path in wanted.items():
            if device not in self._media or self._media[device] == path:
                continue
            try:
                if path is None:
                    self._command("eject", {"id": device, "force": True})
                    log.info("vmi %s/%s: CD-ROM %s ejected", self.namespace, self.name, device[3:])
                else:
                    self._command("blockdev-change-medium", {"id": device, "filename": path, "format": "raw",
                                                             "read-only-mode": "read-only"})
                    log.info("vmi %s/%s: CD-ROM %s: medium %s inserted", self.namespace, self.name, device[3:],
                             os.path.basename(path))
                self._media[device] = path
            except QmpError as exc:
                log.warning("vmi %s/%s: CD-ROM %s: %s", self.namespace, self.name, device[3:], exc)

    def alive(self) -> bool:
        return (self.proc is not None and self.proc.poll() is None) or not self._started.is_set()

    def kill(self) -> None:
        """The grace period is over: virt-handler kills the domain."""
        with self._lock:
            self._ending = True
        log.info("vmi %s/%s: grace period over: QEMU killed", self.namespace, self.name)
        self._started.wait(START_DEADLINE * 2)
        self._stop_process(graceful=False)

    def end(self, reason: str) -> None:
        with self._lock:
            self._ending = True
        super().end(reason)
        with self._lock:
            peer = self._vnc_peer
        if peer is not None:
            peer.end(reason)
        threading.Thread(target=self._teardown, name=f"teardown-{self.name}", daemon=True).start()

    def _teardown(self) -> None:
        self._started.wait(START_DEADLINE * 2)
        self._stop_process()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def stop_now(self) -> None:
        """kubesim stops: QEMU goes with it, synchronously."""
        with self._lock:
            self._ending = True
        self._stop_process(graceful=False)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def _stop_process(self, graceful: bool = True) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            if graceful:
                proc.terminate()
                try:
                    proc.wait(STOP_DEADLINE)
                except subprocess.TimeoutExpired:
                    proc.kill()
            else:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(STOP_DEADLINE)
        for closing in (self._qmp, self._serial):
            if closing is not None:
                with contextlib.suppress(OSError):
                    closing.close()

    # ---- the screen: QEMU's VNC server, one client at a time

    def attach_screen(self, preserve: bool) -> VncPeer:  # type: ignore[override]
        from .console import ScreenBusy
        self._started.wait(START_DEADLINE * 2)
        with self._lock:
            previous = self._vnc_peer
            if previous is not None and not previous.closed and preserve:
                raise ScreenBusy(ACTIVE_SESSION)
            if self.ended:
                raise ScreenBusy(self.ended)
        sock = _connect_unix(os.path.join(self.run_dir, "vnc.sock"), START_DEADLINE)
        peer = VncPeer(sock, self)
        with self._lock:
            self._vnc_peer = peer
        if previous is not None:
            previous.end(SCREEN_TAKEN_OVER)
        log.info("vmi %s/%s: VNC client connected%s", self.namespace, self.name,
                 " (took over from the previous client)" if previous is not None else "")
        return peer

    def screen_busy(self) -> bool:
        with self._lock:
            return self._vnc_peer is not None and not self._vnc_peer.closed


class VncPeer:
    """A WebSocket's end of QEMU's VNC server: RFB bytes both ways, unchanged."""

    def __init__(self, sock: socket.socket, guest: QemuGuest) -> None:
        self._sock = sock
        self._sock.setblocking(False)
        self._guest = guest
        self.reason = ""
        self.closed = False
        self._ended = ""

    def fileno(self) -> int:
        return self._sock.fileno()

    def end(self, reason: str) -> None:
        self._ended = reason
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def take(self) -> bytes | None:
        if self._ended:
            self.reason = self._ended
            return None
        try:
            data = self._sock.recv(65536)
        except BlockingIOError:
            return b""
        except OSError as exc:
            self.reason = f"the VNC server closed: {exc}"
            return None
        if not data:
            self.reason = self._ended or "the VNC server closed the connection"
            return None
        return data

    def feed(self, data: bytes) -> None:
        if self._ended:
            return
        self._sock.setblocking(True)
        self._sock.settimeout(10)
        try:
            self._sock.sendall(data)
        except OSError:
            pass
        finally:
            self._sock.setblocking(False)

    def close(self) -> None:
        self.closed = True
        with self._guest._lock:
            if self._guest._vnc_peer is self:
                self._guest._vnc_peer = None
        with contextlib.suppress(OSError):
            self._sock.close()
