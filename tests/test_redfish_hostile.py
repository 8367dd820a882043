"""Hostile input to the Redfish frontend (issue 11, deliverable 3): whatever a client sends, the answer is a
Redfish JSON error with a 4xx status (or 503 when the backend is unreachable), never a 5xx, and bad input leaves
no traceback in the log. The first tests reproduce each reported defect against a running agent; the fuzz tests
send a few thousand seeded random and mutated requests through the Flask test client and a few hundred over
real HTTP, then check that the agent still serves."""

from __future__ import annotations

import base64
import json
import logging
import random
import socket
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
from flask.testing import FlaskClient

from tests.agents import PASSWORD, USER, AgentProcess
from tests.conftest import wait_for
from vbmc.machine import BackendUnavailable
from vbmc.memory import MemoryMachine
from vbmc.redfish import payloads
from vbmc.redfish.app import create_app
from vbmc.redfish.errors import RedfishError

VM = "demo"
SYSTEM = f"/redfish/v1/Systems/{VM}"
SESSIONS = "/redfish/v1/SessionService/Sessions"
CD = "/redfish/v1/Managers/BMC/VirtualMedia/Cd"
SYSTEM_CD = f"{SYSTEM}/VirtualMedia/Cd"
INSERT = f"{CD}/Actions/VirtualMedia.InsertMedia"
RESET = f"{SYSTEM}/Actions/ComputerSystem.Reset"
AUTH = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()


# ---- a running agent, reached over HTTP with raw bytes


@pytest.fixture(scope="module")
def agent() -> Iterator[AgentProcess]:
    process = AgentProcess("--backend", "memory", "--vm", VM)
    try:
        wait_for(process.ready, timeout=20, what="the agent to be ready")
        yield process
    finally:
        process.stop()


