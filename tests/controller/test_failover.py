"""Leader election as an operator sees it: a stopped leader hands over at once, a Lease the controller may not
touch is logged with its name and the API's reason, and a controller without its CRD says which one to apply."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
import yaml
from kubernetes import client

from controller.kubeapi import ApiError
from controller.leader import LeaderElector, Record, micro_time, record_of, released, to_lead

from ..support.cluster import BMC_CRD, Sim, call, signal_other_thread, start_sim, wait_for
from ..support.controllers import ControllerProcess, apply_bmc, is_ready, make_secret
from ..support.vms import make_vm

LEASE_DURATION = 15  # the controller's default (settings.Settings.lease_duration)
NOW = "2026-11-23T20:00:00.000000Z"
EARLIER = "2026-11-23T19:59:00.000000Z"


# ---- the decisions (pure)

@pytest.mark.parametrize(("current", "expired", "wanted"), [
    # no Lease yet: create it as its first holder
    (None, False, Record("me", 15, NOW, NOW, 0)),
    # a Lease released by its leader (client-go writes holderIdentity ""): free at once
    (Record("", 1, EARLIER, EARLIER, 3), False, Record("me", 15, NOW, NOW, 4)),
    # another holder that has renewed within the lease duration: wait
    (Record("other", 15, EARLIER, EARLIER, 3), False, None),
    # another holder that stopped renewing for a whole lease duration: take over
    (Record("other", 15, EARLIER, EARLIER, 3), True, Record("me", 15, NOW, NOW, 4)),
    # our own Lease: renew, keeping when it was acquired and the transitions
    (Record("me", 15, EARLIER, EARLIER, 3), False, Record("me", 15, EARLIER, NOW, 3)),
])
def test_a_candidate_takes_a_missing_released_or_expired_lease_and_renews_its_own(
        current: Record | None, expired: bool, wanted: Record | None) -> None:
    assert to_lead(current, "me", NOW, 15, expired) == wanted


def test_a_released_lease_has_no_holder_and_a_one_second_duration_as_client_go_writes_it() -> None:
    assert released(Record("me", 15, EARLIER, EARLIER, 3), NOW) == Record("", 1, NOW, NOW, 3)


def test_a_lease_record_reads_what_client_go_writes() -> None:
    lease = {"spec": {"holderIdentity": "pod-a_1234", "leaseDurationSeconds": 15, "acquireTime": EARLIER,
                      "renewTime": NOW, "leaseTransitions": 2}}
    assert record_of(lease) == Record("pod-a_1234", 15, EARLIER, NOW, 2)
    assert record_of({"spec": {}}) == Record()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", micro_time(datetime.datetime.now()))


class RefusingApi:
    """An API server that answers every Lease request with the same error (what RBAC without the Role does)."""

    def __init__(self, error: ApiError) -> None:
        self.error, self.requests = error, 0

    def request(self, method: str, path: str, body: Any = None, **_: Any) -> dict[str, Any]:
        self.requests += 1
        raise self.error


def test_a_refused_lease_is_warned_about_once_per_reason_and_minute_not_on_every_retry(
        caplog: pytest.LogCaptureFixture) -> None:
    forbidden = ApiError(403, "Forbidden", 'leases.coordination.k8s.io "kubevbmc" is forbidden: User '
                         '"system:serviceaccount:kubevbmc-system:kubevbmc" cannot get resource "leases"')
    unreachable = ApiError(0, "Unreachable", "GET /apis/coordination.k8s.io/...: connection refused")
    api, now = RefusingApi(forbidden), [0.0]
    elector = LeaderElector(api, "kubevbmc-system", "kubevbmc", "me", 15, 10, 2,  # type: ignore[arg-type]
                            clock=lambda: now[0])

    def retry(times: int, error: ApiError) -> None:
        api.error = error
        for _ in range(times):  # one attempt every retry period (2 s)
            assert not elector.try_acquire_or_renew()
            now[0] += 2

    with caplog.at_level(logging.INFO, logger="controller.leader"):
        retry(10, forbidden)  # 0-18 s: one warning
        retry(1, unreachable)  # 20 s: another reason, another warning
        retry(31, forbidden)  # 22-82 s: the reason again, and once more after a minute
    refused = "cannot read the leader Lease kubevbmc-system/kubevbmc: 403 Forbidden: " + forbidden.message
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        refused, "cannot read the leader Lease kubevbmc-system/kubevbmc: 0 Unreachable: " + unreachable.message,
        refused, refused]
    assert api.requests == 42


class OneLeaseApi:
    """One Lease kept as the API server keeps it: a write must carry the current resourceVersion (else 409)."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0

    def request(self, method: str, path: str, body: Any = None, **_: Any) -> dict[str, Any]:
        if method == "GET":
            if self.lease is None:
                raise ApiError(404, "NotFound", 'leases.coordination.k8s.io "l" not found')
            return json.loads(json.dumps(self.lease))
        if method == "PUT" and body["metadata"]["resourceVersion"] != str(self.version):
            raise ApiError(409, "Conflict", "the object has been modified")
        self.version += 1
        self.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}
        return json.loads(json.dumps(self.lease))


