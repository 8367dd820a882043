"""The Redfish EventService as a provisioning system sees it: subscriptions, events pushed to a loopback receiver
(HTTP and HTTPS), filters, retries and suspension, SubmitTestEvent, the SSE stream, and subscriptions that outlive
the agent process (kept in a Secret, against kubesim)."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from controller import desired
from controller.kubeapi import APPLY
from vbmc.machine.events import Event, EventBus
from vbmc.redfish.errors import RedfishError
from vbmc.redfish.events import parse_filter
from vbmc.redfish.eventservice import (
    QUEUE_LENGTH,
    SECRET_KEY,
    EventService,
    Subscription,
    event_record,
    iso_timestamp,
    retry_delay,
)

from ..support.agents import (
    PASSWORD,
    USER,
    AgentProcess,
    agent_for_vm,
    redfish_at,
    running_agent,
    write_serving_certificate,
)
from ..support.cluster import Sim, call, wait_for
from ..support.controllers import apply_bmc, get_bmc, ipmitool, is_ready, make_secret, pods
from ..support.vms import make_vm

EVENT_SERVICE = "/redfish/v1/EventService"
SUBSCRIPTIONS = f"{EVENT_SERVICE}/Subscriptions"
SSE = f"{EVENT_SERVICE}/SSE"
SUBMIT = f"{EVENT_SERVICE}/Actions/EventService.SubmitTestEvent"
POWERED_ON = "ResourceEvent.1.4.ResourcePoweredOn"
POWERED_OFF = "ResourceEvent.1.4.ResourcePoweredOff"
CHANGED = "ResourceEvent.1.4.ResourceChanged"
AUTH = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()


class Receiver:
    """An event listener on 127.0.0.1 (HTTPS with `tls`): keeps what it is POSTed, answers `status`."""

    def __init__(self, tls: tuple[Path, Path] | None = None, status: int = 204) -> None:
        self.status = status
        self.posts: list[tuple[dict[str, str], Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with receiver.lock:
                    receiver.posts.append((dict(self.headers.items()), json.loads(body)))
                self.send_response(receiver.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.scheme = "http"
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            self.scheme = "https"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.server.server_port}/events"

    def records(self) -> list[dict[str, Any]]:
        with self.lock:
            return [e for _, doc in self.posts for e in doc["Events"]]

    def message_ids(self) -> list[str]:
        return [e["MessageId"] for e in self.records()]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def receiver(tls: tuple[Path, Path] | None = None, status: int = 204) -> Iterator[Receiver]:
    r = Receiver(tls, status)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def agent() -> Iterator[AgentProcess]:
    with running_agent("--backend", "memory", "--vm", "vm1") as process:
        yield process


def subscribe(agent: AgentProcess, destination: str, **extra: Any) -> dict[str, Any]:
    status, doc = agent.redfish("POST", SUBSCRIPTIONS, {"Destination": destination, "Protocol": "Redfish", **extra})
    assert status == 201, doc
    return dict(doc)


def power(agent: AgentProcess, reset_type: str) -> None:
    status, doc = agent.redfish("POST", "/redfish/v1/Systems/vm1/Actions/ComputerSystem.Reset",
                                {"ResetType": reset_type})
    assert status == 204, doc


# ---- pushed events


def test_power_on_through_ipmitool_and_off_through_redfish_arrive_in_order(agent: AgentProcess) -> None:
    with receiver() as rx:
        sub = subscribe(agent, rx.url, Context="provisioner-42", HttpHeaders=[{"X-Listener-Token": "t0ken"}])
        assert sub["Status"]["State"] == "Enabled"
        assert sub["HttpHeaders"] == []  # never shown again: they may carry credentials

        assert agent.ipmitool("chassis", "power", "on").returncode == 0
        wait_for(lambda: POWERED_ON in rx.message_ids(), what="ResourcePoweredOn")
        power(agent, "ForceOff")
        wait_for(lambda: POWERED_OFF in rx.message_ids(), what="ResourcePoweredOff")

        records = rx.records()
        assert [r["MessageId"] for r in records] == [POWERED_ON, POWERED_OFF]
        assert [r["MessageArgs"] for r in records] == [["vm1"], ["vm1"]]
        assert all(r["OriginOfCondition"] == {"@odata.id": "/redfish/v1/Systems/vm1"} for r in records)
        stamps = [r["EventTimestamp"] for r in records]
        assert stamps == sorted(stamps) and all(s.endswith("Z") for s in stamps)
        assert int(records[0]["EventId"]) < int(records[1]["EventId"])
        headers, doc = rx.posts[0]
        assert doc["Context"] == "provisioner-42"
        assert doc["@odata.type"].startswith("#Event.v1_")
        assert headers["X-Listener-Token"] == "t0ken"
        assert headers["Content-Type"] == "application/json"


def test_filters_hold_back_what_they_exclude(agent: AgentProcess) -> None:
    with receiver() as media_rx, receiver() as system_rx:
        subscribe(agent, media_rx.url, ResourceTypes=["VirtualMedia"])
        subscribe(agent, system_rx.url, RegistryPrefixes=["ResourceEvent"],
                  OriginResources=[{"@odata.id": "/redfish/v1/Systems/vm1"}])
        power(agent, "On")
        status, _ = agent.redfish("POST", "/redfish/v1/Managers/BMC/VirtualMedia/Cd/Actions/VirtualMedia.InsertMedia",
                                  {"Image": "http://images.example.com/boot.iso"})
        assert status == 202  # a Task (the memory backend has nothing to import: it completes at once)
        wait_for(lambda: media_rx.records(), what="the media event")
        wait_for(lambda: system_rx.records(), what="the power event")
        # A test event from the VirtualMedia, as the last one: once it is in, nothing earlier is still on its way.
        status, _ = agent.redfish("POST", SUBMIT, {"MessageId": "ResourceEvent.1.4.ResourceChanged",
                                                   "OriginOfCondition": "/redfish/v1/Managers/BMC/VirtualMedia/Cd"})
        assert status == 204
        wait_for(lambda: len(media_rx.records()) == 2, what="the test event")

        assert [(r["MessageId"], r["OriginOfCondition"]["@odata.id"]) for r in media_rx.records()] == [
            (CHANGED, "/redfish/v1/Managers/BMC/VirtualMedia/Cd")] * 2
        assert system_rx.message_ids() == [POWERED_ON]


def test_a_failing_destination_is_retried_then_suspended(agent: AgentProcess) -> None:
    status, doc = agent.redfish("PATCH", EVENT_SERVICE, {"DeliveryRetryAttempts": 2,
                                                         "DeliveryRetryIntervalSeconds": 1})
    assert status == 200 and (doc["DeliveryRetryAttempts"], doc["DeliveryRetryIntervalSeconds"]) == (2, 1), doc
    with receiver(status=500) as rx:
        sub = subscribe(agent, rx.url)
        power(agent, "On")
        # One attempt and two retries, then Status.State Disabled (DeliveryRetryPolicy SuspendRetries).
        shown = wait_for(lambda: (s := agent.redfish("GET", sub["@odata.id"])[1])["Status"]["State"] == "Disabled"
                         and s, timeout=15, what="the subscription to be suspended")
        assert shown["DeliveryRetryPolicy"] == "SuspendRetries"
        assert rx.message_ids() == [POWERED_ON] * 3
        rx.status = 204
        power(agent, "ForceOff")
        status, _ = agent.redfish("POST", SUBMIT, {"MessageId": "Base.1.19.Success"})
        assert status == 204
        # A suspended subscription is sent nothing more; a new one for the same listener gets the next event.
        with receiver() as control:
            subscribe(agent, control.url)
            power(agent, "On")
            wait_for(lambda: control.records(), what="the control subscription's event")
        assert rx.message_ids() == [POWERED_ON] * 3
    assert "suspended" in agent.output()


def test_terminate_after_retries_deletes_the_subscription(agent: AgentProcess) -> None:
    agent.redfish("PATCH", EVENT_SERVICE, {"DeliveryRetryAttempts": 0, "DeliveryRetryIntervalSeconds": 1})
    with receiver(status=503) as rx:
        sub = subscribe(agent, rx.url, DeliveryRetryPolicy="TerminateAfterRetries")
        power(agent, "On")
        wait_for(lambda: agent.redfish("GET", sub["@odata.id"])[0] == 404, what="the subscription to be deleted")
        assert agent.redfish("GET", SUBSCRIPTIONS)[1]["Members"] == []


def test_https_destinations_are_verified_with_the_configured_ca(tmp_path: Path) -> None:
    (tmp_path / "trusted").mkdir()
    (tmp_path / "other").mkdir()
    trusted = write_serving_certificate(tmp_path / "trusted")
    untrusted = write_serving_certificate(tmp_path / "other")  # another CA, which the agent does not know
    process = AgentProcess("--backend", "memory", "--vm", "vm1", "--event-ca-file", str(trusted[0]))
    try:
        wait_for(process.ready, timeout=20, what="the agent to be ready")
        process.redfish("PATCH", EVENT_SERVICE, {"DeliveryRetryAttempts": 0, "DeliveryRetryIntervalSeconds": 1})
        with receiver(trusted) as good, receiver(untrusted) as bad, receiver(untrusted) as unverified:
            subscribe(process, good.url)
            refused = subscribe(process, bad.url)
            assert refused["VerifyCertificate"] is True
            subscribe(process, unverified.url, VerifyCertificate=False)
            power(process, "On")
            wait_for(lambda: good.records() and unverified.records(), what="both deliveries")
            wait_for(lambda: process.redfish("GET", refused["@odata.id"])[1]["Status"]["State"] == "Disabled",
                     what="the unverifiable destination to be suspended")
            assert bad.records() == []
            assert good.message_ids() == unverified.message_ids() == [POWERED_ON]
        assert "CERTIFICATE_VERIFY_FAILED" in process.output()
    finally:
        process.stop()


def test_submit_test_event_reaches_every_subscriber_as_given(agent: AgentProcess) -> None:
    with receiver() as rx:
        subscribe(agent, rx.url, Context="ctx")
        status, doc = agent.redfish("POST", SUBMIT, {
            "MessageId": "Base.1.19.Success", "Message": "hello", "MessageArgs": [], "MessageSeverity": "Warning",
            "EventId": "t-1", "EventTimestamp": "2026-01-02T03:04:05Z", "EventGroupId": 9})
        assert status == 204, doc
        wait_for(rx.records, what="the test event")
        [record] = rx.records()
        assert (record["MessageId"], record["Message"], record["MessageSeverity"], record["EventId"],
                record["EventTimestamp"], record["EventGroupId"]) == (
            "Base.1.19.Success", "hello", "Warning", "t-1", "2026-01-02T03:04:05Z", 9)
        status, doc = agent.redfish("POST", SUBMIT, {"MessageId": "Base.1.19.Success", "EventTimestamp": "noon"})
        assert status == 400 and doc["error"]["@Message.ExtendedInfo"][0]["MessageId"].endswith(
            "ActionParameterValueFormatError")
        status, doc = agent.redfish("POST", SUBMIT, {"Message": "no id"})
        assert status == 400 and doc["error"]["@Message.ExtendedInfo"][0]["MessageId"].endswith(
            "ActionParameterMissing")


@pytest.mark.parametrize(("body", "expected"), [
    ({"Destination": "ftp://listener.example.com/", "Protocol": "Redfish"}, "PropertyValueFormatError"),
    ({"Destination": "http://listener.example.com/"}, "PropertyMissing"),
    ({"Destination": "http://listener.example.com/", "Protocol": "SNMPv2c"}, "PropertyValueNotInList"),
    ({"Destination": "http://listener.example.com/", "Protocol": "Redfish", "RegistryPrefixes": ["Power"]},
     "PropertyValueNotInList"),
    ({"Destination": "http://listener.example.com/", "Protocol": "Redfish", "ResourceTypes": ["Chassis"]},
     "PropertyValueNotInList"),
    ({"Destination": "http://listener.example.com/", "Protocol": "Redfish", "EventTypes": ["Alert"]},
     "PropertyUnknown"),
    ({"Destination": "http://listener.example.com/", "Protocol": "Redfish",
      "HttpHeaders": [{"Content-Type": "text/plain"}]}, "PropertyValueFormatError"),
    ({"Destination": "http://listener.example.com/", "Protocol": "Redfish",
      "OriginResources": [{"@odata.id": "/redfish/v1/Systems/other"}]}, "PropertyValueNotInList"),
])
def test_bad_subscriptions_are_refused_and_change_nothing(agent: AgentProcess, body: dict[str, Any],
                                                          expected: str) -> None:
    status, doc = agent.redfish("POST", SUBSCRIPTIONS, body)
    assert status == 400
    assert doc["error"]["@Message.ExtendedInfo"][0]["MessageId"].endswith(expected), doc
    assert agent.redfish("GET", SUBSCRIPTIONS)[1]["Members"] == []


def test_context_can_be_patched_and_a_subscription_deleted(agent: AgentProcess) -> None:
    sub = subscribe(agent, "http://listener.example.com/events", Context="old")
    status, doc = agent.redfish("PATCH", sub["@odata.id"], {"Context": "new"})
    assert status == 200 and doc["Context"] == "new"
    status, doc = agent.redfish("PATCH", sub["@odata.id"], {"Destination": "http://elsewhere/"})
    assert status == 400 and doc["error"]["@Message.ExtendedInfo"][0]["MessageId"].endswith("PropertyNotWritable")
    assert agent.redfish("DELETE", sub["@odata.id"])[0] == 204
    assert agent.redfish("GET", sub["@odata.id"])[0] == 404


# ---- SSE


class SseClient:
    """A plain HTTP client reading the SSE stream line by line."""

    def __init__(self, agent: AgentProcess, query: str = "", last_event_id: str | None = None) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", agent.http_port, timeout=10)
        headers = {"Authorization": AUTH, "Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        self.conn.request("GET", SSE + query, headers=headers)
        self.response = self.conn.getresponse()

    def next_event(self) -> tuple[int, dict[str, Any]]:
        """The next event's id and data (comments and keep-alives skipped)."""
        event_id, data = 0, None
        for _ in range(1000):
            line = self.response.readline().decode().rstrip("\n")
            if line.startswith("id: "):
                event_id = int(line[4:])
            elif line.startswith("data: "):
                data = json.loads(line[6:])
            elif line == "" and data is not None:
                return event_id, data
        raise AssertionError("no event in 1000 lines")

    def close(self) -> None:
        self.conn.close()


