"""A pool never outlives its members (issue 21): whatever order they are deleted in (one by one, all at once,
while the controller is down), nothing of the pool is left, and no owner reference was ever emptied.

kubesim's garbage collector removes dangling owner references by uid while the controller may be applying the
same objects (as kube-controller-manager's does): a controller that rewrote the owner list from a stale cache
could leave a pool's Secret (a member's password and TLS key) and Role with no owner, for ever."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from ..support.cluster import call, install_bmc_crd, start_sim, wait_for
from ..support.controllers import ControllerProcess, settle
from ..support.vms import make_vm

NS = "teardown"
MEMBERS = 4
BMCS = f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{NS}/virtualmachinebmcs"
POOL_KINDS = {"serviceaccounts": "/api/v1", "secrets": "/api/v1", "deployments": "/apis/apps/v1",
              "roles": "/apis/rbac.authorization.k8s.io/v1", "rolebindings": "/apis/rbac.authorization.k8s.io/v1"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, client.ApiClient]]:
    work = tmp_path_factory.mktemp("teardown")
    sim = start_sim(work / "sim", "--bookmark-interval", "0.5")
    api = sim.api()
    install_bmc_crd(api)
    assert call(api, "POST", "/api/v1/namespaces", {"metadata": {"name": NS}}).status == 201
    yield sim, api
    sim.stop()


@pytest.fixture
def controller(cluster: Any, tmp_path: Any) -> Iterator[ControllerProcess]:
    sim, _ = cluster
    process = ControllerProcess(sim.kubeconfig, tmp_path / "controller.log")
    yield process
    process.stop()


def pool_objects(api: client.ApiClient, pool: str) -> list[str]:
    """The pool's objects that exist, with their owners: ["secrets lab-virtbmc-pool owners=[...]", ...]."""
    found = []
    for plural, base in POOL_KINDS.items():
        reply = call(api, "GET", f"{base}/namespaces/{NS}/{plural}/{pool}-virtbmc-pool")
        if reply.status == 200:
            owners = [r["name"] for r in reply.body["metadata"].get("ownerReferences") or []]
            found.append(f"{plural} {pool}-virtbmc-pool owners={owners}")
    return found


def make_pool(api: client.ApiClient, pool: str) -> list[str]:
    names = [f"{pool}-{i}" for i in range(MEMBERS)]
    for name in names:
        make_vm(api, NS, name, cdrom=False)
        reply = call(api, "POST", f"/api/v1/namespaces/{NS}/secrets",
                     {"metadata": {"name": f"{name}-auth"}, "stringData": {"username": "u", "password": "p"}})
        assert reply.status == 201, reply.body
        bmc = {"apiVersion": "bmc.kubevirt.io/v1beta1", "kind": "VirtualMachineBMC", "metadata": {"name": name},
               "spec": {"virtualMachineRef": {"name": name}, "authSecretRef": {"name": f"{name}-auth"},
                        "agentPool": pool}}
        assert call(api, "POST", BMCS, bmc).status == 201
    return names


def members_served(api: client.ApiClient, pool: str, names: list[str]) -> bool:
    """Every object of the pool exists, owned by each of `names`."""
    objects = pool_objects(api, pool)
    return len(objects) == len(POOL_KINDS) and all(f"'{n}'" in o for o in objects for n in names)


def gone_for_good(api: client.ApiClient, pool: str) -> None:
    wait_for(lambda: not pool_objects(api, pool), timeout=30, what=f"nothing of pool {pool} left")
    settle(2)  # and nothing comes back from a stale cache
    assert pool_objects(api, pool) == []


def test_members_deleted_one_by_one(cluster: Any, controller: ControllerProcess) -> None:
    _, api = cluster
    names = make_pool(api, "one")
    wait_for(lambda: members_served(api, "one", names), timeout=60, what="the pool owned by its 4 members")
    for name in names:
        assert call(api, "DELETE", f"{BMCS}/{name}").status == 200
        left = names[names.index(name) + 1:]
        if left:
            wait_for(lambda gone=name: all(f"'{gone}'" not in o for o in pool_objects(api, "one")), timeout=30,
                     what=f"{name} no longer an owner")
    gone_for_good(api, "one")


@pytest.mark.parametrize("order", ["created", "reversed"])
def test_members_deleted_all_at_once(cluster: Any, controller: ControllerProcess, order: str) -> None:
    _, api = cluster
    pool = f"all-{order}"
    names = make_pool(api, pool)
    wait_for(lambda: members_served(api, pool, names), timeout=60, what="the pool owned by its 4 members")
    for name in names if order == "created" else reversed(names):  # as `kubectl delete vmbmc -l ...` does
        assert call(api, "DELETE", f"{BMCS}/{name}").status == 200
    gone_for_good(api, pool)
    # An object deleted while it was being reconciled is the normal case, not an operator's concern.
    noted = [line for line in controller.log_path.read_text().splitlines() if " WARNING " in line or " ERROR " in line]
    assert not noted, noted


