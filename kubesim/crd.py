"""CustomResourceDefinitions: a CRD that is stored becomes a kind that is served, from its schema."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

from . import cel
from .loop import ControlLoop
from .objects import set_condition
from .resources import ResourceType
from .store import DELETED, Event, Store

Obj = dict[str, Any]
CRD_KEY = "apiextensions.k8s.io/customresourcedefinitions"


def resource_type(crd: Obj) -> ResourceType:
    spec = crd["spec"]
    names = spec["names"]
    versions = [v for v in spec.get("versions") or [] if v.get("served", True)]
    storage = next((v for v in spec.get("versions") or [] if v.get("storage")), versions[0])
    schema = ((storage.get("schema") or {}).get("openAPIV3Schema")) or {
        "type": "object", "x-kubernetes-preserve-unknown-fields": True}
    selectable = frozenset(f["jsonPath"].lstrip(".") for f in storage.get("selectableFields") or [])
    return ResourceType(
        group=spec["group"], version=storage["name"], kind=names["kind"], plural=names["plural"],
        singular=names.get("singular") or names["kind"].lower(), namespaced=spec.get("scope") != "Cluster",
        versions=tuple(v["name"] for v in versions), short_names=tuple(names.get("shortNames") or ()),
        categories=tuple(names.get("categories") or ()),
        status_subresource="status" in (storage.get("subresources") or {}),
        has_generation=True, delete_returns_object=True, schema=schema,
        printer_columns=tuple(storage.get("additionalPrinterColumns") or ()), field_labels=selectable, crd=True,
        rules=cel.rule_validator(schema),  # x-kubernetes-validations, compiled once per CRD version
    )


class CRDController(ControlLoop):
    """Serves each CRD as soon as it is stored and reports it Established, as the apiextensions server does."""

    name = "crd-controller"
    kinds = (CRD_KEY,)

    def __init__(self, store: Store) -> None:
        super().__init__(store)

    def _hear(self, event: Event) -> None:
        if event.rtype.key != CRD_KEY:
            return
        spec = event.obj.get("spec") or {}
        key = f"{spec.get('group')}/{(spec.get('names') or {}).get('plural')}"
        if event.type == DELETED:
            self.store.remove_type(key)
            return
        self.store.add_type(resource_type(event.obj))
        super()._hear(event)

    def keys_for(self, event: Event) -> Iterable[Hashable]:
        return [event.obj["metadata"]["name"]]

    def sync(self, key: Hashable) -> float | None:
        rtype = self.store.type(CRD_KEY)

        def establish(crd: Obj) -> bool:
            status = crd.setdefault("status", {})
            before = dict(status)
            conditions = status.get("conditions") or []
            conditions = set_condition(conditions, "NamesAccepted", "True", "NoConflicts", "no conflicts found")
            conditions = set_condition(conditions, "Established", "True", "InitialNamesAccepted",
                                       "the initial names have been accepted")
            status["conditions"] = conditions
            status["acceptedNames"] = crd["spec"]["names"]
            status["storedVersions"] = [v["name"] for v in crd["spec"].get("versions") or [] if v.get("storage")]
            return status != before

        self.store.mutate(rtype, "", str(key), establish, subresource="status",
                          manager="kube-apiserver")
        return None