def test_a_leader_releases_only_the_lease_it_still_holds() -> None:
    api, never = OneLeaseApi(), threading.Event()
    leader = LeaderElector(api, "ns", "l", "a", 15, 10, 2)  # type: ignore[arg-type]
    standby = LeaderElector(api, "ns", "l", "b", 15, 10, 2)  # type: ignore[arg-type]
    assert leader.acquire(never) and not standby.try_acquire_or_renew()
    assert leader.release()
    assert api.lease is not None
    assert (record_of(api.lease).holder, record_of(api.lease).duration) == ("", 1)
    assert standby.try_acquire_or_renew(), "a released Lease is free at once"
    standby.leading = True  # what acquire() records
    assert (record_of(api.lease).holder, record_of(api.lease).transitions) == ("b", 1)

    # A leader whose Lease was taken since it last wrote it leaves the new holder's Lease alone.
    api.request("PUT", "", {**api.lease, "spec": {**api.lease["spec"], "holderIdentity": "c"}})
    assert not standby.release()  # a conflict: the resourceVersion it saw is gone
    assert record_of(api.lease).holder == "c"


# ---- two controller processes on kubesim

def lease_of(api: client.ApiClient, ns: str, name: str) -> dict[str, Any]:
    reply = call(api, "GET", f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{name}")
    return reply.body if reply.status == 200 else {}


def leader_of(pair: list[ControllerProcess]) -> ControllerProcess | None:
    leading = [c for c in pair if c.proc.poll() is None and c.metric("kubevbmc_controller_leader") == 1]
    return leading[0] if len(leading) == 1 else None


def test_a_standby_takes_over_within_seconds_when_the_leader_is_stopped_with_sigterm(
        sim: Sim, api: client.ApiClient, bmc_crd: None, namespace: str, tmp_path: Path) -> None:
    flags = ("--namespace", namespace, "--lease-namespace", namespace, "--lease-name", "failover")
    pair = [ControllerProcess(sim.kubeconfig, tmp_path / f"controller-{i}.log", *flags) for i in range(2)]
    try:
        first = wait_for(lambda: leader_of(pair), timeout=30, what="one of two controllers to lead")
        standby = pair[1 - pair.index(first)]
        assert standby.metric("kubevbmc_controller_leader") == 0
        assert standby.get("/readyz")[0] == 200  # a standby is ready: it waits for the Lease
        held_by = lease_of(api, namespace, "failover")["spec"]["holderIdentity"]

        seen = watch_lease(api, namespace, "failover")
        began = time.monotonic()
        assert first.stop() == 0
        stopped = time.monotonic() - began
        wait_for(lambda: standby.metric("kubevbmc_controller_leader") == 1, timeout=LEASE_DURATION + 10,
                 interval=0.05, what="the standby to lead")
        takeover = time.monotonic() - began
        print(f"\ntakeover after SIGTERM: {takeover:.2f}s (the leader exited after {stopped:.2f}s; "
              f"lease duration {LEASE_DURATION}s)")
        assert "released the leader Lease" in first.log_path.read_text()
        # Released as client-go releases: no holder and a one-second lease, which client-go candidates (and
        # `kubectl get lease`) read as free.
        wait_for(lambda: any(s.get("holderIdentity", "") == "" and s.get("leaseDurationSeconds") == 1
                             for s in seen), timeout=5, what=f"the released Lease among {seen}")
        spec = lease_of(api, namespace, "failover")["spec"]
        assert spec["holderIdentity"] not in ("", held_by)
        assert spec["leaseTransitions"] >= 1
        # Well under the lease duration: without the release the standby waits for the Lease to expire.
        assert takeover < LEASE_DURATION / 2, f"takeover took {takeover:.1f}s"

        # The new leader does the work.
        make_vm(api, namespace)
        make_secret(api, namespace)
        apply_bmc(api, namespace)
        wait_for(lambda: is_ready(api, namespace), timeout=40, what="the new leader to make the BMC Ready")
    finally:
        for c in pair:
            c.stop()


def watch_lease(api: client.ApiClient, ns: str, name: str) -> list[dict[str, Any]]:
    """The Lease's specs as a watch reports them from now on (for 60 s), collected by a thread."""
    seen: list[dict[str, Any]] = []
    version = call(api, "GET", f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{name}").body[
        "metadata"]["resourceVersion"]

    def collect() -> None:
        resp = api.rest_client.pool_manager.request(
            "GET", f"{api.configuration.host}/apis/coordination.k8s.io/v1/namespaces/{ns}/leases",
            fields={"watch": "true", "resourceVersion": version, "fieldSelector": f"metadata.name={name}",
                    "timeoutSeconds": "60"},
            headers={"Authorization": api.configuration.auth_settings()["BearerToken"]["value"]},
            preload_content=False)
        buffer = b""
        with contextlib.suppress(urllib3.exceptions.HTTPError):  # the simulator ended the session first
            for chunk in resp.stream(4096):
                *lines, buffer = (buffer + chunk).split(b"\n")
                seen.extend(json.loads(line)["object"].get("spec") or {} for line in lines if line.strip())

    threading.Thread(target=collect, daemon=True).start()
    return seen


def test_a_leader_whose_lease_is_taken_stops_renewing_and_exits_1(
        sim: Sim, api: client.ApiClient, bmc_crd: None, namespace: str, tmp_path: Path) -> None:
    controller = ControllerProcess(sim.kubeconfig, tmp_path / "controller.log", "--namespace", namespace,
                                   "--lease-namespace", namespace, "--lease-name", "taken")
    try:
        wait_for(lambda: controller.metric("kubevbmc_controller_leader") == 1, timeout=30, what="it to lead")
        path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/taken"
        lease = call(api, "GET", path).body
        lease["spec"].update(holderIdentity="someone-else", renewTime=micro_time(datetime.datetime.now()))
        assert call(api, "PUT", path, lease).status == 200
        # No renewal succeeds for the renew deadline (10 s), well before the intruder's record expires (15 s).
        code = controller.proc.wait(timeout=40)
        log = controller.log_path.read_text()
        assert code == 1, log
        assert f"ERROR controller: lost the leader Lease {namespace}/taken; exiting" in log
        assert lease_of(api, namespace, "taken")["spec"]["holderIdentity"] == "someone-else"
    finally:
        controller.stop()


@contextlib.contextmanager
def terminating_namespace(api: client.ApiClient, name: str) -> Iterator[str]:
    """A namespace being deleted (a ConfigMap's finalizer holds it): the API server forbids creating in it."""
    assert call(api, "POST", "/api/v1/namespaces", {"metadata": {"name": name}}).status == 201
    held = {"metadata": {"name": "hold", "finalizers": ["example.com/hold"]}}
    assert call(api, "POST", f"/api/v1/namespaces/{name}/configmaps", held).status == 201
    assert call(api, "DELETE", f"/api/v1/namespaces/{name}").status == 200
    try:
        yield name
    finally:
        call(api, "PATCH", f"/api/v1/namespaces/{name}/configmaps/hold", {"metadata": {"finalizers": None}},
             content_type="application/merge-patch+json")


@pytest.mark.parametrize(("lease_namespace", "reason"), [
    # a --lease-namespace that does not exist
    ("no-such-namespace", '404 NotFound: namespaces "no-such-namespace" not found'),
    # the API server refuses the Lease
    ("terminating", "403 Forbidden: unable to create new content in namespace"),
])
def test_a_lease_the_controller_cannot_create_is_a_warning_naming_the_lease_and_the_reason(
        sim: Sim, api: client.ApiClient, bmc_crd: None, namespace: str, tmp_path: Path, lease_namespace: str,
        reason: str) -> None:
    with contextlib.ExitStack() as stack:
        if lease_namespace == "terminating":
            lease_namespace = stack.enter_context(terminating_namespace(api, f"{namespace}-gone"))
        controller = ControllerProcess(sim.kubeconfig, tmp_path / "controller.log", "--namespace", namespace,
                                       "--lease-namespace", lease_namespace, "--lease-name", "wrong-lease")
        stack.callback(controller.stop)
        expected = f"WARNING controller.leader: cannot create the leader Lease {lease_namespace}/wrong-lease: {reason}"
        line = wait_for(lambda: next((ln for ln in controller.log_path.read_text().splitlines() if expected in ln),
                                     None), timeout=20, what="a warning naming the Lease")
        assert controller.proc.poll() is None, "it keeps waiting for the Lease"
        assert controller.metric("kubevbmc_controller_leader") == 0
        assert line


# ---- the CRD

@pytest.fixture(scope="module")
def bare_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    """A simulator without the VirtualMachineBMC CRD."""
    s = start_sim(tmp_path_factory.mktemp("bare-sim"))
    yield s
    s.stop()


def test_a_controller_without_its_crd_says_which_to_apply_and_exits_non_zero(bare_sim: Sim, tmp_path: Path) -> None:
    controller = ControllerProcess(bare_sim.kubeconfig, tmp_path / "controller.log")
    code = controller.proc.wait(timeout=60)
    log = controller.log_path.read_text()
    assert code == 1, log
    assert ("ERROR controller: CustomResourceDefinition virtualmachinebmcs.bmc.kubevirt.io not found: "
            "kubectl apply -f controller/crds/bmc.kubevirt.io_virtualmachinebmcs.yaml") in log
    assert "Traceback" not in log
    assert not lease_of(bare_sim.api(), "default", "kubevbmc-controller"), "it never took the Lease"


def test_a_crd_applied_just_after_the_controller_started_is_waited_for(bare_sim: Sim, tmp_path: Path) -> None:
    api = bare_sim.api()
    controller = ControllerProcess(bare_sim.kubeconfig, tmp_path / "controller.log", "--lease-name", "late-crd")
    try:
        wait_for(lambda: "not found: kubectl apply -f" in controller.log_path.read_text(), timeout=10,
                 what="the controller to name the missing CRD")
        reply = call(api, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                     yaml.safe_load(BMC_CRD.read_text()))
        assert reply.status == 201, reply.body
        wait_for(lambda: controller.metric("kubevbmc_controller_leader") == 1 and controller.get("/readyz")[0] == 200,
                 timeout=30, what="the controller to lead with synced caches")
        assert controller.proc.poll() is None
    finally:
        assert controller.stop() == 0


def test_sigterm_delivered_to_any_thread_stops_the_controller(sim: Sim, bmc_crd: None, namespace: str,
                                                              tmp_path: Path) -> None:
    """The kernel hands a process's SIGTERM to any of its threads; a main thread asleep on a lock never saw one
    that went to a worker, and the controller outlived the kubelet's grace period (one stop in ten, in CI)."""
    import signal

    controller = ControllerProcess(sim.kubeconfig, tmp_path / "controller.log", "--namespace", namespace,
                                   "--lease-namespace", namespace, "--lease-name", "any-thread")
    try:
        wait_for(lambda: controller.metric("kubevbmc_controller_leader") == 1 and controller.get("/readyz")[0] == 200,
                 timeout=30, what="the controller to lead with synced caches")
        signal_other_thread(controller.proc.pid, signal.SIGTERM)
        assert controller.proc.wait(timeout=10) == 0
        assert "stopping" in controller.log_path.read_text()
    finally:
        controller.stop()
