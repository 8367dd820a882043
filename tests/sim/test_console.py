"""kubesim's serial console: virt-api's `virtualmachineinstances/console` WebSocket and the guest behind it.

The pure parts (boot order, the getty, a line and its clients) are tested on their own; the WebSocket is tested
through kubesim's TLS listener with websocket-client, as the agent reaches it."""

from __future__ import annotations

import base64
import json
import select
import ssl
import time
from dataclasses import dataclass
from typing import Any

import pytest
import websocket
import yaml
from kubernetes import client, config

from kubesim.cluster import Cluster, SimConfig
from kubesim.console import (
    BUFFER_LIMIT,
    CDROM_TEXT,
    DISK_TEXT,
    FIRMWARE_TEXT,
    KERNEL_TEXT,
    NETWORK_TEXT,
    NO_BOOT_TEXT,
    NO_CDROM_TEXT,
    REBOOT_TEXT,
    SHUTDOWN_TEXT,
    TAKEN_OVER,
    BootDevice,
    Domain,
    GuestTty,
    SerialConsoles,
    SerialLine,
    boot_sequence,
    boot_text,
)

from ..support.cluster import Sim, address_ranges, call, wait_for
from ..support.vms import get_vmi, make_vm, running_vmi_uid

Obj = dict[str, Any]
PROTOCOL = "plain.kubevirt.io"
PROMPT = b"vm login: "
BOOT = FIRMWARE_TEXT + DISK_TEXT + KERNEL_TEXT + b"\r\n\r\n" + PROMPT


# ---------------------------------------------------------------- the boot order the guest boots from


def devices(disks: list[Obj], interfaces: list[Obj] | None = None, volumes: tuple[str, ...] = ("root", "cd")) -> Obj:
    return {"domain": {"devices": {"disks": disks, "interfaces": interfaces or []}},
            "volumes": [{"name": v, "containerDisk": {"image": "x"}} for v in volumes]}


ROOT, CD, NIC = {"name": "root", "disk": {}}, {"name": "cd", "cdrom": {}}, {"name": "default", "masquerade": {}}


@pytest.mark.parametrize(("spec", "expected"), [
    (devices([ROOT, CD], [NIC]), [BootDevice("disk", "root"), BootDevice("cdrom", "cd")]),
    (devices([CD, ROOT]), [BootDevice("cdrom", "cd"), BootDevice("disk", "root")]),
    (devices([{**ROOT, "bootOrder": 2}, {**CD, "bootOrder": 1}], [NIC]),
     [BootDevice("cdrom", "cd"), BootDevice("disk", "root")]),
    (devices([{**ROOT, "bootOrder": 2}, CD], [{**NIC, "bootOrder": 1}]),
     [BootDevice("network", "default"), BootDevice("disk", "root")]),
    (devices([ROOT, {**CD, "bootOrder": 1}], volumes=("root",)), [BootDevice("cdrom", "cd", media=False)]),
    ({}, []),
], ids=["declared-order", "cdrom-declared-first", "boot-order", "network-first", "only-numbered-empty-cdrom",
        "no-devices"])
def test_boot_sequence_follows_the_boot_order(spec: Obj, expected: list[BootDevice]) -> None:
    assert boot_sequence(spec) == expected


@pytest.mark.parametrize(("spec", "device_text", "prompt"), [
    (devices([ROOT, CD]), DISK_TEXT, True),
    (devices([{**CD, "bootOrder": 1}, {**ROOT, "bootOrder": 2}]), CDROM_TEXT, True),
    (devices([ROOT], [{**NIC, "bootOrder": 1}]), NETWORK_TEXT, True),
    (devices([{**CD, "bootOrder": 1}, {**ROOT, "bootOrder": 2}], volumes=("root",)), NO_CDROM_TEXT + DISK_TEXT, True),
    (devices([{**CD, "bootOrder": 1}], volumes=()), NO_CDROM_TEXT + NO_BOOT_TEXT, False),
], ids=["hard-disk", "dvd", "ipxe", "empty-dvd-falls-through", "nothing-bootable"])
def test_boot_text_names_the_device_booted(spec: Obj, device_text: bytes, prompt: bool) -> None:
    text, up = boot_text("vm", spec)

    assert text.startswith(FIRMWARE_TEXT + device_text)
    assert up is prompt
    assert text.endswith(KERNEL_TEXT + b"\r\n\r\nvm login: ") is prompt


