"""The rollout plan (controller/rollout.py) and the pool's objects (controller/desired.py) as pure functions."""

from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

import pytest

from controller import desired, rollout, verdicts
from controller.settings import Settings

OLD = Settings(agent_image="kubevbmc:v1", rollout_batch="25%")
NEW = dataclasses.replace(OLD, agent_image="kubevbmc:v2")


def agent(name: str, settings: Settings, *, ready: bool = True, failed: bool = False, generation: int = 2) -> Any:
    secret = {"metadata": {"name": f"{name}-auth", "uid": "u", "resourceVersion": "1"}}
    bmc = {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
           "spec": {"virtualMachineRef": {"name": name}, "authSecretRef": {"name": f"{name}-auth"}}}
    d = desired.desired_deployment(bmc, name, settings, secret, None)
    d["metadata"]["generation"] = generation
    conditions = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                   "message": "timed out"}] if failed else []
    d["status"] = {"observedGeneration": generation, "replicas": 1, "updatedReplicas": 1,
                   "readyReplicas": 1 if ready else 0, "conditions": conditions}
    if not ready:
        d["status"].pop("readyReplicas")
    return d


def fleet(n: int, settings: Settings = OLD) -> list[Any]:
    return [agent(f"vm{i:02d}", settings) for i in range(n)]


def names(keys: Any) -> list[str]:
    """The VMs of agent Deployments' keys."""
    return sorted(name.removesuffix("-virtbmc") for _, name in keys)


def test_a_new_template_updates_one_canary_first() -> None:
    plan = rollout.plan(fleet(20), NEW)
    assert names(plan.allowed) == ["vm00"] and len(plan.outdated) == 20 and plan.halted_by is None
    up, reason, _ = plan.state(("ns", "vm01-virtbmc"))
    assert (up, reason) == (False, "RolloutPending")
    assert plan.state(("ns", "vm00-virtbmc"))[0]


def test_nothing_more_while_an_updated_agent_is_on_its_way() -> None:
    agents = fleet(20)
    agents[0] = agent("vm00", NEW, ready=False)
    plan = rollout.plan(agents, NEW)
    assert plan.allowed == frozenset() and plan.halted_by is None


def test_batches_follow_once_every_updated_agent_is_ready() -> None:
    agents = fleet(20)
    agents[0] = agent("vm00", NEW)
    plan = rollout.plan(agents, NEW)
    assert names(plan.allowed) == ["vm01", "vm02", "vm03", "vm04", "vm05"]  # 25% of 20
    assert rollout.plan(agents, dataclasses.replace(NEW, rollout_batch="3")).allowed.__len__() == 3


def test_an_updated_agent_past_its_deadline_halts_and_names_itself() -> None:
    agents = fleet(20)
    agents[0] = agent("vm00", NEW, ready=False, failed=True)
    plan = rollout.plan(agents, NEW)
    assert plan.allowed == frozenset() and plan.halted_by == ("ns", "vm00-virtbmc")
    up, reason, message = plan.state(("ns", "vm07-virtbmc"))
    assert not up and reason == "RolloutHalted" and "ns/vm00-virtbmc" in message and "timed out" in message


def test_a_corrected_template_fixes_the_broken_agent_first() -> None:
    agents = fleet(20)
    agents[7] = agent("vm07", NEW, ready=False, failed=True)  # on the bad revision, not ready
    fixed = dataclasses.replace(NEW, agent_image="kubevbmc:v3")
    plan = rollout.plan(agents, fixed)
    assert names(plan.allowed) == ["vm07"] and plan.halted_by is None


def test_a_failed_verdict_of_an_older_generation_does_not_count() -> None:
    broken = agent("vm00", NEW, ready=False, failed=True)
    broken["metadata"]["generation"] = 3  # updated since: the verdict was about the template before
    assert verdicts.progress_deadline_exceeded(broken) == ""


def test_a_broken_agent_with_nothing_left_to_update_is_no_halt() -> None:
    agents = fleet(20, NEW)
    agents[3] = agent("vm03", NEW, ready=False, failed=True)
    plan = rollout.plan(agents, NEW)
    assert plan.outdated == () and plan.halted_by is None  # vm03's own Ready says it (status.py), not the fleet
    assert plan.state(("ns", "vm03-virtbmc"))[0]


def timed_out_on(d: Any, replicaset: str) -> Any:
    d["status"]["conditions"] = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                                  "message": f'ReplicaSet "{replicaset}" has timed out progressing.'}]
    return d


