"""kubesim's nodes as Kubernetes runs them: heartbeats, scheduling, and what happens when a node loses power.

A kubesim of three nodes with a node monitor grace period of 2 s. What must hold is Kubernetes' behaviour, as its
sources have it: pkg/controller/nodelifecycle/node_lifecycle_controller.go (Ready Unknown after the grace period,
taints node.kubernetes.io/unreachable NoSchedule and NoExecute, pods Ready False), pkg/controller/tainteviction/
taint_eviction.go (deletion after the toleration's tolerationSeconds, at once without a toleration, never with one
without seconds), plugin/pkg/admission/defaulttolerationseconds (300 s tolerations for pods that lack them),
pkg/controller/controller_utils.go FilterActivePods (a Terminating pod is replaced at once) and the scheduler's
TaintToleration, NodeAffinity and InterPodAffinity filters. Timing verdicts come from the objects' own timestamps
(taints' timeAdded, conditions' lastTransitionTime, the Lease's renewTime), never from a clock in the test.
"""

from __future__ import annotations

import math
import socket
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from kubesim.cluster import Cluster, SimConfig
from kubesim.nodelifecycle import desired_taints, unknown_status
from kubesim.objects import parse_time
from kubesim.scheduler import pick, unschedulable_message, why_not
from kubesim.tolerations import default_toleration_seconds, eviction_delay, tolerates

from ..support.cluster import Sim, call, start_sim, wait_for

GRACE = 2.0
NODES = ["kubesim-node", "kubesim-node-2", "kubesim-node-3"]
UNREACHABLE = "node.kubernetes.io/unreachable"
NOT_READY = "node.kubernetes.io/not-ready"

# A pod that answers every TCP connection on its Pod IP, port 9000, with its own name.
NAME_SERVER = textwrap.dedent("""
    import os, socket
    tcp = socket.socket()
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind((os.environ["POD_IP"], 9000))
    tcp.listen()
    while True:
        conn, _ = tcp.accept()
        conn.sendall(os.environ["HOSTNAME"].encode())
        conn.close()
""")


@pytest.fixture(scope="module")
def nodes_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    sim = start_sim(tmp_path_factory.mktemp("nodes"), "--nodes", "3", "--node-monitor-grace-period", str(GRACE))
    yield sim
    sim.stop()


@pytest.fixture(scope="module")
def napi(nodes_sim: Sim) -> client.ApiClient:
    return nodes_sim.api()


@pytest.fixture
def core(napi: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(napi)


@pytest.fixture
def ns(core: client.CoreV1Api, nodes_sim: Sim) -> Iterator[str]:
    """A namespace of the test's own; every node is powered on again and untainted afterwards."""
    name = f"n-{uuid.uuid4().hex[:8]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    for node in NODES:
        nodes_sim.power_on_node(node)
        core.patch_node(node, {"spec": {"taints": None}})
    wait_for(lambda: all(ready(core.read_node(n)) == "True" and not taints(core.read_node(n)) for n in NODES),
             what="every node Ready and untainted again")
    core.delete_namespace(name)


def ready(node: client.V1Node) -> str:
    return next(c.status for c in node.status.conditions if c.type == "Ready")


def taints(node: client.V1Node) -> list[Any]:
    return list((node.spec.taints if node.spec else None) or [])


def raw(api: client.ApiClient, path: str) -> Any:
    reply = call(api, "GET", path)
    assert reply.status == 200, reply.body
    return reply.body


def name_server(**pod_spec: Any) -> dict[str, Any]:
    return {"containers": [{
        "name": "main", "image": "kubevbmc:dev", "command": [sys.executable, "-c", NAME_SERVER],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"containerPort": 9000}],
        "readinessProbe": {"tcpSocket": {"port": 9000}, "periodSeconds": 1}}], **pod_spec}


def deployment(name: str, replicas: int = 1, **pod_spec: Any) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name}, "spec": {
        "replicas": replicas, "selector": {"matchLabels": {"app": name}},
        "template": {"metadata": {"labels": {"app": name}}, "spec": name_server(**pod_spec)}}}


