"""The status of a VirtualMachineBMC: conditions, clusterIP and endpoints, as a pure function of what the
reconciler observed. `lastTransitionTime` moves only when a condition's status changes, so an unchanged world
gives an identical status and no write."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import desired
from .spec import BMCSpec
from .verdicts import agent_readiness

Obj = dict[str, Any]
READY, VM_AVAILABLE, SECRET_AVAILABLE, AGENT_READY = "Ready", "VirtualMachineAvailable", "SecretAvailable", "AgentReady"
AGENT_UP_TO_DATE = "AgentUpToDate"
CONDITION_ORDER = (READY, VM_AVAILABLE, SECRET_AVAILABLE, AGENT_READY, AGENT_UP_TO_DATE)
# bootOverride and agent (a pool member's own readiness): the agent's
OWNED_KEYS = ("observedGeneration", "clusterIP", "endpoints", "conditions", "redfish")


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str


@dataclass(frozen=True)
class Observed:
    """What one reconcile saw, reduced to what the status says."""

    vm_found: bool
    credentials_problem: tuple[str, str] | None  # (reason, message) or None when usable
    conflict_with: str = ""  # the older VirtualMachineBMC that serves this VM
    tls_problem: tuple[str, str] | None = None
    cluster_ip: str = ""
    external: str = ""  # a LoadBalancer Service's first ingress IP or hostname
    deployment: Obj | None = None
    blocked_by: str = ""  # a child of that name exists and is controlled by someone else
    rejected: str = ""  # the API server refused a child: which, and the API's reason and message
    certificate: Obj | None = None  # the served certificate's expiry (certificates.certificate_status)
    pool: str = ""  # spec.agentPool: the pool's agent serves this BMC
    pool_full: bool = False  # the pool has no free place for it
    up_to_date: tuple[bool, str, str] | None = None  # AgentUpToDate (controller/rollout.py), with an agent
    not_serving: str = ""  # a pool's agent reports this member cannot serve (status.agent): why


# Reasons for Ready=False while the agent rolls out normally (no Event: not a problem).
IN_PROGRESS = frozenset({"AgentProgressing", "AgentNotReady", "ServicePending"})


def not_serving(bmc: Obj) -> str:
    """Why a pool's agent reports this member cannot serve (status.agent, written by the agent), "" when it
    serves or did not say."""
    report = (bmc.get("status") or {}).get("agent") or {}
    if report.get("serving") is False:
        return str(report.get("message") or "the pool's agent reports this member cannot serve")
    return ""


def conditions_of(spec: BMCSpec, observed: Observed, vm: str) -> list[Condition]:
    vm_cond = (Condition(VM_AVAILABLE, True, "VirtualMachineFound", f"VirtualMachine {vm} exists")
               if observed.vm_found else
               Condition(VM_AVAILABLE, False, "VirtualMachineNotFound", f"VirtualMachine {vm} not found"))
    problem = observed.credentials_problem or observed.tls_problem
    secret_cond = (Condition(SECRET_AVAILABLE, False, *problem) if problem else
                   Condition(SECRET_AVAILABLE, True, "SecretFound",
                             f"Secret {spec.auth_secret_ref.name if spec.auth_secret_ref else ''} has username "
                             "and password"))
    if observed.conflict_with:
        message = (f"VirtualMachine {vm} is already served by the older VirtualMachineBMC {observed.conflict_with}; "
                   "this one has no agent")
        agent = Condition(AGENT_READY, False, "Conflict", message)
        ready = Condition(READY, False, "Conflict", message)
        return [ready, vm_cond, secret_cond, agent]
    if observed.rejected:
        agent = Condition(AGENT_READY, False, "ChildRejected", observed.rejected)
    elif observed.pool_full:
        agent = Condition(AGENT_READY, False, "PoolFull", f"agent pool {observed.pool} serves at most "
                          f"{desired.MAX_POOL_MEMBERS} BMCs: this one waits for a free place")
    elif observed.blocked_by:
        agent = Condition(AGENT_READY, False, "ChildConflict", observed.blocked_by)
    elif not observed.vm_found or problem:
        agent = Condition(AGENT_READY, False, "AgentNotDeployed", "no agent until the VirtualMachine and the "
                          "Secret are available")
    else:
        agent = Condition(AGENT_READY, *agent_readiness(observed.deployment))
        if observed.pool and agent.status and observed.not_serving:
            # The pool's pod is ready (the others serve); this member is not.
            agent = Condition(AGENT_READY, False, "MemberNotServing", observed.not_serving)
        if observed.pool:
            agent = Condition(AGENT_READY, agent.status, agent.reason,
                              f"agent pool {observed.pool} ({desired.pool_name(observed.pool)}): {agent.message}")
    if observed.rejected or observed.pool_full:
        ready = Condition(READY, False, agent.reason, agent.message)
    elif not observed.vm_found:
        ready = Condition(READY, False, vm_cond.reason, vm_cond.message)
    elif problem:
        ready = Condition(READY, False, secret_cond.reason, secret_cond.message)
    elif not agent.status:
        ready = Condition(READY, False, agent.reason, agent.message)
    elif not observed.cluster_ip:
        ready = Condition(READY, False, "ServicePending", "the Service has no ClusterIP yet")
    else:
        ready = Condition(READY, True, "Ready", "the BMC answers on " + observed.cluster_ip
                          + (f" and {observed.external}" if observed.external else ""))
    if observed.up_to_date is None or observed.deployment is None:
        return [ready, vm_cond, secret_cond, agent]
    return [ready, vm_cond, secret_cond, agent, Condition(AGENT_UP_TO_DATE, *observed.up_to_date)]


def load_balancer_address(service: Obj | None) -> str:
    """A LoadBalancer Service's first ingress IP or hostname ("" for other types, or before one is assigned)."""
    if not service or (service.get("spec") or {}).get("type") != "LoadBalancer":
        return ""
    ingress = (((service.get("status") or {}).get("loadBalancer") or {}).get("ingress") or [{}])[0] or {}
    return str(ingress.get("ip") or ingress.get("hostname") or "")