def replicaset_of(d: Any, name: str) -> Any:
    """The ReplicaSet the deployment controller makes of `d`'s template: a hash label, server defaults."""
    template = json.loads(json.dumps(d["spec"]["template"]))
    template["metadata"]["labels"]["pod-template-hash"] = name.rsplit("-", 1)[1]
    template["spec"]["restartPolicy"] = "Always"
    template["spec"]["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
    return {"metadata": {"name": name}, "spec": {"replicas": 1, "template": template}}


def test_a_verdict_counts_only_for_the_replicaset_of_the_current_template() -> None:
    old = agent("vm00", NEW, ready=False)
    new = agent("vm00", dataclasses.replace(NEW, agent_image="kubevbmc:v3"), ready=False, generation=3)
    old_rs, new_rs = replicaset_of(old, "vm00-virtbmc-5d8f7c9b4"), replicaset_of(new, "vm00-virtbmc-6c9d8e7f5")
    # The first sync of the new template: generation observed, the verdict still the old ReplicaSet's.
    stale = timed_out_on(new, "vm00-virtbmc-5d8f7c9b4")
    assert verdicts.timed_out_replicaset(stale) == "vm00-virtbmc-5d8f7c9b4"
    assert not verdicts.runs_template(stale, old_rs)
    assert not verdicts.runs_template(stale, None)  # cleaned up since
    assert verdicts.progress_deadline_exceeded(verdicts.without_progress_verdict(stale)) == ""
    assert verdicts.agent_readiness(verdicts.without_progress_verdict(stale))[1] == "AgentNotReady"
    # The new ReplicaSet's own verdict.
    fresh = timed_out_on(agent("vm00", dataclasses.replace(NEW, agent_image="kubevbmc:v3"), ready=False,
                               generation=3), "vm00-virtbmc-6c9d8e7f5")
    assert verdicts.runs_template(fresh, new_rs)
    assert verdicts.agent_readiness(fresh)[1] == "ProgressDeadlineExceeded"
    # A verdict that names no ReplicaSet (none existed by the deadline) is the template's own.
    fresh["status"]["conditions"][0]["message"] = 'Deployment "vm00-virtbmc" has timed out progressing.'
    assert verdicts.timed_out_replicaset(fresh) == ""


@pytest.mark.parametrize(("batch", "total", "size"), [("10%", 20, 2), ("10%", 5, 1), ("25%", 20, 5),
                                                      ("100%", 7, 7), ("3", 20, 3)])
def test_batch_size(batch: str, total: int, size: int) -> None:
    assert rollout.batch_size(batch, total) == size


def test_a_waiting_agent_is_rendered_with_the_fleet_settings_it_runs() -> None:
    have = agent("vm00", OLD)
    running = rollout.running_settings(NEW, have)
    assert running is not None and running.agent_image == "kubevbmc:v1"
    assert rollout.revision(running) == rollout.revision_of(have)
    # Rendered by another controller version (another template shape): not reproducible, left alone.
    have["spec"]["template"]["metadata"]["annotations"][rollout.REVISION] = "0123456789"
    assert rollout.running_settings(NEW, have) is None


def test_a_waiting_agent_keeps_the_node_loss_toleration_it_runs() -> None:
    have = agent("vm00", dataclasses.replace(OLD, agent_node_loss_toleration=120))
    running = rollout.running_settings(NEW, have)
    assert running is not None and running.agent_node_loss_toleration == 120
    assert rollout.revision(running) == rollout.revision_of(have)


def test_the_revision_follows_the_fleet_fields_only() -> None:
    assert rollout.revision(OLD) != rollout.revision(NEW)
    assert rollout.revision(OLD) != rollout.revision(dataclasses.replace(OLD, agent_log_level="debug"))
    assert rollout.revision(OLD) != rollout.revision(dataclasses.replace(OLD, agent_node_loss_toleration=60))
    assert rollout.revision(OLD) == rollout.revision(dataclasses.replace(OLD, workers=3, rollout_batch="1"))


def member(name: str, **spec: Any) -> Any:
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
            "spec": {"virtualMachineRef": {"name": name}, "authSecretRef": {"name": f"{name}-auth"},
                     "agentPool": "lab", **spec}}


def owned_by(*bmcs: Any) -> list[Any]:
    return desired.pool_owner_references([], list(bmcs), set())


def test_a_member_service_points_at_its_slot_on_the_pool_pod() -> None:
    service = desired.desired_member_service(member("vm1"), "vm1", "lab", 7)
    assert service["metadata"]["name"] == "vm1-virtbmc"
    assert service["spec"]["selector"] == {desired.NAME_LABEL: desired.AGENT, desired.POOL_LABEL: "lab"}
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        "ipmi": (623, 20007), "http": (80, 30007), "https": (443, 40007)}
    assert desired.slot_of(service) == 7
    assert desired.slot_of(desired.desired_service(member("vm1"), "vm1")) is None  # a dedicated agent's


