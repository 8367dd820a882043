"""What an agent Deployment's status says: is its agent ready, and has the deployment controller given up on its
current template. The BMC's status (status.py) and the fleet's rollout (rollout.py) read the same verdicts.

A verdict can outlive the template it was about. kube-controller-manager's deployment controller
(pkg/controller/deployment/progress.go, syncRolloutStatus; util.DeploymentTimedOut) keeps a Progressing=False
ProgressDeadlineExceeded condition until the new ReplicaSet makes progress, and its first sync of a new template
under Recreate (recreate.go: scale the old ReplicaSets down, then return) already reports the new generation as
observed: so `observedGeneration` alone does not make the condition current. The condition names the ReplicaSet
that timed out ("ReplicaSet \"<name>\" has timed out progressing."); it belongs to the current template only when
that ReplicaSet runs it, the rule FindNewReplicaSet applies (the template equal but for the pod-template-hash
label). `timed_out_replicaset` says which ReplicaSet to look at, `runs_template` decides, and the reconciler drops
a stale verdict (`without_progress_verdict`) before any of the functions below read the Deployment.
"""

from __future__ import annotations

import re
from typing import Any

Obj = dict[str, Any]

HASH_LABEL = "pod-template-hash"
_TIMED_OUT_RS = re.compile(r'^ReplicaSet "([^"]+)" has timed out progressing')


def _deadline_condition(deployment: Obj) -> Obj | None:
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("status") == "False" \
                and cond.get("reason") == "ProgressDeadlineExceeded":
            return dict(cond)
    return None


def timed_out_replicaset(deployment: Obj) -> str | None:
    """The ReplicaSet a ProgressDeadlineExceeded verdict of the observed generation names; "" when it names none
    (the deadline passed before any ReplicaSet of the template existed: the verdict is the template's own);
    None without such a verdict."""
    meta, status = deployment.get("metadata") or {}, deployment.get("status") or {}
    if int(status.get("observedGeneration") or 0) < int(meta.get("generation") or 0):
        return None
    cond = _deadline_condition(deployment)
    if cond is None:
        return None
    found = _TIMED_OUT_RS.match(str(cond.get("message") or ""))
    return found.group(1) if found else ""


def runs_template(deployment: Obj, replicaset: Obj | None) -> bool:
    """Whether `replicaset` (None: gone) runs the Deployment's pod template: every field of the Deployment's
    template (as cached: what this controller applied) has the same value in the ReplicaSet's, whose extra
    fields (the pod-template-hash label, server defaults) do not count."""
    if replicaset is None:
        return False
    want = ((deployment.get("spec") or {}).get("template")) or {}
    have = ((replicaset.get("spec") or {}).get("template")) or {}
    return _contains(have, want)


def _contains(have: Any, want: Any) -> bool:
    if isinstance(want, dict):
        return isinstance(have, dict) and all(_contains(have.get(k), v) for k, v in want.items()
                                              if v not in ({}, []) or k in have)
    if isinstance(want, list):
        return isinstance(have, list) and len(have) == len(want) and all(
            _contains(h, w) for h, w in zip(have, want, strict=True))
    return bool(have == want)


def without_progress_verdict(deployment: Obj) -> Obj:
    """The Deployment as if the deployment controller had not judged its template yet (a stale verdict)."""
    status = deployment.get("status") or {}
    conditions = [c for c in status.get("conditions") or [] if c.get("type") != "Progressing"]
    return {**deployment, "status": {**status, "conditions": conditions}}


def progress_deadline_exceeded(deployment: Obj) -> str:
    """The deployment controller's verdict that the current template did not become ready within
    progressDeadlineSeconds (its message), or "": what halts a rollout (controller/rollout.py). The caller has
    dropped a verdict about an older template (`without_progress_verdict`)."""
    if timed_out_replicaset(deployment) is None:
        return ""  # none, or a verdict on the template before this one
    cond = _deadline_condition(deployment) or {}
    return str(cond.get("message") or "ProgressDeadlineExceeded")


def agent_readiness(deployment: Obj | None) -> tuple[bool, str, str]:
    """From the Deployment's status: ready when the current generation's pod is ready (not just a ClusterIP)."""
    if deployment is None:
        return False, "AgentNotDeployed", "the agent Deployment does not exist yet"
    meta, status = deployment.get("metadata") or {}, deployment.get("status") or {}
    generation = int(meta.get("generation") or 0)
    if int(status.get("observedGeneration") or 0) < generation:
        return False, "AgentProgressing", "the agent Deployment's new generation is not observed yet"
    want = int((deployment.get("spec") or {}).get("replicas", 1))
    updated, ready = int(status.get("updatedReplicas") or 0), int(status.get("readyReplicas") or 0)
    replicas = int(status.get("replicas") or 0)
    if updated >= want and replicas <= updated and ready >= want:
        return True, "AgentReady", f"{ready}/{want} agent pods ready"
    failed = progress_deadline_exceeded(deployment)
    if failed:
        deadline = (deployment.get("spec") or {}).get("progressDeadlineSeconds")
        return False, "ProgressDeadlineExceeded", (f"the agent did not become ready within {deadline}s "
                                                   f"({failed}): see its pod's events")
    if updated < want or replicas > updated:
        return False, "AgentProgressing", f"rolling out the agent ({updated}/{want} updated)"
    return False, "AgentNotReady", f"{ready}/{want} agent pods ready"