def test_sse_streams_events_and_resumes_from_last_event_id(agent: AgentProcess) -> None:
    stream = SseClient(agent)
    try:
        assert stream.response.status == 200
        assert stream.response.getheader("Content-Type") == "text/event-stream"
        power(agent, "On")
        first_id, first = stream.next_event()
        assert first["Events"][0]["MessageId"] == POWERED_ON
        power(agent, "ForceOff")
        second_id, second = stream.next_event()
        assert second["Events"][0]["MessageId"] == POWERED_OFF and second_id > first_id
    finally:
        stream.close()
    # A client that lost the connection after the first event catches up from the agent's history.
    resumed = SseClient(agent, last_event_id=str(first_id))
    try:
        event_id, doc = resumed.next_event()
        assert (event_id, doc["Events"][0]["MessageId"]) == (second_id, POWERED_OFF)
    finally:
        resumed.close()


def test_sse_filter_holds_back_what_it_excludes(agent: AgentProcess) -> None:
    stream = SseClient(agent, "?$filter=ResourceType%20eq%20%27VirtualMedia%27")
    try:
        power(agent, "On")
        agent.redfish("POST", "/redfish/v1/Managers/BMC/VirtualMedia/Cd/Actions/VirtualMedia.InsertMedia",
                      {"Image": "http://images.example.com/boot.iso"})
        _, doc = stream.next_event()
        assert doc["Events"][0]["OriginOfCondition"]["@odata.id"] == "/redfish/v1/Managers/BMC/VirtualMedia/Cd"
    finally:
        stream.close()
    status, doc = agent.redfish("GET", f"{SSE}?$filter=MessageId%20eq%20%27x%27")
    assert status == 400 and doc["error"]["@Message.ExtendedInfo"][0]["MessageId"].endswith(
        "QueryParameterValueFormatError")