def test_the_pool_role_names_exactly_its_members_objects() -> None:
    role = desired.desired_pool_role("ns", "lab", owned_by(member("a"), member("b")),
                                     [(member("a"), "a", ["cdrom"]), (member("b"), "b", [])])
    by_resource = {tuple(r["resources"]): r for r in role["rules"]}
    assert by_resource[("virtualmachines",)]["resourceNames"] == ["a", "b"]
    assert by_resource[("virtualmachinebmcs",)]["resourceNames"] == ["a", "b"]
    secrets = [r for r in role["rules"] if r["resources"] == ["secrets"]]
    assert sorted(n for r in secrets for n in r["resourceNames"]) == [
        "a-virtbmc-events", "b-virtbmc-events", "lab-virtbmc-pool"]
    for rule in role["rules"]:  # nothing namespace-wide but what a dedicated agent has (Events, DataVolume create)
        if "resourceNames" not in rule:
            assert rule["verbs"] == ["create"], rule
    assert [o["uid"] for o in role["metadata"]["ownerReferences"]] == ["uid-a", "uid-b"]
    assert not any(o["controller"] for o in role["metadata"]["ownerReferences"])


def test_the_pool_secret_carries_each_members_credentials_and_certificate() -> None:
    creds = {"metadata": {"name": "a-auth"}, "data": {"username": base64.b64encode(b"u1").decode(),
                                                      "password": base64.b64encode(b"p1").decode()}}
    tls = {"data": {"tls.crt": base64.b64encode(b"CERT").decode(), "tls.key": base64.b64encode(b"KEY").decode()}}
    entries = [desired.pool_member(member("a"), "a", 3, creds, tls),
               desired.pool_member(member("b", redfish={"enabled": False}), "b", 4, creds, None)]
    secret = desired.desired_pool_secret("ns", "lab", owned_by(member("a"), member("b")), entries)
    config = json.loads(base64.b64decode(secret["data"][desired.POOL_CONFIG_KEY]))
    a, b = config["members"]
    assert (a["username"], a["password"], a["ipmiPort"], a["httpPort"], a["httpsPort"]) == ("u1", "p1", 20003,
                                                                                             30003, 40003)
    assert (a["tlsCert"], a["tlsKey"], a["subscriptionsSecret"]) == ("CERT", "KEY", "a-virtbmc-events")
    assert (b["redfish"], b["httpsPort"], b["tlsCert"]) == (False, 0, "")


def test_a_full_pool_of_long_names_fits_the_api_servers_object_limit() -> None:
    """MAX_POOL_MEMBERS members, each with names of the longest a DNS label allows, a long password and a real
    certificate (P-256, the Service's four DNS names, a ClusterIP and a LoadBalancer address): the pool's Secret
    and every object that names each member stay under the 1 MiB kube-apiserver accepts (etcd's request limit is
    1.5 MiB), with room to spare."""
    import datetime

    from controller import certificates

    now = datetime.datetime.now(datetime.UTC)
    ca = certificates.issue_ca("kubevbmc", now)
    namespace = "n" * 63
    creds = {"metadata": {"name": "x"}, "data": {"username": base64.b64encode(b"u" * 32).decode(),
                                                 "password": base64.b64encode(b"p" * 64).decode()}}
    entries, grants, bmcs = [], [], []
    for slot in range(desired.MAX_POOL_MEMBERS):
        name = f"vm-{slot:03d}-" + "x" * 56
        bmc = {**member(name), "metadata": {"name": name, "namespace": namespace, "uid": f"{slot:08d}" + "-" * 28}}
        names = certificates.service_names(desired.child_name(name)[:63], namespace, "10.96.255.255",
                                           "192.168.255.255")
        material = certificates.issue_leaf(ca, names, now)
        tls = desired.desired_tls_secret(bmc, name, material)
        entries.append(desired.pool_member(bmc, name, slot, creds, tls))
        grants.append((bmc, name, ["cdrom"]))
        bmcs.append(bmc)
    owners = owned_by(*bmcs)
    objects = [desired.desired_pool_secret(namespace, "lab", owners, entries),
               desired.desired_pool_role(namespace, "lab", owners, grants),
               desired.desired_pool_service_account(namespace, "lab", owners)]
    sizes = [len(json.dumps(o, separators=(",", ":"))) for o in objects]
    assert max(sizes) < 0.9 * 2**20, sizes