# ---------------------------------------------------------------- the getty


@pytest.mark.parametrize(("typed", "shown"), [
    (b"\r", b"\r\nvm login: "),
    (b"\n", b"\r\nvm login: "),
    (b"\r\n", b"\r\nvm login: "),  # one Enter, not two
    (b"\r\x00", b"\r\nvm login: "),
    (b"root\r", b"root\r\nPassword: "),
    (b"root\rsecret\r", b"root\r\nPassword: \r\n\r\nLogin incorrect\r\nvm login: "),
    (b"rox\x7ft", b"rox\b \bt"),
    (b"ro\x08\x08\x08", b"ro\b \b\b \b"),
    (b"abc\x15", b"abc\b \b\b \b\b \b"),
    (b"ab\x03", b"ab^C\r\nvm login: "),
    (b"root\rpw\x03", b"root\r\nPassword: ^C\r\nvm login: "),
    (b"\x1b[A", b"^[[A"),
    (b"a\tb", b"a\tb"),
    (b"\xff\xfe", b"\xff\xfe"),
], ids=repr)
def test_the_getty_echoes_and_answers(typed: bytes, shown: bytes) -> None:
    assert GuestTty("vm").receive(typed) == shown


def test_binary_noise_never_breaks_the_getty() -> None:
    tty = GuestTty("vm")
    tty.receive(bytes(range(256)) * 64)

    assert tty.receive(b"\x03\r").endswith(b"\r\nvm login: ")


def test_an_overlong_line_is_cut() -> None:
    tty = GuestTty("vm")

    assert len(tty.receive(b"x" * 1000)) == 255


# ---------------------------------------------------------------- one line, its clients


def booted_line(spec: Obj | None = None) -> SerialLine:
    line = SerialLine("ns", "vm", "uid-1")
    line.boot(spec if spec is not None else devices([ROOT]))
    return line


