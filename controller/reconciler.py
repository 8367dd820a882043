"""`reconcile(key) -> Result`: one VirtualMachineBMC, level-triggered and idempotent.

It reads only the watch caches, computes the children with the pure functions of `desired`, applies a child
(server-side apply, one field manager, force: a hand edit of a field we own is undone) only when the cached one
differs in a field we set, and writes the status once, only when it changed. The caches may be stale: what this
controller wrote itself is remembered until the cache has caught up, so a stale cache does not cause a second
write, and anything else stale is corrected by the next reconcile that the watch event triggers.
"""

from __future__ import annotations

import base64
import datetime
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from . import certificates, desired, metrics, rollout, verdicts
from .caches import BMCS, CHILD_KINDS, FLEET, REPLICA_SETS, Caches, PoolKey, pool_of
from .events import EventRecorder
from .informer import Key
from .kubeapi import APPLY, MERGE_PATCH, ApiError, KubeApi
from .settings import Settings
from .spec import BMCSpec
from .status import (
    AGENT_UP_TO_DATE,
    IN_PROGRESS,
    Observed,
    desired_status,
    load_balancer_address,
    not_serving,
    progress_only,
    status_patch,
    transitions,
)

log = logging.getLogger(__name__)
Obj = dict[str, Any]


@dataclass(frozen=True)
class Result:
    requeue_after: float = 0.0


@dataclass(frozen=True)
class PoolPlan:
    """A pool as the caches show it: every VirtualMachineBMC naming it (the owners of its objects), each one's
    slot (kept from its Service, else the lowest free one, oldest BMC first), and the members the agent serves
    (their VM and Secrets usable, and not in conflict over their VM): (BMC, VM, credentials Secret, slot)."""

    owners: list[Obj]
    slots: dict[str, int]
    served: list[tuple[Obj, str, Obj, int]]


# Answers that say the request itself is wrong (not a passing state): retrying the same object cannot help.
_REFUSALS = frozenset({400, 403, 404, 405, 413, 415, 422})