def send_raw(agent: AgentProcess, method: str, path: str, body: bytes = b"", *, auth: bool = True,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request over a fresh connection, the body sent byte for byte (urllib would re-encode it)."""
    head = {"Host": "127.0.0.1", "Content-Type": "application/json", "Content-Length": str(len(body)),
            "Connection": "close", **({"Authorization": AUTH} if auth else {}), **(headers or {})}
    request = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items()) + "\r\n"
    with socket.create_connection(("127.0.0.1", agent.http_port), timeout=10) as sock:
        sock.sendall(request.encode("latin-1") + body)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    raw = b"".join(chunks)
    head_raw, _, payload = raw.partition(b"\r\n\r\n")
    status_line, *lines = head_raw.decode("latin-1").split("\r\n")
    fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), fields, payload


def error_ids(payload: bytes) -> list[str]:
    return [m["MessageId"].rsplit(".", 1)[1] for m in json.loads(payload)["error"]["@Message.ExtendedInfo"]]


def nested(depth: int) -> bytes:
    return b'{"UserName":' + b"[" * depth + b"]" * depth + b',"Password":"x"}'


def assert_no_traceback(agent: AgentProcess) -> None:
    log = agent.output()
    assert "Traceback" not in log, log[-3000:]


@pytest.mark.parametrize(("method", "path", "auth"), [
    ("POST", SESSIONS, False),  # the login, reachable without credentials
    ("PATCH", SYSTEM, True),
    ("POST", RESET, True),
    ("POST", INSERT, True),
])
def test_json_nested_a_thousand_deep_is_malformed_json_not_a_crash(agent: AgentProcess, method: str, path: str,
                                                                     auth: bool) -> None:
    status, head, payload = send_raw(agent, method, path, nested(1000), auth=auth)
    assert status == 400
    assert head["content-type"].startswith("application/json")
    assert error_ids(payload) == ["MalformedJSON"]
    assert b"nested" in payload, "the message says what is wrong"
    assert_no_traceback(agent)


def test_lone_surrogate_in_the_login_user_name_is_a_format_error(agent: AgentProcess) -> None:
    status, _, payload = send_raw(agent, "POST", SESSIONS, b'{"UserName":"\\ud800","Password":"x"}', auth=False)
    assert status == 400
    assert error_ids(payload) == ["PropertyValueFormatError"]
    assert json.loads(payload)["error"]["@Message.ExtendedInfo"][0]["RelatedProperties"] == ["#/UserName"]
    assert_no_traceback(agent)


def test_body_that_is_not_utf8_is_malformed_json(agent: AgentProcess) -> None:
    status, _, payload = send_raw(agent, "POST", SESSIONS, b'{"UserName":"\xff\xfe","Password":"x"}', auth=False)
    assert status == 400
    assert error_ids(payload) == ["MalformedJSON"]


@pytest.mark.parametrize("image", ["http://[::1/x", "http://host:99999/x.iso", "http://host:port/x.iso",
                                   "http:///x.iso", "http://ho st/x.iso", "http://host/x\n.iso"])
def test_malformed_image_url_on_insert_media_names_the_parameter(agent: AgentProcess, image: str) -> None:
    status, _, payload = send_raw(agent, "POST", INSERT, json.dumps({"Image": image}).encode())
    assert status == 400
    info = json.loads(payload)["error"]["@Message.ExtendedInfo"]
    assert [i["MessageId"].rsplit(".", 1)[1] for i in info] == ["ActionParameterValueFormatError"]
    assert info[0]["MessageArgs"][1:] == ["Image", "VirtualMedia.InsertMedia"]
    assert agent.redfish("GET", CD)[1]["Inserted"] is False, "nothing was inserted"
    assert_no_traceback(agent)


@pytest.mark.parametrize("path", [CD, SYSTEM_CD])
def test_malformed_image_url_on_a_virtual_media_patch_names_the_property(agent: AgentProcess, path: str) -> None:
    status, _, payload = send_raw(agent, "PATCH", path, b'{"Image":"http://[::1/x"}')
    assert status == 400
    info = json.loads(payload)["error"]["@Message.ExtendedInfo"]
    assert [i["MessageId"].rsplit(".", 1)[1] for i in info] == ["PropertyValueFormatError"]
    assert info[0]["RelatedProperties"] == ["#/Image"]
    assert agent.redfish("GET", CD)[1]["Inserted"] is False
    assert_no_traceback(agent)


def test_body_over_the_size_limit_is_413_with_a_redfish_body(agent: AgentProcess) -> None:
    status, _, payload = send_raw(agent, "PATCH", SYSTEM, b'{"Boot":{}}' + b" " * (1024 * 1024))
    assert status == 413
    assert error_ids(payload) == ["GeneralError"]


def test_unknown_method_is_405_with_allow(agent: AgentProcess) -> None:
    status, head, payload = send_raw(agent, "BREW", SYSTEM)
    assert status == 405
    assert head["allow"] == "GET, HEAD, PATCH"
    assert error_ids(payload) == ["OperationNotAllowed"]


# ---- the app in process: the catch-all and the edge checks


def client(machine: MemoryMachine | None = None) -> FlaskClient:
    app = create_app(machine or MemoryMachine(VM), USER, PASSWORD)
    return app.test_client()


class Exploding(MemoryMachine):
    def power_state(self) -> Any:
        raise KeyError("a bug, not input")


def test_an_unexpected_exception_is_a_redfish_500_and_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        resp = client(Exploding(VM)).get(SYSTEM, headers={"Authorization": AUTH})
    assert resp.status_code == 500
    assert resp.json is not None and resp.json["error"]["code"] == "Base.1.19.GeneralError"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert errors[0].exc_info is None and "\n" not in errors[0].getMessage()
    assert "KeyError" in errors[0].getMessage()


def test_an_unreachable_backend_is_still_503() -> None:
    class Down(MemoryMachine):
        def power_state(self) -> Any:
            raise BackendUnavailable("the API server does not answer", retry_after=3)

    resp = client(Down(VM)).get(SYSTEM, headers={"Authorization": AUTH})
    assert resp.status_code == 503 and resp.headers["Retry-After"] == "3"


@pytest.mark.parametrize(("raw", "key"), [
    (b"[1]", "MalformedJSON"),
    (b'{"a":' * 33 + b"1" + b"}" * 33, "MalformedJSON"),
    (b'{"a":"' + b"\\ud800" + b'"}', "PropertyValueFormatError"),
    (b'{"\\udfff":1}', "MalformedJSON"),
    (b'{"a":1e99999}', "MalformedJSON"),
    (b'{"a":NaN}', "MalformedJSON"),
    (b'{"a":"x\\u00"}', "MalformedJSON"),
    (b'{"a":' + b"9" * 5000 + b"}", "MalformedJSON"),
])
def test_load_json_refuses_what_no_property_can_hold(raw: bytes, key: str) -> None:
    with pytest.raises(RedfishError) as err:
        payloads.load_json(raw)
    assert err.value.infos[0]["MessageId"].endswith("." + key)
    json.dumps(err.value.body())  # the error itself always renders


@pytest.mark.parametrize("body", [
    {"UserName": USER, "Password": "hunter2\ud800"},
    {"UserName": USER, "Password": ["hunter2"]},
    {"UserName": USER, "Password": {"a": "hunter2"}},
])
def test_an_error_about_the_password_never_echoes_it(body: dict[str, Any]) -> None:
    resp = client().post(SESSIONS, data=json.dumps(body), content_type="application/json")
    assert resp.status_code == 400
    assert b"hunter2" not in resp.get_data()
    assert resp.json is not None and "(redacted)" in resp.json["error"]["@Message.ExtendedInfo"][0]["MessageArgs"]


def test_load_json_accepts_the_depth_a_real_body_has() -> None:
    doc = {"Boot": {"BootSourceOverrideTarget": "Pxe"}, "Oem": {"a": {"b": [{"c": [1, 2]}]}}}
    assert payloads.load_json(json.dumps(doc).encode()) == doc


# ---- fuzz: seeded random and mutated requests

PATHS = ["/redfish", "/redfish/v1", "/redfish/v1/odata", "/redfish/v1/$metadata", "/redfish/v1/Systems", SYSTEM,
         RESET, f"{SYSTEM}/EthernetInterfaces", f"{SYSTEM}/Processors", f"{SYSTEM}/Processors/CPU0",
         f"{SYSTEM}/Memory", f"{SYSTEM}/Memory/DIMM0", f"{SYSTEM}/SimpleStorage", f"{SYSTEM}/SimpleStorage/1",
         f"{SYSTEM}/Storage", f"{SYSTEM}/Storage/1", "/redfish/v1/Chassis", f"/redfish/v1/Chassis/{VM}",
         f"/redfish/v1/Chassis/{VM}/Drives", "/redfish/v1/Managers", "/redfish/v1/Managers/BMC",
         "/redfish/v1/Managers/BMC/NetworkProtocol", "/redfish/v1/Managers/BMC/VirtualMedia", CD, INSERT,
         f"{CD}/Actions/VirtualMedia.EjectMedia", f"{SYSTEM}/VirtualMedia", SYSTEM_CD,
         f"{SYSTEM_CD}/Actions/VirtualMedia.InsertMedia", "/redfish/v1/SessionService", SESSIONS,
         f"{SESSIONS}/1", "/redfish/v1/AccountService", "/redfish/v1/AccountService/Accounts",
         "/redfish/v1/AccountService/Accounts/1", "/redfish/v1/AccountService/Roles",
         "/redfish/v1/AccountService/Roles/Administrator", "/healthz", "/readyz", "/"]
METHODS = ["GET", "HEAD", "POST", "PATCH", "PUT", "DELETE", "OPTIONS", "TRACE", "BREW", "get", "M-SEARCH"]
NAMES = ["ResetType", "Boot", "BootSourceOverrideTarget", "BootSourceOverrideEnabled", "BootSourceOverrideMode",
         "Image", "Inserted", "WriteProtected", "UserName", "Password", "TransferMethod", "TransferProtocolType",
         "Context", "@odata.etag", "Oem", "\ud800", "\x00", "A" * 300]
TEXTS = ["On", "ForceOff", "GracefulRestart", "Pxe", "Cd", "Once", "UEFI", "http://h/x.iso", "http://[::1/x",
         "https://u:p@h:0/x", "http://h:70000/", "ftp://h/x", "//h/x", "\ud800", "\udfff\ud800", "\x00", "",
         "é" * 100, "%ff", "http://" + "a" * 5000, USER, PASSWORD]


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 4 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 2**64, 1.5, float("inf"), float("nan"), -0.0])
    if kind in (3, 4, 5):
        return rng.choice(TEXTS)
    if kind in (6, 7):
        return {rng.choice(NAMES): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}
    return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randrange(1, 6)):
        op = rng.randrange(4)
        pos = rng.randrange(len(buf) + 1)
        if op == 0 and buf:
            del buf[pos % len(buf)]
        elif op == 1:
            buf[pos:pos] = bytes([rng.randrange(256)])
        elif op == 2:
            buf[pos:pos] = rng.choice([b"{", b"[", b"}", b"]", b'"', b"\\", b"\\u", b"\\ud800", b",", b":"]) * \
                rng.choice([1, 2, 50, 2000])
        elif buf:
            buf[pos % len(buf)] ^= 1 << rng.randrange(8)
    return bytes(buf)


def random_body(rng: random.Random) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:
        return b""
    doc = {rng.choice(NAMES): random_value(rng) for _ in range(rng.randrange(1, 4))}
    data = json.dumps(doc).encode()
    if kind == 1:
        return rng.randbytes(rng.randrange(1, 200))
    if kind in (2, 3):
        return mutate(rng, data)
    return data


def random_path(rng: random.Random) -> str:
    path = rng.choice(PATHS)
    kind = rng.randrange(8)
    if kind == 0:
        return path + rng.choice(["/", "//", "/..", "/%2e%2e", "/%00", "/%ff", "?$expand=*", "?$top=-1", "#x",
                                  "/" + "A" * 3000, "/\u2603", ";x=1"])
    if kind == 1:
        parts = path.split("/")
        parts[rng.randrange(len(parts))] = rng.choice(["", "..", "%", "%zz", "x" * 100, "CPU99", "\x7f"])
        return "/".join(parts) or "/"
    return path


def random_headers(rng: random.Random) -> dict[str, str]:
    headers: dict[str, str] = {}
    auth = rng.randrange(6)
    if auth in (0, 1, 2):
        headers["Authorization"] = AUTH
    elif auth == 3:
        headers["Authorization"] = rng.choice(["Basic", "Basic !!!", "Basic " + base64.b64encode(
            b"\xff\xfe:\xff").decode(), "Bearer x", "Basic " + base64.b64encode(b"admin").decode(), "Digest a=b"])
    elif auth == 4:
        headers["X-Auth-Token"] = rng.choice(["", "x" * 500, "\xff", "0" * 32])
    if rng.random() < 0.3:
        headers["If-Match"] = rng.choice(["*", '"x"', "W/", ",,,", '"' * 100, "\xe9"])
    if rng.random() < 0.3:
        headers["Content-Type"] = rng.choice(["text/plain", "application/json; charset=latin-1",
                                              "multipart/form-data; boundary=x", "application/x-www-form-urlencoded",
                                              ""])
    if rng.random() < 0.1:
        headers["Transfer-Encoding"] = "chunked"
    return headers


def wsgi_path(target: str) -> dict[str, str]:
    """PATH_INFO and QUERY_STRING as a server hands them to the app (PEP 3333: percent-decoded bytes, as
    latin-1), for any request target, even one the test client would read as a URL with a host."""
    path, _, query = target.partition("?")
    return {"PATH_INFO": urllib.parse.unquote_to_bytes(path).decode("latin-1"), "QUERY_STRING": query}


def check_answer(method: str, path: str, status: int, content_type: str, data: bytes) -> None:
    where = f"{method} {path!r} -> {status}"
    assert status < 500 or status == 503, where
    if status >= 400 and method.upper() != "HEAD":
        assert content_type.startswith("application/json"), where
        error = json.loads(data)["error"]
        assert error["code"].startswith("Base.1.") and error["@Message.ExtendedInfo"], where


def test_fuzz_through_the_app_gives_no_5xx_and_a_redfish_body_on_every_error(
        caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(11)
    app = create_app(MemoryMachine(VM), USER, PASSWORD)
    http = app.test_client()
    with caplog.at_level(logging.WARNING):
        for _ in range(3000):
            method, path, headers, body = rng.choice(METHODS), random_path(rng), random_headers(rng), random_body(rng)
            resp = http.open("/", method=method, headers=headers, data=body, environ_overrides=wsgi_path(path))
            check_answer(method, path, resp.status_code, resp.content_type or "", resp.get_data())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert http.get(SYSTEM, headers={"Authorization": AUTH}).status_code == 200


def test_fuzz_over_http_leaves_the_agent_serving(agent: AgentProcess) -> None:
    rng = random.Random(1111)
    for _ in range(300):
        method, path, headers, body = rng.choice(METHODS), random_path(rng), random_headers(rng), random_body(rng)
        headers.pop("Transfer-Encoding", None)  # send_raw frames the body with Content-Length
        if not method.isupper() or not path.startswith("/"):
            continue  # gunicorn refuses these below Flask, in HTML: the HTTP layer's part of issue 11
        if any(ord(c) > 255 for c in path + "".join(headers.values())) or any(c in path for c in " \r\n\x7f"):
            continue  # not sendable on a request line; the in-process test covers the routing of such paths
        status, head, payload = send_raw(agent, method, path, body, auth=False, headers=headers)
        check_answer(method, path, status, head.get("content-type", ""), payload)
    assert agent.redfish("GET", SYSTEM)[0] == 200
    assert agent.ready()
    assert_no_traceback(agent)
