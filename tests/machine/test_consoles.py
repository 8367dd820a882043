"""A BMC's consoles, shared: the serial hub (one line, every viewer) and the screen hub (one VNC connection,
an RFB server to every viewer), over MemoryMachine and over KubeVirtMachine on kubesim."""

from __future__ import annotations

import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import websocket
from kubernetes import client

from vbmc.machine import PowerState, ResetType
from vbmc.machine.console import SerialHub, TooManyViewers
from vbmc.machine.kubevirt.client import KubeClient, load_credentials
from vbmc.machine.kubevirt.machine import KubeVirtMachine
from vbmc.machine.memory import MemoryMachine
from vbmc.machine.rfb import (
    FORMAT,
    Framebuffer,
    PixelFormat,
    RfbClient,
    RfbError,
    RfbServer,
    convert,
    merge,
)
from vbmc.machine.screen import ScreenHub

from ..sim.test_screen import connect as vnc_connect
from ..sim.test_screen import endpoint, rfb_over
from ..support import rfb as test_rfb
from ..support.cluster import Sim, call, wait_for
from ..support.vms import make_bmc, make_vm, running_vmi_uid


class Seen:
    """What one viewer was given: output bytes and attach states."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.states: list[tuple[bool, str]] = []
        self.lock = threading.Lock()

    def output(self, data: bytes) -> None:
        with self.lock:
            self.out += data

    def attached(self, available: bool, why: str) -> None:
        self.states.append((available, why))

    def text(self) -> bytes:
        with self.lock:
            return bytes(self.out)


# ---------------------------------------------------------------- the serial hub, in memory


@pytest.fixture
def memory() -> MemoryMachine:
    machine = MemoryMachine()
    machine.reset(ResetType.ON)
    return machine


def test_viewers_share_one_line_and_what_each_types_reaches_it(memory: MemoryMachine) -> None:
    hub = SerialHub(memory, "vm")
    a, b = Seen(), Seen()
    va = hub.join(a.output, a.attached)
    vb = hub.join(b.output, b.attached)
    wait_for(lambda: b.states and b.states[-1][0], what="the line attached")
    assert hub.bridge is not None and hub.bridge.attachments == 1

    assert memory.write_console(b"boot text\r\n")
    assert a.text() == b.text() == b"boot text\r\n"
    assert va.send(b"from a") and vb.send(b"from b")
    assert bytes(memory.console_input) == b"from afrom b"

    va.leave()
    assert memory.write_console(b"more")
    assert b.text().endswith(b"more") and not a.text().endswith(b"more")
    vb.leave()
    assert not memory.write_console(b"nobody")  # the last viewer gone: the line is detached


def test_a_late_viewer_gets_the_recent_output_and_the_cap_holds(memory: MemoryMachine) -> None:
    hub = SerialHub(memory, "vm", max_viewers=2, scrollback=8)
    first = Seen()
    hub.join(first.output, first.attached)
    wait_for(lambda: first.states and first.states[-1][0], what="the line attached")
    memory.write_console(b"0123456789")

    late = Seen()
    hub.join(late.output, late.attached, replay=True)
    assert late.text() == b"23456789"  # the last 8 bytes
    assert late.states == [(True, "attached")]
    with pytest.raises(TooManyViewers):
        hub.join(Seen().output, Seen().attached)
    sol = Seen()
    hub.join(sol.output, sol.attached, counted=False)  # IPMI SOL is not counted
    hub.stop()


def test_viewers_are_told_the_machine_is_off_and_the_line_comes_back(memory: MemoryMachine) -> None:
    memory.reset(ResetType.FORCE_OFF)
    hub = SerialHub(memory, "vm")
    seen = Seen()
    viewer = hub.join(seen.output, seen.attached)
    wait_for(lambda: (False, "the machine is off") in seen.states, what="the off state")
    memory.reset(ResetType.ON)
    wait_for(lambda: seen.states[-1] == (True, "attached"), what="the line attached")
    memory.reset(ResetType.FORCE_RESTART)
    wait_for(lambda: seen.states[-1] == (True, "attached") and hub.bridge is not None
             and hub.bridge.attachments == 2, what="the line of the new boot")
    viewer.leave()


# ---------------------------------------------------------------- RFB pieces


@pytest.mark.parametrize(("fmt", "order"), [
    (FORMAT, (0, 1, 2)),
    (PixelFormat(32, 24, False, True, 255, 255, 255, 16, 8, 0), (2, 1, 0)),  # QEMU's, most clients' default
    (PixelFormat(32, 24, True, True, 255, 255, 255, 16, 8, 0), (1, 2, 3)),
    (PixelFormat(32, 32, False, True, 255, 255, 255, 24, 16, 8), (3, 2, 1)),
    (PixelFormat(16, 16, False, True, 31, 63, 31, 11, 5, 0), None),
    (PixelFormat(8, 8, False, False, 0, 0, 0, 0, 0, 0), None),
    (PixelFormat(32, 24, False, True, 255, 255, 255, 0, 0, 16), None),
], ids=["novnc", "qemu", "big-endian", "high-bytes", "16bpp", "colour-map", "overlap"])
def test_pixel_formats_a_viewer_may_ask_for(fmt: PixelFormat, order: tuple[int, int, int] | None) -> None:
    assert PixelFormat.unpack(fmt.pack()) == fmt
    assert fmt.byte_order() == order


def test_pixels_are_permuted_into_the_viewers_format() -> None:
    rgbx = bytes([1, 2, 3, 0, 4, 5, 6, 0])
    assert convert(rgbx, (0, 1, 2)) == rgbx
    assert convert(rgbx, (2, 1, 0)) == bytes([3, 2, 1, 0, 6, 5, 4, 0])
    assert convert(rgbx, (1, 2, 3)) == bytes([0, 1, 2, 3, 0, 4, 5, 6])


def test_merge_covers_all() -> None:
    assert merge([(0, 0, 2, 2), (10, 5, 1, 1)]) == (0, 0, 11, 6)


class Wire:
    """Bytes one side of an RFB conversation sent, to read as the other side."""

    def __init__(self) -> None:
        self.q: queue.Queue[bytes] = queue.Queue()

    def send(self, data: bytes) -> None:
        self.q.put(data)

    def receive(self, timeout: float) -> bytes:
        try:
            return self.q.get(timeout=max(timeout, 0.001))
        except queue.Empty:
            return b""


def served(width: int = 64, height: int = 32) -> tuple[RfbServer, Framebuffer, Wire, list[bytes]]:
    fb = Framebuffer(width, height)
    wire, forwarded = Wire(), []
    return RfbServer(fb, "vm", wire.send, forwarded.append), fb, wire, forwarded


def test_the_server_sends_what_changed_when_asked_and_forwards_input() -> None:
    server, fb, wire, forwarded = served()
    viewer = test_rfb.RfbClient(wire.receive, server.feed)
    viewer.handshake()
    assert (viewer.width, viewer.height, viewer.name) == (64, 32, "vm")
    viewer.refresh()
    assert viewer.lit() == 0

    viewer.request()
    assert wire.receive(0) == b""  # nothing changed: no answer yet
    fb.put((2, 3, 2, 1), bytes([255, 0, 0, 0, 0, 255, 0, 0]))
    server.damaged([(2, 3, 2, 1)])
    assert viewer.read_update() == 1
    start = (3 * 64 + 2) * 4
    assert viewer.pixels[start:start + 8] == bytes([255, 0, 0, 0, 0, 255, 0, 0])

    viewer.key(ord("a"))
    assert forwarded == [struct.pack(">BBxxI", 4, 1, ord("a")), struct.pack(">BBxxI", 4, 0, ord("a"))]


def test_a_resize_reaches_viewers_that_take_desktop_size_and_ends_others() -> None:
    server, fb, wire, _ = served()
    viewer = test_rfb.RfbClient(wire.receive, server.feed)
    viewer.handshake()
    viewer.request()
    fb.resize(80, 40)
    server.redraw()
    viewer.read_update()
    assert (viewer.width, viewer.height) == (80, 40)

    server2, fb2, wire2, _ = served()
    old = test_rfb.RfbClient(wire2.receive, server2.feed)
    old.handshake(encodings=(0,))
    old.request()
    fb2.resize(80, 40)
    with pytest.raises(RfbError, match="DesktopSize"):
        server2.redraw()


@pytest.mark.parametrize("sent", [
    b"RFB 003.009\n",
    b"RFB 003.008\n\x02",
    b"RFB 003.008\n\x01\x01\x07",
    b"RFB 003.008\n\x01\x01\x00\x00\x00\x00" + PixelFormat(16, 16, False, True, 31, 63, 31, 11, 5, 0).pack(),
    b"RFB 003.008\n\x01\x01\x06\x00\x00\x00\x7f\xff\xff\xff",
], ids=["version", "security", "message-type", "pixel-format", "cut-text"])
def test_a_viewer_that_breaks_the_protocol_is_refused(sent: bytes) -> None:
    server, _, _, _ = served()
    with pytest.raises(RfbError):
        server.feed(sent)


def server_bytes(*parts: bytes) -> bytes:
    return b"".join(parts)


INIT = struct.pack(">HH", 16, 8) + FORMAT.pack() + struct.pack(">I", 2) + b"vm"


@pytest.mark.parametrize(("sent", "error"), [
    (b"HTTP/1.1 200\r\n", "not an RFB server"),
    (b"RFB 003.003\n", "too old"),
    (b"RFB 003.008\n\x01\x02", "wants authentication"),
    (b"RFB 003.008\n\x00\x00\x00\x00\x04nope", "refused the connection: nope"),
    (b"RFB 003.008\n\x01\x01" + struct.pack(">II", 1, 3) + b"bad", "refused the connection: bad"),
    (b"RFB 003.008\n\x01\x01\x00\x00\x00\x00" + struct.pack(">HH", 60000, 60000) + FORMAT.pack() + bytes(4),
     "is not served"),
    (b"RFB 003.008\n\x01\x01\x00\x00\x00\x00" + INIT + b"\x00\x00\x00\x01" + struct.pack(">HHHHi", 10, 0, 10, 1, 0),
     "outside"),
    (b"RFB 003.008\n\x01\x01\x00\x00\x00\x00" + INIT + b"\x00\x00\x00\x01" + struct.pack(">HHHHi", 0, 0, 1, 1, 5),
     "not asked for"),
    (b"RFB 003.008\n\x01\x01\x00\x00\x00\x00" + INIT + b"\x09", "unknown server message"),
], ids=["http", "old", "auth", "refused", "result", "huge", "outside", "encoding", "message"])
def test_a_screen_that_breaks_the_protocol_is_left(sent: bytes, error: str) -> None:
    rfb = RfbClient(lambda _: None, Framebuffer())
    with pytest.raises(RfbError, match=error):
        rfb.feed(sent)


def test_the_client_applies_raw_and_copyrect_and_asks_again() -> None:
    sent: list[bytes] = []
    fb = Framebuffer()
    rfb = RfbClient(sent.append, fb)
    changes = rfb.feed(b"RFB 003.008\n\x01\x01\x00\x00\x00\x00" + INIT)
    assert changes.ready and (fb.width, fb.height) == (16, 8) and rfb.name == "vm"
    assert sent[0] == b"RFB 003.008\n" and sent[-1][:2] == b"\x03\x00"  # a full update is asked for first
    pixel = bytes([9, 8, 7, 0])
    update = (b"\x00\x00\x00\x02" + struct.pack(">HHHHi", 1, 1, 1, 1, 0) + pixel
              + struct.pack(">HHHHi", 5, 5, 1, 1, 1) + struct.pack(">HH", 1, 1))
    half = len(update) // 2
    assert rfb.feed(update[:half]).rects is None  # half a rectangle: nothing yet
    changes = rfb.feed(update[half:])
    assert changes.rects == [(1, 1, 1, 1), (5, 5, 1, 1)]
    assert fb.get((5, 5, 1, 1)) == pixel == fb.get((1, 1, 1, 1))
    assert sent[-1][:2] == b"\x03\x01"  # then incremental updates


# ---------------------------------------------------------------- on kubesim: KubeVirt's console and screen


@pytest.fixture
def kubevirt_machine(sim: Sim, api: client.ApiClient, namespace: str, bmc_crd: None) -> Iterator[KubeVirtMachine]:
    make_vm(api, namespace, run_strategy="Manual")
    make_bmc(api, namespace)
    machine = KubeVirtMachine(KubeClient(load_credentials(sim.kubeconfig)), namespace, "vm", "vm")
    machine.start()
    assert machine.wait_ready(5)
    machine.reset(ResetType.ON)
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=15, what="the VMI running")
    wait_for(lambda: machine.power_state() == PowerState.ON, what="the machine on")
    yield machine
    machine.stop()


def reset_vmi(api: client.ApiClient, namespace: str) -> None:
    reply = call(api, "PUT", f"/apis/subresources.kubevirt.io/v1/namespaces/{namespace}/virtualmachineinstances/vm/"
                             "reset", {})
    assert reply.status == 200, reply.body


def test_the_serial_line_survives_typing_from_many_threads_while_the_vm_resets_and_prints(
        kubevirt_machine: KubeVirtMachine, api: client.ApiClient, namespace: str) -> None:
    """The defect: a reader thread and a writer thread on one TLS connection. Four typists and the guest's boot
    text at once, through ten resets: the line stays the same one and every line typed is echoed."""
    hub = SerialHub(kubevirt_machine, "vm")
    seen = Seen()
    viewer = hub.join(seen.output, seen.attached)
    wait_for(lambda: b"vm login: " in seen.text(), timeout=10, what="the login prompt")
    stop = threading.Event()
    sent: list[bytes] = []

    def typist(n: int) -> None:
        i = 0
        while not stop.is_set() and i < 400:
            line = b"t%d-%d\x03" % (n, i)  # ^C: the getty echoes the line and prompts again
            if viewer.send(line):
                sent.append(line[:-1])
            i += 1
            time.sleep(0.005)

    typists = [threading.Thread(target=typist, args=(n,)) for n in range(4)]
    for t in typists:
        t.start()
    for _ in range(10):
        reset_vmi(api, namespace)
        time.sleep(0.2)
    stop.set()
    for t in typists:
        t.join(10)
    marker = b"last-line"
    viewer.send(marker + b"\x03")
    wait_for(lambda: marker in seen.text(), timeout=10, what="the last line echoed")
    assert hub.bridge is not None and hub.bridge.attachments == 1
    assert seen.states == [(False, "connecting"), (True, "attached")]
    text = seen.text()
    assert len(sent) > 100 and all(line in text for line in sent)
    viewer.leave()


def rfb_viewer(hub: ScreenHub) -> tuple[test_rfb.RfbClient, Any, Seen]:
    wire, seen = Wire(), Seen()
    viewer = hub.join(wire.send, seen.attached)
    return test_rfb.RfbClient(wire.receive, viewer.feed), viewer, seen


def until(rfb: test_rfb.RfbClient, check: Callable[[test_rfb.RfbClient], bool], what: str,
          timeout: float = 10) -> None:
    def look() -> bool:
        rfb.request(incremental=False)  # answered at once, whether anything changed or not
        rfb.read_update(timeout=5)
        return check(rfb)

    wait_for(look, timeout=timeout, what=what)


def test_viewers_share_the_screen_through_reset_stop_and_start(kubevirt_machine: KubeVirtMachine,
                                                              api: client.ApiClient, namespace: str) -> None:
    hub = ScreenHub(kubevirt_machine, "vm")
    a, va, sa = rfb_viewer(hub)
    b, vb, _ = rfb_viewer(hub)
    a.handshake()
    b.handshake()
    until(a, lambda r: r.text().endswith("vm login:"), "the login prompt on viewer a")
    assert (a.width, a.height) == (640, 400)  # DesktopSize followed the VM's screen

    a.type("admin\n")
    until(b, lambda r: "vm login: admin" in r.text(), "what a typed, on viewer b")

    reset_vmi(api, namespace)
    until(b, lambda r: "admin" not in r.text() and r.text().endswith("vm login:"), "the screen after the reset")

    kubevirt_machine.reset(ResetType.FORCE_OFF)
    wait_for(lambda: sa.states[-1][0] is False, timeout=15, what="the viewers told the screen is gone")
    until(a, lambda r: r.lit() == 0, "a black screen while off")
    kubevirt_machine.reset(ResetType.ON)
    wait_for(lambda: sa.states[-1] == (True, "attached"), timeout=20, what="the screen back")
    until(a, lambda r: r.text().endswith("vm login:"), "the new boot's prompt", timeout=15)
    assert hub.bridge is not None and hub.bridge.attachments == 2
    va.leave()
    vb.leave()
    assert hub.bridge is None


def test_the_bmc_leaves_the_screen_to_another_vnc_client(kubevirt_machine: KubeVirtMachine, sim: Sim,
                                                         namespace: str) -> None:
    kube = endpoint(sim.kubeconfig)
    other = vnc_connect(kube, namespace)  # someone's virtctl vnc
    rfb_over(other).handshake()
    hub = ScreenHub(kubevirt_machine, "vm")
    rfb, viewer, seen = rfb_viewer(hub)
    wait_for(lambda: any("Active VNC connection" in why for _, why in seen.states), what="the screen in use")
    other.settimeout(0.5)
    with pytest.raises(websocket.WebSocketTimeoutException):  # still connected: the BMC did not take over
        other.recv_data()
    other.close()
    wait_for(lambda: seen.states[-1] == (True, "attached"), timeout=15, what="the screen once it is free")
    rfb.handshake()
    until(rfb, lambda r: r.text().endswith("vm login:"), "the prompt")
    viewer.leave()


def test_ctrl_alt_del_from_a_viewer_reboots_the_guest(kubevirt_machine: KubeVirtMachine, api: client.ApiClient,
                                                     namespace: str) -> None:
    serial = SerialHub(kubevirt_machine, "vm")
    seen = Seen()
    line = serial.join(seen.output, seen.attached)
    hub = ScreenHub(kubevirt_machine, "vm")
    rfb, viewer, states = rfb_viewer(hub)
    rfb.handshake()
    wait_for(lambda: states.states[-1] == (True, "attached"), what="the screen attached")
    until(rfb, lambda r: r.text().endswith("vm login:"), "the prompt")
    rfb.type("hello")
    until(rfb, lambda r: r.text().endswith("vm login: hello"), "the keys on the screen")
    reset_vmi(api, namespace)
    until(rfb, lambda r: r.text().endswith("vm login:"), "the prompt after the reset")
    for keysym in (0xFFE3, 0xFFE9, 0xFFFF):
        rfb.key(keysym, True)
    for keysym in (0xFFFF, 0xFFE9, 0xFFE3):
        rfb.key(keysym, False)
    wait_for(lambda: b"reboot: Restarting system" in seen.text(), what="the guest rebooting")
    viewer.leave()
    line.leave()
