"""kube-scheduler: every pod without a node is bound to one, one pod at a time.

The filters are those of the default profile that a pod here can meet (pkg/scheduler/framework/plugins):
- NodeUnschedulable: a cordoned node (spec.unschedulable) only for pods tolerating node.kubernetes.io/unschedulable;
- NodeAffinity: the pod's nodeSelector, and its requiredDuringSchedulingIgnoredDuringExecution node affinity
  (nodeSelectorTerms ORed, a term's matchExpressions and matchFields ANDed: In, NotIn, Exists, DoesNotExist);
- TaintToleration: every NoSchedule and NoExecute taint of the node tolerated (so a node the node lifecycle
  controller tainted unreachable or not-ready gets nothing new; PreferNoSchedule does not filter);
- InterPodAffinity, anti-affinity: no pod matching one of the pod's requiredDuringScheduling podAntiAffinity terms
  runs in the same topology domain (the nodes sharing the term's topologyKey label value, e.g. one node for
  kubernetes.io/hostname), and the pod matches no such term of a pod already there (the rule is symmetric). Every
  pod bound to a node counts, Terminating ones too: the scheduler's cache keeps a pod until it is deleted.
Of the nodes that pass, the one running the fewest pods wins, ties going to the first by name: where kube-scheduler
would score (NodeResourcesFit's LeastAllocated over default requests, PodTopologySpread's system defaults) and pick
at random among the best, kubesim spreads alike and stays deterministic.

A pod no node passes gets PodScheduled False, reason Unschedulable, with the scheduler's message ("0/3 nodes are
available: 1 node(s) had untolerated taint {node.kubernetes.io/unreachable: }, 2 node(s) didn't match pod
anti-affinity rules.") and is tried again when a node changes or a pod goes, as the scheduling queue moves
unschedulable pods back on cluster events. Pod affinity (as opposed to anti-affinity), preferred terms, resources
and topology spread constraints are not simulated.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Hashable, Iterable
from typing import Any

from .loop import ControlLoop
from .objects import set_condition
from .store import DELETED, Event, Store
from .tolerations import NO_EXECUTE, NO_SCHEDULE, UNSCHEDULABLE, untolerated
from .workloads import selector_matches

Obj = dict[str, Any]

SCHEDULER_NAME = "default-scheduler"
PodKey = tuple[str, str]


# ---- pure decisions


def matches_expression(labels: Obj, expr: Obj) -> bool:
    key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    return False  # Gt and Lt compare numbers: not simulated


def node_affinity_fits(pod_spec: Obj, node: Obj) -> bool:
    """NodeAffinity: nodeSelector, and required node affinity (its terms ORed, an empty list matching nothing)."""
    labels = node["metadata"].get("labels") or {}
    if any(labels.get(k) != v for k, v in (pod_spec.get("nodeSelector") or {}).items()):
        return False
    required = ((pod_spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution")
    if not required:
        return True
    fields = {"metadata.name": node["metadata"]["name"]}
    return any((term.get("matchExpressions") or term.get("matchFields"))
               and all(matches_expression(labels, e) for e in term.get("matchExpressions") or [])
               and all(matches_expression(fields, e) for e in term.get("matchFields") or [])
               for term in required.get("nodeSelectorTerms") or [])


def anti_affinity_terms(pod: Obj) -> list[Obj]:
    return list((((pod.get("spec") or {}).get("affinity") or {}).get("podAntiAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution") or [])


def term_selects(term: Obj, owner: Obj, other: Obj) -> bool:
    """Whether `other` is what `owner`'s pod (anti-)affinity term names: in the term's namespaces (by default the
    owner's own) and matching its labelSelector."""
    namespaces = term.get("namespaces") or [owner["metadata"].get("namespace", "")]
    if other["metadata"].get("namespace", "") not in namespaces:
        return False
    return selector_matches(term.get("labelSelector"), other["metadata"].get("labels") or {})


def anti_affinity_fits(pod: Obj, node: Obj, nodes: dict[str, Obj], placed: Iterable[tuple[Obj, str]]) -> bool:
    """InterPodAffinity's required anti-affinity, both ways, against the pods `placed` on `nodes`."""
    own = anti_affinity_terms(pod)
    labels = node["metadata"].get("labels") or {}
    for other, other_node in placed:
        where = (nodes.get(other_node) or {}).get("metadata", {}).get("labels") or {}
        for term in own:
            key = term.get("topologyKey", "")
            if key in labels and where.get(key) == labels[key] and term_selects(term, pod, other):
                return False
        for term in anti_affinity_terms(other):
            key = term.get("topologyKey", "")
            if key in labels and where.get(key) == labels[key] and term_selects(term, other, pod):
                return False
    return True


def why_not(pod: Obj, node: Obj, nodes: dict[str, Obj], placed: list[tuple[Obj, str]]) -> str | None:
    """The filter `node` fails for `pod`, in the words of kube-scheduler's status message; None when it fits."""
    spec = pod.get("spec") or {}
    tolerations = spec.get("tolerations") or []
    node_spec = node.get("spec") or {}
    if node_spec.get("unschedulable") and untolerated(
            [{"key": UNSCHEDULABLE, "effect": NO_SCHEDULE}], tolerations, (NO_SCHEDULE,)):
        return "node(s) were unschedulable"
    if not node_affinity_fits(spec, node):
        return "node(s) didn't match Pod's node affinity/selector"
    taint = untolerated(node_spec.get("taints") or [], tolerations, (NO_SCHEDULE, NO_EXECUTE))
    if taint is not None:
        return f"node(s) had untolerated taint {{{taint.get('key', '')}: {taint.get('value', '')}}}"
    if not anti_affinity_fits(pod, node, nodes, placed):
        return "node(s) didn't match pod anti-affinity rules"
    return None


def unschedulable_message(total: int, reasons: list[str]) -> str:
    """FitError.Error: each reason with its count of nodes, the strings sorted (so by count first)."""
    counted = sorted(f"{n} {why}" for why, n in Counter(reasons).items())
    return f"0/{total} nodes are available: " + ", ".join(counted) + "."


def pick(candidates: list[str], load: dict[str, int]) -> str:
    """The node with the fewest pods, the first by name among equals."""
    return min(sorted(candidates), key=lambda name: load.get(name, 0))


# ---- the scheduler


class Scheduler(ControlLoop):
    name = SCHEDULER_NAME
    kinds = ("/pods", "/nodes")

    def __init__(self, store: Store) -> None:
        super().__init__(store, workers=1)  # one pod at a time: each decision sees the last one's binding
        # Kept from events: the pods bound to each node (any phase but finished), the bound pods that carry
        # anti-affinity terms, and the pods found unschedulable, looked at again when something changes.
        self._placed: dict[PodKey, str] = {}
        self._load: Counter[str] = Counter()
        self._with_terms: dict[PodKey, str] = {}
        self._unschedulable: set[PodKey] = set()
        self._lock = threading.Lock()

    def keys_for(self, event: Event) -> Iterable[Hashable]:
        with self._lock:
            if event.rtype.key == "/nodes":
                return list(self._unschedulable)
            meta, spec = event.obj["metadata"], event.obj.get("spec") or {}
            key = (meta.get("namespace", ""), meta["name"])
            node = spec.get("nodeName") or ""
            finished = (event.obj.get("status") or {}).get("phase") in ("Succeeded", "Failed")
            was = self._placed.pop(key, None)
            if was is not None:
                self._load[was] -= 1
            self._with_terms.pop(key, None)
            if event.type == DELETED:
                self._unschedulable.discard(key)
                return list(self._unschedulable)  # a pod gone may make room
            if node and not finished:
                self._placed[key] = node
                self._load[node] += 1
                if anti_affinity_terms(event.obj):
                    self._with_terms[key] = node
            if node or meta.get("deletionTimestamp") or spec.get("schedulerName", SCHEDULER_NAME) != SCHEDULER_NAME:
                return []
            return [key]

    def sync(self, key: Hashable) -> float | None:
        assert isinstance(key, tuple)
        store = self.store
        pod_type = store.type("/pods")
        pod = store.find(pod_type, key[0], key[1])
        if pod is None or pod["spec"].get("nodeName") or pod["metadata"].get("deletionTimestamp"):
            with self._lock:
                self._unschedulable.discard(key)
            return None
        nodes = {n["metadata"]["name"]: n for n in store.list(store.type("/nodes"))[0]}
        placed = self._placed_pods(pod)
        reasons: dict[str, str] = {}
        for name, node in nodes.items():
            reason = why_not(pod, node, nodes, placed)
            if reason is not None:
                reasons[name] = reason
        candidates = [name for name in nodes if name not in reasons]
        if not candidates:
            self._unschedulable_now(pod, unschedulable_message(len(nodes), list(reasons.values())))
            return None
        with self._lock:
            self._unschedulable.discard(key)
            target = pick(candidates, self._load)
        uid = pod["metadata"]["uid"]

        def bind(obj: Obj) -> bool:
            if obj["metadata"]["uid"] != uid or obj["spec"].get("nodeName"):
                return False
            obj["spec"]["nodeName"] = target
            return True

        store.mutate(pod_type, key[0], key[1], bind, manager=SCHEDULER_NAME, only="spec")
        return None

    def _placed_pods(self, pod: Obj) -> list[tuple[Obj, str]]:
        """The bound pods the anti-affinity filter must look at: all of them when the pod has terms of its own,
        else only those with terms (which might exclude it)."""
        with self._lock:
            keys = dict(self._placed) if anti_affinity_terms(pod) else dict(self._with_terms)
        pod_type = self.store.type("/pods")
        found = ((self.store.find(pod_type, ns, name), node) for (ns, name), node in keys.items())
        return [(other, node) for other, node in found if other is not None]

    def _unschedulable_now(self, pod: Obj, message: str) -> None:
        key = (pod["metadata"].get("namespace", ""), pod["metadata"]["name"])
        with self._lock:
            self._unschedulable.add(key)
        uid = pod["metadata"]["uid"]

        def change(obj: Obj) -> bool:
            if obj["metadata"]["uid"] != uid:
                return False
            status = obj.setdefault("status", {})
            conditions = set_condition(status.get("conditions") or [], "PodScheduled", "False", "Unschedulable",
                                       message, lastProbeTime=None)
            if conditions == status.get("conditions"):
                return False
            status["conditions"] = conditions
            return True

        self.store.mutate(self.store.type("/pods"), key[0], key[1], change, subresource="status",
                          manager=SCHEDULER_NAME)


def install(cluster: Any) -> None:
    cluster.add_component(Scheduler(cluster.store))