def test_the_pool_deployment_names_no_member() -> None:
    one = desired.desired_pool_deployment("ns", "lab", owned_by(member("a")), OLD)
    two = desired.desired_pool_deployment("ns", "lab", owned_by(member("a"), member("b")), OLD)
    assert one["spec"]["template"] == two["spec"]["template"]  # a new member restarts nothing
    assert one["metadata"]["name"] == "lab-virtbmc-pool"
    assert "--pool-secret" in one["spec"]["template"]["spec"]["containers"][0]["args"]
    assert one["spec"]["template"]["spec"]["tolerations"] == desired.node_loss_tolerations(30)  # as a dedicated one


def ref(name: str) -> Any:
    return desired.pool_owner_reference(member(name))


@pytest.mark.parametrize(("have", "members", "left", "want"), [
    # A new pool: every member, by name.
    ([], ["b", "a"], set(), ["a", "b"]),
    # A member joins: added after the others, whose order is kept.
    ([ref("b"), ref("a")], ["a", "b", "c"], set(), ["b", "a", "c"]),
    # Members deleted (gone from the cache): their references stay for the garbage collector to remove by uid.
    ([ref("a"), ref("b"), ref("c")], ["c"], set(), ["a", "b", "c"]),
    ([ref("a"), ref("b")], [], set(), ["a", "b"]),
    # A member that went to another pool, or to a dedicated agent, alive: its reference goes.
    ([ref("a"), ref("b")], ["a"], {"uid-b"}, ["a"]),
    # A BMC deleted and created again under its name: the new one is another owner (another uid).
    ([ref("a")], [{**member("a"), "metadata": {**member("a")["metadata"], "uid": "uid-a2"}}], set(), ["a", "a"]),
])
def test_pool_owner_references_are_added_never_rewritten_from_the_cache(
        have: list[Any], members: list[str | Any], left: set[str], want: list[str]) -> None:
    bmcs = [member(m) if isinstance(m, str) else m for m in members]
    refs = desired.pool_owner_references(have, bmcs, left)
    assert [r["name"] for r in refs] == want
    assert [r for r in refs if r["uid"] in {h["uid"] for h in have}] == [h for h in have if h["uid"] not in left]
    assert not any(r["controller"] for r in refs)


# ---- a pool's slots and members, as the reconciler plans them from its caches


class _Informer:
    def __init__(self, objs: list[Any] | None = None) -> None:
        self.items = {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in objs or []}
        self.handlers: list[Any] = []

    def get(self, namespace: str, name: str) -> Any:
        return self.items.get((namespace, name))

    def list(self) -> list[Any]:
        return list(self.items.values())

    def seen_through(self, _rv: int) -> bool:
        return True


def planner(members: list[Any], services: tuple[Any, ...] = (), vms: tuple[str, ...] | None = None,
            certified: tuple[str, ...] | None = None) -> Any:
    from types import SimpleNamespace

    from controller.reconciler import Reconciler

    names = vms if vms is not None else tuple(m["spec"]["virtualMachineRef"]["name"] for m in members)
    certified = certified if certified is not None else names
    secrets = _Informer([{"metadata": {"namespace": "ns", "name": f"{m['metadata']['name']}-auth"},
                          "data": {"username": "dQ==", "password": "cA=="}} for m in members]
                        + [{"metadata": {"namespace": "ns", "name": desired.tls_secret_name(vm)}} for vm in certified])
    children = {kind: _Informer() for kind in ("ServiceAccount", "Role", "RoleBinding", "Deployment")}
    children["Service"] = _Informer(list(services))
    children["Secret"] = secrets
    by_vm: dict[str, list[Any]] = {}
    for m in members:
        by_vm.setdefault(m["spec"]["virtualMachineRef"]["name"], []).append(m)
    caches = SimpleNamespace(
        bmcs=_Informer(members), children=children, secrets=secrets,
        vms=_Informer([{"metadata": {"namespace": "ns", "name": n}} for n in names]),
        bmcs_in_pool=lambda ns, pool: [m for m in members if m["spec"].get("agentPool") == pool],
        bmcs_for_vm=lambda ns, vm: by_vm.get(vm, []))
    return Reconciler(None, caches, Settings(), None)  # type: ignore[arg-type]


def pooled(name: str, created: str, vm: str | None = None) -> Any:
    b = member(name)
    b["metadata"]["creationTimestamp"] = created
    b["spec"]["virtualMachineRef"]["name"] = vm or name
    return b


