"""The controller's watch caches and the indexes that map an event to the VirtualMachineBMCs it concerns.

Scoped as DESIGN.md section 4 asks: every VirtualMachineBMC; VMs and Secrets only when a VirtualMachineBMC
references them (or, for Secrets, when they carry the managed-by label: the generated TLS Secrets); children only
with the managed-by label. The VM and Secret watches still stream the namespace's objects (a watch cannot select
a set of names), but only referenced ones are kept, and VMs are kept slimmed to what the controller reads.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .desired import AGENT, MANAGED_BY, MANAGER, NAME_LABEL, OWNER_LABEL, POOL_LABEL, pool_name
from .informer import Informer, Key, Kind
from .kubeapi import KubeApi
from .rollout import REVISION
from .settings import FIELD_MANAGER
from .spec import GROUP, KIND, VERSION

Obj = dict[str, Any]

BMCS = Kind(GROUP, VERSION, "virtualmachinebmcs")
VMS = Kind("kubevirt.io", "v1", "virtualmachines")
SECRETS = Kind("", "v1", "secrets")
SERVICE_ACCOUNTS = Kind("", "v1", "serviceaccounts")
SERVICES = Kind("", "v1", "services")
ROLES = Kind("rbac.authorization.k8s.io", "v1", "roles")
ROLE_BINDINGS = Kind("rbac.authorization.k8s.io", "v1", "rolebindings")
DEPLOYMENTS = Kind("apps", "v1", "deployments")
REPLICA_SETS = Kind("apps", "v1", "replicasets")  # not cached: read by name when a Deployment's verdict names one
CHILD_KINDS = {"ServiceAccount": SERVICE_ACCOUNTS, "Service": SERVICES, "Role": ROLES, "RoleBinding": ROLE_BINDINGS,
               "Deployment": DEPLOYMENTS, "Secret": SECRETS}


# The work queue's key for the fleet's rollout (controller/rollout.py): no VirtualMachineBMC has an empty name.
FLEET: Key = ("", "")


@dataclass(frozen=True)
class PoolKey:
    """The work queue's key for a pool's own objects (reconciler.reconcile_pool): not a tuple, so that it never
    equals a VirtualMachineBMC's (namespace, name)."""

    namespace: str
    pool: str


def pool_of(bmc: Obj | None) -> str:
    return str(((bmc or {}).get("spec") or {}).get("agentPool") or "")


def is_agent(deployment: Obj | None) -> bool:
    return ((deployment or {}).get("metadata") or {}).get("labels", {}).get(NAME_LABEL) == AGENT


def refs(bmc: Obj) -> tuple[str, list[str]]:
    """(the VM, the Secrets) a VirtualMachineBMC references."""
    spec = bmc.get("spec") or {}
    vm = str((spec.get("virtualMachineRef") or {}).get("name") or "")
    secrets = [str((spec.get("authSecretRef") or {}).get("name") or ""),
               str((((spec.get("redfish") or {}).get("tls") or {}).get("secretRef") or {}).get("name") or "")]
    return vm, [s for s in secrets if s]


# What the reconciler reads beyond the fields it applies: identity, ownership, server-assigned addresses, status.
_KEPT_METADATA = ("name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
                  "deletionTimestamp", "labels", "ownerReferences")
_KEPT_SPEC = ("clusterIP", "clusterIPs")


def without_managed_fields(obj: Obj, _cached: Obj | None = None) -> Obj:
    (obj.get("metadata") or {}).pop("managedFields", None)
    return _interned(obj)


def slim_bmc(obj: Obj, _cached: Obj | None = None) -> Obj:
    """A VirtualMachineBMC without what the controller never reads: its managedFields and annotations (kubectl
    apply's last-applied-configuration is a second copy of the spec)."""
    meta = obj.get("metadata") or {}
    meta.pop("managedFields", None)
    meta.pop("annotations", None)
    return _interned(obj)