def node_loss_tolerations(seconds: int | None) -> list[dict[str, Any]]:
    extra = {} if seconds is None else {"tolerationSeconds": seconds}
    return [{"key": key, "operator": "Exists", "effect": "NoExecute", **extra} for key in (UNREACHABLE, NOT_READY)]


def pods(api: client.ApiClient, ns: str, app: str) -> list[dict[str, Any]]:
    return list(raw(api, f"/api/v1/namespaces/{ns}/pods?labelSelector=app%3D{app}")["items"])


def is_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def ready_pods(api: client.ApiClient, ns: str, app: str, count: int = 1) -> list[dict[str, Any]]:
    return wait_for(lambda: len(found := [p for p in pods(api, ns, app) if is_ready(p)
                                          and not p["metadata"].get("deletionTimestamp")]) == count and found,
                    what=f"{count} ready pod(s) of {app}")


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in obj["status"]["conditions"] if c["type"] == kind)


def ask(host: str, port: int = 9000) -> str:
    with socket.create_connection((host, port), timeout=2) as s:
        return s.recv(100).decode()


# ---- nodes and their heartbeats


def test_every_node_is_registered_ready_and_renews_its_lease(napi: client.ApiClient, core: client.CoreV1Api) -> None:
    nodes = core.list_node().items
    assert [n.metadata.name for n in nodes] == NODES
    for node in nodes:
        assert ready(node) == "True"
        assert node.metadata.labels["kubernetes.io/hostname"] == node.metadata.name
        assert not taints(node)
    lease = raw(napi, "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/kubesim-node-2")
    assert lease["spec"]["holderIdentity"] == "kubesim-node-2"
    assert lease["metadata"]["ownerReferences"][0]["kind"] == "Node"
    first = lease["spec"]["renewTime"]
    wait_for(lambda: raw(napi, "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/kubesim-node-2")[
        "spec"]["renewTime"] > first, what="the kubelet to renew its Lease")


def test_kubesims_admin_api_reports_the_nodes_power_and_heartbeats_to_its_admin_only(
        nodes_sim: Sim, napi: client.ApiClient) -> None:
    first = raw(napi, "/kubesim/v1/nodes")
    assert first["items"] == [{"name": n, "powered": True} for n in NODES]
    wait_for(lambda: raw(napi, "/kubesim/v1/nodes")["heartbeatWrites"] > first["heartbeatWrites"],
             what="a heartbeat counted")
    assert call(napi, "POST", "/kubesim/v1/nodes/no-such-node/power-off").status == 404
    assert call(napi, "GET", "/kubesim/v1/nodes/kubesim-node/power-off").status == 405


def test_only_the_cluster_admin_may_switch_a_nodes_power() -> None:
    cluster = Cluster(SimConfig(port=0, kubelet_mode="fake", nodes=2))
    cluster.start()
    try:
        api = config.new_client_from_config(config_file=cluster.kubeconfig)
        token = cluster.new_token("system:serviceaccount:default:default")
        reply = call(api, "POST", "/kubesim/v1/nodes/kubesim-node-2/power-off", token=token)
        assert reply.status == 403 and reply.body["reason"] == "Forbidden"
        assert cluster.nodes.up("kubesim-node-2")
        assert call(api, "POST", "/kubesim/v1/nodes/kubesim-node-2/power-off").status == 200
        assert not cluster.nodes.up("kubesim-node-2")
    finally:
        cluster.stop()


# ---- scheduling


