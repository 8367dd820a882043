"""The serial console bridge behind IPMI SOL: it keeps the machine's serial line attached while a SOL payload is
active. The line ends when the machine's instance does (stopped, or a reset that replaced it); the bridge then
waits for the machine to run again and attaches to the new instance, the way a terminal server's serial line stays
up while the machine behind it reboots.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .model import ConsoleUnavailable, Machine, MachineError, PowerState, SerialConsole

log = logging.getLogger("vbmc.console")

RETRY_MIN, RETRY_MAX = 0.25, 5.0  # seconds between attempts to attach while the machine runs but refuses
POWER_POLL = 0.25  # how often a detached bridge reads the (cached) power state


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
