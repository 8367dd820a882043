"""Contract tests: kubesim evaluates CRD validation rules (`x-kubernetes-validations`, CEL) as kube-apiserver does.

What a client sees is pinned down: the 422 Status with one cause per failed rule (field path of the rule's node
plus its fieldPath, the reason it names, `Invalid value: "<type>": <message>`), transition rules (`oldSelf`) that
run only on update and only where an old value correlates, unchanged values that keep passing after a rule was
added (ratcheting), rules on status fields checked through /status, and CRDs whose rules do not compile refused.
"""

from __future__ import annotations

import copy
import json
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from ..support.cluster import Reply, call, wait_for

CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
MERGE = "application/merge-patch+json"


def rules(*items: dict[str, Any]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(items)}


GADGET_SPEC: dict[str, Any] = {
    "type": "object",
    **rules({"rule": "self.minReplicas <= self.maxReplicas", "message": "minReplicas must not exceed maxReplicas",
             "fieldPath": ".minReplicas", "reason": "FieldValueForbidden"}),
    "properties": {
        "minReplicas": {"type": "integer", "default": 1},
        "maxReplicas": {"type": "integer", "default": 3},
        "network": {"type": "object", "properties": {
            "cidr": {"type": "string", **rules({"rule": "self == oldSelf", "message": "cidr is immutable"})}}},
        "revision": {"type": "integer", **rules({"rule": "self >= oldSelf", "message": "revision may not decrease"})},
        "ports": {
            "type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
            "items": {
                "type": "object", "required": ["name", "port"],
                "properties": {"name": {"type": "string"}, "port": {"type": "integer"}},
                **rules({"rule": "self.port >= 1024 || self.name == 'http'",
                         "messageExpression": "'port ' + string(self.port) + ' of ' + self.name + ' is privileged'"},
                        {"rule": "self.port >= oldSelf.port", "message": "a port may only grow"})}},
        "labels": {"type": "object",
                   "additionalProperties": {"type": "string", **rules({"rule": "self.size() <= 8"})}},
        "tags": {"type": "array", "x-kubernetes-list-type": "set", "items": {"type": "string"},
                 **rules({"rule": "self.all(t, t.lowerAscii() == t)", "reason": "FieldValueDuplicate"})},
        "owner": {"type": "string", **rules({
            "rule": "!oldSelf.hasValue() || oldSelf.value() == '' || self == oldSelf.value()",
            "optionalOldSelf": True, "message": "owner is set once"})},
    },
}
GADGET_STATUS = {"type": "object", "properties": {"phase": {"type": "string", **rules({
    "rule": "self in ['Pending', 'Ready']", "reason": "FieldValueRequired",
    "message": "phase must be Pending or Ready"})}}}


def crd(plural: str, kind: str, spec_schema: dict[str, Any],
        status_schema: dict[str, Any] | None = None) -> dict[str, Any]:
    properties = {"spec": spec_schema, **({"status": status_schema} if status_schema else {})}
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.cel.example.com"},
        "spec": {
            "group": "cel.example.com", "scope": "Namespaced",
            "names": {"plural": plural, "singular": kind.lower(), "kind": kind},
            "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                          "schema": {"openAPIV3Schema": {"type": "object", "properties": properties}}}],
        },
    }


