"""Hostile input to the Redfish frontend (issue 11, deliverable 3): whatever a client sends, the answer is a
Redfish JSON error with a 4xx status (or 503 when the backend is unreachable), never a 5xx, and bad input leaves
no traceback in the log. The first tests reproduce each reported defect against a running agent; the fuzz tests
send a few thousand seeded random and mutated requests through the Flask test client and a few hundred over
real HTTP, then check that the agent still serves."""

from __future__ import annotations

import base64
import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest
from flask.testing import FlaskClient

from vbmc.machine import BackendUnavailable
from vbmc.machine.memory import MemoryMachine
from vbmc.redfish import payloads
from vbmc.redfish.app import create_app
from vbmc.redfish.errors import RedfishError
from vbmc.redfish.media import image_url_problem

from ..support.agents import PASSWORD, USER, AgentProcess
from ..support.cluster import wait_for
from .fuzz import Fuzzer, answer_problem, send_raw, wsgi_path

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


def send(agent: AgentProcess, method: str, path: str, body: bytes = b"", *, auth: bool = True,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    return send_raw(agent.http_port, method, path, body,
                    headers={**({"Authorization": AUTH} if auth else {}), **(headers or {})})


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
    status, head, payload = send(agent, method, path, nested(1000), auth=auth)
    assert status == 400
    assert head["content-type"].startswith("application/json")
    assert error_ids(payload) == ["MalformedJSON"]
    assert b"nested" in payload, "the message says what is wrong"
    assert_no_traceback(agent)


def test_lone_surrogate_in_the_login_user_name_is_a_format_error(agent: AgentProcess) -> None:
    status, _, payload = send(agent, "POST", SESSIONS, b'{"UserName":"\\ud800","Password":"x"}', auth=False)
    assert status == 400
    assert error_ids(payload) == ["PropertyValueFormatError"]
    assert json.loads(payload)["error"]["@Message.ExtendedInfo"][0]["RelatedProperties"] == ["#/UserName"]
    assert_no_traceback(agent)


def test_body_that_is_not_utf8_is_malformed_json(agent: AgentProcess) -> None:
    status, _, payload = send(agent, "POST", SESSIONS, b'{"UserName":"\xff\xfe","Password":"x"}', auth=False)
    assert status == 400
    assert error_ids(payload) == ["MalformedJSON"]


@pytest.mark.parametrize("image", ["http://[::1/x", "http://host:99999/x.iso", "http://host:port/x.iso",
                                   "http:///x.iso", "http://ho st/x.iso", "http://host/x\n.iso"])
def test_malformed_image_url_on_insert_media_names_the_parameter(agent: AgentProcess, image: str) -> None:
    status, _, payload = send(agent, "POST", INSERT, json.dumps({"Image": image}).encode())
    assert status == 400
    info = json.loads(payload)["error"]["@Message.ExtendedInfo"]
    assert [i["MessageId"].rsplit(".", 1)[1] for i in info] == ["ActionParameterValueFormatError"]
    assert info[0]["MessageArgs"][1:] == ["Image", "VirtualMedia.InsertMedia"]
    assert agent.redfish("GET", CD)[1]["Inserted"] is False, "nothing was inserted"
    assert_no_traceback(agent)


@pytest.mark.parametrize("path", [CD, SYSTEM_CD])
def test_malformed_image_url_on_a_virtual_media_patch_names_the_property(agent: AgentProcess, path: str) -> None:
    status, _, payload = send(agent, "PATCH", path, b'{"Image":"http://[::1/x"}')
    assert status == 400
    info = json.loads(payload)["error"]["@Message.ExtendedInfo"]
    assert [i["MessageId"].rsplit(".", 1)[1] for i in info] == ["PropertyValueFormatError"]
    assert info[0]["RelatedProperties"] == ["#/Image"]
    assert agent.redfish("GET", CD)[1]["Inserted"] is False
    assert_no_traceback(agent)


def test_body_over_the_size_limit_is_413_with_a_redfish_body(agent: AgentProcess) -> None:
    status, _, payload = send(agent, "PATCH", SYSTEM, b'{"Boot":{}}' + b" " * (1024 * 1024))
    assert status == 413
    assert error_ids(payload) == ["GeneralError"]


def test_unknown_method_is_405_with_allow(agent: AgentProcess) -> None:
    status, head, payload = send(agent, "BREW", SYSTEM)
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
    ('{"a":"b"}'.encode("utf-16"), "MalformedJSON"),
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


@pytest.mark.parametrize(("url", "problem"), [
    ("http://images.example.com/installer.iso", None),
    ("https://images.example.com:8443/a/b.iso?token=x#frag", None),
    ("http://10.0.0.1/x.iso", None),
    ("http://[fd00::1]:8080/x.iso", None),
    ("http://[fe80::1%25eth0]/x.iso", None),
    ("https://user:pw@host/x.iso", None),
    ("http://[::1/x", "malformed"),
    ("http://[zz::1]/x", "malformed"),
    ("http://host:99999/x", "malformed"),
    ("http://host:0/x", "port"),
    ("http:///x.iso", "no host"),
    ("ftp://host/x.iso", "http or https"),
    ("/x.iso", "http or https"),
    ("http://ho st/x", "space"),
    ("http://host/\x00", "control"),
    ("http://bücher.example/x", "host"),
    ("http://host/" + "a" * 3000, "longer"),
])
def test_image_url_problem(url: str, problem: str | None) -> None:
    found = image_url_problem(url)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def test_load_json_accepts_the_depth_a_real_body_has() -> None:
    doc = {"Boot": {"BootSourceOverrideTarget": "Pxe"}, "Oem": {"a": {"b": [{"c": [1, 2]}]}}}
    assert payloads.load_json(json.dumps(doc).encode()) == doc


def test_every_route_and_method_answers_with_redfish_json_and_no_5xx() -> None:
    app = create_app(MemoryMachine(VM), USER, PASSWORD)
    http = app.test_client()
    methods = ["GET", "HEAD", "POST", "PATCH", "PUT", "DELETE", "OPTIONS", "TRACE", "CONNECT", "BREW"]
    problems = []
    for rule in app.url_map.iter_rules():
        path = re.sub(r"<[^>]+>", "Cd", rule.rule)
        for method in methods:
            for body in (b"", b"{}", b"[", b'{"x":1}'):
                resp = http.open(path, method=method, data=body, headers={"Authorization": AUTH})
                # The SSE stream never ends by itself: its head is the answer; closing it frees its place.
                endless = resp.status_code == 200 and resp.mimetype == "text/event-stream"
                data = b"" if endless else resp.get_data()
                resp.close()
                problem = answer_problem(method, resp.status_code, resp.content_type or "", data)
                if problem:
                    problems.append(f"{method} {path}: {problem}")
                if resp.status_code == 405:
                    assert resp.headers["Allow"], f"{method} {path}: 405 without Allow"
                    assert method not in resp.headers["Allow"].split(", ")
    assert problems == []


# ---- fuzz: seeded random and mutated requests (tests/redfish/fuzz.py)


def test_fuzz_through_the_app_gives_no_5xx_and_a_redfish_body_on_every_error(
        caplog: pytest.LogCaptureFixture) -> None:
    fuzzer = Fuzzer(11, VM, USER, PASSWORD)
    http = client()
    problems = []
    with caplog.at_level(logging.WARNING):
        for _ in range(3000):
            req = fuzzer.request()
            resp = http.open("/", method=req.method, headers=req.headers, data=req.body,
                             environ_overrides=wsgi_path(req.path))
            problem = answer_problem(req.method, resp.status_code, resp.content_type or "", resp.get_data())
            if problem:
                problems.append(f"{req.method} {req.path[:100]!r}: {problem}")
    assert problems == []
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert http.get(SYSTEM, headers={"Authorization": AUTH}).status_code == 200


def test_fuzz_over_http_leaves_the_agent_serving(agent: AgentProcess) -> None:
    fuzzer = Fuzzer(1111, VM, USER, PASSWORD)
    problems, sent = [], 0
    while sent < 300:
        req = fuzzer.request()
        if not req.sendable_on_the_wire():
            continue
        sent += 1
        status, head, payload = send_raw(agent.http_port, req.method, req.path, req.body, headers=req.headers)
        problem = answer_problem(req.method, status, head.get("content-type", ""), payload)
        if problem:
            problems.append(f"{req.method} {req.path[:100]!r}: {problem}")
    assert problems == []
    assert agent.redfish("GET", SYSTEM)[0] == 200
    assert agent.ready()
    assert_no_traceback(agent)
