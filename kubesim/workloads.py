"""kube-controller-manager's Deployment and ReplicaSet controllers.

Faithful where clients look (names, labels, annotations, status fields, condition types and reasons, the
rolling-update arithmetic of pkg/controller/deployment), simpler where nobody can tell: the store is the
informer cache, so no expectations are needed, and a ReplicaSet does not adopt orphaned pods.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Hashable, Iterable
from typing import Any

from . import errors
from .loop import ControlLoop, status_only
from .objects import clone, now, parse_time, set_condition
from .store import DELETED, Event, Store

Obj = dict[str, Any]

HASH_LABEL = "pod-template-hash"
REVISION = "deployment.kubernetes.io/revision"
DESIRED_REPLICAS = "deployment.kubernetes.io/desired-replicas"
MAX_REPLICAS = "deployment.kubernetes.io/max-replicas"
# Deployment annotations not copied to its ReplicaSets (deployment/util skipCopyAnnotation).
_NOT_COPIED = frozenset({"kubectl.kubernetes.io/last-applied-configuration", REVISION, "deployment.kubernetes.io/"
                         "revision-history", DESIRED_REPLICAS, MAX_REPLICAS, "deprecated.deployment.rollback.to"})
_SAFE_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # apimachinery rand.SafeEncodeString: no vowels, no look-alikes
BURST = 500  # pods a ReplicaSet creates or deletes per sync, as the real controller's burstReplicas


# ---- pure decisions


def scaled_value(value: Any, total: int, round_up: bool) -> int:
    """intstr.GetScaledValueFromIntOrPercent: an int, or a percentage of `total` rounded up or down."""
    if isinstance(value, int):
        return value
    text = str(value)
    if not text.endswith("%"):
        return int(text)
    exact = int(text[:-1]) * total / 100
    return math.ceil(exact) if round_up else math.floor(exact)


def fenceposts(strategy: Obj, desired: int) -> tuple[int, int]:
    """(maxSurge, maxUnavailable) as numbers; both zero would block a rollout, so unavailable becomes 1."""
    if strategy.get("type") != "RollingUpdate":
        return 0, 0
    rolling = strategy.get("rollingUpdate") or {}
    surge = scaled_value(rolling.get("maxSurge", "25%"), desired, True)
    unavailable = scaled_value(rolling.get("maxUnavailable", "25%"), desired, False)
    if surge == 0 and unavailable == 0:
        unavailable = 1
    return surge, unavailable


def max_unavailable(deployment: Obj) -> int:
    """deployment/util MaxUnavailable: never more than the desired replicas; 0 for Recreate."""
    spec = deployment["spec"]
    desired = int(spec.get("replicas", 1))
    if spec.get("strategy", {}).get("type") != "RollingUpdate" or desired == 0:
        return 0
    return min(fenceposts(spec["strategy"], desired)[1], desired)


def new_rs_replicas(desired: int, max_surge: int, all_replicas: int, new_replicas: int) -> int:
    """NewRSNewReplicas for RollingUpdate: grow the new ReplicaSet as far as the surge allows."""
    max_total = desired + max_surge
    if all_replicas >= max_total:
        return new_replicas
    return new_replicas + min(max_total - all_replicas, desired - new_replicas)


def old_scale_down_budget(desired: int, max_unavail: int, all_replicas: int, new_replicas: int,
                          new_available: int) -> int:
    """reconcileOldReplicaSets' maxScaledDown: how many old pods may go without breaking availability."""
    min_available = desired - max_unavail
    new_unavailable = new_replicas - new_available
    return all_replicas - min_available - new_unavailable


def template_hash(template: Obj, collision_count: int = 0) -> str:
    """pod-template-hash: FNV-1a (32 bit) of the template (and the collision count), safe-encoded."""
    data = json.dumps(_without_hash(template), sort_keys=True, separators=(",", ":")).encode()
    if collision_count:
        data += str(collision_count).encode()
    value = 0x811C9DC5
    for byte in data:
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return "".join(_SAFE_CHARS[ord(c) % len(_SAFE_CHARS)] for c in str(value))


