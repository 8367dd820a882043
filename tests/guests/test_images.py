"""The test guests that scripts/build-guests.sh builds from Debian's packages, booted under QEMU.

The images are built once per machine into the default cache directory (a second run returns at once), then checked
as files (which are bootable, for which firmware) and booted: guest.iso under SeaBIOS up to a root login on the serial
line and an ACPI power-off, and each other medium under the firmware it is for up to its login prompt. A boot runs
under KVM where the host's KVM is hardware virtualization, else under TCG. Deadlines only catch hangs."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "build-guests.sh"
QEMU = "qemu-system-x86_64"
OVMF = Path("/usr/share/OVMF")
BOOT_DEADLINE = 240.0  # a boot under TCG takes about 20 s on a 2-core machine; this only catches a hang
OUTPUTS = ("guest.iso", "disk.img", "blank.iso", "signed.iso", "netboot/boot.ipxe", "netboot/bootx64.efi",
           "netboot/grub/grub.cfg", "netboot/vmlinuz", "netboot/initrd.img")


# Every medium under every firmware, secure boot's refusal, the signed chain, the login and the ACPI power button
# are booted through the BMC in tests/guests/; here, the images themselves.


def guest_dir() -> Path:
    """The script's default output directory."""
    return Path(os.environ.get("KUBEVBMC_GUESTS") or Path.home() / ".cache" / "kubevbmc" / "guests")


@pytest.fixture(scope="module")
def guests() -> Path:
    directory = guest_dir()
    subprocess.run(["bash", str(SCRIPT), str(directory)], check=True, stdout=subprocess.DEVNULL, timeout=1800)
    for tool in (QEMU, "xorriso"):
        assert shutil.which(tool), f"{tool} is missing after {SCRIPT.name} (it installs it)"
    return directory


def kvm_usable() -> bool:
    """KVM backed by the CPU's virtualization extensions. /dev/kvm may also be PVM (kvm_pvm, as on the machines of
    this project's CI), which runs an unmodified guest's kernel so slowly that it does not boot in minutes."""
    return (os.access("/dev/kvm", os.R_OK | os.W_OK)
            and any(Path("/sys/module", m).exists() for m in ("kvm_intel", "kvm_amd")))


def el_torito(image: Path) -> list[str]:
    """The platforms of an image's El Torito boot entries (BIOS, UEFI), none for an image that is not bootable."""
    result = subprocess.run(["xorriso", "-indev", str(image), "-report_el_torito", "plain"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [line.split()[6] for line in result.stdout.splitlines() if line.startswith("El Torito boot img :")]


def iso_uuid(image: Path) -> bytes:
    with open(image, "rb") as f:
        f.seek(16 * 2048 + 830)  # the primary volume descriptor's modification time
        return f.read(16)


# ---------------------------------------------------------------- a VM


@dataclass
class Firmware:
    kind: str  # bios, uefi, secure

    def args(self, tmp: Path) -> list[str]:
        if self.kind == "bios":
            return []
        secure = self.kind == "secure"
        code, variables = (("OVMF_CODE_4M.ms.fd", "OVMF_VARS_4M.ms.fd") if secure
                           else ("OVMF_CODE_4M.fd", "OVMF_VARS_4M.fd"))
        copy = tmp / "vars.fd"
        shutil.copyfile(OVMF / variables, copy)
        args = ["-machine", "q35,smm=on", "-global", "driver=cfi.pflash01,property=secure,value=on"] if secure else []
        return [*args, "-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={OVMF / code}",
                "-drive", f"if=pflash,format=raw,unit=1,file={copy}"]


@dataclass
class Vm:
    """QEMU with its serial port on a unix socket (as the simulator's consoles use it) and QMP on another; what the
    guest wrote on the serial line is in `seen`."""

    argv: list[str]
    tmp: Path
    seen: bytes = b""
    process: subprocess.Popen[bytes] | None = None
    serial: socket.socket | None = None

    def start(self) -> None:
        serial, qmp = self.tmp / "serial.sock", self.tmp / "qmp.sock"
        accel = "kvm" if kvm_usable() else "tcg"
        argv = [QEMU, "-accel", accel, "-m", "512", "-display", "none",
                "-chardev", f"socket,id=s0,path={serial},server=on,wait=off", "-serial", "chardev:s0",
                "-qmp", f"unix:{qmp},server=on,wait=off", *self.argv]
        with open(self.tmp / "qemu.err", "wb") as errors:  # QEMU keeps its own descriptor
            self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=errors)
        self.serial = self._connect(serial)

    def _connect(self, path: Path) -> socket.socket:
        deadline = time.monotonic() + 30
        while True:
            sock = socket.socket(socket.AF_UNIX)
            try:
                sock.connect(str(path))
                return sock
            except OSError:
                sock.close()
                assert self.process is not None
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"QEMU did not start: {self.qemu_errors()}") from None
                time.sleep(0.05)

    def qemu_errors(self) -> str:
        return (self.tmp / "qemu.err").read_text(errors="replace").strip()

    def expect(self, text: str, deadline: float = BOOT_DEADLINE) -> None:
        """Read the serial line until `text` appears in what the guest wrote after the last expect."""
        assert self.serial is not None and self.process is not None
        wanted = text.encode()
        end = time.monotonic() + deadline
        while wanted not in self.seen:
            if time.monotonic() > end:
                raise AssertionError(f"no {text!r} on the serial line after {deadline:.0f} s; it showed:\n"
                                     + self.tail())
            self.serial.settimeout(0.5)
            try:
                data = self.serial.recv(65536)
            except TimeoutError:
                continue
            if not data:
                raise AssertionError(f"the serial line closed before {text!r} (QEMU: {self.qemu_errors()}):\n"
                                     + self.tail())
            self.seen += data
        self.seen = self.seen[self.seen.index(wanted) + len(wanted):]

    def drain(self) -> None:
        """Read what is left on the serial line once QEMU has ended."""
        assert self.serial is not None
        self.serial.settimeout(5)
        with contextlib.suppress(OSError):
            while data := self.serial.recv(65536):
                self.seen += data

    def tail(self) -> str:
        return self.seen[-3000:].decode(errors="replace")

    def type(self, line: str) -> None:
        assert self.serial is not None
        self.serial.sendall(line.encode() + b"\r")

    def qmp(self, command: str) -> None:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(30)
            sock.connect(str(self.tmp / "qmp.sock"))
            reader = sock.makefile("rb")
            json.loads(reader.readline())  # the greeting
            for execute in ("qmp_capabilities", command):
                sock.sendall(json.dumps({"execute": execute}).encode() + b"\n")
                while True:  # skip events up to the command's answer
                    answer = json.loads(reader.readline())
                    if "return" in answer or "error" in answer:
                        break
                assert "return" in answer, answer

    def wait_exit(self, deadline: float) -> int | None:
        assert self.process is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.process.wait(deadline)
        return None

    def stop(self) -> None:
        if self.serial is not None:
            self.serial.close()
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@contextlib.contextmanager
def vm(firmware: str, *media: str) -> Iterator[Vm]:
    with tempfile.TemporaryDirectory(prefix="kvbmc-guest-") as tmp:  # short: a unix socket's path is at most 107
        machine = Vm([*Firmware(firmware).args(Path(tmp)), *media], Path(tmp))
        try:
            machine.start()
            yield machine
        finally:
            machine.stop()


