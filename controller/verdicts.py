"""What an agent Deployment's status says: is its agent ready, and has the deployment controller given up on its
current template. The BMC's status (status.py) and the fleet's rollout (rollout.py) read the same verdicts."""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]


def progress_deadline_exceeded(deployment: Obj) -> str:
    """The deployment controller's verdict that the current template did not become ready within
    progressDeadlineSeconds (its message), or "": what halts a rollout (controller/rollout.py)."""
    meta, status = deployment.get("metadata") or {}, deployment.get("status") or {}
    if int(status.get("observedGeneration") or 0) < int(meta.get("generation") or 0):
        return ""  # a verdict on the template before this one
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("status") == "False" \
                and cond.get("reason") == "ProgressDeadlineExceeded":
            return str(cond.get("message") or "ProgressDeadlineExceeded")
    return ""


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
