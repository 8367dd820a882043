"""Consoles and inputs that cannot be abused (issue 28, item 10), probed as an attacker with a valid session would:
what a client sends is bounded (a 10 MB WebSocket message is refused and never kept, a compressed one is not
inflated past the limit), what it withholds costs it its slot (a viewer that never reads is dropped after the send
deadline, at once when its session ends), an image URL that is not ASCII is a 400 with the reason, and a failed
login's user name, sometimes a password typed in the wrong field, is never written.

Also the consoles' side of the page (items 3 to 5): a refusal after authentication opens, says why and closes; the
serial console greets every new viewer with the recent output, kept after the last viewer left; each open console
is listed with its session.

First in this process over a MemoryMachine (the server as the agent runs it), then through agents on kubesim (RSS
measured in /proc, the VM's serial line, ipmitool)."""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import socket
import struct
import subprocess
import threading
import time
import tracemalloc
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import websocket
from kubernetes import client

from vbmc.access import audit
from vbmc.access.throttle import LoginThrottle
from vbmc.machine import ResetType
from vbmc.machine.console import SCROLLBACK, SerialHub
from vbmc.machine.kubevirt import imagecheck
from vbmc.machine.memory import MemoryMachine
from vbmc.redfish.server import WEBSOCKET_MESSAGE, BackgroundServer, ServerConfig, drained
from vbmc.web import SCREEN_URI, SERIAL_URI, Consoles, WebFront
from vbmc.web import consoles as consoles_module
from vbmc.web.consoles import INPUT_LIMIT

from ..support.agents import PASSWORD, USER, AgentProcess, agent_for_vm, free_port, ipmitool_argv
from ..support.cluster import Sim, call, wait_for
from ..support.vms import running_vmi_uid
from . import test_web_consoles as consoles_tests
from .test_web_consoles import closed_with, next_text, read_until, redfish_full

SESSIONS = "/redfish/v1/SessionService/Sessions"
MB = 10 * 2**20
# The bounds these tests state.
RSS_GROWTH = 10 * 2**20  # an agent's RSS after twenty 10 MB console messages, over its RSS before them
SEND_DEADLINE = 2.0  # the in-process BMC's send deadline (the agent's is vbmc.web.consoles.SEND_DEADLINE, 10 s)
SESSION_CHECK = 0.2


# ---------------------------------------------------------------- in this process, over a MemoryMachine


