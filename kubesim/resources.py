"""The kinds kubesim serves: built-in kinds and kinds defined by CustomResourceDefinitions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]
Cause = dict[str, str]

# Field labels every kind supports in a field selector.
COMMON_FIELDS = frozenset({"metadata.name", "metadata.namespace"})


@dataclass(eq=False)
class ResourceType:
    group: str
    version: str  # the storage version
    kind: str
    plural: str
    singular: str
    namespaced: bool = True
    versions: tuple[str, ...] = ()  # served versions; () means just `version`
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    status_subresource: bool = False
    # metadata.generation is kept (1 on create, bumped on every change outside metadata and status).
    has_generation: bool = False
    # a DELETE that removes the object at once answers with the object (pods, custom resources) or a Status.
    delete_returns_object: bool = False
    # Field labels usable in fieldSelector beyond metadata.name and metadata.namespace.
    field_labels: frozenset[str] = frozenset()
    # openAPIV3Schema (custom resources): validation, defaults and pruning.
    schema: Obj | None = None
    printer_columns: tuple[Obj, ...] = ()
    # Built-in defaulting and validation (schemaless kinds); both see the object about to be stored.
    defaulter: Callable[[Obj], None] | None = None
    validator: Callable[[Obj, Obj | None], list[Cause]] | None = None
    # x-kubernetes-validations (custom resources): (new, old, the schema's causes, which may block the rules).
    rules: Callable[[Obj, Obj | None, list[Cause]], list[Cause]] | None = None
    # Associative lists for merge and server-side apply: field name -> key fields (None: atomic by default).
    list_keys: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Seconds a DELETE waits for (pods: the kubelet stops the containers first); 0 removes at once.
    grace_period: Callable[[Obj, int | None], int] | None = None
    # Names must be DNS-1123 labels (63 characters, no dots) rather than subdomains.
    label_names: bool = False
    # Deletion also waits for `spec.finalizers` (namespaces).
    spec_finalizers: bool = False
    crd: bool = False
    # What a write through /status may change in metadata besides managedFields: nothing for most kinds; all but
    # the labels for Deployments (their status strategy resets only spec and labels), which is how the deployment
    # controller sets its revision annotation in the same UpdateStatus as its Progressing condition.
    status_writes_metadata: bool = False

    @property
    def key(self) -> str:
        return f"{self.group}/{self.plural}"

    @property
    def served_versions(self) -> tuple[str, ...]:
        return self.versions or (self.version,)

    def api_version(self, version: str | None = None) -> str:
        v = version or self.version
        return f"{self.group}/{v}" if self.group else v

    @property
    def qualified(self) -> str:
        """`plural.group`, as errors name a resource."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def supports_field(self, label: str) -> bool:
        return label in COMMON_FIELDS or label in self.field_labels


# Keys of associative lists in built-in kinds (the patchMergeKey / listMapKeys of the Kubernetes types).
BUILTIN_LIST_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "ephemeralContainers": ("name",),
    "env": ("name",),
    "volumes": ("name",),
    "volumeMounts": ("mountPath",),
    "volumeDevices": ("devicePath",),
    "imagePullSecrets": ("name",),
    "conditions": ("type",),
    "ownerReferences": ("uid",),
    "hostAliases": ("ip",),
    "topologySpreadConstraints": ("topologyKey", "whenUnsatisfiable"),
    "resourceClaims": ("name",),
    "containerStatuses": ("name",),
}
# `ports` is keyed differently in a container (containerPort, protocol) and a Service (port, protocol).
CONTAINER_PORT_KEYS = ("containerPort", "protocol")
SERVICE_PORT_KEYS = ("port", "protocol")
