"""Virtual media from the operator's disk (vbmc/web/upload.py): `POST /ui/media/<slot>/upload?name=...` with a Redfish
session, the file as the body. First the decisions as pure functions, then every refusal in this process over a
MemoryMachine, then through a real agent on kubesim, where the body streams through CDI's upload proxy
(kubesim/upload.py) into the VM's medium: a 300 MB image, its time and the agent's memory measured on the way."""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from vbmc.access.throttle import LoginThrottle
from vbmc.machine import MediaState, ResetType, VirtualMedia
from vbmc.machine.console import SerialHub
from vbmc.machine.memory import MemoryMachine
from vbmc.machine.screen import ScreenHub
from vbmc.redfish import create_app, resources
from vbmc.redfish.server import BackgroundServer, ServerConfig
from vbmc.web import Consoles, MediaUploads, WebFront
from vbmc.web.upload import HEAD, Caller, Refusal, Upload, caller, is_iso9660, upload_of

from ..support.agents import PASSWORD, USER, AgentProcess, agent_for_vm, free_port
from ..support.cluster import Sim, call, wait_for
from ..support.vms import get_vm

Obj = dict[str, Any]
MB = 10**6
MI = 2**20
DVS = "/apis/cdi.kubevirt.io/v1beta1/namespaces/{ns}/datavolumes"
MEDIA = "/redfish/v1/Managers/BMC/VirtualMedia/Cd"
# The agent's resident memory may grow by at most this much while 300 MB stream through it: the body is handed on a
# chunk (1 MiB) at a time, so its size must not show; the margin is for the allocator's arenas, TLS buffers and the
# thread that writes to the proxy.
RSS_GROWTH_BOUND = 40 * MB


def iso_head(size: int = HEAD) -> bytes:
    """The first bytes of an ISO 9660 image: 16 empty sectors, then a primary volume descriptor."""
    head = bytearray(size)
    head[32768:32775] = b"\x01CD001\x01"
    return bytes(head)


# ---------------------------------------------------------------- the decisions, pure functions


@pytest.mark.parametrize(("head", "iso"), [
    (iso_head(), True),
    (iso_head(40000), True),
    (bytes(32768) + b"\x00CD001\x01", True),  # a boot record (El Torito) first: CD001 all the same
    (bytes(32768) + b"\x00BEA01\x01", False),  # UDF without the ISO 9660 bridge
    (bytes(HEAD), False),
    (b"QFI\xfb" + bytes(HEAD), False),  # a qcow2 image
    (iso_head()[: HEAD - 1], False),  # too short to tell
    (bytes(32770) + b"CD001", False),  # one byte off
], ids=["pvd", "longer", "el-torito", "udf-only", "zeros", "qcow2", "short", "off-by-one"])
def test_an_iso_9660_image_is_known_by_cd001_at_byte_32769(head: bytes, iso: bool) -> None:
    assert is_iso9660(head) is iso


H = [(b"host", b"bmc.example:443")]
T = [(b"x-auth-token", b"tok")]


@pytest.mark.parametrize(("path", "scheme", "headers", "require_tls", "expected"), [
    ("/ui/media/Cd/upload", "https", [*H, *T], False, Caller("Cd", "tok")),
    ("/ui/media/Cd/upload", "https", [*H, *T, (b"origin", b"https://bmc.example:443")], False, Caller("Cd", "tok")),
    ("/ui/media/Cd/upload", "https", [*H, *T, (b"origin", b"https://evil.example")], False, 403),
    ("/ui/media/Cd/upload", "http", [*H, *T, (b"origin", b"https://bmc.example:443")], False, 403),
    ("/ui/media/Cd/upload", "http", [*H, *T], True, 403),
    ("/ui/media/Cd/upload", "https", H, False, 401),
    ("/ui/media/Cd/other", "https", [*H, *T], False, 404),
], ids=["token", "same-origin", "other-origin", "origin-scheme", "require-tls", "no-token", "not-upload"])
def test_who_may_upload_where(path: str, scheme: str, headers: list[tuple[bytes, bytes]], require_tls: bool,
                              expected: Caller | int) -> None:
    decided = caller(path, scheme, headers, require_tls)
    assert decided == expected if isinstance(expected, Caller) else (
        isinstance(decided, Refusal) and decided.status == expected)


def length(n: int) -> tuple[bytes, bytes]:
    return (b"content-length", str(n).encode())


OCTETS = (b"content-type", b"application/octet-stream")