def slim_child(obj: Obj, cached: Obj | None = None) -> Obj:
    """A child as the reconciler needs it: what this controller applied (walked along its managedFields), plus
    identity, ownership, server-assigned addresses and status. At 1,000 BMCs the full objects, with the fields
    the server defaulted, were most of the controller's memory. Objects it never applied (a user's Secret) are
    kept whole, without managedFields.

    A Deployment changes mostly in its status: when its generation and our apply's time are those of the cached
    copy, what we applied is unchanged and the cached projection is reused."""
    meta = obj.get("metadata") or {}
    entries = [m for m in meta.get("managedFields") or []
               if m.get("manager") == FIELD_MANAGER and m.get("operation") == "Apply"]
    if not entries:
        return without_managed_fields(obj)
    fields: Obj = entries[0].get("fieldsV1") or {}
    if len(entries) > 1:  # one per subresource at most; the controller applies only the main resource
        fields = {}
        for entry in entries:
            _merge_fields(fields, entry.get("fieldsV1") or {})
    # stale_owned_keys reads which map keys we own: our entry is kept for those maps only.
    mine = [{"manager": FIELD_MANAGER, "operation": "Apply", "fieldsV1": _owned_maps(fields),
             "times": [e.get("time") for e in entries]}]
    cached_meta = (cached or {}).get("metadata") or {}
    if cached is not None and "generation" in meta and meta.get("generation") == cached_meta.get("generation") \
            and mine == cached_meta.get("managedFields"):
        out = {k: v for k, v in cached.items() if k not in ("metadata", "spec", "status")}
        out["spec"] = dict(cached.get("spec") or {})
        out_meta = {k: v for k, v in cached_meta.items() if k not in _KEPT_METADATA}
    else:
        out = _project(obj, fields)
        out_meta = {k: v for k, v in (out.get("metadata") or {}).items() if k not in _KEPT_METADATA}
    out_meta["managedFields"] = mine
    out["metadata"] = out_meta
    for key in _KEPT_METADATA:
        if key in meta:
            out_meta[key] = _interned(meta[key])
    spec = obj.get("spec")
    if isinstance(spec, dict) and any(key in spec for key in _KEPT_SPEC):
        out["spec"] = {**(out.get("spec") or {}), **{key: spec[key] for key in _KEPT_SPEC if key in spec}}
    if "status" in obj:
        out["status"] = _interned(obj["status"])
    out["apiVersion"], out["kind"] = obj.get("apiVersion"), obj.get("kind")
    return out


def _merge_fields(into: Obj, tree: Obj) -> None:
    for key, child in tree.items():
        _merge_fields(into.setdefault(key, {}), child if isinstance(child, dict) else {})


def _interned(value: Any) -> Any:
    """The same JSON value with its strings interned: thousands of children repeat the same keys and words."""
    if isinstance(value, str):
        return sys.intern(value)
    if isinstance(value, dict):
        return {sys.intern(k): _interned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_interned(v) for v in value]
    return value


def _project(value: Any, fields: Obj) -> Any:
    """`value` limited to the fieldsV1 tree `fields` (a leaf, or ".", keeps the whole value), strings interned."""
    if not fields:
        return _interned(value)
    if isinstance(value, dict):
        out = {}
        for key, sub in fields.items():
            if key.startswith("f:") and key[2:] in value:
                out[sys.intern(key[2:])] = _project(value[key[2:]], sub)
        return out
    if isinstance(value, list):
        keyed = [(json.loads(k[2:]), sub) for k, sub in fields.items() if k.startswith("k:")]
        listed = {k[2:] for k in fields if k.startswith("v:")}
        items = []
        for item in value:
            if isinstance(item, dict):
                sub = next((sub for ident, sub in keyed if all(item.get(f) == v for f, v in ident.items())), None)
                if sub is not None:
                    items.append(_project(item, {k: v for k, v in sub.items() if k != "."}) or _interned(item))
            elif json.dumps(item, separators=(",", ":")) in listed:
                items.append(_interned(item))
        return items
    return _interned(value)


