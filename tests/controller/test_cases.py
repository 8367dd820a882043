"""The controller's edge cases against kubesim, each from a user's point of view."""

from __future__ import annotations

from typing import Any

from kubernetes import client

from ..support.cluster import call, wait_for
from ..support.controllers import (
    BMCS,
    ControllerProcess,
    apply_bmc,
    condition,
    deployment,
    get_bmc,
    is_ready,
    make_secret,
    pods,
    settle,
)
from ..support.vms import make_vm


def reason(api: client.ApiClient, ns: str, name: str = "vm") -> str:
    return str(condition(get_bmc(api, ns, name), "Ready").get("reason", ""))


def agent_pod_uids(api: client.ApiClient, ns: str, vm: str) -> set[str]:
    return {p["metadata"]["uid"] for p in pods(api, ns) if p["metadata"]["name"].startswith(f"{vm}-virtbmc-")
            and not p["metadata"].get("deletionTimestamp")}


def children(api: client.ApiClient, ns: str) -> dict[str, str]:
    """kind/name -> resourceVersion of everything the controller manages in `ns` (and the BMCs)."""
    out = {}
    for path in ("/api/v1/namespaces/{ns}/serviceaccounts", "/api/v1/namespaces/{ns}/services",
                 "/api/v1/namespaces/{ns}/secrets", "/apis/apps/v1/namespaces/{ns}/deployments",
                 "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
                 "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings", BMCS):
        for item in call(api, "GET", path.format(ns=ns), query={
                "labelSelector": "app.kubernetes.io/managed-by=kubevbmc"} if path != BMCS else None).body["items"]:
            out[f"{path.rsplit('/', 1)[1]}/{item['metadata']['name']}"] = item["metadata"]["resourceVersion"]
    return out


def test_vm_missing_means_no_agent_until_the_vm_appears(api: client.ApiClient, namespace: str,
                                                        controller: ControllerProcess) -> None:
    make_secret(api, namespace)
    apply_bmc(api, namespace)
    wait_for(lambda: reason(api, namespace) == "VirtualMachineNotFound", timeout=10, what="VM not found")
    assert condition(get_bmc(api, namespace), "VirtualMachineAvailable")["status"] == "False"
    assert deployment(api, namespace) is None
    make_vm(api, namespace)
    wait_for(lambda: is_ready(api, namespace), timeout=30, what="Ready once the VM exists")


def test_secret_missing_or_incomplete_is_a_condition_with_the_reason(api: client.ApiClient, namespace: str,
                                                                     controller: ControllerProcess) -> None:
    make_vm(api, namespace)
    apply_bmc(api, namespace)
    wait_for(lambda: reason(api, namespace) == "SecretNotFound", timeout=10, what="SecretNotFound")
    make_secret(api, namespace, password=None)
    wait_for(lambda: reason(api, namespace) == "SecretMissingKeys", timeout=10, what="SecretMissingKeys")
    secret = condition(get_bmc(api, namespace), "SecretAvailable")
    assert secret["status"] == "False" and "password" in secret["message"]
    assert deployment(api, namespace) is None


def test_a_changed_secret_rolls_only_its_own_agent(api: client.ApiClient, namespace: str,
                                                   controller: ControllerProcess) -> None:
    for vm in ("a", "b"):
        make_vm(api, namespace, vm)
        make_secret(api, namespace, f"{vm}-auth")
        apply_bmc(api, namespace, vm, vm, f"{vm}-auth")
    for vm in ("a", "b"):
        wait_for(lambda vm=vm: is_ready(api, namespace, vm), timeout=30, what=f"{vm} Ready")
    before_a, before_b = agent_pod_uids(api, namespace, "a"), agent_pod_uids(api, namespace, "b")
    reply = call(api, "PATCH", f"/api/v1/namespaces/{namespace}/secrets/a-auth",
                 {"stringData": {"password": "n3w-pass"}}, content_type="application/merge-patch+json")
    assert reply.status == 200, reply.body
    wait_for(lambda: agent_pod_uids(api, namespace, "a") - before_a, timeout=20, what="a new agent pod for a")
    wait_for(lambda: is_ready(api, namespace, "a"), timeout=30, what="a Ready again")
    assert agent_pod_uids(api, namespace, "b") == before_b