def test_required_anti_affinity_puts_each_replica_on_its_own_node_and_leaves_the_extra_one_pending(
        napi: client.ApiClient, core: client.CoreV1Api, ns: str) -> None:
    apps = client.AppsV1Api(napi)
    anti = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"app": "spread"}}, "topologyKey": "kubernetes.io/hostname"}]}}
    apps.create_namespaced_deployment(ns, deployment("spread", replicas=4, affinity=anti))

    running = ready_pods(napi, ns, "spread", 3)
    assert sorted(p["spec"]["nodeName"] for p in running) == NODES
    pending = wait_for(lambda: [p for p in pods(napi, ns, "spread") if not p["spec"].get("nodeName")
                                and any(c["type"] == "PodScheduled" for c in p["status"].get("conditions", []))],
                       what="the fourth replica to be found unschedulable")
    scheduled = condition(pending[0], "PodScheduled")
    assert (scheduled["status"], scheduled["reason"]) == ("False", "Unschedulable")
    assert scheduled["message"] == "0/3 nodes are available: 3 node(s) didn't match pod anti-affinity rules."


def test_a_pod_gets_the_default_300_s_node_loss_tolerations_unless_it_has_its_own(
        napi: client.ApiClient, core: client.CoreV1Api, ns: str) -> None:
    core.create_namespaced_pod(ns, {"metadata": {"name": "plain"}, "spec": name_server()})
    core.create_namespaced_pod(ns, {"metadata": {"name": "own"}, "spec": name_server(
        tolerations=node_loss_tolerations(30))})

    plain = raw(napi, f"/api/v1/namespaces/{ns}/pods/plain")["spec"]["tolerations"]
    own = raw(napi, f"/api/v1/namespaces/{ns}/pods/own")["spec"]["tolerations"]
    assert plain == [{"key": NOT_READY, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
                     {"key": UNREACHABLE, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}]
    assert own == node_loss_tolerations(30)


def test_a_node_selector_or_an_untolerated_taint_keeps_a_pod_off_a_node(napi: client.ApiClient,
                                                                         core: client.CoreV1Api, ns: str) -> None:
    core.patch_node("kubesim-node-3", {"spec": {"taints": [{"key": "example.com/gpu", "effect": "NoSchedule"}]}})
    pinned = {"kubernetes.io/hostname": "kubesim-node-3"}
    core.create_namespaced_pod(ns, {"metadata": {"name": "refused"}, "spec": name_server(nodeSelector=pinned)})
    core.create_namespaced_pod(ns, {"metadata": {"name": "tolerated"}, "spec": name_server(
        nodeSelector=pinned, tolerations=[{"key": "example.com/gpu", "operator": "Exists"}])})

    wait_for(lambda: raw(napi, f"/api/v1/namespaces/{ns}/pods/tolerated")["spec"].get("nodeName") == "kubesim-node-3",
             what="the tolerating pod on kubesim-node-3")
    refused = wait_for(lambda: (p := raw(napi, f"/api/v1/namespaces/{ns}/pods/refused")).get("status", {}).get(
        "conditions") and p, what="the other pod found unschedulable")
    assert not refused["spec"].get("nodeName")
    assert condition(refused, "PodScheduled")["message"] == (
        "0/3 nodes are available: 1 node(s) had untolerated taint {example.com/gpu: }, "
        "2 node(s) didn't match Pod's node affinity/selector.")


# ---- losing a node


def test_a_lost_node_turns_unknown_after_the_grace_period_and_its_pods_are_replaced_after_their_toleration(
        nodes_sim: Sim, napi: client.ApiClient, core: client.CoreV1Api, ns: str) -> None:
    seconds = 3
    client.AppsV1Api(napi).create_namespaced_deployment(ns, deployment(
        "web", tolerations=node_loss_tolerations(seconds), terminationGracePeriodSeconds=5))
    service = core.create_namespaced_service(ns, {"metadata": {"name": "web"}, "spec": {
        "selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 9000}]}})
    [first] = ready_pods(napi, ns, "web")
    lost, name = first["spec"]["nodeName"], first["metadata"]["name"]
    assert wait_for(lambda: ask(service.spec.cluster_ip, 80), what="the Service to answer") == name

    nodes_sim.power_off_node(lost)

    node = wait_for(lambda: (n := raw(napi, f"/api/v1/nodes/{lost}")) and condition(n, "Ready")["status"] ==
                    "Unknown" and n, what="the lost node to turn Unknown")
    unknown = condition(node, "Ready")
    assert (unknown["reason"], unknown["message"]) == ("NodeStatusUnknown", "Kubelet stopped posting node status.")
    lease = raw(napi, f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{lost}")
    last_renewal = parse_micro(lease["spec"]["renewTime"])
    assert parse_time(unknown["lastTransitionTime"]) >= math.floor(last_renewal + GRACE)  # not before the grace
    by_effect = {(t["key"], t["effect"]): t for t in node["spec"]["taints"]}
    assert set(by_effect) == {(UNREACHABLE, "NoSchedule"), (UNREACHABLE, "NoExecute")}
    tainted_at = parse_time(by_effect[(UNREACHABLE, "NoExecute")]["timeAdded"])

    # The replacement runs on another node, is the one Ready endpoint, and answers the Service.
    [replacement] = ready_pods(napi, ns, "web")
    assert replacement["spec"]["nodeName"] != lost
    wait_for(lambda: ask(service.spec.cluster_ip, 80) == replacement["metadata"]["name"],
             what="the Service to reach the replacement")
    endpoints = raw(napi, f"/api/v1/namespaces/{ns}/endpoints/web")
    assert [a["targetRef"]["name"] for s in endpoints["subsets"] for a in s.get("addresses", [])] == [
        replacement["metadata"]["name"]]
    assert not any(s.get("notReadyAddresses") for s in endpoints["subsets"])  # the Terminating pod is out

    # The evicted pod: Ready False, DisruptionTarget, deleted no sooner than tolerationSeconds after the taint, and
    # still there Terminating, as no kubelet confirms its end.
    evicted = raw(napi, f"/api/v1/namespaces/{ns}/pods/{name}")
    assert evicted["metadata"]["deletionTimestamp"]
    assert condition(evicted, "Ready")["status"] == "False"
    disruption = condition(evicted, "DisruptionTarget")
    assert (disruption["status"], disruption["reason"]) == ("True", "DeletionByTaintManager")
    assert parse_time(disruption["lastTransitionTime"]) >= tainted_at + seconds
    deleted_at = parse_time(evicted["metadata"]["deletionTimestamp"]) - evicted["metadata"][
        "deletionGracePeriodSeconds"]
    assert deleted_at >= tainted_at + seconds
    assert parse_time(replacement["metadata"]["creationTimestamp"]) >= deleted_at

    nodes_sim.power_on_node(lost)
    wait_for(lambda: ready(core.read_node(lost)) == "True" and not taints(core.read_node(lost)),
             what="the node back, untainted")
    wait_for(lambda: [p["metadata"]["name"] for p in pods(napi, ns, "web")] == [replacement["metadata"]["name"]],
             what="the powered-on kubelet to finish the evicted pod")


def test_a_pod_tolerating_node_loss_without_seconds_stays_while_an_untolerated_taint_evicts_at_once(
        nodes_sim: Sim, napi: client.ApiClient, core: client.CoreV1Api, ns: str) -> None:
    pinned = {"kubernetes.io/hostname": "kubesim-node-2"}
    for name, tolerations in (("forever", node_loss_tolerations(None)), ("brief", node_loss_tolerations(1))):
        core.create_namespaced_pod(ns, {"metadata": {"name": name, "labels": {"app": name}}, "spec": name_server(
            nodeSelector=pinned, tolerations=tolerations, terminationGracePeriodSeconds=5)})
    ready_pods(napi, ns, "forever")
    ready_pods(napi, ns, "brief")
    core.create_namespaced_service(ns, {"metadata": {"name": "forever"}, "spec": {
        "selector": {"app": "forever"}, "ports": [{"port": 80, "targetPort": 9000}]}})
    wait_for(lambda: raw(napi, f"/api/v1/namespaces/{ns}/endpoints/forever").get("subsets"), what="endpoints")

    nodes_sim.power_off_node("kubesim-node-2")
    wait_for(lambda: raw(napi, f"/api/v1/namespaces/{ns}/pods/brief")["metadata"].get("deletionTimestamp"),
             what="the briefly tolerating pod to be evicted")
    forever = raw(napi, f"/api/v1/namespaces/{ns}/pods/forever")
    assert not forever["metadata"].get("deletionTimestamp")  # the taint eviction controller went by it
    assert condition(forever, "Ready")["status"] == "False"  # but it is out of its Service's ready addresses:
    [subset] = wait_for(lambda: (e := raw(napi, f"/api/v1/namespaces/{ns}/endpoints/forever"))["subsets"] and not
                        e["subsets"][0].get("addresses") and e["subsets"], what="the pod among the not ready")
    assert [a["targetRef"]["name"] for a in subset["notReadyAddresses"]] == ["forever"]

    # The unreachable NoSchedule taint keeps new pods off the node, whatever they tolerate of NoExecute.
    core.create_namespaced_pod(ns, {"metadata": {"name": "late"}, "spec": name_server(
        nodeSelector=pinned, tolerations=node_loss_tolerations(None))})
    late = wait_for(lambda: (p := raw(napi, f"/api/v1/namespaces/{ns}/pods/late")).get("status", {}).get(
        "conditions") and p, what="the late pod found unschedulable")
    assert not late["spec"].get("nodeName")
    assert condition(late, "PodScheduled")["message"] == (
        "0/3 nodes are available: 1 node(s) had untolerated taint {node.kubernetes.io/unreachable: }, "
        "2 node(s) didn't match Pod's node affinity/selector.")

    core.patch_node("kubesim-node-2", {"spec": {"taints": [
        *core.read_node("kubesim-node-2").to_dict()["spec"]["taints"],
        {"key": "example.com/drain", "effect": "NoExecute"}]}})
    evicted = wait_for(lambda: (p := raw(napi, f"/api/v1/namespaces/{ns}/pods/forever"))["metadata"].get(
        "deletionTimestamp") and p, what="the untolerated NoExecute taint to evict the pod")
    assert condition(evicted, "DisruptionTarget")["reason"] == "DeletionByTaintManager"


def test_a_recreate_rollout_waits_for_the_pod_terminating_on_a_lost_node(
        nodes_sim: Sim, napi: client.ApiClient, core: client.CoreV1Api, ns: str) -> None:
    """recreate.go oldPodsRunning counts every old pod not Succeeded or Failed, a Terminating one too: a rollout
    of a one-replica Recreate Deployment (the agents') whose old pod is stuck on a lost node runs nothing at all
    until that pod is gone."""
    apps = client.AppsV1Api(napi)
    body = deployment("rec", tolerations=node_loss_tolerations(1), terminationGracePeriodSeconds=5)
    body["spec"]["strategy"] = {"type": "Recreate"}
    apps.create_namespaced_deployment(ns, body)
    [first] = ready_pods(napi, ns, "rec")
    lost = first["spec"]["nodeName"]
    nodes_sim.power_off_node(lost)
    [replacement] = ready_pods(napi, ns, "rec")  # the old ReplicaSet's replacement, elsewhere

    apps.patch_namespaced_deployment("rec", ns, {"spec": {"template": {"metadata": {"annotations": {"v": "2"}}}}})
    wait_for(lambda: [p["metadata"]["name"] for p in pods(napi, ns, "rec")] == [first["metadata"]["name"]],
             what="the replacement scaled away with its old ReplicaSet")
    # The deployment controller's decision: the old ReplicaSet at 0, and no new one while an old pod is running.
    wait_for(lambda: apps.read_namespaced_deployment("rec", ns).status.observed_generation == 2
             and [rs.spec.replicas for rs in apps.list_namespaced_replica_set(ns).items] == [0],
             what="the rollout to wait with no ReplicaSet scaled up")
    assert not apps.read_namespaced_deployment("rec", ns).status.ready_replicas

    nodes_sim.power_on_node(lost)  # the kubelet finishes the old pod; only then does the new one start
    [new] = ready_pods(napi, ns, "rec")
    assert new["metadata"]["name"] not in (first["metadata"]["name"], replacement["metadata"]["name"])


def parse_micro(text: str) -> float:
    return parse_time(text.split(".")[0] + "Z") + float("0." + text.split(".")[1].rstrip("Z"))


# ---- the decisions, table-driven


@pytest.mark.parametrize(("toleration", "taint", "expected"), [
    ({"key": UNREACHABLE, "operator": "Exists", "effect": "NoExecute"}, {"key": UNREACHABLE, "effect": "NoExecute"},
     True),
    ({"key": UNREACHABLE, "operator": "Exists"}, {"key": UNREACHABLE, "effect": "NoSchedule"}, True),
    ({"operator": "Exists"}, {"key": "anything", "value": "x", "effect": "NoExecute"}, True),
    ({"key": "k", "value": "a"}, {"key": "k", "value": "a", "effect": "NoSchedule"}, True),  # Equal by default
    ({"key": "k", "value": "a"}, {"key": "k", "value": "b", "effect": "NoSchedule"}, False),
    ({"key": UNREACHABLE, "operator": "Exists", "effect": "NoSchedule"}, {"key": UNREACHABLE, "effect": "NoExecute"},
     False),
    ({"key": NOT_READY, "operator": "Exists"}, {"key": UNREACHABLE, "effect": "NoExecute"}, False),
])
def test_tolerates_as_kubernetes_toleration_matching(toleration: dict[str, Any], taint: dict[str, Any],
                                                      expected: bool) -> None:
    assert tolerates(toleration, taint) is expected


UNREACHABLE_NO_EXECUTE = {"key": UNREACHABLE, "effect": "NoExecute"}


@pytest.mark.parametrize(("tolerations", "expected"), [
    ([], 0.0),  # not tolerated: at once
    (node_loss_tolerations(30), 30.0),
    (node_loss_tolerations(None), None),  # tolerated for ever
    (node_loss_tolerations(0), 0.0),
    # the first toleration matching the taint is the one that counts (GetMatchingTolerations)
    ([{"operator": "Exists"}, *node_loss_tolerations(30)], None),
    ([*node_loss_tolerations(30), {"operator": "Exists"}], 30.0),
])
def test_eviction_delay_is_the_least_toleration_seconds(tolerations: list[dict[str, Any]],
                                                        expected: float | None) -> None:
    assert eviction_delay([UNREACHABLE_NO_EXECUTE, {"key": UNREACHABLE, "effect": "NoSchedule"}],
                          tolerations) == expected


def test_no_no_execute_taint_means_no_eviction() -> None:
    assert eviction_delay([{"key": UNREACHABLE, "effect": "NoSchedule"}], []) is None


@pytest.mark.parametrize(("tolerations", "added"), [
    ([], [NOT_READY, UNREACHABLE]),
    (node_loss_tolerations(30), []),
    ([{"operator": "Exists"}], []),  # tolerates every taint
    ([{"key": UNREACHABLE, "operator": "Exists", "effect": "NoSchedule"}], [NOT_READY, UNREACHABLE]),
    ([{"key": UNREACHABLE, "operator": "Exists"}], [NOT_READY]),
])
def test_default_toleration_seconds_adds_only_what_the_pod_lacks(tolerations: list[dict[str, Any]],
                                                                  added: list[str]) -> None:
    spec: dict[str, Any] = {"tolerations": list(tolerations)} if tolerations else {}
    default_toleration_seconds(spec)
    new = spec.get("tolerations", [])[len(tolerations):]
    assert [t["key"] for t in new] == added
    assert all(t["tolerationSeconds"] == 300 and t["effect"] == "NoExecute" for t in new)


def test_desired_taints_follow_the_ready_condition_and_keep_their_time_added() -> None:
    other = {"key": "example.com/gpu", "effect": "NoSchedule"}
    unknown = desired_taints([other], "Unknown")
    assert [(t["key"], t["effect"]) for t in unknown] == [
        ("example.com/gpu", "NoSchedule"), (UNREACHABLE, "NoSchedule"), (UNREACHABLE, "NoExecute")]
    stamped = [{**t, "timeAdded": "2020-01-01T00:00:00Z"} if t is not other else t for t in unknown]
    assert desired_taints(stamped, "Unknown") == stamped  # already there: kept as they are
    assert [t["key"] for t in desired_taints(stamped, "False")] == ["example.com/gpu", NOT_READY, NOT_READY]
    assert desired_taints(stamped, "True") == [other]


def test_unknown_status_keeps_the_last_heartbeat() -> None:
    status = {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                              "lastHeartbeatTime": "2020-01-01T00:00:00Z",
                              "lastTransitionTime": "2019-01-01T00:00:00Z"}]}
    [cond] = unknown_status(status)["conditions"]
    assert (cond["status"], cond["reason"], cond["lastHeartbeatTime"]) == (
        "Unknown", "NodeStatusUnknown", "2020-01-01T00:00:00Z")
    assert cond["lastTransitionTime"] != "2019-01-01T00:00:00Z"
    assert status["conditions"][0]["status"] == "True"  # a copy


def node(name: str, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}, "spec": spec}


@pytest.mark.parametrize(("pod_spec", "node_spec", "expected"), [
    ({}, {}, None),
    ({}, {"unschedulable": True}, "node(s) were unschedulable"),
    ({"tolerations": [{"key": "node.kubernetes.io/unschedulable", "operator": "Exists"}]}, {"unschedulable": True},
     None),
    ({}, {"taints": [{"key": UNREACHABLE, "effect": "NoSchedule"}]},
     "node(s) had untolerated taint {node.kubernetes.io/unreachable: }"),
    ({}, {"taints": [{"key": "soft", "effect": "PreferNoSchedule"}]}, None),
    ({"nodeSelector": {"kubernetes.io/hostname": "b"}}, {}, "node(s) didn't match Pod's node affinity/selector"),
    ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["a"]}]}]}}}}, {},
     "node(s) didn't match Pod's node affinity/selector"),
])
def test_why_not_names_the_filter_a_node_fails(pod_spec: dict[str, Any], node_spec: dict[str, Any],
                                               expected: str | None) -> None:
    a = node("a", **node_spec)
    assert why_not({"metadata": {"name": "p", "namespace": "d"}, "spec": pod_spec}, a, {"a": a}, []) == expected


