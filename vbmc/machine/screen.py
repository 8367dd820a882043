"""The machine's screen as its BMC shares it (KVM over IP): one connection to the machine, however many viewers.

`ScreenHub` keeps the machine's screen attached (a ConsoleBridge over Machine.open_screen: KubeVirt's `vnc`
subresource) while at least one viewer is, and is itself an RFB server to each viewer (vbmc/machine/rfb.py): the
hub keeps the framebuffer, each viewer gets the rectangles that changed at its own pace. KubeVirt takes one VNC
connection per VMI (a new one ends the one before); the BMC asks with `preserveSession`, so it never takes the
screen from someone else's `virtctl vnc`: while one is connected the viewers are told the screen is in use and the
hub attaches again once it is free. Among the BMC's own viewers nobody is cut off: they all see the one screen.

Keyboard and pointer events from every viewer go to the machine as they come: two people typing at once
interleave their keystrokes, and their pointers move the one pointer, as on a physical KVM switch in shared mode.

While the machine is off, being reset to a new instance, or its screen refused, viewers stay connected and see a
black screen (as a KVM shows "no signal"); `attached(False, why)` tells them why, and the screen comes back by
itself when the machine runs again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .console import MAX_VIEWERS, ConsoleBridge, TooManyViewers, too_many
from .model import Machine
from .rfb import Changes, Framebuffer, RfbClient, RfbError, RfbServer

log = logging.getLogger("vbmc.console")


class ScreenViewer:
    """One viewer of the screen: feed() it what the viewer sends (raises RfbError when the viewer breaks the
    protocol: its connection should end), leave() when it goes."""

    def __init__(self, hub: ScreenHub, output: Callable[[bytes], None],
                 attached: Callable[[bool, str], None]) -> None:
        self._hub = hub
        self.attached = attached
        self.ended = ""  # why the hub let this viewer go (it cannot follow the screen); its connection should end
        self.server = RfbServer(hub.framebuffer, hub.name, output, hub._forward)

    def feed(self, data: bytes) -> None:
        self._hub._feed(self, data)

    def leave(self) -> None:
        self._hub._leave(self)


class ScreenHub:
    """A BMC's screen, shared by its viewers (see the module's docstring). Viewer callbacks run on the hub's threads
    and must not block."""

    def __init__(self, machine: Machine, name: str = "vm", max_viewers: int = MAX_VIEWERS) -> None:
        self._machine = machine
        self.name = name
        self.max_viewers = max_viewers
        self._lock = threading.Lock()
        self.framebuffer = Framebuffer()
        self._viewers: list[ScreenViewer] = []
        self._bridge: ConsoleBridge | None = None
        self._client: RfbClient | None = None
        self._upstream_ready = False  # the line is attached: what the client sends goes straight to it
        self._held = bytearray()  # what the client sent before the line was attached
        self._state: tuple[bool, str] = (False, "connecting")

    @property
    def viewers(self) -> int:
        with self._lock:
            return len(self._viewers)

    @property
    def bridge(self) -> ConsoleBridge | None:
        return self._bridge

    def join(self, output: Callable[[bytes], None], attached: Callable[[bool, str], None]) -> ScreenViewer:
        with self._lock:
            if len(self._viewers) >= self.max_viewers:
                raise TooManyViewers(too_many(self.max_viewers, "the screen"))
            viewer = ScreenViewer(self, output, attached)
            self._viewers.append(viewer)
            start = self._bridge is None
            if start:
                self._new_client()
                self._state = (False, "connecting")
                self._bridge = ConsoleBridge(self._machine, self._output, self._attached, self.name,
                                             self._machine.open_screen, kind="screen")
            bridge = self._bridge if start else None
            attached(*self._state)
        if bridge is not None:
            bridge.start()
        return viewer

    def stop(self) -> None:
        with self._lock:
            bridge, self._bridge = self._bridge, None
            self._viewers.clear()
        if bridge is not None:
            bridge.stop()

    # ---- viewers

    def _feed(self, viewer: ScreenViewer, data: bytes) -> None:
        with self._lock:
            if viewer in self._viewers:
                viewer.server.feed(data)

    def _leave(self, viewer: ScreenViewer) -> None:
        with self._lock:
            if viewer not in self._viewers:
                return
            self._viewers.remove(viewer)
            bridge = self._bridge if not self._viewers else None
            if bridge is not None:
                self._bridge = None
                self.framebuffer.blank()  # nobody looks: no copy of the screen kept
        if bridge is not None:
            bridge.stop()

    def _forward(self, event: bytes) -> None:
        """A viewer's KeyEvent or PointerEvent, for the machine (under the lock); dropped while detached."""
        if self._upstream_ready and self._bridge is not None:
            self._bridge.send(event)

    # ---- the machine's side

    def _new_client(self) -> None:
        self._client = RfbClient(self._send_up, self.framebuffer)
        self._upstream_ready = False
        self._held.clear()

    def _send_up(self, data: bytes) -> None:
        """What the hub's RFB client says to the machine (under the lock)."""
        if self._upstream_ready and self._bridge is not None:
            self._bridge.send(data)
        else:
            self._held += data

    def _output(self, data: bytes) -> None:
        with self._lock:
            client, bridge = self._client, self._bridge
            if client is None or bridge is None:
                return
            try:
                changes = client.feed(data)
            except RfbError as exc:
                log.warning("screen of vm=%s: %s", self.name, exc)
                self._client = None  # nothing more from this line; the next one gets a new client
                threading.Thread(target=bridge.hang_up, args=(f"the screen broke the protocol: {exc}",),
                                 daemon=True).start()
                return
            self._show(changes)

    def _show(self, changes: Changes) -> None:
        for viewer in list(self._viewers):
            try:
                if changes.ready or changes.resized:
                    viewer.server.redraw()
                elif changes.rects:
                    viewer.server.damaged(changes.rects)
                if changes.bell:
                    viewer.server.bell()
            except RfbError as exc:  # a viewer that cannot follow a new screen size: it goes
                log.info("screen viewer of vm=%s leaves: %s", self.name, exc)
                self._viewers.remove(viewer)
                viewer.ended = str(exc)
                viewer.attached(False, viewer.ended)

    def _attached(self, available: bool, why: str) -> None:
        with self._lock:
            if available:
                self._upstream_ready = True
                held, self._held = bytes(self._held), bytearray()
                if held and self._bridge is not None:
                    self._bridge.send(held)
            else:
                self._new_client()  # for the next line
                self.framebuffer.blank()
                self._show(Changes(rects=[(0, 0, self.framebuffer.width, self.framebuffer.height)]))
            self._state = (available, why)
            for viewer in list(self._viewers):
                viewer.attached(available, why)
