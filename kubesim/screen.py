"""The VMIs' screens: the guest end of virt-api's `virtualmachineinstances/vnc` WebSocket.

What QEMU's VNC server shows of a kubesim guest is its VGA text console: 80x25 cells of 8x16 pixels (640x400), on
which the firmware and the kernel print what they print on the serial port (SeaBIOS and Linux write to both) and
tty1's getty shows its own login prompt. Keys typed on the screen reach that getty, not the serial one, as on a
real VM (tty1 and ttyS0 are two terminals). Ctrl-Alt-Del reboots the guest, as systemd's ctrl-alt-del.target does.

The stream is RFB 3.8 (RFC 6143) as QEMU serves it to virt-handler's unix socket, which virt-api relays as binary
WebSocket messages (pkg/virt-api/rest/vnc.go: NewRawStreamer; pkg/virt-handler/rest/console.go: VNCHandler):
- ProtocolVersion: the server says 3.8; a client may answer 3.3, 3.7 or 3.8 (QEMU's vnc.c accepts those).
- Security: type 1 (None) only: KubeVirt's VNC has no password (the API server's authorization is the gate).
  3.8 sends a SecurityResult, 3.7 does not for None, 3.3 gets the type as a 32-bit number.
- ServerInit: 640x400, QEMU's pixel format (32 bits per pixel, depth 24, little-endian, true colour, red at bit 16,
  green at 8, blue at 0) and the desktop name QEMU gives it, `QEMU (<namespace>_<name>)` (libvirt's domain name).
- Client messages: SetPixelFormat (any 32-bit true-colour format with 8-bit channels on byte boundaries; kubesim's
  simplification: others end the connection), SetEncodings (Raw is always used; DesktopSize noted),
  FramebufferUpdateRequest, KeyEvent, PointerEvent (ignored: a text console has no pointer), ClientCutText
  (ignored). An unknown message type ends the connection, as QEMU does.
- Updates: Raw rectangles of the text rows that changed since the client's last update, sent when it asks.

One connection per VMI (virt-handler's newStopChan): a new connection ends the one before, unless it asks
`preserveSession=true`, which is refused while another is open (virt-handler answers 503, which virt-api relays as
500 InternalError, "Can't connect to websocket (503): ... Active VNC connection. Request denied.").

This module is bytes only, under the guest's line lock (kubesim/console.py's SerialLine owns the screen); the
WebSocket is kubesim/server.py's.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Callable
from typing import Any

from . import font

COLS, ROWS = 80, 25
WIDTH, HEIGHT = COLS * font.WIDTH, ROWS * font.HEIGHT
FOREGROUND, BACKGROUND = (0xAA, 0xAA, 0xAA), (0x00, 0x00, 0x00)  # VGA's light grey on black

VERSION = b"RFB 003.008\n"
CLIENT_VERSIONS = {b"RFB 003.003\n": 3, b"RFB 003.007\n": 7, b"RFB 003.008\n": 8}
SECURITY_NONE = 1
# QEMU's ServerInit pixel format: bpp, depth, big-endian, true colour, red/green/blue max, red/green/blue shift.
QEMU_FORMAT = struct.pack(">BBBBHHHBBB3x", 32, 24, 0, 1, 255, 255, 255, 16, 8, 0)
RAW, DESKTOP_SIZE = 0, -223
CUT_TEXT_LIMIT = 1 << 20  # a ClientCutText longer than this ends the connection
TAKEN_OVER = "another client connected to the VNC console"
ACTIVE_SESSION = ("Internal error occurred: Can't connect to websocket (503): websocket: bad handshake: "
                  "application info: Active VNC connection. Request denied.")

# X11 keysyms (RFC 6143 7.5.4) the text console understands, besides printable Latin-1 (0x20-0x7E).
KEYSYMS = {0xFF08: b"\x7f", 0xFF09: b"\t", 0xFF0D: b"\r", 0xFF8D: b"\r", 0xFF1B: b"\x1b"}
CONTROL_KEYS, ALT_KEYS, DELETE_KEYS = {0xFFE3, 0xFFE4}, {0xFFE9, 0xFFEA}, {0xFFFF, 0xFF9F}


class TextScreen:
    """A VGA text console: characters in cells, a cursor, scrolling; `changed` holds the rows drawn since the
    last `take_changes`."""

    def __init__(self) -> None:
        self.cells = [bytearray(b" " * COLS) for _ in range(ROWS)]
        self.row = self.col = 0
        self.changed: set[int] = set(range(ROWS))
        self._escape = b""

    def clear(self) -> None:
        for row in self.cells:
            row[:] = b" " * COLS
        self.row = self.col = 0
        self.changed = set(range(ROWS))

    def write(self, data: bytes) -> None:
        self.changed.add(self.row)  # the cursor moves off this row
        for byte in data:
            if self._escape or byte == 0x1B:  # a terminal escape sequence: skipped (the text console has none)
                self._escape += bytes([byte])
                if _escape_complete(self._escape):
                    self._escape = b""
                continue
            if byte == 0x0D:
                self.col = 0
            elif byte == 0x0A:
                self._line_feed()
            elif byte == 0x08:
                self.col = max(0, self.col - 1)
            elif byte == 0x09:
                self.col = min(COLS - 1, (self.col // 8 + 1) * 8)
            elif byte >= 0x20:
                if self.col >= COLS:
                    self.col = 0
                    self._line_feed()
                self.cells[self.row][self.col] = byte if byte < 0x7F else 0x3F
                self.changed.add(self.row)
                self.col += 1
        self.changed.add(self.row)

    def _line_feed(self) -> None:
        if self.row == ROWS - 1:
            del self.cells[0]
            self.cells.append(bytearray(b" " * COLS))
            self.changed = set(range(ROWS))
        else:
            self.changed.add(self.row)
            self.row += 1

    def text(self) -> str:
        """What the screen reads, one line per row, trailing blanks dropped (for tests)."""
        return "\n".join(row.decode().rstrip() for row in self.cells).rstrip("\n")


def _escape_complete(seq: bytes) -> bool:
    """ESC and one character, or ESC [ parameters and a final byte (0x40 to 0x7E), or too long to be one."""
    if len(seq) > 16:
        return True
    if len(seq) < 2:
        return False
    if seq[1:2] != b"[":
        return True
    return len(seq) > 2 and 0x40 <= seq[-1] <= 0x7E


def render_rows(screen: TextScreen, first: int, last: int, order: tuple[int, int, int]) -> bytes:
    """The pixels of text rows first..last (inclusive), 4 bytes each with red, green and blue at the byte offsets
    `order`, top to bottom."""
    fg, bg = bytearray(4), bytearray(4)
    for colour, pixel in ((FOREGROUND, fg), (BACKGROUND, bg)):
        for value, offset in zip(colour, order, strict=True):
            pixel[offset] = value
    on, off = bytes(fg), bytes(bg)
    patterns = [b"".join(on if bits & (0x80 >> i) else off for i in range(8)) for bits in range(256)]
    out = bytearray()
    for row in range(first, last + 1):
        glyphs = [font.glyph(char) for char in screen.cells[row]]
        cursor = row == screen.row
        for y in range(font.HEIGHT):
            line = [patterns[g[y]] for g in glyphs]
            if cursor and y >= font.HEIGHT - 2 and screen.col < COLS:
                line[screen.col] = on * 8  # the blinking underline, not blinking
            out += b"".join(line)
    return bytes(out)


def _bands(rows: set[int]) -> list[tuple[int, int]]:
    """Runs of consecutive rows: {1, 2, 3, 7} -> [(1, 3), (7, 7)]."""
    bands: list[tuple[int, int]] = []
    for row in sorted(rows):
        if bands and bands[-1][1] == row - 1:
            bands[-1] = (bands[-1][0], row)
        else:
            bands.append((row, row))
    return bands


def pixel_order(fmt: bytes) -> tuple[int, int, int] | None:
    """The byte offsets of red, green and blue in a pixel of the SetPixelFormat `fmt`; None when it is not a
    32-bit true-colour format with 8-bit channels on byte boundaries."""
    bpp, _depth, big_endian, true_colour, rmax, gmax, bmax, rs, gs, bs = struct.unpack(">BBBBHHHBBB3x", fmt)
    if bpp != 32 or not true_colour or (rmax, gmax, bmax) != (255, 255, 255):
        return None
    shifts = (rs, gs, bs)
    if len(set(shifts)) != 3 or any(s % 8 or s > 24 for s in shifts):
        return None
    red, green, blue = (3 - s // 8 if big_endian else s // 8 for s in shifts)
    return red, green, blue


class ScreenClient:
    """One connection to a VMI's screen (a kubesim/server.py StreamPeer): the RFB server side of it.

    `fileno()` reads as ready whenever `take()` may have something new."""

    def __init__(self, name: str, screen: TextScreen, lock: Any, keys: Callable[[bytes], None],
                 reboot: Callable[[], None], detach: Callable[[ScreenClient], None]) -> None:
        self.name = name
        self.reason = ""
        self._screen = screen
        self._lock = lock  # the guest line's: keys and reboot are called with it held
        self._keys = keys
        self._reboot = reboot
        self._detach = detach
        self._in = bytearray()
        self._out = bytearray(VERSION)
        self._state = "version"
        self._minor = 8
        self._order: tuple[int, int, int] = (2, 1, 0)  # QEMU_FORMAT: blue, green, red from the lowest byte
        self._wants: tuple[bool, int, int, int, int] | None = None  # an outstanding FramebufferUpdateRequest
        self._dirty: set[int] = set()
        self._held: set[int] = set()  # modifier keysyms down
        self.ended = ""
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.wake()

    # ---- the line's side (under its lock)

    def damaged(self, rows: set[int]) -> None:
        self._dirty |= rows
        if self._wants is not None:
            self.wake()

    def end(self, reason: str) -> None:
        if not self.ended:
            self.ended = reason
            self.wake()

    # ---- StreamPeer (the WebSocket's thread)

    def fileno(self) -> int:
        return self._wake_r.fileno()

    def take(self) -> bytes | None:
        with self._lock:
            return self.take_locked()

    def feed(self, data: bytes) -> None:
        with self._lock:
            self.feed_locked(data)

    def close(self) -> None:
        with self._lock:
            self._detach(self)
        self._wake_r.close()
        self._wake_w.close()

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # full (it is already awake) or closed (it is gone)
            self._wake_w.send(b"\0")

    def take_locked(self) -> bytes | None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass
        if self.ended:
            self.reason = self.ended
            return None
        if self._state == "messages" and self._wants is not None:
            self._update()
        out, self._out = bytes(self._out), bytearray()
        return out

    def feed_locked(self, data: bytes) -> None:
        if self.ended:
            return
        self._in += data
        try:
            while self._step():
                pass
        except ValueError as exc:
            self.end(str(exc))
        if self._out or self.ended or (self._wants is not None and self._dirty):
            self.wake()

    # ---- the protocol

    def _take(self, size: int) -> bytes | None:
        if len(self._in) < size:
            return None
        data = bytes(self._in[:size])
        del self._in[:size]
        return data

    def _step(self) -> bool:
        """Handle one whole client message if there is one; False when more bytes are needed."""
        if self._state == "version":
            data = self._take(12)
            if data is None:
                return False
            minor = CLIENT_VERSIONS.get(data)
            if minor is None:
                raise ValueError(f"unsupported RFB version {data!r}")
            self._minor = minor
            if minor == 3:
                self._out += struct.pack(">I", SECURITY_NONE)
                self._state = "init"
            else:
                self._out += bytes([1, SECURITY_NONE])
                self._state = "security"
            return True
        if self._state == "security":
            data = self._take(1)
            if data is None:
                return False
            if data[0] != SECURITY_NONE:
                if self._minor == 8:
                    reason = b"unsupported security type"
                    self._out += struct.pack(">II", 1, len(reason)) + reason
                raise ValueError(f"unsupported security type {data[0]}")
            if self._minor == 8:
                self._out += struct.pack(">I", 0)
            self._state = "init"
            return True
        if self._state == "init":
            if self._take(1) is None:  # ClientInit's shared flag: every connection is the only one here
                return False
            name = f"QEMU ({self.name})".encode()
            self._out += struct.pack(">HH", WIDTH, HEIGHT) + QEMU_FORMAT + struct.pack(">I", len(name)) + name
            self._state = "messages"
            return True
        return self._message()

    def _message(self) -> bool:
        if not self._in:
            return False
        kind = self._in[0]
        if kind == 0:  # SetPixelFormat
            data = self._take(20)
            if data is None:
                return False
            order = pixel_order(data[4:20])
            if order is None:
                raise ValueError("unsupported pixel format")
            self._order = order
            self._dirty = set(range(ROWS))
        elif kind == 2:  # SetEncodings (Raw is always used)
            if len(self._in) < 4:
                return False
            count = struct.unpack(">H", self._in[2:4])[0]
            if self._take(4 + 4 * count) is None:
                return False
        elif kind == 3:  # FramebufferUpdateRequest
            data = self._take(10)
            if data is None:
                return False
            incremental, x, y, w, h = struct.unpack(">BHHHH", data[1:])
            self._wants = (bool(incremental), x, y, w, h)
            if not incremental:
                self._dirty = set(range(ROWS))
        elif kind == 4:  # KeyEvent
            data = self._take(8)
            if data is None:
                return False
            down, keysym = data[1], struct.unpack(">I", data[4:8])[0]
            self._key(bool(down), keysym)
        elif kind == 5:  # PointerEvent
            if self._take(6) is None:
                return False
        elif kind == 6:  # ClientCutText
            if len(self._in) < 8:
                return False
            length = struct.unpack(">I", self._in[4:8])[0]
            if length > CUT_TEXT_LIMIT:
                raise ValueError("ClientCutText too long")
            if self._take(8 + length) is None:
                return False
        else:
            raise ValueError(f"unknown client message type {kind}")
        return True

    def _key(self, down: bool, keysym: int) -> None:
        if keysym in CONTROL_KEYS | ALT_KEYS:
            (self._held.add if down else self._held.discard)(keysym)
            return
        if not down:
            return
        control, alt = bool(self._held & CONTROL_KEYS), bool(self._held & ALT_KEYS)
        if keysym in DELETE_KEYS and control and alt:
            self._reboot()
            return
        char = KEYSYMS.get(keysym)
        if char is None and 0x20 <= keysym <= 0x7E:
            char = bytes([keysym])
            if control and 0x40 <= keysym & ~0x20 <= 0x5F:
                char = bytes([keysym & 0x1F])
        if char is not None:
            self._keys(char)

    def _update(self) -> None:
        """Answer the outstanding request with the rows that changed (nothing yet if none did)."""
        if not self._dirty:
            return
        bands = _bands(self._dirty)
        self._out += struct.pack(">BxH", 0, len(bands))
        for first, last in bands:
            y, h = first * font.HEIGHT, (last - first + 1) * font.HEIGHT
            self._out += struct.pack(">HHHHi", 0, y, WIDTH, h, RAW)
            self._out += render_rows(self._screen, first, last, self._order)
        self._dirty.clear()
        self._wants = None