def _owned_maps(fields: Obj) -> Obj:
    out: Obj = {}
    for path in (("metadata", "labels"), ("metadata", "annotations"),
                 ("spec", "template", "metadata", "annotations")):
        node: Any = fields
        for part in path:
            node = node.get("f:" + part) if isinstance(node, dict) else None
        if node:
            target = out
            for part in path:
                target = target.setdefault("f:" + part, {})
            target.update({k: {} for k in node})
    return out


def fleet_view(deployment: Obj) -> Obj:
    """An agent Deployment as the fleet's rollout reads it (rollout.plan, verdicts): identity, generation,
    replicas and deadline, the template's revision annotation, the status. A verdict that names a ReplicaSet is
    checked against the whole template, read from the cache (Reconciler._judged)."""
    meta, spec = deployment.get("metadata") or {}, deployment.get("spec") or {}
    template_meta = ((spec.get("template") or {}).get("metadata") or {})
    return {"apiVersion": deployment.get("apiVersion"), "kind": deployment.get("kind"),
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "generation", "labels",
                                              "ownerReferences") if k in meta},
            "spec": {**{k: spec[k] for k in ("replicas", "progressDeadlineSeconds") if k in spec},
                     "template": {"metadata": {"annotations": {
                         k: v for k, v in (template_meta.get("annotations") or {}).items() if k == REVISION}}}},
            "status": deployment.get("status") or {}}


def slim_vm(vm: Obj, _cached: Obj | None = None) -> Obj:
    meta = vm.get("metadata") or {}
    disks = (((((vm.get("spec") or {}).get("template") or {}).get("spec") or {}).get("domain") or {})
             .get("devices") or {}).get("disks") or []
    return {"apiVersion": vm.get("apiVersion"), "kind": vm.get("kind"),
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "generation",
                                              "creationTimestamp", "deletionTimestamp") if k in meta},
            "spec": {"template": {"spec": {"domain": {"devices": {"disks": [
                {"name": d.get("name"), **({"cdrom": {}} if "cdrom" in d else {})} for d in disks
                if isinstance(d, dict)]}}}}}}


def changed(old: Obj | None, new: Obj | None, ignore: tuple[str, ...] = ()) -> bool:
    """Whether an event changed what the reconciler reads: more than the resourceVersion (and `ignore`)."""
    if old is None or new is None:
        return True

    def seen(obj: Obj) -> Obj:
        meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "resourceVersion"}
        return {**{k: v for k, v in obj.items() if k not in ignore}, "metadata": meta}

    return seen(old) != seen(new)


def _agent_report(bmc: Obj | None) -> Any:
    """What a pool's agent says of this member (status.agent): the one part of the status the reconciler reads."""
    return ((bmc or {}).get("status") or {}).get("agent")


