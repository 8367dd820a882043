"""kube-controller-manager's persistent volume controller, with a dynamic provisioner behind it.

A PersistentVolumeClaim is bound as soon as it is seen (a StorageClass with `volumeBindingMode: Immediate`): the
controller sets `spec.volumeName`, the bind annotations, and `status` {phase Bound, accessModes, capacity}. The
capacity is the request: a provisioner may round it up, never down (pkg/controller/volume/persistentvolume,
pv_controller.go bindClaimToVolume and updateClaimStatus). kubesim serves no PersistentVolume kind: the volume is
named `pvc-<claim uid>` as external provisioners name theirs, and exists only in that name.

Its bytes are a file (kubesim/volumes.py, `<state_dir>/volumes/<namespace>/<claim>.img`): once a claim created
directly is bound, a sparse file of its requested size (all zeros: a new empty volume); the claim of a DataVolume
gets its file from CDI's importer instead (kubesim/cdi.py), when the import completes. When a claim is deleted
(its DELETED event: deleted itself, by the garbage collector with its DataVolume, or with its namespace), its file is
removed, whoever wrote it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

from .loop import ControlLoop
from .store import DELETED, Event, Store
from .volumes import VolumeFiles, quantity_bytes

Obj = dict[str, Any]

CLAIM_KEY = "/persistentvolumeclaims"
BIND_COMPLETED = "pv.kubernetes.io/bind-completed"
BOUND_BY_CONTROLLER = "pv.kubernetes.io/bound-by-controller"


def imported(claim: Obj) -> bool:
    """Whether a DataVolume owns the claim: CDI writes its volume (kubesim/cdi.py), not the provisioner."""
    return any(ref.get("kind") == "DataVolume" and str(ref.get("apiVersion", "")).startswith("cdi.kubevirt.io/")
               for ref in claim["metadata"].get("ownerReferences") or [])


def bound_status(claim: Obj) -> Obj:
    """The status the controller writes once a claim is bound to a volume of exactly its request."""
    spec = claim.get("spec") or {}
    request = ((spec.get("resources") or {}).get("requests") or {}).get("storage")
    return {"phase": "Bound", "accessModes": list(spec.get("accessModes") or []),
            "capacity": {"storage": request}}


class ClaimBinder(ControlLoop):
    """Binds every Pending claim to a volume provisioned for it."""

    name = "persistentvolume-binder"
    kinds = (CLAIM_KEY,)
    manager = "kube-controller-manager"

    def __init__(self, store: Store, volumes: VolumeFiles | None = None) -> None:
        super().__init__(store)
        self.volumes = volumes  # None: no volume files are written

    def keys_for(self, event: Event) -> Iterable[Hashable]:
        meta = event.obj["metadata"]
        if event.type == DELETED:
            # (namespace, name, uid): the deleted claim's file is removed by sync (no I/O here: under the lock).
            return [(meta.get("namespace", ""), meta["name"], meta.get("uid", ""))] if self.volumes is not None else []
        return [(meta.get("namespace", ""), meta["name"])]

    def _provision(self, ns: str, name: str, claim: Obj) -> None:
        """The new volume's bytes: a sparse file of the claim's request."""
        if self.volumes is None or imported(claim):
            return
        spec = claim.get("spec") or {}
        size = quantity_bytes(((spec.get("resources") or {}).get("requests") or {}).get("storage"))
        if size is None:
            return
        uid = claim["metadata"]["uid"]
        rtype = self.store.type(CLAIM_KEY)

        def wanted() -> bool:
            current = self.store.find(rtype, ns, name)
            return (current is not None and current["metadata"]["uid"] == uid
                    and not current["metadata"].get("deletionTimestamp"))

        self.volumes.ensure_sparse(ns, name, size, uid, wanted)

    def sync(self, key: Hashable) -> float | None:
        assert isinstance(key, tuple)
        if len(key) == 3:
            ns, name, uid = key
            if self.volumes is not None:
                self.volumes.remove(ns, name, uid)
            return None
        ns, name = key
        rtype = self.store.type(CLAIM_KEY)
        claim = self.store.find(rtype, ns, name)
        if claim is None or claim["metadata"].get("deletionTimestamp"):
            return None
        if (claim.get("status") or {}).get("phase") == "Bound":
            self._provision(ns, name, claim)
            return None
        volume = f"pvc-{claim['metadata']['uid']}"

        def bind(obj: Obj) -> bool:
            if obj.get("spec", {}).get("volumeName") == volume:
                return False
            obj.setdefault("spec", {})["volumeName"] = volume
            obj["metadata"].setdefault("annotations", {}).update({BIND_COMPLETED: "yes", BOUND_BY_CONTROLLER: "yes"})
            return True

        claim = self.store.mutate(rtype, ns, name, bind, manager=self.manager) or claim
        status = bound_status(claim)
        self._provision(ns, name, claim)
        self.store.mutate(rtype, ns, name, lambda o: o.__setitem__("status", status), subresource="status",
                          manager=self.manager)
        return None


def install(cluster: Any) -> None:
    """Register the binder with `cluster`, writing into the cluster's volume files."""
    cluster.add_component(ClaimBinder(cluster.store, getattr(cluster, "volumes", None)))
