"""Taints and tolerations: which taints a pod tolerates, and for how long.

The rules are Kubernetes' own, shared by the scheduler (kubesim/scheduler.py), the taint eviction controller
(kubesim/tainteviction.py) and the DefaultTolerationSeconds admission plugin (`default_toleration_seconds`):
- a toleration matches a taint when its effect is empty or the taint's, its key is empty or the taint's, and its
  operator is Exists, or Equal (the default) with the taint's value (k8s.io/api/core/v1 toleration.go
  ToleratesTaint);
- each NoExecute taint of a node is matched by the pod's first toleration of it (v1helper GetMatchingTolerations);
  the shortest tolerationSeconds among those decides when the pod is evicted, and when none has seconds the pod
  stays for ever (pkg/controller/tainteviction/taint_eviction.go getMinTolerationTime).
"""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]

NOT_READY = "node.kubernetes.io/not-ready"
UNREACHABLE = "node.kubernetes.io/unreachable"
UNSCHEDULABLE = "node.kubernetes.io/unschedulable"
NO_SCHEDULE, NO_EXECUTE = "NoSchedule", "NoExecute"
# kube-apiserver's --default-not-ready-toleration-seconds and --default-unreachable-toleration-seconds.
DEFAULT_TOLERATION_SECONDS = 300


def tolerates(toleration: Obj, taint: Obj) -> bool:
    """ToleratesTaint."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    return operator == "Equal" and (toleration.get("value") or "") == (taint.get("value") or "")


def untolerated(taints: list[Obj], tolerations: list[Obj], effects: tuple[str, ...]) -> Obj | None:
    """The first taint with one of `effects` that no toleration matches (FindMatchingUntoleratedTaint)."""
    for taint in taints:
        if taint.get("effect") in effects and not any(tolerates(t, taint) for t in tolerations):
            return taint
    return None


def eviction_delay(taints: list[Obj], tolerations: list[Obj]) -> float | None:
    """Seconds a pod may stay on a node with these taints: 0 when a NoExecute taint is not tolerated, None when it
    is tolerated forever (or there is no NoExecute taint)."""
    no_execute = [t for t in taints if t.get("effect") == NO_EXECUTE]
    if not no_execute:
        return None
    used: list[Obj] = []
    for taint in no_execute:
        first = next((t for t in tolerations if tolerates(t, taint)), None)
        if first is None:
            return 0.0
        used.append(first)
    seconds = [int(t["tolerationSeconds"]) for t in used if t.get("tolerationSeconds") is not None]
    if not seconds:
        return None
    return float(max(0, min(seconds)))


def default_toleration_seconds(spec: Obj, seconds: int = DEFAULT_TOLERATION_SECONDS) -> None:
    """The DefaultTolerationSeconds admission plugin (plugin/pkg/admission/defaulttolerationseconds/admission.go):
    a pod that tolerates neither node.kubernetes.io/not-ready:NoExecute nor node.kubernetes.io/unreachable:NoExecute
    (a toleration with that key or none, and that effect or none) gets an Exists toleration of each for 300 s. This
    is why a pod stays on a lost node five minutes after it is found unreachable unless it says otherwise."""
    tolerations = spec.get("tolerations") or []
    for key in (NOT_READY, UNREACHABLE):
        if not any(t.get("key") in (None, "", key) and t.get("effect") in (None, "", NO_EXECUTE)
                   for t in tolerations if isinstance(t, dict)):
            tolerations = [*tolerations, {"key": key, "operator": "Exists", "effect": NO_EXECUTE,
                                          "tolerationSeconds": seconds}]
    if tolerations:
        spec["tolerations"] = tolerations
