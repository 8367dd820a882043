"""The QEMU command line kubesim builds from a VMI spec (kubesim/guests.py), device by device, against what
virt-launcher's converter (pkg/virt-launcher/virtwrap/converter) and libvirt make of the same spec."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kubesim.guests import (
    BIOS,
    EFI,
    EFI_SECURE,
    Acceleration,
    Accelerators,
    Attachment,
    Firmware,
    GuestConfig,
    QemuGuest,
    firmware_kind,
    memory_mib,
    qemu_command,
    vcpus,
)
from kubesim.volumes import VolumeFiles

from ..support.cluster import wait_for

Obj = dict[str, Any]
KVM = Acceleration("kvm", "host")
TCG = Acceleration("tcg", "max", "KVM internal error")


def command(spec: Obj, disks: list[Attachment] | None = None, nics: list[tuple[str, str, int | None]] | None = None,
            firmware: Firmware | None = None, accel: Acceleration = KVM, netboot: str = "/srv/netboot") -> list[str]:
    return qemu_command(name="ns_vm", spec=spec, firmware=firmware or Firmware(BIOS), accel=accel,
                        variables="/state/VARS.fd", disks=disks or [], nics=nics or [],
                        netboot_dir=netboot, memory_cap=512, cpu_cap=2)


def values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


@pytest.mark.parametrize(("bootloader", "kind"), [
    (None, BIOS),
    ({"bios": {}}, BIOS),
    ({"efi": {}}, EFI_SECURE),  # secureBoot is true unless false (KubeVirt's default)
    ({"efi": {"secureBoot": True}}, EFI_SECURE),
    ({"efi": {"secureBoot": False}}, EFI),
])
def test_the_firmware_follows_the_bootloader(bootloader: Obj | None, kind: str) -> None:
    spec: Obj = {"domain": {"firmware": {"bootloader": bootloader}} if bootloader else {}}
    assert firmware_kind(spec) == kind


def test_bios_is_seabios_on_q35_and_serial_bios_output_is_graphics_off() -> None:
    argv = command({"domain": {}})
    assert values(argv, "-machine") == ["q35,accel=kvm"]
    assert not [v for v in values(argv, "-drive") if v.startswith("if=pflash")]  # SeaBIOS: QEMU's default
    assert "-no-shutdown" in argv and "-S" in argv  # libvirt's: a guest power-off stops QEMU, kubesim quits it
    assert values(argv, "-boot") == ["strict=on"]
    serial = command({"domain": {"firmware": {"bootloader": {"bios": {"useSerial": True}}}}})
    assert values(serial, "-machine") == ["q35,accel=kvm,graphics=off"]


def test_uefi_gets_ovmf_with_its_own_variables_and_secure_boot_gets_smm_and_a_secure_flash() -> None:
    plain = command({"domain": {}}, firmware=Firmware(EFI, "/fw/CODE.fd", "/fw/VARS.fd"), accel=TCG)
    assert values(plain, "-machine") == ["q35,accel=tcg"]
    assert values(plain, "-cpu") == ["max"]
    assert "if=pflash,format=raw,unit=0,readonly=on,file=/fw/CODE.fd" in values(plain, "-drive")
    assert "if=pflash,format=raw,unit=1,file=/state/VARS.fd" in values(plain, "-drive")  # a copy, never the template
    assert "driver=cfi.pflash01,property=secure,value=on" not in values(plain, "-global")
    secure = command({"domain": {}}, firmware=Firmware(EFI_SECURE, "/fw/CODE.secboot.fd", "/fw/VARS.ms.fd"),
                     accel=TCG)
    assert values(secure, "-machine") == ["q35,accel=tcg,smm=on"]
    assert "driver=cfi.pflash01,property=secure,value=on" in values(secure, "-global")


def test_disks_get_their_bus_and_boot_order_as_bootindex() -> None:
    disks = [Attachment("root", "disk", "virtio", "/v/root.img", 2),
             Attachment("data", "disk", "sata", "/v/data.img", None, serial="D1"),
             Attachment("cd", "cdrom", "sata", None, 1),
             Attachment("scsi", "disk", "scsi", "/v/s.img", None),
             Attachment("os", "disk", "virtio", "/images/fedora.img", None, overlay=True)]
    argv = command({"domain": {}}, disks)
    drives, devices = values(argv, "-drive"), values(argv, "-device")
    assert "if=none,id=drive-0,file=/v/root.img,format=raw" in drives
    assert "virtio-blk-pci,drive=drive-0,id=ua-root,bootindex=2" in devices
    assert "ide-hd,bus=ide.0,drive=drive-1,id=ua-data,serial=D1" in devices
    # an empty CD-ROM tray: a drive with no file, which a medium change fills later
    assert "if=none,id=drive-2,media=cdrom,readonly=on" in drives
    assert "ide-cd,bus=ide.1,drive=drive-2,id=ua-cd,bootindex=1" in devices
    assert "virtio-scsi-pci,id=scsi0" in devices and "scsi-hd,bus=scsi0.0,drive=drive-3,id=ua-scsi" in devices
    # a containerDisk: the guest's writes go to a throw-away overlay
    assert "if=none,id=drive-4,file=/images/fedora.img,format=raw,snapshot=on" in drives


def test_a_nic_boots_only_with_a_boot_order_as_the_converter_disables_its_rom() -> None:
    argv = command({"domain": {}}, nics=[("default", "52:54:00:00:00:01", 1), ("second", "52:54:00:00:00:02", None)])
    devices = values(argv, "-device")
    # converter.go: a masquerade/bridge interface without bootOrder gets <rom enabled='no'/>
    assert "virtio-net-pci,netdev=net0,mac=52:54:00:00:00:01,id=ua-default,bootindex=1" in devices
    assert "virtio-net-pci,netdev=net1,mac=52:54:00:00:00:02,id=ua-second,romfile=" in devices
    netdevs = values(argv, "-netdev")
    assert all("restrict=on" in n for n in netdevs)  # no packet leaves the host
    assert netdevs[0].endswith("tftp=/srv/netboot,bootfile=boot.ipxe")
    efi = command({"domain": {}}, nics=[("default", "52:54:00:00:00:01", 1)],
                  firmware=Firmware(EFI, "/c", "/v"))
    assert values(efi, "-netdev")[0].endswith("bootfile=bootx64.efi")


def test_identity_consoles_and_caps() -> None:
    spec = {"domain": {"firmware": {"uuid": "6a1a24a1-0000-4000-8000-000000000001", "serial": "S,1"},
                       "cpu": {"cores": 4, "sockets": 2}, "resources": {"requests": {"memory": "8Gi"}},
                       "devices": {"autoattachGraphicsDevice": False}}}
    argv = command(spec)
    assert values(argv, "-uuid") == ["6a1a24a1-0000-4000-8000-000000000001"]
    assert values(argv, "-smbios") == ["type=1,manufacturer=KubeVirt,product=None,family=KubeVirt,serial=S,,1"]
    assert values(argv, "-m") == ["512"] and values(argv, "-smp") == ["2"]  # capped
    assert "-vnc" not in argv and values(argv, "-vga") == ["none"]
    assert values(argv, "-serial") == ["chardev:serial0"]
    no_serial = command({"domain": {"devices": {"autoattachSerialConsole": False}}})
    assert "-serial" not in no_serial and values(no_serial, "-vnc") == ["unix:vnc.sock"]


@pytest.mark.parametrize(("domain", "mib", "cpus"), [
    ({}, 512, 1),
    ({"resources": {"requests": {"memory": "128Mi"}}}, 128, 1),
    ({"memory": {"guest": "1G"}, "cpu": {"cores": 1, "threads": 2}}, 512, 2),
])
def test_memory_and_vcpus(domain: Obj, mib: int, cpus: int) -> None:
    assert memory_mib({"domain": domain}, 512) == mib
    assert vcpus({"domain": domain}, 4) == cpus


def test_what_is_asked_of_a_guest_reaches_qemu_in_the_order_asked(tmp_path: Path) -> None:
    """A pause and the unpause right after it, a reset and a power-off: each QMP command waits for the one before,
    however long that one takes."""
    config = GuestConfig(str(tmp_path), VolumeFiles(str(tmp_path / "volumes")), Accelerators("tcg"),
                         lambda ns, name, iface: "52:54:00:00:00:01")
    guest = QemuGuest("ns", "vm", "uid", config)
    done: list[int] = []
    rng = random.Random(27)
    before = threading.active_count()

    def action(i: int, pause: float) -> Any:
        def run() -> None:
            time.sleep(pause)
            done.append(i)
        return run

    for i in range(20):  # asked before QEMU runs: held until it does
        guest._after_start(action(i, rng.random() / 100))
    assert done == []
    guest._started.set()
    for i in range(20, 40):
        guest._after_start(action(i, rng.random() / 100))
    wait_for(lambda: len(done) == 40, timeout=30, what="every action")
    assert done == list(range(40))
    wait_for(lambda: threading.active_count() <= before, timeout=30, what="the thread that ran them to end")