def test_output_with_no_client_is_kept_for_the_next_one_and_bounded() -> None:
    line = booted_line()
    first = line.attach()
    first.close()
    for _ in range(BUFFER_LIMIT // 10):
        line.reboot(devices([ROOT]), soft=True)

    kept = line.attach().take()

    assert kept is not None
    assert len(kept) == BUFFER_LIMIT
    assert kept.endswith(PROMPT)


def test_a_new_client_takes_over_and_the_old_one_is_told() -> None:
    line = booted_line()
    first = line.attach()
    assert first.take() == BOOT

    second = line.attach()
    second.feed(b"x")

    assert first.take() is None
    assert first.reason == TAKEN_OVER
    assert second.take() == b"x"


def test_an_ended_line_gives_what_is_left_then_ends() -> None:
    line = booted_line()
    client_ = line.attach()
    line.shut_down()
    line.end("VMI vm is no longer running")

    assert client_.take() == BOOT + SHUTDOWN_TEXT
    assert client_.take() is None
    assert client_.reason == "VMI vm is no longer running"


def test_a_connection_that_takes_the_last_output_is_woken_again_for_the_end() -> None:
    # A connection waits on the client's wake-up; the end must not hide behind the output taken just before it.
    line = booted_line()
    client_ = line.attach()
    line.end("VMI vm is no longer running")
    assert select.select([client_], [], [], 0)[0] == [client_]
    assert client_.take() == BOOT
    assert select.select([client_], [], [], 0)[0] == [client_]
    assert client_.take() is None


def test_input_while_paused_is_read_when_the_guest_runs_again() -> None:
    line = booted_line()
    client_ = line.attach()
    client_.take()
    line.set_paused(True)

    client_.feed(b"root\r")
    assert client_.take() == b""
    line.set_paused(False)

    assert client_.take() == b"root\r\nPassword: "


def test_the_client_wakes_when_there_is_output() -> None:
    line = booted_line()
    client_ = line.attach()
    client_.take()
    assert select.select([client_], [], [], 0)[0] == []

    line.reboot(devices([ROOT]), soft=False)

    assert select.select([client_], [], [], 1)[0] == [client_]
    assert client_.take() == BOOT


def domain(uid: str, *, running: bool = True, stopping: bool = False, serial: bool = True,
           graphics: bool = True) -> Domain:
    return Domain(uid=uid, running=running, serial=serial, stopping=stopping, paused=False, spec=devices([ROOT]),
                  graphics=graphics)


def test_consoles_follow_the_vmi_uid() -> None:
    consoles = SerialConsoles()
    first = consoles.settle("ns", "vm", domain("a"))
    assert first is not None
    assert consoles.settle("ns", "vm", domain("a")) is first

    second = consoles.settle("ns", "vm", domain("b"))

    assert first.ended
    assert second is not None and second is not first and second.uid == "b"
    assert consoles.settle("ns", "vm", domain("a")) is None  # a stale read of the old VMI brings nothing back
    assert second.ended


@pytest.mark.parametrize("gone", [None, domain("a", running=False)], ids=["deleted", "final"])
def test_a_line_ends_when_its_vmi_stops_running(gone: Domain | None) -> None:
    consoles = SerialConsoles()
    line = consoles.settle("ns", "vm", domain("a"))

    assert consoles.settle("ns", "vm", gone) is None
    assert line is not None and line.ended
    assert consoles.lines() == []


def test_no_guest_line_without_a_serial_console_or_a_screen() -> None:
    assert SerialConsoles().settle("ns", "vm", domain("a", serial=False, graphics=False)) is None
    assert SerialConsoles().settle("ns", "vm", domain("a", serial=False)) is not None  # the screen has a guest


# ---------------------------------------------------------------- over kubesim's API (TLS, websocket-client)


@dataclass
class Endpoint:
    """Where a console client connects, and with what: kubesim's URL, a bearer token and its CA."""

    url: str
    token: str
    tls: ssl.SSLContext


def endpoint(kubeconfig: str) -> Endpoint:
    with open(kubeconfig, encoding="utf-8") as fh:
        config = yaml.safe_load(fh)
    ca = base64.b64decode(config["clusters"][0]["cluster"]["certificate-authority-data"]).decode()
    return Endpoint(config["clusters"][0]["cluster"]["server"], config["users"][0]["user"]["token"],
                    ssl.create_default_context(cadata=ca))


@pytest.fixture(scope="module")
def kube(sim: Sim) -> Endpoint:
    return endpoint(sim.kubeconfig)


def connect(kube: Endpoint, ns: str, name: str = "vm", token: str | None = "") -> websocket.WebSocket:
    """A console connection as the agent opens it; `token` None sends no Authorization header."""
    url = (kube.url.replace("https://", "wss://") +
           f"/apis/subresources.kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances/{name}/console")
    header = [] if token is None else [f"Authorization: Bearer {token or kube.token}"]
    return websocket.create_connection(url, header=header, subprotocols=[PROTOCOL], sslopt={"context": kube.tls},
                                       timeout=5)


def refusal(kube: Endpoint, ns: str, name: str = "vm", token: str | None = "") -> tuple[int, Obj]:
    """The HTTP status and Status body of a console request the server refuses before the upgrade."""
    with pytest.raises(websocket.WebSocketBadStatusException) as refused:
        connect(kube, ns, name, token).close()
    return refused.value.status_code, json.loads(refused.value.resp_body or b"{}")


def read_until(ws: websocket.WebSocket, needle: bytes, timeout: float = 5.0) -> bytes:
    """Everything received until `needle` has been seen (binary frames only, as virt-api sends)."""
    seen = b""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {needle!r} in {seen!r}"
        ws.settimeout(left)
        opcode, data = ws.recv_data()
        assert opcode == websocket.ABNF.OPCODE_BINARY, (opcode, data)
        seen += data
    return seen


def wait_closed(ws: websocket.WebSocket, timeout: float = 5.0) -> tuple[bytes, int]:
    """What arrives until the server closes the connection, and the code of its close frame."""
    seen = b""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"still open after {seen!r}"
        ws.settimeout(left)
        opcode, frame = ws.recv_data_frame()
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            return seen, int.from_bytes(frame.data[:2], "big")
        seen += frame.data


def running_vm(api: client.ApiClient, ns: str, name: str = "vm", **template: Any) -> str:
    """A VM (tests/support/vms.py's, its template merged with `template`) started, and its VMI's uid once Running."""
    make_vm(api, ns, name)
    body = {"spec": {"runStrategy": "Always", "template": {"spec": template}}}
    reply = call(api, "PATCH", f"/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachines/{name}", body,
                 content_type="application/merge-patch+json")
    assert reply.status == 200, reply.body
    return wait_for(lambda: running_vmi_uid(api, ns), what="VMI running")


def test_a_running_vmi_shows_its_boot_and_login_prompt(kube: Endpoint, api: client.ApiClient, namespace: str) -> None:
    running_vm(api, namespace)

    ws = connect(kube, namespace)

    assert ws.subprotocol == PROTOCOL
    assert read_until(ws, PROMPT) == BOOT  # booted before anyone connected: kept for the first client
    ws.close()


def test_typed_input_is_echoed_and_answered(kube: Endpoint, api: client.ApiClient, namespace: str) -> None:
    running_vm(api, namespace)
    ws = connect(kube, namespace)
    read_until(ws, PROMPT)

    ws.send_binary(b"root\r")
    assert read_until(ws, b"Password: ") == b"root\r\nPassword: "
    ws.send_binary(b"hunter2\r")
    assert read_until(ws, PROMPT) == b"\r\n\r\nLogin incorrect\r\nvm login: "
    ws.send(b"\r".decode())  # a text frame is taken as bytes too
    assert read_until(ws, PROMPT) == b"\r\nvm login: "
    ws.close()


def test_ping_is_answered_with_pong(kube: Endpoint, api: client.ApiClient, namespace: str) -> None:
    running_vm(api, namespace)
    ws = connect(kube, namespace)
    read_until(ws, PROMPT)

    ws.ping(b"are you there")
    opcode, frame = ws.recv_data_frame(control_frame=True)

    assert (opcode, frame.data) == (websocket.ABNF.OPCODE_PONG, b"are you there")
    ws.close()


def test_a_soft_reboot_boots_again_on_the_same_connection(kube: Endpoint, api: client.ApiClient,
                                                          namespace: str) -> None:
    uid = running_vm(api, namespace)
    ws = connect(kube, namespace)
    read_until(ws, PROMPT)

    reply = call(api, "PUT", f"/apis/subresources.kubevirt.io/v1/namespaces/{namespace}/virtualmachineinstances/vm/"
                 "softreboot", {})

    assert reply.status == 200
    assert read_until(ws, PROMPT) == REBOOT_TEXT + BOOT
    assert running_vmi_uid(api, namespace) == uid
    ws.close()


def test_a_restart_closes_the_console_and_the_new_vmi_boots_afresh(kube: Endpoint, api: client.ApiClient,
                                                                  namespace: str) -> None:
    old = running_vm(api, namespace)
    ws = connect(kube, namespace)
    read_until(ws, PROMPT)

    reply = call(api, "PUT", f"/apis/subresources.kubevirt.io/v1/namespaces/{namespace}/virtualmachines/vm/restart",
                 {})
    assert reply.status == 202

    assert wait_closed(ws) == (SHUTDOWN_TEXT, 1000)  # the guest powers off, then the domain goes
    new = wait_for(lambda: (uid := running_vmi_uid(api, namespace)) != old and uid, what="a new VMI running")
    assert new != old
    fresh = connect(kube, namespace)
    assert read_until(fresh, PROMPT) == BOOT
    fresh.close()


def test_a_second_client_takes_over_from_the_first(kube: Endpoint, api: client.ApiClient, namespace: str) -> None:
    running_vm(api, namespace)
    first = connect(kube, namespace)
    read_until(first, PROMPT)

    second = connect(kube, namespace)
    second.send_binary(b"\r")

    assert wait_closed(first) == (b"", 1000)
    assert read_until(second, PROMPT) == b"\r\nvm login: "
    second.close()


def test_the_boot_text_follows_the_vmi_boot_order(kube: Endpoint, api: client.ApiClient, namespace: str) -> None:
    running_vm(api, namespace, domain={"devices": {
        "disks": [{"name": "root", "disk": {"bus": "virtio"}, "bootOrder": 2},
                  {"name": "cdrom", "cdrom": {"bus": "sata"}, "bootOrder": 3}],
        "interfaces": [{"name": "default", "masquerade": {}, "bootOrder": 1}]}})

    ws = connect(kube, namespace)

    assert read_until(ws, PROMPT).startswith(FIRMWARE_TEXT + NETWORK_TEXT)
    ws.close()


# ---- refused before the upgrade


def vmi(ns: str, phase: str = "", volume: Obj | None = None, **devices_: Any) -> Obj:
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "vm"},
            "spec": {"domain": {"devices": {"disks": [{"name": "root", "disk": {}}], **devices_}},
                     "volumes": [volume or {"name": "root", "containerDisk": {"image": "x"}}]},
            "status": {"phase": phase} if phase else {}}


