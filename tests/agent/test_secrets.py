"""Secrets never derivable (issue 11, deliverable 5): nothing readable without the credentials Secret reveals the
password or lets anyone test a guess of it, and no key material outlives the process that wrote it."""

from __future__ import annotations

import base64
import hashlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from controller import certificates, desired
from controller.settings import Settings
from kubesim.cluster import Cluster, SimConfig
from vbmc.access.audit import redact_url
from vbmc.machine.kubevirt.client import KubeClient, load_credentials

from ..controller.test_units import bmc
from ..support.agents import AgentProcess, agent_for_vm
from ..support.cluster import call, start_sim, wait_for
from ..support.vms import make_bmc, make_vm


def credentials(password: str, uid: str = "uid-1", resource_version: str = "7") -> dict[str, Any]:
    data = {"username": "admin", "password": password}
    return {"metadata": {"name": "auth", "namespace": "ns", "uid": uid, "resourceVersion": resource_version},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


def deployment(secret: dict[str, Any]) -> dict[str, Any]:
    tls = desired.desired_tls_secret(bmc(), "vm", certificates.TLSMaterial(b"c", b"k", b"a"))
    return desired.desired_deployment(bmc(), "vm", Settings(agent_image="img:1"), secret, tls)


def test_the_agent_deployment_lets_no_one_test_a_password_guess() -> None:
    """Two Secrets that differ only in the password give the same Deployment: nothing in it depends on the
    password, so nothing in it can confirm a guess (it used to carry sha256 of username and password)."""
    assert deployment(credentials("hunter2")) == deployment(credentials("correct horse battery staple"))
    text = json.dumps(deployment(credentials("hunter2")))
    data = credentials("hunter2")["data"]
    unsalted = hashlib.sha256("".join(f"{k}={data[k]}\n" for k in sorted(data)).encode()).hexdigest()
    assert unsalted not in text and "hunter2" not in text and data["password"] not in text


def test_a_changed_credentials_secret_still_rolls_its_agent() -> None:
    def roll_trigger(secret: dict[str, Any]) -> str:
        return deployment(secret)["spec"]["template"]["metadata"]["annotations"][desired.CREDENTIALS_VERSION]

    same = roll_trigger(credentials("a"))
    assert roll_trigger(credentials("a")) == same  # a reconcile, or a restarted controller: nothing to write
    assert roll_trigger(credentials("b", resource_version="8")) != same  # the Secret was updated
    assert roll_trigger(credentials("a", uid="uid-2")) != same  # deleted and created again


def test_a_simulated_cluster_leaves_no_key_or_token_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cluster = Cluster(SimConfig(host="127.0.0.1", port=0))
    cluster.start()
    try:
        assert [p for p in tmp_path.rglob("*") if p.is_file() and b"PRIVATE KEY" in p.read_bytes()] == []
        assert KubeClient(load_credentials(cluster.kubeconfig)).request("GET", "/api/v1/namespaces")["items"]
    finally:
        cluster.stop()
    assert list(tmp_path.iterdir()) == []  # its kubeconfig (a token) went with it


def test_the_agents_api_client_writes_no_pem_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  sim: Any) -> None:
    """A kubeconfig with inline certificate data (as kubesim's, as many clusters') used to leave one PEM in /tmp
    per agent start."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for _ in range(3):
        client = KubeClient(load_credentials(sim.kubeconfig))
        assert client.request("GET", "/api/v1/namespaces")["items"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("url", "shown"), [
    ("http://user:pw@images.example.com/x.iso", "http://images.example.com/x.iso"),
    ("https://u%40corp:p%3Aw@host:8443/a/b.iso?sig=1#f", "https://host:8443/a/b.iso?sig=1#f"),
    ("http://a@b@host/x.iso", "http://host/x.iso"),  # the last @ ends the userinfo
    ("http://host/path/with@sign.iso", "http://host/path/with@sign.iso"),  # an @ after the authority is kept
    ("http://user:pw@[::1/x", "http://[::1/x"),  # malformed: still redacted, no exception
    ("not a url", "not a url"),
])
def test_an_image_url_is_shown_without_its_userinfo(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.fixture
def agent(sim: Any, api: client.ApiClient, namespace: str, bmc_crd: None) -> Iterator[AgentProcess]:
    with agent_for_vm(sim, api, namespace) as process:
        yield process


CD = "/redfish/v1/Systems/vm/VirtualMedia/Cd"


def test_credentials_in_an_image_url_reach_the_import_but_no_event_log_or_redfish_answer(
        agent: AgentProcess, api: client.ApiClient, namespace: str, image_server: Any) -> None:
    host = image_server.base.removeprefix("http://")
    url = f"http://mediauser:media-pw-42@{host}/installer.iso"
    status, task = agent.redfish("POST", f"{CD}/Actions/VirtualMedia.InsertMedia", {"Image": url, "Inserted": True})
    assert status == 202 and "media-pw-42" not in str(task)
    dv = call(api, "GET", f"/apis/cdi.kubevirt.io/v1beta1/namespaces/{namespace}/datavolumes/vm-cdrom").body
    assert dv["spec"]["source"]["http"]["url"] == url  # the importer needs them
    status, cd = agent.redfish("GET", CD)
    assert status == 200 and cd["Image"] == f"http://{host}/installer.iso"
    assert cd["ImageName"] == "installer.iso"

    def inserted() -> list[dict[str, Any]]:
        items = call(api, "GET", f"/api/v1/namespaces/{namespace}/events").body["items"]
        return [e for e in items if e.get("reason") == "VirtualMediaInserted"]

    event = wait_for(inserted, what="the VirtualMediaInserted Event")[0]
    assert f"http://{host}/installer.iso" in event["message"]
    assert "media-pw-42" not in event["message"] and "mediauser" not in event["message"]
    assert "media-pw-42" not in agent.output()


@pytest.mark.parametrize("parameters", [{"UserName": "mediauser"}, {"Password": "media-pw-42"},
                                        {"UserName": "mediauser", "Password": "media-pw-42"}])
def test_insert_media_credentials_are_refused_never_dropped(agent: AgentProcess, api: client.ApiClient,
                                                            namespace: str, parameters: dict[str, str],
                                                            image_server: Any) -> None:
    body = {"Image": f"{image_server.base}/installer.iso", "Inserted": True, **parameters}
    status, answer = agent.redfish("POST", f"{CD}/Actions/VirtualMedia.InsertMedia", body)
    assert status == 400
    info = answer["error"]["@Message.ExtendedInfo"][0]
    assert info["MessageId"].endswith("ActionParameterNotSupported")
    assert info["MessageArgs"][0] in parameters and info["MessageArgs"][1] == "VirtualMedia.InsertMedia"
    assert agent.redfish("GET", CD)[1]["Inserted"] is False  # nothing was inserted
    assert call(api, "GET", f"/apis/cdi.kubevirt.io/v1beta1/namespaces/{namespace}/datavolumes/vm-cdrom").status \
        == 404
    # What sushy sends on a retry: empty credentials are no credentials.
    empty = {**body, "UserName": "", "Password": ""}
    assert agent.redfish("POST", f"{CD}/Actions/VirtualMedia.InsertMedia", empty)[0] == 202


def leftovers(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def test_kubesim_run_as_a_process_leaves_nothing_in_tmp_after_sigterm(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    sim = start_sim(tmp_path / "sim")
    assert [p for p in scratch.rglob("*") if p.is_file() and b"PRIVATE KEY" in p.read_bytes()] == []
    sim.stop()  # SIGTERM
    assert leftovers(scratch) == []


def test_an_agent_leaves_nothing_in_tmp_after_sigterm(tmp_path: Path, sim: Any, api: client.ApiClient,
                                                      namespace: str, bmc_crd: None) -> None:
    """It used to leave one PEM (the kubeconfig's CA) per start."""
    make_vm(api, namespace)
    make_bmc(api, namespace)
    process = AgentProcess("--namespace", namespace, "--vm", "vm", "--vmbmc", "vm",
                           env={"KUBECONFIG": sim.kubeconfig, "TMPDIR": str(tmp_path)})
    try:
        wait_for(process.ready, timeout=20, what="the agent to be ready")
    finally:
        assert process.stop() == 0
    assert leftovers(tmp_path) == []
