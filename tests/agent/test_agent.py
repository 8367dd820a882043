"""`kubevbmc agent` as a user runs it: a real process, reached with ipmitool and HTTP, driving kubesim's VMs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from ..support.agents import PASSWORD, USER, AgentProcess
from ..support.cluster import REPO, STOP_DEADLINE, Sim, call, wait_for
from ..support.vms import get_vm, make_bmc, make_vm


@pytest.fixture
def memory_agent() -> Iterator[AgentProcess]:
    agent = AgentProcess("--backend", "memory", "--vm", "demo")
    wait_for(agent.ready, timeout=15, what="the agent to be ready")
    yield agent
    agent.stop()


def test_agent_serves_ipmi_and_redfish_over_one_machine(memory_agent: AgentProcess) -> None:
    assert "Chassis Power is off" in memory_agent.ipmitool("power", "status").stdout
    assert memory_agent.ipmitool("power", "on").returncode == 0
    status, system = memory_agent.redfish("GET", "/redfish/v1/Systems/demo")
    assert status == 200 and system["PowerState"] == "On"
    status, _ = memory_agent.redfish("POST", "/redfish/v1/Systems/demo/Actions/ComputerSystem.Reset",
                                     {"ResetType": "ForceOff"})
    assert status in (200, 202, 204)
    assert "Chassis Power is off" in memory_agent.ipmitool("power", "status", cipher="3").stdout


def test_agent_health_endpoints_need_no_credentials(memory_agent: AgentProcess) -> None:
    for path in ("/healthz", "/readyz"):
        with urllib.request.urlopen(memory_agent.url + path, timeout=2) as resp:
            assert resp.status == 200


def test_agent_without_redfish_answers_ipmi_and_its_probes_only() -> None:
    agent = AgentProcess("--backend", "memory", "--vm", "demo", "--redfish", "false")
    try:
        wait_for(agent.ready, timeout=15, what="the agent to be ready")
        with urllib.request.urlopen(agent.url + "/healthz", timeout=2) as resp:
            assert resp.status == 200
        for path in ("/redfish/v1", "/redfish/v1/Systems/demo"):
            status, body = agent.redfish("GET", path)
            assert status == 404
            assert body["error"]["code"] == "Base.1.19.ServiceDisabled"
        status, _ = agent.redfish("POST", "/redfish/v1/Systems/demo/Actions/ComputerSystem.Reset", {"ResetType": "On"})
        assert status == 404
        assert "Chassis Power is off" in agent.ipmitool("power", "status").stdout  # the POST changed nothing
    finally:
        agent.stop()


def test_agent_refuses_https_redfish_with_redfish_off(tmp_path: Path) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_text("x")
    key.write_text("x")
    result = subprocess.run([sys.executable, "-m", "vbmc", "agent", "--backend", "memory", "--vm", "x",
                             "--redfish", "false", "--redfish-tls-address", "127.0.0.1:0",
                             "--tls-cert", str(cert), "--tls-key", str(key)],
                            capture_output=True, text=True, timeout=30, cwd=REPO,
                            env={**os.environ, "VBMC_USERNAME": USER, "VBMC_PASSWORD": PASSWORD})
    assert result.returncode == 2
    assert "--redfish-tls-address serves Redfish: it cannot go with --redfish false" in result.stderr


@pytest.mark.parametrize("seconds", ["-1", "nan", "90000"])
def test_agent_refuses_a_keep_ejected_media_time_out_of_range(seconds: str) -> None:
    result = subprocess.run([sys.executable, "-m", "vbmc", "agent", "--backend", "memory", "--vm", "x",
                             "--keep-ejected-media", seconds], capture_output=True, text=True, timeout=30, cwd=REPO,
                            env={**os.environ, "VBMC_USERNAME": USER, "VBMC_PASSWORD": PASSWORD})
    assert result.returncode == 2
    assert "--keep-ejected-media must be between 0 and 86400 seconds" in result.stderr


def test_agent_stops_on_sigterm(memory_agent: AgentProcess) -> None:
    assert memory_agent.stop(timeout=STOP_DEADLINE) == 0  # exit 0, not killed
    with pytest.raises(OSError):
        urllib.request.urlopen(memory_agent.url + "/healthz", timeout=1)


def test_agent_without_credentials_exits_with_a_clear_error() -> None:
    result = subprocess.run([sys.executable, "-m", "vbmc", "agent", "--backend", "memory", "--vm", "x"],
                            capture_output=True, text=True, timeout=30, cwd=REPO,
                            env={k: v for k, v in os.environ.items() if not k.startswith("VBMC_")})
    assert result.returncode == 2
    assert "VBMC_USERNAME and VBMC_PASSWORD must be set" in result.stderr


def test_agent_drives_a_kubevirt_vm(sim: Sim, api: client.ApiClient, namespace: str, bmc_crd: None) -> None:
    make_vm(api, namespace)
    make_bmc(api, namespace)
    agent = AgentProcess("--namespace", namespace, "--vm", "vm", "--vmbmc", "vm", env={"KUBECONFIG": sim.kubeconfig})
    try:
        wait_for(agent.ready, timeout=15, what="the agent to be ready")
        assert "Chassis Power is off" in agent.ipmitool("power", "status").stdout
        on = agent.ipmitool("power", "on")
        assert on.returncode == 0, on.stderr
        assert get_vm(api, namespace)["spec"]["runStrategy"] == "Manual"
        wait_for(lambda: get_vm(api, namespace).get("status", {}).get("printableStatus") == "Running", timeout=10,
                 what="the VM to run")
        wait_for(lambda: agent.redfish("GET", "/redfish/v1/Systems/vm")[1]["PowerState"] == "On", timeout=5,
                 what="Redfish to report On")
        status, _ = agent.redfish("PATCH", "/redfish/v1/Systems/vm", {"Boot": {
            "BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Once",
            "BootSourceOverrideMode": "UEFI"}})
        assert status in (200, 204)
        bmc = call(api, "GET", f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{namespace}/virtualmachinebmcs/vm").body
        assert bmc["status"]["bootOverride"]["target"] == "Pxe"
        bootparam = agent.ipmitool("chassis", "bootparam", "get", "5")
        assert "Force PXE" in bootparam.stdout, bootparam.stdout
    finally:
        agent.stop()


def test_agent_reports_an_unreachable_api_server_as_node_busy_and_503() -> None:
    kubeconfig = Path(os.environ.get("TMPDIR", "/tmp")) / f"dead-{os.getpid()}.kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "dead",
        "clusters": [{"name": "dead", "cluster": {"server": "https://127.0.0.1:1", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "dead", "context": {"cluster": "dead", "user": "u"}}]}))
    agent = AgentProcess("--namespace", "default", "--vm", "vm", "--ipmi-address", "", env={
        "KUBECONFIG": str(kubeconfig)})
    try:
        wait_for(lambda: agent.redfish("GET", "/redfish/v1")[0] == 200, timeout=20, what="the agent to serve")
        began = time.monotonic()
        status, body = agent.redfish("GET", "/redfish/v1/Systems/vm")
        assert status == 503 and time.monotonic() - began < 2
        assert body["error"]["@Message.ExtendedInfo"]
        assert not agent.ready()
    finally:
        agent.stop()


def test_agent_pod_behind_a_service_answers_ipmitool_on_the_cluster_ip(api: client.ApiClient, namespace: str,
                                                                     bmc_crd: None) -> None:
    """The agent as the controller will deploy it: a Pod of the project's image, reached through its Service."""
    make_vm(api, namespace)
    secret = {"metadata": {"name": "vm-auth"}, "stringData": {"username": USER, "password": PASSWORD}}
    assert call(api, "POST", f"/api/v1/namespaces/{namespace}/secrets", secret).status == 201

    def secret_env(name: str, key: str) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"secretKeyRef": {"name": "vm-auth", "key": key}}}

    pod_spec = {"containers": [{
        "name": "agent", "image": "kubevbmc:dev",
        "args": ["agent", "--namespace", "$(POD_NAMESPACE)", "--vm", "vm",
                 "--ipmi-address", "$(POD_IP):10623", "--redfish-address", "$(POD_IP):10080"],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                secret_env("VBMC_USERNAME", "username"), secret_env("VBMC_PASSWORD", "password")],
        "ports": [{"name": "ipmi", "containerPort": 10623, "protocol": "UDP"},
                  {"name": "http", "containerPort": 10080}],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 1},
    }]}
    deployment = {"metadata": {"name": "vm-virtbmc"}, "spec": {
        "replicas": 1, "selector": {"matchLabels": {"app": "vm-virtbmc"}}, "strategy": {"type": "Recreate"},
        "template": {"metadata": {"labels": {"app": "vm-virtbmc"}}, "spec": pod_spec}}}
    service = {"metadata": {"name": "vm-virtbmc"}, "spec": {"selector": {"app": "vm-virtbmc"}, "ports": [
        {"name": "ipmi", "port": 623, "targetPort": "ipmi", "protocol": "UDP"},
        {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]}}
    assert call(api, "POST", f"/apis/apps/v1/namespaces/{namespace}/deployments", deployment).status == 201
    created = call(api, "POST", f"/api/v1/namespaces/{namespace}/services", service)
    assert created.status == 201
    cluster_ip = created.body["spec"]["clusterIP"]

    def ready() -> bool:
        status = call(api, "GET", f"/apis/apps/v1/namespaces/{namespace}/deployments/vm-virtbmc").body["status"]
        return bool(status.get("readyReplicas"))

    wait_for(ready, timeout=30, what="the agent pod to be Ready")
    result = subprocess.run(["ipmitool", "-I", "lanplus", "-H", cluster_ip, "-U", USER, "-P", PASSWORD,
                             "power", "status"], capture_output=True, text=True, timeout=30)
    assert "Chassis Power is off" in result.stdout, result.stderr
    with urllib.request.urlopen(f"http://{cluster_ip}/redfish/v1", timeout=5) as resp:
        assert json.loads(resp.read())["Systems"]["@odata.id"] == "/redfish/v1/Systems"