def create_vmi(api: client.ApiClient, ns: str, body: Obj) -> None:
    reply = call(api, "POST", f"/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances", body)
    assert reply.status == 201, reply.body


def test_a_vmi_that_is_not_running_is_400(kube: Endpoint, api: client.ApiClient, namespace: str) -> None:
    # Its DataVolume does not exist: the VMI stays Pending.
    create_vmi(api, namespace, vmi(namespace, volume={"name": "root", "dataVolume": {"name": "missing"}}))
    wait_for(lambda: (get_vmi(api, namespace) or {}).get("status", {}).get("phase") == "Pending", what="Pending")

    code, status = refusal(kube, namespace)

    assert (code, status["reason"], status["message"]) == (400, "BadRequest", "VMI is not running")


def test_a_failed_vmi_is_409(kube: Endpoint, api: client.ApiClient, namespace: str) -> None:
    create_vmi(api, namespace, vmi(namespace, phase="Failed"))

    code, status = refusal(kube, namespace)

    assert (code, status["reason"], status["message"]) == (
        409, "Conflict", 'Operation cannot be fulfilled on virtualmachineinstance.kubevirt.io "vm": VMI is in failed '
                         "status")


def test_a_vmi_without_a_serial_console_is_400(kube: Endpoint, api: client.ApiClient, namespace: str) -> None:
    running_vm(api, namespace, domain={"devices": {"autoattachSerialConsole": False}})

    code, status = refusal(kube, namespace)

    assert (code, status["reason"], status["message"]) == (400, "BadRequest", "No serial consoles are present.")