def test_sse_streams_are_capped_and_a_closed_one_frees_its_place(agent: AgentProcess) -> None:
    streams = [SseClient(agent) for _ in range(4)]
    try:
        assert [s.response.status for s in streams] == [200] * 4
        status, doc = agent.redfish("GET", SSE)
        assert status == 503 and doc["error"]["@Message.ExtendedInfo"][0]["MessageId"].endswith(
            "ServiceTemporarilyUnavailable")
        # The streams take no worker thread: the service still answers everything else.
        assert agent.redfish("GET", "/redfish/v1/Systems/vm1")[0] == 200
        streams.pop().close()

        def opened() -> SseClient | None:
            stream = SseClient(agent)
            if stream.response.status == 200:
                return stream
            stream.close()
            return None

        reopened = wait_for(opened, what="a place for a new stream")
        assert reopened is not None
        streams.append(reopened)
    finally:
        for s in streams:
            s.close()


# ---- subscriptions kept in the cluster


def test_subscriptions_survive_an_agent_restart(sim: Sim, api: client.ApiClient, namespace: str,
                                                bmc_crd: None) -> None:
    # Not the controller's name for it, so that a controller running in this session leaves it alone.
    name = "subscriptions-for-restart"
    bmc = {"metadata": {"name": "vm", "namespace": namespace, "uid": "u"}}
    secret = desired.desired_events_secret(bmc, "vm")
    del secret["metadata"]["ownerReferences"]  # no VirtualMachineBMC object behind this test's owner
    secret["metadata"]["name"] = name
    assert call(api, "POST", f"/api/v1/namespaces/{namespace}/secrets", secret).status == 201
    with receiver() as rx, agent_for_vm(sim, api, namespace, "--subscriptions-secret", name) as first:
        sub = subscribe(first, rx.url, Context="keep me", HttpHeaders=[{"Authorization": "Bearer x"}])
        assert first.stop() == 0
        stored = call(api, "GET", f"/api/v1/namespaces/{namespace}/secrets/{name}").body
        kept = json.loads(base64.b64decode(stored["data"][SECRET_KEY]))
        assert [(s["id"], s["destination"], s["headers"]) for s in kept] == [
            (sub["Id"], rx.url, {"Authorization": "Bearer x"})]

        second = AgentProcess("--namespace", namespace, "--vm", "vm", "--vmbmc", "vm", "--subscriptions-secret", name,
                              env={"KUBECONFIG": sim.kubeconfig})
        try:
            wait_for(second.ready, timeout=20, what="the restarted agent to be ready")
            status, doc = second.redfish("GET", sub["@odata.id"])
            assert status == 200 and doc["Context"] == "keep me" and doc["Destination"] == rx.url
            assert second.ipmitool("chassis", "power", "on").returncode == 0
            wait_for(lambda: POWERED_ON in rx.message_ids(), timeout=20, what="an event after the restart")
            assert rx.posts[-1][0]["Authorization"] == "Bearer x"
            assert second.redfish("DELETE", sub["@odata.id"])[0] == 204
        finally:
            second.stop()
        stored = call(api, "GET", f"/api/v1/namespaces/{namespace}/secrets/{name}").body
        assert json.loads(base64.b64decode(stored["data"][SECRET_KEY])) == []


