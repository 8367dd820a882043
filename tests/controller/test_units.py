"""The controller's pure parts, without a cluster: desired children, status, comparison, queue, certificates."""

from __future__ import annotations

import argparse
import base64
import datetime
import time
from pathlib import Path
from typing import Any

import pytest

from controller import certificates, desired
from controller.reconciler import difference, stale_owned_keys
from controller.settings import Settings, add_arguments, settings_from
from controller.status import (
    Observed,
    desired_status,
    load_balancer_address,
    progress_only,
    status_patch,
)
from controller.verdicts import agent_readiness
from controller.workqueue import WorkQueue
from vbmc.agent import command as agent

from ..support.cluster import wait_for

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def bmc(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "b", "namespace": "ns", "uid": "u1", "generation": 3},
            "spec": {"virtualMachineRef": {"name": "vm"}, "authSecretRef": {"name": "auth"}, **spec}}


def secret(resource_version: str = "1", **data: str) -> dict[str, Any]:
    return {"metadata": {"name": "auth", "uid": "u-auth", "resourceVersion": resource_version},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


def test_every_child_is_named_from_the_vm_labelled_and_controlled_by_the_bmc() -> None:
    b = bmc()
    tls = desired.desired_tls_secret(b, "vm", certificates.TLSMaterial(b"c", b"k", b"a"))
    creds = secret(username="u", password="p")
    for child in (desired.desired_service_account(b, "vm"), desired.desired_role(b, "vm", ["cdrom"]),
                  desired.desired_role_binding(b, "vm"), desired.desired_service(b, "vm"),
                  desired.desired_deployment(b, "vm", Settings(), creds, tls)):
        meta = child["metadata"]
        assert meta["name"] == "vm-virtbmc" and meta["namespace"] == "ns"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "kubevbmc"
        assert meta["labels"]["bmc.kubevirt.io/vmbmc"] == "b"
        assert meta["ownerReferences"] == [{"apiVersion": "bmc.kubevirt.io/v1beta1", "kind": "VirtualMachineBMC",
                                            "name": "b", "uid": "u1", "controller": True,
                                            "blockOwnerDeletion": True}]


def test_the_role_names_only_this_vm_its_vmi_datavolumes_and_bmc() -> None:
    rules = desired.desired_role(bmc(), "vm", ["cdrom"])["rules"]
    named = [r for r in rules if "resourceNames" in r]
    assert {n for r in named for n in r["resourceNames"]} == {"vm", "b", "vm-cdrom", "vm-virtbmc-events",
                                                               "vm-virtbmc-log"}
    unnamed = [(tuple(r["resources"]), tuple(r["verbs"])) for r in rules if "resourceNames" not in r]
    # create cannot be restricted by name in RBAC; nothing else is namespace-wide
    assert all(verbs == ("create",) for _, verbs in unnamed)
    consoles = next(r for r in rules if "virtualmachineinstances/vnc" in r["resources"])
    assert consoles == {"apiGroups": ["subresources.kubevirt.io"], "resourceNames": ["vm"], "verbs": ["get"],
                        "resources": ["virtualmachineinstances/console", "virtualmachineinstances/vnc"]}


def test_a_pool_role_grants_each_members_screen_and_no_other() -> None:
    role = desired.desired_pool_role("ns", "lab", [bmc()], [(bmc(), "vm", []), (bmc(), "other", [])])
    screens = [r for r in role["rules"] if "virtualmachineinstances/vnc" in r["resources"]]
    assert [sorted(r["resourceNames"]) for r in screens] == [["other", "vm"]]
    assert screens[0]["apiGroups"] == ["subresources.kubevirt.io"] and screens[0]["verbs"] == ["get"]


@pytest.mark.parametrize(("spec", "ports"), [
    ({}, [("ipmi", 623, "UDP"), ("http", 80, "TCP"), ("https", 443, "TCP")]),
    ({"redfish": {"enabled": False}}, [("ipmi", 623, "UDP")]),
    ({"ipmi": {"enabled": False}}, [("http", 80, "TCP"), ("https", 443, "TCP")]),
])
def test_service_ports_follow_the_enabled_protocols(spec: dict[str, Any], ports: list[tuple[str, int, str]]) -> None:
    svc = desired.desired_service(bmc(**spec), "vm")
    assert [(p["name"], p["port"], p["protocol"]) for p in svc["spec"]["ports"]] == ports


@pytest.mark.parametrize(("spec", "serves"), [
    ({}, {"ipmi": True, "redfish": True, "tls": True}),
    ({"redfish": {"enabled": False}}, {"ipmi": True, "redfish": False, "tls": False}),
    ({"ipmi": {"enabled": False}}, {"ipmi": False, "redfish": True, "tls": True}),
])
def test_the_agent_serves_only_the_enabled_protocols(spec: dict[str, Any], serves: dict[str, bool]) -> None:
    b = bmc(**spec)
    tls = desired.desired_tls_secret(b, "vm", certificates.TLSMaterial(b"c", b"k", b"a"))
    container = desired.desired_deployment(b, "vm", Settings(), secret(username="u", password="p"),
                                           tls)["spec"]["template"]["spec"]["containers"][0]
    agent_flags = argparse.ArgumentParser()
    agent.add_arguments(agent_flags)
    args = agent_flags.parse_args([a.replace("$(POD_IP)", "10.0.0.9").replace("$(POD_NAMESPACE)", "ns")
                                   for a in container["args"][1:]])
    assert {"ipmi": bool(args.ipmi_address), "redfish": args.redfish == "true",
            "tls": bool(args.redfish_tls_address)} == serves


def test_service_type_and_annotations_come_from_the_spec() -> None:
    svc = desired.desired_service(bmc(service={"type": "LoadBalancer", "annotations": {"a": "1"}}), "vm")
    assert svc["spec"]["type"] == "LoadBalancer" and svc["metadata"]["annotations"] == {"a": "1"}


def test_the_agent_deployment_is_locked_down_and_rolls_on_credential_changes() -> None:
    tls = desired.desired_tls_secret(bmc(), "vm", certificates.TLSMaterial(b"c", b"k", b"a"))
    one = desired.desired_deployment(bmc(), "vm", Settings(agent_image="img:1"), secret(username="u", password="p"),
                                     tls)
    two = desired.desired_deployment(bmc(), "vm", Settings(agent_image="img:1"),
                                     secret(resource_version="2", username="u", password="q"), tls)
    spec = one["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "img:1" and "$(POD_IP):10623" in c["args"]
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["capabilities"] == {
        "drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"]
    assert {(p["containerPort"], p["protocol"]) for p in c["ports"]} == {(10623, "UDP"), (10080, "TCP"),
                                                                          (10443, "TCP")}
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["resources"]["requests"]
    key = desired.CREDENTIALS_VERSION
    assert spec["template"]["metadata"]["annotations"][key] != two["spec"]["template"]["metadata"]["annotations"][key]


def test_the_agent_probes_are_sized_for_a_fleet_and_documented() -> None:
    """Issue 29: the kubelet sends every probe of every agent; after a fast start, readiness every 10 s and liveness
    every 20 s (not 1 s and 10 s), for dedicated and pooled agents alike, as docs/reference.md says."""
    dedicated = desired.desired_deployment(bmc(), "vm", Settings(), secret(username="u", password="p"), None)
    pooled = desired.desired_pool_deployment("ns", "rack", [bmc()], Settings())
    for deployment in (dedicated, pooled):
        c = deployment["spec"]["template"]["spec"]["containers"][0]
        probes = {kind: (c[f"{kind}Probe"]["httpGet"]["path"], c[f"{kind}Probe"]["httpGet"]["port"],
                         c[f"{kind}Probe"]["periodSeconds"]) for kind in ("startup", "readiness", "liveness")}
        assert probes == {"startup": ("/readyz", "http", 1), "readiness": ("/readyz", "http", 10),
                          "liveness": ("/healthz", "http", 20)}
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] == desired.STARTUP_SECONDS
        assert "initialDelaySeconds" not in c["livenessProbe"]  # the startup probe holds it back
    reference = " ".join((Path(__file__).parents[2] / "docs" / "reference.md").read_text().split())
    assert (f"a startup probe on `/readyz` every second (for up to {desired.STARTUP_SECONDS} s" in reference
            and "a readiness probe on `/readyz` every 10 s and a liveness probe on `/healthz` every 20 s" in reference)


@pytest.mark.parametrize(("environment", "flags", "level"), [
    ({}, [], "info"),
    ({"KUBEVBMC_AGENT_LOG_LEVEL": "debug"}, [], "debug"),
    ({"KUBEVBMC_AGENT_LOG_LEVEL": "debug"}, ["--agent-log-level", "warning"], "warning"),
])
def test_the_agent_log_level_setting_reaches_the_agents_own_flag(monkeypatch: pytest.MonkeyPatch,
                                                                 environment: dict[str, str], flags: list[str],
                                                                 level: str) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    controller_flags = argparse.ArgumentParser()
    add_arguments(controller_flags)
    settings = settings_from(controller_flags.parse_args(flags))
    tls = desired.desired_tls_secret(bmc(), "vm", certificates.TLSMaterial(b"c", b"k", b"a"))
    container = desired.desired_deployment(bmc(), "vm", settings, secret(username="u", password="p"),
                                           tls)["spec"]["template"]["spec"]["containers"][0]
    # What the agent makes of its args: the level it logs at.
    agent_flags = argparse.ArgumentParser()
    agent.add_arguments(agent_flags)
    assert agent_flags.parse_args(container["args"][1:]).log_level == level


@pytest.mark.parametrize(("environment", "flags", "seconds"), [
    ({}, [], 30),
    ({"KUBEVBMC_AGENT_NODE_LOSS_TOLERATION": "120"}, [], 120),
    ({"KUBEVBMC_AGENT_NODE_LOSS_TOLERATION": "120"}, ["--agent-node-loss-toleration", "0"], 0),
])
def test_the_agent_tolerates_a_lost_node_for_the_configured_seconds_not_kubernetes_300(
        monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], flags: list[str], seconds: int) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    controller_flags = argparse.ArgumentParser()
    add_arguments(controller_flags)
    settings = settings_from(controller_flags.parse_args(flags))
    pod = desired.desired_deployment(bmc(), "vm", settings, secret(username="u", password="p"),
                                     None)["spec"]["template"]["spec"]
    # Both taints the node lifecycle controller puts on a lost node, NoExecute: with these the API server's
    # DefaultTolerationSeconds admission adds none of its 300 s ones.
    assert pod["tolerations"] == [
        {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
         "tolerationSeconds": seconds},
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
         "tolerationSeconds": seconds}]


