"""kubesim answers as kube-apiserver v1.36 does in the details that hide controller bugs when they differ: the
shape of list items, empty maps, watch bookmarks, pods/log and kubectl's tables."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from kubesim import cli, podlogs, printers
from kubesim.cluster import SimConfig
from kubesim.objects import parse_time

from ..support.cluster import Reply, Sim, call, wait_for
from .test_kubectl import kubectl

BUILTIN_LISTS = [
    ("/api/v1/namespaces/{ns}/configmaps", {"metadata": {"name": "item"}, "data": {"a": "1"}}),
    ("/api/v1/namespaces/{ns}/secrets", {"metadata": {"name": "item"}, "stringData": {"a": "1"}}),
    ("/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": "item"}}),
    ("/api/v1/namespaces/{ns}/services", {"metadata": {"name": "item"},
                                          "spec": {"ports": [{"port": 80}], "selector": {"app": "x"}}}),
    ("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles", {"metadata": {"name": "item"}, "rules": []}),
    ("/apis/coordination.k8s.io/v1/namespaces/{ns}/leases", {"metadata": {"name": "item"}, "spec": {}}),
    ("/apis/apps/v1/namespaces/{ns}/deployments", {"metadata": {"name": "item"}, "spec": {
        "replicas": 0, "selector": {"matchLabels": {"app": "x"}},
        "template": {"metadata": {"labels": {"app": "x"}},
                     "spec": {"containers": [{"name": "c", "image": "example/c"}]}}}}),
]


def _watch_events(api: client.ApiClient, path: str) -> list[dict[str, Any]]:
    """The events a watch from resourceVersion 0 sends at once (an ADDED per object), read until it times out."""
    reply = call(api, "GET", path, query={"watch": "true", "resourceVersion": "0", "timeoutSeconds": "1"})
    text = reply.body if isinstance(reply.body, str) else json.dumps(reply.body)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _list(api: client.ApiClient, path: str, **query: str) -> Reply:
    reply = call(api, "GET", path, query=query or None)
    assert reply.status == 200, reply.body
    return reply


# ---- list items


@pytest.mark.parametrize(("path", "body"), BUILTIN_LISTS, ids=[p.rsplit("/", 1)[1] for p, _ in BUILTIN_LISTS])
def test_builtin_list_items_carry_no_type_meta_but_gets_and_watch_events_do(
        api: client.ApiClient, namespace: str, path: str, body: dict[str, Any]) -> None:
    path = path.format(ns=namespace)
    created = call(api, "POST", path, body)
    assert created.status == 201, created.body
    kind = created.body["kind"]

    listed = _list(api, path).body
    assert listed["kind"] == f"{kind}List" and listed["apiVersion"] == created.body["apiVersion"]
    item = next(i for i in listed["items"] if i["metadata"]["name"] == "item")
    assert "kind" not in item and "apiVersion" not in item
    assert item["metadata"]["uid"] == created.body["metadata"]["uid"]

    got = call(api, "GET", f"{path}/item").body
    assert got["kind"] == kind and got["apiVersion"] == created.body["apiVersion"]
    added = next(e for e in _watch_events(api, path) if e["object"]["metadata"]["name"] == "item")
    assert added["object"]["kind"] == kind and added["object"]["apiVersion"] == created.body["apiVersion"]


def test_builtin_list_pages_and_cluster_scoped_lists_carry_no_item_type_meta(
        api: client.ApiClient, namespace: str) -> None:
    for name in ("a", "b", "c"):
        created = call(api, "POST", f"/api/v1/namespaces/{namespace}/configmaps", {"metadata": {"name": name}})
        assert created.status == 201
    page = _list(api, f"/api/v1/namespaces/{namespace}/configmaps", limit="2").body
    assert page["metadata"]["continue"] and len(page["items"]) == 2
    rest = _list(api, f"/api/v1/namespaces/{namespace}/configmaps", limit="2",
                 **{"continue": page["metadata"]["continue"]}).body
    for item in page["items"] + rest["items"]:
        assert "kind" not in item and "apiVersion" not in item
    for path in ("/api/v1/namespaces", "/api/v1/configmaps",
                 "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"):
        items = _list(api, path).body["items"]
        assert items and all("kind" not in i and "apiVersion" not in i for i in items), path


def test_delete_collection_of_a_builtin_kind_answers_a_list_without_item_type_meta(
        api: client.ApiClient, namespace: str) -> None:
    path = f"/api/v1/namespaces/{namespace}/configmaps"
    assert call(api, "POST", path, {"metadata": {"name": "gone"}}).status == 201
    reply = call(api, "DELETE", path)
    assert reply.status == 200 and reply.body["kind"] == "ConfigMapList"
    assert [i["metadata"]["name"] for i in reply.body["items"]] == ["gone"]
    assert "kind" not in reply.body["items"][0] and "apiVersion" not in reply.body["items"][0]


def test_custom_resource_list_items_keep_kind_and_api_version(api: client.ApiClient, namespace: str) -> None:
    path = f"/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachines"
    vm = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "listed"},
          "spec": {"runStrategy": "Halted", "template": {"spec": {"domain": {"devices": {}}}}}}
    assert call(api, "POST", path, vm).status == 201
    dv_path = f"/apis/cdi.kubevirt.io/v1beta1/namespaces/{namespace}/datavolumes"
    dv = {"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume", "metadata": {"name": "listed"},
          "spec": {"source": {"blank": {}}, "storage": {"resources": {"requests": {"storage": "1Gi"}}}}}
    assert call(api, "POST", dv_path, dv).status == 201, "DataVolume create"

    for list_path, kind, api_version in ((path, "VirtualMachine", "kubevirt.io/v1"),
                                         (dv_path, "DataVolume", "cdi.kubevirt.io/v1beta1")):
        items = _list(api, list_path).body["items"]
        assert [(i["kind"], i["apiVersion"]) for i in items] == [(kind, api_version)]


def test_official_client_reads_builtin_lists_without_item_type_meta(api: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_service_account(namespace, client.V1ServiceAccount(
        metadata=client.V1ObjectMeta(name="reader")))
    accounts = core.list_namespaced_service_account(namespace)
    assert accounts.kind == "ServiceAccountList"
    assert [(a.metadata.name, a.kind) for a in accounts.items if a.metadata.name == "reader"] == [("reader", None)]


def test_kubectl_reads_builtin_lists_without_item_type_meta(sim: Sim, api: client.ApiClient, namespace: str) -> None:
    assert call(api, "POST", f"/api/v1/namespaces/{namespace}/configmaps",
                {"metadata": {"name": "shown"}, "data": {"a": "1"}}).status == 201
    got = kubectl(sim, "get", "configmaps", "-n", namespace, "-o", "json")
    assert got.returncode == 0, got.stderr
    items = [i for i in json.loads(got.stdout)["items"] if i["metadata"]["name"] == "shown"]
    # kubectl fills in each item's kind from the list it decoded, as against a real cluster.
    assert [(i["kind"], i["data"]) for i in items] == [("ConfigMap", {"a": "1"})]
    names = kubectl(sim, "get", "configmaps", "-n", namespace, "-o", "name")
    assert "configmap/shown" in names.stdout.split(), names.stderr


# ---- watch bookmarks


def test_bookmarks_default_to_about_once_a_minute_as_kube_apiserver_sends_them() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.config_from(parser.parse_args([])).bookmark_interval == 60.0
    assert SimConfig().bookmark_interval == 60.0
    quick = cli.config_from(parser.parse_args(["--bookmark-interval", "0.5"]))
    assert quick.bookmark_interval == 0.5


# ---- empty maps


EMPTY_META = {"labels": {}, "annotations": {}, "finalizers": []}


def _without_server_fields(obj: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in obj["metadata"].items() if k not in (
        "uid", "resourceVersion", "creationTimestamp", "managedFields", "generation")}
    return {**obj, "metadata": meta}


def test_empty_maps_of_a_configmap_and_a_secret_are_not_stored(api: client.ApiClient, namespace: str) -> None:
    cm_path = f"/api/v1/namespaces/{namespace}/configmaps"
    created = call(api, "POST", cm_path, {"metadata": {"name": "empty", **EMPTY_META}, "data": {},
                                          "binaryData": {}})
    assert created.status == 201, created.body
    for cm in (created.body, call(api, "GET", f"{cm_path}/empty").body):
        assert _without_server_fields(cm) == {"apiVersion": "v1", "kind": "ConfigMap",
                                              "metadata": {"name": "empty", "namespace": namespace}}
    secret_path = f"/api/v1/namespaces/{namespace}/secrets"
    secret = call(api, "POST", secret_path, {"metadata": {"name": "empty", **EMPTY_META}, "data": {},
                                             "stringData": {}})
    assert secret.status == 201, secret.body
    got = call(api, "GET", f"{secret_path}/empty").body
    assert "data" not in got and "stringData" not in got and got["type"] == "Opaque"
    assert not {"labels", "annotations", "finalizers"} & got["metadata"].keys()


def test_an_update_with_empty_maps_stores_none(api: client.ApiClient, namespace: str) -> None:
    path = f"/api/v1/namespaces/{namespace}/configmaps"
    cm = call(api, "POST", path, {"metadata": {"name": "u", "labels": {"a": "1"}}, "data": {"k": "v"}}).body
    cm["metadata"]["labels"], cm["data"] = {}, {}
    updated = call(api, "PUT", f"{path}/u", cm)
    assert updated.status == 200, updated.body
    assert "labels" not in updated.body["metadata"] and "data" not in updated.body
    patched = call(api, "PATCH", f"{path}/u", [{"op": "add", "path": "/metadata/annotations", "value": {}}],
                   content_type="application/json-patch+json")
    assert patched.status == 200 and "annotations" not in patched.body["metadata"]


def test_empty_maps_in_service_and_pod_template_specs_are_not_stored(api: client.ApiClient, namespace: str) -> None:
    svc = call(api, "POST", f"/api/v1/namespaces/{namespace}/services", {
        "metadata": {"name": "nosel"}, "spec": {"selector": {}, "ports": [{"port": 80}]}})
    assert svc.status == 201, svc.body
    assert "selector" not in svc.body["spec"]
    deploy = call(api, "POST", f"/apis/apps/v1/namespaces/{namespace}/deployments", {
        "metadata": {"name": "d", "annotations": {}}, "spec": {
            "replicas": 0, "selector": {"matchLabels": {"app": "d"}},
            "template": {"metadata": {"labels": {"app": "d"}, "annotations": {}}, "spec": {
                "nodeSelector": {}, "volumes": [{"name": "scratch", "emptyDir": {}}],
                "containers": [{"name": "c", "image": "example/c", "resources": {"limits": {}, "requests": {}}}]}}}})
    assert deploy.status == 201, deploy.body
    template = call(api, "GET", f"/apis/apps/v1/namespaces/{namespace}/deployments/d").body["spec"]["template"]
    assert template["metadata"] == {"labels": {"app": "d"}}
    assert "nodeSelector" not in template["spec"]
    # Structs are kept even when empty: a container's resources, an emptyDir volume source.
    assert template["spec"]["containers"][0]["resources"] == {}
    assert template["spec"]["volumes"] == [{"name": "scratch", "emptyDir": {}}]


def test_custom_resources_lose_empty_metadata_maps_but_keep_their_own(api: client.ApiClient, namespace: str) -> None:
    path = f"/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachines"
    vm = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "e", **EMPTY_META},
          "spec": {"runStrategy": "Halted", "template": {"metadata": {"labels": {}},
                                                         "spec": {"nodeSelector": {}, "domain": {"devices": {}}}}}}
    created = call(api, "POST", path, vm)
    assert created.status == 201, created.body
    assert not {"labels", "annotations", "finalizers"} & created.body["metadata"].keys()
    got = call(api, "GET", f"{path}/e").body
    assert "labels" not in got["metadata"]
    assert got["spec"]["template"]["metadata"] == {"labels": {}}
    assert got["spec"]["template"]["spec"]["nodeSelector"] == {}


def _owned(obj: dict[str, Any], manager: str) -> dict[str, Any]:
    entries = [e for e in obj["metadata"].get("managedFields", []) if e["manager"] == manager]
    assert len(entries) == 1, obj["metadata"].get("managedFields")
    fields: dict[str, Any] = entries[0]["fieldsV1"]
    return fields


def test_applied_empty_labels_are_owned_but_not_stored(api: client.ApiClient, namespace: str) -> None:
    """structured-merge-diff's ToFieldSet records a null or empty map as a leaf of the applied configuration, so
    the applier owns `f:labels`; the object itself comes back without labels."""
    path = f"/api/v1/namespaces/{namespace}/configmaps/ssa"
    query = {"fieldManager": "tool"}
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa", "labels": {}},
              "data": {"a": "1"}}
    for _ in range(2):  # the create, then an apply to the existing object
        reply = call(api, "PATCH", path, config, query=query, content_type="application/apply-patch+yaml")
        assert reply.status in (200, 201), reply.body
        assert "labels" not in reply.body["metadata"]
        assert _owned(reply.body, "tool") == {"f:data": {"f:a": {}}, "f:metadata": {"f:labels": {}}}
    other = call(api, "PATCH", path, {"metadata": {"labels": {"kept": "yes"}}},
                 content_type="application/merge-patch+json", query={"fieldManager": "other"})
    assert other.body["metadata"]["labels"] == {"kept": "yes"}
    config["metadata"] = {"name": "ssa"}
    reply = call(api, "PATCH", path, config, query=query, content_type="application/apply-patch+yaml")
    assert reply.status == 200, reply.body
    assert reply.body["metadata"]["labels"] == {"kept": "yes"}
    assert _owned(reply.body, "tool") == {"f:data": {"f:a": {}}}


def test_an_apply_that_creates_is_defaulted_so_the_same_apply_again_changes_nothing(
        api: client.ApiClient, namespace: str) -> None:
    path = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings/rb"
    config = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "rb"},
              "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "r"},
              "subjects": [{"kind": "ServiceAccount", "name": "sa", "namespace": namespace}]}
    query = {"fieldManager": "tool", "force": "true"}
    created = call(api, "PATCH", path, config, query=query, content_type="application/apply-patch+yaml")
    assert created.status == 201, created.body
    assert created.body["subjects"][0]["apiGroup"] == ""  # defaulted inside the list the apply set
    again = call(api, "PATCH", path, config, query=query, content_type="application/apply-patch+yaml")
    assert again.body["metadata"]["resourceVersion"] == created.body["metadata"]["resourceVersion"]


def test_an_update_with_empty_labels_records_no_ownership_of_them(api: client.ApiClient, namespace: str) -> None:
    created = call(api, "POST", f"/api/v1/namespaces/{namespace}/configmaps",
                   {"metadata": {"name": "upd", "labels": {}}, "data": {"a": "1"}}, query={"fieldManager": "me"})
    assert created.status == 201
    assert "labels" not in created.body["metadata"]
    assert "f:metadata" not in _owned(created.body, "me")


# ---- pods/log

LOCAL_IMAGE = "kubevbmc:dev"  # the kubelet runs this image's containers as local processes
TALKER = """\
import os, sys, time
print("line 1", flush=True)
print("line 2", flush=True)
print("line 3", flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
print("done", flush=True)
"""
RESTARTER = """\
import os, sys, time
if not os.path.exists(sys.argv[1]):
    open(sys.argv[1], "w").close()
    print("first run", flush=True)
    sys.exit(1)
print("second run", flush=True)
time.sleep(120)
"""


def _talker(name: str, gate: Path, script: str = TALKER) -> dict[str, Any]:
    return {"name": name, "image": LOCAL_IMAGE, "command": [sys.executable, "-c", script, str(gate)]}


def _pod(api: client.ApiClient, ns: str, name: str, *containers: dict[str, Any], policy: str = "Never") -> None:
    reply = call(api, "POST", f"/api/v1/namespaces/{ns}/pods", {
        "metadata": {"name": name}, "spec": {"restartPolicy": policy, "containers": list(containers)}})
    assert reply.status == 201, reply.body


def _log(api: client.ApiClient, ns: str, pod: str, **query: str) -> Reply:
    return call(api, "GET", f"/api/v1/namespaces/{ns}/pods/{pod}/log", query=query or None,
                headers={"Accept": "*/*"})


def _text(reply: Reply) -> str:
    assert reply.status == 200, reply.body
    assert reply.headers["content-type"] == "text/plain"
    return reply.body if isinstance(reply.body, str) else "" if reply.body is None else json.dumps(reply.body)


def test_pod_log_serves_a_containers_output_with_kubectls_options(
        api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    _pod(api, namespace, "talker", _talker("main", tmp_path / "gate"))
    text = wait_for(lambda: (t := _text(_log(api, namespace, "talker"))).count("\n") == 3 and t, what="3 lines")
    assert text == "line 1\nline 2\nline 3\n"
    assert _text(_log(api, namespace, "talker", container="main", tailLines="1")) == "line 3\n"
    assert _text(_log(api, namespace, "talker", tailLines="0")) == ""
    assert _text(_log(api, namespace, "talker", limitBytes="8")) == "line 1\nl"
    assert _text(_log(api, namespace, "talker", sinceSeconds="3600")) == text
    later = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 3600))
    assert _text(_log(api, namespace, "talker", sinceTime=later)) == ""
    stamped = _text(_log(api, namespace, "talker", timestamps="true")).splitlines()
    stamps = [datetime.datetime.fromisoformat(line.split(" ", 1)[0].replace("Z", "+00:00")) for line in stamped]
    assert [line.split(" ", 1)[1] for line in stamped] == ["line 1", "line 2", "line 3"]
    assert stamps == sorted(stamps) and all(s.tzinfo is not None for s in stamps)
    assert abs(stamps[0].timestamp() - time.time()) < 600


def test_pod_log_follow_streams_until_the_container_ends(
        api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    _pod(api, namespace, "follow", _talker("main", gate))
    wait_for(lambda: _text(_log(api, namespace, "follow")).count("\n") == 3, what="3 lines")
    method, url, head, _, _ = api.param_serialize(
        method="GET", resource_path=f"/api/v1/namespaces/{namespace}/pods/follow/log",
        query_params=[("follow", "true")], header_params={"Accept": "*/*"}, auth_settings=["BearerToken"])
    resp = api.call_api(method, url, header_params=head, _request_timeout=60)
    assert resp.status == 200
    received = b""
    stream = resp.response.stream(1024, decode_content=False)
    while received.count(b"\n") < 3:
        received += next(stream)
    assert received == b"line 1\nline 2\nline 3\n"
    gate.touch()  # the container prints its last line and exits: the stream ends
    received += b"".join(stream)
    assert received == b"line 1\nline 2\nline 3\ndone\n"


def test_pod_log_previous_is_the_run_before_a_restart(api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    _pod(api, namespace, "again", _talker("main", tmp_path / "marker", RESTARTER), policy="Always")

    def restarted() -> bool:
        statuses = call(api, "GET", f"/api/v1/namespaces/{namespace}/pods/again").body["status"].get(
            "containerStatuses") or []
        return bool(statuses) and statuses[0]["restartCount"] >= 1 and "running" in statuses[0]["state"]

    wait_for(restarted, timeout=30, what="a restart")
    wait_for(lambda: _text(_log(api, namespace, "again")) == "second run\n", what="the second run's output")
    assert _text(_log(api, namespace, "again", previous="true")) == "first run\n"


CRASHER = """\
import os, sys
count = sum(1 for _ in open(sys.argv[1])) + 1 if os.path.exists(sys.argv[1]) else 1
with open(sys.argv[1], "a") as runs:
    runs.write("run\\n")
print(f"run {count}", flush=True)
sys.exit(1)
"""


def test_pod_log_of_a_crash_looping_container_is_the_run_that_crashed(
        api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    _pod(api, namespace, "crash", _talker("main", tmp_path / "runs", CRASHER), policy="Always")

    def crashed_run_shown() -> bool:
        status = call(api, "GET", f"/api/v1/namespaces/{namespace}/pods/crash").body["status"]
        statuses = status.get("containerStatuses") or []
        if not statuses or (statuses[0]["state"].get("waiting") or {}).get("reason") != "CrashLoopBackOff":
            return False
        crashed = statuses[0]["restartCount"] + 1  # the run that just ended: it has not been restarted yet
        return _log(api, namespace, "crash").body == f"run {crashed}\n"

    wait_for(crashed_run_shown, timeout=30, what="the crashed run's output while in CrashLoopBackOff")


def test_pod_log_errors_are_statuses_as_kube_apiserver_gives(
        api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    missing = _log(api, namespace, "nope")
    assert (missing.status, missing.body["reason"], missing.body["message"]) == (
        404, "NotFound", 'pods "nope" not found')
    _pod(api, namespace, "pair", _talker("a", tmp_path / "gate"), _talker("b", tmp_path / "gate"))
    unnamed = _log(api, namespace, "pair")
    assert (unnamed.status, unnamed.body["reason"], unnamed.body["message"]) == (
        400, "BadRequest", "a container name must be specified for pod pair, choose one of: [a b]")
    wrong = _log(api, namespace, "pair", container="c")
    assert (wrong.status, wrong.body["message"]) == (400, "container c is not valid for pod pair")
    wait_for(lambda: _log(api, namespace, "pair", container="b", previous="true").body["message"] == (
        'previous terminated container "b" in pod "pair" not found'), what="no previous container")
    for query, field in (({"tailLines": "-1"}, "tailLines"), ({"limitBytes": "0"}, "limitBytes"),
                         ({"sinceSeconds": "0"}, "sinceSeconds"),
                         ({"sinceSeconds": "5", "sinceTime": "2026-01-01T00:00:00Z"}, "")):
        invalid = _log(api, namespace, "pair", container="a", **query)
        assert (invalid.status, invalid.body["reason"]) == (422, "Invalid"), query
        assert invalid.body["details"]["kind"] == "PodLogOptions"
        assert [c["field"] for c in invalid.body["details"]["causes"]] == [field]
    assert _log(api, namespace, "pair", container="a", tailLines="many").status == 400

    _pod(api, namespace, "elsewhere", {"name": "main", "image": "registry.example/other:1"})
    seen: set[str] = set()

    def waiting() -> bool:
        reply = _log(api, namespace, "elsewhere")
        assert reply.status == 400, reply.body
        seen.add(reply.body["message"].split(": ")[0])
        return bool(reply.body["message"].startswith('container "main" in pod "elsewhere" is waiting to start: '))

    wait_for(waiting, what="ErrImagePull")
    # Before it, only the answer for a container whose kubelet has not reported it yet (validateContainerLogStatus):
    # the scheduler binds the pod first, its kubelet starts it after.
    assert seen <= {'container "main" in pod "elsewhere" is not available',
                    'container "main" in pod "elsewhere" is waiting to start'}, seen


def test_pods_log_is_a_subresource_in_discovery(api: client.ApiClient) -> None:
    resources = {r["name"]: r for r in call(api, "GET", "/api/v1").body["resources"]}
    assert resources["pods/log"]["verbs"] == ["get"] and resources["pods/log"]["kind"] == "Pod"


def test_kubectl_logs_a_deployment_and_a_pod(sim: Sim, api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    reply = call(api, "POST", f"/apis/apps/v1/namespaces/{namespace}/deployments", {
        "metadata": {"name": "web"}, "spec": {
            "replicas": 1, "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web"}},
                         "spec": {"containers": [_talker("main", tmp_path / "gate")]}}}})
    assert reply.status == 201, reply.body
    logs = wait_for(lambda: (r := kubectl(sim, "logs", "-n", namespace, "deployment/web")).returncode == 0
                    and r.stdout.count("\n") == 3 and r, timeout=30, what="kubectl logs deployment/web")
    assert logs.stdout == "line 1\nline 2\nline 3\n"
    tail = kubectl(sim, "logs", "-n", namespace, "deploy/web", "--tail=1", "-c", "main")
    assert (tail.returncode, tail.stdout) == (0, "line 3\n"), tail.stderr
    missing = kubectl(sim, "logs", "-n", namespace, "deploy/web", "-c", "other")
    assert missing.returncode != 0 and "container other is not valid for pod web-" in missing.stderr


@pytest.mark.parametrize(("at", "text"), [
    (0.0, "1970-01-01T00:00:00Z"),
    (1.5, "1970-01-01T00:00:01.5Z"),
    (1.000123, "1970-01-01T00:00:01.000123Z"),
    (1.9999999, "1970-01-01T00:00:02Z"),
])
def test_log_timestamps_are_rfc3339nano_without_trailing_zeros(at: float, text: str) -> None:
    assert podlogs.timestamp(at) == text


@pytest.mark.parametrize(("opts", "expected"), [
    (podlogs.LogOptions(), [1, 2, 3, 4]),
    (podlogs.LogOptions(tail_lines=2), [3, 4]),
    (podlogs.LogOptions(tail_lines=0), []),
    (podlogs.LogOptions(tail_lines=9), [1, 2, 3, 4]),
    (podlogs.LogOptions(since_seconds=25), [3, 4]),  # now is 120: lines at 95 and later
    (podlogs.LogOptions(since_time=110.0, tail_lines=5), [4]),
    (podlogs.LogOptions(since_seconds=25, tail_lines=1), [4]),  # since first, then the tail of what is left
])
def test_log_lines_are_chosen_by_time_then_tail(opts: podlogs.LogOptions, expected: list[int]) -> None:
    lines = [podlogs.Line(at, i, i + 1) for i, at in enumerate((80.0, 90.0, 100.0, 110.0), start=1)]
    assert [line.start for line in podlogs.select(lines, opts, now=120.0)] == expected


# ---- tables for kubectl get

TABLE = {"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"}
EVENT_WIDE = ["Subobject", "Source", "First Seen", "Count", "Name"]
TABLE_COLUMNS: list[tuple[str, list[str], int | list[str]]] = [
    ("/api/v1/namespaces/{ns}/pods", ["Name", "Ready", "Status", "Restarts", "Age", "IP", "Node", "Nominated Node",
                                      "Readiness Gates"], 4),
    ("/api/v1/namespaces/{ns}/services", ["Name", "Type", "Cluster-IP", "External-IP", "Port(s)", "Age",
                                          "Selector"], 1),
    ("/apis/apps/v1/namespaces/{ns}/deployments", ["Name", "Ready", "Up-to-date", "Available", "Age", "Containers",
                                                   "Images", "Selector"], 3),
    ("/apis/apps/v1/namespaces/{ns}/replicasets", ["Name", "Desired", "Current", "Ready", "Age", "Containers",
                                                   "Images", "Selector"], 3),
    ("/api/v1/namespaces/{ns}/events", ["Last Seen", "Type", "Reason", "Object", "Subobject", "Source", "Message",
                                        "First Seen", "Count", "Name"], EVENT_WIDE),
    ("/apis/events.k8s.io/v1/namespaces/{ns}/events", ["Last Seen", "Type", "Reason", "Object", "Subobject",
                                                       "Source", "Message", "First Seen", "Count", "Name"],
     EVENT_WIDE),
    ("/api/v1/namespaces/{ns}/secrets", ["Name", "Type", "Data", "Age"], 0),
    ("/api/v1/namespaces/{ns}/serviceaccounts", ["Name", "Secrets", "Age"], 0),
    ("/api/v1/namespaces/{ns}/configmaps", ["Name", "Data", "Age"], 0),
    ("/api/v1/namespaces/{ns}/endpoints", ["Name", "Endpoints", "Age"], 0),
    ("/api/v1/namespaces", ["Name", "Status", "Age"], 0),
    ("/api/v1/nodes", ["Name", "Status", "Roles", "Age", "Version", "Internal-IP", "External-IP", "OS-Image",
                       "Kernel-Version", "Container-Runtime"], 5),
    ("/apis/coordination.k8s.io/v1/namespaces/{ns}/leases", ["Name", "Holder", "Age"], 0),
    ("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles", ["Name", "Created At"], 0),
    ("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings", ["Name", "Role", "Age", "Users", "Groups",
                                                                         "ServiceAccounts"], 3),
    ("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", ["Name", "Created At"], 0),
]


@pytest.mark.parametrize(("path", "names", "wide"), TABLE_COLUMNS,
                         ids=[p.split("/")[-1] + ("-v1" if "events.k8s.io" in p else "") for p, _, _ in TABLE_COLUMNS])
def test_builtin_tables_have_kube_apiservers_columns(
        api: client.ApiClient, namespace: str, path: str, names: list[str], wide: int | list[str]) -> None:
    reply = call(api, "GET", path.format(ns=namespace), headers=TABLE)
    assert reply.status == 200 and reply.body["kind"] == "Table", reply.body
    columns = reply.body["columnDefinitions"]
    assert [c["name"] for c in columns] == names
    # The server always sends the wide columns (priority 1); kubectl shows them only with -o wide.
    wide_names = wide if isinstance(wide, list) else names[len(names) - wide:] if wide else []
    assert [c["name"] for c in columns if c["priority"] == 1] == wide_names
    assert all(len(row["cells"]) == len(names) for row in reply.body["rows"])


def test_table_rows_carry_metadata_the_object_or_nothing_as_asked(api: client.ApiClient, namespace: str) -> None:
    path = f"/api/v1/namespaces/{namespace}/configmaps"
    assert call(api, "POST", path, {"metadata": {"name": "t"}, "data": {"a": "1", "b": "2"}}).status == 201
    rows = call(api, "GET", path, headers=TABLE).body["rows"]
    assert rows[0]["cells"][:2] == ["t", 2]
    assert rows[0]["object"]["kind"] == "PartialObjectMetadata" and rows[0]["object"]["metadata"]["name"] == "t"
    full = call(api, "GET", path, headers=TABLE, query={"includeObject": "Object"}).body["rows"][0]["object"]
    assert full["data"] == {"a": "1", "b": "2"}
    bare = call(api, "GET", path, headers=TABLE, query={"includeObject": "None"}).body["rows"][0]
    assert "object" not in bare
    assert call(api, "GET", path, headers=TABLE, query={"includeObject": "All"}).status == 400


def _columns(output: str) -> list[list[str]]:
    """kubectl's table output split into cells (two or more spaces apart)."""
    import re
    return [re.split(r"\s{2,}", line.strip()) for line in output.splitlines() if line.strip()]


def test_kubectl_get_prints_pods_services_deployments_and_events(
        sim: Sim, api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    reply = call(api, "POST", f"/apis/apps/v1/namespaces/{namespace}/deployments", {
        "metadata": {"name": "web"}, "spec": {
            "replicas": 1, "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web"}},
                         "spec": {"containers": [_talker("main", tmp_path / "gate")]}}}})
    assert reply.status == 201, reply.body
    svc = call(api, "POST", f"/api/v1/namespaces/{namespace}/services", {
        "metadata": {"name": "web"}, "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}}).body
    event = call(api, "POST", f"/api/v1/namespaces/{namespace}/events", {
        "metadata": {"name": "web.1"}, "involvedObject": {"kind": "Deployment", "name": "web",
                                                          "namespace": namespace},
        "reason": "Tested", "message": "a message", "type": "Normal", "source": {"component": "test"},
        "firstTimestamp": "2026-01-01T00:00:00Z", "lastTimestamp": "2026-01-01T00:00:00Z", "count": 2})
    assert event.status == 201, event.body
    wait_for(lambda: call(api, "GET", f"/apis/apps/v1/namespaces/{namespace}/deployments/web").body.get(
        "status", {}).get("availableReplicas") == 1, timeout=30, what="the deployment available")

    got = kubectl(sim, "get", "pods,svc,deploy,events", "-n", namespace)
    assert got.returncode == 0, got.stderr
    rows = _columns(got.stdout)
    headers = [r for r in rows if r[0] in ("NAME", "LAST SEEN")]
    assert headers == [["NAME", "READY", "STATUS", "RESTARTS", "AGE"],
                       ["NAME", "TYPE", "CLUSTER-IP", "EXTERNAL-IP", "PORT(S)", "AGE"],
                       ["NAME", "READY", "UP-TO-DATE", "AVAILABLE", "AGE"],
                       ["LAST SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]]
    pod = next(r for r in rows if r[0].startswith("pod/web-"))
    assert pod[1:4] == ["1/1", "Running", "0"]
    assert next(r for r in rows if r[0] == "service/web")[1:5] == [
        "ClusterIP", svc["spec"]["clusterIP"], "<none>", "80/TCP"]
    assert next(r for r in rows if r[0] == "deployment.apps/web")[1:4] == ["1/1", "1", "1"]
    assert next(r for r in rows if "Tested" in r)[1:] == ["Normal", "Tested", "deployment/web", "a message"]

    wide = kubectl(sim, "get", "pods", "-n", namespace, "-o", "wide")
    header, row = _columns(wide.stdout)[:2]
    assert header == ["NAME", "READY", "STATUS", "RESTARTS", "AGE", "IP", "NODE", "NOMINATED NODE",
                      "READINESS GATES"]
    assert row[6:] == ["kubesim-node", "<none>", "<none>"]
    nodes = _columns(kubectl(sim, "get", "nodes").stdout)
    assert nodes[1][:3] == ["kubesim-node", "Ready", "<none>"] and nodes[1][4].startswith("v1.36")


@pytest.mark.parametrize(("seconds", "text"), [
    (-5, "<invalid>"), (-1, "0s"), (0, "0s"), (119, "119s"), (120, "2m"), (150, "2m30s"), (600, "10m"),
    (3 * 3600 - 1, "179m"), (3 * 3600, "3h"), (3 * 3600 + 60, "3h1m"), (8 * 3600, "8h"), (47 * 3600, "47h"),
    (50 * 3600, "2d2h"), (8 * 86400, "8d"), (800 * 86400, "2y70d"), (3000 * 86400, "8y"),
])
def test_ages_print_as_apimachinerys_human_duration(seconds: int, text: str) -> None:
    assert printers.human_duration(seconds) == text


def _pod_status(*states: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p", "creationTimestamp": "2026-01-01T00:00:00Z", **extra.pop("meta", {})},
            "spec": {"containers": [{"name": f"c{i}"} for i in range(len(states))], "nodeName": "n"},
            "status": {"phase": extra.pop("phase", "Running"), "podIP": "10.0.0.1",
                       "containerStatuses": list(states), **extra}}


NOW = parse_time("2026-01-01T01:00:00Z")
RUNNING = {"name": "c", "ready": True, "restartCount": 0, "state": {"running": {}}}


@pytest.mark.parametrize(("pod", "cells"), [
    (_pod_status(RUNNING), ["1/1", "Running", "0", "60m"]),
    (_pod_status(RUNNING, {**RUNNING, "ready": False}), ["1/2", "Running", "0", "60m"]),
    (_pod_status({"name": "c", "restartCount": 3, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                  "lastState": {"terminated": {"finishedAt": "2026-01-01T00:58:00Z"}}}),
     ["0/1", "CrashLoopBackOff", "3 (2m ago)", "60m"]),
    (_pod_status({"name": "c", "state": {"terminated": {"reason": "Completed", "exitCode": 0}}},
                 phase="Succeeded"), ["0/1", "Completed", "0", "60m"]),
    (_pod_status({"name": "c", "state": {"terminated": {"exitCode": 137, "signal": 9}}}, phase="Failed"),
     ["0/1", "Signal:9", "0", "60m"]),
    (_pod_status(RUNNING, meta={"deletionTimestamp": "2026-01-01T00:59:00Z"}), ["1/1", "Terminating", "0", "60m"]),
    (_pod_status({"name": "c", "state": {"waiting": {"reason": "ErrImagePull"}}}, phase="Pending"),
     ["0/1", "ErrImagePull", "0", "60m"]),
])
def test_pod_rows_say_what_kubectl_get_pods_says(pod: dict[str, Any], cells: list[str]) -> None:
    assert printers.pod_row(pod, NOW)[1:5] == cells


@pytest.mark.parametrize(("spec", "status", "external", "ports"), [
    ({"type": "ClusterIP", "ports": [{"port": 80, "protocol": "TCP"}]}, {}, "<none>", "80/TCP"),
    ({"type": "NodePort", "ports": [{"port": 623, "nodePort": 30623, "protocol": "UDP"}]}, {}, "<none>",
     "623:30623/UDP"),
    ({"type": "LoadBalancer", "ports": []}, {}, "<pending>", "<none>"),
    ({"type": "LoadBalancer", "ports": []}, {"loadBalancer": {"ingress": [{"ip": "127.3.0.1"}]}}, "127.3.0.1",
     "<none>"),
    ({"type": "ClusterIP", "externalIPs": ["1.2.3.4"]}, {}, "1.2.3.4", "<none>"),
])
def test_service_rows_show_external_ips_and_ports_as_kubectl(
        spec: dict[str, Any], status: dict[str, Any], external: str, ports: str) -> None:
    svc = {"metadata": {"name": "s", "creationTimestamp": "2026-01-01T00:00:00Z"}, "spec": spec, "status": status}
    assert printers.service_row(svc, NOW)[3:5] == [external, ports]
