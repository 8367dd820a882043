"""DSP0266's protocol rules, as strict clients and DMTF's validators check them: query parameters, media types,
OData-Version, ETags and If-Match, session login at Sessions/Members, partial PATCH, and credentials over HTTPS only
when the BMC asks for it."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import sushy
from flask.testing import FlaskClient

from controller.desired import desired_deployment
from controller.settings import Settings
from vbmc.machine import BootEnabled, BootOverride, BootTarget
from vbmc.machine.memory import MemoryMachine
from vbmc.redfish.app import create_app

from ..support.agents import (
    PASSWORD,
    USER,
    AgentProcess,
    free_port,
    running_agent,
    sushy_at,
    write_serving_certificate,
)

AUTH = {"Authorization": "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}
SYSTEM = "/redfish/v1/Systems/vm"


@pytest.fixture
def machine() -> MemoryMachine:
    return MemoryMachine("vm")


@pytest.fixture
def client(machine: MemoryMachine) -> FlaskClient:
    return create_app(machine, USER, PASSWORD).test_client()


def message_ids(resp: Any) -> list[str]:
    body = resp.json or {}
    infos = (body.get("error") or {}).get("@Message.ExtendedInfo") or body.get("@Message.ExtendedInfo") or []
    return [i["MessageId"].rsplit(".", 1)[-1] for i in infos]


# ---- query parameters


@pytest.mark.parametrize("query", ["$expand=.", "$select=PowerState", "$top=1", "$skip=1", "$filter=Id eq 'x'",
                                   "$levels=2", "only", "excerpt"])
def test_unsupported_query_parameters_are_501(client: FlaskClient, query: str) -> None:
    resp = client.get(f"/redfish/v1/Systems?{query}", headers=AUTH)
    assert resp.status_code == 501
    assert message_ids(resp) == ["QueryParameterUnsupported"]
    assert query.split("=")[0] in resp.json["error"]["message"]  # type: ignore[index]


def test_other_query_parameters_are_ignored_and_the_root_says_what_is_supported(client: FlaskClient) -> None:
    assert client.get(f"{SYSTEM}?cachebuster=1", headers=AUTH).status_code == 200
    features = client.get("/redfish/v1").json["ProtocolFeaturesSupported"]  # type: ignore[index]
    assert features["ExpandQuery"]["ExpandAll"] is False and features["SelectQuery"] is False
    assert features["FilterQuery"] is False and features["TopSkipQuery"] is False
    assert features["OnlyMemberQuery"] is False and features["ExcerptQuery"] is False
    assert features["MultipleHTTPRequests"] is True


# ---- headers


def test_a_body_that_is_not_json_is_415(client: FlaskClient, machine: MemoryMachine) -> None:
    resp = client.patch(SYSTEM, data="Boot=Pxe", headers={**AUTH, "Content-Type": "application/x-www-form-urlencoded"})
    assert resp.status_code == 415 and message_ids(resp) == ["HeaderInvalid"]
    assert machine.boot_override().target == BootTarget.NONE
    # JSON with a charset, and JSON without a Content-Type (scripts sending data=): accepted
    ok = client.patch(SYSTEM, data='{"Boot": {"BootSourceOverrideTarget": "Pxe"}}',
                      headers={**AUTH, "Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_an_unsupported_odata_version_is_412(client: FlaskClient) -> None:
    resp = client.get(SYSTEM, headers={**AUTH, "OData-Version": "4.1"})
    assert resp.status_code == 412 and message_ids(resp) == ["HeaderInvalid"]
    assert client.get(SYSTEM, headers={**AUTH, "OData-Version": "4.0"}).status_code == 200


# ---- ETags


@pytest.mark.parametrize("path", [SYSTEM, f"{SYSTEM}/SecureBoot", "/redfish/v1/Managers/BMC/VirtualMedia/Cd",
                                  "/redfish/v1/AccountService/Accounts/1", "/redfish/v1/EventService"])
def test_writable_resources_carry_a_strong_etag(client: FlaskClient, path: str) -> None:
    etag = client.get(path, headers=AUTH).headers.get("ETag", "")
    assert etag.startswith('"') and etag.endswith('"')  # strong: no W/


def test_a_weak_if_match_is_refused(client: FlaskClient, machine: MemoryMachine) -> None:
    etag = client.get(SYSTEM, headers=AUTH).headers["ETag"]
    body = {"Boot": {"BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Once"}}
    assert client.patch(SYSTEM, json=body, headers={**AUTH, "If-Match": f"W/{etag}"}).status_code == 412
    assert machine.boot_override().target == BootTarget.NONE
    assert client.patch(SYSTEM, json=body, headers={**AUTH, "If-Match": etag}).status_code == 200
    assert machine.boot_override().target == BootTarget.PXE


def test_event_destinations_carry_an_etag_and_honour_if_match(client: FlaskClient) -> None:
    created = client.post("/redfish/v1/EventService/Subscriptions", headers=AUTH,
                          json={"Destination": "http://127.0.0.1:9/events", "Protocol": "Redfish"})
    path = created.headers["Location"]
    etag = client.get(path, headers=AUTH).headers["ETag"]
    assert client.patch(path, json={"Context": "new"}, headers={**AUTH, "If-Match": '"other"'}).status_code == 412
    assert client.patch(path, json={"Context": "new"}, headers={**AUTH, "If-Match": etag}).status_code == 200


# ---- sessions


def test_a_post_to_sessions_members_logs_in(client: FlaskClient) -> None:
    resp = client.post("/redfish/v1/SessionService/Sessions/Members", json={"UserName": USER, "Password": PASSWORD})
    assert resp.status_code == 201
    token = resp.headers["X-Auth-Token"]
    assert client.get(SYSTEM, headers={"X-Auth-Token": token}).status_code == 200
    wrong = client.post("/redfish/v1/SessionService/Sessions/Members", json={"UserName": USER, "Password": "x"})
    assert wrong.status_code == 401


# ---- partial PATCH


def test_a_patch_applies_what_it_can_and_says_what_it_did_not(client: FlaskClient, machine: MemoryMachine) -> None:
    body = {"PowerState": "On", "AssetTag": "rack-7",
            "Boot": {"BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Continuous"}}
    resp = client.patch(SYSTEM, json=body, headers=AUTH)
    assert resp.status_code == 200
    assert machine.boot_override().target == BootTarget.PXE
    assert machine.boot_override().enabled == BootEnabled.CONTINUOUS
    assert sorted(message_ids(resp)) == ["PropertyNotWritable", "PropertyUnknown"]
    assert resp.json["Boot"]["BootSourceOverrideTarget"] == "Pxe"  # type: ignore[index]
    related = {i["RelatedProperties"][0] for i in resp.json["@Message.ExtendedInfo"]}  # type: ignore[index]
    assert related == {"#/PowerState", "#/AssetTag"}


def test_a_patch_with_nothing_writable_is_refused_whole(client: FlaskClient) -> None:
    resp = client.patch(SYSTEM, json={"PowerState": "On"}, headers=AUTH)
    assert resp.status_code == 400 and message_ids(resp) == ["PropertyNotWritable"]


def test_sushy_still_sets_boot_through_the_strict_service(agent: AgentProcess) -> None:
    with sushy_at(agent.url) as root:
        system = root.get_system(SYSTEM)
        system.set_system_boot_options(sushy.BootSource.PXE, enabled=sushy.BootSourceOverrideEnabled.ONCE)
        system.refresh()
        assert system.boot.target == sushy.BootSource.PXE


# ---- credentials over HTTPS only


@pytest.fixture
def agent() -> Iterator[AgentProcess]:
    with running_agent("--backend", "memory", "--vm", "vm") as process:
        yield process


@pytest.fixture
def tls_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[AgentProcess, str, Path]]:
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    cert, key = write_serving_certificate(tmp_path)
    port = free_port()
    with running_agent("--backend", "memory", "--vm", "vm", "--redfish-tls-address", f"127.0.0.1:{port}",
                       "--tls-cert", str(cert), "--tls-key", str(key), "--redfish-require-tls", "true") as process:
        yield process, f"https://127.0.0.1:{port}", cert


def test_require_tls_refuses_credentials_over_http_and_takes_them_over_https(
        tls_agent: tuple[AgentProcess, str, Path]) -> None:
    agent, https, cert = tls_agent
    auth = (USER, PASSWORD)
    assert requests.get(f"{agent.url}/redfish/v1", timeout=5).status_code == 200  # the root stays readable
    for resp in (requests.get(f"{agent.url}{SYSTEM}", auth=auth, timeout=5),
                 requests.post(f"{agent.url}/redfish/v1/SessionService/Sessions", timeout=5,
                               json={"UserName": USER, "Password": PASSWORD}),
                 requests.post(f"{agent.url}/redfish/v1/SessionService/Sessions/Members/", timeout=5,
                               json={"UserName": USER, "Password": PASSWORD}),
                 requests.get(f"{agent.url}{SYSTEM}", headers={"X-Auth-Token": "anything"}, timeout=5)):
        assert resp.status_code == 403
        assert "HTTPS only" in resp.json()["error"]["message"]
        assert "X-Auth-Token" not in resp.headers
    assert requests.get(f"{https}{SYSTEM}", auth=auth, verify=str(cert), timeout=5).status_code == 200
    login = requests.post(f"{https}/redfish/v1/SessionService/Sessions", verify=str(cert), timeout=5,
                          json={"UserName": USER, "Password": PASSWORD})
    assert login.status_code == 201
    # sushy against the HTTPS URL, as Metal3's redfish:// (HTTPS) drives it
    with sushy_at(https, verify=str(cert)) as root:
        assert root.get_system(SYSTEM).power_state == sushy.PowerState.OFF


def test_the_controller_passes_require_tls_to_the_agent() -> None:
    bmc = {"metadata": {"name": "vm", "namespace": "ns", "uid": "u1"},
           "spec": {"virtualMachineRef": {"name": "vm"}, "redfish": {"requireTLS": True}}}
    creds = {"metadata": {"name": "auth", "uid": "s1", "resourceVersion": "1"}}
    tls = {"metadata": {"name": "vm-virtbmc-tls"}, "data": {"tls.crt": "x", "tls.key": "y"}}
    args = desired_deployment(bmc, "vm", Settings(), creds, tls)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--redfish-require-tls") + 1] == "true"
    bmc["spec"]["redfish"] = {}
    args = desired_deployment(bmc, "vm", Settings(), creds, tls)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--redfish-require-tls" not in args  # off by default: no flag, no rollout for existing BMCs


# ---- conditional GET, empty bodies, POST to a collection's Members


def test_if_none_match_with_the_current_etag_is_304(client: FlaskClient, machine: MemoryMachine) -> None:
    first = client.get(SYSTEM, headers=AUTH)
    etag = first.headers["ETag"]
    again = client.get(SYSTEM, headers={**AUTH, "If-None-Match": etag})
    assert again.status_code == 304 and again.data == b"" and again.headers["ETag"] == etag
    assert client.get(SYSTEM, headers={**AUTH, "If-None-Match": f"W/{etag}"}).status_code == 304  # weak comparison
    machine.set_boot_override(BootOverride(BootTarget.PXE, BootEnabled.ONCE))
    changed = client.get(SYSTEM, headers={**AUTH, "If-None-Match": etag})
    assert changed.status_code == 200 and changed.headers["ETag"] != etag
    assert changed.json["Boot"]["BootSourceOverrideTarget"] == "Pxe"  # type: ignore[index]


def test_an_empty_body_labelled_as_form_data_is_not_415(client: FlaskClient) -> None:
    # curl -X POST -d '' labels an empty body application/x-www-form-urlencoded: nothing to refuse as a media type
    resp = client.post(f"{SYSTEM}/Actions/ComputerSystem.Reset", data="",
                       headers={**AUTH, "Content-Type": "application/x-www-form-urlencoded"})
    assert resp.status_code == 400 and "HeaderInvalid" not in message_ids(resp)


def test_post_to_a_collections_members_creates_as_the_collection_does(client: FlaskClient,
                                                                     machine: MemoryMachine) -> None:
    volumes = f"{SYSTEM}/Storage/1/Volumes"
    before = len(client.get(volumes, headers=AUTH).json["Members"])  # type: ignore[index]
    created = client.post(f"{volumes}/Members", json={"CapacityBytes": 2**30, "RAIDType": "RAID0"}, headers=AUTH)
    assert created.status_code == 201 and created.headers["Location"].startswith(f"{volumes}/")
    assert len(client.get(volumes, headers=AUTH).json["Members"]) == before + 1  # type: ignore[index]
    subscriptions = "/redfish/v1/EventService/Subscriptions"
    sub = client.post(f"{subscriptions}/Members", headers=AUTH,
                      json={"Destination": "https://listener.example.com/events", "Protocol": "Redfish"})
    assert sub.status_code == 201, sub.json
    assert client.get(sub.headers["Location"], headers=AUTH).status_code == 200
    assert client.get(f"{subscriptions}/Members", headers=AUTH).status_code == 404  # not a subscription


@pytest.mark.parametrize("path", ["/redfish/v1/EventService/Subscriptions/Members",
                                  f"{SYSTEM}/Storage/1/Volumes/Members"])
@pytest.mark.parametrize("body", ["{not json", "[]", '{"CapacityBytes": "big", "Destination": 5}'])
def test_a_malformed_post_to_members_is_400_and_creates_nothing(client: FlaskClient, machine: MemoryMachine,
                                                                path: str, body: str) -> None:
    disks = len(machine.inventory().disks)
    resp = client.post(path, data=body, headers={**AUTH, "Content-Type": "application/json"})
    assert resp.status_code == 400 and message_ids(resp)
    assert len(machine.inventory().disks) == disks
    members = client.get("/redfish/v1/EventService/Subscriptions", headers=AUTH).json["Members"]  # type: ignore[index]
    assert members == []


def test_a_malformed_if_none_match_is_an_ordinary_get(client: FlaskClient) -> None:
    for header in ("garbage", '"', "W/", ",,,"):
        resp = client.get(SYSTEM, headers={**AUTH, "If-None-Match": header})
        assert resp.status_code == 200 and resp.json["Id"] == "vm"  # type: ignore[index]