def _without_hash(template: Obj) -> Obj:
    """A view of the template without the pod-template-hash label (shallow: for comparing, not for editing)."""
    meta = template.get("metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("labels"), dict) or HASH_LABEL not in meta["labels"]:
        return template
    labels = {k: v for k, v in meta["labels"].items() if k != HASH_LABEL}
    return {**template, "metadata": {**meta, "labels": labels}}


def templates_equal(a: Obj, b: Obj) -> bool:
    """EqualIgnoreHash: pod templates equal but for the pod-template-hash label."""
    return _without_hash(a) == _without_hash(b)


def selector_matches(selector: Obj | None, labels: Obj) -> bool:
    """A metav1.LabelSelector (matchLabels and matchExpressions) against a label map."""
    if not selector:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def pod_active(pod: Obj) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and (pod.get("status") or {}).get("phase") not in (
        "Succeeded", "Failed")


def _ready_since(pod: Obj) -> float | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready" and cond.get("status") == "True":
            try:
                return parse_time(cond.get("lastTransitionTime") or now())
            except ValueError:
                return time.time()
    return None


def pod_available(pod: Obj, min_ready_seconds: int, at: float) -> bool:
    since = _ready_since(pod)
    return since is not None and (min_ready_seconds <= 0 or since + min_ready_seconds <= at)


def deletion_rank(pod: Obj) -> tuple[Any, ...]:
    """controller.ActivePods ordering: the pod to delete first sorts first."""
    status = pod.get("status") or {}
    phase_rank = {"Pending": 0, "Unknown": 1, "Running": 2}.get(status.get("phase", "Pending"), 0)
    since = _ready_since(pod)
    restarts = sum(int(c.get("restartCount", 0)) for c in status.get("containerStatuses") or [])
    created = pod["metadata"].get("creationTimestamp", "")
    return (bool((pod.get("spec") or {}).get("nodeName")), phase_rank, since is not None,
            -(since or 0.0), -restarts, _reverse(created))


def _reverse(text: str) -> tuple[int, ...]:
    return tuple(-ord(c) for c in text)


def owner_ref(owner: Obj, kind: str, api_version: str) -> Obj:
    return {"apiVersion": api_version, "kind": kind, "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def controller_of(obj: Obj) -> Obj | None:
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("controller"):
            return dict(ref)
    return None


def revision_of(rs: Obj) -> int:
    try:
        return int((rs["metadata"].get("annotations") or {}).get(REVISION, "0"))
    except ValueError:
        return 0


def desired_replicaset(deployment: Obj, pod_hash: str, replicas: int, revision: int) -> Obj:
    """The ReplicaSet a Deployment's current template becomes: `<deployment>-<pod-template-hash>`."""
    meta, spec = deployment["metadata"], deployment["spec"]
    template = clone(spec["template"])
    template.setdefault("metadata", {}).setdefault("labels", {})[HASH_LABEL] = pod_hash
    selector = clone(spec["selector"])
    selector.setdefault("matchLabels", {})[HASH_LABEL] = pod_hash
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k not in _NOT_COPIED}
    max_surge = fenceposts(spec.get("strategy") or {}, int(spec.get("replicas", 1)))[0]
    annotations.update({REVISION: str(revision), DESIRED_REPLICAS: str(spec.get("replicas", 1)),
                        MAX_REPLICAS: str(int(spec.get("replicas", 1)) + max_surge)})
    rs: Obj = {
        "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {"name": f"{meta['name']}-{pod_hash}", "namespace": meta.get("namespace", ""),
                     "labels": dict(template["metadata"]["labels"]), "annotations": annotations,
                     "ownerReferences": [owner_ref(deployment, "Deployment", "apps/v1")]},
        "spec": {"replicas": replicas, "selector": selector, "template": template},
    }
    if spec.get("minReadySeconds"):
        rs["spec"]["minReadySeconds"] = spec["minReadySeconds"]
    return rs


def replicaset_status(rs: Obj, pods: Iterable[Obj], at: float) -> Obj:
    """ReplicaSet status from its active pods."""
    template_labels = ((rs["spec"].get("template") or {}).get("metadata") or {}).get("labels") or {}
    min_ready = int(rs["spec"].get("minReadySeconds") or 0)
    active = [p for p in pods if pod_active(p)]
    status: Obj = {
        "replicas": len(active),
        "fullyLabeledReplicas": sum(1 for p in active if all(
            (p["metadata"].get("labels") or {}).get(k) == v for k, v in template_labels.items())),
        "readyReplicas": sum(1 for p in active if _ready_since(p) is not None),
        "availableReplicas": sum(1 for p in active if pod_available(p, min_ready, at)),
        "observedGeneration": rs["metadata"].get("generation", 1),
    }
    # Only `replicas` is always present in apps/v1 ReplicaSetStatus; the other counts are omitempty.
    status = {k: v for k, v in status.items() if k == "replicas" or v != 0}
    if "conditions" in (rs.get("status") or {}):
        status["conditions"] = rs["status"]["conditions"]
    return status


