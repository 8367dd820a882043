"""kube-controller-manager's taint eviction controller: pods leave nodes with NoExecute taints they do not tolerate.

As pkg/controller/tainteviction/taint_eviction.go does it: when a node's NoExecute taints change (or a pod is bound
to a tainted node, or its tolerations change), each pod on it is looked at (processPodOnNode):
- a taint it does not tolerate: deleted at once;
- every taint tolerated, some toleration with tolerationSeconds: deleted that many seconds (the least of them) after
  the controller first saw the pod under those taints; an eviction already scheduled keeps its start;
- tolerated without tolerationSeconds: never deleted; a scheduled eviction is cancelled, as it is when the taints go.
A deletion first sets the pod's DisruptionTarget condition (reason DeletionByTaintManager, "Taint manager: deleting
due to NoExecute taint"), then deletes it with its own grace period (addConditionAndDeletePod). On a lost node no
kubelet confirms the deletion: the pod stays Terminating, and its ReplicaSet, which counts only pods without a
deletionTimestamp (controller.FilterActivePods, IsPodActive in pkg/controller/controller_utils.go), creates its
replacement at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable, Iterable
from typing import Any

from . import errors
from .loop import ControlLoop
from .objects import set_condition
from .store import DELETED, Event, Store
from .tolerations import NO_EXECUTE, eviction_delay

log = logging.getLogger(__name__)

Obj = dict[str, Any]

MANAGER = "taint-eviction-controller"


def no_execute(node: Obj | None) -> list[Obj]:
    return [t for t in ((node or {}).get("spec") or {}).get("taints") or [] if t.get("effect") == NO_EXECUTE]


class TaintEvictionController(ControlLoop):
    name = "taint-eviction-controller"
    kinds = ("/nodes", "/pods")

    def __init__(self, store: Store) -> None:
        super().__init__(store, workers=1)
        self._tainted: dict[str, list[Obj]] = {}  # node -> its NoExecute taints
        self._started: dict[tuple[str, str], float] = {}  # pod -> when its eviction was scheduled (time.time)
        self._lock = threading.Lock()

    def keys_for(self, event: Event) -> Iterable[Hashable]:
        obj, old = event.obj, event.old
        if event.rtype.key == "/nodes":
            if event.type != DELETED and old is not None and no_execute(obj) == no_execute(old):
                return []
            return [("node", obj["metadata"]["name"])]
        spec, old_spec = obj.get("spec") or {}, (old or {}).get("spec") or {}
        if old is not None and event.type != DELETED and spec.get("nodeName") == old_spec.get("nodeName") and \
                spec.get("tolerations") == old_spec.get("tolerations"):
            return []  # PodUpdated: only a new node or new tolerations matter
        return [("pod", obj["metadata"].get("namespace", ""), obj["metadata"]["name"])]

    def sync(self, key: Hashable) -> float | None:
        assert isinstance(key, tuple)
        store = self.store
        at = time.time()
        if key[0] == "node":
            node = store.find(store.type("/nodes"), "", key[1])
            taints = no_execute(node)
            with self._lock:
                if taints:
                    self._tainted[key[1]] = taints
                else:
                    self._tainted.pop(key[1], None)
            pods, _ = store.list(store.type("/pods"), fields_=lambda pod: pod["spec"].get("nodeName") == key[1])
            for pod in pods:
                wait = self._process(pod, taints, at)
                if wait is not None:
                    self.enqueue(("pod", pod["metadata"].get("namespace", ""), pod["metadata"]["name"]), wait)
            return None
        found = store.find(store.type("/pods"), key[1], key[2])
        if found is None:
            with self._lock:
                self._started.pop((key[1], key[2]), None)
            return None
        with self._lock:
            taints = self._tainted.get(found["spec"].get("nodeName") or "", [])
        return self._process(found, taints, at)

    def _process(self, pod: Obj, taints: list[Obj], at: float) -> float | None:
        """processPodOnNode: evict now, or say in how many seconds to look again (None: nothing scheduled)."""
        key = (pod["metadata"].get("namespace", ""), pod["metadata"]["name"])
        delay = eviction_delay(taints, pod["spec"].get("tolerations") or []) if taints else None
        with self._lock:
            if delay is None:
                self._started.pop(key, None)
                return None
            started = self._started.setdefault(key, at)
        if started + delay > at:
            return started + delay - at
        self._evict(pod)
        with self._lock:
            self._started.pop(key, None)
        return None

    def _evict(self, pod: Obj) -> None:
        if pod["metadata"].get("deletionTimestamp"):
            return
        store, pod_type = self.store, self.store.type("/pods")
        ns, name, uid = pod["metadata"].get("namespace", ""), pod["metadata"]["name"], pod["metadata"]["uid"]

        def disrupted(obj: Obj) -> bool:
            if obj["metadata"]["uid"] != uid:
                return False
            status = obj.setdefault("status", {})
            status["conditions"] = set_condition(status.get("conditions") or [], "DisruptionTarget", "True",
                                                 "DeletionByTaintManager",
                                                 "Taint manager: deleting due to NoExecute taint")
            return True

        log.info("taint-eviction-controller: deleting pod %s/%s (NoExecute taint of node %s)", ns, name,
                 pod["spec"].get("nodeName"))
        store.mutate(pod_type, ns, name, disrupted, subresource="status", manager=MANAGER)
        try:
            store.delete(pod_type, ns, name, preconditions={"uid": uid})
        except errors.ApiError as exc:
            if exc.code not in (404, 409):
                raise


def install(cluster: Any) -> None:
    cluster.add_component(TaintEvictionController(cluster.store))
