"""Day 2 on a cluster that behaves as kube-apiserver does: a restarted controller, a re-list after 410 Gone and
every resync write nothing and post no Event over a converged cluster; names that fit; refusals that reach status."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from controller import desired
from controller.events import EventRecorder
from controller.informer import typed_items
from controller.kubeapi import ApiError
from controller.reconciler import difference
from controller.spec import BMCSpec
from controller.status import Observed, conditions_of

from ..support.cluster import Sim, bmc_sim, call, wait_for
from ..support.controllers import (
    ControllerProcess,
    apply_bmc,
    condition,
    get_bmc,
    is_ready,
    make_secret,
    settle,
)
from ..support.vms import make_vm

# ---- pure parts


def test_list_items_of_built_in_kinds_get_the_lists_type() -> None:
    page = {"apiVersion": "v1", "kind": "ServiceList", "items": [{"metadata": {"name": "a"}},
                                                                  {"apiVersion": "v1", "kind": "Service"}]}
    assert [(i["apiVersion"], i["kind"]) for i in typed_items(page)] == [("v1", "Service"), ("v1", "Service")]
    apps = {"apiVersion": "apps/v1", "kind": "DeploymentList", "items": [{"metadata": {"name": "a"}}]}
    assert typed_items(apps)[0]["apiVersion"] == "apps/v1" and typed_items(apps)[0]["kind"] == "Deployment"


@pytest.mark.parametrize(("want", "have", "found"), [
    ({"metadata": {"labels": {}}}, {"metadata": {}}, None),  # not stored: Go's omitempty
    ({"data": {}}, {}, None),
    ({"spec": {"ports": []}}, {"spec": {}}, None),
    ({"metadata": {"labels": {"a": "b"}}}, {"metadata": {}}, "metadata.labels"),
    ({"apiVersion": "v1", "kind": "Role"}, {"kind": "Role"}, "apiVersion"),
])
def test_an_empty_map_or_list_is_satisfied_by_an_absent_one(want: Any, have: Any, found: str | None) -> None:
    assert difference(want, have) == found


@pytest.mark.parametrize("vm", ["vm", "a" * 55, "a" * 56, "b" * 63, "c" * 253, "1vm", "9" * 253, "my.vm.example",
                                "x.y" * 80])
def test_child_names_are_dns_labels_that_fit_63_characters_for_any_vm_name(vm: str) -> None:
    name = desired.child_name(vm)
    assert len(name) <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name), name
    assert name == desired.child_name(vm)  # deterministic
    assert len(desired.tls_secret_name(vm)) <= 253
    for value in desired.selector(vm).values():
        assert len(value) <= 63 and re.fullmatch(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?", value), value


def test_short_names_keep_kubevirtbmcs_form_and_long_ones_that_share_a_prefix_stay_apart() -> None:
    assert desired.child_name("vm-1") == "vm-1-virtbmc"
    assert desired.child_name("a" * 55) == "a" * 55 + "-virtbmc"
    one, two = desired.child_name("a" * 60 + "1"), desired.child_name("a" * 60 + "2")
    assert one != two and one.endswith("-virtbmc") and two.endswith("-virtbmc")
    assert desired.label_value("a" * 64) != desired.label_value("a" * 65)
    assert desired.label_value("vm.with.dots") == "vm.with.dots"


def test_a_refused_child_is_the_ready_condition_with_the_apis_message() -> None:
    spec = BMCSpec.of({"spec": {"virtualMachineRef": {"name": "vm"}, "authSecretRef": {"name": "s"}}})
    message = "the API server refused Service vm-virtbmc: 422 Invalid: metadata.annotations: Invalid value"
    ready, _vm, _secret, agent = conditions_of(spec, Observed(vm_found=False, credentials_problem=None,
                                                              rejected=message), "vm")
    assert (ready.status, ready.reason, ready.message) == (False, "ChildRejected", message)
    assert (agent.status, agent.reason) == (False, "ChildRejected")


class _Api:
    """Records requests; a PATCH of an Event that no longer exists answers 404."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Any]] = []
        self.gone: set[str] = set()

    def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        self.requests.append((method, path, body))
        if method == "PATCH" and path.rsplit("/", 1)[1] in self.gone:
            raise ApiError(404, "NotFound", "events not found")
        return {}