def deployment_counts(deployment: Obj, all_rss: list[Obj], new_rs: Obj | None) -> Obj:
    """The replica counts of a Deployment's status (calculateStatus)."""
    available = sum(int((rs.get("status") or {}).get("availableReplicas", 0)) for rs in all_rss)
    desired = int(deployment["spec"].get("replicas", 1))
    return {
        "observedGeneration": deployment["metadata"].get("generation", 1),
        "replicas": sum(int((rs.get("status") or {}).get("replicas", 0)) for rs in all_rss),
        "updatedReplicas": int(((new_rs or {}).get("status") or {}).get("replicas", 0)),
        "readyReplicas": sum(int((rs.get("status") or {}).get("readyReplicas", 0)) for rs in all_rss),
        "availableReplicas": available,
        "unavailableReplicas": max(0, desired - available),
    }


def rollout_complete(deployment: Obj, counts: Obj) -> bool:
    desired = int(deployment["spec"].get("replicas", 1))
    return (counts["updatedReplicas"] == desired and counts["replicas"] == desired
            and counts["availableReplicas"] == desired
            and counts["observedGeneration"] >= deployment["metadata"].get("generation", 1))


def made_progress(old: Obj, new: Obj) -> bool:
    """DeploymentProgressing: more updated, ready or available pods, or fewer old ones."""
    old_old = int(old.get("replicas", 0)) - int(old.get("updatedReplicas", 0))
    new_old = int(new.get("replicas", 0)) - int(new.get("updatedReplicas", 0))
    return (new["updatedReplicas"] > int(old.get("updatedReplicas", 0)) or new_old < old_old
            or new["readyReplicas"] > int(old.get("readyReplicas", 0))
            or new["availableReplicas"] > int(old.get("availableReplicas", 0)))


def deployment_conditions(deployment: Obj, counts: Obj, new_rs: Obj | None, at: float) -> list[Obj]:
    """Available and Progressing, with the reasons and messages of the Deployment controller."""
    old_status = deployment.get("status") or {}
    conditions = list(old_status.get("conditions") or [])
    desired = int(deployment["spec"].get("replicas", 1))
    if counts["availableReplicas"] >= desired - max_unavailable(deployment):
        conditions = set_condition(conditions, "Available", "True", "MinimumReplicasAvailable",
                                   "Deployment has minimum availability.", lastUpdateTime=now())
    else:
        conditions = set_condition(conditions, "Available", "False", "MinimumReplicasUnavailable",
                                   "Deployment does not have minimum availability.", lastUpdateTime=now())
    conditions = _keep_update_time(old_status.get("conditions") or [], conditions, "Available")
    rs_name = (new_rs or {}).get("metadata", {}).get("name", "")
    progressing = next((c for c in conditions if c.get("type") == "Progressing"), None)
    if deployment["spec"].get("paused"):
        if not progressing or progressing.get("reason") != "DeploymentPaused":
            conditions = set_condition(conditions, "Progressing", "Unknown", "DeploymentPaused",
                                       "Deployment is paused", lastUpdateTime=now())
        return conditions
    if rollout_complete(deployment, counts):
        if not progressing or progressing.get("reason") != "NewReplicaSetAvailable":
            conditions = set_condition(conditions, "Progressing", "True", "NewReplicaSetAvailable",
                                       f'ReplicaSet "{rs_name}" has successfully progressed.',
                                       lastUpdateTime=now())
    elif made_progress(old_status, counts) and rs_name:
        conditions = set_condition(conditions, "Progressing", "True", "ReplicaSetUpdated",
                                   f'ReplicaSet "{rs_name}" is progressing.', lastUpdateTime=now())
    elif progressing and progressing.get("status") == "True" and rs_name:
        deadline = deployment["spec"].get("progressDeadlineSeconds")
        try:
            last = parse_time(progressing.get("lastUpdateTime") or progressing.get("lastTransitionTime", ""))
        except ValueError:
            last = at
        if deadline is not None and at - last > int(deadline):
            conditions = set_condition(conditions, "Progressing", "False", "ProgressDeadlineExceeded",
                                       f'ReplicaSet "{rs_name}" has timed out progressing.',
                                       lastUpdateTime=now())
    return conditions