def endpoints(spec: BMCSpec, host: str, vm: str) -> Obj:
    """Where to reach the BMC at `host` (the LoadBalancer address, else the ClusterIP); an IPv6 address is
    bracketed, as in URLs."""
    if not host or host == "None":
        return {}
    host = f"[{host}]" if ":" in host else host
    out: Obj = {}
    if spec.ipmi.enabled:
        out["ipmi"] = f"{host}:623"
        out["metal3IPMI"] = f"ipmi://{host}:623"
    if spec.redfish.enabled:
        out["redfish"] = f"https://{host}/redfish/v1/Systems/{vm}"
        out["metal3Redfish"] = f"redfish-virtualmedia+https://{host}/redfish/v1/Systems/{vm}"
        out["web"] = f"https://{host}/"  # the BMC's page (vbmc/web)
    return out


def desired_status(bmc: Obj, observed: Observed, now: str) -> Obj:
    """The fields of `status` the controller owns (never bootOverride)."""
    spec = BMCSpec.of(bmc)
    vm = spec.virtual_machine_ref.name
    generation = int(bmc["metadata"].get("generation") or 0)
    previous = {c.get("type"): c for c in ((bmc.get("status") or {}).get("conditions") or [])}
    conditions = []
    for cond in conditions_of(spec, observed, vm):
        status = "True" if cond.status else "False"
        before = previous.get(cond.type) or {}
        since = before.get("lastTransitionTime") if before.get("status") == status else None
        conditions.append({"type": cond.type, "status": status, "reason": cond.reason, "message": cond.message,
                           "observedGeneration": generation, "lastTransitionTime": since or now})
    out: Obj = {"observedGeneration": generation, "conditions": conditions}
    if observed.cluster_ip and not observed.conflict_with:
        out["clusterIP"] = observed.cluster_ip
        out["endpoints"] = endpoints(spec, observed.external or observed.cluster_ip, vm)
    if observed.certificate and not observed.conflict_with:
        out["redfish"] = {"certificate": observed.certificate}
    return out


def merge_diff(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) that takes `old` to `new`: keys `new` lacks are nulled."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    diff = {k: merge_diff(old.get(k), v) for k, v in new.items() if old.get(k) != v}
    diff.update({k: None for k in old if k not in new})
    return diff


def status_patch(current: Obj | None, desired: Obj) -> Obj | None:
    """A merge patch taking the owned part of `current` to `desired` (None when equal); other keys untouched."""
    current = current or {}
    patch: Obj = {}
    for key in OWNED_KEYS:
        if key not in desired:
            if current.get(key) is not None:
                patch[key] = None
        elif key == "endpoints":
            old = current.get(key) or {}
            diff = {k: v for k, v in desired[key].items() if old.get(k) != v}
            diff.update({k: None for k in old if k not in desired[key]})
            if diff or key not in current:
                patch[key] = diff if key in current else desired[key]
        elif key == "redfish":  # nested: a key dropped inside (renewAfter) must be nulled
            if current.get(key) != desired[key]:
                patch[key] = merge_diff(current.get(key), desired[key])
        elif current.get(key) != desired[key]:
            patch[key] = desired[key]
    return patch or None


def progress_only(current: Obj | None, patch: Obj) -> bool:
    """Whether a status patch only moves a rollout from one step to the next: Ready stays False for an
    in-progress reason before and after, and no other condition but AgentReady changes."""
    if set(patch) != {"conditions"}:
        return False
    before = {c.get("type"): c for c in (current or {}).get("conditions") or []}
    after = {c.get("type"): c for c in patch["conditions"] or []}
    was, now = before.get(READY) or {}, after.get(READY) or {}
    return (was.get("status") == now.get("status") == "False" and was.get("reason") in IN_PROGRESS
            and now.get("reason") in IN_PROGRESS
            and all(before.get(t) == after.get(t) for t in before.keys() | after.keys()
                    if t not in (READY, AGENT_READY)))


def transitions(current: Obj | None, desired: Obj) -> list[Obj]:
    """Conditions whose status or reason changed (each worth an Event)."""
    before = {c.get("type"): c for c in ((current or {}).get("conditions") or [])}
    return [c for c in desired.get("conditions") or []
            if (before.get(c["type"]) or {}).get("status") != c["status"]
            or (before.get(c["type"]) or {}).get("reason") != c["reason"]]