@pytest.mark.parametrize("value", ["-1", "1.5", "86401", "30s"])
def test_a_node_loss_toleration_that_is_not_whole_seconds_up_to_a_day_is_refused(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    controller_flags = argparse.ArgumentParser()
    add_arguments(controller_flags)
    with pytest.raises(SystemExit):
        controller_flags.parse_args([f"--agent-node-loss-toleration={value}"])
    assert "not a number of seconds from 0 to 86400" in capsys.readouterr().err


@pytest.mark.parametrize(("environment", "flags", "pod_secrets"), [
    ({}, [], None),  # none: the pod spec has no imagePullSecrets at all
    ({"KUBEVBMC_AGENT_IMAGE_PULL_SECRETS": "registry, mirror,,registry"}, [], ["registry", "mirror"]),
    ({"KUBEVBMC_AGENT_IMAGE_PULL_SECRETS": "registry"},
     ["--agent-image-pull-secrets", "a,b"], ["a", "b"]),  # the flag wins
])
def test_agent_image_pull_secrets_reach_the_agent_pod(monkeypatch: pytest.MonkeyPatch, environment: dict[str, str],
                                                      flags: list[str], pod_secrets: list[str] | None) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    controller_flags = argparse.ArgumentParser()
    add_arguments(controller_flags)
    settings = settings_from(controller_flags.parse_args(flags))
    pod = desired.desired_deployment(bmc(), "vm", settings, secret(username="u", password="p"),
                                     None)["spec"]["template"]["spec"]
    got = pod.get("imagePullSecrets")
    assert got == (None if pod_secrets is None else [{"name": name} for name in pod_secrets])


def test_an_agent_log_level_the_agent_does_not_know_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    controller_flags = argparse.ArgumentParser()
    add_arguments(controller_flags)
    with pytest.raises(SystemExit):
        controller_flags.parse_args(["--agent-log-level", "verbose"])
    assert "invalid choice: 'verbose'" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "problem"), [
    (["--rollout-batch", "0"], "not a batch size"),
    (["--rollout-batch", "150%"], "not a batch size"),
    (["--rollout-batch", "ten"], "not a batch size"),
    (["--rollout-timeout", "2s"], "out of range"),
    (["--rollout-timeout", "2d"], "not a duration"),
    (["--rollout-timeout", "soon"], "not a duration"),
])
def test_a_rollout_flag_out_of_its_domain_is_refused_naming_it(flags: list[str], problem: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    controller_flags = argparse.ArgumentParser()
    add_arguments(controller_flags)
    with pytest.raises(SystemExit) as exited:
        controller_flags.parse_args(flags)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and flags[0] in err and problem in err, err


def test_the_rollout_flags_read_what_they_say() -> None:
    from controller.settings import settings_from

    controller_flags = argparse.ArgumentParser()
    add_arguments(controller_flags)
    settings = settings_from(controller_flags.parse_args(["--rollout-batch", "25%", "--rollout-timeout", "90s"]))
    assert (settings.rollout_batch, settings.rollout_timeout) == ("25%", 90)
    settings = settings_from(controller_flags.parse_args(["--rollout-batch", "3", "--rollout-timeout", "2h"]))
    assert (settings.rollout_batch, settings.rollout_timeout) == ("3", 7200)


@pytest.mark.parametrize(("bmc_spec", "sec", "problem"), [
    ({}, secret(username="u", password="p"), None),
    ({}, None, "SecretNotFound"),
    ({}, secret(username="u"), "SecretMissingKeys"),
    ({"authSecretRef": None}, None, "SecretNotSpecified"),
])
def test_credentials_problems(bmc_spec: dict[str, Any], sec: Any, problem: str | None) -> None:
    from controller.spec import BMCSpec

    got = desired.credentials_problem(BMCSpec.of(bmc(**bmc_spec)), sec)
    assert (got[0] if got else None) == problem


def ready_deployment(**status: int) -> dict[str, Any]:
    return {"metadata": {"generation": 2}, "spec": {"replicas": 1}, "status": {
        "observedGeneration": 2, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1, **status}}


@pytest.mark.parametrize(("observed", "ready", "why"), [
    (Observed(True, None, cluster_ip="10.0.0.1", deployment=ready_deployment()), "True", "Ready"),
    (Observed(False, None, cluster_ip="10.0.0.1"), "False", "VirtualMachineNotFound"),
    (Observed(True, ("SecretNotFound", "x"), cluster_ip="10.0.0.1"), "False", "SecretNotFound"),
    (Observed(True, None, cluster_ip="10.0.0.1", conflict_with="a"), "False", "Conflict"),
    (Observed(True, None, cluster_ip="10.0.0.1", deployment=ready_deployment(readyReplicas=0)), "False",
     "AgentNotReady"),
    (Observed(True, None, cluster_ip="10.0.0.1", deployment=ready_deployment(observedGeneration=1)), "False",
     "AgentProgressing"),
    (Observed(True, None, cluster_ip="10.0.0.1"), "False", "AgentNotDeployed"),
])
def test_ready_condition(observed: Observed, ready: str, why: str) -> None:
    status = desired_status(bmc(), observed, "2026-01-01T00:00:00Z")
    cond = status["conditions"][0]
    assert (cond["type"], cond["status"], cond["reason"]) == ("Ready", ready, why)
    assert status["observedGeneration"] == 3


def test_only_the_steps_of_a_rollout_count_as_progress() -> None:
    """Progress reports are spaced out (Reconciler.PROGRESS_INTERVAL); everything else is written at once."""
    def status(observed: Observed) -> dict[str, Any]:
        return desired_status(bmc(), observed, "2026-01-01T00:00:00Z")

    starting = status(Observed(True, None, cluster_ip="10.0.0.1",
                               deployment=ready_deployment(observedGeneration=1)))
    not_ready = status(Observed(True, None, cluster_ip="10.0.0.1", deployment=ready_deployment(readyReplicas=0)))
    ready = status(Observed(True, None, cluster_ip="10.0.0.1", deployment=ready_deployment()))
    secret_gone = status(Observed(True, ("SecretNotFound", "x"), cluster_ip="10.0.0.1",
                                  deployment=ready_deployment(readyReplicas=0)))
    step = status_patch(starting, not_ready)
    assert step is not None and progress_only(starting, step)
    assert not progress_only(not_ready, status_patch(not_ready, ready) or {})  # Ready: at once
    assert not progress_only(None, status_patch(None, starting) or {})  # the first status: at once
    assert not progress_only(not_ready, status_patch(not_ready, secret_gone) or {})  # another condition
    assert not progress_only(starting, {**step, "observedGeneration": 4})  # more than the conditions


def test_a_cluster_ip_alone_is_not_ready() -> None:
    assert agent_readiness(None)[0] is False


def test_unchanged_status_needs_no_write_and_keeps_transition_times() -> None:
    obs = Observed(True, None, cluster_ip="10.0.0.1", deployment=ready_deployment())
    first = desired_status(bmc(), obs, "2026-01-01T00:00:00Z")
    again = desired_status({**bmc(), "status": {**first, "bootOverride": {"target": "Pxe"}}}, obs,
                           "2026-01-02T00:00:00Z")
    assert status_patch({**first, "bootOverride": {"target": "Pxe"}}, again) is None


@pytest.mark.parametrize(("service", "address"), [
    ({"spec": {"type": "LoadBalancer"}, "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.50"}]}}},
     "192.0.2.50"),
    ({"spec": {"type": "LoadBalancer"}, "status": {"loadBalancer": {"ingress": [{"hostname": "bmc.example"}]}}},
     "bmc.example"),
    ({"spec": {"type": "LoadBalancer"}, "status": {"loadBalancer": {}}}, ""),  # not assigned yet
    ({"spec": {"type": "ClusterIP"}, "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.50"}]}}}, ""),
    (None, ""),
])
def test_the_load_balancer_address_is_the_first_ingress(service: Any, address: str) -> None:
    assert load_balancer_address(service) == address


