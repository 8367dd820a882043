"""The consoles as WebSockets (vbmc/web/consoles.py), with a plain WebSocket client (websocket-client) and a Redfish
session: first in this process over a MemoryMachine (the protocol and every refusal), then through an agent on
kubesim, where the serial line is the VM's (KubeVirt's console subresource) and the screen its VNC."""

from __future__ import annotations

import json
import logging
import random
import socket
import ssl
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import websocket
from kubernetes import client

from vbmc.access.throttle import LoginThrottle
from vbmc.machine import ResetType
from vbmc.machine.console import SerialHub
from vbmc.machine.memory import MemoryMachine
from vbmc.machine.screen import ScreenHub
from vbmc.redfish import create_app
from vbmc.redfish.resources import ConsoleAccess
from vbmc.redfish.server import BackgroundServer, ServerConfig
from vbmc.web import SCREEN_URI, SERIAL_URI, Consoles, WebFront
from vbmc.web.consoles import Refusal, Upgrade, same_origin, upgrade

from ..support.agents import PASSWORD, USER, AgentProcess, agent_for_vm, free_port
from ..support.cluster import Sim, wait_for
from ..support.rfb import rfb_over
from ..support.vms import running_vmi_uid

Obj = dict[str, Any]
B = TypeVar("B", bound="Bmc")


# ---------------------------------------------------------------- the upgrade decision, a pure function


H = [(b"host", b"bmc.example:443")]


@pytest.mark.parametrize(("path", "scheme", "headers", "protocols", "require_tls", "expected"), [
    (SERIAL_URI, "wss", H, ["kubevbmc", "x-auth-token.abc"], False, Upgrade("serial", "abc", "kubevbmc")),
    (SCREEN_URI, "wss", H, ["binary", "x-auth-token.abc"], False, Upgrade("screen", "abc", "binary")),
    (SERIAL_URI, "ws", [*H, (b"x-auth-token", b"hdr")], [], False, Upgrade("serial", "hdr", None)),
    (SERIAL_URI, "wss", [*H, (b"origin", b"https://bmc.example:443")], ["x-auth-token.t"], False,
     Upgrade("serial", "t", None)),
    (SERIAL_URI, "wss", [*H, (b"origin", b"https://evil.example")], ["x-auth-token.t"], False,
     Refusal(403, "The page that opened this console is not this BMC's (Origin).")),
    (SERIAL_URI, "ws", [*H, (b"origin", b"https://bmc.example:443")], ["x-auth-token.t"], False,
     Refusal(403, "The page that opened this console is not this BMC's (Origin).")),
    (SERIAL_URI, "ws", H, ["x-auth-token.t"], True,
     Refusal(403, "This BMC accepts credentials over HTTPS only (spec.redfish.requireTLS): use wss://.")),
    (SERIAL_URI, "wss", H, ["kubevbmc"], False,
     Refusal(401, "No Redfish session: offer the subprotocol x-auth-token.<X-Auth-Token>.")),
    (SERIAL_URI, "wss", H, ["x-auth-token.a", "x-auth-token.b"], False,
     Refusal(400, "More than one session token offered.")),
    ("/consoles/other", "wss", H, ["x-auth-token.a"], False, Refusal(404, "no console at /consoles/other")),
], ids=["serial", "screen", "header-token", "same-origin", "other-origin", "origin-scheme", "require-tls",
        "no-token", "two-tokens", "unknown-path"])
def test_upgrade_decisions(path: str, scheme: str, headers: list[tuple[bytes, bytes]], protocols: list[str],
                           require_tls: bool, expected: Upgrade | Refusal) -> None:
    assert upgrade(path, scheme, headers, protocols, require_tls) == expected


@pytest.mark.parametrize(("origin", "scheme", "host", "same"), [
    (None, "ws", None, True),
    ("http://127.0.0.1:8080", "ws", "127.0.0.1:8080", True),
    ("HTTPS://BMC", "wss", "bmc", True),
    ("http://127.0.0.1:8080", "ws", "127.0.0.1:8081", False),
    ("null", "wss", "bmc", False),
    ("https://bmc", "wss", None, False),
])
def test_same_origin(origin: str | None, scheme: str, host: str | None, same: bool) -> None:
    assert same_origin(origin, scheme, host) is same


