"""Real guests for the tests: the test guest images (scripts/build-guests.sh), VMs that boot them on a kubesim that
runs QEMU (`--guests qemu`), and a reader of a VM's serial line that follows it across VMIs."""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import websocket
from kubernetes import client

from kubesim.guests import default_guest_dir

from .cluster import HANG_DEADLINE, REPO, call

GUEST_PASSWORD = "guest"  # the test guests' root password (scripts/build-guests.sh)
PROMPT = b"kubevbmc-guest login: "
SHELL = b"guest# "
# A boot that runs under TCG (OVMF where the host's KVM cannot run it) on a loaded machine: a deadline for hangs.
BOOT_DEADLINE = 300.0


def build_guest_images() -> Path:
    """The test guests, built once per machine (cached; several test processes wait for one build)."""
    directory = default_guest_dir()
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / "build-guests.test-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run(["bash", str(REPO / "scripts" / "build-guests.sh"), str(directory)], check=True,
                       stdout=subprocess.DEVNULL, timeout=1800)
    return directory


def sim_flags(images: Path) -> list[str]:
    return ["--guests", "qemu", "--vm-start-delay", "0.2", "--import-delay", "0.3",
            "--container-disk-dir", str(images), "--netboot-dir", str(images / "netboot")]


def guest_vm(api: client.ApiClient, ns: str, name: str = "vm", *, firmware: str = "bios",
             run_strategy: str = "Halted", grace: int = 60, mac: str = "") -> dict[str, Any]:
    """A VM that boots the test guest's disk image (a containerDisk whose image name maps to disk.img), with an
    empty CD-ROM drive and a NIC on the pod network; `firmware` bios (SeaBIOS, its output on the serial port
    too), efi or secure (OVMF with secure boot, SMM on)."""
    bootloader: dict[str, Any] = {"bios": {"useSerial": True}}
    features: dict[str, Any] = {"acpi": {}}
    if firmware == "efi":
        bootloader = {"efi": {"secureBoot": False}}
    elif firmware == "secure":
        bootloader = {"efi": {"secureBoot": True}}
        features["smm"] = {"enabled": True}
    vm = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": name},
          "spec": {"runStrategy": run_strategy, "template": {"spec": {
              "terminationGracePeriodSeconds": grace,
              "domain": {"firmware": {"bootloader": bootloader}, "features": features,
                         "resources": {"requests": {"memory": "512Mi"}},
                         "devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}, "bootOrder": 1},
                                               {"name": "cdrom", "cdrom": {"bus": "sata"}}],
                                     "interfaces": [{"name": "default", "masquerade": {},
                                                     **({"macAddress": mac} if mac else {})}]}},
              "networks": [{"name": "default", "pod": {}}],
              "volumes": [{"name": "root", "containerDisk": {"image": "localhost/kubevbmc-guests/disk:latest"}}]}}}}
    reply = call(api, "POST", f"/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachines", vm)
    assert reply.status == 201, reply.body
    return reply.body


def qemu_processes(marker: str) -> list[int]:
    """The QEMU processes whose working directory (a VMI's run directory, named by its uid, in kubesim's state
    directory) or command line holds `marker`."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if argv and argv[0].endswith(b"qemu-system-x86_64") and (marker in cwd
                                                                  or any(marker.encode() in a for a in argv)):
            try:
                if (entry / "stat").read_text().split(") ", 1)[1].startswith("Z"):
                    continue  # exited, not yet reaped by kubesim
            except OSError:
                continue
            out.append(int(entry.name))
    return out


class SerialTap:
    """A VM's serial line as virt-api's console serves it, read without pause into one transcript that runs on
    across resets and new VMIs (it reconnects whenever the line ends). `mark()` then `expect(text, since)`."""

    def __init__(self, url: str, token: str, tls: Any, namespace: str, name: str = "vm") -> None:
        self.url = (url.replace("https://", "wss://") + f"/apis/subresources.kubevirt.io/v1/namespaces/{namespace}/"
                    f"virtualmachineinstances/{name}/console")
        self._header = [f"Authorization: Bearer {token}"]
        self._tls = tls
        self._transcript = bytearray()
        self._cond = threading.Condition()
        self._ws: websocket.WebSocket | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"tap-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping:
            try:
                ws = websocket.create_connection(self.url, header=self._header, subprotocols=["plain.kubevirt.io"],
                                                 sslopt={"context": self._tls}, timeout=5)
            except (OSError, websocket.WebSocketException):
                time.sleep(0.2)  # not running (yet): try again
                continue
            self._ws = ws
            try:
                while not self._stopping:
                    try:
                        opcode, data = ws.recv_data()
                    except websocket.WebSocketTimeoutException:
                        continue
                    if opcode == websocket.ABNF.OPCODE_CLOSE:
                        break
                    with self._cond:
                        self._transcript += data
                        self._cond.notify_all()
            except (OSError, websocket.WebSocketException):
                pass
            finally:
                self._ws = None
                ws.close()

    def mark(self) -> int:
        with self._cond:
            return len(self._transcript)

    def text(self, since: int = 0) -> str:
        with self._cond:
            return self._transcript[since:].decode(errors="replace")

    def expect(self, pattern: str | bytes, since: int = 0, deadline: float = BOOT_DEADLINE) -> int:
        """Wait until `pattern` (a regular expression) shows after `since`; the position after it."""
        regex = re.compile(pattern.encode() if isinstance(pattern, str) else pattern)
        end = time.monotonic() + max(deadline, HANG_DEADLINE)
        with self._cond:
            while True:
                found = regex.search(bytes(self._transcript), since)
                if found:
                    return found.end()
                left = end - time.monotonic()
                if left <= 0:
                    tail = self._transcript[since:][-2000:].decode(errors="replace")
                    raise AssertionError(f"no {pattern!r} on the serial line; it shows: {tail!r}")
                self._cond.wait(min(left, 1.0))

    def send(self, data: bytes) -> None:
        end = time.monotonic() + HANG_DEADLINE
        while self._ws is None:
            assert time.monotonic() < end, "the serial line is not connected"
            time.sleep(0.05)
        self._ws.send_binary(data)

    def login(self, since: int = 0) -> int:
        """Log in as root at the prompt shown after `since`; the position after the shell's prompt. A login that
        the guest's getty turns down (on a machine this busy a password was once not read before login's own
        60 s ran out) is tried again, twice at most, as a person at the console would."""
        after = self.expect(PROMPT, since)
        for _ in range(3):
            self.send(b"root\r")
            after = self.expect(b"Password: ", after, HANG_DEADLINE)
            self.send(GUEST_PASSWORD.encode() + b"\r")
            after = self.expect(SHELL + b"|Login timed out|Login incorrect", after, BOOT_DEADLINE)
            if self.text(after - len(SHELL)).startswith(SHELL.decode()):
                return after
            after = self.expect(PROMPT, after)
        raise AssertionError(f"three logins turned down: {self.text(since)[-2000:]!r}")

    def close(self) -> None:
        self._stopping = True
        ws = self._ws
        if ws is not None:
            ws.close()
        self._thread.join(10)


def kvm_or_tcg() -> str:
    return "kvm" if os.access("/dev/kvm", os.R_OK | os.W_OK) else "tcg"