def test_iso_timestamps_are_utc_with_milliseconds() -> None:
    assert iso_timestamp(0.0) == "1970-01-01T00:00:00.000Z"
    assert iso_timestamp(1767323045.1234) == "2026-01-02T03:04:05.123Z"


# ---- pure parts


def bus_event(reason: str, seq: int = 7, **detail: str) -> Event:
    return Event(seq, reason, "message", "Normal", 1767323045.5, dict(detail))


MEDIA = "/redfish/v1/Managers/BMC/VirtualMedia"


@pytest.mark.parametrize(("event", "message_id", "origin"), [
    (bus_event("PowerStateChanged", to="On"), POWERED_ON, "/redfish/v1/Systems/vm1"),
    (bus_event("PowerStateChanged", to="Off"), POWERED_OFF, "/redfish/v1/Systems/vm1"),
    (bus_event("PowerStateChanged", to="Paused"), "ResourceEvent.1.4.ResourcePaused", "/redfish/v1/Systems/vm1"),
    (bus_event("BootOverrideSet"), CHANGED, "/redfish/v1/Systems/vm1"),
    (bus_event("BootOverrideConsumed"), CHANGED, "/redfish/v1/Systems/vm1"),
    (bus_event("BootOverrideCleared"), CHANGED, "/redfish/v1/Systems/vm1"),
    (bus_event("VirtualMediaInserted", slot="Cd"), CHANGED, f"{MEDIA}/Cd"),
    (bus_event("VirtualMediaEjected"), CHANGED, f"{MEDIA}/Cd"),
    (bus_event("VirtualMediaImported", slot="Cd"), CHANGED, f"{MEDIA}/Cd"),
    (bus_event("VirtualMediaFailed", slot="Cd"), "ResourceEvent.1.4.ResourceErrorsDetected", f"{MEDIA}/Cd"),
])
def test_bus_events_map_to_resource_event_messages(event: Event, message_id: str, origin: str) -> None:
    record = event_record(event, "/redfish/v1/Systems/vm1", "vm1", MEDIA)
    assert record is not None
    assert (record.message_id, record.origin, record.event_id, record.timestamp) == (
        message_id, origin, "7", "2026-01-02T03:04:05.500Z")