def test_a_repeated_event_is_counted_on_the_first_one_instead_of_posted_again() -> None:
    api = _Api()
    recorder = EventRecorder(api)  # type: ignore[arg-type]
    bmc = {"metadata": {"name": "b", "namespace": "ns", "uid": "u1", "resourceVersion": "1"}}
    recorder.event(bmc, "Warning", "VirtualMachineNotFound", "VirtualMachine vm not found")
    recorder.event({"metadata": {**bmc["metadata"], "resourceVersion": "2"}}, "Warning", "VirtualMachineNotFound",
                   "VirtualMachine vm not found")
    recorder.event(bmc, "Warning", "VirtualMachineNotFound", "VirtualMachine vm not found")
    recorder.event(bmc, "Normal", "Ready", "the BMC answers on 10.0.0.1")
    recorder.stop()
    posts = [body for method, _path, body in api.requests if method == "POST"]
    patches = [(path, body) for method, path, body in api.requests if method == "PATCH"]
    assert [p["reason"] for p in posts] == ["VirtualMachineNotFound", "Ready"]
    first = posts[0]["metadata"]["name"]
    assert [(path.rsplit("/", 1)[1], body["count"]) for path, body in patches] == [(first, 2), (first, 3)]

    # An Event that expired meanwhile (Events live an hour) is posted anew.
    api = _Api()
    recorder = EventRecorder(api)  # type: ignore[arg-type]
    recorder.event(bmc, "Normal", "Ready", "the BMC answers on 10.0.0.1")
    posted = wait_for(lambda: [b for m, _p, b in api.requests if m == "POST"], what="the first Event")
    api.gone.add(posted[0]["metadata"]["name"])
    recorder.event(bmc, "Normal", "Ready", "the BMC answers on 10.0.0.1")
    recorder.stop()
    assert [m for m, _p, _b in api.requests] == ["POST", "PATCH", "POST"]


# ---- against kubesim

BMC_COUNT = 60


@pytest.fixture(scope="module")
def quiet_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    """A cluster of its own: pods Ready without agent processes (the fake kubelet), so many BMCs fit; bookmarks
    as kube-apiserver sends them."""
    with bmc_sim(tmp_path_factory.mktemp("kubesim-day2"), "--kubelet", "fake", "--bookmark-interval", "60") as s:
        yield s


KINDS = [*(f"/api/v1/namespaces/{{ns}}/{kind}" for kind in ("serviceaccounts", "secrets", "configmaps", "services",
                                                               "endpoints", "pods", "events")),
         *(f"/apis/{group}/namespaces/{{ns}}/{kind}" for group, kind in (
             ("apps/v1", "deployments"), ("apps/v1", "replicasets"), ("rbac.authorization.k8s.io/v1", "roles"),
             ("rbac.authorization.k8s.io/v1", "rolebindings"), ("coordination.k8s.io/v1", "leases"),
             ("bmc.kubevirt.io/v1beta1", "virtualmachinebmcs"), ("kubevirt.io/v1", "virtualmachines"),
             ("kubevirt.io/v1", "virtualmachineinstances")))]


def written(api: client.ApiClient, ns: str) -> list[tuple[str, str, str]]:
    """Every object of the namespace with its resourceVersion, which any write to it changes (a deletion removes
    it). Not the cluster's resourceVersion: that counts the kubelets' Lease renewals too, as on any cluster."""
    return sorted((path.rsplit("/", 1)[1], item["metadata"]["name"], item["metadata"]["resourceVersion"])
                  for path in (k.format(ns=ns) for k in KINDS) for item in call(api, "GET", path).body["items"])


def events(api: client.ApiClient, ns: str) -> list[tuple[str, int]]:
    return sorted((e["metadata"]["name"], int(e.get("count") or 1))
                  for e in call(api, "GET", f"/api/v1/namespaces/{ns}/events").body["items"])


def quiet(api: client.ApiClient, ns: str, seconds: float = 2.0) -> list[tuple[str, str, str]]:
    """Wait until nothing has written to the namespace for `seconds`; what it holds then."""
    last = [written(api, ns)]

    def still() -> bool:
        settle(seconds)
        now = written(api, ns)
        same, last[0] = now == last[0], now
        return same

    wait_for(still, timeout=60, interval=0, what="the namespace to be quiet")
    return last[0]