@pytest.mark.parametrize(("query", "headers", "expected"), [
    (b"name=debian.iso", [OCTETS, length(10 * MI)], Upload("debian.iso", 10 * MI)),
    (b"name=C%3A%5Cisos%5Cdebian.iso", [length(MI)], Upload("debian.iso", MI)),  # a path: its last part
    (b"name=my%20disk.iso", [(b"content-type", b"application/x-iso9660-image"), length(MI)],
     Upload("my disk.iso", MI)),
    (b"", [OCTETS, length(MI)], 400),
    (b"name=a%0Ab.iso", [OCTETS, length(MI)], 400),
    (b"name=x.iso", [(b"content-type", b"multipart/form-data; boundary=x"), length(MI)], 415),
    (b"name=x.iso", [OCTETS], 411),
    (b"name=x.iso", [OCTETS, (b"transfer-encoding", b"chunked")], 411),
    (b"name=x.iso", [OCTETS, (b"content-length", b"lots")], 400),
    (b"name=x.iso", [OCTETS, length(2**30 + 1)], 413),
    (b"name=x.iso", [OCTETS, length(1000)], 415),
], ids=["octets", "windows-path", "iso-type", "no-name", "control-char", "form", "no-length", "chunked",
        "bad-length", "too-large", "too-small"])
def test_what_is_uploaded(query: bytes, headers: list[tuple[bytes, bytes]], expected: Upload | int) -> None:
    decided = upload_of(query, headers, 2**30)
    assert decided == expected if isinstance(expected, Upload) else (
        isinstance(decided, Refusal) and decided.status == expected), decided


@pytest.mark.parametrize(("media", "shown"), [
    (VirtualMedia("Cd", "upload:my%20disk.iso", True, True, MediaState.INSERTED),
     {"Image": "upload:my%20disk.iso", "ImageName": "my disk.iso", "Inserted": True, "ConnectedVia": "Applet",
      "TransferMethod": "Upload", "TransferProtocolType": None}),
    (VirtualMedia("Cd", "upload:x.iso", False, True, MediaState.INSERTING, "uploading x.iso from a client", 40),
     {"Image": "upload:x.iso", "ImageName": "x.iso", "Inserted": False, "ConnectedVia": "Applet",
      "TransferMethod": "Upload", "TransferProtocolType": None}),
    (VirtualMedia("Cd", "https://host/boot.iso", True, True, MediaState.INSERTED),
     {"Image": "https://host/boot.iso", "ImageName": "boot.iso", "Inserted": True, "ConnectedVia": "URI",
      "TransferMethod": "Stream", "TransferProtocolType": "HTTPS"}),
], ids=["uploaded", "uploading", "url"])
def test_redfish_shows_an_uploaded_medium_as_connected_from_a_client_application(media: VirtualMedia,
                                                                                 shown: Obj) -> None:
    # VirtualMedia v1.6.5 (the agent's): ConnectedVia Applet since v1.0, TransferMethod Upload since v1.3; DMTF's
    # Service Validator passes such a document.
    doc = resources.virtual_media("/redfish/v1/Managers/BMC/VirtualMedia", media)
    assert {key: doc[key] for key in shown} == shown


# ---------------------------------------------------------------- in this process, over a MemoryMachine


class Bmc:
    def __init__(self, server: BackgroundServer, machine: MemoryMachine) -> None:
        self.server, self.machine = server, machine
        self.port = server.ports[0]
        self.base = f"http://127.0.0.1:{self.port}"

    def login(self) -> str:
        status, _, headers = request(self.port, "POST", "/redfish/v1/SessionService/Sessions",
                                     json.dumps({"UserName": USER, "Password": PASSWORD}).encode(),
                                     {"Content-Type": "application/json"})
        assert status == 201
        return headers["X-Auth-Token"]


def request(port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
            host: str = "127.0.0.1") -> tuple[int, Any, dict[str, str]]:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        raw = response.read()
        parsed = json.loads(raw) if raw and raw[:1] == b"{" else raw
        return response.status, parsed, dict(response.getheaders())
    finally:
        conn.close()


def post_upload(port: int, token: str, body: bytes, name: str = "test.iso", **extra: str) -> tuple[int, Any]:
    headers = {"Content-Type": "application/octet-stream", **({"X-Auth-Token": token} if token else {}), **extra}
    status, parsed, _ = request(port, "POST", f"/ui/media/Cd/upload?name={name}", body, headers)
    return status, parsed