def cdrom(image: Path) -> list[str]:
    return ["-drive", f"file={image},format=raw,media=cdrom,readonly=on,if=none,id=cd0",
            "-device", "ide-cd,drive=cd0,bootindex=1"]


def disk(image: Path) -> list[str]:  # snapshot: the cached image is never written
    return ["-drive", f"file={image},format=raw,if=none,id=d0,snapshot=on",
            "-device", "virtio-blk-pci,drive=d0,bootindex=1"]


def network(netboot: Path, bootfile: str, romfile: str | None = None) -> list[str]:
    rom = "" if romfile is None else f",romfile={romfile}"
    return ["-netdev", f"user,id=n0,tftp={netboot},bootfile={bootfile}",
            "-device", f"virtio-net-pci,netdev=n0{rom},bootindex=1"]


# ---------------------------------------------------------------- the files


def test_the_script_builds_every_image_and_a_second_run_reuses_them(guests: Path) -> None:
    for name in OUTPUTS:
        assert (guests / name).is_file() and (guests / name).stat().st_size > 0, name
    assert (guests / ".stamp").read_text().startswith("build-guests ")
    before = {name: (guests / name).stat().st_mtime_ns for name in OUTPUTS}
    subprocess.run(["bash", str(SCRIPT), str(guests)], check=True, timeout=1800)
    assert {name: (guests / name).stat().st_mtime_ns for name in OUTPUTS} == before
    assert not list(guests.glob(".build.*")), "a build directory was left behind"


def test_which_images_boot_and_for_which_firmware(guests: Path) -> None:
    assert el_torito(guests / "blank.iso") == []
    assert sorted(el_torito(guests / "guest.iso")) == ["BIOS", "UEFI"]
    assert sorted(el_torito(guests / "disk.img")) == ["BIOS", "UEFI"]
    assert el_torito(guests / "signed.iso") == ["UEFI"]
    # GRUB (grub-mkrescue's) finds its files by the ISO's UUID, its modification time: with both images in one VM, the
    # one that boots must not read the other's grub.cfg
    assert iso_uuid(guests / "guest.iso") != iso_uuid(guests / "disk.img")
    assert (guests / "netboot" / "boot.ipxe").read_text().startswith("#!ipxe\n")
    assert "kubevbmc.medium=network" in (guests / "netboot" / "grub" / "grub.cfg").read_text()


def test_the_script_never_writes_into_the_repository() -> None:
    result = subprocess.run(["bash", str(SCRIPT), str(REPO / "guests")], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "refusing" in result.stderr
    assert not (REPO / "guests").exists()


# ---------------------------------------------------------------- the boots
