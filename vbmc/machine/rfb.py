"""RFB 3.8 (RFC 6143, the VNC protocol), the two halves the BMC's screen needs, as pure state machines over bytes.

- `RfbClient`: the BMC's side of the machine's screen (KubeVirt's `vnc` subresource: QEMU's VNC server). It keeps
  a copy of the framebuffer, in one pixel format (`FORMAT`), from Raw and CopyRect rectangles, and follows
  DesktopSize changes; after each update it asks for the next (incremental) one.
- `RfbServer`: the RFB server the BMC is to each viewer (the web page's noVNC, any VNC client over the WebSocket),
  drawing from that framebuffer: it answers each FramebufferUpdateRequest with the rectangles that changed since
  the viewer's last update, and hands the viewer's keyboard and pointer events on, unchanged.

So one connection to the machine serves every viewer of the BMC (KubeVirt takes one VNC connection per VMI), each
viewer at its own pace: a slow one simply asks less often. Security type None on both sides: QEMU's VNC in
KubeVirt has no password (the API server's authorization is the gate), and a viewer was authenticated by its
Redfish session before its first RFB byte.

Pixel formats. The copy is kept as noVNC asks for it (32 bits per pixel, depth 24, true colour, bytes R, G, B, X);
a viewer may ask for any 32-bit true-colour format whose channels are whole bytes (most VNC clients' default is
one), served by permuting bytes; any other format is refused (RfbError: the viewer's connection ends), as is a
message type this server does not know.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

VERSION = b"RFB 003.008\n"
SECURITY_NONE = 1
RAW, COPYRECT, DESKTOP_SIZE = 0, 1, -223
MAX_SIZE = 8192  # pixels, either way: a larger screen is refused (a hostile server must not make us allocate GBs)
CUT_TEXT_LIMIT = 1 << 20
NAME_LIMIT = 4096
MAX_DIRTY = 32  # rectangles a viewer owes before they are merged into one that covers them all

Rect = tuple[int, int, int, int]  # x, y, width, height


class RfbError(Exception):
    """The other side broke the protocol, or asked for what is not served; the connection ends."""


@dataclass(frozen=True)
class PixelFormat:
    bits_per_pixel: int
    depth: int
    big_endian: bool
    true_colour: bool
    red_max: int
    green_max: int
    blue_max: int
    red_shift: int
    green_shift: int
    blue_shift: int

    def pack(self) -> bytes:
        return struct.pack(">BBBBHHHBBB3x", self.bits_per_pixel, self.depth, self.big_endian, self.true_colour,
                           self.red_max, self.green_max, self.blue_max, self.red_shift, self.green_shift,
                           self.blue_shift)

    @classmethod
    def unpack(cls, data: bytes) -> PixelFormat:
        bpp, depth, big, true, rmax, gmax, bmax, rs, gs, bs = struct.unpack(">BBBBHHHBBB3x", data)
        return cls(bpp, depth, bool(big), bool(true), rmax, gmax, bmax, rs, gs, bs)

    def byte_order(self) -> tuple[int, int, int] | None:
        """Where red, green and blue sit in a pixel's 4 bytes; None unless 32-bit true colour with whole-byte
        channels."""
        if self.bits_per_pixel != 32 or not self.true_colour or \
                (self.red_max, self.green_max, self.blue_max) != (255, 255, 255):
            return None
        shifts = (self.red_shift, self.green_shift, self.blue_shift)
        if len(set(shifts)) != 3 or any(s % 8 or s > 24 for s in shifts):
            return None
        red, green, blue = (3 - s // 8 if self.big_endian else s // 8 for s in shifts)
        return red, green, blue


FORMAT = PixelFormat(32, 24, False, True, 255, 255, 255, 0, 8, 16)
FORMAT_ORDER = (0, 1, 2)


def convert(pixels: bytes, order: tuple[int, int, int]) -> bytes:
    """Pixels in FORMAT rearranged so that red, green and blue sit at the byte offsets `order`."""
    if order == FORMAT_ORDER:
        return pixels
    out = bytearray(len(pixels))
    for channel, offset in enumerate(order):
        out[offset::4] = pixels[channel::4]
    return bytes(out)


def merge(rects: list[Rect]) -> Rect:
    """The smallest rectangle that covers all of `rects`."""
    left = min(r[0] for r in rects)
    top = min(r[1] for r in rects)
    right = max(r[0] + r[2] for r in rects)
    bottom = max(r[1] + r[3] for r in rects)
    return left, top, right - left, bottom - top


def clip(rect: Rect, width: int, height: int) -> Rect | None:
    x, y, w, h = rect
    right, bottom = min(x + w, width), min(y + h, height)
    if x >= right or y >= bottom:
        return None
    return x, y, right - x, bottom - y


class _Bytes:
    """Received bytes waiting to make whole messages."""

    def __init__(self) -> None:
        self.data = bytearray()

    def __len__(self) -> int:
        return len(self.data)

    def peek(self, size: int) -> bytes | None:
        return bytes(self.data[:size]) if len(self.data) >= size else None

    def take(self, size: int) -> bytes | None:
        if len(self.data) < size:
            return None
        out = bytes(self.data[:size])
        del self.data[:size]
        return out


class Framebuffer:
    """The screen's pixels, in FORMAT, row after row; held only while drawn on (a pooled agent's hundred idle BMCs
    hold none: a 720x400 screen is 1.1 MB)."""

    def __init__(self, width: int = 720, height: int = 400) -> None:
        self.width, self.height = width, height
        self._pixels: bytearray | None = None

    @property
    def pixels(self) -> bytearray:
        if self._pixels is None:
            self._pixels = bytearray(self.width * self.height * 4)
        return self._pixels

    def resize(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self._pixels = None

    def blank(self) -> None:
        """Black (its memory given back until it is drawn on again)."""
        self._pixels = None

    def put(self, rect: Rect, data: bytes) -> None:
        x, y, w, h = rect
        for row in range(h):
            start = ((y + row) * self.width + x) * 4
            self.pixels[start:start + w * 4] = data[row * w * 4:(row + 1) * w * 4]

    def get(self, rect: Rect) -> bytes:
        x, y, w, h = rect
        if x == 0 and w == self.width:
            return bytes(self.pixels[y * w * 4:(y + h) * w * 4])
        return b"".join(bytes(self.pixels[((y + row) * self.width + x) * 4:((y + row) * self.width + x + w) * 4])
                        for row in range(h))


# ---------------------------------------------------------------- the BMC as the machine's client


@dataclass
class Changes:
    """What one batch of the machine's bytes did to the framebuffer."""

    ready: bool = False  # the handshake completed: the framebuffer has its size (a new one)
    resized: bool = False
    rects: list[Rect] | None = None
    bell: bool = False


