"""The machine's serial line as its BMC shares it: one connection to the machine, however many viewers.

`ConsoleBridge` keeps one of the machine's lines (its serial port, or its screen: vbmc/machine/screen.py) attached
while it is started. The line ends when the machine's instance does (stopped, or a reset that replaced it); the
bridge then waits for the machine to run again and attaches to the new instance, the way a terminal server's
serial line stays up while the machine behind it reboots.

`SerialHub` is a BMC's serial console: one bridge, shared by every viewer (IPMI SOL, the web page's terminals, any
WebSocket client of the Redfish `SerialConsole.WebSocket.ConsoleURI`), attached while at least one viewer is and
never more than once: one connection to KubeVirt per VMI. Every viewer sees the same output. What any viewer types
goes to the line as it comes, chunk by chunk: two people typing at once interleave their keystrokes on the one
line, as two people at one serial terminal server port would (a physical BMC's shared SOL does the same).

The hub keeps the last `SCROLLBACK` bytes of the line's output, whether or not anyone watches: they outlive the
viewers (the last one leaving detaches from the machine, as before, but what the line showed stays) and the
machine's instances (a reset), so that a viewer who joins is shown them first (the web page, `replay`), however long
after the others left: the boot text, the login prompt, the last command's output. IPMI SOL joins without them
(it starts blank, as ipmitool expects). What the machine prints while no viewer is attached reaches the hub only
if the machine keeps it for the next connection (kubesim does, up to 16 KiB; KubeVirt's console drops it): the
hub attaches only while someone watches, because KubeVirt takes one console connection per VMI and a hub attached
for good would take the line from every `virtctl console`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

from .model import ConsoleUnavailable, Machine, MachineError, PowerState, SerialConsole

log = logging.getLogger("vbmc.console")

RETRY_MIN, RETRY_MAX = 0.25, 5.0  # seconds between attempts to attach while the machine runs but refuses
POWER_POLL = 0.25  # how often a detached bridge reads the (cached) power state
SCROLLBACK = 64 * 1024  # bytes of recent output shown to a viewer that joins
MAX_VIEWERS = 4  # per BMC and line, IPMI SOL not counted (it has its own single payload instance)
# Typed while a line is being opened: the machine's first output (kubesim's kept boot text, a VNC greeting) can
# reach viewers before the open returns, and what they answer must not be lost.
EARLY_INPUT = 4096

Opener = Callable[[Callable[[bytes], None], Callable[[str], None]], SerialConsole]


class TooManyViewers(Exception):
    """The line has as many viewers as it takes."""


def too_many(viewers: int, console: str) -> str:
    """Why a viewer is refused, in words a person can act on (at most 123 bytes: a WebSocket close reason)."""
    return (f"{viewers} viewers already watch {console}, the most it serves: close one (see the sessions view) or "
            "try again later")


class ConsoleBridge:
    """Keeps one of the machine's lines attached while started: `output` gets what comes from the machine and
    `attached(True|False, why)` is told when the line comes and goes (from the bridge's thread); send() writes to
    the line when there is one. `open_line` is the machine's open_console (the default) or open_screen."""

    def __init__(self, machine: Machine, output: Callable[[bytes], None],
                 attached: Callable[[bool, str], None], name: str = "vm", open_line: Opener | None = None,
                 kind: str = "sol") -> None:
        self._machine = machine
        self._open = open_line or machine.open_console
        self._output = output
        self._attached = attached
        self._name = name
        self._kind = kind
        self._stopping = threading.Event()
        self._gone = threading.Event()  # the current line ended
        self._why = ""  # why it ended
        self._line: SerialConsole | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.attachments = 0  # lines attached so far (for the log and tests)
        self._backoff = False  # hang_up() ended the line: wait before attaching again
        self._opening = False  # a line is being opened: send() keeps what comes for it
        self._early = bytearray()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"{self._kind}-{self._name}", daemon=True)
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
        """Write to the line; False when none is attached (the bytes are lost, as on a cut line)."""
        with self._lock:
            line = self._line
            if line is None:
                if self._opening and len(self._early) + len(data) <= EARLY_INPUT:
                    self._early += data
                    return True
                return False
        try:
            line.send(data)
        except ConsoleUnavailable:
            return False
        return True

    def hang_up(self, why: str) -> None:
        """End the current line from this side (its peer broke the protocol): the bridge attaches again after
        RETRY_MAX seconds."""
        with self._lock:
            line = self._line
        if line is not None:
            self._backoff = True
            line.close()
            self._hung_up(why)

    def _run(self) -> None:
        retry = RETRY_MIN
        last_refusal = ""
        while not self._stopping.is_set():
            try:
                running = self._machine.power_state() != PowerState.OFF
            except MachineError:
                running = False
            if not running:
                if last_refusal != "off":
                    last_refusal = "off"
                    self._attached(False, "the machine is off")
                self._stopping.wait(POWER_POLL)
                continue
            self._gone.clear()
            with self._lock:
                self._opening = True
            try:
                line = self._open(self._output, self._hung_up)
            except MachineError as exc:
                with self._lock:
                    self._opening = False
                    self._early.clear()
                if str(exc) != last_refusal:  # once per reason, not once per attempt
                    last_refusal = str(exc)
                    log.info("%s console unavailable vm=%s: %s", self._kind, self._name, exc)
                    self._attached(False, str(exc))
                self._stopping.wait(retry)
                retry = min(retry * 2, RETRY_MAX)
                continue
            with self._lock:
                self._opening = False
                early, self._early = bytes(self._early), bytearray()
                if self._stopping.is_set():
                    line.close()
                    return
                self._line = line
                if early:  # before anything sent from now on (send() takes the lock)
                    with contextlib.suppress(ConsoleUnavailable):
                        line.send(early)
            retry, last_refusal = RETRY_MIN, ""
            self.attachments += 1
            log.info("%s console attached vm=%s", self._kind, self._name)
            self._attached(True, "attached")
            self._gone.wait()
            with self._lock:
                self._line = None
            if not self._stopping.is_set():
                log.info("%s console detached vm=%s: %s", self._kind, self._name, self._why)
                self._attached(False, self._why)
            if self._backoff:
                self._backoff = False
                self._stopping.wait(RETRY_MAX)

    def _hung_up(self, reason: str) -> None:
        self._why = reason
        self._gone.set()


