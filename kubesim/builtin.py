"""Kubernetes' built-in kinds, with the defaults kube-apiserver fills in and the checks it makes."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from . import cel
from .resources import ResourceType
from .tolerations import default_toleration_seconds

Obj = dict[str, Any]
Cause = dict[str, str]


def _default_probe(probe: Any) -> None:
    if not isinstance(probe, dict):
        return
    for key, value in (("timeoutSeconds", 1), ("periodSeconds", 10), ("successThreshold", 1),
                       ("failureThreshold", 3)):
        probe.setdefault(key, value)
    if isinstance(probe.get("httpGet"), dict):
        probe["httpGet"].setdefault("scheme", "HTTP")
        probe["httpGet"].setdefault("path", "/")


def default_pod_spec(spec: Obj) -> None:
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("securityContext", {})
    spec.setdefault("enableServiceLinks", True)
    if spec.get("serviceAccountName") and "serviceAccount" not in spec:
        spec["serviceAccount"] = spec["serviceAccountName"]
    for container in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        if not isinstance(container, dict):
            continue
        container.setdefault("terminationMessagePath", "/dev/termination-log")
        container.setdefault("terminationMessagePolicy", "File")
        if "imagePullPolicy" not in container:
            image = str(container.get("image") or "")
            tag = image.rsplit("/", 1)[-1]
            latest = "@" not in tag and (":" not in tag or tag.endswith(":latest"))
            container["imagePullPolicy"] = "Always" if latest else "IfNotPresent"
        container.setdefault("resources", {})
        for port in container.get("ports") or []:
            if isinstance(port, dict):
                port.setdefault("protocol", "TCP")
        for key in ("readinessProbe", "livenessProbe", "startupProbe"):
            _default_probe(container.get(key))
        for env in container.get("env") or []:
            ref = (env.get("valueFrom") or {}).get("fieldRef") if isinstance(env, dict) else None
            if isinstance(ref, dict):
                ref.setdefault("apiVersion", "v1")
    for volume in spec.get("volumes") or []:
        if isinstance(volume, dict) and isinstance(volume.get("secret"), dict):
            volume["secret"].setdefault("defaultMode", 420)


def _default_pod(obj: Obj) -> None:
    default_pod_spec(obj.setdefault("spec", {}))
    default_toleration_seconds(obj["spec"])
    obj.setdefault("status", {}).setdefault("phase", "Pending")
    obj["status"].setdefault("qosClass", "BestEffort")


def _default_deployment(obj: Obj) -> None:
    spec = obj.setdefault("spec", {})
    spec.setdefault("replicas", 1)
    spec.setdefault("revisionHistoryLimit", 10)
    spec.setdefault("progressDeadlineSeconds", 600)
    strategy = spec.setdefault("strategy", {})
    strategy.setdefault("type", "RollingUpdate")
    if strategy["type"] == "RollingUpdate":
        rolling = strategy.setdefault("rollingUpdate", {})
        rolling.setdefault("maxSurge", "25%")
        rolling.setdefault("maxUnavailable", "25%")
    template = spec.setdefault("template", {})
    template.setdefault("metadata", {})
    default_pod_spec(template.setdefault("spec", {}))


def _default_replicaset(obj: Obj) -> None:
    spec = obj.setdefault("spec", {})
    spec.setdefault("replicas", 1)
    default_pod_spec(spec.setdefault("template", {}).setdefault("spec", {}))


def _default_service(obj: Obj) -> None:
    spec = obj.setdefault("spec", {})
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    if spec["type"] != "ExternalName":
        spec.setdefault("ipFamilies", ["IPv4"])
        spec.setdefault("ipFamilyPolicy", "SingleStack")
        spec.setdefault("internalTrafficPolicy", "Cluster")
    if spec["type"] in ("NodePort", "LoadBalancer"):
        spec.setdefault("externalTrafficPolicy", "Cluster")
    if spec["type"] == "LoadBalancer":
        spec.setdefault("allocateLoadBalancerNodePorts", True)
    for port in spec.get("ports") or []:
        if isinstance(port, dict):
            port.setdefault("protocol", "TCP")
            if "port" in port:
                port.setdefault("targetPort", port["port"])
    obj.setdefault("status", {}).setdefault("loadBalancer", {})


def _validate_service(obj: Obj, old: Obj | None) -> list[Cause]:
    causes: list[Cause] = []
    spec = obj.get("spec") or {}
    if spec.get("type") not in ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName"):
        causes.append({"field": "spec.type", "message": f'Unsupported value: "{spec.get("type")}": supported '
                       'values: "ClusterIP", "ExternalName", "LoadBalancer", "NodePort"',
                       "reason": "FieldValueNotSupported"})
    ports = spec.get("ports") or []
    if spec.get("type") != "ExternalName" and not ports and spec.get("clusterIP") != "None":
        causes.append({"field": "spec.ports", "message": "Required value", "reason": "FieldValueRequired"})
    seen = set()
    for i, port in enumerate(ports):
        if not isinstance(port, dict) or not isinstance(port.get("port"), int) or not 0 < port["port"] < 65536:
            causes.append({"field": f"spec.ports[{i}].port", "message": "Invalid value: must be between 1 and "
                           "65535, inclusive"})
            continue
        if port.get("protocol") not in ("TCP", "UDP", "SCTP"):
            causes.append({"field": f"spec.ports[{i}].protocol", "message": f'Unsupported value: '
                           f'"{port.get("protocol")}": supported values: "SCTP", "TCP", "UDP"',
                           "reason": "FieldValueNotSupported"})
        key = (port["port"], port.get("protocol"))
        if key in seen:
            causes.append({"field": f"spec.ports[{i}]", "message": f"Duplicate value: {port}",
                           "reason": "FieldValueDuplicate"})
        seen.add(key)
        if len(ports) > 1 and not port.get("name"):
            causes.append({"field": f"spec.ports[{i}].name", "message": "Required value",
                           "reason": "FieldValueRequired"})
    if old is not None:
        old_ip = (old.get("spec") or {}).get("clusterIP")
        if old_ip and spec.get("clusterIP") and spec["clusterIP"] != old_ip:
            causes.append({"field": "spec.clusterIPs[0]", "message": "Invalid value: field is immutable"})
    return causes


def _validate_deployment(obj: Obj, old: Obj | None) -> list[Cause]:
    causes: list[Cause] = []
    spec = obj.get("spec") or {}
    selector = (spec.get("selector") or {}).get("matchLabels") or {}
    labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
    if not spec.get("selector"):
        causes.append({"field": "spec.selector", "message": "Required value", "reason": "FieldValueRequired"})
    elif any(labels.get(k) != v for k, v in selector.items()):
        causes.append({"field": "spec.template.metadata.labels", "message": f"Invalid value: {labels}: "
                       "`selector` does not match template `labels`"})
    if spec.get("strategy", {}).get("type") not in ("RollingUpdate", "Recreate"):
        causes.append({"field": "spec.strategy.type", "message": "Unsupported value", "reason":
                       "FieldValueNotSupported"})
    if old is not None and (old.get("spec") or {}).get("selector") != spec.get("selector"):
        causes.append({"field": "spec.selector", "message": f"Invalid value: {spec.get('selector')}: field is "
                       "immutable"})
    containers = ((spec.get("template") or {}).get("spec") or {}).get("containers")
    if not containers:
        causes.append({"field": "spec.template.spec.containers", "message": "Required value",
                       "reason": "FieldValueRequired"})
    return causes


def _validate_pod(obj: Obj, old: Obj | None) -> list[Cause]:
    spec = obj.get("spec") or {}
    causes: list[Cause] = []
    if not spec.get("containers"):
        causes.append({"field": "spec.containers", "message": "Required value", "reason": "FieldValueRequired"})
    for i, c in enumerate(spec.get("containers") or []):
        if not isinstance(c, dict) or not c.get("name"):
            causes.append({"field": f"spec.containers[{i}].name", "message": "Required value",
                           "reason": "FieldValueRequired"})
        if isinstance(c, dict) and not c.get("image"):
            causes.append({"field": f"spec.containers[{i}].image", "message": "Required value",
                           "reason": "FieldValueRequired"})
    return causes


def _default_secret(obj: Obj) -> None:
    obj.setdefault("type", "Opaque")
    string_data = obj.pop("stringData", None)
    if isinstance(string_data, dict):
        data = obj.setdefault("data", {})
        for key, value in string_data.items():
            data[key] = base64.b64encode(str(value).encode()).decode()


def _validate_secret(obj: Obj, old: Obj | None) -> list[Cause]:
    causes: list[Cause] = []
    for key, value in (obj.get("data") or {}).items():
        try:
            base64.b64decode(str(value), validate=True)
        except (binascii.Error, ValueError):
            causes.append({"field": f"data[{key}]", "message": "Invalid value: illegal base64 data"})
    if old is not None and old.get("immutable") and (old.get("data") != obj.get("data")):
        causes.append({"field": "data", "message": "Forbidden: field is immutable when `immutable` is set",
                       "reason": "FieldValueForbidden"})
    return causes


def _default_claim(obj: Obj) -> None:
    """SetDefaults_PersistentVolumeClaim: Filesystem volume mode; a new claim is Pending until it is bound."""
    spec = obj.setdefault("spec", {})
    if isinstance(spec, dict):
        spec.setdefault("volumeMode", "Filesystem")
    obj.setdefault("status", {}).setdefault("phase", "Pending")


def _validate_claim(obj: Obj, old: Obj | None) -> list[Cause]:
    """ValidatePersistentVolumeClaimSpec: access modes and a storage request are required; once bound, only the
    request may change (and only grow, which kubesim does not check)."""
    spec = obj.get("spec") or {}
    causes: list[Cause] = []
    if not spec.get("accessModes"):
        causes.append({"field": "spec.accessModes", "reason": "FieldValueRequired",
                       "message": "Required value: at least 1 access mode is required"})
    if not ((spec.get("resources") or {}).get("requests") or {}).get("storage"):
        causes.append({"field": "spec.resources[storage]", "reason": "FieldValueRequired",
                       "message": "Required value"})
    if old is not None:
        before, after = dict(old.get("spec") or {}), dict(spec)
        for s in (before, after):
            s.pop("resources", None)
            s.pop("volumeName", None)  # the binder writes it once
        if before != after:
            causes.append({"field": "spec", "reason": "FieldValueForbidden",
                           "message": "Forbidden: spec is immutable after creation except resources.requests "
                                      "and volumeAttributesClassName for bound claims"})
    return causes


def _default_namespace(obj: Obj) -> None:
    name = obj.get("metadata", {}).get("name")
    if name:
        obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = name
    obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
    obj.setdefault("status", {}).setdefault("phase", "Active")


def _default_rolebinding(obj: Obj) -> None:
    for subject in obj.get("subjects") or []:
        if isinstance(subject, dict) and "apiGroup" not in subject:
            subject["apiGroup"] = "" if subject.get("kind") == "ServiceAccount" else "rbac.authorization.k8s.io"


def _validate_rolebinding(obj: Obj, old: Obj | None) -> list[Cause]:
    if not isinstance(obj.get("roleRef"), dict) or not obj["roleRef"].get("name"):
        return [{"field": "roleRef.name", "message": "Required value", "reason": "FieldValueRequired"}]
    if old is not None and old.get("roleRef") != obj.get("roleRef"):
        return [{"field": "roleRef", "message": "Invalid value: cannot change roleRef"}]
    return []


def _pod_grace(obj: Obj, requested: int | None) -> int:
    status = obj.get("status") or {}
    if not (obj.get("spec") or {}).get("nodeName") or status.get("phase") in ("Succeeded", "Failed"):
        return 0
    if requested is not None:
        return max(0, requested)
    return int((obj.get("spec") or {}).get("terminationGracePeriodSeconds", 30))


_POD_FIELDS = frozenset({"spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName",
                         "spec.hostNetwork", "status.phase", "status.podIP", "status.nominatedNodeName"})
_EVENT_FIELDS = frozenset({"involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
                           "involvedObject.uid", "involvedObject.apiVersion", "involvedObject.resourceVersion",
                           "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type"})
_EVENTS_V1_FIELDS = frozenset({"regarding.kind", "regarding.namespace", "regarding.name", "regarding.uid",
                               "regarding.apiVersion", "reason", "reportingController", "type"})


def builtin_types() -> list[ResourceType]:
    rbac = "rbac.authorization.k8s.io"
    return [
        ResourceType("", "v1", "Namespace", "namespaces", "namespace", namespaced=False, short_names=("ns",),
                     status_subresource=True, defaulter=_default_namespace, label_names=True, spec_finalizers=True,
                     field_labels=frozenset({"status.phase"})),
        ResourceType("", "v1", "Node", "nodes", "node", namespaced=False, short_names=("no",),
                     status_subresource=True),
        ResourceType("", "v1", "Pod", "pods", "pod", short_names=("po",), categories=("all",),
                     status_subresource=True, has_generation=True, delete_returns_object=True,
                     defaulter=_default_pod, validator=_validate_pod, grace_period=_pod_grace,
                     field_labels=_POD_FIELDS),
        ResourceType("", "v1", "Service", "services", "service", short_names=("svc",), categories=("all",),
                     status_subresource=True, defaulter=_default_service, validator=_validate_service,
                     label_names=True, delete_returns_object=True),  # ReturnDeletedObject (service storage.go)
        ResourceType("", "v1", "Secret", "secrets", "secret", defaulter=_default_secret,
                     validator=_validate_secret, field_labels=frozenset({"type"})),
        ResourceType("", "v1", "ConfigMap", "configmaps", "configmap", short_names=("cm",)),
        ResourceType("", "v1", "PersistentVolumeClaim", "persistentvolumeclaims", "persistentvolumeclaim",
                     short_names=("pvc",), status_subresource=True, defaulter=_default_claim,
                     delete_returns_object=True,
                     validator=_validate_claim),
        ResourceType("", "v1", "ServiceAccount", "serviceaccounts", "serviceaccount", short_names=("sa",)),
        ResourceType("", "v1", "Event", "events", "event", short_names=("ev",), field_labels=_EVENT_FIELDS),
        ResourceType("", "v1", "Endpoints", "endpoints", "endpoints", short_names=("ep",)),
        ResourceType("apps", "v1", "Deployment", "deployments", "deployment", short_names=("deploy",),
                     categories=("all",), status_subresource=True, has_generation=True,
                     defaulter=_default_deployment, validator=_validate_deployment, status_writes_metadata=True),
        ResourceType("apps", "v1", "ReplicaSet", "replicasets", "replicaset", short_names=("rs",),
                     categories=("all",), status_subresource=True, has_generation=True,
                     defaulter=_default_replicaset, field_labels=frozenset({"status.replicas"})),
        ResourceType(rbac, "v1", "Role", "roles", "role"),
        ResourceType(rbac, "v1", "RoleBinding", "rolebindings", "rolebinding", defaulter=_default_rolebinding,
                     validator=_validate_rolebinding),
        ResourceType(rbac, "v1", "ClusterRole", "clusterroles", "clusterrole", namespaced=False),
        ResourceType(rbac, "v1", "ClusterRoleBinding", "clusterrolebindings", "clusterrolebinding",
                     namespaced=False, defaulter=_default_rolebinding, validator=_validate_rolebinding),
        ResourceType("coordination.k8s.io", "v1", "Lease", "leases", "lease"),
        ResourceType("events.k8s.io", "v1", "Event", "events", "event", short_names=("ev",),
                     field_labels=_EVENTS_V1_FIELDS),
        ResourceType("apiextensions.k8s.io", "v1", "CustomResourceDefinition", "customresourcedefinitions",
                     "customresourcedefinition", namespaced=False, short_names=("crd", "crds"),
                     status_subresource=True, has_generation=True, validator=cel.check_crd),
    ]
