"""kube-controller-manager's node lifecycle controller: a node whose kubelet falls silent is given up on.

As pkg/controller/nodelifecycle/node_lifecycle_controller.go does it:
- a node's health is heard from its kubelet's two heartbeats, its Lease's renewTime and its Ready condition's
  lastHeartbeatTime; the controller notes when (on its own clock) either last changed (tryUpdateNodeHealth's
  probeTimestamp);
- when neither changed for the node monitor grace period (--node-monitor-grace-period, 40 s by default; kubesim's
  flag of the same name), the Ready condition becomes Unknown, reason NodeStatusUnknown, "Kubelet stopped posting
  node status.", its lastHeartbeatTime left at the last one heard;
- the Ready condition is mirrored into taints: Unknown gives node.kubernetes.io/unreachable, False gives
  node.kubernetes.io/not-ready, each with effect NoSchedule (doNoScheduleTaintingPass, so the scheduler places
  nothing new there) and NoExecute (doNoExecuteTaintingPass, UnreachableTaintTemplate / NotReadyTaintTemplate: the
  taint eviction controller, kubesim/tainteviction.py, evicts what does not tolerate them), every taint stamped
  with timeAdded (SwapNodeControllerTaint); a node Ready again loses them;
- the pods bound to a node that is not Ready get their Ready condition set to False (MarkPodsNotReady in
  pkg/controller/util/node/controller_utils.go), which takes them out of their Services' ready endpoints.

What it checks it checks at once, where the real one looks every --node-monitor-period (5 s): a node turns Unknown
from the grace period on, up to 5 s sooner than it would in a cluster. Zones, their disruption states and the rate
limits on tainting many nodes at once are not simulated: a cluster of a few nodes is one zone.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable
from typing import Any

from .loop import ControlLoop
from .nodes import LEASE_NAMESPACE
from .objects import clone, now, set_condition
from .store import DELETED, Event, Store
from .tolerations import NO_EXECUTE, NO_SCHEDULE, NOT_READY, UNREACHABLE

Obj = dict[str, Any]

MANAGER = "node-controller"
# The taint the Ready condition calls for (nodeConditionToTaintKeyStatusMap).
TAINT_OF_READY = {"False": NOT_READY, "Unknown": UNREACHABLE}


def ready_condition(node: Obj) -> Obj:
    return next((c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), {})


def heartbeat(node: Obj, lease: Obj | None) -> tuple[str, str]:
    """What changes whenever the node's kubelet is heard from: its Ready condition's lastHeartbeatTime and its
    Lease's renewTime."""
    return (str(ready_condition(node).get("lastHeartbeatTime") or ""),
            str(((lease or {}).get("spec") or {}).get("renewTime") or ""))


def unknown_status(status: Obj) -> Obj:
    """The node status once its kubelet is given up on: every condition Unknown (NodeStatusUnknown), each keeping
    the last heartbeat heard; lastTransitionTime now."""
    out = clone(status)
    at = now()
    for cond in out.get("conditions") or []:
        if cond.get("status") != "Unknown":
            cond.update(status="Unknown", reason="NodeStatusUnknown", message="Kubelet stopped posting node status.",
                        lastTransitionTime=at)
    return out


def desired_taints(taints: list[Obj], ready: str) -> list[Obj]:
    """The node's taints with the controller's own set for this Ready status: those of other keys kept in their
    order; the not-ready or unreachable taints kept if already there (with their timeAdded), added if not."""
    wanted_key = TAINT_OF_READY.get(ready)
    out = [t for t in taints if t.get("key") not in (NOT_READY, UNREACHABLE)
           or (t.get("key") == wanted_key and t.get("effect") in (NO_SCHEDULE, NO_EXECUTE))]
    if wanted_key is not None:
        for effect in (NO_SCHEDULE, NO_EXECUTE):
            if not any(t.get("key") == wanted_key and t.get("effect") == effect for t in out):
                out.append({"key": wanted_key, "effect": effect, "timeAdded": now()})
    return out