# ---------------------------------------------------------------- in this process, over a MemoryMachine


class Bmc:
    def __init__(self, server: BackgroundServer, machine: MemoryMachine, app: Any, serial: SerialHub) -> None:
        self.server, self.machine, self.app, self.serial = server, machine, app, serial
        self.port = server.ports[0]
        self.base = f"http://127.0.0.1:{self.port}"
        self.ws = f"ws://127.0.0.1:{self.port}"
        self.store = app.extensions["vbmc.sessions"]

    def login(self) -> tuple[str, str]:
        status, body, headers = redfish_full(self.base, "POST", "/redfish/v1/SessionService/Sessions",
                                             {"UserName": USER, "Password": PASSWORD})
        assert status == 201, body
        return headers["X-Auth-Token"], headers["Location"]


def redfish_full(base: str, method: str, path: str, body: Any = None, token: str = "") -> tuple[int, Any, Any]:
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **({"X-Auth-Token": token}
                                                                                      if token else {})})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None, resp.headers
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        return exc.code, json.loads(raw) if raw else None, exc.headers


def console_bmc(kind: type[B] | None = None, **options: Any) -> B:
    """A started BMC (`kind`, a Bmc) of a running memory machine with 2 viewer slots per console; `options` go to
    Consoles."""
    machine = MemoryMachine()
    machine.reset(ResetType.ON)
    throttle = LoginThrottle()
    access = ConsoleAccess(ipmi_sol=False, serial_uri=SERIAL_URI, screen_uri=SCREEN_URI, max_sessions=2)
    app = create_app(machine, USER, PASSWORD, throttle=throttle, consoles=access)
    serial = SerialHub(machine, "vm", max_viewers=2)
    consoles = Consoles(app.extensions["vbmc.sessions"], throttle, "vm", serial, ScreenHub(machine, "vm"),
                        **{"session_check": 0.1, **options})
    server = BackgroundServer(app, ServerConfig(http=f"127.0.0.1:{free_port()}"), web=WebFront(consoles))
    server.start()
    return (kind or Bmc)(server, machine, app, serial)  # type: ignore[return-value]


def stop_bmc(bmc: Bmc) -> None:
    bmc.server.stop()
    bmc.serial.stop()
    bmc.app.extensions["vbmc.events"].close()


@pytest.fixture
def bmc() -> Iterator[Bmc]:
    started: Bmc = console_bmc()
    yield started
    stop_bmc(started)


def open_serial(bmc: Bmc, token: str, **kwargs: Any) -> websocket.WebSocket:
    return websocket.create_connection(bmc.ws + SERIAL_URI, subprotocols=["kubevbmc", f"x-auth-token.{token}"],
                                       timeout=5, **kwargs)


def next_text(ws: websocket.WebSocket) -> Obj:
    while True:
        opcode, data = ws.recv_data()
        if opcode == websocket.ABNF.OPCODE_TEXT:
            return dict(json.loads(data))


def read_until(ws: websocket.WebSocket, needle: bytes, timeout: float = 5) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        ws.settimeout(max(0.01, deadline - time.monotonic()))
        opcode, data = ws.recv_data()
        if opcode == websocket.ABNF.OPCODE_BINARY:
            seen += data
        assert time.monotonic() < deadline, seen
    return seen


def closed_with(ws: websocket.WebSocket, timeout: float = 5) -> tuple[int, str]:
    """The code and reason of the server's close frame (read as a frame: the server may have gone already, so no
    close is sent back)."""
    deadline = time.monotonic() + timeout
    while True:
        ws.settimeout(max(0.01, deadline - time.monotonic()))
        frame = ws.recv_frame()
        if frame.opcode == websocket.ABNF.OPCODE_CLOSE:
            return int.from_bytes(frame.data[:2], "big"), frame.data[2:].decode()
        assert time.monotonic() < deadline


