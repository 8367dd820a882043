"""The VMIs' serial consoles: the guest end of virt-api's `virtualmachineinstances/console` WebSocket (and the
guest behind each VMI's screen, whose RFB side is kubesim/screen.py).

One `SerialLine` per VMI uid (a VMI that is stopped and started again, or restarted, is a new VMI and a new line).
When the VMI is Running its guest "boots" at once: the firmware, the device it boots from (the VMI's boot order,
as `boot_sequence` reads it), a kernel line and a login prompt, `<vmi name> login: `. What a client types reaches
`GuestTty`, a getty in cooked mode that echoes, edits lines and never lets anyone log in. A soft reboot prints the
reboot and the boot text again on the same line; a reset the boot text. When the VMI is deleted its guest prints a
shutdown line; when the VMI is gone or final the line ends and every client is told so (the WebSocket closes).

As virt-handler, a line has one client at a time: a new connection takes over and the older one ends.

kubesim's simplification: output produced while no client is connected is kept (the last `BUFFER_LIMIT` bytes)
and the next client gets it first, so a client that connects after the VMI booted still sees the boot text and
the prompt. Real QEMU drops serial output that nobody reads.

The server side of the WebSocket is kubesim/server.py's; this module is threads and bytes only: lines are written
by the HTTP threads (input, connections) and the console loop (VMI state), under each line's lock.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .screen import ACTIVE_SESSION, ScreenClient, TextScreen
from .screen import TAKEN_OVER as SCREEN_TAKEN_OVER

log = logging.getLogger(__name__)
Obj = dict[str, Any]

BUFFER_LIMIT = 16 * 1024  # output kept for the next client (oldest dropped)
INPUT_LIMIT = 4096  # input held while the VMI is paused (more is dropped, as a full tty buffer drops it)
LINE_LIMIT = 255  # characters of one typed line; further ones are dropped
_FORGET_AFTER = 4096  # ended lines remembered, so that a stale read of a VMI cannot bring its line back

FIRMWARE_TEXT = b"\r\nSeaBIOS (version kubesim)\r\n"
DISK_TEXT = b"Booting from Hard Disk...\r\n"
CDROM_TEXT = b"Booting from DVD/CD...\r\n"
NO_CDROM_TEXT = b"Boot failed: Could not read from CDROM (code 0003)\r\n"
NETWORK_TEXT = b"Booting from ROM...\r\niPXE (https://ipxe.org) starting execution...ok\r\n"
NO_BOOT_TEXT = b"No bootable device.  Retrying in 60 seconds.\r\n"
KERNEL_TEXT = b"[    0.000000] Linux version 6.12.0-kubesim (kubesim@kubesim) #1 SMP PREEMPT_DYNAMIC\r\n"
REBOOT_TEXT = (b"\r\n[  OK  ] Reached target reboot.target - System Reboot.\r\n"
               b"[   42.000000] reboot: Restarting system\r\n")
SHUTDOWN_TEXT = (b"\r\n[  OK  ] Reached target poweroff.target - System Power Off.\r\n"
                 b"[   42.000000] reboot: Power down\r\n")
LOGIN_INCORRECT = b"\r\nLogin incorrect\r\n"

# Why a client's connection ends (the reason of the WebSocket close frame).
TAKEN_OVER = "another client connected to the serial console"


def prompt(name: str) -> bytes:
    return f"{name} login: ".encode()


# ---------------------------------------------------------------- what the guest boots from


@dataclass(frozen=True)
class BootDevice:
    kind: str  # "disk", "cdrom" or "network"
    name: str
    media: bool = True  # a CD-ROM drive with a disc in it (an ejected one has no volume)


def boot_sequence(spec: Obj) -> list[BootDevice]:
    """The devices the firmware tries, in order: those with a `bootOrder` (disks and interfaces), lowest first;
    once any device has one, the others are not tried. Without any, the disks in the order they are declared."""
    devices = (spec.get("domain") or {}).get("devices") or {}
    volumes = {str(v.get("name")) for v in spec.get("volumes") or [] if isinstance(v, dict)}
    disks = [d for d in devices.get("disks") or [] if isinstance(d, dict)]
    interfaces = [i for i in devices.get("interfaces") or [] if isinstance(i, dict)]

    def disk(d: Obj) -> BootDevice:
        name = str(d.get("name"))
        if "cdrom" in d:
            return BootDevice("cdrom", name, name in volumes)
        return BootDevice("disk", name)

    ranked = [(d["bootOrder"], disk(d)) for d in disks if isinstance(d.get("bootOrder"), int)]
    ranked += [(i["bootOrder"], BootDevice("network", str(i.get("name")))) for i in interfaces
               if isinstance(i.get("bootOrder"), int)]
    if ranked:
        return [device for _, device in sorted(ranked, key=lambda r: r[0])]
    return [disk(d) for d in disks]


def boot_text(name: str, spec: Obj) -> tuple[bytes, bool]:
    """What the line shows as the guest boots, and whether it got as far as a login prompt."""
    out = [FIRMWARE_TEXT]
    for device in boot_sequence(spec):
        if device.kind == "cdrom" and not device.media:
            out.append(NO_CDROM_TEXT)
            continue
        out.append({"disk": DISK_TEXT, "cdrom": CDROM_TEXT, "network": NETWORK_TEXT}[device.kind])
        out += [KERNEL_TEXT, b"\r\n\r\n", prompt(name)]
        return b"".join(out), True
    out.append(NO_BOOT_TEXT)
    return b"".join(out), False


# ---------------------------------------------------------------- the guest's getty


CR, LF, NUL, BS, TAB, ETX, NAK, DEL = 0x0D, 0x0A, 0x00, 0x08, 0x09, 0x03, 0x15, 0x7F


class GuestTty:
    """agetty and login on ttyS0, in cooked mode: input is echoed (control characters as `^X`), backspace and ^U
    edit the line, ^C starts over; a user name is answered with `Password: ` (not echoed, as login turns echo
    off), any password with `Login incorrect` and the prompt again. An empty line gets the prompt again."""

    def __init__(self, hostname: str) -> None:
        self.prompt = prompt(hostname)
        self._typed = bytearray()
        self._password = False
        self._after_cr = False

    def receive(self, data: bytes) -> bytes:
        return b"".join(self._key(byte) for byte in data)

    def _key(self, byte: int) -> bytes:
        after_cr, self._after_cr = self._after_cr, byte == CR
        if byte in (LF, NUL) and after_cr:
            return b""  # CR LF and CR NUL (telnet's and many terminals' Enter) are one Enter
        if byte in (CR, LF):
            return self._enter()
        if byte in (BS, DEL):
            if not self._typed:
                return b""
            del self._typed[-1]
            return b"" if self._password else b"\b \b"
        if byte == NAK:
            erased, self._typed = len(self._typed), bytearray()
            return b"" if self._password else b"\b \b" * erased
        if byte == ETX:
            self._typed.clear()
            self._password = False
            return b"^C\r\n" + self.prompt
        if byte < 0x20 and byte != TAB:
            return b"" if self._password else b"^" + bytes([byte + 0x40])  # ECHOCTL; not part of the line
        if len(self._typed) >= LINE_LIMIT:
            return b""
        self._typed.append(byte)
        return b"" if self._password else bytes([byte])

    def _enter(self) -> bytes:
        typed, self._typed = bytes(self._typed), bytearray()
        if self._password:
            self._password = False
            return b"\r\n" + LOGIN_INCORRECT + self.prompt
        if typed:
            self._password = True
            return b"\r\nPassword: "
        return b"\r\n" + self.prompt


# ---------------------------------------------------------------- a VMI's serial line and its client


@dataclass(frozen=True)
class Domain:
    """What virt-handler knows of a VMI's domain, all the console depends on."""

    uid: str
    running: bool  # phase Running
    serial: bool  # a serial console is attached (`autoattachSerialConsole` is not false)
    stopping: bool  # the VMI is being deleted: the guest is shutting down
    paused: bool
    spec: Obj
    graphics: bool = True  # a graphics device is attached (`autoattachGraphicsDevice` is not false)