@pytest.mark.parametrize(("observed", "host"), [
    (Observed(True, None, cluster_ip="10.0.0.1"), "10.0.0.1"),
    (Observed(True, None, cluster_ip="10.0.0.1", external="192.0.2.50"), "192.0.2.50"),
    (Observed(True, None, cluster_ip="fd00::1"), "[fd00::1]"),
])
def test_the_endpoints_name_the_load_balancer_else_the_cluster_ip(observed: Observed, host: str) -> None:
    status = desired_status(bmc(), observed, "2026-01-01T00:00:00Z")
    assert status["clusterIP"] == observed.cluster_ip
    assert status["endpoints"] == {"ipmi": f"{host}:623", "metal3IPMI": f"ipmi://{host}:623",
                                   "redfish": f"https://{host}/redfish/v1/Systems/vm",
                                   "metal3Redfish": f"redfish-virtualmedia+https://{host}/redfish/v1/Systems/vm",
                                   "web": f"https://{host}/"}


def test_status_patch_never_touches_boot_override_and_nulls_what_is_gone() -> None:
    current = {"clusterIP": "1.2.3.4", "endpoints": {"ipmi": "x", "redfish": "y"}, "bootOverride": {"x": 1}}
    want = {"observedGeneration": 1, "conditions": [], "clusterIP": "1.2.3.4", "endpoints": {"ipmi": "x"}}
    assert status_patch(current, want) == {"observedGeneration": 1, "conditions": [], "endpoints": {"redfish": None}}


