"""kube-controller-manager's persistent volume controller, with a dynamic provisioner behind it.

A PersistentVolumeClaim is bound as soon as it is seen (a StorageClass with `volumeBindingMode: Immediate`): the
controller sets `spec.volumeName`, the bind annotations, and `status` {phase Bound, accessModes, capacity}. The
capacity is the request: a provisioner may round it up, never down (pkg/controller/volume/persistentvolume,
pv_controller.go bindClaimToVolume and updateClaimStatus). kubesim serves no PersistentVolume kind: the volume is
named `pvc-<claim uid>` as external provisioners name theirs, and exists only in that name.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

from .loop import ControlLoop
from .store import DELETED, Event, Store

Obj = dict[str, Any]

CLAIM_KEY = "/persistentvolumeclaims"
BIND_COMPLETED = "pv.kubernetes.io/bind-completed"
BOUND_BY_CONTROLLER = "pv.kubernetes.io/bound-by-controller"


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

    def __init__(self, store: Store) -> None:
        super().__init__(store)

    def keys_for(self, event: Event) -> Iterable[Hashable]:
        if event.type == DELETED:
            return []
        meta = event.obj["metadata"]
        return [(meta.get("namespace", ""), meta["name"])]

    def sync(self, key: Hashable) -> float | None:
        assert isinstance(key, tuple)
        ns, name = key
        rtype = self.store.type(CLAIM_KEY)
        claim = self.store.find(rtype, ns, name)
        if claim is None or claim["metadata"].get("deletionTimestamp"):
            return None
        if (claim.get("status") or {}).get("phase") == "Bound":
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
        self.store.mutate(rtype, ns, name, lambda o: o.__setitem__("status", status), subresource="status",
                          manager=self.manager)
        return None


def install(cluster: Any) -> None:
    cluster.add_component(ClaimBinder(cluster.store))