def refused(bmc: Bmc, path: str = SERIAL_URI, **kwargs: Any) -> tuple[int, Obj]:
    with pytest.raises(websocket.WebSocketBadStatusException) as exc:
        websocket.create_connection(bmc.ws + path, timeout=5, **kwargs).close()
    return exc.value.status_code, json.loads(exc.value.resp_body or b"{}")


def test_a_viewer_reads_and_types_on_the_serial_line(bmc: Bmc) -> None:
    token, _ = bmc.login()
    bmc.serial.join(lambda _: None, lambda *_: None)  # someone on SOL since the boot
    wait_for(lambda: bmc.machine.write_console(b"SeaBIOS\r\nvm login: "), what="the line attached")

    ws = open_serial(bmc, token)
    assert ws.subprotocol == "kubevbmc"  # never the token back
    assert next_text(ws) == {"Console": "serial", "Attached": True, "Message": "attached"}
    assert read_until(ws, b"vm login: ") == b"SeaBIOS\r\nvm login: "  # the recent output first
    ws.send_binary(b"root\r")
    ws.send("text too")
    wait_for(lambda: bytes(bmc.machine.console_input) == b"root\rtext too", what="the typed bytes on the line")
    bmc.machine.write_console(b"Password: ")
    assert read_until(ws, b"Password: ") == b"Password: "
    ws.close()


def test_the_token_may_come_as_the_redfish_header(bmc: Bmc) -> None:
    token, _ = bmc.login()
    ws = websocket.create_connection(bmc.ws + SERIAL_URI, header=[f"X-Auth-Token: {token}"], timeout=5)
    assert next_text(ws)["Console"] == "serial"
    ws.close()