@pytest.mark.parametrize("reason", ["PowerAction", "RunStrategyManual", "LoginThrottled"])
def test_bus_events_without_a_redfish_meaning_are_not_sent(reason: str) -> None:
    assert event_record(bus_event(reason), "/redfish/v1/Systems/vm1", "vm1", MEDIA) is None


@pytest.mark.parametrize(("text", "expected"), [
    (None, ([], [], [])),
    ("RegistryPrefix eq 'ResourceEvent'", (["ResourceEvent"], [], [])),
    ("(ResourceType eq 'ComputerSystem' or ResourceType eq 'VirtualMedia') "
     "and OriginResource eq '/redfish/v1/Systems/vm1'",
     ([], ["ComputerSystem", "VirtualMedia"], ["/redfish/v1/Systems/vm1"])),
])
def test_sse_filters_parse(text: str | None, expected: tuple[list[str], ...]) -> None:
    assert parse_filter(text) == expected


@pytest.mark.parametrize("text", ["MessageId eq 'x'", "ResourceType eq 'A' or RegistryPrefix eq 'B'",
                                  "ResourceType eq 'A' and ResourceType eq 'B'", "ResourceType ne 'A'", ""])
def test_sse_filters_outside_what_is_supported_are_refused(text: str) -> None:
    with pytest.raises(RedfishError) as caught:
        parse_filter(text)
    assert caught.value.status == 400