@pytest.fixture
def bmc() -> Iterator[Bmc]:
    machine = MemoryMachine()
    machine.reset(ResetType.ON)
    machine.media_max_size = 10 * MI
    throttle = LoginThrottle()
    app = create_app(machine, USER, PASSWORD, throttle=throttle)
    sessions = app.extensions["vbmc.sessions"]
    serial = SerialHub(machine, "vm")
    consoles = Consoles(sessions, throttle, "vm", serial, ScreenHub(machine, "vm"))
    uploads = MediaUploads(machine, sessions, throttle, "vm")
    server = BackgroundServer(app, ServerConfig(http=f"127.0.0.1:{free_port()}"),
                              web=WebFront(consoles, uploads=uploads))
    with server:
        yield Bmc(server, machine)
    uploads.close()
    serial.stop()
    app.extensions["vbmc.events"].close()


def test_every_refusal_comes_before_anything_is_done_and_says_why(bmc: Bmc) -> None:
    token = bmc.login()
    iso = iso_head(64 * 1024)
    status, body = post_upload(bmc.port, "", iso)
    assert status == 401 and body["error"]["code"] == "Base.1.19.NoValidSession"
    assert post_upload(bmc.port, "not-a-session", iso)[0] == 401
    status, body = post_upload(bmc.port, token, iso, Origin="http://evil.example")
    assert status == 403 and "Origin" in body["error"]["message"]
    assert post_upload(bmc.port, token, iso, Origin=bmc.base)[0] != 403  # the page's own origin
    status, body = post_upload(bmc.port, token, b"MZ" + bytes(64 * 1024), name="setup.exe")
    assert status == 415
    assert "setup.exe is not an ISO 9660 image" in body["error"]["message"]
    assert body["error"]["@Message.ExtendedInfo"][0]["MessageId"] == "Base.1.19.GeneralError"
    status, body = post_upload(bmc.port, token, bytes(11 * MI), name="big.iso")
    assert status == 413 and "big.iso is 0.0 GiB, more than this BMC takes" in body["error"]["message"]
    status, body, _ = request(bmc.port, "POST", "/ui/media/Floppy/upload?name=x.iso", iso,
                              {"X-Auth-Token": token, "Content-Type": "application/octet-stream"})
    assert status == 404
    status, body = post_upload(bmc.port, token, iso, name="")
    assert status == 400
    # Past every check, a machine that takes no uploads says so, as InsertMedia on a slot without a drive.
    status, body = post_upload(bmc.port, token, iso)
    assert status == 400 and body["error"]["code"] == "Base.1.19.ActionNotSupported"
    entries = [e.fields["result"] for e in bmc.machine.audit_trail.entries()]
    assert sum(str(r).startswith("refused") for r in entries) >= 8


def test_a_refusal_is_the_error_the_redfish_service_gives_for_the_same_condition(bmc: Bmc) -> None:
    status, upload = post_upload(bmc.port, "not-a-session", iso_head(64 * 1024))
    service_status, service, _ = request(bmc.port, "GET", "/redfish/v1/Systems", headers={"X-Auth-Token":
                                                                                           "not-a-session"})
    assert status == service_status == 401
    assert upload["error"]["code"] == service["error"]["code"] == "Base.1.19.NoValidSession"
    assert upload["error"]["@Message.ExtendedInfo"] == service["error"]["@Message.ExtendedInfo"]
    assert upload["error"]["message"] == f"{service['error']['message']} No live Redfish session for this token."

    # A refusal of the upload's own: a Base registry message, the reason after the registry's text (DSP0266 9.6).
    token = bmc.login()
    status, body = post_upload(bmc.port, token, b"MZ" + bytes(64 * 1024), name="setup.exe")
    general = ("A general error has occurred.  See Resolution for information on how to resolve the error, or "
               "@Message.ExtendedInfo if Resolution is not provided.")
    why = f"setup.exe is not an ISO 9660 image (no CD001 at byte {HEAD - 5}): only CD and DVD images can be inserted."
    assert status == 415
    assert body == {"error": {"code": "Base.1.19.GeneralError", "message": f"{general} {why}",
                              "@Message.ExtendedInfo": [{
                                  "@odata.type": "#Message.v1_2_1.Message", "MessageId": "Base.1.19.GeneralError",
                                  "Message": general, "MessageArgs": [], "MessageSeverity": "Critical",
                                  "Resolution": "None."}]}}


def test_an_upload_without_a_length_is_411(bmc: Bmc) -> None:
    token = bmc.login()
    conn = http.client.HTTPConnection("127.0.0.1", bmc.port, timeout=10)
    conn.putrequest("POST", "/ui/media/Cd/upload?name=x.iso")
    conn.putheader("X-Auth-Token", token)
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    conn.send(b"10\r\n" + bytes(16) + b"\r\n0\r\n\r\n")
    response = conn.getresponse()
    assert response.status == 411
    message = json.loads(response.read())["error"]["message"]
    assert message.endswith(" x.iso: the upload needs a Content-Length (the file's size).")
    conn.close()