@pytest.mark.parametrize(("want", "have", "diff"), [
    ({"a": 1}, {"a": 1, "b": 2}, None),  # server-defaulted fields are not ours
    ({"a": [{"x": 1}]}, {"a": [{"x": 1, "y": 2}]}, None),
    ({"a": [{"x": 1}]}, {"a": [{"x": 2}]}, "a[0].x"),
    ({"a": [1]}, {"a": [1, 2]}, "a"),
    ({"a": {"b": 1}}, {}, "a"),
])
def test_difference_compares_only_what_we_set(want: Any, have: Any, diff: str | None) -> None:
    assert difference(want, have) == diff


def test_an_annotation_we_no_longer_set_is_a_difference() -> None:
    have = {"metadata": {"annotations": {"a": "1", "b": "2"}, "managedFields": [{
        "manager": "m", "operation": "Apply", "fieldsV1": {"f:metadata": {"f:annotations": {"f:a": {}, "f:b": {}}}}}]}}
    assert stale_owned_keys({"metadata": {"annotations": {"a": "1"}}}, have, "m") == "metadata.annotations.b " \
        "(no longer set)"
    assert stale_owned_keys({"metadata": {"annotations": {"a": "1", "b": "2"}}}, have, "m") is None


def test_work_queue_deduplicates_and_never_hands_a_key_to_two_workers() -> None:
    q = WorkQueue()
    q.add("k")
    q.add("k")
    assert len(q) == 1
    assert q.get(0.1) == "k"
    q.add("k")  # while processing: queued again only when done
    assert q.get(0.05) is None
    q.done("k")
    assert q.get(0.1) == "k"