class ScreenBusy(Exception):
    """Another client holds the screen and this one asked to preserve that session."""

    message = ACTIVE_SESSION


class SerialLine:
    """One VMI's guest and its consoles: its serial port (the guest writes to it, at most one client reads it and
    types into it) and its screen (kubesim/screen.py: a text console with its own getty, at most one client)."""

    def __init__(self, namespace: str, name: str, uid: str) -> None:
        self.namespace, self.name, self.uid = namespace, name, uid
        self._lock = threading.Lock()
        self._pending = bytearray()  # guest output not yet taken by a client
        self._client: SerialClient | None = None
        self._tty: GuestTty | None = None  # None: nothing reads the line (no bootable device, powered down)
        self._paused = False
        self._held = bytearray()  # input that arrived while paused: the guest reads it once it runs again
        self._stopping = False
        self._spec: Obj = {}
        self.screen = TextScreen()
        self._screen_tty: GuestTty | None = None  # tty1's getty, on the screen
        self._screen_client: ScreenClient | None = None
        self.ended = ""  # why the line went away; "" while it is up

    def __repr__(self) -> str:
        return f"SerialLine({self.namespace}/{self.name} uid={self.uid})"

    # ---- the guest's side

    def boot(self, spec: Obj) -> None:
        with self._lock:
            self._boot(spec)

    def reboot(self, spec: Obj, soft: bool) -> None:
        """A soft reboot (the guest restarts itself) or a reset (the firmware starts over at once)."""
        with self._lock:
            self._reboot(spec, soft)

    def _reboot(self, spec: Obj, soft: bool) -> None:
        if self.ended or self._stopping:
            return
        if soft:
            self._emit(REBOOT_TEXT)
            self._show(REBOOT_TEXT)
        self._boot(spec)

    def update(self, spec: Obj) -> None:
        """The VMI's spec changed while it runs (the simulated guest reads its spec only when it boots)."""

    def alive(self) -> bool:
        """Whether the guest still runs (the simulated one runs until its line ends)."""
        return not self.ended

    def kill(self) -> None:
        """virt-handler kills the domain at the end of its grace period (the simulated guest needs no killing)."""

    def stop_now(self) -> None:
        self.end("kubesim is shutting down")

    def shut_down(self) -> None:
        """The guest powers off (an ACPI shutdown); the line stays until the domain is gone."""
        with self._lock:
            if self.ended or self._stopping:
                return
            self._stopping = True
            self._tty = self._screen_tty = None
            self._emit(SHUTDOWN_TEXT)
            self._show(SHUTDOWN_TEXT)

    def set_paused(self, paused: bool) -> None:
        with self._lock:
            self._paused = paused
            if not paused and self._held:
                held, self._held = bytes(self._held), bytearray()
                self._input(held)

    def end(self, reason: str) -> None:
        """The domain is gone: the client, if any, takes what is left and then is disconnected."""
        with self._lock:
            if self.ended:
                return
            self.ended = reason
            self._tty = self._screen_tty = None
            if self._client is not None:
                self._client.wake()
            if self._screen_client is not None:
                self._screen_client.end(reason)
        log.info("vmi %s/%s: serial console closed (%s)", self.namespace, self.name, reason)

    def _boot(self, spec: Obj) -> None:
        self._spec = spec
        text, up = boot_text(self.name, spec)
        self._tty = GuestTty(self.name) if up else None
        self._screen_tty = GuestTty(self.name) if up else None
        self._held.clear()
        self._emit(text)
        self.screen.clear()  # the firmware starts with a blank screen
        self._show(text)

    def _show(self, data: bytes) -> None:
        self.screen.write(data)
        if self._screen_client is not None and self.screen.changed:
            self._screen_client.damaged(self.screen.changed)
        self.screen.changed = set()

    def _emit(self, data: bytes) -> None:
        self._pending += data
        if len(self._pending) > BUFFER_LIMIT:
            del self._pending[:len(self._pending) - BUFFER_LIMIT]
        if self._client is not None and data:
            self._client.wake()

    def _input(self, data: bytes) -> None:
        if self._paused:
            self._held += data[:max(INPUT_LIMIT - len(self._held), 0)]
        elif self._tty is not None:
            self._emit(self._tty.receive(data))

    def _screen_keys(self, data: bytes) -> None:
        """Keys typed on the screen (under the lock): tty1's getty reads them; a paused guest reads nothing."""
        if not self._paused and self._screen_tty is not None and not self.ended:
            self._show(self._screen_tty.receive(data))

    def _ctrl_alt_del(self) -> None:
        log.info("vmi %s/%s: Ctrl-Alt-Del on the screen: the guest reboots", self.namespace, self.name)
        self._reboot(self._spec, soft=True)

    # ---- the screen's client

    def attach_screen(self, preserve: bool) -> ScreenClient:
        """A new VNC client; the one before, if any, is disconnected, unless `preserve` asks to leave it be (then
        ScreenBusy)."""
        with self._lock:
            previous = self._screen_client
            if previous is not None and preserve:
                raise ScreenBusy(ACTIVE_SESSION)
            client = ScreenClient(f"{self.namespace}_{self.name}", self.screen, self._lock, self._screen_keys,
                                  self._ctrl_alt_del, self._detach_screen)
            self._screen_client = client
            if previous is not None:
                previous.end(SCREEN_TAKEN_OVER)
            if self.ended:
                client.end(self.ended)
        log.info("vmi %s/%s: VNC client connected%s", self.namespace, self.name,
                 " (took over from the previous client)" if previous is not None else "")
        return client

    def screen_busy(self) -> bool:
        with self._lock:
            return self._screen_client is not None

    def _detach_screen(self, client: ScreenClient) -> None:
        if client is self._screen_client:
            self._screen_client = None

    # ---- the client's side

    def attach(self) -> SerialClient:
        """A new client; the one connected before, if any, is disconnected (it has been taken over)."""
        client = SerialClient(self)
        with self._lock:
            previous, self._client = self._client, client
            if previous is not None:
                previous.wake()
            client.wake()  # what was kept while no one was connected
        log.info("vmi %s/%s: serial console connected%s", self.namespace, self.name,
                 " (took over from the previous client)" if previous is not None else "")
        return client

    def _take(self, client: SerialClient) -> bytes | None:
        with self._lock:
            if client is not self._client:
                client.reason = TAKEN_OVER
                return None
            if self._pending:
                out, self._pending = bytes(self._pending), bytearray()
                if self.ended:  # the last output, then the end: wake the connection again for it
                    client.wake()
                return out
            if self.ended:
                client.reason = self.ended
                return None
            return b""

    def _feed(self, client: SerialClient, data: bytes) -> None:
        with self._lock:
            if client is self._client and not self.ended:
                self._input(data)

    def _detach(self, client: SerialClient) -> None:
        with self._lock:
            if client is self._client:
                self._client = None