def install(api: client.ApiClient, manifest: dict[str, Any]) -> str:
    """Create (or replace) a CRD, wait until it is Established; return its objects' path template."""
    name = manifest["metadata"]["name"]
    reply = call(api, "POST", CRDS, manifest)
    if reply.status == 409:
        current = call(api, "GET", f"{CRDS}/{name}").body
        reply = call(api, "PUT", f"{CRDS}/{name}", {**manifest, "metadata": current["metadata"]})
    assert reply.status in (200, 201), reply.body

    def established() -> bool:
        conditions = (call(api, "GET", f"{CRDS}/{name}").body.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    wait_for(established, what=f"{name} Established")
    spec = manifest["spec"]
    return f"/apis/{spec['group']}/v1/namespaces/{{ns}}/{spec['names']['plural']}"


@pytest.fixture(scope="module")
def gadgets(api: client.ApiClient) -> str:
    return install(api, crd("gadgets", "Gadget", GADGET_SPEC, GADGET_STATUS))


def gadget(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "cel.example.com/v1", "kind": "Gadget", "metadata": {"name": name}, "spec": spec}


def causes(reply: Reply) -> list[tuple[str, str, str]]:
    assert reply.status == 422 and reply.body["reason"] == "Invalid", reply.body
    return sorted((c["field"], c["reason"], c["message"]) for c in reply.body["details"]["causes"])


def patch(api: client.ApiClient, path: str, body: dict[str, Any], subresource: str = "") -> Reply:
    return call(api, "PATCH", f"{path}/{subresource}" if subresource else path, body, content_type=MERGE)


# ---- rules on create


def test_a_valid_object_passes_every_rule(api: client.ApiClient, namespace: str, gadgets: str) -> None:
    reply = call(api, "POST", gadgets.format(ns=namespace), gadget(
        "ok", ports=[{"name": "http", "port": 80}, {"name": "app", "port": 8080}], labels={"team": "infra"},
        tags=["blue"], network={"cidr": "10.0.0.0/8"}, revision=1, owner="alice"))
    assert reply.status == 201, reply.body
    assert (reply.body["spec"]["minReplicas"], reply.body["spec"]["maxReplicas"]) == (1, 3)


def test_failed_rules_at_every_level_are_422_with_one_cause_each(api: client.ApiClient, namespace: str,
                                                                 gadgets: str) -> None:
    reply = call(api, "POST", gadgets.format(ns=namespace), gadget(
        "bad", minReplicas=5, maxReplicas=2, ports=[{"name": "ssh", "port": 22}], labels={"team": "far-too-long"},
        tags=["Blue"]))
    assert causes(reply) == [
        # a rule on the values of a map, without a message
        ("spec.labels[team]", "FieldValueInvalid", 'Invalid value: "string": failed rule: self.size() <= 8'),
        # a spec rule with fieldPath and reason: the cause is at spec.minReplicas, Forbidden
        ("spec.minReplicas", "FieldValueForbidden", "Forbidden: minReplicas must not exceed maxReplicas"),
        # a rule on the items of a list, with a messageExpression
        ("spec.ports[0]", "FieldValueInvalid", 'Invalid value: "object": port 22 of ssh is privileged'),
        # reason FieldValueDuplicate shows the node's type, not the message
        ("spec.tags", "FieldValueDuplicate", 'Duplicate value: "array"'),
    ]
    assert reply.body["message"].startswith('Gadget.cel.example.com "bad" is invalid: [')
    assert "spec.minReplicas: Forbidden: minReplicas must not exceed maxReplicas" in reply.body["message"]


def test_transition_rules_do_not_run_on_create(api: client.ApiClient, namespace: str, gadgets: str) -> None:
    # `self == oldSelf` and `self >= oldSelf` would fail without an old value; the apiserver skips them.
    reply = call(api, "POST", gadgets.format(ns=namespace), gadget(
        "new", network={"cidr": "10.0.0.0/8"}, revision=-5, ports=[{"name": "app", "port": 2000}]))
    assert reply.status == 201, reply.body


def test_structural_errors_stop_the_rules_from_running(api: client.ApiClient, namespace: str, gadgets: str) -> None:
    reply = call(api, "POST", gadgets.format(ns=namespace), gadget("typed", minReplicas="five", maxReplicas=2))
    assert causes(reply) == [
        ("<nil>", "FieldValueInvalid", 'Invalid value: "null": some validation rules were not checked because the '
                                       "object was invalid; correct the existing errors to complete validation"),
        ("spec.minReplicas", "FieldValueTypeInvalid",
         'Invalid value: "string": spec.minReplicas in body must be of type integer: "string"'),
    ]


# ---- rules on update


@pytest.fixture
def stored(api: client.ApiClient, namespace: str, gadgets: str) -> str:
    path = gadgets.format(ns=namespace)
    reply = call(api, "POST", path, gadget("g", network={"cidr": "10.0.0.0/8"}, revision=2,
                                           ports=[{"name": "http", "port": 80}, {"name": "app", "port": 8080}]))
    assert reply.status == 201, reply.body
    return f"{path}/g"


def test_a_transition_rule_refuses_a_change_of_a_nested_field(api: client.ApiClient, stored: str) -> None:
    reply = patch(api, stored, {"spec": {"network": {"cidr": "10.1.0.0/16"}}})
    assert causes(reply) == [("spec.network.cidr", "FieldValueInvalid", 'Invalid value: "string": cidr is immutable')]
    assert call(api, "GET", stored).body["spec"]["network"]["cidr"] == "10.0.0.0/8"


def test_a_transition_rule_compares_with_the_old_value(api: client.ApiClient, stored: str) -> None:
    lower = patch(api, stored, {"spec": {"revision": 1}})
    assert causes(lower) == [("spec.revision", "FieldValueInvalid",
                              'Invalid value: "integer": revision may not decrease')]
    assert patch(api, stored, {"spec": {"revision": 3}}).status == 200


def test_a_field_without_an_old_value_is_not_checked_by_its_transition_rule(api: client.ApiClient,
                                                                           namespace: str, gadgets: str) -> None:
    path = gadgets.format(ns=namespace)
    assert call(api, "POST", path, gadget("late")).status == 201
    assert patch(api, f"{path}/late", {"spec": {"network": {"cidr": "192.168.0.0/16"}}}).status == 200


def test_map_list_items_correlate_by_key(api: client.ApiClient, stored: str) -> None:
    # Reordered, with a new item: the new item has no old value, the others keep theirs.
    grown = patch(api, stored, {"spec": {"ports": [{"name": "app", "port": 9090}, {"name": "http", "port": 80},
                                                   {"name": "extra", "port": 2000}]}})
    assert grown.status == 200, grown.body
    shrunk = patch(api, stored, {"spec": {"ports": [{"name": "http", "port": 80}, {"name": "app", "port": 9000}]}})
    assert causes(shrunk) == [("spec.ports[1]", "FieldValueInvalid", 'Invalid value: "object": a port may only grow')]


def test_an_optional_old_self_rule_also_runs_on_create(api: client.ApiClient, namespace: str, gadgets: str) -> None:
    path = gadgets.format(ns=namespace)
    assert call(api, "POST", path, gadget("owned", owner="alice")).status == 201
    reply = patch(api, f"{path}/owned", {"spec": {"owner": "bob"}})
    assert causes(reply) == [("spec.owner", "FieldValueInvalid", 'Invalid value: "string": owner is set once')]
    assert call(api, "POST", path, gadget("unowned")).status == 201
    assert patch(api, f"{path}/unowned", {"spec": {"owner": "bob"}}).status == 200


def test_every_kind_of_write_is_checked(api: client.ApiClient, stored: str) -> None:
    current = call(api, "GET", stored).body
    changed = copy.deepcopy(current)
    changed["spec"]["network"]["cidr"] = "10.9.0.0/16"
    assert call(api, "PUT", stored, changed).status == 422
    json_patch = call(api, "PATCH", stored, [{"op": "replace", "path": "/spec/network/cidr", "value": "10.9.0.0/16"}],
                      content_type="application/json-patch+json")
    assert json_patch.status == 422
    applied = call(api, "PATCH", stored, json.dumps({
        "apiVersion": "cel.example.com/v1", "kind": "Gadget", "metadata": {"name": "g"},
        "spec": {"network": {"cidr": "10.9.0.0/16"}}}),
        content_type="application/apply-patch+yaml", query={"fieldManager": "tester", "force": "true"})
    assert causes(applied) == [("spec.network.cidr", "FieldValueInvalid", 'Invalid value: "string": cidr is immutable')]


# ---- status


def test_rules_on_status_fields_apply_to_status_updates(api: client.ApiClient, stored: str) -> None:
    bad = patch(api, stored, {"status": {"phase": "Bogus"}}, "status")
    assert causes(bad) == [("status.phase", "FieldValueRequired", "Required value: phase must be Pending or Ready")]
    good = patch(api, stored, {"status": {"phase": "Ready"}}, "status")
    assert good.status == 200 and good.body["status"] == {"phase": "Ready"}
    # status sent to the main resource is reset to the stored one, so its rules pass whatever was sent
    main = patch(api, stored, {"metadata": {"labels": {"x": "y"}}, "status": {"phase": "Bogus"}})
    assert main.status == 200 and main.body["status"] == {"phase": "Ready"}


# ---- ratcheting


def test_unchanged_values_keep_passing_after_a_rule_is_added(api: client.ApiClient, namespace: str) -> None:
    spec = {"type": "object", "properties": {
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "replicas": {"type": "integer"}}}
    manifest = crd("ratchets", "Ratchet", spec)
    path = install(api, manifest).format(ns=namespace)
    created = call(api, "POST", path, {"apiVersion": "cel.example.com/v1", "kind": "Ratchet",
                                       "metadata": {"name": "r"}, "spec": {"labels": {"team": "a"}, "replicas": 1}})
    assert created.status == 201, created.body
    stricter = copy.deepcopy(manifest)
    stricter_spec = stricter["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    stricter_spec["properties"]["labels"].update(rules({"rule": "'owner' in self", "message": "labels need an owner"}))
    install(api, stricter)
    try:
        assert patch(api, f"{path}/r", {"spec": {"replicas": 2}}).status == 200
        still = patch(api, f"{path}/r", {"spec": {"labels": {"team": "b"}}})
        assert causes(still) == [("spec.labels", "FieldValueInvalid", 'Invalid value: "object": labels need an owner')]
        assert patch(api, f"{path}/r", {"spec": {"labels": {"owner": "me"}}}).status == 200
    finally:
        call(api, "DELETE", f"{CRDS}/{manifest['metadata']['name']}")


def test_schema_errors_in_unchanged_values_are_ratcheted(api: client.ApiClient, namespace: str) -> None:
    """CRDValidationRatcheting: once the schema is tightened, a stored value that breaks it may stay as it is
    while other fields (and the status) change; changing it to another invalid value is refused."""
    spec = {"type": "object", "properties": {"size": {"type": "integer"}, "note": {"type": "string"}}}
    status = {"type": "object", "properties": {"phase": {"type": "string"}}}
    manifest = crd("sizes", "Size", spec, status)
    path = install(api, manifest).format(ns=namespace)
    created = call(api, "POST", path, {"apiVersion": "cel.example.com/v1", "kind": "Size",
                                       "metadata": {"name": "s"}, "spec": {"size": 50}})
    assert created.status == 201, created.body
    stricter = copy.deepcopy(manifest)
    stricter["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["size"][
        "maximum"] = 10
    install(api, stricter)
    try:
        assert patch(api, f"{path}/s", {"status": {"phase": "Ready"}}, "status").status == 200
        assert patch(api, f"{path}/s", {"spec": {"note": "kept"}}).status == 200
        refused = patch(api, f"{path}/s", {"spec": {"size": 60}})
        assert refused.status == 422 and [c["field"] for c in refused.body["details"]["causes"]] == ["spec.size"]
        assert call(api, "GET", f"{path}/s").body["spec"] == {"size": 50, "note": "kept"}  # nothing changed
        fresh = call(api, "POST", path, {"apiVersion": "cel.example.com/v1", "kind": "Size",
                                         "metadata": {"name": "t"}, "spec": {"size": 50}})
        assert fresh.status == 422  # a create has nothing to ratchet against
        assert patch(api, f"{path}/s", {"spec": {"size": 5}}).status == 200
    finally:
        call(api, "DELETE", f"{CRDS}/{manifest['metadata']['name']}")


# ---- CRDs whose rules are wrong


@pytest.fixture
def crd_name() -> Iterator[str]:
    yield f"broken{uuid.uuid4().hex[:6]}"


def refused(api: client.ApiClient, plural: str, spec_schema: dict[str, Any]) -> list[tuple[str, str, str]]:
    reply = call(api, "POST", CRDS, crd(plural, "Broken", spec_schema))
    assert call(api, "GET", f"{CRDS}/{plural}.cel.example.com").status == 404
    return causes(reply)


def test_a_crd_whose_rule_does_not_compile_is_refused(api: client.ApiClient, crd_name: str) -> None:
    found = refused(api, crd_name, {"type": "object", "properties": {"size": {"type": "integer"}}, **rules(
        {"rule": "self.size >"}, {"rule": "self.sise > 1"})})
    base = "spec.validation.openAPIV3Schema.properties[spec].x-kubernetes-validations"
    assert [(f, r) for f, r, _ in found] == [(f"{base}[0].rule", "FieldValueInvalid"),
                                            (f"{base}[1].rule", "FieldValueInvalid")]
    syntax, undefined = found[0][2], found[1][2]
    assert syntax.startswith('Invalid value: apiextensions.ValidationRule{Rule:"self.size >", Message:"", '
                             'MessageExpression:"", Reason:(*apiextensions.FieldValueErrorReason)(nil), '
                             'FieldPath:"", OptionalOldSelf:(*bool)(nil)}: compilation failed: ERROR: <input>:1:12: '
                             "Syntax error:")
    assert undefined.endswith("compilation failed: ERROR: <input>:1:5: undefined field 'sise'\n"
                              " | self.sise > 1\n | ....^")


def test_old_self_below_a_list_that_does_not_correlate_is_refused(api: client.ApiClient, crd_name: str) -> None:
    found = refused(api, crd_name, {"type": "object", "properties": {"tags": {
        "type": "array", "x-kubernetes-list-type": "set",
        "items": {"type": "string", **rules({"rule": "self == oldSelf"})}}}})
    assert found == [(
        "spec.validation.openAPIV3Schema.properties[spec].properties[tags].items.x-kubernetes-validations[0].rule",
        "FieldValueInvalid", 'Invalid value: "self == oldSelf": oldSelf cannot be used on the uncorrelatable portion '
        "of the schema within spec.validation.openAPIV3Schema.properties[spec].properties[tags]")]


def test_a_rule_with_an_unknown_reason_or_field_path_is_refused(api: client.ApiClient, crd_name: str) -> None:
    found = refused(api, crd_name, {"type": "object", "properties": {"size": {"type": "integer"}}, **rules(
        {"rule": "true", "reason": "FieldValueWrong", "fieldPath": ".nothing"})})
    base = "spec.validation.openAPIV3Schema.properties[spec].x-kubernetes-validations[0]"
    assert found == [
        (f"{base}.fieldPath", "FieldValueInvalid", 'Invalid value: ".nothing": fieldPath must be a valid path'),
        (f"{base}.reason", "FieldValueNotSupported", 'Unsupported value: "FieldValueWrong": supported values: '
         '"FieldValueDuplicate", "FieldValueForbidden", "FieldValueInvalid", "FieldValueRequired"'),
    ]


def test_without_cel_python_a_crd_with_rules_is_refused_with_a_clear_message(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kubesim import cel, errors

    monkeypatch.setitem(sys.modules, "celpy", None)  # `import celpy` now fails
    cel.engine.cache_clear()
    try:
        assert cel.check_crd(crd("plain", "Plain", {"type": "object"})) == []  # no rules: no cel-python needed
        with pytest.raises(errors.ApiError) as exc:
            cel.check_crd(crd("gadgets", "Gadget", GADGET_SPEC))
    finally:
        cel.engine.cache_clear()
    assert exc.value.code == 500
    assert "need cel-python" in exc.value.message and "pip install 'kubevbmc[sim]'" in exc.value.message


# ---- the project's CRD


BMC_PATH = "/apis/bmc.kubevirt.io/v1beta1/namespaces/{ns}/virtualmachinebmcs"


@pytest.fixture
def custom(api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


def bmc(name: str, vm: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "bmc.kubevirt.io/v1beta1", "kind": "VirtualMachineBMC", "metadata": {"name": name},
            "spec": {"virtualMachineRef": {"name": vm}, **spec}}


def refusal(exc: pytest.ExceptionInfo[client.ApiException]) -> dict[str, Any]:
    assert exc.value.status == 422
    body: dict[str, Any] = json.loads(exc.value.body)
    return body


def test_the_virtual_machine_of_a_bmc_cannot_change(custom: client.CustomObjectsApi, namespace: str,
                                                    bmc_crd: None) -> None:
    args = ("bmc.kubevirt.io", "v1beta1", namespace, "virtualmachinebmcs")
    custom.create_namespaced_custom_object(*args, bmc("web", "vm-a"))
    with pytest.raises(client.ApiException) as exc:
        custom.patch_namespaced_custom_object(*args, "web", {"spec": {"virtualMachineRef": {"name": "vm-b"}}})
    status = refusal(exc)
    assert status["message"] == ('VirtualMachineBMC.bmc.kubevirt.io "web" is invalid: spec.virtualMachineRef: '
                                 'Invalid value: "object": virtualMachineRef is immutable')
    assert status["details"]["causes"] == [{"reason": "FieldValueInvalid", "field": "spec.virtualMachineRef",
                                            "message": 'Invalid value: "object": virtualMachineRef is immutable'}]
    stored = custom.get_namespaced_custom_object(*args, "web")
    assert stored["spec"]["virtualMachineRef"] == {"name": "vm-a"}


def test_a_bmc_needs_ipmi_or_redfish(custom: client.CustomObjectsApi, namespace: str, bmc_crd: None) -> None:
    args = ("bmc.kubevirt.io", "v1beta1", namespace, "virtualmachinebmcs")
    expected = [{"reason": "FieldValueInvalid", "field": "spec",
                 "message": 'Invalid value: "object": at least one of ipmi and redfish must be enabled'}]
    with pytest.raises(client.ApiException) as exc:
        custom.create_namespaced_custom_object(*args, bmc("none", "vm-a", ipmi={"enabled": False},
                                                          redfish={"enabled": False}))
    assert refusal(exc)["details"]["causes"] == expected
    custom.create_namespaced_custom_object(*args, bmc("one", "vm-a", ipmi={"enabled": False}))
    with pytest.raises(client.ApiException) as exc:
        custom.patch_namespaced_custom_object(*args, "one", {"spec": {"redfish": {"enabled": False}}})
    assert refusal(exc)["details"]["causes"] == expected


def test_a_bmc_status_update_passes_the_spec_rules(custom: client.CustomObjectsApi, namespace: str,
                                                   bmc_crd: None) -> None:
    args = ("bmc.kubevirt.io", "v1beta1", namespace, "virtualmachinebmcs")
    created = custom.create_namespaced_custom_object(*args, bmc("st", "vm-a"))
    updated = custom.patch_namespaced_custom_object_status(*args, "st", {"status": {"clusterIP": "10.96.0.10"}})
    assert updated["status"]["clusterIP"] == "10.96.0.10"
    assert updated["spec"] == created["spec"]
    assert updated["metadata"]["generation"] == created["metadata"]["generation"]