class Caches:
    def __init__(self, api: KubeApi, namespace: str, enqueue: Callable[[Key | PoolKey], None]) -> None:
        self.enqueue = enqueue
        self._lock = threading.Lock()
        self._by_vm: dict[Key, set[str]] = {}      # (ns, vm) -> BMC names
        self._by_secret: dict[Key, set[str]] = {}  # (ns, secret) -> BMC names
        self._refs: dict[Key, tuple[str, list[str]]] = {}
        self._by_pool: dict[Key, set[str]] = {}  # (ns, pool) -> BMC names
        self._pools: dict[Key, str] = {}  # (ns, BMC) -> its pool
        selector = f"{MANAGED_BY}={MANAGER}"
        self.bmcs = Informer(api, BMCS, namespace=namespace, transform=slim_bmc)
        # Held pickled (Informer's `compact`): at 10,000 VirtualMachineBMCs these caches as dicts were most of the
        # controller's memory (a Deployment as applied was 15 KB of dicts). The fleet's rollout plans over every
        # agent Deployment: it reads their summaries (`_fleet`, dicts), not the pickles. VirtualMachineBMCs, read
        # by every path, stay dicts.
        self.vms = Informer(api, VMS, namespace=namespace, keep=self._vm_wanted, transform=slim_vm, compact=True)
        self.secrets = Informer(api, SECRETS, namespace=namespace, keep=self._secret_wanted, transform=slim_child,
                                compact=True)
        self.children = {kind: Informer(api, k, namespace=namespace, label_selector=selector, transform=slim_child,
                                        compact=True)
                         for kind, k in CHILD_KINDS.items() if kind != "Secret"}
        self._fleet: dict[Key, Obj] = {}  # agent Deployments as the rollout reads them (fleet_view)
        self.children["Secret"] = self.secrets
        self.bmcs.handlers.append(self._on_bmc)
        self.vms.handlers.append(self._on_vm)
        # A BMC waiting on a fetch (`pending`) is not requeued on a timer: the answer enqueues it, found or not.
        self.vms.resolved.append(lambda ns, name: self._by_key(self._by_vm, ns, name))
        self.secrets.resolved.append(lambda ns, name: self._by_key(self._by_secret, ns, name))
        self.secrets.handlers.append(self._on_secret)
        for kind, informer in self.children.items():
            if kind != "Secret":
                informer.handlers.append(self._on_child)
        self.children["Deployment"].handlers.insert(0, self._on_deployment)

    def informers(self) -> list[Informer]:
        return [self.bmcs, self.vms, *self.children.values()]

    def start(self, timeout: float) -> bool:
        """BMCs first (the others' `keep` reads their references), then the rest; True once all are synced. Called
        again after a timeout, it waits on (a restarted controller at 10,000 BMCs on a loaded machine took more
        than 30 s to list everything, and starting the informers twice raised)."""
        self.bmcs.start()
        if not self.bmcs.wait_synced(timeout):
            return False
        rest = [i for i in self.informers() if i is not self.bmcs]
        for informer in rest:
            informer.start()
        return all(i.wait_synced(timeout) for i in rest)

    def stop(self) -> None:
        for informer in self.informers():
            informer.stop()

    @property
    def synced(self) -> bool:
        return all(i.synced for i in self.informers())

    def bmcs_for_vm(self, namespace: str, vm: str) -> list[Obj]:
        with self._lock:
            names = list(self._by_vm.get((namespace, vm), ()))
        return [b for b in (self.bmcs.get(namespace, n) for n in names) if b is not None]

    def bmcs_in_pool(self, namespace: str, pool: str) -> list[Obj]:
        with self._lock:
            names = list(self._by_pool.get((namespace, pool), ()))
        return [b for b in (self.bmcs.get(namespace, n) for n in names) if b is not None]

    def agents(self) -> list[Obj]:
        """Every agent Deployment, dedicated and pooled: the fleet a rollout goes through, as `fleet_view`s."""
        with self._lock:
            return list(self._fleet.values())

    # ---- keep predicates and handlers

    def _vm_wanted(self, obj: Obj) -> bool:
        meta = obj.get("metadata") or {}
        with self._lock:
            return bool(self._by_vm.get((meta.get("namespace", ""), meta.get("name", ""))))

    def _secret_wanted(self, obj: Obj) -> bool:
        meta = obj.get("metadata") or {}
        if (meta.get("labels") or {}).get(MANAGED_BY) == MANAGER:
            return True
        with self._lock:
            return bool(self._by_secret.get((meta.get("namespace", ""), meta.get("name", ""))))

    def _on_bmc(self, old: Obj | None, new: Obj | None) -> None:
        obj = new or old
        assert obj is not None
        if not changed(old, new, ignore=("status",)) and _agent_report(old) == _agent_report(new):
            return  # its status (ours, or the agent's boot record): nothing to reconcile
        meta = obj["metadata"]
        ns, name = meta["namespace"], meta["name"]
        before = self._refs.get((ns, name))
        after = refs(new) if new is not None else None
        pools = {self._pools.get((ns, name), ""), pool_of(new)}
        with self._lock:
            old_pool = self._pools.pop((ns, name), "")
            self._by_pool.get((ns, old_pool), set()).discard(name)
            if new is not None and pool_of(new):
                self._pools[(ns, name)] = pool_of(new)
                self._by_pool.setdefault((ns, pool_of(new)), set()).add(name)
            if before is not None:
                self._by_vm.get((ns, before[0]), set()).discard(name)
                for s in before[1]:
                    self._by_secret.get((ns, s), set()).discard(name)
            if after is not None:
                self._refs[(ns, name)] = after
                self._by_vm.setdefault((ns, after[0]), set()).add(name)
                for s in after[1]:
                    self._by_secret.setdefault((ns, s), set()).add(name)
            else:
                self._refs.pop((ns, name), None)
        if after is not None and after != before:
            self.vms.track(ns, after[0])
            for s in after[1]:
                self.secrets.track(ns, s)
        if before is not None and after != before:
            self.vms.forget_unkept()
            self.secrets.forget_unkept()
        self.enqueue((ns, name))
        # Who serves a VM depends on every BMC that names it: a change to one concerns the others.
        for vm in {r[0] for r in (before, after) if r is not None}:
            for other in self.bmcs_for_vm(ns, vm):
                self.enqueue((ns, other["metadata"]["name"]))
        # A pool's agent serves every member: one joining or leaving changes the pool's objects and what the others
        # apply (a slot freed).
        for pool in pools - {""}:
            self.enqueue(PoolKey(ns, pool))
            for other in self.bmcs_in_pool(ns, pool):
                self.enqueue((ns, other["metadata"]["name"]))

    def _by_index(self, index: dict[Key, set[str]], obj: Obj | None) -> None:
        if obj is not None:
            meta = obj["metadata"]
            self._by_key(index, meta.get("namespace", ""), meta.get("name", ""))

    def _by_key(self, index: dict[Key, set[str]], namespace: str, name: str) -> None:
        with self._lock:
            names = list(index.get((namespace, name), ()))
        for bmc in names:
            self.enqueue((namespace, bmc))

    def _on_vm(self, old: Obj | None, new: Obj | None) -> None:
        """Only what the reconciler reads of a VM (slim_vm) wakes its BMCs: not a status-only update, nor a
        re-list that finds it unchanged."""
        if changed(old, new):
            self._by_index(self._by_vm, old or new)

    def _on_secret(self, old: Obj | None, new: Obj | None) -> None:
        if not changed(old, new):
            return
        obj = new or old
        self._by_index(self._by_secret, obj)
        self._on_child(old, new)

    def _on_deployment(self, old: Obj | None, new: Obj | None) -> None:
        obj = new or old
        assert obj is not None
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        with self._lock:
            if new is not None and is_agent(new):
                self._fleet[key] = fleet_view(new)
            else:
                self._fleet.pop(key, None)
        if is_agent(obj) and changed(old, new):
            self.enqueue(FLEET)

    def _on_child(self, old: Obj | None, new: Obj | None) -> None:
        obj = new or old
        if obj is None or not changed(old, new):
            return
        meta = obj.get("metadata") or {}
        pool = str((meta.get("labels") or {}).get(POOL_LABEL) or "")
        if pool and meta.get("name") == pool_name(pool):  # one of a pool's own objects
            self.enqueue(PoolKey(meta.get("namespace", ""), pool))
        owners = {r.get("name") for r in meta.get("ownerReferences") or [] if r.get("kind") == KIND}
        label = (meta.get("labels") or {}).get(OWNER_LABEL)
        for name in owners | ({label} if label else set()):
            if name:
                self.enqueue((meta.get("namespace", ""), name))