class ChildRejected(Exception):
    """The API server refused a child: the BMC's status says which and why, then the reconcile is retried with
    back-off (a webhook, quota or RBAC may change its mind; a spec change reconciles at once)."""

    def __init__(self, kind: str, name: str, error: ApiError) -> None:
        super().__init__(f"the API server refused {kind} {name}: {error.status} {error.reason}: {error.message}")
        self.error = error


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def difference(want: Any, have: Any, path: str = "") -> str | None:
    """The first path where `have` lacks what `want` sets (None: `have` satisfies `want`). Fields the server or
    others added are ignored: only what we set is compared. An empty map or list is satisfied by an absent one:
    kube-apiserver does not store them (Go's omitempty), so `{}` never comes back."""
    if want in ({}, []) and have is None:
        return None
    if isinstance(want, dict):
        if not isinstance(have, dict):
            return path or "."
        for key, value in want.items():
            found = difference(value, have.get(key), f"{path}.{key}" if path else key)
            if found is not None:
                return found
        return None
    if isinstance(want, list):
        if not isinstance(have, list) or len(want) != len(have):
            return path
        for i, (w, h) in enumerate(zip(want, have, strict=True)):
            found = difference(w, h, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    return None if want == have else path


# Maps whose keys we may stop setting (an annotation removed from spec.service.annotations): a key we own in
# managedFields but no longer want means the child differs, which `difference` alone cannot see.
_OWNED_MAPS = (("metadata", "labels"), ("metadata", "annotations"), ("spec", "template", "metadata", "annotations"))


def stale_owned_keys(want: Obj, have: Obj, manager: str) -> str | None:
    for entry in (have.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") != manager or entry.get("operation") != "Apply":
            continue
        for map_path in _OWNED_MAPS:
            fields: Any = entry.get("fieldsV1") or {}
            wanted: Any = want
            for part in map_path:
                fields = (fields or {}).get(f"f:{part}") if isinstance(fields, dict) else None
                wanted = (wanted or {}).get(part) if isinstance(wanted, dict) else None
            for owned in fields or {}:
                if owned.startswith("f:") and owned[2:] not in (wanted or {}):
                    return ".".join(map_path) + "." + owned[2:] + " (no longer set)"
    return None


def _rv(obj: Obj | None) -> int:
    text = str(((obj or {}).get("metadata") or {}).get("resourceVersion") or "")
    return int(text) if text.isdigit() else -1


def _cluster_ip(service: Obj) -> str:
    return str((service.get("spec") or {}).get("clusterIP") or "")


def _controller_uid(obj: Obj | None) -> str:
    for ref in ((obj or {}).get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid") or "")
    return ""


def _decode(secret: Obj | None, key: str) -> bytes:
    try:
        return base64.b64decode(((secret or {}).get("data") or {}).get(key) or "")
    except ValueError:
        return b""


class Reconciler:
    PROGRESS_INTERVAL = 1.0  # seconds between reports of a rollout's steps (Ready itself is reported at once)

    def __init__(self, api: KubeApi, caches: Caches, settings: Settings, recorder: EventRecorder,
                 clock: Callable[[], datetime.datetime] = utcnow) -> None:
        self.api = api
        self.caches = caches
        self.settings = settings
        self.recorder = recorder
        self.clock = clock
        # What this controller wrote, by (kind, ns, name), until the cache shows that resourceVersion or newer.
        self._written: dict[tuple[str, str, str], Obj] = {}
        self._lock = threading.Lock()
        # BMCs whose rollout moved on while a progress report waits (monotonic time since when), so that a rollout
        # is reported at most every PROGRESS_INTERVAL seconds rather than at each of its steps.
        self._progress_since: dict[Key, float] = {}
        # The fleet's rollout plan, computed again after any agent Deployment changed (a cache event or our write).
        self._fleet_version = 0
        self._fleet_plan: tuple[int, rollout.Plan] | None = None
        self._fleet_phase: tuple[str, Key | None] | None = None  # what the last fleet pass woke everyone for
        # Whether a ProgressDeadlineExceeded verdict belongs to the Deployment's current template, by (namespace,
        # Deployment, its generation, the ReplicaSet named): one GET of that ReplicaSet per verdict (verdicts.py).
        self._verdicts: dict[tuple[str, str, int, str], bool] = {}
        # One member's reconcile at a time computes and applies a pool's objects.
        self._pool_locks: dict[Key, threading.Lock] = {}
        for kind, informer in (("VirtualMachineBMC", caches.bmcs), *caches.children.items()):
            informer.handlers.append(functools.partial(self._seen, kind))

    # ---- reading, with our own writes overlaid on a cache that may lag behind them

    def _cached(self, kind: str, namespace: str, name: str) -> Obj | None:
        informer = self.caches.bmcs if kind == "VirtualMachineBMC" else self.caches.children[kind]
        cached = informer.get(namespace, name)
        with self._lock:  # (_seen forgets our copy once the cache has it)
            written = self._written.get((kind, namespace, name))
        return written if written is not None and (cached is None or _rv(written) > _rv(cached)) else cached

    def _seen(self, kind: str, old: Obj | None, new: Obj | None) -> None:
        """The cache caught up with (or went past) what we wrote: forget our copy."""
        meta = (new or old or {}).get("metadata") or {}
        key = (kind, meta.get("namespace", ""), meta.get("name", ""))
        with self._lock:
            if kind == "Deployment":
                self._fleet_version += 1
            written = self._written.get(key)
            if written is not None and (new is None or _rv(new) >= _rv(written)):
                del self._written[key]

    def _remember(self, kind: str, obj: Obj) -> None:
        """Keep what we wrote until the cache has it. Its watch event may have come before our answer: then the
        cache has it already (checked under the lock _seen takes, so neither order leaves a copy behind). The
        watch may even have gone past it, the object deleted since (a child re-created for a VirtualMachineBMC
        being deleted, which the garbage collector removes at once): then the cache is the truth, and a copy kept
        here would never be forgotten."""
        meta = obj.get("metadata") or {}
        namespace, name = meta.get("namespace", ""), meta.get("name", "")
        informer = self.caches.bmcs if kind == "VirtualMachineBMC" else self.caches.children[kind]
        with self._lock:
            if kind == "Deployment":
                self._fleet_version += 1
            if _rv(informer.get(namespace, name)) < _rv(obj) and not informer.seen_through(_rv(obj)):
                self._written[(kind, namespace, name)] = obj

    # ---- the loop

    def reconcile(self, key: Key | PoolKey) -> Result:
        if isinstance(key, PoolKey):
            return self.reconcile_pool(key)
        if key == FLEET:
            return self.reconcile_fleet()
        namespace, name = key
        bmc = self._cached("VirtualMachineBMC", namespace, name)
        if bmc is None or (bmc.get("metadata") or {}).get("deletionTimestamp"):
            self._progress_since.pop(key, None)
            return Result()  # the children go with it: they carry its ownerReference
        try:
            spec = BMCSpec.of(bmc)
        except ValidationError as exc:
            log.warning("reconcile %s/%s: invalid spec: %s", namespace, name, exc)
            return Result()
        vm_name = spec.virtual_machine_ref.name
        secret_name = spec.auth_secret_ref.name if spec.auth_secret_ref else ""
        tls_ref = spec.redfish.tls.secret_ref.name if spec.redfish.tls.secret_ref else ""
        if self.caches.vms.pending(namespace, vm_name) or any(
                self.caches.secrets.pending(namespace, s) for s in (secret_name, tls_ref) if s):
            return Result()  # just referenced: the fetch's answer (Caches) enqueues this BMC again

        vm = self.caches.vms.get(namespace, vm_name)
        secret = self.caches.secrets.get(namespace, secret_name) if secret_name else None
        problem = desired.credentials_problem(spec, secret)
        tls_problem = self._tls_problem(namespace, tls_ref) if tls_ref and spec.redfish.enabled else None
        winner = self._serving(namespace, vm_name)
        if winner != name:
            return self._write_status(bmc, Observed(vm_found=vm is not None, credentials_problem=problem,
                                                    tls_problem=tls_problem, conflict_with=winner))

        blocked = self._foreign_child(bmc, vm_name)
        if blocked:
            self._write_status(bmc, Observed(vm_found=vm is not None, credentials_problem=problem,
                                             tls_problem=tls_problem, blocked_by=blocked))
            return Result(requeue_after=2.0)

        created: list[str] = []  # one Event names every child this pass created, even if a later write fails
        pool = spec.agent_pool or ""
        try:
            if pool:
                service, deployment, up_to_date = self._apply_pooled(bmc, spec, vm, problem or tls_problem, created)
            else:
                service, deployment, up_to_date = self._apply_children(bmc, spec, vm, secret, problem or tls_problem,
                                                                       created)
        except ChildRejected as exc:
            self._write_status(bmc, Observed(vm_found=vm is not None, credentials_problem=problem,
                                             tls_problem=tls_problem, rejected=str(exc), pool=pool))
            raise
        finally:
            if created:
                self.recorder.event(bmc, "Normal", "Created", "created " + ", ".join(created))
        if service is None:  # a pool without a free place
            return self._write_status(bmc, Observed(vm_found=vm is not None, credentials_problem=problem,
                                                    tls_problem=tls_problem, pool=pool, pool_full=True))
        certificate = self._certificate(namespace, spec) if deployment is not None else {}
        result = self._write_status(bmc, Observed(vm_found=vm is not None, credentials_problem=problem,
                                                  tls_problem=tls_problem, cluster_ip=_cluster_ip(service),
                                                  external=load_balancer_address(service),
                                                  deployment=None if deployment is None else self._judged(deployment),
                                                  certificate=certificate, pool=pool,
                                                  up_to_date=up_to_date,
                                                  not_serving=not_serving(bmc) if pool else ""))
        return self._until_renewal(result, certificate)

    def _apply_children(self, bmc: Obj, spec: BMCSpec, vm: Obj | None, secret: Obj | None,
                        problem: tuple[str, str] | None, created: list[str]
                        ) -> tuple[Obj, Obj | None, tuple[bool, str, str] | None]:
        """Apply the children; the agent only when its VM and Secrets are usable. Returns (Service, agent, its
        AgentUpToDate)."""
        namespace, vm_name = bmc["metadata"]["namespace"], spec.virtual_machine_ref.name
        tls_ref = spec.redfish.tls.secret_ref.name if spec.redfish.tls.secret_ref else ""
        self._apply(bmc, desired.desired_service_account(bmc, vm_name), created)
        self._apply(bmc, desired.desired_role(bmc, vm_name, desired.cdrom_disks(vm), desired.vm_claims(vm),
                                              desired.created_disks(vm)), created)
        self._apply(bmc, desired.desired_role_binding(bmc, vm_name), created)
        service = self._apply(bmc, desired.desired_service(bmc, vm_name, self.settings.default_service_type),
                              created)
        if spec.redfish.enabled:
            self._apply(bmc, desired.desired_events_secret(bmc, vm_name), created)
        if vm is None or problem is not None:
            why = "the VirtualMachine is missing" if vm is None else (problem or ("", ""))[1]
            self._remove_child(bmc, "Deployment", desired.child_name(vm_name), why)
            return service, None, None
        tls_secret = None
        if spec.redfish.enabled:
            tls_secret = (self.caches.secrets.get(namespace, tls_ref) if tls_ref
                          else self._tls_secret(bmc, vm_name, service, created))
        assert secret is not None
        deployment, up_to_date = self._apply_agent(
            bmc, desired.child_name(vm_name),
            lambda settings: desired.desired_deployment(bmc, vm_name, settings, secret, tls_secret), created)
        return service, deployment, up_to_date

    # ---- pools

    def _apply_pooled(self, bmc: Obj, spec: BMCSpec, vm: Obj | None, problem: tuple[str, str] | None,
                      created: list[str]) -> tuple[Obj | None, Obj | None, tuple[bool, str, str] | None]:
        """A member's own children (its Service, Secrets); the pool's objects are the pool's own reconcile
        (`reconcile_pool`), woken here. Returns (its Service, None when the pool has no place for it; the pool's
        agent when it serves this BMC; AgentUpToDate)."""
        namespace, name, vm_name = bmc["metadata"]["namespace"], bmc["metadata"]["name"], spec.virtual_machine_ref.name
        pool = spec.agent_pool or ""
        with self._pool_lock(namespace, pool):  # two newcomers must not take the same free slot
            slot = self._pool_plan(namespace, pool).slots.get(name)
            if slot is not None:
                service = self._apply(bmc, desired.desired_member_service(
                    bmc, vm_name, pool, slot, self.settings.default_service_type), created)
                if spec.redfish.enabled:
                    self._apply(bmc, desired.desired_events_secret(bmc, vm_name), created)
                    if vm is not None and problem is None and not spec.redfish.tls.secret_ref:
                        self._tls_secret(bmc, vm_name, service, created)
        self.caches.enqueue(PoolKey(namespace, pool))
        if slot is None:
            return None, None, None
        for kind in ("Deployment", "RoleBinding", "Role", "ServiceAccount"):  # a dedicated agent's, if any
            self._remove_child(bmc, kind, desired.child_name(vm_name), f"served by agent pool {pool}")
        if not any(member["metadata"]["name"] == name for member, *_ in self._pool_plan(namespace, pool).served):
            return service, None, None
        agent = desired.pool_name(pool)
        return service, self._cached("Deployment", namespace, agent), self._agent_state(namespace, agent)

    def _pool_lock(self, namespace: str, pool: str) -> threading.Lock:
        with self._lock:
            return self._pool_locks.setdefault((namespace, pool), threading.Lock())

    def _pool_plan(self, namespace: str, pool: str) -> PoolPlan:
        owners = sorted((b for b in self.caches.bmcs_in_pool(namespace, pool)
                         if pool_of(b) == pool and not b["metadata"].get("deletionTimestamp")),
                        key=lambda b: b["metadata"]["name"])
        oldest_first = sorted(owners, key=lambda b: (str(b["metadata"].get("creationTimestamp") or ""),
                                                     b["metadata"]["name"]))
        specs: dict[str, BMCSpec] = {}
        for b in oldest_first:
            try:
                specs[b["metadata"]["name"]] = BMCSpec.of(b)
            except ValidationError:
                continue
        slots: dict[str, int] = {}
        for name, spec in specs.items():  # a member keeps the slot its Service points at
            kept = desired.slot_of(self._cached("Service", namespace,
                                                desired.child_name(spec.virtual_machine_ref.name)))
            if kept is not None and kept not in slots.values():
                slots[name] = kept
        free = iter(k for k in range(desired.MAX_POOL_MEMBERS) if k not in set(slots.values()))
        for name in specs:
            if name not in slots:
                slot = next(free, None)
                if slot is not None:
                    slots[name] = slot
        served = []
        for b in oldest_first:
            name = b["metadata"]["name"]
            member = specs.get(name)
            if member is None or name not in slots:
                continue
            spec = member
            vm = spec.virtual_machine_ref.name
            secret = self.caches.secrets.get(namespace, spec.auth_secret_ref.name) if spec.auth_secret_ref else None
            tls_ref = spec.redfish.tls.secret_ref
            if (self._serving(namespace, vm) != name or self.caches.vms.get(namespace, vm) is None
                    or desired.credentials_problem(spec, secret) is not None
                    or (spec.redfish.enabled and tls_ref and self._tls_problem(namespace, tls_ref.name))):
                continue
            if spec.redfish.enabled and not tls_ref and self._cached(
                    "Secret", namespace, desired.tls_secret_name(vm)) is None:
                continue  # its certificate first: an entry that gained one later would restart the member
            assert secret is not None
            served.append((b, vm, secret, slots[name]))
        return PoolPlan(owners=owners, slots=slots, served=served)

    def reconcile_pool(self, key: PoolKey) -> Result:
        """A pool's own objects (ServiceAccount, Role, RoleBinding, Secret, Deployment), applied for the members
        the cache shows, or deleted once no member is left: whatever order the members went in, and whether this
        controller saw them go (after a restart, the objects' own events wake this key)."""
        namespace, pool = key.namespace, key.pool
        created: list[str] = []
        with self._pool_lock(namespace, pool):
            plan = self._pool_plan(namespace, pool)
            if not plan.owners:
                for kind in ("Deployment", "Secret", "RoleBinding", "Role", "ServiceAccount"):
                    self._delete(namespace, kind, desired.pool_name(pool), f"agent pool {pool} has no member left")
                return Result()
            actor = min(plan.owners, key=lambda b: (str(b["metadata"].get("creationTimestamp") or ""),
                                                    b["metadata"]["name"]))
            try:
                self._apply_pool(actor, namespace, pool, plan, created)
            finally:
                if created:
                    self.recorder.event(actor, "Normal", "Created", "created " + ", ".join(created))
        return Result()

    def _pool_owners(self, namespace: str, pool: str, kind: str, plan: PoolPlan) -> list[Obj]:
        """The ownerReferences of one of the pool's objects (desired.pool_owner_references): a reference goes only
        when its BMC is alive and names another pool, or none."""
        have = ((self._cached(kind, namespace, desired.pool_name(pool)) or {}).get("metadata") or {}).get(
            "ownerReferences") or []
        left = set()
        for ref in have:
            bmc = self.caches.bmcs.get(namespace, str(ref.get("name") or ""))
            if bmc is not None and bmc["metadata"].get("uid") == ref.get("uid") and pool_of(bmc) != pool:
                left.add(str(ref.get("uid")))
        return desired.pool_owner_references(have, plan.owners, left)

    def _apply_pool(self, actor: Obj, namespace: str, pool: str, plan: PoolPlan, created: list[str]) -> None:
        """The pool's ServiceAccount, Role (its members' objects by name), RoleBinding, Secret (its members) and
        Deployment, in that order: the agent may read a member's objects before it learns of the member."""
        entries, grants = [], []
        for member, vm, secret, slot in plan.served:
            spec = BMCSpec.of(member)
            tls = None
            if spec.redfish.enabled:
                ref = spec.redfish.tls.secret_ref
                tls = (self.caches.secrets.get(namespace, ref.name) if ref
                       else self._cached("Secret", namespace, desired.tls_secret_name(vm)))
            entries.append(desired.pool_member(member, vm, slot, secret, tls))
            vm_obj = self.caches.vms.get(namespace, vm)
            grants.append((member, vm, desired.cdrom_disks(vm_obj), vm_obj))

        def owners(kind: str) -> list[Obj]:
            return self._pool_owners(namespace, pool, kind, plan)

        self._apply(actor, desired.desired_pool_service_account(namespace, pool, owners("ServiceAccount")), created)
        self._apply(actor, desired.desired_pool_role(namespace, pool, owners("Role"), grants), created)
        self._apply(actor, desired.desired_pool_role_binding(namespace, pool, owners("RoleBinding")), created)
        self._apply(actor, desired.desired_pool_secret(namespace, pool, owners("Secret"), entries), created)
        deployment_owners = owners("Deployment")
        self._apply_agent(
            actor, desired.pool_name(pool),
            lambda settings: desired.desired_pool_deployment(namespace, pool, deployment_owners, settings), created)

    # ---- the fleet's rollout

    def _plan(self) -> rollout.Plan:
        """The rollout plan (controller/rollout.py) of every agent Deployment, our own writes overlaid."""
        with self._lock:
            version, memo = self._fleet_version, self._fleet_plan
            if memo is not None and memo[0] == version:
                return memo[1]
            written = [w for (kind, _, _), w in self._written.items() if kind == "Deployment"]
        agents = {rollout.key_of(d): d for d in self.caches.agents()}
        for w in written:
            if _rv(w) > _rv(agents.get(rollout.key_of(w))):
                agents[rollout.key_of(w)] = w
        # A verdict naming a ReplicaSet is judged against the whole template: the cached Deployment, not its
        # summary (Caches.agents).
        plan = rollout.plan((self._judged(self._cached("Deployment", *key) or d)
                             if verdicts.timed_out_replicaset(d) else d for key, d in agents.items()), self.settings)
        with self._lock:
            if self._fleet_version == version:
                self._fleet_plan = (version, plan)
        return plan

    def _agent_state(self, namespace: str, name: str) -> tuple[bool, str, str]:
        """AgentUpToDate of the agent Deployment `name`: at the fleet's revision, or its place in the rollout."""
        have = self._cached("Deployment", namespace, name)
        target = rollout.revision(self.settings)
        if have is not None and rollout.revision_of(have) != target:
            return self._plan().state((namespace, name))
        return rollout.up_to_date(target, self.settings.agent_image)

    def _apply_agent(self, bmc: Obj, name: str, render: Callable[[Settings], Obj],
                     created: list[str]) -> tuple[Obj | None, tuple[bool, str, str]]:
        """Apply an agent Deployment rendered with the fleet's settings when it is up to date or its turn in the
        rollout has come; else with the settings it runs (a change of its own inputs still applies at once), or
        not at all when another controller version rendered it. Returns (the Deployment, AgentUpToDate)."""
        namespace = bmc["metadata"]["namespace"]
        have = self._cached("Deployment", namespace, name)
        settings: Settings | None = self.settings
        state = self._agent_state(namespace, name)
        if not state[0]:
            assert have is not None
            settings = rollout.running_settings(self.settings, have)
        if settings is None:
            return have, state
        return self._apply(bmc, render(settings), created), state

    def reconcile_fleet(self) -> Result:
        """After an agent Deployment changed: wake the BMCs whose agents may now be updated, and every waiting one
        when the rollout halts or resumes (so that their AgentUpToDate says so); the metrics."""
        plan = self._plan()
        metrics.agents.set(plan.total)
        metrics.agents_outdated.set(len(plan.outdated))
        metrics.rollout_halted.set(1 if plan.halted_by else 0)
        phase = (plan.target, plan.halted_by)
        wake = set(plan.allowed)
        if phase != self._fleet_phase:
            if plan.halted_by is not None:
                log.warning("the rollout of agent revision %s (%s) is halted: agent Deployment %s did not become "
                            "ready (%s); %d agents keep their current revision", plan.target, plan.image,
                            "/".join(plan.halted_by), plan.halted_why, len(plan.outdated))
            self._fleet_phase = phase
            wake |= set(plan.outdated)
        for namespace, name in wake:
            deployment = self._cached("Deployment", namespace, name)
            for ref in ((deployment or {}).get("metadata") or {}).get("ownerReferences") or []:
                if ref.get("kind") == desired.KIND:
                    self.caches.enqueue((namespace, str(ref.get("name"))))
        return Result()

    def _judged(self, deployment: Obj) -> Obj:
        """`deployment` without a ProgressDeadlineExceeded verdict that was about an older template: the
        deployment controller keeps it until the new ReplicaSet progresses (verdicts.py). The ReplicaSet the
        verdict names is read once per verdict; a verdict that names none is the template's own."""
        rs_name = verdicts.timed_out_replicaset(deployment)
        if not rs_name:
            return deployment
        meta = deployment["metadata"]
        key = (meta["namespace"], meta["name"], int(meta.get("generation") or 0), rs_name)
        with self._lock:
            current = self._verdicts.get(key)
        if current is None:
            try:
                replicaset: Obj | None = self.api.request("GET", f"{REPLICA_SETS.path(key[0])}/{rs_name}")
            except ApiError as exc:
                if exc.status != 404:
                    raise  # retried: until then no verdict either way
                replicaset = None
            current = verdicts.runs_template(deployment, replicaset)
            with self._lock:
                if len(self._verdicts) > 10_000:  # verdicts of Deployments long gone or changed
                    self._verdicts.clear()
                self._verdicts[key] = current
            if not current:
                log.info("Deployment %s/%s: ignoring ProgressDeadlineExceeded of ReplicaSet %s, which does not run "
                         "its current template", key[0], key[1], rs_name)
        return deployment if current else verdicts.without_progress_verdict(deployment)

    # ---- decisions that read the caches

    def _serving(self, namespace: str, vm: str) -> str:
        """The VirtualMachineBMC that serves `vm`: the oldest one naming it (the newer ones get Conflict)."""
        live = [b for b in self.caches.bmcs_for_vm(namespace, vm) if not b["metadata"].get("deletionTimestamp")]
        if not live:
            return ""
        oldest = min(live, key=lambda b: (str(b["metadata"].get("creationTimestamp") or ""), b["metadata"]["name"]))
        return str(oldest["metadata"]["name"])

    def _foreign_child(self, bmc: Obj, vm: str) -> str:
        """A message when a child's name is taken by an object another owner controls (e.g. a deleted
        VirtualMachineBMC's children not yet garbage-collected)."""
        namespace, uid = bmc["metadata"]["namespace"], bmc["metadata"]["uid"]
        names = [(kind, desired.child_name(vm)) for kind in CHILD_KINDS if kind != "Secret"]
        for kind, name in [*names, ("Secret", desired.tls_secret_name(vm)), ("Secret", desired.ca_secret_name(vm))]:
            owner = _controller_uid(self._cached(kind, namespace, name))
            if owner and owner != uid:
                return f"{kind} {name} is controlled by another owner (uid {owner}); waiting for it to go"
        return ""

    def _tls_problem(self, namespace: str, name: str) -> tuple[str, str] | None:
        secret = self.caches.secrets.get(namespace, name)
        if secret is None:
            return "TLSSecretNotFound", f"TLS Secret {name} (spec.redfish.tls.secretRef) not found"
        if not _decode(secret, "tls.crt") or not _decode(secret, "tls.key"):
            return "TLSSecretInvalid", f"TLS Secret {name} lacks tls.crt or tls.key"
        return None

    # ---- writes

    def _apply(self, bmc: Obj, want: Obj, created: list[str]) -> Obj:
        """Apply `want` when the cached child differs; a creation is added to `created` ("Kind name")."""
        kind, meta = want["kind"], want["metadata"]
        have = self._cached(kind, meta["namespace"], meta["name"])
        why = "created" if have is None else (difference(want, have)
                                               or stale_owned_keys(want, have, self.settings.field_manager))
        if why is None:
            assert have is not None
            return have
        path = CHILD_KINDS[kind].path(meta["namespace"]) + "/" + meta["name"]
        try:
            result = self.api.request("PATCH", path, want, content_type=APPLY,
                                      query={"fieldManager": self.settings.field_manager, "force": "true"})
        except ApiError as exc:
            if exc.status in _REFUSALS:
                raise ChildRejected(kind, meta["name"], exc) from exc
            raise
        self._remember(kind, result)
        if why == "created":
            created.append(f"{kind} {meta['name']}")
        elif desired.CREDENTIALS_VERSION in why:
            self.recorder.event(bmc, "Normal", "CredentialsChanged",
                                f"the credentials Secret changed: restarting the agent ({kind} {meta['name']})")
        else:
            self.recorder.event(bmc, "Normal", "Updated", f"updated {kind} {meta['name']}: {why} differed")
        return result

    def _tls_secret(self, bmc: Obj, vm: str, service: Obj, created: list[str]) -> Obj:
        """The agent's TLS Secret: the leaf is kept until its names change or it is due for renewal, and is
        signed by the BMC's CA, which is kept for as long as it can sign (`certificates`)."""
        namespace = bmc["metadata"]["namespace"]
        now, validity = self.clock(), datetime.timedelta(seconds=self.settings.certificate_duration)
        have = self._cached("Secret", namespace, desired.tls_secret_name(vm))
        ca = self._ca(bmc, vm, now, validity, _decode(have, "ca.crt"), created)
        names = certificates.service_names(desired.child_name(vm), namespace, _cluster_ip(service),
                                           load_balancer_address(service))
        stored = None if have is None else certificates.TLSMaterial(
            _decode(have, "tls.crt"), _decode(have, "tls.key"), _decode(have, "ca.crt"))
        why = certificates.leaf_problem(stored, ca.cert_pem, names, now)
        if why is None:
            assert stored is not None
            material = stored
        else:
            log.info("issuing the certificate of %s/%s: %s", namespace, bmc["metadata"]["name"], why)
            material = certificates.issue_leaf(ca, names, now, validity)
        return self._apply(bmc, desired.desired_tls_secret(bmc, vm, material), created)

    def _ca(self, bmc: Obj, vm: str, now: datetime.datetime, leaf_validity: datetime.timedelta, served_ca: bytes,
            created: list[str]) -> certificates.KeyPair:
        """The BMC's CA from its Secret; a new one only when there is none or it can no longer sign a leaf. A
        new CA while clients may have pinned another (`served_ca`, the TLS Secret's ca.crt: the CA Secret was
        deleted, or a controller before this one made that leaf) is a Warning."""
        namespace = bmc["metadata"]["namespace"]
        have = self._cached("Secret", namespace, desired.ca_secret_name(vm))
        ca = None if have is None else certificates.KeyPair(_decode(have, "tls.crt"), _decode(have, "tls.key"))
        why = certificates.ca_problem(ca, now, leaf_validity)
        if why is not None:
            if have is not None or served_ca:
                self.recorder.event(bmc, "Warning", "CARenewed", f"a new CA in Secret {desired.ca_secret_name(vm)}"
                                    f" ({why}): clients that pinned the old ca.crt must pin the new one")
            ca = certificates.issue_ca(f"kubevbmc CA {namespace}/{vm}", now)
            self._apply(bmc, desired.desired_ca_secret(bmc, vm, ca), created)
        assert ca is not None
        return ca

    def _certificate(self, namespace: str, spec: BMCSpec) -> Obj:
        """`status.redfish.certificate` of the Secret the agent serves ({} without Redfish): a user's Secret is
        only read."""
        if not spec.redfish.enabled:
            return {}
        if spec.redfish.tls.secret_ref:
            return certificates.certificate_status(
                _decode(self.caches.secrets.get(namespace, spec.redfish.tls.secret_ref.name), "tls.crt"))
        have = self._cached("Secret", namespace, desired.tls_secret_name(spec.virtual_machine_ref.name))
        return certificates.certificate_status(_decode(have, "tls.crt"), _decode(have, "ca.crt"))

    def _until_renewal(self, result: Result, certificate: Obj) -> Result:
        """Requeue at the leaf's renewal when that comes before the next resync (which covers later ones, with
        no queue entry kept for months per BMC). A second more: renewAfter is rounded down to the second."""
        if "renewAfter" not in certificate:
            return result
        due = datetime.datetime.fromisoformat(certificate["renewAfter"])
        wait = (due - self.clock()).total_seconds() + 1.0
        if not 0 < wait <= self.settings.resync_seconds:
            return result
        return Result(requeue_after=min(wait, result.requeue_after) if result.requeue_after else wait)

    def _remove_child(self, bmc: Obj, kind: str, name: str, why: str) -> None:
        """Delete a child this BMC controls, if the cache has it."""
        have = self.caches.children[kind].get(bmc["metadata"]["namespace"], name)
        if have is None or _controller_uid(have) != bmc["metadata"]["uid"] or not self._delete(
                bmc["metadata"]["namespace"], kind, name, why):
            return
        if kind == "Deployment":
            self.recorder.event(bmc, "Normal", "AgentRemoved", f"deleted Deployment {name}: {why}")
        else:
            self.recorder.event(bmc, "Normal", "Deleted", f"deleted {kind} {name}: {why}")

    def _delete(self, namespace: str, kind: str, name: str, why: str) -> bool:
        """Delete the object the cache has by that name (that uid only); False when there was none to delete."""
        have = self.caches.children[kind].get(namespace, name)
        if have is None:
            return False
        try:
            self.api.request("DELETE", f"{CHILD_KINDS[kind].path(namespace)}/{name}", {
                "apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background",
                "preconditions": {"uid": have["metadata"]["uid"]}})
        except ApiError as exc:
            if exc.status not in (404, 409):
                raise
            return False
        log.info("deleted %s %s/%s: %s", kind, namespace, name, why)
        return True

    def _write_status(self, bmc: Obj, observed: Observed) -> Result:
        meta = bmc["metadata"]
        now = self.clock().strftime("%Y-%m-%dT%H:%M:%SZ")
        want = desired_status(bmc, observed, now)
        patch = status_patch(bmc.get("status"), want)
        key = (meta["namespace"], meta["name"])
        if patch is not None and progress_only(bmc.get("status"), patch):
            since = self._progress_since.setdefault(key, time.monotonic())
            wait = self.PROGRESS_INTERVAL - (time.monotonic() - since)
            if wait > 0:
                return Result(requeue_after=wait)
        self._progress_since.pop(key, None)
        if patch is None:
            return Result()
        path = f"{BMCS.path(meta['namespace'])}/{meta['name']}/status"
        result = self.api.request("PATCH", path, {"status": patch}, content_type=MERGE_PATCH)
        self._remember("VirtualMachineBMC", result)
        for cond in transitions(bmc.get("status"), want):
            # Ready's reason and message name the first thing that is not ready. A rollout in progress is no
            # problem: it shows in the condition (and the agent's own Events), not as a Warning.
            if cond["type"] == "Ready" and cond["reason"] not in IN_PROGRESS:
                ok = cond["status"] == "True"
                self.recorder.event(bmc, "Normal" if ok else "Warning", cond["reason"], cond["message"])
            elif cond["type"] == AGENT_UP_TO_DATE and cond["reason"] == "RolloutHalted":
                self.recorder.event(bmc, "Warning", "RolloutHalted", cond["message"])
        return Result()