class SerialViewer:
    """One viewer's hold on the shared serial line, until leave()."""

    def __init__(self, hub: SerialHub, output: Callable[[bytes], None],
                 attached: Callable[[bool, str], None], counted: bool) -> None:
        self._hub = hub
        self.output = output
        self.attached = attached
        self.counted = counted  # against the hub's max_viewers

    def send(self, data: bytes) -> bool:
        """Type on the line; False when no line is attached (the bytes are lost)."""
        return self._hub._send(data)

    def leave(self) -> None:
        self._hub._leave(self)


class SerialHub:
    """A BMC's serial console, shared by its viewers (see the module's docstring). Viewer callbacks run on the
    console's threads and must not block."""

    def __init__(self, machine: Machine, name: str = "vm", max_viewers: int = MAX_VIEWERS,
                 scrollback: int = SCROLLBACK) -> None:
        self._machine = machine
        self._name = name
        self.max_viewers = max_viewers
        self._scrollback_limit = scrollback
        self._lock = threading.Lock()
        self._viewers: list[SerialViewer] = []
        self._bridge: ConsoleBridge | None = None
        self._scrollback = bytearray()
        self._state: tuple[bool, str] = (False, "connecting")

    @property
    def viewers(self) -> int:
        with self._lock:
            return len(self._viewers)

    @property
    def bridge(self) -> ConsoleBridge | None:
        return self._bridge

    def join(self, output: Callable[[bytes], None], attached: Callable[[bool, str], None], *,
             replay: bool = False, counted: bool = True) -> SerialViewer:
        """A new viewer: told the line's state at once and, with `replay`, the recent output. Raises
        TooManyViewers past `max_viewers` counted viewers (IPMI SOL joins uncounted)."""
        viewer = SerialViewer(self, output, attached, counted)
        with self._lock:
            if counted and sum(1 for v in self._viewers if v.counted) >= self.max_viewers:
                raise TooManyViewers(too_many(self.max_viewers, "the serial console"))
            self._viewers.append(viewer)
            start = self._bridge is None
            if start:
                self._state = (False, "connecting")
                self._bridge = ConsoleBridge(self._machine, self._output, self._attached, self._name,
                                             self._machine.open_console, kind="serial")
            bridge = self._bridge if start else None
            # Under the lock, so that nothing the line sends from now on can reach the viewer before these.
            attached(*self._state)
            if replay and self._scrollback:
                output(bytes(self._scrollback))
        if bridge is not None:
            bridge.start()
        return viewer

    def stop(self) -> None:
        """Detach from the machine whoever is viewing, and forget the recent output (the BMC stops)."""
        with self._lock:
            bridge, self._bridge = self._bridge, None
            self._viewers.clear()
            self._scrollback.clear()
        if bridge is not None:
            bridge.stop()

    def _leave(self, viewer: SerialViewer) -> None:
        with self._lock:
            if viewer not in self._viewers:
                return
            self._viewers.remove(viewer)
            bridge = self._bridge if not self._viewers else None
            if bridge is not None:
                self._bridge = None
        if bridge is not None:
            bridge.stop()

    def _send(self, data: bytes) -> bool:
        bridge = self._bridge
        return bridge is not None and bridge.send(data)

    def _output(self, data: bytes) -> None:
        with self._lock:
            self._scrollback += data
            if len(self._scrollback) > self._scrollback_limit:
                del self._scrollback[:len(self._scrollback) - self._scrollback_limit]
            viewers = list(self._viewers)
        for viewer in viewers:
            viewer.output(data)

    def _attached(self, available: bool, why: str) -> None:
        with self._lock:
            self._state = (available, why)
            viewers = list(self._viewers)
        for viewer in viewers:
            viewer.attached(available, why)