def test_members_deleted_while_the_controller_is_down(cluster: Any, controller: ControllerProcess) -> None:
    _, api = cluster
    names = make_pool(api, "down")
    wait_for(lambda: members_served(api, "down", names), timeout=60, what="the pool owned by its 4 members")
    assert controller.stop() == 0
    for name in names[:2]:
        assert call(api, "DELETE", f"{BMCS}/{name}").status == 200
    controller.restart()
    wait_for(lambda: all(f"'{n}'" not in o for o in pool_objects(api, "down") for n in names[:2]), timeout=30,
             what="the two deleted members no longer owners")
    assert controller.stop() == 0
    for name in names[2:]:
        assert call(api, "DELETE", f"{BMCS}/{name}").status == 200
    controller.restart()
    gone_for_good(api, "down")


def test_the_last_members_leave_alive_while_the_others_are_deleted(cluster: Any,
                                                                  controller: ControllerProcess) -> None:
    _, api = cluster
    names = make_pool(api, "move")
    wait_for(lambda: members_served(api, "move", names), timeout=60, what="the pool owned by its 4 members")
    for i, name in enumerate(names):
        if i % 2:
            reply = call(api, "PATCH", f"{BMCS}/{name}", {"spec": {"agentPool": None}},
                         content_type="application/merge-patch+json")
            assert reply.status == 200
        else:
            assert call(api, "DELETE", f"{BMCS}/{name}").status == 200
    gone_for_good(api, "move")
    # The two that left have dedicated agents.
    wait_for(lambda: all(call(api, "GET", f"/apis/apps/v1/namespaces/{NS}/deployments/{n}-virtbmc").status == 200
                         for n in names[1::2]), timeout=30, what="the moved BMCs' own agents")


def test_a_pool_whose_objects_lost_their_owners_still_goes_with_its_last_member(
        cluster: Any, controller: ControllerProcess) -> None:
    """What the race with the garbage collector left on a real cluster: pool objects with no owner reference at
    all. The pool is the controller's to delete, not the collector's alone."""
    _, api = cluster
    names = make_pool(api, "bare")
    wait_for(lambda: members_served(api, "bare", names), timeout=60, what="the pool owned by its 4 members")
    assert controller.stop() == 0
    for plural, base in POOL_KINDS.items():
        reply = call(api, "PATCH", f"{base}/namespaces/{NS}/{plural}/bare-virtbmc-pool",
                     [{"op": "remove", "path": "/metadata/ownerReferences"}],
                     content_type="application/json-patch+json")
        assert reply.status == 200, reply.body
    for name in names:
        assert call(api, "DELETE", f"{BMCS}/{name}").status == 200
    settle(1)
    assert len(pool_objects(api, "bare")) == len(POOL_KINDS)  # the collector has nothing to go by
    controller.restart()
    gone_for_good(api, "bare")


def test_a_grown_pool_shrunk_then_emptied(cluster: Any, controller: ControllerProcess) -> None:
    """The sequence that left a real cluster's pool objects with no owner at all (2 teardowns of 2): 5 members,
    3 more, 6 of the 8 deleted, then the last 2 a moment apart."""
    _, api = cluster
    names = make_pool(api, "grow")
    wait_for(lambda: members_served(api, "grow", names), timeout=60, what="the pool owned by its 4 members")
    more = []
    for i in range(MEMBERS, MEMBERS + 3):
        name = f"grow-{i}"
        make_vm(api, NS, name, cdrom=False)
        call(api, "POST", f"/api/v1/namespaces/{NS}/secrets",
             {"metadata": {"name": f"{name}-auth"}, "stringData": {"username": "u", "password": "p"}})
        call(api, "POST", BMCS, {"apiVersion": "bmc.kubevirt.io/v1beta1", "kind": "VirtualMachineBMC",
                                 "metadata": {"name": name}, "spec": {"virtualMachineRef": {"name": name},
                                                                      "authSecretRef": {"name": f"{name}-auth"},
                                                                      "agentPool": "grow"}})
        more.append(name)
    wait_for(lambda: members_served(api, "grow", names + more), timeout=60, what="the pool grown to 7")
    last = [names[-1], more[-1]]
    for name in names[:-1] + more[:-1]:
        assert call(api, "DELETE", f"{BMCS}/{name}").status == 200
    wait_for(lambda: pool_objects(api, "grow") and all(
        f"'{n}'" not in o for o in pool_objects(api, "grow") for n in names[:-1] + more[:-1]), timeout=30,
             what="the pool shrunk to 2")
    for name in last:
        assert call(api, "DELETE", f"{BMCS}/{name}").status == 200
    gone_for_good(api, "grow")