class NodeLifecycleController(ControlLoop):
    name = "node-lifecycle-controller"
    kinds = ("/nodes", "coordination.k8s.io/leases", "/pods")

    def __init__(self, store: Store, grace_period: float) -> None:
        super().__init__(store, workers=1)
        self.grace_period = grace_period
        self._probed: dict[str, tuple[tuple[str, str], float]] = {}  # node -> (heartbeat, when it last changed)
        self._not_ready: set[str] = set()  # nodes whose pods are to be marked not ready

    def keys_for(self, event: Event) -> Iterable[Hashable]:
        meta = event.obj["metadata"]
        if event.rtype.key == "/nodes":
            return [("node", meta["name"])]
        if event.rtype.key != "/pods":
            return [("node", meta["name"])] if meta.get("namespace") == LEASE_NAMESPACE else []
        node = (event.obj.get("spec") or {}).get("nodeName")
        if event.type == DELETED or node not in self._not_ready:
            return []
        return [("pod", meta.get("namespace", ""), meta["name"])]

    def sync(self, key: Hashable) -> float | None:
        assert isinstance(key, tuple)
        if key[0] == "pod":
            pod = self.store.find(self.store.type("/pods"), key[1], key[2])
            if pod is not None and pod["spec"].get("nodeName") in self._not_ready:
                self._mark_not_ready(pod)
            return None
        return self._sync_node(key[1])

    def _sync_node(self, name: str) -> float | None:
        store = self.store
        node_type = store.type("/nodes")
        node = store.find(node_type, "", name)
        if node is None:
            self._probed.pop(name, None)
            self._not_ready.discard(name)
            return None
        lease = store.find(store.type("coordination.k8s.io/leases"), LEASE_NAMESPACE, name)
        heard = heartbeat(node, lease)
        at = time.monotonic()
        probed = self._probed.get(name)
        if probed is None or probed[0] != heard:
            probed = self._probed[name] = (heard, at)
        silent_for = at - probed[1]
        if silent_for >= self.grace_period and ready_condition(node).get("status") != "Unknown":
            node = store.mutate(node_type, "", name, lambda obj: obj.update(status=unknown_status(obj["status"])),
                                subresource="status", manager=MANAGER) or node
        ready = str(ready_condition(node).get("status") or "Unknown")
        taints = list((node.get("spec") or {}).get("taints") or [])
        wanted = desired_taints(taints, ready)
        if wanted != taints:
            store.mutate(node_type, "", name, lambda obj: _set_taints(obj, wanted), manager=MANAGER, only="spec")
        if ready == "True":
            self._not_ready.discard(name)
        else:
            self._not_ready.add(name)
            pods, _ = store.list(store.type("/pods"), fields_=lambda pod: pod["spec"].get("nodeName") == name)
            for pod in pods:
                self._mark_not_ready(pod)
        return None if ready == "Unknown" else max(0.0, self.grace_period - silent_for)

    def _mark_not_ready(self, pod: Obj) -> None:
        if not _ready(pod):
            return

        def change(obj: Obj) -> bool:
            if not _ready(obj):
                return False
            obj["status"]["conditions"] = set_condition(obj["status"]["conditions"], "Ready", "False")
            return True

        self.store.mutate(self.store.type("/pods"), pod["metadata"].get("namespace", ""), pod["metadata"]["name"],
                          change, subresource="status", manager=MANAGER)


def _set_taints(node: Obj, taints: list[Obj]) -> None:
    spec = node.setdefault("spec", {})
    if taints:
        spec["taints"] = taints
    else:
        spec.pop("taints", None)  # omitempty: a node without taints has none listed


def _ready(pod: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def install(cluster: Any) -> None:
    cluster.add_component(NodeLifecycleController(cluster.store, cluster.config.node_monitor_grace_period))