def test_a_second_bmc_for_the_same_vm_gets_conflict_and_the_first_keeps_working(
        api: client.ApiClient, namespace: str, controller: ControllerProcess) -> None:
    make_vm(api, namespace)
    make_secret(api, namespace)
    apply_bmc(api, namespace, "first")
    wait_for(lambda: is_ready(api, namespace, "first"), timeout=30, what="first Ready")
    owned = children(api, namespace)
    apply_bmc(api, namespace, "second")
    wait_for(lambda: reason(api, namespace, "second") == "Conflict", timeout=10, what="second Conflict")
    assert "first" in condition(get_bmc(api, namespace, "second"), "Ready")["message"]
    settle(1.0)
    assert is_ready(api, namespace, "first")
    after = children(api, namespace)
    assert {k: v for k, v in after.items() if not k.startswith("virtualmachinebmcs/")} == {
        k: v for k, v in owned.items() if not k.startswith("virtualmachinebmcs/")}
    # When the first goes, the second takes over (after the first's children are garbage-collected).
    assert call(api, "DELETE", f"{BMCS.format(ns=namespace)}/first").status == 200
    wait_for(lambda: is_ready(api, namespace, "second"), timeout=40, what="second Ready after first deleted")


def test_a_child_deleted_or_edited_by_hand_is_restored(api: client.ApiClient, namespace: str,
                                                       controller: ControllerProcess) -> None:
    make_vm(api, namespace)
    make_secret(api, namespace)
    apply_bmc(api, namespace)
    wait_for(lambda: is_ready(api, namespace), timeout=30, what="Ready")
    role = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles/vm-virtbmc"
    assert call(api, "DELETE", role).status == 200
    wait_for(lambda: call(api, "GET", role).status == 200, timeout=10, what="the Role restored")
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments/vm-virtbmc"
    edit = {"spec": {"template": {"spec": {"containers": [{"name": "agent", "image": "kubevbmc:hacked"}]}}}}
    assert call(api, "PATCH", path, edit, content_type="application/strategic-merge-patch+json").status == 200

    def image() -> str:
        return str(call(api, "GET", path).body["spec"]["template"]["spec"]["containers"][0]["image"])

    wait_for(lambda: image() == "kubevbmc:dev", timeout=10, what="the image restored")


def test_deleting_the_bmc_garbage_collects_its_children(api: client.ApiClient, namespace: str,
                                                        controller: ControllerProcess) -> None:
    make_vm(api, namespace)
    make_secret(api, namespace)
    apply_bmc(api, namespace)
    wait_for(lambda: is_ready(api, namespace), timeout=30, what="Ready")
    # ServiceAccount, Role, RoleBinding, Service, TLS Secret, CA Secret, events Secret, Deployment, and the BMC
    assert len(children(api, namespace)) == 9
    assert call(api, "DELETE", f"{BMCS.format(ns=namespace)}/vm").status == 200
    wait_for(lambda: not children(api, namespace), timeout=20, what="the children gone")
    wait_for(lambda: not agent_pod_uids(api, namespace, "vm"), timeout=20, what="the agent pod gone")


def test_a_restarted_controller_writes_nothing_and_restarts_no_agent(
        api: client.ApiClient, namespace: str, controller: ControllerProcess) -> None:
    make_vm(api, namespace)
    make_secret(api, namespace)
    apply_bmc(api, namespace)
    wait_for(lambda: is_ready(api, namespace), timeout=30, what="Ready")
    settle(0.5)
    before, agents = children(api, namespace), agent_pod_uids(api, namespace, "vm")
    controller.restart()
    wait_for(lambda: controller.metric("kubevbmc_controller_reconciles_total") >= controller.metric(
        "kubevbmc_controller_bmcs") > 0, timeout=20, what="the new controller to reconcile every BMC")
    settle(1.0)
    assert children(api, namespace) == before
    assert agent_pod_uids(api, namespace, "vm") == agents
    assert controller.metric("kubevbmc_controller_api_writes_total") == 0


