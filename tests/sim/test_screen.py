"""kubesim's VM screens: virt-api's `virtualmachineinstances/vnc` WebSocket (raw RFB 3.8) and the text console
behind it. The pure parts (the text console, pixel formats, the RFB server of one client) on their own; then the
WebSocket through kubesim's TLS listener, read by an RFB client written from RFC 6143 (tests/support/rfb.py)."""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import websocket
from kubernetes import client

from kubesim.console import ScreenBusy, SerialLine
from kubesim.screen import (
    COLS,
    HEIGHT,
    QEMU_FORMAT,
    ROWS,
    WIDTH,
    TextScreen,
    pixel_order,
)

from ..support.cluster import Sim, call, wait_for
from ..support.rfb import NOVNC_FORMAT, RfbClient, rfb_over
from ..support.vms import make_vm
from .test_console import PROTOCOL, Endpoint, create_vmi, endpoint, read_until, running_vm, vmi, wait_closed

Obj = dict[str, Any]


# ---------------------------------------------------------------- the text console


def test_text_wraps_scrolls_and_skips_escape_sequences() -> None:
    screen = TextScreen()
    screen.write(b"\x1b[2J\x1b[1;1Hhello\r\nwor\bld\tx\r\n")
    assert screen.text() == "hello\nwold    x"
    screen.write(b"y" * (COLS + 3))
    assert screen.text().splitlines()[2:] == ["y" * COLS, "yyy"]
    screen.write(b"".join(b"%d\r\n" % i for i in range(ROWS * 2)))
    assert screen.text().splitlines()[-1] == str(ROWS * 2 - 1)
    assert len(screen.cells) == ROWS


def test_a_write_reports_the_rows_it_changed() -> None:
    screen = TextScreen()
    screen.changed.clear()
    screen.write(b"abc\r\ndef")
    assert screen.changed == {0, 1}


@pytest.mark.parametrize(("fmt", "order"), [
    (QEMU_FORMAT, (2, 1, 0)),
    (NOVNC_FORMAT, (0, 1, 2)),
    (struct.pack(">BBBBHHHBBB3x", 32, 24, 1, 1, 255, 255, 255, 16, 8, 0), (1, 2, 3)),  # big-endian
    (struct.pack(">BBBBHHHBBB3x", 16, 16, 0, 1, 31, 63, 31, 11, 5, 0), None),  # 16 bpp
    (struct.pack(">BBBBHHHBBB3x", 32, 24, 0, 0, 255, 255, 255, 16, 8, 0), None),  # colour map
    (struct.pack(">BBBBHHHBBB3x", 32, 24, 0, 1, 255, 255, 255, 4, 8, 0), None),  # not on a byte
    (struct.pack(">BBBBHHHBBB3x", 32, 24, 0, 1, 255, 255, 255, 8, 8, 0), None),  # two channels in one byte
], ids=["qemu", "novnc", "big-endian", "16bpp", "colour-map", "unaligned", "overlapping"])
def test_pixel_formats_the_screen_serves(fmt: bytes, order: tuple[int, int, int] | None) -> None:
    assert pixel_order(fmt) == order


# ---------------------------------------------------------------- one client, without a socket


def booted(name: str = "vm") -> SerialLine:
    line = SerialLine("ns", name, "uid-1")
    line.boot({"domain": {"devices": {"disks": [{"name": "root", "disk": {}}]}},
               "volumes": [{"name": "root", "containerDisk": {"image": "x"}}]})
    return line


class Pipe:
    """A ScreenClient driven directly, as kubesim/server.py drives it."""

    def __init__(self, line: SerialLine, preserve: bool = False) -> None:
        self.peer = line.attach_screen(preserve)
        self.rfb = RfbClient(self.receive, self.peer.feed)

    def receive(self, timeout: float) -> bytes:
        out = self.peer.take()
        assert out is not None, self.peer.reason
        return out


def test_the_screen_shows_the_boot_and_its_own_login_prompt() -> None:
    pipe = Pipe(booted())
    pipe.rfb.handshake()

    assert (pipe.rfb.width, pipe.rfb.height) == (WIDTH, HEIGHT) == (640, 400)
    assert pipe.rfb.name == "QEMU (ns_vm)"
    assert pipe.rfb.server_format == QEMU_FORMAT
    pipe.rfb.refresh()
    lines = pipe.rfb.text().splitlines()
    assert lines[1:4] == ["SeaBIOS (version kubesim)", "Booting from Hard Disk...",
                          "[    0.000000] Linux version 6.12.0-kubesim (kubesim@kubesim) #1 SMP PREEMPT_DYN"]
    assert lines[-1] == "vm login:"