def test_a_member_keeps_its_slot_and_newcomers_take_the_lowest_free_one_oldest_first() -> None:
    old = pooled("old", "2026-01-01T00:00:00Z")
    newer, newest = pooled("newer", "2026-01-02T00:00:00Z"), pooled("newest", "2026-01-03T00:00:00Z")
    kept = desired.desired_member_service(old, "old", "lab", 1)
    kept["metadata"]["namespace"] = "ns"
    plan = planner([newest, old, newer], (kept,))._pool_plan("ns", "lab")
    assert plan.slots == {"old": 1, "newer": 0, "newest": 2}
    assert [m["metadata"]["name"] for m in plan.owners] == ["newer", "newest", "old"]
    assert [(m["metadata"]["name"], slot) for m, _, _, slot in plan.served] == [("old", 1), ("newer", 0),
                                                                                 ("newest", 2)]


def test_a_full_pool_leaves_the_newest_without_a_place_until_one_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(desired, "MAX_POOL_MEMBERS", 2)
    a, b, c = (pooled(n, f"2026-01-0{i}T00:00:00Z") for i, n in enumerate("abc", 1))
    plan = planner([a, b, c])._pool_plan("ns", "lab")
    assert plan.slots == {"a": 0, "b": 1} and "c" not in plan.slots
    assert [m["metadata"]["name"] for m, *_ in plan.served] == ["a", "b"]
    plan = planner([a, c])._pool_plan("ns", "lab")
    assert plan.slots == {"a": 0, "c": 1}


def test_the_pool_serves_only_members_whose_vm_exists_and_that_do_not_conflict() -> None:
    first = pooled("first", "2026-01-01T00:00:00Z", "shared")
    second = pooled("second", "2026-01-02T00:00:00Z", "shared")
    lonely = pooled("lonely", "2026-01-03T00:00:00Z")
    plan = planner([first, second, lonely], vms=("shared",))._pool_plan("ns", "lab")
    assert [m["metadata"]["name"] for m, *_ in plan.served] == ["first"]  # second: Conflict; lonely: no VM
    assert set(plan.slots) == {"first", "second", "lonely"}  # each keeps a place for when it can be served


def test_a_member_is_served_once_its_certificate_is_issued() -> None:
    a, b = pooled("a", "2026-01-01T00:00:00Z"), pooled("b", "2026-01-02T00:00:00Z")
    plain = pooled("plain", "2026-01-03T00:00:00Z")
    plain["spec"]["redfish"] = {"enabled": False}
    plan = planner([a, b, plain], certified=("a",))._pool_plan("ns", "lab")
    # b would first join without HTTPS, then again with it: its agent would restart the member for nothing.
    assert [m["metadata"]["name"] for m, *_ in plan.served] == ["a", "plain"]
    assert set(plan.slots) == {"a", "b", "plain"}


def test_the_reconciler_reads_the_replicaset_a_verdict_names_once_and_drops_a_stale_verdict() -> None:
    from controller.kubeapi import ApiError

    new = agent("vm00", dataclasses.replace(NEW, agent_image="kubevbmc:v3"), ready=False, generation=3)
    new["metadata"]["namespace"] = "ns"
    replicasets = {"vm00-virtbmc-5d8f7c9b4": replicaset_of(agent("vm00", NEW), "vm00-virtbmc-5d8f7c9b4"),
                   "vm00-virtbmc-6c9d8e7f5": replicaset_of(new, "vm00-virtbmc-6c9d8e7f5")}
    asked: list[str] = []

    class Api:
        def request(self, method: str, path: str, *_: Any, **__: Any) -> Any:
            asked.append(path)
            name = path.rsplit("/", 1)[1]
            if name not in replicasets:
                raise ApiError(404, "NotFound", "not found")
            return replicasets[name]

    reconciler = planner([])
    reconciler.api = Api()
    stale = timed_out_on(json.loads(json.dumps(new)), "vm00-virtbmc-5d8f7c9b4")
    for _ in range(3):
        assert verdicts.progress_deadline_exceeded(reconciler._judged(stale)) == ""
    assert asked == ["/apis/apps/v1/namespaces/ns/replicasets/vm00-virtbmc-5d8f7c9b4"]
    fresh = timed_out_on(json.loads(json.dumps(new)), "vm00-virtbmc-6c9d8e7f5")
    assert "timed out" in verdicts.progress_deadline_exceeded(reconciler._judged(fresh))
    gone = timed_out_on(json.loads(json.dumps(new)), "vm00-virtbmc-77777777")
    assert verdicts.progress_deadline_exceeded(reconciler._judged(gone)) == ""
    assert len(asked) == 3