def test_work_queue_backs_off_per_key_exponentially_up_to_a_cap() -> None:
    q = WorkQueue(base_delay=0.01, max_delay=0.04)
    assert [q.add_rate_limited("k") for _ in range(4)] == [0.01, 0.02, 0.04, 0.04]
    q.forget("k")
    assert q.add_rate_limited("k") == 0.01
    assert q.get(30.0) == "k"  # after its 0.01 s: a deadline that only catches a key never handed out


def test_work_queue_keeps_one_delayed_add_per_key_the_earliest() -> None:
    q = WorkQueue()
    for _ in range(50):
        q.add_after("k", 30.0)  # a resync requeued on every event
    q.add_after("k", 0.02)  # an earlier one wins
    q.add_after("k", 60.0)  # a later one is dropped
    q.add_after("other", 30.0)
    assert len(q._waiting) <= 3  # not one heap entry per call
    assert q.get(1.0) == "k"
    q.done("k")
    assert q.get(0.1) is None  # the superseded entries do not hand the key out again


# ---- the API transport and the caches' fetches


class _ClosingServer:
    """A plain-HTTP API server that answers once per connection and then closes it without saying so (as a
    server or proxy dropping idle keep-alive connections does)."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.connections = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                outer.connections += 1

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                body = b'{"kind":"Status","code":200}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                self.close_connection = True  # no "Connection: close": the client learns of it at its next use

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def test_a_connection_the_server_closed_while_idle_is_replaced_before_the_next_request() -> None:
    from kubernetes import client

    from controller.kubeapi import KubeApi

    server = _ClosingServer()
    try:
        api = KubeApi(client.ApiClient(client.Configuration(host=server.url)))
        for _ in range(3):
            assert api.request("GET", "/api/v1/namespaces/default")["code"] == 200
            time.sleep(0.1)  # the server has closed its side by now
        assert server.connections == 3
    finally:
        server.server.shutdown()


def test_an_unreachable_server_is_an_api_error_with_status_0() -> None:
    import socket

    from kubernetes import client

    from controller.kubeapi import ApiError, KubeApi

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens here once the socket is closed
    api = KubeApi(client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{port}")))
    with pytest.raises(ApiError) as err:
        api.request("GET", "/api/v1/namespaces/default", timeout=2)
    assert err.value.status == 0 and err.value.reason == "Unreachable"


def test_a_tracked_fetch_reports_its_answer_whether_or_not_the_object_exists(api: Any, namespace: str) -> None:
    """A VirtualMachineBMC that names a VM or Secret the cache does not hold yet waits for this answer (not a
    timer): found or not, the fetch must say so, or the BMC would wait forever."""
    import threading

    from kubernetes import client

    from controller.informer import Informer, Kind
    from controller.kubeapi import KubeApi

    client.CoreV1Api(api).create_namespaced_secret(namespace, client.V1Secret(
        metadata=client.V1ObjectMeta(name="present"), string_data={"username": "u"}))
    answered: list[tuple[str, str]] = []
    done = threading.Event()
    secrets = Informer(KubeApi(api), Kind("", "v1", "secrets"), namespace=namespace, keep=lambda _obj: False)
    secrets.resolved.append(lambda ns, name: (answered.append((ns, name)), len(answered) == 2 and done.set()))
    secrets.start()
    try:
        assert secrets.wait_synced(10)
        assert secrets.get(namespace, "present") is None  # `keep` refused it at the list
        secrets.track(namespace, "present")
        secrets.track(namespace, "absent")
        assert done.wait(10), answered
        assert sorted(answered) == [(namespace, "absent"), (namespace, "present")]
        assert not secrets.pending(namespace, "absent") and not secrets.pending(namespace, "present")
    finally:
        secrets.stop()


def test_names_tracked_before_the_first_list_are_fetched_only_if_the_list_did_not_have_them(
        api: Any, namespace: str) -> None:
    """At a start, BMCs are listed before their VMs and Secrets: every name they reference is tracked while its cache
    has not listed yet. The list then stores them; only a name it did not have is fetched (found on a real
    kube-apiserver: 2,400 fetches by name at every start over 1,200 BMCs)."""
    import threading

    from kubernetes import client

    from controller.informer import Informer, Kind
    from controller.kubeapi import KubeApi

    core = client.CoreV1Api(api)
    for name in ("listed-1", "listed-2"):
        core.create_namespaced_secret(namespace, client.V1Secret(metadata=client.V1ObjectMeta(name=name),
                                                                 string_data={"username": "u"}))
    kube = KubeApi(api)
    fetched: list[str] = []
    plain = kube.request

    def request(method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        selector = (kwargs.get("query") or {}).get("fieldSelector", "")
        if selector.startswith("metadata.name="):
            fetched.append(selector.removeprefix("metadata.name="))
        return plain(method, path, body, **kwargs)

    kube.request = request  # type: ignore[method-assign]
    referenced = {"listed-1", "listed-2", "absent"}
    answered = threading.Event()
    secrets = Informer(kube, Kind("", "v1", "secrets"), namespace=namespace,
                       keep=lambda obj: obj["metadata"]["name"] in referenced)
    secrets.resolved.append(lambda _ns, name: name == "absent" and answered.set())
    for name in sorted(referenced):
        secrets.track(namespace, name)
    secrets.start()
    try:
        assert secrets.wait_synced(10)
        assert answered.wait(10)
        assert fetched == ["absent"]
        assert secrets.get(namespace, "listed-1") is not None and not secrets.pending(namespace, "listed-2")
    finally:
        secrets.stop()


def test_a_status_only_change_of_a_vm_wakes_no_bmc(api: Any, namespace: str) -> None:
    """What the reconciler reads of a VM is its name, uid, generation and disks (slim_vm): its status changes with
    every start and stop, and a forced re-list finds every VM again; neither is a reason to reconcile."""
    from controller.caches import Caches, slim_vm
    from controller.kubeapi import KubeApi

    woken: list[Any] = []
    caches = Caches(KubeApi(api), namespace, woken.append)
    vm = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
          "metadata": {"name": "vm", "namespace": namespace, "uid": "u", "resourceVersion": "1", "generation": 1},
          "spec": {"template": {"spec": {"domain": {"devices": {"disks": [{"name": "cd", "cdrom": {}}]}}}}},
          "status": {"printableStatus": "Stopped"}}
    caches._by_vm[(namespace, "vm")] = {"bmc"}
    handler = caches.vms.handlers[-1]
    status_only = {**vm, "metadata": {**vm["metadata"], "resourceVersion": "2"},
                   "status": {"printableStatus": "Running"}}
    handler(slim_vm(vm), slim_vm(status_only))
    assert woken == []
    new_disk = {**status_only, "spec": {"template": {"spec": {"domain": {"devices": {"disks": [{"name": "root"}]}}}}}}
    handler(slim_vm(status_only), slim_vm(new_disk))
    assert woken == [(namespace, "bmc")]


def test_a_write_answered_after_the_watch_saw_its_object_deleted_is_not_kept(api: Any, namespace: str) -> None:
    """A child re-created for a VirtualMachineBMC being deleted is removed by the garbage collector at once; the
    watch may report both before the apply's answer arrives. The reconciler must then believe the cache."""
    from controller.caches import Caches
    from controller.kubeapi import KubeApi
    from controller.reconciler import Reconciler

    kube = KubeApi(api)
    caches = Caches(kube, namespace, lambda _key: None)
    services = caches.children["Service"]
    reconciler = Reconciler(kube, caches, Settings(), recorder=None)  # type: ignore[arg-type]
    services.start()
    try:
        assert services.wait_synced(10)
        path = f"/api/v1/namespaces/{namespace}/services"
        body = {"metadata": {"name": "vm-virtbmc", "labels": {desired.MANAGED_BY: desired.MANAGER}},
                "spec": {"ports": [{"port": 623, "protocol": "UDP"}]}}
        created = kube.request("POST", path, body)
        kube.request("DELETE", f"{path}/vm-virtbmc")
        after = int(created["metadata"]["resourceVersion"]) + 1  # the deletion's, or a later one
        wait_for(lambda: services.get(namespace, "vm-virtbmc") is None and services.seen_through(after),
                 what="the watch to report the deletion")

        reconciler._remember("Service", created)  # the apply's answer, arriving late
        assert reconciler._cached("Service", namespace, "vm-virtbmc") is None
    finally:
        services.stop()