def test_the_controller_creates_the_subscriptions_secret_empty_and_grants_the_agent_that_one() -> None:
    bmc = {"metadata": {"name": "b", "namespace": "ns", "uid": "u"}, "spec": {"virtualMachineRef": {"name": "vm"}}}
    secret = desired.desired_events_secret(bmc, "vm")
    assert secret["metadata"]["name"] == "vm-virtbmc-events" and "data" not in secret
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "u"
    rules = [r for r in desired.desired_role(bmc, "vm", [])["rules"] if "secrets" in r["resources"]]
    assert rules == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["vm-virtbmc-events"],
                      "verbs": ["get", "update", "patch"]}]


# ---- through the controller


def test_a_controller_made_agent_keeps_subscriptions_across_a_pod_restart(api: client.ApiClient, namespace: str,
                                                                           controller: Any) -> None:
    make_vm(api, namespace)
    make_secret(api, namespace)
    apply_bmc(api, namespace)
    wait_for(lambda: is_ready(api, namespace), timeout=40, what="the BMC to be Ready")
    base = f"http://{get_bmc(api, namespace)['status']['clusterIP']}"
    with receiver() as rx:
        status, sub = redfish_at(base, "POST", SUBSCRIPTIONS, {"Destination": rx.url, "Protocol": "Redfish",
                                                               "Context": "metal3"})
        assert status == 201, sub
        secret = call(api, "GET", f"/api/v1/namespaces/{namespace}/secrets/vm-virtbmc-events").body
        assert secret["metadata"]["ownerReferences"][0]["kind"] == "VirtualMachineBMC"
        assert [s["id"] for s in json.loads(base64.b64decode(secret["data"][SECRET_KEY]))] == [sub["Id"]]

        [pod] = [p for p in pods(api, namespace) if p["metadata"]["name"].startswith("vm-virtbmc-")]
        assert call(api, "DELETE", f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}").status == 200

        def served_again() -> bool:
            try:
                return redfish_at(base, "GET", sub["@odata.id"], timeout=2)[0] == 200 and not any(
                    p["metadata"]["uid"] == pod["metadata"]["uid"] for p in pods(api, namespace))
            except OSError:
                return False

        wait_for(served_again, timeout=40, what="a new agent pod serving the subscription")
        status, shown = redfish_at(base, "GET", sub["@odata.id"])
        assert (shown["Context"], shown["Destination"]) == ("metal3", rx.url)
        assert ipmitool(base.removeprefix("http://"), "power", "on").returncode == 0
        wait_for(lambda: POWERED_ON in rx.message_ids(), timeout=20, what="an event from the new pod")


