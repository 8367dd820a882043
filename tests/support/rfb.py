"""A small RFB 3.8 client for the tests (RFC 6143), written from the RFC and apart from the agent's own
(vbmc/machine/rfb.py), over any byte channel: it reads the framebuffer and reads text off it with kubesim's font."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable

import websocket

from kubesim import font

# The pixel format noVNC asks for (core/rfb.js _sendSetPixelFormat): 32 bpp, depth 24, little-endian, true colour,
# red at bit 0, green at 8, blue at 16: bytes R, G, B, X in memory.
NOVNC_FORMAT = struct.pack(">BBBBHHHBBB3x", 32, 24, 0, 1, 255, 255, 255, 0, 8, 16)
RAW, COPYRECT, DESKTOP_SIZE = 0, 1, -223


class RfbClient:
    """`receive(timeout)` returns the next bytes of the channel (b"" when nothing came in time), `send` writes."""

    def __init__(self, receive: Callable[[float], bytes], send: Callable[[bytes], None]) -> None:
        self._receive = receive
        self._send = send
        self._buffer = bytearray()
        self.width = self.height = 0
        self.name = ""
        self.server_format = b""
        self.pixels = bytearray()
        self.updates = 0
        self.bells = 0

    def _read(self, size: int, timeout: float = 5.0) -> bytes:
        deadline = time.monotonic() + timeout
        while len(self._buffer) < size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"wanted {size} bytes, have {len(self._buffer)}")
            self._buffer += self._receive(left)
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    def handshake(self, encodings: tuple[int, ...] = (RAW, DESKTOP_SIZE)) -> None:
        version = self._read(12)
        assert version == b"RFB 003.008\n", version
        self._send(version)
        count = self._read(1)[0]
        assert count > 0, self._read(struct.unpack(">I", self._read(4))[0])
        types = self._read(count)
        assert 1 in types, types
        self._send(b"\x01")
        result = struct.unpack(">I", self._read(4))[0]
        assert result == 0, result
        self._send(b"\x01")  # ClientInit: shared
        self.width, self.height = struct.unpack(">HH", self._read(4))
        self.server_format = self._read(16)
        self.name = self._read(struct.unpack(">I", self._read(4))[0]).decode()
        self._send(struct.pack(">B3x", 0) + NOVNC_FORMAT)
        self._send(struct.pack(">BxH", 2, len(encodings)) + b"".join(struct.pack(">i", e) for e in encodings))
        self.pixels = bytearray(self.width * self.height * 4)

    def request(self, incremental: bool = True) -> None:
        self._send(struct.pack(">BBHHHH", 3, int(incremental), 0, 0, self.width, self.height))

    def key(self, keysym: int, down: bool | None = None) -> None:
        for state in ((True, False) if down is None else (down,)):
            self._send(struct.pack(">BBxxI", 4, int(state), keysym))

    def type(self, text: str) -> None:
        for char in text:
            self.key(0xFF0D if char in "\r\n" else ord(char))

    def read_update(self, timeout: float = 5.0) -> int:
        """Read server messages until a FramebufferUpdate has been applied; the number of rectangles in it."""
        while True:
            kind = self._read(1, timeout)[0]
            if kind == 0:
                break
            if kind == 2:
                self.bells += 1
            elif kind == 3:
                self._read(3)
                self._read(struct.unpack(">I", self._read(4))[0])
            else:
                raise AssertionError(f"unexpected server message {kind}")
        self._read(1)
        count = struct.unpack(">H", self._read(2))[0]
        for _ in range(count):
            x, y, w, h, encoding = struct.unpack(">HHHHi", self._read(12))
            if encoding == DESKTOP_SIZE:
                self.width, self.height = w, h
                self.pixels = bytearray(w * h * 4)
                continue
            if encoding == COPYRECT:
                sx, sy = struct.unpack(">HH", self._read(4))
                rows = [bytes(self.pixels[((sy + r) * self.width + sx) * 4:((sy + r) * self.width + sx + w) * 4])
                        for r in range(h)]
            else:
                assert encoding == RAW, encoding
                data = self._read(w * h * 4, timeout)
                rows = [data[r * w * 4:(r + 1) * w * 4] for r in range(h)]
            for r, row in enumerate(rows):
                start = ((y + r) * self.width + x) * 4
                self.pixels[start:start + w * 4] = row
        self.updates += 1
        return count

    def refresh(self, timeout: float = 5.0) -> None:
        """The whole screen, now."""
        self.request(incremental=False)
        self.read_update(timeout)

    def lit(self) -> int:
        """How many pixels are not black."""
        return sum(1 for i in range(0, len(self.pixels), 4) if self.pixels[i:i + 3] != b"\0\0\0")

    def text(self) -> str:
        """The screen read as kubesim's text console (see screen_text)."""
        return screen_text(bytes(self.pixels), self.width, self.height)


def screen_text(pixels: bytes, width: int, height: int) -> str:
    """Pixels (4 bytes each, red, green and blue first, as here and in a canvas's ImageData) read as kubesim's text
    console: each 8x16 cell matched against its font (lit pixels are the glyph's), "?" for a cell that matches no
    glyph, " " for the cursor."""
    glyphs = {font.glyph(c): chr(c) for c in range(font.FIRST, font.LAST + 1)}
    lines = []
    for top in range(0, height - font.HEIGHT + 1, font.HEIGHT):
        chars = []
        for left in range(0, width - font.WIDTH + 1, font.WIDTH):
            rows = []
            for y in range(top, top + font.HEIGHT):
                bits = 0
                for x in range(left, left + font.WIDTH):
                    i = (y * width + x) * 4
                    bits = bits << 1 | (pixels[i:i + 3] != b"\0\0\0")
                rows.append(bits)
            cursor = rows[:-2] == [0] * (font.HEIGHT - 2) and rows[-2:] == [0xFF, 0xFF]
            chars.append(" " if cursor else glyphs.get(bytes(rows), "?"))
        lines.append("".join(chars).rstrip())
    return "\n".join(lines).rstrip("\n")


def rfb_over(ws: websocket.WebSocket) -> RfbClient:
    """An RFB client over a WebSocket whose binary messages carry RFB (kubesim's `vnc`, the agent's screen)."""

    def receive(timeout: float) -> bytes:
        ws.settimeout(timeout)
        try:
            opcode, data = ws.recv_data()
        except websocket.WebSocketTimeoutException:
            return b""
        # The agent's screen also sends text messages about the connection (vbmc/web/consoles.py): not RFB
        return bytes(data) if opcode == websocket.ABNF.OPCODE_BINARY else b""

    def send(data: bytes) -> None:
        ws.send_binary(data)

    return RfbClient(receive, send)