def test_keys_reach_the_screens_getty_and_changed_rows_come_back() -> None:
    line = booted()
    pipe = Pipe(line)
    pipe.rfb.handshake()
    pipe.rfb.refresh()
    pipe.rfb.request()
    assert pipe.receive(0) == b""  # nothing changed: the request waits

    pipe.rfb.type("root\n")
    assert pipe.rfb.read_update() == 1  # the prompt's row and the next, one band
    assert pipe.rfb.text().endswith("vm login: root\nPassword:")
    assert b"root" not in bytes(line._pending)  # typed on tty1, not on the serial port


def test_control_keys_and_ctrl_alt_del() -> None:
    line = booted()
    pipe = Pipe(line)
    pipe.rfb.handshake()
    pipe.rfb.type("abc")
    pipe.rfb.key(0xFFE3, True)  # Control_L
    pipe.rfb.key(ord("u"))
    pipe.rfb.key(0xFFE3, False)
    pipe.rfb.refresh()
    assert pipe.rfb.text().endswith("vm login:")

    for keysym in (0xFFE3, 0xFFE9, 0xFFFF):  # Control_L, Alt_L, Delete: what noVNC's sendCtrlAltDel sends
        pipe.rfb.key(keysym, True)
    pipe.rfb.refresh()
    assert "reboot: Restarting system\nSeaBIOS" not in pipe.rfb.text()  # the screen was cleared by the firmware
    assert pipe.rfb.text().splitlines()[1] == "SeaBIOS (version kubesim)"
    assert b"Reached target reboot.target" in bytes(line._pending)  # the serial port saw the reboot


@pytest.mark.parametrize("version", [b"RFB 003.003\n", b"RFB 003.007\n"])
def test_older_protocol_versions_are_served(version: bytes) -> None:
    peer = booted().attach_screen(False)
    assert peer.take() == b"RFB 003.008\n"
    peer.feed(version)
    if version == b"RFB 003.003\n":
        assert peer.take() == struct.pack(">I", 1)
    else:
        assert peer.take() == b"\x01\x01"
        peer.feed(b"\x01")
        assert peer.take() == b""  # 3.7 sends no SecurityResult for None
    peer.feed(b"\x01")
    assert peer.take()[:4] == struct.pack(">HH", WIDTH, HEIGHT)


@pytest.mark.parametrize("sent", [
    b"RFB 004.000\n",
    b"RFB 003.008\n\x02",  # VNC authentication: not offered
    b"RFB 003.008\n\x01\x01\x09",  # an unknown message
    b"RFB 003.008\n\x01\x01\x00\x00\x00\x00" + struct.pack(">BBBBHHHBBB3x", 16, 16, 0, 1, 31, 63, 31, 11, 5, 0),
    b"RFB 003.008\n\x01\x01\x06\x00\x00\x00\xff\xff\xff\xff",  # a 4 GiB ClientCutText
], ids=["version", "security", "message", "pixel-format", "cut-text"])
def test_a_client_that_breaks_the_protocol_is_disconnected(sent: bytes) -> None:
    peer = booted().attach_screen(False)
    peer.feed(sent)
    while (out := peer.take()) is not None:
        assert out != b"" or peer.reason, "still connected"
    assert peer.reason


def test_a_new_client_takes_over_unless_it_preserves_the_session() -> None:
    line = booted()
    first = line.attach_screen(False)
    second = line.attach_screen(False)
    assert first.take() is None and first.reason == "another client connected to the VNC console"
    with pytest.raises(ScreenBusy):
        line.attach_screen(True)
    assert second.take() is not None
    second.close()
    line.attach_screen(True).close()


def test_the_screen_client_ends_with_the_vmi() -> None:
    line = booted()
    peer = line.attach_screen(False)
    line.end("VMI vm is no longer running")
    assert peer.take() is None and peer.reason == "VMI vm is no longer running"


# ---------------------------------------------------------------- through kubesim's WebSocket


@pytest.fixture(scope="module")
def kube(sim: Sim) -> Endpoint:
    return endpoint(sim.kubeconfig)


def vnc_url(kube: Endpoint, ns: str, name: str = "vm", query: str = "") -> str:
    return (kube.url.replace("https://", "wss://") +
            f"/apis/subresources.kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances/{name}/vnc{query}")


def connect(kube: Endpoint, ns: str, name: str = "vm", query: str = "") -> websocket.WebSocket:
    return websocket.create_connection(vnc_url(kube, ns, name, query), header=[f"Authorization: Bearer {kube.token}"],
                                       subprotocols=[PROTOCOL], sslopt={"context": kube.tls}, timeout=5)


def refusal(kube: Endpoint, ns: str, name: str = "vm", query: str = "") -> tuple[int, Obj]:
    with pytest.raises(websocket.WebSocketBadStatusException) as refused:
        connect(kube, ns, name, query).close()
    return refused.value.status_code, json.loads(refused.value.resp_body or b"{}")


@pytest.fixture
def screen(kube: Endpoint, api: client.ApiClient, namespace: str) -> Iterator[tuple[websocket.WebSocket, RfbClient]]:
    running_vm(api, namespace)
    ws = connect(kube, namespace)
    rfb = rfb_over(ws)
    rfb.handshake()
    yield ws, rfb
    ws.close()


