"""The cluster's nodes as their kubelets keep them alive: registration, heartbeats, and a node's loss.

`--nodes N` registers N nodes: `kubesim-node`, then `kubesim-node-2` ... `kubesim-node-N` (one node by default,
as kubesim always had). Each carries the labels a kubelet sets on its own Node (kubernetes.io/hostname, os, arch)
and the Ready condition and addresses it reports. Every node shares the host's address: pods bind their own Pod IPs
on loopback whichever node runs them.

A kubelet proves it is alive in two ways, and the node lifecycle controller (kubesim/nodelifecycle.py) listens to
both: it renews its Lease in kube-node-lease (named after the node, held by it, leaseDurationSeconds 40, renewed
every quarter of that: pkg/kubelet/nodelease, component-helpers/apimachinery/lease/controller.go) and it posts its
node status, whose Ready condition's lastHeartbeatTime moves with each post (pkg/kubelet/kubelet_node_status.go;
an unchanged status is posted every nodeStatusReportFrequency, 5 minutes, a changed one at once). With a node
monitor grace period shorter than 40 s the Lease is renewed every quarter of that period instead, so that the
ratio stays Kubernetes' (a grace period of four renewals).

`power_off(name)` is a node that loses power: its kubelet stops renewing and posting, and (kubesim/kubelet.py)
its pods' processes are killed with nothing reported about them. `power_on(name)` boots it again: the kubelet
posts Ready at once, renews its Lease, and restarts or finishes the pods the API server still binds to it.
"""

from __future__ import annotations

import datetime
import logging
import platform
import threading
import time
from typing import Any

from .objects import now
from .server import KUBE_VERSION

log = logging.getLogger(__name__)

Obj = dict[str, Any]

NODE_NAME = "kubesim-node"  # the first node, and the only one by default
HOST_IP = "127.0.0.1"
LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION = 40  # the kubelet's nodeLeaseDurationSeconds
RENEW_FRACTION = 0.25  # the lease controller renews every quarter of the lease's duration (10 s)
STATUS_REPORT_SECONDS = 300.0  # nodeStatusReportFrequency: an unchanged status is posted this often


def node_names(count: int) -> list[str]:
    """The names of `count` nodes: kubesim-node, kubesim-node-2, ..."""
    return [NODE_NAME] + [f"{NODE_NAME}-{i}" for i in range(2, count + 1)]


def micro_now() -> str:
    """metav1.MicroTime as it serialises: RFC 3339 with microseconds (a Lease's renewTime)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def ready_status(name: str, at: str, previous: Obj | None = None) -> Obj:
    """The node status its kubelet posts: Ready True (lastTransitionTime kept while it stays True), its address and
    what it runs."""
    old = next((c for c in (previous or {}).get("conditions") or [] if c.get("type") == "Ready"), None)
    since = old["lastTransitionTime"] if old and old.get("status") == "True" else at
    return {
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                        "message": "kubelet is posting ready status", "lastHeartbeatTime": at,
                        "lastTransitionTime": since}],
        "addresses": [{"type": "InternalIP", "address": HOST_IP}, {"type": "Hostname", "address": name}],
        "nodeInfo": {"kubeletVersion": KUBE_VERSION["gitVersion"], "kubeProxyVersion": "", "osImage": "kubesim",
                     "kernelVersion": platform.release(), "containerRuntimeVersion": "process://kubesim",
                     "operatingSystem": "linux", "architecture": "amd64", "machineID": "", "systemUUID": "",
                     "bootID": ""},
    }


def renew_interval(grace_period: float) -> float:
    return min(LEASE_DURATION * RENEW_FRACTION, grace_period * RENEW_FRACTION)


class Nodes:
    """The nodes' kubelets' heartbeats (one thread for all of them), and which nodes have power."""

    def __init__(self, cluster: Any) -> None:
        self.store = cluster.store
        self.names = node_names(cluster.config.nodes)
        self.interval = renew_interval(cluster.config.node_monitor_grace_period)
        self.down: set[str] = set()
        self.writes = 0  # the kubelets' heartbeat writes (Leases, Node statuses): what a write count should leave out
        self._posted: dict[str, float] = {}  # node -> when its kubelet last posted its status (monotonic)
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Each kubelet registers its Node, posts its status and takes its Lease, then keeps beating (once the
        cluster's namespaces exist: Cluster._bootstrap)."""
        for name in self.names:
            self.store.create(self.store.type("/nodes"), {"metadata": {"name": name, "labels": {
                "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}}},
                manager="kubelet")
            self._beat(name)
        self._thread = threading.Thread(target=self._run, name="node-heartbeats", daemon=True)
        self._thread.start()

    def up(self, name: str) -> bool:
        with self._lock:
            return name in self.names and name not in self.down

    def report(self) -> Obj:
        """What kubesim's admin API says of its nodes: each one's power, and the heartbeat writes so far."""
        with self._lock:
            return {"items": [{"name": n, "powered": n not in self.down} for n in self.names],
                    "heartbeatWrites": self.writes}

    def power_off(self, name: str) -> None:
        self._known(name)
        with self._lock:
            self.down.add(name)
        log.info("nodes: %s lost power: its kubelet no longer renews its Lease or posts its status", name)

    def power_on(self, name: str) -> None:
        self._known(name)
        with self._lock:
            self.down.discard(name)
            self._posted.pop(name, None)  # a kubelet that starts posts its status at once
        log.info("nodes: %s is powered on", name)
        self._wake.set()

    def _known(self, name: str) -> None:
        if name not in self.names:
            raise KeyError(f"no node {name!r} (nodes: {', '.join(self.names)})")

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stopping:
            for name in self.names:
                if self.up(name):
                    try:
                        self._beat(name)
                    except Exception:
                        log.exception("nodes: heartbeat of %s failed", name)
            self._wake.wait(self.interval)
            self._wake.clear()

    def _beat(self, name: str) -> None:
        """Renew the node's Lease; post its status when it is due or is not Ready as the kubelet sees it."""
        store = self.store
        lease_type = store.type("coordination.k8s.io/leases")
        renewed = micro_now()
        if store.find(lease_type, LEASE_NAMESPACE, name) is None:
            node = store.get(store.type("/nodes"), "", name)
            store.create(lease_type, {"metadata": {"name": name, "namespace": LEASE_NAMESPACE, "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node["metadata"]["uid"]}]},
                "spec": {"holderIdentity": name, "leaseDurationSeconds": LEASE_DURATION, "renewTime": renewed}},
                namespace=LEASE_NAMESPACE, manager="kubelet")
        else:
            store.mutate(lease_type, LEASE_NAMESPACE, name, lambda lease: lease["spec"].update(renewTime=renewed),
                         manager="kubelet", only="spec")
        self.writes += 1
        at = time.monotonic()
        node = store.get(store.type("/nodes"), "", name)
        ready: Obj = next((c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"),
                          {})
        due = self._posted.get(name, -STATUS_REPORT_SECONDS) + STATUS_REPORT_SECONDS <= at
        if due or ready.get("status") != "True":
            store.mutate(store.type("/nodes"), "", name,
                         lambda obj: obj.update(status=ready_status(name, now(), obj.get("status"))),
                         subresource="status", manager="kubelet")
            self._posted[name] = at
            self.writes += 1


def install(cluster: Any) -> None:
    """The nodes, started by the cluster's bootstrap (their Leases live in a namespace it creates)."""
    cluster.nodes = Nodes(cluster)