def _keep_update_time(before: list[Obj], after: list[Obj], cond_type: str) -> list[Obj]:
    """The Available condition's lastUpdateTime moves only when the condition itself changes."""
    old = next((c for c in before if c.get("type") == cond_type), None)
    if old is None:
        return after
    out = []
    for c in after:
        if c.get("type") == cond_type and all(c.get(k) == old.get(k) for k in ("status", "reason", "message")):
            c = {**c, "lastUpdateTime": old.get("lastUpdateTime", c.get("lastUpdateTime"))}
        out.append(c)
    return out


def proportions(sizes: list[int], to_add: int) -> list[int]:
    """Spread a replica change over active ReplicaSets in proportion to their size (leftover to the first)."""
    total = sum(sizes)
    if total == 0:
        return [to_add] + [0] * (len(sizes) - 1) if sizes else []
    shares = [int(to_add * s / total) for s in sizes]
    shares[0] += to_add - sum(shares)
    return shares


# ---- ownership index


class ControllerIndex:
    """Who controls whom: (kind key, namespace, owner uid) -> dependent names, kept from store events."""

    def __init__(self, store: Store, kinds: tuple[str, ...]) -> None:
        self._kinds = kinds
        self._lock = threading.Lock()
        self._owned: dict[tuple[str, str, str], set[str]] = {}
        store.add_listener(self._hear)

    def _hear(self, event: Event) -> None:
        if event.rtype.key not in self._kinds:
            return
        meta = event.obj["metadata"]
        ns = meta.get("namespace", "")
        old_ref = controller_of(event.old) if event.old is not None else None
        new_ref = controller_of(event.obj) if event.type != DELETED else None
        with self._lock:
            if old_ref and old_ref != new_ref:
                key = (event.rtype.key, ns, old_ref.get("uid", ""))
                names = self._owned.get(key)
                if names is not None:
                    names.discard(meta["name"])
                    if not names:
                        del self._owned[key]
            if new_ref:
                self._owned.setdefault((event.rtype.key, ns, new_ref.get("uid", "")), set()).add(meta["name"])

    def owned(self, kind: str, namespace: str, owner_uid: str) -> list[str]:
        with self._lock:
            return sorted(self._owned.get((kind, namespace, owner_uid), ()))


# ---- the ReplicaSet controller


class ReplicaSetController(ControlLoop):
    name = "replicaset-controller"
    kinds = ("apps/replicasets", "/pods")

    def __init__(self, store: Store, index: ControllerIndex) -> None:
        super().__init__(store, workers=2)
        self.index = index

    def keys_for(self, event: Event) -> Iterable[Hashable]:
        meta = event.obj["metadata"]
        ns = meta.get("namespace", "")
        if event.rtype.key == "apps/replicasets":
            return [] if status_only(event) else [(ns, meta["name"])]  # its own status writes
        keys = []
        for obj in (event.obj, event.old):
            ref = controller_of(obj) if obj is not None else None
            if ref and ref.get("kind") == "ReplicaSet":
                keys.append((ns, ref["name"]))
        return keys

    def pods_of(self, rs: Obj) -> list[Obj]:
        pod_type = self.store.type("/pods")
        ns = rs["metadata"].get("namespace", "")
        pods = (self.store.find(pod_type, ns, n) for n in self.index.owned("/pods", ns, rs["metadata"]["uid"]))
        return [p for p in pods if p is not None and (controller_of(p) or {}).get("uid") == rs["metadata"]["uid"]]

    def sync(self, key: Hashable) -> float | None:
        assert isinstance(key, tuple)
        ns, name = key
        store = self.store
        rs_type, pod_type = store.type("apps/replicasets"), store.type("/pods")
        rs = store.find(rs_type, ns, name)
        if rs is None:
            return None
        pods = self.pods_of(rs)
        active = [p for p in pods if pod_active(p)]
        again: float | None = None
        if not rs["metadata"].get("deletionTimestamp"):
            diff = len(active) - int(rs["spec"].get("replicas", 1))
            if diff < 0:
                for _ in range(min(-diff, BURST)):
                    store.create(pod_type, self._pod(rs), namespace=ns, copy=False)
                again = 0.0 if -diff > BURST else None
            elif diff > 0:
                for pod in sorted(active, key=deletion_rank)[:min(diff, BURST)]:
                    try:
                        store.delete(pod_type, ns, pod["metadata"]["name"])
                    except errors.ApiError as exc:
                        if exc.code != 404:
                            raise
            if diff:
                pods = self.pods_of(rs)
        at = time.time()
        status = replicaset_status(rs, pods, at)
        if status != rs.get("status"):
            store.mutate(rs_type, ns, name, lambda o: o.update(status=status), subresource="status",
                         manager="replicaset-controller")
        min_ready = int(rs["spec"].get("minReadySeconds") or 0)
        if min_ready and status["readyReplicas"] > status["availableReplicas"]:
            again = float(min_ready) / 2  # look again when the ready pods have been ready long enough
        return again

    def _pod(self, rs: Obj) -> Obj:
        template = rs["spec"].get("template") or {}
        tmeta = template.get("metadata") or {}
        meta: Obj = {"generateName": f"{rs['metadata']['name']}-", "namespace": rs["metadata"].get("namespace"),
                     "labels": clone(tmeta.get("labels") or {}),
                     "ownerReferences": [owner_ref(rs, "ReplicaSet", "apps/v1")]}
        if tmeta.get("annotations"):
            meta["annotations"] = clone(tmeta["annotations"])
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": clone(template.get("spec") or {})}


