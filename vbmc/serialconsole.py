"""The serial console behind IPMI SOL: KubeVirt's console subresource over a WebSocket, and the bridge that keeps
it attached while a SOL payload is active.

KubeVirt serves a running VMI's serial port at `subresources.kubevirt.io/v1/.../virtualmachineinstances/{name}/
console` as a WebSocket with the `plain.kubevirt.io` subprotocol: binary frames of raw serial bytes, both ways
(virtctl console speaks the same). The line ends when the VMI does (stopped, or a reset that replaced it); the
bridge then waits for the machine to run again and attaches to the new instance, the way a terminal server's serial
line stays up while the machine behind it reboots.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from .machine import ConsoleUnavailable, Machine, MachineError, PowerState, SerialConsole

log = logging.getLogger("vbmc.console")

SUBPROTOCOL = "plain.kubevirt.io"
RETRY_MIN, RETRY_MAX = 0.25, 5.0  # seconds between attempts to attach while the machine runs but refuses
POWER_POLL = 0.25  # how often a detached bridge reads the (cached) power state
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


class ConsoleBridge:
    """Keeps the machine's serial console attached while started: `output` gets the machine's characters and
    `attached(True|False, why)` is told when the line comes and goes (from the bridge's thread); send() writes to
    the line when there is one."""

    def __init__(self, machine: Machine, output: Callable[[bytes], None],
                 attached: Callable[[bool, str], None], name: str = "vm") -> None:
        self._machine = machine
        self._output = output
        self._attached = attached
        self._name = name
        self._stopping = threading.Event()
        self._gone = threading.Event()  # the current line ended
        self._why = ""  # why it ended
        self._line: SerialConsole | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.attachments = 0  # lines attached so far (for the log and tests)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"sol-{self._name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Detach and end the thread (returns without waiting for an attempt in flight to time out)."""
        self._stopping.set()
        self._gone.set()
        with self._lock:
            line, self._line = self._line, None
        if line is not None:
            line.close()

    def send(self, data: bytes) -> bool:
        """Write to the serial line; False when none is attached (the characters are lost, as on a cut line)."""
        line = self._line
        if line is None:
            return False
        try:
            line.send(data)
        except ConsoleUnavailable:
            return False
        return True

    def _run(self) -> None:
        retry = RETRY_MIN
        last_refusal = ""
        while not self._stopping.is_set():
            try:
                running = self._machine.power_state() != PowerState.OFF
            except MachineError:
                running = False
            if not running:
                self._stopping.wait(POWER_POLL)
                continue
            self._gone.clear()
            try:
                line = self._machine.open_console(self._output, self._hung_up)
            except MachineError as exc:
                if str(exc) != last_refusal:  # once per reason, not once per attempt
                    last_refusal = str(exc)
                    log.info("sol console unavailable vm=%s: %s", self._name, exc)
                    self._attached(False, str(exc))
                self._stopping.wait(retry)
                retry = min(retry * 2, RETRY_MAX)
                continue
            with self._lock:
                if self._stopping.is_set():
                    line.close()
                    return
                self._line = line
            retry, last_refusal = RETRY_MIN, ""
            self.attachments += 1
            log.info("sol console attached vm=%s", self._name)
            self._attached(True, "attached")
            self._gone.wait()
            with self._lock:
                self._line = None
            if not self._stopping.is_set():
                log.info("sol console detached vm=%s: %s", self._name, self._why)
                self._attached(False, self._why)

    def _hung_up(self, reason: str) -> None:
        self._why = reason
        self._gone.set()