def test_an_unknown_vmi_is_404(kube: Endpoint, namespace: str) -> None:
    code, status = refusal(kube, namespace, "nothing")

    assert (code, status["reason"]) == (404, "NotFound")
    assert status["message"] == 'virtualmachineinstance.kubevirt.io "nothing" not found'


@pytest.mark.parametrize("token", [None, "not-a-token"], ids=["no-token", "bad-token"])
def test_a_client_without_a_valid_token_is_401(kube: Endpoint, api: client.ApiClient, namespace: str,
                                                 token: str | None) -> None:
    running_vm(api, namespace)

    code, status = refusal(kube, namespace, token=token)

    assert (code, status["reason"]) == (401, "Unauthorized")


def test_a_request_that_is_no_websocket_is_400(kube: Endpoint, api: client.ApiClient, namespace: str) -> None:
    running_vm(api, namespace)

    reply = call(api, "GET", f"/apis/subresources.kubevirt.io/v1/namespaces/{namespace}/virtualmachineinstances/vm/"
                 "console")

    assert (reply.status, reply.body["reason"]) == (400, "BadRequest")
    assert "'websocket' token not found in 'Upgrade' header" in reply.body["message"]


def test_discovery_lists_the_console(api: client.ApiClient) -> None:
    reply = call(api, "GET", "/apis/subresources.kubevirt.io/v1")

    listed = {r["name"]: r for r in reply.body["resources"]}
    assert listed["virtualmachineinstances/console"]["verbs"] == ["get"]
    assert listed["virtualmachineinstances/console"]["namespaced"] is True


# ---- the server stopping


def test_stopping_the_server_ends_its_console_connections() -> None:
    flags = address_ranges()
    ranges = dict(zip(flags[::2], flags[1::2], strict=True))
    cluster = Cluster(SimConfig(port=0, vm_start_delay=0.1, vm_stop_delay=0.1, kubelet_mode="fake",
                                pod_cidr=ranges["--pod-cidr"], service_cidr=ranges["--service-cidr"],
                                load_balancer_cidr=ranges["--load-balancer-cidr"]))
    cluster.start()
    try:
        running_vm(config.new_client_from_config(config_file=cluster.kubeconfig), "default")
        ws = connect(endpoint(cluster.kubeconfig), "default")
        read_until(ws, PROMPT)
    finally:
        cluster.stop()

    assert wait_closed(ws, timeout=3) == (b"", 1001)