# ---- the Deployment controller


class DeploymentController(ControlLoop):
    name = "deployment-controller"
    kinds = ("apps/deployments", "apps/replicasets", "/pods")

    def __init__(self, store: Store, index: ControllerIndex) -> None:
        super().__init__(store, workers=2)
        self.index = index

    def keys_for(self, event: Event) -> Iterable[Hashable]:
        meta = event.obj["metadata"]
        ns = meta.get("namespace", "")
        if event.rtype.key == "apps/deployments":
            return [] if status_only(event) else [(ns, meta["name"])]  # its own status writes
        if event.rtype.key == "apps/replicasets":
            keys = []
            for obj in (event.obj, event.old):
                ref = controller_of(obj) if obj is not None else None
                if ref and ref.get("kind") == "Deployment":
                    keys.append((ns, ref["name"]))
            return keys
        # Pods matter only when they are gone: Recreate waits for every old pod to disappear.
        if event.type != DELETED:
            return []
        ref = controller_of(event.obj)
        if not ref or ref.get("kind") != "ReplicaSet":
            return []
        rs = self.store.find(self.store.type("apps/replicasets"), ns, ref["name"])
        owner = controller_of(rs) if rs else None
        return [(ns, owner["name"])] if owner and owner.get("kind") == "Deployment" else []

    def sync(self, key: Hashable) -> float | None:
        assert isinstance(key, tuple)
        ns, name = key
        store = self.store
        d = store.find(store.type("apps/deployments"), ns, name)
        if d is None or d["metadata"].get("deletionTimestamp"):
            return None
        rss = self._replicasets(d)
        new_rs = next((rs for rs in sorted(rss, key=_created) if templates_equal(
            rs["spec"].get("template") or {}, d["spec"]["template"])), None)
        old_rss = [rs for rs in rss if rs is not new_rs]
        paused = bool(d["spec"].get("paused"))
        if new_rs is not None:
            new_rs = self._sync_revision(d, new_rs, old_rss)
        if paused or self._scaling_event(d, new_rs, old_rss):
            self._scale(d, new_rs, old_rss)
        elif d["spec"]["strategy"].get("type") == "Recreate":
            new_rs = self._recreate(d, new_rs, old_rss)
        else:
            new_rs = self._rolling(d, new_rs, old_rss)
        rss = self._replicasets(d)
        new_rs = next((rs for rs in rss if new_rs is not None and rs["metadata"]["uid"] == new_rs["metadata"]["uid"]),
                      None)
        old_rss = [rs for rs in rss if rs is not new_rs]
        if new_rs is not None and not paused:
            self._cleanup(d, old_rss)
        return self._write_status(d, rss, new_rs)

    def _replicasets(self, d: Obj) -> list[Obj]:
        rs_type = self.store.type("apps/replicasets")
        ns = d["metadata"].get("namespace", "")
        found = (self.store.find(rs_type, ns, n) for n in self.index.owned("apps/replicasets", ns,
                                                                          d["metadata"]["uid"]))
        return [rs for rs in found if rs is not None
                and (controller_of(rs) or {}).get("uid") == d["metadata"]["uid"]]

    def _set_replicas(self, d: Obj, rs: Obj, replicas: int) -> Obj:
        """Scale a ReplicaSet and stamp the Deployment's size on it (setReplicasAnnotations)."""
        desired = int(d["spec"].get("replicas", 1))
        surge = fenceposts(d["spec"].get("strategy") or {}, desired)[0]
        notes = {DESIRED_REPLICAS: str(desired), MAX_REPLICAS: str(desired + surge)}

        def change(obj: Obj) -> bool:
            annotations = obj["metadata"].setdefault("annotations", {})
            if obj["spec"].get("replicas") == replicas and all(annotations.get(k) == v for k, v in notes.items()):
                return False
            obj["spec"]["replicas"] = replicas
            annotations.update(notes)
            return True

        meta = rs["metadata"]
        return self.store.mutate(self.store.type("apps/replicasets"), meta.get("namespace", ""), meta["name"],
                                 change, manager="deployment-controller", only=("metadata", "spec")) or rs

    def _sync_revision(self, d: Obj, new_rs: Obj, old_rss: list[Obj]) -> Obj:
        """A ReplicaSet that becomes current again (a rollback) takes the next revision number."""
        wanted = max([revision_of(rs) for rs in old_rss] + [0]) + 1
        if revision_of(new_rs) >= wanted:
            self._set_deployment_revision(d, revision_of(new_rs))
            return new_rs

        def bump(obj: Obj) -> None:
            obj["metadata"].setdefault("annotations", {})[REVISION] = str(wanted)

        meta = new_rs["metadata"]
        new_rs = self.store.mutate(self.store.type("apps/replicasets"), meta.get("namespace", ""), meta["name"],
                                   bump, manager="deployment-controller", only="metadata") or new_rs
        self._set_deployment_revision(d, wanted)
        return new_rs

    def _set_deployment_revision(self, d: Obj, revision: int, progressing: tuple[str, str] | None = None) -> None:
        """The revision annotation, and a Progressing condition (reason, message) when given, in one write through
        /status, as getNewReplicaSet's single UpdateStatus (a Deployment's status strategy keeps metadata)."""
        if (d["metadata"].get("annotations") or {}).get(REVISION) == str(revision) and progressing is None:
            return

        def change(obj: Obj) -> None:
            # Only status is the mutation's own copy: the annotations are replaced, never edited in place.
            obj["metadata"]["annotations"] = {**(obj["metadata"].get("annotations") or {}), REVISION: str(revision)}
            if progressing is not None:
                status = obj.setdefault("status", {})
                status["conditions"] = set_condition(status.get("conditions") or [], "Progressing", "True",
                                                     progressing[0], progressing[1], lastUpdateTime=now())

        self.store.mutate(self.store.type("apps/deployments"), d["metadata"].get("namespace", ""),
                          d["metadata"]["name"], change, subresource="status", manager="deployment-controller")

    def _create_new(self, d: Obj, old_rss: list[Obj], replicas: int) -> Obj | None:
        store = self.store
        rs_type = store.type("apps/replicasets")
        ns = d["metadata"].get("namespace", "")
        collisions = int((d.get("status") or {}).get("collisionCount", 0))
        revision = max([revision_of(rs) for rs in old_rss] + [0]) + 1
        pod_hash = template_hash(d["spec"]["template"], collisions)
        rs = desired_replicaset(d, pod_hash, replicas, revision)
        try:
            created = store.create(rs_type, rs, namespace=ns, manager="deployment-controller", copy=False)
        except errors.ApiError as exc:
            if exc.code != 409:
                raise
            existing = store.find(rs_type, ns, rs["metadata"]["name"])
            if existing is not None and (controller_of(existing) or {}).get("uid") == d["metadata"]["uid"] and \
                    templates_equal(existing["spec"].get("template") or {}, d["spec"]["template"]):
                return existing
            # A hash collision with someone else's ReplicaSet: count it, which changes the next hash.
            store.mutate(store.type("apps/deployments"), ns, d["metadata"]["name"],
                         lambda o: o.setdefault("status", {}).update(collisionCount=collisions + 1),
                         subresource="status", manager="deployment-controller")
            return None
        self._set_deployment_revision(d, revision, ("NewReplicaSetCreated",
                                                    f'Created new replica set "{created["metadata"]["name"]}"'))
        return created

    def _scaling_event(self, d: Obj, new_rs: Obj | None, old_rss: list[Obj]) -> bool:
        """isScalingEvent: an active ReplicaSet was sized for a different `spec.replicas`."""
        if new_rs is None:
            return False
        wanted = str(d["spec"].get("replicas", 1))
        for rs in [new_rs, *old_rss]:
            if int(rs["spec"].get("replicas", 0)) > 0:
                noted = (rs["metadata"].get("annotations") or {}).get(DESIRED_REPLICAS)
                if noted is not None and noted != wanted:
                    return True
        return False

    def _scale(self, d: Obj, new_rs: Obj | None, old_rss: list[Obj]) -> None:
        """Proportional scaling: a size change mid-rollout is spread over the active ReplicaSets."""
        desired = int(d["spec"].get("replicas", 1))
        active = [rs for rs in [new_rs, *old_rss] if rs is not None and int(rs["spec"].get("replicas", 0)) > 0]
        if len(active) <= 1:
            target = active[0] if active else new_rs
            if target is not None:
                self._set_replicas(d, target, desired)
            return
        surge = fenceposts(d["spec"].get("strategy") or {}, desired)[0]
        current = sum(int(rs["spec"]["replicas"]) for rs in active)
        to_add = desired + surge - current
        if to_add == 0:
            return
        # Growth goes to the newest first, shrinking takes from the largest and oldest first.
        ordered = sorted(active, key=_created, reverse=True) if to_add > 0 else sorted(
            active, key=lambda rs: (-int(rs["spec"]["replicas"]), _created(rs)))
        for rs, share in zip(ordered, proportions([int(rs["spec"]["replicas"]) for rs in ordered], to_add),
                             strict=True):
            self._set_replicas(d, rs, max(0, int(rs["spec"]["replicas"]) + share))

    def _recreate(self, d: Obj, new_rs: Obj | None, old_rss: list[Obj]) -> Obj | None:
        """Recreate: every old pod is gone before the new ReplicaSet gets any."""
        for rs in old_rss:
            if int(rs["spec"].get("replicas", 0)) != 0:
                self._set_replicas(d, rs, 0)
        pod_type = self.store.type("/pods")
        ns = d["metadata"].get("namespace", "")
        for rs in old_rss:
            for pod_name in self.index.owned("/pods", ns, rs["metadata"]["uid"]):
                pod = self.store.find(pod_type, ns, pod_name)
                if pod is not None and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                    return new_rs
        desired = int(d["spec"].get("replicas", 1))
        if new_rs is None:
            return self._create_new(d, old_rss, desired)
        if int(new_rs["spec"].get("replicas", 0)) != desired:
            new_rs = self._set_replicas(d, new_rs, desired)
        return new_rs

    def _rolling(self, d: Obj, new_rs: Obj | None, old_rss: list[Obj]) -> Obj | None:
        desired = int(d["spec"].get("replicas", 1))
        surge, _ = fenceposts(d["spec"]["strategy"], desired)
        old_total = sum(int(rs["spec"].get("replicas", 0)) for rs in old_rss)
        if new_rs is None:
            new_rs = self._create_new(d, old_rss, new_rs_replicas(desired, surge, old_total, 0))
            if new_rs is None:
                return None
        new_count = int(new_rs["spec"].get("replicas", 0))
        wanted = new_rs_replicas(desired, surge, old_total + new_count, new_count)
        if wanted > new_count:
            return self._set_replicas(d, new_rs, wanted)
        self._scale_down_old(d, new_rs, old_rss)
        return new_rs

    def _scale_down_old(self, d: Obj, new_rs: Obj, old_rss: list[Obj]) -> None:
        """reconcileOldReplicaSets: first unhealthy old pods, then healthy ones down to minAvailable."""
        old_total = sum(int(rs["spec"].get("replicas", 0)) for rs in old_rss)
        if old_total == 0:
            return
        desired = int(d["spec"].get("replicas", 1))
        unavail = max_unavailable(d)
        new_count = int(new_rs["spec"].get("replicas", 0))
        new_available = int((new_rs.get("status") or {}).get("availableReplicas", 0))
        budget = old_scale_down_budget(desired, unavail, old_total + new_count, new_count, new_available)
        if budget <= 0:
            return
        sizes = {rs["metadata"]["uid"]: int(rs["spec"].get("replicas", 0)) for rs in old_rss}
        by_age = sorted(old_rss, key=_created)
        cleaned = 0
        for rs in by_age:
            if cleaned >= budget:
                break
            size, available = sizes[rs["metadata"]["uid"]], int((rs.get("status") or {}).get("availableReplicas", 0))
            if size == 0 or size <= available:
                continue
            down = min(budget - cleaned, size - available)
            sizes[rs["metadata"]["uid"]] = size - down
            cleaned += down
        all_available = sum(int((rs.get("status") or {}).get("availableReplicas", 0)) for rs in old_rss)
        all_available += new_available
        min_available = desired - unavail
        remaining = max(0, all_available - min_available)
        for rs in by_age:
            if remaining <= 0:
                break
            size = sizes[rs["metadata"]["uid"]]
            down = min(size, remaining)
            sizes[rs["metadata"]["uid"]] = size - down
            remaining -= down
        for rs in old_rss:
            if sizes[rs["metadata"]["uid"]] != int(rs["spec"].get("replicas", 0)):
                self._set_replicas(d, rs, sizes[rs["metadata"]["uid"]])

    def _cleanup(self, d: Obj, old_rss: list[Obj]) -> None:
        """Old ReplicaSets beyond revisionHistoryLimit, emptied and settled, are deleted oldest first."""
        limit = d["spec"].get("revisionHistoryLimit")
        if limit is None:
            return
        removable = [rs for rs in old_rss if int(rs["spec"].get("replicas", 0)) == 0
                     and int((rs.get("status") or {}).get("replicas", 0)) == 0
                     and (rs.get("status") or {}).get("observedGeneration", 0) >= rs["metadata"].get("generation", 1)
                     and not rs["metadata"].get("deletionTimestamp")]
        excess = len(old_rss) - int(limit)
        for rs in sorted(removable, key=lambda r: (revision_of(r), _created(r)))[:max(0, excess)]:
            try:
                self.store.delete(self.store.type("apps/replicasets"), rs["metadata"].get("namespace", ""),
                                  rs["metadata"]["name"])
            except errors.ApiError as exc:
                if exc.code != 404:
                    raise

    def _write_status(self, d: Obj, rss: list[Obj], new_rs: Obj | None) -> float | None:
        store = self.store
        d = store.find(store.type("apps/deployments"), d["metadata"].get("namespace", ""), d["metadata"]["name"]) or d
        at = time.time()
        counts = deployment_counts(d, rss, new_rs)
        if new_rs is not None and not any(c.get("type") == "Progressing"
                                          for c in (d.get("status") or {}).get("conditions") or []):
            d = clone(d)
            d.setdefault("status", {})["conditions"] = set_condition(
                [], "Progressing", "True", "FoundNewReplicaSet",
                f'Found new replica set "{new_rs["metadata"]["name"]}"', lastUpdateTime=now())
        # The counts are `omitempty` int32s in apps/v1 DeploymentStatus: a zero is not sent at all.
        status = {k: v for k, v in {**(d.get("status") or {}), **counts}.items() if v != 0}
        order = ("Available", "Progressing", "ReplicaFailure")
        status["conditions"] = sorted(deployment_conditions(d, counts, new_rs, at), key=lambda c: order.index(
            c["type"]) if c.get("type") in order else len(order))
        if status != d.get("status"):
            store.mutate(store.type("apps/deployments"), d["metadata"].get("namespace", ""), d["metadata"]["name"],
                         lambda o: o.update(status=status), subresource="status", manager="deployment-controller")
        if not rollout_complete(d, counts) and not d["spec"].get("paused"):
            # Come back to notice a missed progress deadline.
            return float(d["spec"].get("progressDeadlineSeconds") or 600) + 1
        return None


def _created(rs: Obj) -> tuple[str, str]:
    return rs["metadata"].get("creationTimestamp", ""), rs["metadata"]["name"]


def install(cluster: Any) -> None:
    """The Deployment and ReplicaSet controllers, sharing one index of who controls whom."""
    index = ControllerIndex(cluster.store, ("apps/replicasets", "/pods"))
    cluster.add_component(ReplicaSetController(cluster.store, index))
    cluster.add_component(DeploymentController(cluster.store, index))