def test_a_running_vmi_shows_its_screen(screen: tuple[websocket.WebSocket, RfbClient], namespace: str) -> None:
    ws, rfb = screen
    assert ws.subprotocol == PROTOCOL
    assert rfb.name == f"QEMU ({namespace}_vm)"
    rfb.refresh()
    assert rfb.text().endswith("vm login:")
    rfb.type("admin\n")
    wait_for(lambda: (rfb.request(), rfb.read_update(), rfb.text())[2].endswith("Password:"),
             what="the password prompt")


def test_a_reset_redraws_the_screen(screen: tuple[websocket.WebSocket, RfbClient], api: client.ApiClient,
                                    namespace: str) -> None:
    _, rfb = screen
    rfb.type("typed before the reset")
    rfb.refresh()
    before = bytes(rfb.pixels)
    assert "typed before the reset" in rfb.text()

    reply = call(api, "PUT", f"/apis/subresources.kubevirt.io/v1/namespaces/{namespace}/virtualmachineinstances/vm/"
                             "reset", {})
    assert reply.status == 200, reply.body
    rfb.request()
    rfb.read_update()
    assert bytes(rfb.pixels) != before and rfb.lit() > 0
    assert "typed before the reset" not in rfb.text()
    assert rfb.text().endswith("vm login:")


def test_a_second_client_takes_over_and_a_preserving_one_is_refused(kube: Endpoint, api: client.ApiClient,
                                                                    namespace: str) -> None:
    running_vm(api, namespace)
    first = connect(kube, namespace)
    read_until(first, b"RFB 003.008\n")

    status, body = refusal(kube, namespace, query="?preserveSession=true")
    assert (status, body["reason"], body["message"]) == (
        500, "InternalError", "Internal error occurred: Can't connect to websocket (503): websocket: bad handshake: "
                              "application info: Active VNC connection. Request denied.")

    second = connect(kube, namespace, query="?preserveSession=false")
    _, code = wait_closed(first)
    assert code == 1000
    rfb = rfb_over(second)
    rfb.handshake()
    second.close()


def test_the_screen_closes_when_the_vm_stops(screen: tuple[websocket.WebSocket, RfbClient], api: client.ApiClient,
                                            namespace: str) -> None:
    ws, _ = screen
    reply = call(api, "PUT", f"/apis/subresources.kubevirt.io/v1/namespaces/{namespace}/virtualmachines/vm/stop",
                 {"gracePeriod": 0})
    assert reply.status == 202, reply.body
    _, code = wait_closed(ws, timeout=10)
    assert code == 1000


def test_refusals_before_the_upgrade(kube: Endpoint, api: client.ApiClient, namespace: str) -> None:
    create_vmi(api, namespace, vmi(namespace, phase="Scheduling"))
    status, body = refusal(kube, namespace)
    assert (status, body["reason"], body["message"]) == (400, "BadRequest", "VMI is not running")

    make_vm(api, namespace, "nographics")
    body_patch = {"spec": {"runStrategy": "Always",
                           "template": {"spec": {"domain": {"devices": {"autoattachGraphicsDevice": False}}}}}}
    assert call(api, "PATCH", f"/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachines/nographics", body_patch,
                content_type="application/merge-patch+json").status == 200
    wait_for(lambda: (call(api, "GET", f"/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachineinstances/"
                                       "nographics").body or {}).get("status", {}).get("phase") == "Running",
             what="the VMI without graphics running")
    status, body = refusal(kube, namespace, "nographics")
    assert (status, body["message"]) == (400, "No graphics devices are present.")

    status, body = refusal(kube, namespace, "absent")
    assert (status, body["reason"]) == (404, "NotFound")


def test_discovery_lists_the_vnc_subresource(api: client.ApiClient) -> None:
    listed = {r["name"]: r for r in call(api, "GET", "/apis/subresources.kubevirt.io/v1").body["resources"]}
    assert listed["virtualmachineinstances/vnc"]["verbs"] == ["get"]


def test_clients_connect_and_type_at_once(kube: Endpoint, api: client.ApiClient, namespace: str) -> None:
    """Connections taking over from each other while the previous ones type: each ends cleanly, none hangs."""
    running_vm(api, namespace)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            ws = connect(kube, namespace)
            rfb = rfb_over(ws)
            try:
                rfb.handshake()
                rfb.type(f"client {i}\n")
                rfb.refresh()
            except (TimeoutError, websocket.WebSocketException, AssertionError, OSError):
                pass  # taken over by another: its connection ends
            ws.close()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not errors and not any(t.is_alive() for t in threads)
    last = connect(kube, namespace)
    rfb = rfb_over(last)
    rfb.handshake()
    rfb.refresh()
    assert rfb.lit() > 0
    last.close()