class RfbClient:
    """The BMC's RFB client of the machine's screen. `send` writes to the machine; feed() takes what it sent."""

    def __init__(self, send: Callable[[bytes], None], framebuffer: Framebuffer) -> None:
        self._send = send
        self.fb = framebuffer
        self._in = _Bytes()
        self._state = "version"
        self._minor = 8
        self.name = ""
        self._rects_left = 0  # of the FramebufferUpdate being read

    def feed(self, data: bytes) -> Changes:
        self._in.data += data
        changes = Changes()
        while self._step(changes):
            pass
        return changes

    def _step(self, changes: Changes) -> bool:
        state = self._state
        if state == "version":
            data = self._in.take(12)
            if data is None:
                return False
            if not data.startswith(b"RFB 003.") or data[11:] != b"\n" or not data[8:11].isdigit():
                raise RfbError(f"not an RFB server: {data!r}")
            minor = int(data[8:11])
            if minor < 7:
                raise RfbError(f"RFB 3.{minor} is too old (3.7 or later)")
            self._minor = 8 if minor >= 8 else 7
            self._send(VERSION if minor >= 8 else b"RFB 003.007\n")
            self._state = "security"
            return True
        if state == "security":
            head = self._in.peek(1)
            if head is None:
                return False
            if head[0] == 0:
                reason = self._reason(1)
                if reason is None:
                    return False
                raise RfbError(f"the screen refused the connection: {reason}")
            types = self._in.take(1 + head[0])
            if types is None:
                return False
            if SECURITY_NONE not in types[1:]:
                raise RfbError(f"the screen wants authentication (security types {list(types[1:])})")
            self._send(bytes([SECURITY_NONE]))
            if self._minor == 8:
                self._state = "result"
            else:
                self._send(b"\x01")  # ClientInit: shared, so that another client does not end ours
                self._state = "init"
            return True
        if state == "result":
            head = self._in.peek(4)
            if head is None:
                return False
            if struct.unpack(">I", head)[0] != 0:
                reason = self._reason(4)
                if reason is None:
                    return False
                raise RfbError(f"the screen refused the connection: {reason}")
            self._in.take(4)
            self._send(b"\x01")
            self._state = "init"
            return True
        if state == "init":
            head = self._in.peek(24)
            if head is None:
                return False
            width, height = struct.unpack(">HH", head[:4])
            length = struct.unpack(">I", head[20:24])[0]
            if length > NAME_LIMIT:
                raise RfbError("the desktop name is too long")
            data = self._in.take(24 + length)
            if data is None:
                return False
            self._check_size(width, height)
            self.name = data[24:].decode("utf-8", "replace")
            self.fb.resize(width, height)
            self._send(struct.pack(">B3x", 0) + FORMAT.pack())
            encodings = (RAW, COPYRECT, DESKTOP_SIZE)
            self._send(struct.pack(">BxH", 2, len(encodings)) + b"".join(struct.pack(">i", e) for e in encodings))
            self._request(incremental=False)
            self._state = "messages"
            changes.ready = True
            return True
        if self._rects_left:
            return self._rect(changes)
        return self._message(changes)

    def _reason(self, offset: int) -> str | None:
        head = self._in.peek(offset + 4)
        if head is None:
            return None
        length = min(struct.unpack(">I", head[offset:])[0], NAME_LIMIT)
        data = self._in.peek(offset + 4 + length)
        return None if data is None else data[offset + 4:].decode("utf-8", "replace")

    @staticmethod
    def _check_size(width: int, height: int) -> None:
        if not (0 < width <= MAX_SIZE and 0 < height <= MAX_SIZE):
            raise RfbError(f"a screen of {width}x{height} is not served")

    def _request(self, incremental: bool) -> None:
        self._send(struct.pack(">BBHHHH", 3, int(incremental), 0, 0, self.fb.width, self.fb.height))

    def _message(self, changes: Changes) -> bool:
        head = self._in.peek(1)
        if head is None:
            return False
        kind = head[0]
        if kind == 0:  # FramebufferUpdate
            data = self._in.take(4)
            if data is None:
                return False
            self._rects_left = struct.unpack(">H", data[2:4])[0]
            if not self._rects_left:
                self._request(incremental=True)
            return True
        if kind == 1:  # SetColourMapEntries: not used with a true-colour format; skipped
            data = self._in.peek(6)
            return data is not None and self._in.take(6 + 6 * struct.unpack(">H", data[4:6])[0]) is not None
        if kind == 2:  # Bell
            self._in.take(1)
            changes.bell = True
            return True
        if kind == 3:  # ServerCutText
            data = self._in.peek(8)
            if data is None:
                return False
            length = struct.unpack(">I", data[4:8])[0]
            if length > CUT_TEXT_LIMIT:
                raise RfbError("ServerCutText too long")
            return self._in.take(8 + length) is not None
        raise RfbError(f"unknown server message type {kind}")

    def _rect(self, changes: Changes) -> bool:
        head = self._in.peek(12)
        if head is None:
            return False
        x, y, w, h, encoding = struct.unpack(">HHHHi", head)
        if encoding == DESKTOP_SIZE:
            self._check_size(w, h)
            self._in.take(12)
            self.fb.resize(w, h)
            changes.resized = True
            changes.rects = [(0, 0, w, h)]
        else:
            if clip((x, y, w, h), self.fb.width, self.fb.height) != (x, y, w, h) and w and h:
                raise RfbError(f"a rectangle {w}x{h}+{x}+{y} outside the {self.fb.width}x{self.fb.height} screen")
            if encoding == RAW:
                data = self._in.take(12 + w * h * 4)
                if data is None:
                    return False
                self.fb.put((x, y, w, h), data[12:])
            elif encoding == COPYRECT:
                data = self._in.take(16)
                if data is None:
                    return False
                sx, sy = struct.unpack(">HH", data[12:16])
                if clip((sx, sy, w, h), self.fb.width, self.fb.height) != (sx, sy, w, h) and w and h:
                    raise RfbError("a CopyRect source outside the screen")
                self.fb.put((x, y, w, h), self.fb.get((sx, sy, w, h)))
            else:
                raise RfbError(f"an encoding not asked for: {encoding}")
            if w and h:
                changes.rects = (changes.rects or []) + [(x, y, w, h)]
        self._rects_left -= 1
        if not self._rects_left:
            self._request(incremental=True)
        return True