def test_a_refusal_reaches_a_client_still_sending_a_large_body(bmc: Bmc) -> None:
    """A browser sends the whole file before it reads the answer: the BMC reads on a little after refusing, so the
    refusal arrives instead of a reset connection."""
    token = bmc.login()
    conn = http.client.HTTPConnection("127.0.0.1", bmc.port, timeout=10)
    conn.putrequest("POST", "/ui/media/Cd/upload?name=notes.txt")
    conn.putheader("X-Auth-Token", token)
    conn.putheader("Content-Type", "application/octet-stream")
    conn.putheader("Content-Length", str(8 * MI))
    conn.endheaders()
    for _ in range(8):
        conn.send(b"plain text\n" * (MI // 11) + b"x" * (MI % 11))
    response = conn.getresponse()
    assert response.status == 415 and response.getheader("Connection") == "close"
    conn.close()


# ---------------------------------------------------------------- an agent on kubesim


@pytest.fixture
def agent(sim: Sim, api: client.ApiClient, namespace: str, bmc_crd: None) -> Iterator[AgentProcess]:
    with agent_for_vm(sim, api, namespace) as process:
        yield process


def agent_login(agent: AgentProcess) -> str:
    status, _, headers = request(agent.http_port, "POST", "/redfish/v1/SessionService/Sessions",
                                 json.dumps({"UserName": USER, "Password": PASSWORD}).encode(),
                                 {"Content-Type": "application/json"})
    assert status == 201
    return headers["X-Auth-Token"]


def make_iso(path: Path, size: int, blocks: int) -> None:
    """A sparse-ish ISO: a file of `size` bytes made with truncate, a primary volume descriptor at sector 16, and
    `blocks` random 1 MiB blocks spread over it."""
    with open(path, "wb") as fh:
        fh.truncate(size)
        fh.seek(32768)
        fh.write(b"\x01CD001\x01" + b"KUBEVBMC TEST".ljust(32) + b"UPLOAD".ljust(32))
        rnd = random.Random(size)
        for index in range(blocks):
            fh.seek(MI + index * ((size - 2 * MI) // blocks))
            fh.write(rnd.randbytes(MI))


def vm_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


class RssSampler:
    """The process's VmRSS every few milliseconds, in a thread, while a `with` block runs."""

    def __init__(self, pid: int, every: float = 0.01) -> None:
        self.pid, self.every = pid, every
        self.baseline = vm_rss(pid)
        self.peak = self.baseline
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, vm_rss(self.pid))
            self.samples += 1
            self._stop.wait(self.every)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    @property
    def growth(self) -> int:
        return self.peak - self.baseline


def stream_file(port: int, token: str, path: Path, name: str, *, stop_after: int | None = None,
                ) -> tuple[int, Any] | socket.socket:
    """POST the file as a browser does (Content-Length, then its bytes); with `stop_after`, the socket once that many
    bytes are sent, the rest never (for the caller to close: the page's Cancel)."""
    size = path.stat().st_size
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    head = (f"POST /ui/media/Cd/upload?name={name} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Origin: http://127.0.0.1:{port}\r\nX-Auth-Token: {token}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {size}\r\n\r\n")
    sock.sendall(head.encode())
    sent = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(MI):
            if stop_after is not None and sent >= stop_after:
                return sock
            sock.sendall(chunk)
            sent += len(chunk)
    response = http.client.HTTPResponse(sock)
    response.begin()
    raw = response.read()
    sock.close()
    return response.status, json.loads(raw) if raw else None


def datavolume_status(api: client.ApiClient, ns: str) -> int:
    return call(api, "GET", DVS.format(ns=ns) + "/vm-cdrom").status


def media(agent: AgentProcess) -> Obj:
    status, body = agent.redfish("GET", MEDIA)
    assert status == 200
    return dict(body)


def test_a_300_mb_iso_streams_into_the_vm_with_the_agents_memory_bounded(
        agent: AgentProcess, api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    iso = tmp_path / "debian-300.iso"
    make_iso(iso, 300 * MB, 30)
    token = agent_login(agent)
    with RssSampler(agent.proc.pid) as rss:
        started = time.monotonic()
        answer = stream_file(agent.http_port, token, iso, "debian-300.iso")
        took = time.monotonic() - started
    print(f"\nupload of 300 MB through the agent into kubesim's CDI: {took:.2f} s "
          f"({300 / took:.0f} MB/s); agent VmRSS {rss.baseline / MB:.1f} MB before, peak {rss.peak / MB:.1f} MB, "
          f"growth {rss.growth / MB:.1f} MB ({rss.samples} samples)")
    assert answer == (201, {"Image": "upload:debian-300.iso", "Inserted": True})
    assert rss.growth < RSS_GROWTH_BOUND, f"the agent grew by {rss.growth / MB:.1f} MB"

    volumes = get_vm(api, namespace)["spec"]["template"]["spec"]["volumes"]
    assert {"name": "cdrom", "dataVolume": {"name": "vm-cdrom"}} in volumes
    dv = call(api, "GET", DVS.format(ns=namespace) + "/vm-cdrom").body
    assert dv["spec"]["source"] == {"upload": {}} and dv["status"]["phase"] == "Succeeded"
    assert dv["metadata"]["annotations"]["bmc.kubevirt.io/upload-name"] == "debian-300.iso"
    assert dv["metadata"]["ownerReferences"][0]["kind"] == "VirtualMachineBMC"
    shown = media(agent)
    assert shown["Inserted"] is True and shown["Image"] == "upload:debian-300.iso"
    assert shown["ImageName"] == "debian-300.iso" and shown["ConnectedVia"] == "Applet"
    assert shown["TransferMethod"] == "Upload" and shown["TransferProtocolType"] is None

    # A medium in the slot: the same refusal as InsertMedia's.
    status, body = post_upload(agent.http_port, token, iso_head(64 * 1024))
    assert status == 409 and body["error"]["code"] == "Base.1.19.ResourceInUse"
    assert body["error"]["message"].endswith(" a medium is already inserted: eject it first")
    status, _ = agent.redfish("POST", f"{MEDIA}/Actions/VirtualMedia.EjectMedia", {})
    assert status == 204
    wait_for(lambda: datavolume_status(api, namespace) == 404, what="the uploaded medium's DataVolume gone")
    assert "upload debian-300.iso into Cd" in agent.output()


def test_a_file_that_is_not_an_iso_is_415_and_leaves_no_datavolume(agent: AgentProcess, api: client.ApiClient,
                                                                   namespace: str, tmp_path: Path) -> None:
    token = agent_login(agent)
    disk = tmp_path / "disk.qcow2"
    with open(disk, "wb") as fh:
        fh.write(b"QFI\xfb" + bytes(100))
        fh.truncate(8 * MI)
    answer = stream_file(agent.http_port, token, disk, "disk.qcow2")
    assert isinstance(answer, tuple) and answer[0] == 415
    assert "disk.qcow2 is not an ISO 9660 image" in answer[1]["error"]["message"]
    assert datavolume_status(api, namespace) == 404
    assert media(agent)["Inserted"] is False


def test_a_cancelled_upload_leaves_no_datavolume_and_the_slot_empty(agent: AgentProcess, api: client.ApiClient,
                                                                    namespace: str, tmp_path: Path) -> None:
    iso = tmp_path / "big.iso"
    make_iso(iso, 200 * MB, 4)
    token = agent_login(agent)
    sock = stream_file(agent.http_port, token, iso, "big.iso", stop_after=40 * MI)
    assert isinstance(sock, socket.socket)
    # The upload is under way: its DataVolume exists and the slot shows the upload, not yet inserted.
    wait_for(lambda: datavolume_status(api, namespace) == 200, what="the upload's DataVolume")
    uploading = wait_for(lambda: (m := media(agent))["Image"] == "upload:big.iso" and m, what="the upload shown")
    assert uploading["Inserted"] is False and uploading["Status"]["State"] == "Starting"
    sock.close()  # the page's Cancel: the XHR aborted
    wait_for(lambda: datavolume_status(api, namespace) == 404, what="the cancelled upload's DataVolume removed")
    shown = wait_for(lambda: (m := media(agent))["Image"] is None and m, what="the slot empty again")
    assert shown["Inserted"] is False and shown["ConnectedVia"] == "NotConnected"
    assert "volumes" not in get_vm(api, namespace)["spec"]["template"]["spec"] or all(
        v["name"] != "cdrom" for v in get_vm(api, namespace)["spec"]["template"]["spec"]["volumes"])
    wait_for(lambda: "cancelled: the client went away" in agent.output(), what="the audit line")


def test_an_upload_without_a_session_is_401_on_the_agent(agent: AgentProcess, api: client.ApiClient,
                                                         namespace: str) -> None:
    status, body = post_upload(agent.http_port, "", iso_head(64 * 1024))
    assert status == 401 and body["error"]["message"]
    assert datavolume_status(api, namespace) == 404
    assert os.path.exists(f"/proc/{agent.proc.pid}")