class Bmc(consoles_tests.Bmc):
    def serial_viewer(self, token: str) -> websocket.WebSocket:
        return websocket.create_connection(self.ws + SERIAL_URI, subprotocols=["kubevbmc", f"x-auth-token.{token}"],
                                           timeout=5)

    def attached_viewer(self, token: str) -> websocket.WebSocket:
        """A serial viewer, once the line is attached (the first status may be "connecting")."""
        ws = self.serial_viewer(token)
        while not next_text(ws)["Attached"]:
            pass
        return ws

    def stalled_viewer(self, token: str, path: str = SERIAL_URI) -> socket.socket:
        """A viewer that completes the WebSocket handshake and then never reads: its receive buffer as small as the
        kernel allows, so that what the BMC sends it backs up at once."""
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(5)
        sock.connect(("127.0.0.1", self.port))
        key = base64.b64encode(os.urandom(16)).decode()
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nUpgrade: websocket\r\n"
                     f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                     f"Sec-WebSocket-Protocol: kubevbmc, x-auth-token.{token}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:  # a byte at a time: nothing past the handshake's answer is read
            byte = sock.recv(1)
            assert byte, head
            head += byte
        assert head.startswith(b"HTTP/1.1 101 "), head
        return sock

    def flood(self, total: int = 8 * 2**20) -> None:
        """The machine prints `total` bytes: more than the kernel takes for a peer that does not read (about 3 MB on
        loopback), so that the BMC's sends to such a viewer wait."""
        for _ in range(total // 4096):
            assert self.machine.write_console(b"x" * 4095 + b"\n")


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Starts a BMC (a MemoryMachine that is on, two viewers per console) with the given send deadline. Its viewers'
    outboxes hold 64 MiB (1 MiB in the agent), so that a viewer that stops reading is dropped by the send deadline
    or its session's end, not by its outbox filling first."""
    monkeypatch.setitem(consoles_module.OUTBOX, "serial", 64 << 20)
    started: list[Bmc] = []

    def start(send_deadline: float = SEND_DEADLINE) -> Bmc:
        bmc = consoles_tests.console_bmc(Bmc, session_check=SESSION_CHECK, send_deadline=send_deadline)
        started.append(bmc)
        return bmc

    yield start
    for bmc in started:
        consoles_tests.stop_bmc(bmc)


def test_a_refused_upgrade_answers_the_redfish_services_error_for_the_same_condition(serve: Any) -> None:
    bmc = serve()
    status, body = consoles_tests.refused(bmc, subprotocols=["kubevbmc", "x-auth-token.not-a-session"])
    service_status, service, _ = redfish_full(bmc.base, "GET", "/redfish/v1/Systems/vm", token="not-a-session")
    assert status == service_status == 401
    assert body["error"]["code"] == service["error"]["code"] == "Base.1.19.NoValidSession"
    assert body["error"]["@Message.ExtendedInfo"] == service["error"]["@Message.ExtendedInfo"]
    assert body["error"]["message"] == f"{service['error']['message']} No live Redfish session for this token."

    for _ in range(12):
        redfish_full(bmc.base, "POST", SESSIONS, {"UserName": USER, "Password": "no"})
    status, body = consoles_tests.refused(bmc, subprotocols=["kubevbmc", "x-auth-token.not-a-session"])
    service_status, service, _ = redfish_full(bmc.base, "POST", SESSIONS, {"UserName": USER, "Password": PASSWORD})
    assert status == service_status == 429
    for error in (body["error"], service["error"]):
        assert error["code"] == "Base.1.19.ServiceTemporarilyUnavailable"
        assert error["message"].endswith(" Too many failed logins from this address.")
        assert error["@Message.ExtendedInfo"][0]["MessageId"] == "Base.1.19.ServiceTemporarilyUnavailable"


def test_a_serial_message_over_4_kib_is_refused_with_1009_and_nothing_of_it_is_typed(serve: Any) -> None:
    bmc = serve()
    token, _ = bmc.login()
    ws = bmc.attached_viewer(token)
    ws.send_binary(b"a" * INPUT_LIMIT["serial"])  # the most a message may be
    wait_for(lambda: len(bmc.machine.console_input) == INPUT_LIMIT["serial"], what="the typed bytes on the line")
    ws.send_binary(b"b" * (INPUT_LIMIT["serial"] + 1))
    why = "a serial console message is at most 4096 bytes"
    assert next_text(ws) == {"Console": "serial", "Attached": False, "Message": why}
    assert closed_with(ws) == (1009, why)
    assert b"b" not in bytes(bmc.machine.console_input)
    wait_for(lambda: bmc.serial.viewers == 0, what="the viewer's slot free")


def test_a_message_over_the_servers_limit_is_refused_with_1009_before_it_is_read_whole(serve: Any) -> None:
    bmc = serve()
    token, _ = bmc.login()
    ws = websocket.create_connection(bmc.ws + SCREEN_URI, subprotocols=["binary", f"x-auth-token.{token}"],
                                     timeout=10)
    ws.send_binary(b"\x00" * MB)
    assert closed_with(ws, timeout=10) == (1009, f"a message is at most {WEBSOCKET_MESSAGE} bytes")
    wait_for(lambda: not bmc.store.list()[0].viewers, what="the screen viewer gone")


def deflate_frame(payload: bytes) -> bytes:
    """One masked binary frame, compressed (permessage-deflate, RFC 7692: RSV1 set, the trailing 00 00 ff ff cut)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    data = (compressor.compress(payload) + compressor.flush(zlib.Z_SYNC_FLUSH))[:-4]
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
    if len(data) < 126:
        head = struct.pack(">BB", 0x80 | 0x40 | 0x2, 0x80 | len(data))
    elif len(data) < 65536:
        head = struct.pack(">BBH", 0x80 | 0x40 | 0x2, 0x80 | 126, len(data))
    else:
        head = struct.pack(">BBQ", 0x80 | 0x40 | 0x2, 0x80 | 127, len(data))
    return head + mask + masked


def test_a_compressed_message_is_not_inflated_past_the_limit(serve: Any) -> None:
    """A browser offers permessage-deflate; 10 KB of deflated zeros would inflate to 10 MB before any check."""
    bmc = serve()
    token, _ = bmc.login()
    frame = deflate_frame(b"\x00" * MB)
    assert len(frame) < 20_000
    sock = socket.create_connection(("127.0.0.1", bmc.port), timeout=5)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(f"GET {SERIAL_URI} HTTP/1.1\r\nHost: 127.0.0.1:{bmc.port}\r\nUpgrade: websocket\r\n"
                 f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                 "Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits\r\n"
                 f"Sec-WebSocket-Protocol: kubevbmc, x-auth-token.{token}\r\n\r\n".encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 101 ") and b"permessage-deflate" in answer.lower()
    tracemalloc.start()
    try:
        sock.sendall(frame)
        received = answer.partition(b"\r\n\r\n")[2]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # until the server closes the connection
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        sock.close()
    assert peak < 2 * 2**20, f"{peak} bytes allocated while the message was read"
    assert struct.pack(">H", 1009) in received  # a close frame with 1009 (after the status messages)
    assert b"xxxx" not in bytes(bmc.machine.console_input) and bytes(bmc.machine.console_input) == b""


def test_a_viewer_that_never_reads_loses_its_slot_within_the_send_deadline(
        serve: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vbmc.audit")
    bmc = serve()
    token, _ = bmc.login()
    stalled = [bmc.stalled_viewer(token), bmc.stalled_viewer(token)]
    wait_for(lambda: bmc.serial.viewers == 2, what="two viewers in")
    locked_out = bmc.serial_viewer(token)
    assert closed_with(locked_out)[0] == 1013  # every slot is taken
    bmc.flood()
    flooded = time.monotonic()
    wait_for(lambda: bmc.serial.viewers == 0, what="the slots of the viewers that never read free")
    took = time.monotonic() - flooded
    print(f"\nthe slots of two never-reading viewers freed {took:.2f} s after the output backed up "
          f"(send deadline {SEND_DEADLINE} s)")
    assert took < SEND_DEADLINE + 1.5
    assert caplog.text.count("closed: the viewer stopped reading") == 2
    assert not bmc.store.list()[0].viewers  # nor listed with the session any more
    newcomer = bmc.attached_viewer(token)
    newcomer.close()
    for sock in stalled:
        sock.close()


def test_a_never_reading_viewer_whose_session_is_deleted_loses_its_slot_at_once(serve: Any) -> None:
    bmc = serve(send_deadline=600.0)  # only the session's end can free the slot
    token, location = bmc.login()
    stalled = bmc.stalled_viewer(token)
    wait_for(lambda: bmc.serial.viewers == 1, what="the viewer in")
    bmc.flood()  # its sends now wait for a reader that never comes
    status, _, _ = redfish_full(bmc.base, "DELETE", location, token=token)
    assert status == 204
    deleted = time.monotonic()
    wait_for(lambda: bmc.serial.viewers == 0, what="the slot free")
    took = time.monotonic() - deleted
    print(f"\nthe slot of a never-reading viewer freed {took:.2f} s after its session was deleted "
          f"(sessions looked at every {SESSION_CHECK} s)")
    assert took < SESSION_CHECK + 1.0
    token, _ = bmc.login()
    newcomer = bmc.attached_viewer(token)
    newcomer.close()
    stalled.close()


def test_a_peer_that_takes_nothing_is_cut_off_after_the_write_deadline_and_a_slow_one_is_not() -> None:
    """The server's own deadline (vbmc/redfish/server.py drained): what frees a connection, and the memory queued
    for it, once a viewer that never reads has been dropped."""

    async def main() -> tuple[float, bool]:
        writers: asyncio.Queue[asyncio.StreamWriter] = asyncio.Queue()

        async def accepted(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await writers.put(writer)

        server = await asyncio.start_server(accepted, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        never = socket.socket()
        never.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await asyncio.get_running_loop().sock_connect(never, ("127.0.0.1", port))
        writer = await writers.get()
        writer.write(b"x" * (4 << 20))
        began = time.monotonic()
        with pytest.raises(ConnectionAbortedError):
            await drained(writer, 0.5)
        took = time.monotonic() - began
        assert writer.transport.is_closing()
        never.close()

        slow = socket.create_connection(("127.0.0.1", port))
        writer = await writers.get()
        stop = threading.Event()

        def read_slowly() -> None:
            while not stop.is_set() and slow.recv(32 * 1024):
                stop.wait(0.1)

        reader = threading.Thread(target=read_slowly, daemon=True)
        reader.start()
        writer.write(b"y" * (2 << 20))
        await drained(writer, 0.5)  # about 320 KiB/s: over 6 s in all, never 0.5 s without progress
        kept = not writer.transport.is_closing()
        stop.set()
        writer.close()  # the reader's recv() then ends
        await asyncio.get_running_loop().run_in_executor(None, reader.join, 5)
        slow.close()
        server.close()
        return took, kept

    took, kept = asyncio.run(main())
    assert took < 2.0 and kept


def test_the_first_viewer_is_greeted_with_the_output_from_before_it_came_and_no_more_than_64_kib(
        serve: Any) -> None:
    bmc = serve()
    token, _ = bmc.login()
    first = bmc.serial_viewer(token)
    next_text(first)
    wait_for(lambda: bmc.machine.write_console(b"SeaBIOS\r\nvm login: "), what="the line attached")
    read_until(first, b"vm login: ")
    first.close()
    wait_for(lambda: bmc.serial.viewers == 0 and bmc.serial.bridge is None, what="the line detached")
    assert not bmc.machine.write_console(b"lost")  # nobody watches: the hub is not attached

    second = bmc.serial_viewer(token)  # the first viewer since the line detached
    assert next_text(second)["Console"] == "serial"
    assert read_until(second, b"vm login: ") == b"SeaBIOS\r\nvm login: "  # without typing anything
    for i in range(100):
        bmc.machine.write_console(f"{i:04d}".encode() + b"." * 1019 + b"\n")  # 100 KiB in all
    read_until(second, b"0099")
    second.close()
    wait_for(lambda: bmc.serial.viewers == 0, what="the second viewer gone")

    third = bmc.serial_viewer(token)
    greeting = read_until(third, b"0099" + b"." * 1019 + b"\n")
    assert len(greeting) == SCROLLBACK and greeting.endswith(b"0099" + b"." * 1019 + b"\n")
    third.close()
    assert bmc.machine.console_input == bytearray()


def test_ipmi_sol_still_starts_blank() -> None:
    machine = MemoryMachine()
    machine.reset(ResetType.ON)
    hub = SerialHub(machine, "vm")
    web = hub.join(lambda _: None, lambda *_: None, replay=True)
    wait_for(lambda: machine.write_console(b"boot text\r\n"), what="the line attached")
    seen: list[bytes] = []
    sol = hub.join(seen.append, lambda *_: None, counted=False)  # as vbmc/ipmi/server.py joins
    machine.write_console(b"after\r\n")
    assert seen == [b"after\r\n"]
    sol.leave()
    web.leave()
    hub.stop()


def test_each_open_console_is_listed_with_its_session_until_it_closes(serve: Any) -> None:
    bmc = serve()
    token, location = bmc.login()
    session = bmc.store.list()[0]
    ws = bmc.serial_viewer(token)
    next_text(ws)
    (viewer,) = session.viewers
    assert (viewer.console, viewer.origin) == ("serial", "127.0.0.1") and viewer.since
    screen = websocket.create_connection(bmc.ws + SCREEN_URI, subprotocols=["binary", f"x-auth-token.{token}"],
                                         timeout=5)
    wait_for(lambda: len(session.viewers) == 2, what="the screen listed too")
    assert sorted(v.console for v in session.viewers) == ["screen", "serial"]
    ws.close()
    wait_for(lambda: [v.console for v in session.viewers] == ["screen"], what="the serial console unlisted")
    assert redfish_full(bmc.base, "DELETE", location, token=token)[0] == 204
    assert closed_with(screen) == (1008, "the Redfish session ended")
    wait_for(lambda: not session.viewers, what="the screen unlisted")


def test_a_machine_without_a_screen_says_so_to_a_screen_viewer(serve: Any) -> None:
    bmc = serve()
    consoles = Consoles(bmc.store, LoginThrottle(), "vm", bmc.serial, None)
    server = BackgroundServer(bmc.app, ServerConfig(http=f"127.0.0.1:{free_port()}"), web=WebFront(consoles))
    with server:
        token, _ = bmc.login()
        ws = websocket.create_connection(f"ws://127.0.0.1:{server.ports[0]}{SCREEN_URI}",
                                         subprotocols=["binary", f"x-auth-token.{token}"], timeout=5)
        assert next_text(ws) == {"Console": "screen", "Attached": False, "Message": "this machine has no screen"}
        assert closed_with(ws) == (1003, "this machine has no screen")


# ---------------------------------------------------------------- agents on kubesim


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def session_token(agent: AgentProcess) -> str:
    status, body, headers = redfish_full(agent.url, "POST", SESSIONS, {"UserName": USER, "Password": PASSWORD})
    assert status == 201, body
    return str(headers["X-Auth-Token"])


@pytest.fixture
def agent(sim: Sim, api: client.ApiClient, namespace: str, bmc_crd: None) -> Iterator[AgentProcess]:
    with agent_for_vm(sim, api, namespace) as process:
        yield process


def test_twenty_10_mb_console_messages_are_refused_and_the_agents_memory_stays_bounded(agent: AgentProcess) -> None:
    token = session_token(agent)
    ws_base = agent.url.replace("http://", "ws://")
    protocols = {SERIAL_URI: "kubevbmc", SCREEN_URI: "binary"}

    def viewer(path: str) -> websocket.WebSocket:
        return websocket.create_connection(ws_base + path, subprotocols=[protocols[path], f"x-auth-token.{token}"],
                                           timeout=30)

    for path in protocols:  # each console once, so that what every connection costs is in the baseline
        warm = viewer(path)
        warm.send_binary(b"\x00" * (WEBSOCKET_MESSAGE + 1))
        closed_with(warm)
    before = rss(agent.proc.pid)
    peak = before
    for i in range(20):
        ws = viewer(SERIAL_URI if i % 2 == 0 else SCREEN_URI)
        began = time.monotonic()
        ws.send_binary(b"x" * MB)
        assert closed_with(ws, timeout=30) == (1009, f"a message is at most {WEBSOCKET_MESSAGE} bytes")
        assert time.monotonic() - began < 10
        ws.close()
        peak = max(peak, rss(agent.proc.pid))
    after = rss(agent.proc.pid)
    print(f"\nagent RSS {before / 2**20:.1f} MiB before twenty 10 MB console messages, {after / 2**20:.1f} MiB "
          f"after, {peak / 2**20:.1f} MiB at most")
    assert peak - before < RSS_GROWTH
    ws = viewer(SERIAL_URI)  # and the consoles still serve
    assert next_text(ws)["Console"] == "serial"
    ws.close()


def test_a_first_viewer_after_everyone_left_sees_the_vms_recent_output_without_typing(
        agent: AgentProcess, api: client.ApiClient, namespace: str) -> None:
    assert agent.redfish("POST", "/redfish/v1/Systems/vm/Actions/ComputerSystem.Reset", {"ResetType": "On"})[0] == 204
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=15, what="the VMI running")
    token = session_token(agent)
    url = agent.url.replace("http://", "ws://") + SERIAL_URI
    first = websocket.create_connection(url, subprotocols=["kubevbmc", f"x-auth-token.{token}"], timeout=10)
    read_until(first, b"vm login: ", timeout=10)
    first.send_binary(b"operator\r")
    read_until(first, b"Password: ")
    first.close()
    wait_for(lambda: "closed: closed by the viewer" in agent.output(), what="the first viewer gone")

    second = websocket.create_connection(url, subprotocols=["kubevbmc", f"x-auth-token.{token}"], timeout=10)
    greeting = read_until(second, b"Password: ", timeout=10)  # typing nothing
    assert b"vm login: operator\r\nPassword: " in greeting
    second.close()


URLS = [
    ("http://images.example/installer-\u00e9t\u00e9.iso", "not ASCII"),
    ("http://images.example/boot.iso?lang=fran\u00e7ais", "not ASCII"),
    ("http://im\u00e4ges.example/boot.iso", "host is not a valid host name"),
    ("http://images.example/my boot.iso", "space or a control character"),
    ("http://images.example/boot\x01.iso", "space or a control character"),
]


def test_an_image_url_that_is_not_ascii_is_a_400_with_the_reason_and_changes_nothing(
        agent: AgentProcess, api: client.ApiClient, namespace: str) -> None:
    media = "/redfish/v1/Managers/BMC/VirtualMedia/Cd"
    for url, reason in URLS:
        resp = requests.post(f"{agent.url}{media}/Actions/VirtualMedia.InsertMedia", json={"Image": url},
                             auth=(USER, PASSWORD), timeout=10)
        assert resp.status_code == 400, (url, resp.text)
        error = resp.json()["error"]
        assert error["@Message.ExtendedInfo"][0]["MessageId"].endswith(".ActionParameterValueFormatError")
        assert reason in error["message"], (url, error)
        resp = requests.patch(f"{agent.url}{media}", json={"Image": url}, auth=(USER, PASSWORD), timeout=10)
        assert resp.status_code == 400, (url, resp.text)
        error = resp.json()["error"]
        assert error["@Message.ExtendedInfo"][0]["MessageId"].endswith(".PropertyValueFormatError")
        assert reason in error["message"], (url, error)
    shown = requests.get(f"{agent.url}{media}", auth=(USER, PASSWORD), timeout=5).json()
    assert shown["Inserted"] is False and not shown.get("Image")
    dvs = call(api, "GET", f"/apis/cdi.kubevirt.io/v1beta1/namespaces/{namespace}/datavolumes").body["items"]
    assert dvs == []
    assert "Traceback" not in agent.output() and "UnicodeEncodeError" not in agent.output()


def test_the_image_check_refuses_a_url_that_is_not_ascii_in_words() -> None:
    with pytest.raises(imagecheck.ImageProblem, match="not ASCII: percent-encode it"):
        imagecheck.check("http://127.0.0.1:9/\u00e9.iso", timeout=0.5)


def test_a_failed_logins_user_name_is_never_written_unless_it_is_the_accounts(agent: AgentProcess) -> None:
    typed = "hunter2-Secret"  # a password typed in the user name field
    denied = subprocess.run(ipmitool_argv("127.0.0.1", agent.ipmi_port, "-R", "1", "-N", "1", "power", "status",
                                          user=typed, password="x"), capture_output=True, text=True, timeout=30)
    assert denied.returncode != 0
    assert requests.post(f"{agent.url}{SESSIONS}", json={"UserName": typed, "Password": "x"}, timeout=5).status_code \
        == 401
    assert requests.get(f"{agent.url}/redfish/v1/Systems/vm", auth=(typed, "x"), timeout=5).status_code == 401
    assert requests.post(f"{agent.url}{SESSIONS}", json={"UserName": USER, "Password": "x"}, timeout=5).status_code \
        == 401
    for _ in range(10):  # until the throttle locks the address out: its log line names the user too
        if requests.post(f"{agent.url}{SESSIONS}", json={"UserName": typed, "Password": "x"},
                         timeout=5).status_code == 429:
            break
    wait_for(lambda: "login throttled" in agent.output(), what="the throttle's line")
    output = agent.output()
    assert "hunter2" not in output
    refused = [line for line in output.splitlines() if "action='login'" in line]
    assert any("protocol=ipmi" in line and f"user='{audit.UNKNOWN_USER}'" in line for line in refused), refused
    assert any("protocol=redfish" in line and f"user='{audit.UNKNOWN_USER}'" in line for line in refused), refused
    assert any("protocol=redfish" in line and f"user='{USER}'" in line for line in refused), refused
    assert any(f"user='{audit.UNKNOWN_USER}'" in line for line in output.splitlines() if "login throttled" in line)