def test_logging_out_closes_the_consoles(bmc: Bmc, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vbmc.audit")
    token, location = bmc.login()
    ws = open_serial(bmc, token)
    next_text(ws)
    status, _, _ = redfish_full(bmc.base, "DELETE", location, token=token)
    assert status == 204
    assert closed_with(ws) == (1008, "the Redfish session ended")
    wait_for(lambda: "closed: the Redfish session ended" in caplog.text, what="the audit line")
    line = next(r for r in caplog.records if "closed: the Redfish session ended" in r.getMessage())
    assert line.audit["user"] == USER and line.audit["action"] == "serial console"  # type: ignore[attr-defined]


def test_an_expired_session_closes_the_consoles(bmc: Bmc) -> None:
    token, _ = bmc.login()
    ws = open_serial(bmc, token)
    next_text(ws)
    store = bmc.app.extensions["vbmc.sessions"]
    store.timeout = 0.0  # every session is now past its inactivity timeout
    assert closed_with(ws) == (1008, "the Redfish session ended")


def test_refusals_before_anything_opens(bmc: Bmc, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vbmc.audit")
    token, _ = bmc.login()
    assert refused(bmc, subprotocols=["kubevbmc"])[0] == 401
    assert refused(bmc, subprotocols=["kubevbmc", "x-auth-token.not-a-session"])[0] == 401
    assert refused(bmc, SERIAL_URI + f"?token={token}")[0] == 401  # never from the URL
    status, body = refused(bmc, subprotocols=[f"x-auth-token.{token}"], origin="http://evil.example")
    assert status == 403 and body["error"]["code"] == "Base.1.19.GeneralError"
    assert body["error"]["message"].endswith(" The page that opened this console is not this BMC's (Origin).")
    assert refused(bmc, "/consoles/nothing", subprotocols=[f"x-auth-token.{token}"])[0] == 404
    assert "denied: No live Redfish session for this token." in caplog.text
    assert token not in caplog.text


def test_viewers_are_capped_and_the_refusal_says_why_in_words_a_browser_shows(bmc: Bmc) -> None:
    token, _ = bmc.login()
    first, second = open_serial(bmc, token), open_serial(bmc, token)
    # A browser never sees a refused upgrade's status (it reports 1006): the third viewer is let in to be told why.
    third = open_serial(bmc, token)
    why = "2 viewers already watch the serial console, the most it serves: close one (see the sessions view) or try " \
          "again later"
    assert next_text(third) == {"Console": "serial", "Attached": False, "Message": why}
    assert closed_with(third) == (1013, why)
    assert bmc.serial.viewers == 2
    first.close()
    wait_for(lambda: bmc.serial.viewers < 2, what="the first viewer gone")
    open_serial(bmc, token).close()
    second.close()


def test_a_source_locked_out_by_failed_logins_is_refused(bmc: Bmc) -> None:
    token, _ = bmc.login()
    for _ in range(12):
        redfish_full(bmc.base, "POST", "/redfish/v1/SessionService/Sessions", {"UserName": USER, "Password": "no"})
    status, _ = refused(bmc, subprotocols=[f"x-auth-token.{token}"])
    assert status == 429


def test_the_system_advertises_its_consoles(bmc: Bmc) -> None:
    token, _ = bmc.login()
    _, system, _ = redfish_full(bmc.base, "GET", "/redfish/v1/Systems/vm", token=token)
    assert system["SerialConsole"]["WebSocket"] == {"ServiceEnabled": True, "ConsoleURI": SERIAL_URI,
                                                    "Interactive": True}
    assert system["SerialConsole"]["IPMI"] == {"ServiceEnabled": False}
    assert system["GraphicalConsole"] == {"ServiceEnabled": False, "MaxConcurrentSessions": 2,
                                          "ConnectTypesSupported": ["KVMIP"]}  # MemoryMachine has no screen
    _, manager, _ = redfish_full(bmc.base, "GET", "/redfish/v1/Managers/BMC", token=token)
    assert manager["GraphicalConsole"]["ConnectTypesSupported"] == ["KVMIP"]


def test_fuzzed_upgrades_and_frames_are_answered_cleanly(bmc: Bmc) -> None:
    """Hostile handshakes and frames, bounded: each gets an HTTP status or a close, and the BMC still serves."""
    token, _ = bmc.login()
    rng = random.Random(23)
    port = bmc.server.ports[0]
    for i in range(150):
        lines = [f"GET {rng.choice([SERIAL_URI, SCREEN_URI, '/consoles', '/x'])} HTTP/1.1",
                 f"Host: 127.0.0.1:{port}", "Upgrade: websocket", "Connection: Upgrade",
                 f"Sec-WebSocket-Key: {rng.choice(['dGhlIHNhbXBsZSBub25jZQ==', '', 'x' * 40])}",
                 f"Sec-WebSocket-Version: {rng.choice(['13', '8', 'x'])}"]
        protocols = rng.sample(["kubevbmc", f"x-auth-token.{token}", "x-auth-token.", "x-auth-token.bad", "," * 3,
                                "\u00e9", "binary"], k=rng.randint(0, 3))
        if protocols:
            lines.append("Sec-WebSocket-Protocol: " + ", ".join(protocols))
        if rng.random() < 0.3:
            lines.append(f"Origin: {rng.choice(['null', 'http://x', f'http://127.0.0.1:{port}'])}")
        raw = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(raw)
            answer = sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 "), (i, raw, answer)
            if answer.startswith(b"HTTP/1.1 101"):
                frames = [rng.randbytes(rng.randint(1, 64)), struct.pack(">BB", 0x82, 0x7F) + b"\xff" * 8,
                          b"\x81\x85" + rng.randbytes(9)]
                sock.sendall(rng.choice(frames))
                sock.settimeout(2)
                try:
                    while sock.recv(4096):
                        pass
                except (TimeoutError, ConnectionResetError):
                    pass
    status, _, _ = redfish_full(bmc.base, "GET", "/redfish/v1/Systems/vm", token=token)
    assert status == 200
    ws = open_serial(bmc, token)
    assert next_text(ws)["Console"] == "serial"
    ws.close()


def test_a_screen_viewer_that_breaks_rfb_is_closed(bmc: Bmc) -> None:
    token, _ = bmc.login()
    ws = websocket.create_connection(bmc.ws + SCREEN_URI, subprotocols=["binary", f"x-auth-token.{token}"],
                                     timeout=5)
    ws.send_binary(b"RFB 009.000\n")
    code, reason = closed_with(ws)
    assert code == 1002 and reason.startswith("RFB: unsupported RFB version")


def test_the_page_is_served_with_its_security_headers(bmc: Bmc) -> None:
    import urllib.request

    with urllib.request.urlopen(bmc.base + "/", timeout=5) as resp:
        page = resp.read().decode()
        headers = resp.headers
    assert "<title>" in page and 'src="/ui/app.js"' in page
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert "frame-ancestors 'none'" in headers["Content-Security-Policy"]
    assert headers["X-Content-Type-Options"] == "nosniff"
    with urllib.request.urlopen(bmc.base + "/ui/app.js", timeout=5) as resp:
        assert resp.headers["Content-Type"] == "text/javascript; charset=utf-8"


# ---------------------------------------------------------------- an agent on kubesim


@pytest.fixture
def agent(sim: Sim, api: client.ApiClient, namespace: str, bmc_crd: None, tmp_path: Path) \
        -> Iterator[AgentProcess]:
    from ..support.agents import write_serving_certificate

    cert, key = write_serving_certificate(tmp_path)
    https = free_port()
    with agent_for_vm(sim, api, namespace, "--redfish-tls-address", f"127.0.0.1:{https}", "--tls-cert", str(cert),
                      "--tls-key", str(key)) as process:
        process.https = f"127.0.0.1:{https}"  # type: ignore[attr-defined]
        process.cafile = str(cert)  # type: ignore[attr-defined]
        yield process


def test_a_plain_websocket_client_reads_the_vms_serial_line_at_the_console_uri(
        agent: AgentProcess, api: client.ApiClient, namespace: str) -> None:
    status, _ = agent.redfish("POST", "/redfish/v1/Systems/vm/Actions/ComputerSystem.Reset", {"ResetType": "On"})
    assert status == 204
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=15, what="the VMI running")
    base = f"https://{agent.https}"  # type: ignore[attr-defined]
    tls = ssl.create_default_context(cafile=agent.cafile)  # type: ignore[attr-defined]
    status, _, headers = https_login(base, tls)
    assert status == 201
    token = headers["X-Auth-Token"]
    system = https_get(base, tls, "/redfish/v1/Systems/vm", token)
    uri = system["SerialConsole"]["WebSocket"]["ConsoleURI"]
    assert system["GraphicalConsole"]["ServiceEnabled"] is True

    ws = websocket.create_connection(f"wss://{agent.https}{uri}",  # type: ignore[attr-defined]
                                     subprotocols=["kubevbmc", f"x-auth-token.{token}"], sslopt={"context": tls},
                                     timeout=10)
    assert read_until(ws, b"vm login: ", timeout=10).endswith(b"vm login: ")
    ws.send_binary(b"operator\r")
    assert b"operator\r\nPassword: " in read_until(ws, b"Password: ")
    ws.close()

    screen = websocket.create_connection(f"wss://{agent.https}{SCREEN_URI}",  # type: ignore[attr-defined]
                                         subprotocols=["binary", f"x-auth-token.{token}"], sslopt={"context": tls},
                                         timeout=10)

    viewer = rfb_over(screen)
    viewer.handshake()

    def prompt() -> bool:
        viewer.request(incremental=False)
        viewer.read_update(timeout=2)
        return viewer.text().endswith("vm login:")

    wait_for(prompt, timeout=15, what="the login prompt on the screen")
    screen.close()
    assert "open serial console" in agent.output() and "open screen console" in agent.output()


def https_login(base: str, tls: ssl.SSLContext) -> tuple[int, Any, Any]:
    import urllib.request

    request = urllib.request.Request(base + "/redfish/v1/SessionService/Sessions", method="POST",
                                     data=json.dumps({"UserName": USER, "Password": PASSWORD}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5, context=tls) as resp:
        return resp.status, json.loads(resp.read()), resp.headers


def https_get(base: str, tls: ssl.SSLContext, path: str, token: str) -> Obj:
    import urllib.request

    request = urllib.request.Request(base + path, headers={"X-Auth-Token": token})
    with urllib.request.urlopen(request, timeout=5, context=tls) as resp:
        return dict(json.loads(resp.read()))