def test_a_slow_destination_gets_a_bounded_queue_that_drops_the_oldest(caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus()
    service = EventService(bus, system="/redfish/v1/Systems/vm1", system_name="vm1", media_base=MEDIA)
    service.start()
    release = threading.Event()
    with receiver() as rx:
        handler = rx.server.RequestHandlerClass
        original = handler.do_POST  # type: ignore[attr-defined]

        def held(self: Any) -> None:
            release.wait(10)
            original(self)

        handler.do_POST = held  # type: ignore[attr-defined]
        try:
            service.create(Subscription(id="", destination=rx.url))
            total = 500
            for i in range(total):  # the publisher never waits on the destination
                bus.publish("PowerStateChanged", "m", to="On" if i % 2 else "Off")
            [deliverer] = service._deliverers.values()
            assert deliverer.dropped >= total - QUEUE_LENGTH - 1
            assert "the oldest dropped" in caplog.text
        finally:
            release.set()
        wait_for(lambda: rx.records() and rx.records()[-1]["EventId"] == str(total), what="the newest event")
        ids = [int(r["EventId"]) for r in rx.records()]
        assert len(ids) <= QUEUE_LENGTH + 1 and ids == sorted(ids)
    service.close()


def test_applying_the_events_secret_again_keeps_what_the_agent_wrote(api: client.ApiClient, namespace: str) -> None:
    bmc = {"metadata": {"name": "vm", "namespace": namespace, "uid": "u"}}
    want = desired.desired_events_secret(bmc, "vm")
    del want["metadata"]["ownerReferences"]
    path = f"/api/v1/namespaces/{namespace}/secrets/{want['metadata']['name']}"
    query = {"fieldManager": "kubevbmc-controller", "force": "true"}
    assert call(api, "PATCH", path, want, content_type=APPLY, query=query).status == 201
    secret = call(api, "GET", path).body
    secret["data"] = {SECRET_KEY: base64.b64encode(b"[]").decode()}
    assert call(api, "PUT", path, secret).status == 200  # the agent's write (an update)
    want["metadata"]["labels"]["extra"] = "label"  # a change, so that the apply writes
    assert call(api, "PATCH", path, want, content_type=APPLY, query=query).status == 200
    assert call(api, "GET", path).body["data"] == {SECRET_KEY: base64.b64encode(b"[]").decode()}


def test_an_sse_id_from_before_a_restart_replays_the_whole_history() -> None:
    bus = EventBus()
    service = EventService(bus, system="/redfish/v1/Systems/vm1", system_name="vm1", media_base=MEDIA)
    service.start()
    for to in ("On", "Off", "On"):
        bus.publish("PowerStateChanged", "m", to=to)
    stream = service.open_stream([], [], [], 500)
    assert stream is not None
    assert [f.split(b"\n", 1)[0] for f in stream.drain()] == [b"id: 1", b"id: 2", b"id: 3"]
    stream.close()
    assert service.open_streams == 0
    service.close()


@pytest.mark.parametrize(("policy", "delays"), [
    ("SuspendRetries", [10, 10, 10]),
    ("RetryForever", [10, 10, 10, 10, 10, 10]),
    ("RetryForeverWithBackoff", [10, 10, 10, 20, 40, 80]),
])
def test_retry_delays_follow_the_policy(policy: str, delays: list[float]) -> None:
    assert [retry_delay(policy, n, 3, 10) for n in range(1, len(delays) + 1)] == delays
    assert retry_delay("RetryForeverWithBackoff", 100, 3, 10) == 3600


def test_a_retry_forever_destination_gets_the_event_once_it_answers(agent: AgentProcess) -> None:
    agent.redfish("PATCH", EVENT_SERVICE, {"DeliveryRetryAttempts": 0, "DeliveryRetryIntervalSeconds": 1})
    with receiver(status=500) as rx:
        sub = subscribe(agent, rx.url, DeliveryRetryPolicy="RetryForever")
        power(agent, "On")
        wait_for(lambda: len(rx.records()) >= 2, what="a retry past DeliveryRetryAttempts")
        rx.status = 204
        count = len(rx.records())
        wait_for(lambda: len(rx.records()) > count, what="the delivery that succeeds")
        assert set(rx.message_ids()) == {POWERED_ON}
        assert agent.redfish("GET", sub["@odata.id"])[1]["Status"]["State"] == "Enabled"


def test_until_the_subscriptions_secret_can_be_read_subscribing_is_503(sim: Sim, api: client.ApiClient,
                                                                      namespace: str, bmc_crd: None) -> None:
    # Not the controller's name for it: a controller running in this session would create that one at once.
    name = "subscriptions-made-later"
    with agent_for_vm(sim, api, namespace, "--subscriptions-secret", name) as agent:
        body = {"Destination": "http://listener.example.com/events", "Protocol": "Redfish"}
        status, doc = agent.redfish("POST", SUBSCRIPTIONS, body)
        assert status == 503 and doc["error"]["@Message.ExtendedInfo"][0]["MessageId"].endswith(
            "ServiceTemporarilyUnavailable")
        secret = desired.desired_events_secret({"metadata": {"name": "vm", "namespace": namespace, "uid": "u"}},
                                               "vm")
        del secret["metadata"]["ownerReferences"]
        secret["metadata"]["name"] = name
        assert call(api, "POST", f"/api/v1/namespaces/{namespace}/secrets", secret).status == 201
        wait_for(lambda: agent.redfish("GET", SUBSCRIPTIONS)[0] == 200, what="the Secret to be read")
        assert agent.redfish("POST", SUBSCRIPTIONS, body)[0] == 201