class SerialClient:
    """One connection's hold on a line, until the line ends or another connection takes over.

    `fileno()` reads as ready whenever `take()` may have something new, so a connection waits on it and on its
    socket in one `select`."""

    def __init__(self, line: SerialLine) -> None:
        self.line = line
        self.reason = ""  # why take() returned None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    def fileno(self) -> int:
        return self._wake_r.fileno()

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # full (it is already awake) or closed (it is gone)
            self._wake_w.send(b"\0")

    def take(self) -> bytes | None:
        """Guest output since the last take (b"" if none); None once this client is disconnected (`reason`)."""
        with contextlib.suppress(OSError):  # drained (BlockingIOError) or closed
            while self._wake_r.recv(4096):
                pass
        return self.line._take(self)

    def feed(self, data: bytes) -> None:
        """What the client typed."""
        self.line._feed(self, data)

    def close(self) -> None:
        self.line._detach(self)
        self._wake_r.close()
        self._wake_w.close()


# ---------------------------------------------------------------- all of them


class SerialConsoles:
    """The serial lines of every VMI, by namespace and name, brought in line with the VMIs' domains by `settle`."""

    def __init__(self, make_line: Callable[[str, str, str], SerialLine] | None = None) -> None:
        self._lock = threading.Lock()
        self._lines: dict[tuple[str, str], SerialLine] = {}
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()  # uids whose line ended
        # What runs behind a line: this module's simulated guest, or a real one (kubesim/guests.py), which runs
        # whether or not the VMI has a serial console or a screen.
        self.make_line = make_line or SerialLine
        self.real = make_line is not None

    def settle(self, namespace: str, name: str, domain: Domain | None) -> SerialLine | None:
        """Make the line match the VMI's domain (None: there is no VMI): a running domain with a serial console
        has a line, booted when it is made; any other has none. Returns the line, if any."""
        key = (namespace, name)
        with self._lock:
            line = self._lines.get(key)
            up = domain is not None and domain.running and (self.real or domain.serial or domain.graphics)
            if line is not None and (not up or domain is None or line.uid != domain.uid):
                del self._lines[key]
                self._forget(line.uid)
                line.end(f"VMI {name} is no longer running")
                line = None
            if not up or domain is None or domain.uid in self._ended:
                return None
            if line is None:
                line = self._lines[key] = self.make_line(namespace, name, domain.uid)
                line.boot(domain.spec)
            else:
                line.update(domain.spec)
            line.set_paused(domain.paused)
            if domain.stopping:
                line.shut_down()
            return line

    def reboot(self, namespace: str, name: str, uid: str, spec: Obj, soft: bool) -> None:
        with self._lock:
            line = self._lines.get((namespace, name))
        if line is not None and line.uid == uid:
            line.reboot(spec, soft)

    def lines(self) -> list[SerialLine]:
        with self._lock:
            return list(self._lines.values())

    def line(self, namespace: str, name: str, uid: str) -> SerialLine | None:
        with self._lock:
            line = self._lines.get((namespace, name))
        return line if line is not None and line.uid == uid else None

    def stop(self) -> None:
        """The node goes away: every real guest with it (a simulated one is only threads and bytes; its clients
        learn of the end from the server's own shutdown)."""
        if not self.real:
            return
        with self._lock:
            lines, self._lines = list(self._lines.values()), {}
        for line in lines:
            line.stop_now()

    def _forget(self, uid: str) -> None:
        self._ended[uid] = None
        while len(self._ended) > _FORGET_AFTER:
            self._ended.popitem(last=False)