def test_a_restart_and_a_relist_over_a_converged_cluster_write_nothing_and_post_no_event(
        quiet_sim: Sim, tmp_path: Path) -> None:
    api = quiet_sim.api()
    ns = "day2"
    assert call(api, "POST", "/api/v1/namespaces", {"metadata": {"name": ns}}).status == 201
    for i in range(BMC_COUNT):
        make_vm(api, ns, f"vm-{i}")
        make_secret(api, ns, f"vm-{i}-auth")
        apply_bmc(api, ns, f"vm-{i}", vm=f"vm-{i}", secret=f"vm-{i}-auth")
    flags = ("--leader-elect", "false")  # a Lease's renewals would be writes
    controller = ControllerProcess(quiet_sim.kubeconfig, tmp_path / "controller.log", *flags)
    try:
        wait_for(lambda: sum(is_ready(api, ns, f"vm-{i}") for i in range(BMC_COUNT)) == BMC_COUNT, timeout=120,
                 interval=0.5, what="every BMC Ready")
        held, before = quiet(api, ns), events(api, ns)

        controller.restart()
        wait_for(lambda: controller.metric("kubevbmc_controller_reconciles_total") >= BMC_COUNT
                 and controller.metric("kubevbmc_controller_workqueue_depth") == 0, timeout=60,
                 what="the new controller to reconcile every BMC")
        settle(2.0)
        assert controller.metric("kubevbmc_controller_api_writes_total") == 0
        assert written(api, ns) == held, "something wrote after the restart"
        assert events(api, ns) == before

        # An API server restart after a compaction: every watch ends and resuming it gets 410 Gone.
        os.kill(quiet_sim.process.pid, signal.SIGUSR1)
        wait_for(lambda: controller.log_path.read_text().count("(410 Gone); listing again") >= 7, timeout=30,
                 what="every informer to list again")
        wait_for(lambda: controller.metric("kubevbmc_controller_workqueue_depth") == 0, timeout=30,
                 what="the queue to drain")
        settle(2.0)
        assert controller.metric("kubevbmc_controller_api_writes_total") == 0
        assert written(api, ns) == held, "something wrote after the re-list"
        assert events(api, ns) == before
    finally:
        controller.stop()


def test_a_vm_with_a_63_character_name_gets_a_ready_bmc(api: client.ApiClient, namespace: str,
                                                       controller: ControllerProcess) -> None:
    vm = "v" * 63
    make_vm(api, namespace, vm)
    make_secret(api, namespace)
    apply_bmc(api, namespace, "b" * 253, vm=vm)
    wait_for(lambda: is_ready(api, namespace, "b" * 253), timeout=40, what="the BMC to be Ready")
    status = get_bmc(api, namespace, "b" * 253)["status"]
    name = desired.child_name(vm)
    service = call(api, "GET", f"/api/v1/namespaces/{namespace}/services/{name}").body
    assert status["clusterIP"] == service["spec"]["clusterIP"]
    assert service["spec"]["selector"] == desired.selector(vm)


def test_a_child_the_api_refuses_shows_in_ready_with_the_apis_message_and_an_event(
        api: client.ApiClient, namespace: str, controller: ControllerProcess) -> None:
    make_vm(api, namespace)
    make_secret(api, namespace)
    apply_bmc(api, namespace, service={"annotations": {"not a key!": "x"}})

    def refused() -> dict[str, Any]:
        ready = condition(get_bmc(api, namespace), "Ready")
        return ready if ready.get("reason") == "ChildRejected" else {}

    ready = wait_for(refused, timeout=20, what="Ready=False ChildRejected")
    assert ready["status"] == "False"
    assert "Service vm-virtbmc" in ready["message"] and "not a key!" in ready["message"]

    def warnings() -> list[dict[str, Any]]:
        return [e for e in call(api, "GET", f"/api/v1/namespaces/{namespace}/events").body["items"]
                if e["reason"] == "ChildRejected" and e["type"] == "Warning"]

    # Events are posted off the reconcile path (controller/events.py, as client-go's broadcaster): after the status
    assert "not a key!" in wait_for(warnings, timeout=10, what="the ChildRejected Warning")[0]["message"]

    # Fixing the spec heals it.
    reply = call(api, "PATCH", f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{namespace}/virtualmachinebmcs/vm",
                 {"spec": {"service": {"annotations": None}}}, content_type="application/merge-patch+json")
    assert reply.status == 200, reply.body
    wait_for(lambda: is_ready(api, namespace), timeout=40, what="Ready once the annotation is gone")