def test_anti_affinity_is_symmetric_and_by_topology_domain() -> None:
    a, b = node("a"), node("b")
    nodes = {"a": a, "b": b}
    term = {"labelSelector": {"matchLabels": {"app": "x"}}, "topologyKey": "kubernetes.io/hostname"}
    with_term = {"metadata": {"name": "old", "namespace": "d", "labels": {"app": "x"}},
                 "spec": {"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}}}
    plain = {"metadata": {"name": "new", "namespace": "d", "labels": {"app": "x"}}, "spec": {}}
    assert why_not(plain, a, nodes, [(with_term, "a")]) == "node(s) didn't match pod anti-affinity rules"
    assert why_not(plain, b, nodes, [(with_term, "a")]) is None
    elsewhere = {**plain, "metadata": {**plain["metadata"], "namespace": "other"}}
    assert why_not(elsewhere, a, nodes, [(with_term, "a")]) is None  # the term names its own namespace


def test_the_least_loaded_node_wins_and_ties_go_by_name() -> None:
    assert pick(["c", "b", "a"], {"a": 2, "b": 1, "c": 1}) == "b"
    assert pick(["b", "a"], {}) == "a"
    assert unschedulable_message(3, ["x y", "a b", "x y"]) == "0/3 nodes are available: 1 a b, 2 x y."


def test_kubesim_refuses_no_nodes(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="exited early"):
        start_sim(tmp_path, "--nodes", "0")
