"""Secrets never derivable (issue 11, deliverable 5): nothing readable without the credentials Secret reveals the
password or lets anyone test a guess of it, and no key material outlives the process that wrote it."""

from __future__ import annotations

import base64
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

from controller import certificates, desired
from controller.settings import Settings
from kubesim.cluster import Cluster, SimConfig
from vbmc.kube import KubeClient, load_credentials

from .test_controller_units import bmc


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
