"""KubeVirt's serial console: the console subresource of a running VMI over a WebSocket.

KubeVirt serves a running VMI's serial port at `subresources.kubevirt.io/v1/.../virtualmachineinstances/{name}/
console` as a WebSocket with the `plain.kubevirt.io` subprotocol: binary frames of raw serial bytes, both ways
(virtctl console speaks the same). The line ends when the VMI does (stopped, or a reset that replaced it).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from ..model import ConsoleUnavailable

log = logging.getLogger("vbmc.console")

SUBPROTOCOL = "plain.kubevirt.io"
OUTBOX = 256  # typed chunks waiting for the WebSocket; beyond it they are refused (and lost)


class WebSocketConsole:
    """A serial line over a connected websocket-client WebSocket: a daemon thread reads frames into `output` and
    calls `closed` once when the server ends the line; another writes what send() queues, so that a caller (the
    IPMI server's one thread) never waits on the API server's connection."""

    def __init__(self, ws: Any, output: Callable[[bytes], None], closed: Callable[[str], None], name: str) -> None:
        self._ws = ws
        self._output = output
        self._closed = closed
        self._hung_up = threading.Event()  # close() was called: no callback
        self._outbox: queue.Queue[bytes | None] = queue.Queue(maxsize=OUTBOX)
        ws.settimeout(None)
        self._thread = threading.Thread(target=self._read, name=f"console-{name}", daemon=True)
        self._thread.start()
        threading.Thread(target=self._write, name=f"console-{name}-w", daemon=True).start()

    def _read(self) -> None:
        import websocket

        reason = "the serial console closed"
        try:
            while True:
                opcode, data = self._ws.recv_data()
                if opcode == websocket.ABNF.OPCODE_CLOSE:
                    break
                if opcode in (websocket.ABNF.OPCODE_BINARY, websocket.ABNF.OPCODE_TEXT) and data:
                    self._output(bytes(data))
        except Exception as exc:  # a reset connection, a closed socket: the line is gone either way
            if not self._hung_up.is_set():
                reason = f"the serial console connection ended: {exc or type(exc).__name__}"
        finally:
            self._shutdown()
            with contextlib.suppress(queue.Full):
                self._outbox.put_nowait(None)  # ends the writer
            if not self._hung_up.is_set():
                self._closed(reason)

    def _write(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self._ws.send_binary(data)
            except Exception:  # the reader sees the connection end too, and reports it
                self._shutdown()
                return

    def send(self, data: bytes) -> None:
        if self._hung_up.is_set():
            raise ConsoleUnavailable("the serial console was closed")
        try:
            self._outbox.put_nowait(data)
        except queue.Full:  # the API server's connection does not take what is typed: lost, as on a stalled line
            raise ConsoleUnavailable("the serial console connection is not keeping up") from None

    def close(self) -> None:
        self._hung_up.set()
        with contextlib.suppress(queue.Full):
            self._outbox.put_nowait(None)
        self._shutdown()

    def _shutdown(self) -> None:
        with contextlib.suppress(Exception):  # already closed
            self._ws.shutdown()