def test_api_errors_are_retried_with_backoff_and_nothing_is_duplicated(
        api: client.ApiClient, namespace: str, controller: ControllerProcess) -> None:
    make_vm(api, namespace)
    make_secret(api, namespace)
    # Someone else's Deployment under the agent's name, with another (immutable) selector: every apply fails 422.
    squatter: dict[str, Any] = {"metadata": {"name": "vm-virtbmc", "labels": {
        "app.kubernetes.io/managed-by": "kubevbmc"}}, "spec": {
        "selector": {"matchLabels": {"app": "other"}}, "template": {"metadata": {"labels": {"app": "other"}}, "spec": {
            "containers": [{"name": "c", "image": "example.com/other:1"}]}}}}
    assert call(api, "POST", f"/apis/apps/v1/namespaces/{namespace}/deployments", squatter).status == 201
    errors_before = controller.metric("kubevbmc_controller_reconcile_errors_total")
    apply_bmc(api, namespace)
    wait_for(lambda: controller.metric("kubevbmc_controller_reconcile_errors_total") > errors_before, timeout=10,
             what="a failing reconcile")
    settle(3.0)
    failures = controller.metric("kubevbmc_controller_reconcile_errors_total") - errors_before
    assert failures <= 12, f"{failures} retries in 3 s: no back-off"  # 50 ms doubling: about 6
    assert not is_ready(api, namespace)
    assert call(api, "DELETE", f"/apis/apps/v1/namespaces/{namespace}/deployments/vm-virtbmc").status == 200
    wait_for(lambda: is_ready(api, namespace), timeout=40, what="Ready once the squatter is gone")
    names = [d["metadata"]["name"] for d in call(api, "GET", f"/apis/apps/v1/namespaces/{namespace}/deployments")
             .body["items"]]
    assert names == ["vm-virtbmc"]
    services = call(api, "GET", f"/api/v1/namespaces/{namespace}/services").body["items"]
    assert [s["metadata"]["name"] for s in services] == ["vm-virtbmc"]


def bmc_events(api: client.ApiClient, ns: str, name: str = "vm") -> list[dict[str, Any]]:
    items = call(api, "GET", f"/api/v1/namespaces/{ns}/events").body["items"]
    return [e for e in items if e["involvedObject"].get("kind") == "VirtualMachineBMC"
            and e["involvedObject"]["name"] == name and e.get("source", {}).get("component") == "kubevbmc-controller"]


def test_events_tell_what_was_created_and_what_is_wrong_without_warning_about_a_normal_rollout(
        api: client.ApiClient, namespace: str, controller: ControllerProcess) -> None:
    make_secret(api, namespace)
    apply_bmc(api, namespace)
    wait_for(lambda: any(e["reason"] == "VirtualMachineNotFound" for e in bmc_events(api, namespace)), timeout=10,
             what="a Warning for the missing VM")
    make_vm(api, namespace)
    wait_for(lambda: any(e["reason"] == "Ready" for e in bmc_events(api, namespace)), timeout=30,
             what="the Ready Event")

    events = bmc_events(api, namespace)
    messages = {(e["type"], e["reason"]): e["message"] for e in events}
    assert messages[("Warning", "VirtualMachineNotFound")] == "VirtualMachine vm not found"
    assert messages[("Normal", "Ready")].startswith("the BMC answers on ")
    # Two passes created children: the first before the VM existed, the second the agent and its certificate.
    created = " ".join(e["message"] for e in events if e["reason"] == "Created")
    for child in ("ServiceAccount vm-virtbmc", "Role vm-virtbmc", "RoleBinding vm-virtbmc", "Service vm-virtbmc",
                  "Secret vm-virtbmc-tls", "Deployment vm-virtbmc"):
        assert child in created
    assert [(e["type"], e["reason"]) for e in events if e["type"] == "Warning"] == [
        ("Warning", "VirtualMachineNotFound")]
