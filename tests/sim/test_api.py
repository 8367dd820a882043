"""Contract tests: kubesim's API machinery behaves as kube-apiserver does where our code relies on it.

Every test speaks HTTPS to a running `kubevbmc sim` through the official client (DESIGN.md section 6 lists the
behaviours observed on a real kube-apiserver that these tests pin down).
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, watch

from ..support.cluster import Reply, Sim, call, signal_other_thread, start_sim, wait_for

VM_PATH = "/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachines"


def vm_manifest(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": name},
        "spec": {"runStrategy": "Halted", "template": {"spec": {"domain": {"devices": {}}}}, **spec},
    }


def configmap(api: client.ApiClient, ns: str, name: str, **data: str) -> dict[str, Any]:
    reply = call(api, "POST", f"/api/v1/namespaces/{ns}/configmaps", {"metadata": {"name": name}, "data": data})
    assert reply.status == 201, reply.body
    return reply.body


def cm_path(ns: str, name: str = "") -> str:
    return f"/api/v1/namespaces/{ns}/configmaps" + (f"/{name}" if name else "")


def watch_lines(reply: Reply) -> list[dict[str, Any]]:
    text = reply.body if isinstance(reply.body, str) else json.dumps(reply.body)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# ---- discovery, version, authentication


def test_discovery_lists_core_groups_and_kubevirt(api: client.ApiClient) -> None:
    assert client.CoreApi(api).get_api_versions().versions == ["v1"]
    groups = {g.name: g for g in client.ApisApi(api).get_api_versions().groups}
    for group in ("apps", "rbac.authorization.k8s.io", "coordination.k8s.io", "events.k8s.io",
                  "apiextensions.k8s.io", "kubevirt.io", "cdi.kubevirt.io", "subresources.kubevirt.io"):
        assert group in groups, group
    assert groups["kubevirt.io"].preferred_version.version == "v1"
    resources = call(api, "GET", "/apis/kubevirt.io/v1").body["resources"]
    vm = next(r for r in resources if r["name"] == "virtualmachines")
    assert vm["kind"] == "VirtualMachine" and vm["namespaced"] and "vm" in vm["shortNames"]
    assert any(r["name"] == "virtualmachines/status" for r in resources)
    assert client.VersionApi(api).get_code().major == "1"


def test_wrong_token_is_401_with_a_status_body(api: client.ApiClient) -> None:
    reply = call(api, "GET", "/api/v1/namespaces", token="not-a-token")
    assert reply.status == 401
    assert reply.body["kind"] == "Status" and reply.body["reason"] == "Unauthorized"


def test_unknown_resource_is_404_and_post_to_an_item_is_405(api: client.ApiClient, namespace: str) -> None:
    assert call(api, "GET", "/apis/nope.example.com/v1/things").status == 404
    assert call(api, "GET", f"/api/v1/namespaces/{namespace}/widgets").status == 404
    configmap(api, namespace, "a")
    reply = call(api, "POST", cm_path(namespace, "a"), {"metadata": {"name": "a"}})
    assert reply.status == 405 and reply.body["reason"] == "MethodNotAllowed"


def test_malformed_json_is_400(api: client.ApiClient, namespace: str) -> None:
    reply = call(api, "POST", cm_path(namespace), "{not json")
    assert reply.status == 400 and reply.body["kind"] == "Status"


# ---- metadata


def test_create_sets_uid_creation_time_and_a_global_resource_version(api: client.ApiClient, namespace: str) -> None:
    first = configmap(api, namespace, "one")
    secret = call(api, "POST", f"/api/v1/namespaces/{namespace}/secrets",
                  {"metadata": {"name": "s"}, "stringData": {"k": "v"}}).body
    second = configmap(api, namespace, "two")
    rvs = [int(o["metadata"]["resourceVersion"]) for o in (first, secret, second)]
    assert rvs == sorted(rvs) and len(set(rvs)) == 3
    assert first["metadata"]["uid"] != second["metadata"]["uid"]
    assert first["metadata"]["creationTimestamp"].endswith("Z")
    assert secret["data"] == {"k": "dg=="} and secret["type"] == "Opaque"


def test_second_create_of_a_name_is_409_already_exists(api: client.ApiClient, namespace: str) -> None:
    configmap(api, namespace, "dup")
    reply = call(api, "POST", cm_path(namespace), {"metadata": {"name": "dup"}})
    assert reply.status == 409 and reply.body["reason"] == "AlreadyExists"


def test_generate_name_makes_a_unique_name(api: client.ApiClient, namespace: str) -> None:
    a = call(api, "POST", cm_path(namespace), {"metadata": {"generateName": "gen-"}}).body
    b = call(api, "POST", cm_path(namespace), {"metadata": {"generateName": "gen-"}}).body
    assert a["metadata"]["name"].startswith("gen-") and a["metadata"]["name"] != b["metadata"]["name"]


def test_invalid_name_is_422(api: client.ApiClient, namespace: str) -> None:
    reply = call(api, "POST", cm_path(namespace), {"metadata": {"name": "Not_Valid"}})
    assert reply.status == 422 and reply.body["reason"] == "Invalid"
    assert reply.body["details"]["causes"][0]["field"] == "metadata.name"


def test_create_in_a_missing_namespace_is_404(api: client.ApiClient) -> None:
    reply = call(api, "POST", cm_path("no-such-ns"), {"metadata": {"name": "a"}})
    assert reply.status == 404 and "namespaces" in reply.body["message"]


def test_generation_moves_on_spec_changes_only(api: client.ApiClient, namespace: str) -> None:
    path = VM_PATH.format(ns=namespace)
    vm = call(api, "POST", path, vm_manifest("gen")).body
    assert vm["metadata"]["generation"] == 1
    labelled = call(api, "PATCH", f"{path}/gen", {"metadata": {"labels": {"a": "b"}}},
                    content_type="application/merge-patch+json").body
    assert labelled["metadata"]["generation"] == 1
    changed = call(api, "PATCH", f"{path}/gen", {"spec": {"runStrategy": "Manual"}},
                   content_type="application/merge-patch+json").body
    assert changed["metadata"]["generation"] == 2


# ---- updates


def test_put_with_a_stale_resource_version_is_409_conflict(api: client.ApiClient, namespace: str) -> None:
    obj = configmap(api, namespace, "c", k="1")
    fresh = call(api, "PUT", cm_path(namespace, "c"), {**obj, "data": {"k": "2"}})
    assert fresh.status == 200
    stale = call(api, "PUT", cm_path(namespace, "c"), {**obj, "data": {"k": "3"}})
    assert stale.status == 409 and stale.body["reason"] == "Conflict"
    assert call(api, "GET", cm_path(namespace, "c")).body["data"] == {"k": "2"}


def test_put_without_resource_version_is_accepted(api: client.ApiClient, namespace: str) -> None:
    configmap(api, namespace, "c", k="1")
    reply = call(api, "PUT", cm_path(namespace, "c"), {"metadata": {"name": "c"}, "data": {"k": "9"}})
    assert reply.status == 200 and reply.body["data"] == {"k": "9"}


def test_noop_update_keeps_the_resource_version(api: client.ApiClient, namespace: str) -> None:
    obj = configmap(api, namespace, "same", k="1")
    again = call(api, "PUT", cm_path(namespace, "same"), obj).body
    assert again["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]


# ---- patches


def test_merge_patch_sets_and_removes_keys(api: client.ApiClient, namespace: str) -> None:
    configmap(api, namespace, "m", a="1", b="2")
    reply = call(api, "PATCH", cm_path(namespace, "m"), {"data": {"a": None, "c": "3"}},
                 content_type="application/merge-patch+json")
    assert reply.status == 200 and reply.body["data"] == {"b": "2", "c": "3"}


def test_json_patch_with_a_passing_test_op_applies(api: client.ApiClient, namespace: str) -> None:
    configmap(api, namespace, "j", a="1")
    ops = [{"op": "test", "path": "/data/a", "value": "1"}, {"op": "replace", "path": "/data/a", "value": "2"}]
    reply = call(api, "PATCH", cm_path(namespace, "j"), ops, content_type="application/json-patch+json")
    assert reply.status == 200 and reply.body["data"] == {"a": "2"}


def test_json_patch_with_a_failing_test_op_is_422_and_changes_nothing(api: client.ApiClient,
                                                                       namespace: str) -> None:
    before = configmap(api, namespace, "j", a="1")
    ops = [{"op": "test", "path": "/data/a", "value": "other"}, {"op": "replace", "path": "/data/a", "value": "2"}]
    reply = call(api, "PATCH", cm_path(namespace, "j"), ops, content_type="application/json-patch+json")
    assert reply.status == 422 and reply.body["reason"] == "Invalid"
    after = call(api, "GET", cm_path(namespace, "j")).body
    assert after["data"] == {"a": "1"}
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]


def test_patch_with_an_unknown_content_type_is_415(api: client.ApiClient, namespace: str) -> None:
    configmap(api, namespace, "u")
    reply = call(api, "PATCH", cm_path(namespace, "u"), json.dumps({"data": {"a": "1"}}), content_type="text/plain")
    assert reply.status == 415 and reply.body["reason"] == "UnsupportedMediaType"


def test_strategic_merge_patch_merges_containers_by_name(api: client.ApiClient, namespace: str) -> None:
    deploy = {"metadata": {"name": "d"}, "spec": {
        "replicas": 0, "selector": {"matchLabels": {"app": "d"}},
        "template": {"metadata": {"labels": {"app": "d"}}, "spec": {"containers": [
            {"name": "a", "image": "busybox:1"}, {"name": "b", "image": "busybox:1"}]}}}}
    assert call(api, "POST", f"/apis/apps/v1/namespaces/{namespace}/deployments", deploy).status == 201
    patch = {"spec": {"template": {"spec": {"containers": [{"name": "b", "image": "busybox:2"}]}}}}
    reply = call(api, "PATCH", f"/apis/apps/v1/namespaces/{namespace}/deployments/d", patch,
                 content_type="application/strategic-merge-patch+json")
    images = {c["name"]: c["image"] for c in reply.body["spec"]["template"]["spec"]["containers"]}
    assert images == {"a": "busybox:1", "b": "busybox:2"}


def test_strategic_merge_patch_is_415_for_custom_resources(api: client.ApiClient, namespace: str) -> None:
    call(api, "POST", VM_PATH.format(ns=namespace), vm_manifest("smp"))
    reply = call(api, "PATCH", VM_PATH.format(ns=namespace) + "/smp", {"spec": {"runStrategy": "Manual"}},
                 content_type="application/strategic-merge-patch+json")
    assert reply.status == 415


# ---- server-side apply


def apply(api: client.ApiClient, path: str, body: dict[str, Any], manager: str | None, force: bool = False) -> Reply:
    query = {"fieldManager": manager} if manager else {}
    if force:
        query["force"] = "true"
    return call(api, "PATCH", path, json.dumps(body), content_type="application/apply-patch+yaml", query=query)


def test_first_apply_creates_with_201_and_records_the_manager(api: client.ApiClient, namespace: str) -> None:
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa"}, "data": {"a": "1"}}
    reply = apply(api, cm_path(namespace, "ssa"), body, "alice")
    assert reply.status == 201
    managers = {(m["manager"], m["operation"]) for m in reply.body["metadata"]["managedFields"]}
    assert managers == {("alice", "Apply")}
    assert apply(api, cm_path(namespace, "ssa"), body, "alice").status == 200


def test_apply_of_a_field_another_manager_owns_is_409_unless_forced(api: client.ApiClient, namespace: str) -> None:
    path = cm_path(namespace, "ssa")
    apply(api, path, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa"}, "data": {"a": "1"}},
          "alice")
    bob = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa"}, "data": {"a": "2"}}
    conflict = apply(api, path, bob, "bob")
    assert conflict.status == 409 and conflict.body["reason"] == "Conflict"
    assert 'conflict with "alice"' in conflict.body["message"]
    assert call(api, "GET", path).body["data"] == {"a": "1"}
    forced = apply(api, path, bob, "bob", force=True)
    assert forced.status == 200 and forced.body["data"] == {"a": "2"}
    owners = {m["manager"]: m["fieldsV1"] for m in forced.body["metadata"]["managedFields"]}
    assert "f:a" in owners["bob"]["f:data"] and "alice" not in owners


def test_apply_of_the_same_value_shares_ownership_without_conflict(api: client.ApiClient, namespace: str) -> None:
    path = cm_path(namespace, "ssa")
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa"}, "data": {"a": "1"}}
    apply(api, path, body, "alice")
    assert apply(api, path, body, "bob").status == 200


def test_apply_without_field_manager_is_422(api: client.ApiClient, namespace: str) -> None:
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa"}, "data": {"a": "1"}}
    reply = apply(api, cm_path(namespace, "ssa"), body, None)
    assert reply.status == 422


def test_apply_drops_fields_the_manager_stopped_applying(api: client.ApiClient, namespace: str) -> None:
    path = cm_path(namespace, "ssa")
    apply(api, path, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa", "labels": {"x": "1"}},
                      "data": {"a": "1", "b": "2"}}, "alice")
    reply = apply(api, path, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa"},
                              "data": {"a": "1"}}, "alice")
    assert reply.body["data"] == {"a": "1"}
    assert "x" not in (reply.body["metadata"].get("labels") or {})


def test_update_by_another_manager_takes_ownership_of_changed_fields(api: client.ApiClient, namespace: str) -> None:
    path = cm_path(namespace, "ssa")
    apply(api, path, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa"}, "data": {"a": "1"}},
          "alice")
    call(api, "PATCH", path, {"data": {"a": "2"}}, content_type="application/merge-patch+json",
         query={"fieldManager": "editor"})
    conflict = apply(api, path, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa"},
                                 "data": {"a": "1"}}, "alice")
    assert conflict.status == 409 and 'conflict with "editor"' in conflict.body["message"]


def test_apply_merges_containers_by_name_in_built_in_kinds(api: client.ApiClient, namespace: str) -> None:
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments/ssa"

    def deployment(containers: list[dict[str, str]]) -> dict[str, Any]:
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "ssa"}, "spec": {
            "replicas": 0, "selector": {"matchLabels": {"app": "ssa"}},
            "template": {"metadata": {"labels": {"app": "ssa"}}, "spec": {"containers": containers}}}}

    apply(api, path, deployment([{"name": "a", "image": "busybox:1"}]), "alice")
    reply = apply(api, path, deployment([{"name": "b", "image": "busybox:1"}]), "bob")
    names = [c["name"] for c in reply.body["spec"]["template"]["spec"]["containers"]]
    assert names == ["a", "b"]


# ---- status subresource


def test_status_sent_to_the_main_resource_is_ignored(api: client.ApiClient, namespace: str) -> None:
    path = VM_PATH.format(ns=namespace)
    call(api, "POST", path, vm_manifest("st"))
    reply = call(api, "PATCH", f"{path}/st", {"status": {"printableStatus": "Bogus"}},
                 content_type="application/merge-patch+json")
    assert reply.status == 200 and (reply.body.get("status") or {}).get("printableStatus") != "Bogus"


def test_spec_sent_to_status_is_ignored_and_generation_stays(api: client.ApiClient, namespace: str) -> None:
    path = VM_PATH.format(ns=namespace)
    created = call(api, "POST", path, vm_manifest("st")).body
    reply = call(api, "PATCH", f"{path}/st/status",
                 {"spec": {"runStrategy": "Always"}, "status": {"printableStatus": "Custom"}},
                 content_type="application/merge-patch+json")
    assert reply.status == 200
    assert reply.body["spec"]["runStrategy"] == "Halted"
    assert reply.body["status"]["printableStatus"] == "Custom"
    assert reply.body["metadata"]["generation"] == created["metadata"]["generation"]


def test_status_of_a_kind_without_the_subresource_is_404(api: client.ApiClient, namespace: str) -> None:
    configmap(api, namespace, "nostatus")
    assert call(api, "GET", cm_path(namespace, "nostatus") + "/status").status == 404


# ---- schema validation and defaults (CRDs)


def test_wrong_type_in_a_vm_spec_is_422_with_the_field_path(api: client.ApiClient, namespace: str) -> None:
    vm = vm_manifest("bad")
    vm["spec"]["template"]["spec"]["domain"]["cpu"] = {"cores": "two"}
    reply = call(api, "POST", VM_PATH.format(ns=namespace), vm)
    assert reply.status == 422 and reply.body["reason"] == "Invalid"
    fields = [c["field"] for c in reply.body["details"]["causes"]]
    assert "spec.template.spec.domain.cpu.cores" in fields


def test_unknown_fields_are_pruned_or_rejected_when_strict(api: client.ApiClient, namespace: str) -> None:
    vm = vm_manifest("unknown")
    vm["spec"]["bogus"] = 1
    strict = call(api, "POST", VM_PATH.format(ns=namespace), vm, query={"fieldValidation": "Strict"})
    assert strict.status == 400 and 'unknown field "spec.bogus"' in strict.body["message"]
    lenient = call(api, "POST", VM_PATH.format(ns=namespace), vm)
    assert lenient.status == 201 and "bogus" not in lenient.body["spec"]
    assert "spec.bogus" in lenient.headers.get("warning", "")


CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.example.com"},
    "spec": {
        "group": "example.com", "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wd"]},
        "versions": [{
            "name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
            "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                "spec": {"type": "object", "required": ["size"], "properties": {
                    "size": {"type": "integer", "minimum": 1},
                    "color": {"type": "string", "enum": ["red", "blue"], "default": "red"}}},
                "status": {"type": "object", "properties": {"ok": {"type": "boolean"}}}}}},
        }],
    },
}


@pytest.fixture(scope="module")
def widgets(api: client.ApiClient) -> str:
    reply = call(api, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", CRD)
    assert reply.status in (201, 409)

    def established() -> bool:
        crd = call(api, "GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.example.com").body
        return any(c["type"] == "Established" and c["status"] == "True"
                   for c in (crd.get("status") or {}).get("conditions") or [])

    wait_for(established, what="the CRD to be Established")
    return "/apis/example.com/v1/namespaces/{ns}/widgets"


def test_an_applied_crd_is_served_with_defaults_and_validation(api: client.ApiClient, namespace: str,
                                                               widgets: str) -> None:
    path = widgets.format(ns=namespace)
    ok = call(api, "POST", path, {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"},
                                  "spec": {"size": 2}})
    assert ok.status == 201 and ok.body["spec"]["color"] == "red"
    bad = call(api, "POST", path, {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "x"},
                                   "spec": {"size": 0, "color": "green"}})
    assert bad.status == 422
    fields = sorted(c["field"] for c in bad.body["details"]["causes"])
    assert fields == ["spec.color", "spec.size"]
    missing = call(api, "POST", path, {"apiVersion": "example.com/v1", "kind": "Widget",
                                       "metadata": {"name": "y"}, "spec": {}})
    assert missing.status == 422 and missing.body["details"]["causes"][0]["field"] == "spec.size"
    status = call(api, "PUT", f"{path}/w/status", {**ok.body, "status": {"ok": True}})
    assert status.status == 200 and status.body["status"] == {"ok": True}
    resources = call(api, "GET", "/apis/example.com/v1").body["resources"]
    assert {r["name"] for r in resources} == {"widgets", "widgets/status"}


# ---- list and selectors


def test_label_selectors(api: client.ApiClient, namespace: str) -> None:
    for name, labels in (("a", {"tier": "web", "env": "prod"}), ("b", {"tier": "db", "env": "prod"}),
                         ("c", {"tier": "web"}), ("d", {})):
        call(api, "POST", cm_path(namespace), {"metadata": {"name": name, "labels": labels}})

    def names(selector: str) -> list[str]:
        reply = call(api, "GET", cm_path(namespace), query={"labelSelector": selector})
        return [i["metadata"]["name"] for i in reply.body["items"]]

    assert names("tier=web") == ["a", "c"]
    assert names("tier==web,env=prod") == ["a"]
    assert names("tier!=web") == ["b", "d"]
    assert names("tier in (web,db)") == ["a", "b", "c"]
    assert names("tier notin (web)") == ["b", "d"]
    assert names("env") == ["a", "b"]
    assert names("!env") == ["c", "d"]
    assert call(api, "GET", cm_path(namespace), query={"labelSelector": "tier in web"}).status == 400


def test_field_selectors_on_name_and_namespace(api: client.ApiClient, namespace: str) -> None:
    configmap(api, namespace, "x")
    configmap(api, namespace, "y")
    reply = call(api, "GET", "/api/v1/configmaps", query={"fieldSelector": f"metadata.namespace={namespace},"
                                                                           "metadata.name!=x"})
    assert [i["metadata"]["name"] for i in reply.body["items"]] == ["y"]


def test_field_selector_on_an_unindexed_field_is_400(api: client.ApiClient, namespace: str) -> None:
    reply = call(api, "GET", cm_path(namespace), query={"fieldSelector": "data.k=v"})
    assert reply.status == 400 and "field label not supported" in reply.body["message"]


def test_list_pages_with_limit_and_continue(api: client.ApiClient, namespace: str) -> None:
    for i in range(5):
        configmap(api, namespace, f"p{i}")
    seen: list[str] = []
    token = ""
    for _ in range(10):
        query = {"limit": "2", **({"continue": token} if token else {})}
        page = call(api, "GET", cm_path(namespace), query=query).body
        seen += [i["metadata"]["name"] for i in page["items"]]
        token = page["metadata"].get("continue", "")
        if not token:
            break
    assert seen == ["p0", "p1", "p2", "p3", "p4"]


def test_list_carries_the_collection_resource_version(api: client.ApiClient, namespace: str) -> None:
    obj = configmap(api, namespace, "rv")
    listing = client.CoreV1Api(api).list_namespaced_config_map(namespace)
    assert int(listing.metadata.resource_version) >= int(obj["metadata"]["resourceVersion"])


# ---- watch


def test_watch_resumed_after_a_reconnect_misses_and_repeats_nothing(api: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(api)
    start = core.list_namespaced_config_map(namespace).metadata.resource_version
    configmap(api, namespace, "w1")
    configmap(api, namespace, "w2")
    first: list[tuple[str, str, str]] = []
    w = watch.Watch()
    for event in w.stream(core.list_namespaced_config_map, namespace, resource_version=start, timeout_seconds=5):
        meta = event["object"].metadata
        first.append((event["type"], meta.name, meta.resource_version))
        if len(first) == 2:
            w.stop()
    # While disconnected: a change, a new object and a deletion.
    call(api, "PATCH", cm_path(namespace, "w1"), {"data": {"k": "v"}}, content_type="application/merge-patch+json")
    configmap(api, namespace, "w3")
    call(api, "DELETE", cm_path(namespace, "w2"))
    rest: list[tuple[str, str, str]] = []
    w = watch.Watch()
    for event in w.stream(core.list_namespaced_config_map, namespace, resource_version=first[-1][2],
                          timeout_seconds=5):
        meta = event["object"].metadata
        rest.append((event["type"], meta.name, meta.resource_version))
        if len(rest) == 3:
            w.stop()
    assert [(t, n) for t, n, _ in first] == [("ADDED", "w1"), ("ADDED", "w2")]
    assert [(t, n) for t, n, _ in rest] == [("MODIFIED", "w1"), ("ADDED", "w3"), ("DELETED", "w2")]
    rvs = [int(rv) for _, _, rv in first + rest]
    assert rvs == sorted(rvs) and len(set(rvs)) == len(rvs)


def test_watch_without_resource_version_starts_with_the_current_objects(api: client.ApiClient,
                                                                        namespace: str) -> None:
    configmap(api, namespace, "existing")
    reply = call(api, "GET", cm_path(namespace), query={"watch": "true", "timeoutSeconds": "1"})
    events = watch_lines(reply)
    assert reply.status == 200
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "existing")]


def test_watch_sends_bookmarks_when_asked(api: client.ApiClient, namespace: str) -> None:
    rv = configmap(api, namespace, "b")["metadata"]["resourceVersion"]
    reply = call(api, "GET", cm_path(namespace), query={"watch": "1", "resourceVersion": rv,
                                                         "allowWatchBookmarks": "true", "timeoutSeconds": "2"})
    bookmarks = [e for e in watch_lines(reply) if e["type"] == "BOOKMARK"]
    assert bookmarks and int(bookmarks[-1]["object"]["metadata"]["resourceVersion"]) >= int(rv)


def test_watch_follows_label_selector_transitions(api: client.ApiClient, namespace: str) -> None:
    rv = configmap(api, namespace, "sel")["metadata"]["resourceVersion"]
    call(api, "PATCH", cm_path(namespace, "sel"), {"metadata": {"labels": {"on": "yes"}}},
         content_type="application/merge-patch+json")
    call(api, "PATCH", cm_path(namespace, "sel"), {"metadata": {"labels": {"on": None}}},
         content_type="application/merge-patch+json")
    reply = call(api, "GET", cm_path(namespace), query={"watch": "1", "resourceVersion": rv,
                                                         "labelSelector": "on=yes", "timeoutSeconds": "1"})
    assert [e["type"] for e in watch_lines(reply)] == ["ADDED", "DELETED"]


@pytest.fixture(scope="module")
def short_history_sim(tmp_path_factory: pytest.TempPathFactory) -> Any:
    s = start_sim(Path(tmp_path_factory.mktemp("short-history")), "--history", "20", "--kubelet", "fake")
    yield s
    s.stop()


def test_watch_from_an_expired_resource_version_gets_410_in_an_error_event(short_history_sim: Sim) -> None:
    api = short_history_sim.api()
    start = configmap(api, "default", "first")["metadata"]["resourceVersion"]
    for i in range(30):
        configmap(api, "default", f"later-{i}")
    reply = call(api, "GET", cm_path("default"), query={"watch": "true", "resourceVersion": start,
                                                          "timeoutSeconds": "2"})
    assert reply.status == 200
    events = watch_lines(reply)
    assert len(events) == 1 and events[0]["type"] == "ERROR"
    assert events[0]["object"]["code"] == 410 and events[0]["object"]["reason"] == "Expired"


# ---- deletion


def test_delete_with_a_finalizer_waits_for_it(api: client.ApiClient, namespace: str) -> None:
    call(api, "POST", cm_path(namespace), {"metadata": {"name": "f", "finalizers": ["example.com/hold"]}})
    reply = call(api, "DELETE", cm_path(namespace, "f"))
    assert reply.status == 200
    held = call(api, "GET", cm_path(namespace, "f"))
    assert held.status == 200 and held.body["metadata"]["deletionTimestamp"]
    call(api, "PATCH", cm_path(namespace, "f"), {"metadata": {"finalizers": None}},
         content_type="application/merge-patch+json")
    assert call(api, "GET", cm_path(namespace, "f")).status == 404


def test_delete_of_a_missing_object_is_404(api: client.ApiClient, namespace: str) -> None:
    assert call(api, "DELETE", cm_path(namespace, "ghost")).status == 404


def owned_configmap(api: client.ApiClient, ns: str, name: str, owner: dict[str, Any]) -> None:
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": owner["metadata"]["name"],
           "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
    reply = call(api, "POST", cm_path(ns), {"metadata": {"name": name, "ownerReferences": [ref]}})
    assert reply.status == 201


def test_deleting_an_owner_in_the_background_deletes_its_dependents(api: client.ApiClient, namespace: str) -> None:
    owner = configmap(api, namespace, "owner")
    owned_configmap(api, namespace, "child", owner)
    call(api, "DELETE", cm_path(namespace, "owner"), {"propagationPolicy": "Background"})
    wait_for(lambda: call(api, "GET", cm_path(namespace, "child")).status == 404, what="dependent deleted")


def test_foreground_deletion_keeps_the_owner_until_dependents_are_gone(api: client.ApiClient,
                                                                        namespace: str) -> None:
    owner = configmap(api, namespace, "owner")
    call(api, "POST", cm_path(namespace), {"metadata": {
        "name": "child", "finalizers": ["example.com/hold"],
        "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
                             "uid": owner["metadata"]["uid"], "blockOwnerDeletion": True}]}})
    call(api, "DELETE", cm_path(namespace, "owner"), {"propagationPolicy": "Foreground"})
    waiting = call(api, "GET", cm_path(namespace, "owner")).body
    assert "foregroundDeletion" in waiting["metadata"]["finalizers"]
    wait_for(lambda: call(api, "GET", cm_path(namespace, "child")).body["metadata"].get("deletionTimestamp"),
             what="the dependent to be marked for deletion")
    assert call(api, "GET", cm_path(namespace, "owner")).status == 200
    call(api, "PATCH", cm_path(namespace, "child"), {"metadata": {"finalizers": None}},
         content_type="application/merge-patch+json")
    wait_for(lambda: call(api, "GET", cm_path(namespace, "owner")).status == 404, what="owner gone")


def test_orphan_deletion_keeps_dependents_without_the_owner_reference(api: client.ApiClient,
                                                                       namespace: str) -> None:
    owner = configmap(api, namespace, "owner")
    owned_configmap(api, namespace, "child", owner)
    call(api, "DELETE", cm_path(namespace, "owner"), {"propagationPolicy": "Orphan"})
    wait_for(lambda: call(api, "GET", cm_path(namespace, "owner")).status == 404, what="owner gone")
    child = call(api, "GET", cm_path(namespace, "child")).body
    assert not child["metadata"].get("ownerReferences")


def test_a_dependent_that_keeps_a_live_owner_loses_the_reference_to_a_deleted_one(api: client.ApiClient,
                                                                                    namespace: str) -> None:
    """kube-controller-manager's garbage collector (attemptToDeleteItem: solid and dangling owners) removes the
    dangling reference by uid and keeps the object; whatever else changed in it meanwhile stays."""
    first, second = configmap(api, namespace, "first"), configmap(api, namespace, "second")
    refs = [{"apiVersion": "v1", "kind": "ConfigMap", "name": o["metadata"]["name"], "uid": o["metadata"]["uid"]}
            for o in (first, second)]
    assert call(api, "POST", cm_path(namespace), {"metadata": {"name": "shared", "ownerReferences": refs}}).status \
        == 201
    call(api, "DELETE", cm_path(namespace, "first"))
    shared = wait_for(lambda: (b := call(api, "GET", cm_path(namespace, "shared")).body)["metadata"].get(
        "ownerReferences") == refs[1:] and b, what="the dangling reference removed")
    assert shared["metadata"]["uid"]
    # A reference to an owner that no longer exists, added again (a writer with a stale cache): removed again.
    call(api, "PATCH", cm_path(namespace, "shared"), {"metadata": {"ownerReferences": refs}},
         content_type="application/merge-patch+json")
    wait_for(lambda: call(api, "GET", cm_path(namespace, "shared")).body["metadata"].get("ownerReferences")
             == refs[1:], what="the re-added dangling reference removed")
    # Its last owner gone, the object goes.
    call(api, "DELETE", cm_path(namespace, "second"))
    wait_for(lambda: call(api, "GET", cm_path(namespace, "shared")).status == 404, what="the dependent deleted")


def test_an_object_whose_owners_were_all_deleted_before_it_was_created_is_collected(api: client.ApiClient,
                                                                                      namespace: str) -> None:
    gone = configmap(api, namespace, "gone")
    call(api, "DELETE", cm_path(namespace, "gone"))
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "gone", "uid": gone["metadata"]["uid"]}
    assert call(api, "POST", cm_path(namespace), {"metadata": {"name": "late", "ownerReferences": [ref]}}).status \
        == 201
    wait_for(lambda: call(api, "GET", cm_path(namespace, "late")).status == 404, what="the orphan collected")


def test_deleting_a_namespace_removes_its_contents(api: client.ApiClient) -> None:
    ns = f"gone-{uuid.uuid4().hex[:6]}"
    call(api, "POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
    configmap(api, ns, "inside")
    assert call(api, "DELETE", f"/api/v1/namespaces/{ns}").status == 200
    wait_for(lambda: call(api, "GET", f"/api/v1/namespaces/{ns}").status == 404, what="namespace gone")
    assert call(api, "GET", cm_path(ns, "inside")).status == 404


# ---- what clients cost: /metrics


def request_counts(api: client.ApiClient) -> dict[tuple[str, ...], float]:
    """apiserver_request_total by (verb, resource, subresource, scope, code), from /metrics."""
    reply = call(api, "GET", "/metrics", headers={"Accept": "text/plain"})
    assert reply.status == 200
    counts: dict[tuple[str, ...], float] = {}
    for line in str(reply.body).splitlines():
        if line.startswith("apiserver_request_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            assert set(labels) == {"code", "component", "dry_run", "group", "resource", "scope", "subresource",
                                   "system_client", "verb", "version"}  # kube-apiserver v1.36's, all of them
            key = (labels["verb"], labels["resource"], labels["subresource"], labels["scope"], labels["code"])
            counts[key] = counts.get(key, 0) + float(line.rsplit(" ", 1)[1])
    return counts


def test_metrics_count_requests_by_verb_resource_subresource_scope_and_code(tmp_path: Path) -> None:
    """The verbs and scopes kube-apiserver's apiserver_request_total gives requests (observed on v1.36): a LIST
    of a namespace, a GET of one object (also through a list by name), a WATCH (counted when it ends), a create,
    an APPLY, a PATCH, a 404. A kubesim of its own: this test is its only client."""
    sim = start_sim(tmp_path / "sim")
    try:
        counted(sim.api(), "counted")
    finally:
        sim.stop()


def counted(api: client.ApiClient, namespace: str) -> None:
    assert call(api, "POST", "/api/v1/namespaces", {"metadata": {"name": namespace}}).status == 201
    configmap(api, namespace, "counted")
    before = request_counts(api)
    call(api, "GET", cm_path(namespace))
    call(api, "GET", cm_path(namespace, "counted"))
    call(api, "GET", cm_path(namespace, "absent"))
    call(api, "GET", cm_path(namespace), query={"watch": "true", "timeoutSeconds": "1"})
    # A built-in kind's list or watch by name is its route's: of the namespace.
    call(api, "GET", cm_path(namespace), query={"fieldSelector": "metadata.name=counted", "resourceVersion": "0"})
    call(api, "GET", cm_path(namespace), query={"fieldSelector": "metadata.name=counted", "watch": "true",
                                                "timeoutSeconds": "1"})
    configmap(api, namespace, "created")
    # A custom resource's is the object's (apiextensions-apiserver): a GET, a WATCH of scope resource.
    vms = f"/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachines"
    call(api, "GET", vms, query={"fieldSelector": "metadata.name=vm", "resourceVersion": "0"})
    call(api, "GET", vms, query={"fieldSelector": "metadata.name=vm", "watch": "true", "timeoutSeconds": "1"})
    call(api, "GET", vms)
    call(api, "PATCH", cm_path(namespace, "applied"), {"apiVersion": "v1", "kind": "ConfigMap",
                                                        "metadata": {"name": "applied"}},
         query={"fieldManager": "t"}, content_type="application/apply-patch+yaml")
    call(api, "PATCH", f"/api/v1/namespaces/{namespace}", {"metadata": {"labels": {"counted": "yes"}}},
         content_type="application/merge-patch+json")
    call(api, "GET", "/healthz")
    call(api, "GET", "/version")
    after = request_counts(api)
    grown = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    # /metrics, /version and discovery are not counted; the health checks are, by path.
    assert grown == {("GET", "", "/healthz", "", "200"): 1,
                     ("LIST", "configmaps", "", "namespace", "200"): 2,
                     ("GET", "configmaps", "", "resource", "200"): 1,
                     ("GET", "configmaps", "", "resource", "404"): 1,
                     ("WATCH", "configmaps", "", "namespace", "200"): 2,
                     ("POST", "configmaps", "", "resource", "201"): 1,
                     ("GET", "virtualmachines", "", "resource", "200"): 1,
                     ("WATCH", "virtualmachines", "", "resource", "200"): 1,
                     ("LIST", "virtualmachines", "", "namespace", "200"): 1,
                     ("APPLY", "configmaps", "", "resource", "201"): 1,
                     ("PATCH", "namespaces", "", "resource", "200"): 1}


# ---- HTTP framing


def raw_exchange(sim: Sim, request: bytes) -> bytes:
    """Send raw bytes over TLS; everything the server sends until it closes the connection."""
    import socket
    import ssl
    from urllib.parse import urlsplit

    url = urlsplit(sim.url)
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection((url.hostname, url.port), timeout=10) as plain, \
            context.wrap_socket(plain, server_hostname=url.hostname) as tls:
        tls.sendall(request)
        data = b""
        while chunk := tls.recv(65536):
            data += chunk
    return data


def test_a_header_line_without_a_colon_is_400_and_the_connection_closes(sim: Sim) -> None:
    reply = raw_exchange(sim, b"GET /version HTTP/1.1\r\nHost: kubesim\r\nthis is not a header\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400 ")


def test_too_many_header_lines_are_431(sim: Sim) -> None:
    headers = b"".join(b"X-Filler-%d: x\r\n" % i for i in range(101))
    reply = raw_exchange(sim, b"GET /version HTTP/1.1\r\nHost: kubesim\r\n" + headers + b"\r\n")
    assert reply.startswith(b"HTTP/1.1 431 ")


def test_header_names_are_case_insensitive_and_connection_close_is_honoured(sim: Sim, api: client.ApiClient) -> None:
    token = api.configuration.auth_settings()["BearerToken"]["value"]
    reply = raw_exchange(sim, b"GET /api/v1/namespaces/default HTTP/1.1\r\nhost: kubesim\r\n"
                              b"authorization: " + token.encode() + b"\r\nCONNECTION: close\r\n\r\n")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")  # authorised: the lower-case Authorization header was read
    assert json.loads(body)["metadata"]["name"] == "default"  # and the server closed after one answer


def test_sigterm_delivered_to_any_thread_stops_kubesim(tmp_path: Path) -> None:
    """The kernel hands a process's SIGTERM to any of its threads: kubesim stops whichever thread gets it."""
    import signal

    own = start_sim(tmp_path / "sim")
    try:
        signal_other_thread(own.process.pid, signal.SIGTERM)
        assert own.process.wait(timeout=10) == 0
    finally:
        own.stop()