# ---------------------------------------------------------------- the BMC as a viewer's server


class RfbServer:
    """The RFB server one viewer talks to. `send` writes to the viewer, `forward` hands its key and pointer events
    to the machine; feed() takes what the viewer sent (raises RfbError when it breaks the protocol)."""

    def __init__(self, framebuffer: Framebuffer, name: str, send: Callable[[bytes], None],
                 forward: Callable[[bytes], None]) -> None:
        self.fb = framebuffer
        self.name = name
        self._send = send
        self._forward = forward
        self._in = _Bytes()
        self._state = "version"
        self._minor = 8
        self._order = FORMAT_ORDER
        self._desktop_size = False  # the viewer takes DesktopSize
        self._wants: tuple[bool, Rect] | None = None  # its outstanding FramebufferUpdateRequest
        self._dirty: list[Rect] = []
        self._size: tuple[int, int] = (framebuffer.width, framebuffer.height)  # the size this viewer knows
        self.ready = False  # past ServerInit
        send(VERSION)

    # ---- what the machine's screen did

    def damaged(self, rects: list[Rect]) -> None:
        self._dirty.extend(rects)
        if len(self._dirty) > MAX_DIRTY:
            self._dirty = [merge(self._dirty)]
        self._answer()

    def redraw(self) -> None:
        """Everything changed (a new size, or a blank screen)."""
        self._dirty = [(0, 0, self.fb.width, self.fb.height)]
        self._answer()

    # ---- what the viewer sent

    def feed(self, data: bytes) -> None:
        self._in.data += data
        while self._step():
            pass

    def _step(self) -> bool:
        if self._state == "version":
            data = self._in.take(12)
            if data is None:
                return False
            versions = {b"RFB 003.003\n": 3, b"RFB 003.007\n": 7, b"RFB 003.008\n": 8}
            if data not in versions:
                raise RfbError(f"unsupported RFB version {data!r}")
            self._minor = versions[data]
            if self._minor == 3:
                self._send(struct.pack(">I", SECURITY_NONE))
                self._state = "init"
            else:
                self._send(bytes([1, SECURITY_NONE]))
                self._state = "security"
            return True
        if self._state == "security":
            data = self._in.take(1)
            if data is None:
                return False
            if data[0] != SECURITY_NONE:
                raise RfbError(f"unsupported security type {data[0]}")
            if self._minor == 8:
                self._send(struct.pack(">I", 0))
            self._state = "init"
            return True
        if self._state == "init":
            if self._in.take(1) is None:  # ClientInit: every viewer shares the screen
                return False
            name = self.name.encode()
            self._size = (self.fb.width, self.fb.height)
            self._send(struct.pack(">HH", *self._size) + FORMAT.pack() + struct.pack(">I", len(name)) + name)
            self._state = "messages"
            self.ready = True
            return True
        return self._message()

    def _message(self) -> bool:
        head = self._in.peek(1)
        if head is None:
            return False
        kind = head[0]
        if kind == 0:  # SetPixelFormat
            data = self._in.take(20)
            if data is None:
                return False
            order = PixelFormat.unpack(data[4:20]).byte_order()
            if order is None:
                raise RfbError("only 32-bit true-colour pixel formats with whole-byte channels are served")
            self._order = order
        elif kind == 2:  # SetEncodings
            head = self._in.peek(4)
            if head is None:
                return False
            count = struct.unpack(">H", head[2:4])[0]
            data = self._in.take(4 + 4 * count)
            if data is None:
                return False
            encodings = struct.unpack(f">{count}i", data[4:])
            self._desktop_size = DESKTOP_SIZE in encodings
        elif kind == 3:  # FramebufferUpdateRequest
            data = self._in.take(10)
            if data is None:
                return False
            incremental, x, y, w, h = struct.unpack(">BHHHH", data[1:])
            if not incremental:
                self._dirty.append((x, y, w, h))
            self._wants = (bool(incremental), (x, y, w, h))
            self._answer()
        elif kind == 4:  # KeyEvent
            data = self._in.take(8)
            if data is None:
                return False
            self._forward(data)
        elif kind == 5:  # PointerEvent
            data = self._in.take(6)
            if data is None:
                return False
            self._forward(data)
        elif kind == 6:  # ClientCutText: the clipboard stays with the viewer
            head = self._in.peek(8)
            if head is None:
                return False
            length = struct.unpack(">I", head[4:8])[0]
            if length > CUT_TEXT_LIMIT:
                raise RfbError("ClientCutText too long")
            return self._in.take(8 + length) is not None
        else:
            raise RfbError(f"unknown client message type {kind}")
        return True

    def _answer(self) -> None:
        """Answer the outstanding request if there is something to send."""
        if self._wants is None or self._state != "messages":
            return
        resized = self._size != (self.fb.width, self.fb.height)
        if resized and not self._desktop_size:
            raise RfbError("the screen changed size and this viewer does not take DesktopSize")
        rects = [r for r in (clip(d, self.fb.width, self.fb.height) for d in self._dirty) if r is not None]
        if not rects and not resized:
            return
        out = bytearray()
        count = len(rects) + int(resized)
        out += struct.pack(">BxH", 0, count)
        if resized:
            self._size = (self.fb.width, self.fb.height)
            out += struct.pack(">HHHHi", 0, 0, *self._size, DESKTOP_SIZE)
        for rect in rects:
            out += struct.pack(">HHHHi", *rect, RAW)
            out += convert(self.fb.get(rect), self._order)
        self._dirty = []
        self._wants = None
        self._send(bytes(out))

    def bell(self) -> None:
        if self._state == "messages":
            self._send(b"\x02")
