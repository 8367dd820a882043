"""The Table (meta.k8s.io/v1) that `kubectl get` asks for, with kube-apiserver's columns.

Built-in kinds print as kube-apiserver's printers do (kubernetes pkg/printers/internalversion/printers.go): the
server always generates the wide columns (priority 1), and kubectl shows those only with `-o wide`. A custom
resource prints its CRD's additionalPrinterColumns, or Age when it declares none. Any other kind gets the default
table, Name and Created At. Everything here is a pure function of the objects and the current time.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

from .jsonpath import evaluate
from .objects import parse_time
from .resources import ResourceType

Obj = dict[str, Any]
Row = list[Any]

_NAME_DOC = ("Name must be unique within a namespace. Is required when creating resources, although some resources "
             "may allow a client to request the generation of an appropriate name automatically. Name is primarily "
             "intended for creation idempotence and configuration definition. Cannot be updated. More info: "
             "https://kubernetes.io/docs/concepts/overview/working-with-objects/names#names")
_AGE_DOC = ("CreationTimestamp is a timestamp representing the server time when this object was created. It is not "
            "guaranteed to be set in happens-before order across separate operations. Clients may not set this "
            "value. It is represented in RFC3339 form and is in UTC.")


def column(name: str, kind: str = "string", priority: int = 0, description: str = "", fmt: str = "") -> Obj:
    return {"name": name, "type": kind, "format": fmt, "description": description, "priority": priority}


NAME = column("Name", fmt="name", description=_NAME_DOC)
AGE = column("Age", description=_AGE_DOC)
_TEMPLATE_WIDE = (column("Containers", priority=1, description="Names of each container in the template."),
                  column("Images", priority=1, description="Images referenced by each container in the template."),
                  column("Selector", priority=1, description="Label selector for pods."))


# ---- the cells' formats


def human_duration(seconds: float) -> str:
    """apimachinery's duration.HumanDuration, as an Age column shows a time since."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d{hours % 24}h" if hours % 24 else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f"{hours // 24 // 365}y{days}d" if days else f"{hours // 24 // 365}y"
    return f"{hours // 24 // 365}y"


def since(timestamp: Any, now: float) -> str:
    """translateTimestampSince: `<unknown>` for no time."""
    if not isinstance(timestamp, str) or not timestamp:
        return "<unknown>"
    try:
        at = parse_time(timestamp[:19] + "Z")
    except ValueError:
        return "<unknown>"
    return human_duration(now - at)


def format_labels(labels: Any) -> str:
    """labels.FormatLabels: sorted `k=v` pairs, `<none>` for none."""
    if not isinstance(labels, dict) or not labels:
        return "<none>"
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def format_selector(selector: Any) -> str:
    """A LabelSelector as metav1.LabelSelectorAsSelector(...).String() prints it."""
    if not isinstance(selector, dict):
        return "<none>"
    terms: list[tuple[str, str]] = [(k, f"{k}={v}") for k, v in (selector.get("matchLabels") or {}).items()]
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key", ""), expr.get("operator", ""), sorted(expr.get("values") or [])
        text = {"In": f"{key} in ({','.join(values)})", "NotIn": f"{key} notin ({','.join(values)})",
                "Exists": key, "DoesNotExist": f"!{key}"}.get(op, key)
        terms.append((key, text))
    return ",".join(text for _, text in sorted(terms))


def _containers(template_spec: Any) -> tuple[str, str]:
    containers = [c for c in (template_spec or {}).get("containers") or [] if isinstance(c, dict)]
    return ",".join(str(c.get("name", "")) for c in containers), ",".join(str(c.get("image", "")) for c in containers)


# ---- one row per kind


def pod_row(pod: Obj, now: float) -> Row:
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    phase = status.get("phase", "")
    reason = status.get("reason") or phase
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("reason") == "SchedulingGated":
            reason = "SchedulingGated"
    restarts, ready, last_restart = 0, 0, ""
    has_running = False
    for cs in reversed(status.get("containerStatuses") or []):
        restarts += int(cs.get("restartCount") or 0)
        finished = ((cs.get("lastState") or {}).get("terminated") or {}).get("finishedAt") or ""
        last_restart = max(last_restart, finished)
        state = cs.get("state") or {}
        waiting, terminated = state.get("waiting"), state.get("terminated")
        if waiting and waiting.get("reason"):
            reason = waiting["reason"]
        elif terminated and terminated.get("reason"):
            reason = terminated["reason"]
        elif terminated:
            reason = (f"Signal:{terminated['signal']}" if terminated.get("signal")
                      else f"ExitCode:{terminated.get('exitCode', 0)}")
        elif cs.get("ready") and "running" in state:
            has_running = True
            ready += 1
    if reason == "Completed" and has_running:
        pod_ready = any(c.get("type") == "Ready" for c in status.get("conditions") or [])
        reason = "Running" if pod_ready else "NotReady"
    if pod["metadata"].get("deletionTimestamp") and phase not in ("Succeeded", "Failed"):
        reason = "Unknown" if status.get("reason") == "NodeLost" else "Terminating"
    restarts_text = str(restarts)
    if restarts and last_restart:
        restarts_text = f"{restarts} ({since(last_restart, now)} ago)"
    ips = status.get("podIPs") or []
    ip = (ips[0].get("ip") if ips else "") or status.get("podIP") or "<none>"
    gates = spec.get("readinessGates") or []
    gates_text = "<none>"
    if gates:
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        gates_text = f"{sum(conditions.get(g.get('conditionType')) == 'True' for g in gates)}/{len(gates)}"
    return [pod["metadata"]["name"], f"{ready}/{len(spec.get('containers') or [])}", reason, restarts_text,
            since(pod["metadata"].get("creationTimestamp"), now), ip, spec.get("nodeName") or "<none>",
            status.get("nominatedNodeName") or "<none>", gates_text]


def pod_conditions(pod: Obj) -> list[Obj]:
    phase = (pod.get("status") or {}).get("phase")
    if phase == "Succeeded":
        return [{"type": "Completed", "status": "True", "reason": "Succeeded",
                 "message": "The pod has completed successfully."}]
    if phase == "Failed":
        return [{"type": "Completed", "status": "True", "reason": "Failed", "message": "The pod failed."}]
    return []


def _external_ip(svc: Obj) -> str:
    spec = svc.get("spec") or {}
    kind, external = spec.get("type", "ClusterIP"), list(spec.get("externalIPs") or [])
    if kind in ("ClusterIP", "NodePort"):
        return ",".join(external) if external else "<none>"
    if kind == "LoadBalancer":
        ingress = ((svc.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
        found = [i.get("ip") or i.get("hostname") for i in ingress if i.get("ip") or i.get("hostname")]
        if found or external:
            return ",".join([*found, *external])
        return "<pending>"
    if kind == "ExternalName":
        return str(spec.get("externalName", ""))
    return "<unknown>"


def service_row(svc: Obj, now: float) -> Row:
    spec = svc.get("spec") or {}
    ips = spec.get("clusterIPs") or ([spec["clusterIP"]] if spec.get("clusterIP") else [])
    ports = ",".join(f"{p.get('port')}:{p['nodePort']}/{p.get('protocol', 'TCP')}" if p.get("nodePort") else
                     f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in spec.get("ports") or [])
    return [svc["metadata"]["name"], spec.get("type", "ClusterIP"), ips[0] if ips else "<none>", _external_ip(svc),
            ports or "<none>", since(svc["metadata"].get("creationTimestamp"), now),
            format_labels(spec.get("selector"))]


def deployment_row(obj: Obj, now: float) -> Row:
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    containers, images = _containers((spec.get("template") or {}).get("spec"))
    return [obj["metadata"]["name"], f"{int(status.get('readyReplicas') or 0)}/{int(spec.get('replicas', 1))}",
            int(status.get("updatedReplicas") or 0), int(status.get("availableReplicas") or 0),
            since(obj["metadata"].get("creationTimestamp"), now), containers, images,
            format_selector(spec.get("selector"))]


def replicaset_row(obj: Obj, now: float) -> Row:
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    containers, images = _containers((spec.get("template") or {}).get("spec"))
    return [obj["metadata"]["name"], int(spec.get("replicas", 1)), int(status.get("replicas") or 0),
            int(status.get("readyReplicas") or 0), since(obj["metadata"].get("creationTimestamp"), now), containers,
            images, format_selector(spec.get("selector"))]


def _micro_since(timestamp: Any, now: float) -> str:
    if not isinstance(timestamp, str) or not timestamp:
        return "<unknown>"
    try:
        at = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return "<unknown>"
    return human_duration(now - at)


def _event_row(name: str, kind: str, target: str, field_path: str, source: str, message: str, first: str,
               last: str, event_time: str, series: Any, count: int, event_type: str, reason: str,
               now: float) -> Row:
    first_seen = since(first, now) if first else _micro_since(event_time, now)
    last_seen = since(last, now) if last else first_seen
    if isinstance(series, dict):
        last_seen = _micro_since(series.get("lastObservedTime"), now)
        count = int(series.get("count") or 0)
    elif not count:
        count = 1  # a singleton event of the new API has no count
    obj_ref = f"{kind.lower()}/{target}" if target else kind.lower()
    return [last_seen, event_type, reason, obj_ref, field_path, source, message.strip(), first_seen, count, name]


def _event_source(component: str, host: str, controller: str, instance: str) -> str:
    component, host = component or controller, host or instance
    return f"{component}, {host}" if host else component


def event_row(ev: Obj, now: float) -> Row:
    involved, source = ev.get("involvedObject") or {}, ev.get("source") or {}
    return _event_row(
        ev["metadata"]["name"], str(involved.get("kind", "")), str(involved.get("name", "")),
        str(involved.get("fieldPath", "")),
        _event_source(source.get("component", ""), source.get("host", ""), ev.get("reportingComponent", ""),
                      ev.get("reportingInstance", "")),
        str(ev.get("message", "")), ev.get("firstTimestamp") or "", ev.get("lastTimestamp") or "",
        ev.get("eventTime") or "", ev.get("series"), int(ev.get("count") or 0), str(ev.get("type", "")),
        str(ev.get("reason", "")), now)


def events_v1_row(ev: Obj, now: float) -> Row:
    """events.k8s.io/v1 Event: the same internal type and printer as the core one, under its new field names."""
    regarding, source = ev.get("regarding") or {}, ev.get("deprecatedSource") or {}
    return _event_row(
        ev["metadata"]["name"], str(regarding.get("kind", "")), str(regarding.get("name", "")),
        str(regarding.get("fieldPath", "")),
        _event_source(source.get("component", ""), source.get("host", ""), ev.get("reportingController", ""),
                      ev.get("reportingInstance", "")),
        str(ev.get("note", "")), ev.get("deprecatedFirstTimestamp") or "", ev.get("deprecatedLastTimestamp") or "",
        ev.get("eventTime") or "", ev.get("series"), int(ev.get("deprecatedCount") or 0), str(ev.get("type", "")),
        str(ev.get("reason", "")), now)


def _format_endpoints(ep: Obj) -> str:
    addresses: list[str] = []
    total = 0
    for subset in ep.get("subsets") or []:
        ports = subset.get("ports") or []
        for address in subset.get("addresses") or []:
            for port in ports or [None]:
                total += 1
                if len(addresses) < 3:
                    ip = str(address.get("ip", ""))
                    addresses.append(f"{ip}:{port.get('port')}" if port else ip)
    if not addresses:
        return "<none>"
    text = ",".join(addresses)
    return f"{text} + {total - 3} more..." if total > 3 else text


def _node_status(node: Obj) -> str:
    conditions = {c.get("type"): c.get("status") for c in (node.get("status") or {}).get("conditions") or []}
    ready = conditions.get("Ready")
    status = "Ready" if ready == "True" else "NotReady" if ready is not None else "Unknown"
    return f"{status},SchedulingDisabled" if (node.get("spec") or {}).get("unschedulable") else status


def _node_roles(node: Obj) -> str:
    labels = node["metadata"].get("labels") or {}
    roles = sorted({k.split("/", 1)[1] for k in labels if k.startswith("node-role.kubernetes.io/") and
                    k.split("/", 1)[1]} | {v for k, v in labels.items() if k == "kubernetes.io/role" and v})
    return ",".join(roles) if roles else "<none>"


def node_row(node: Obj, now: float) -> Row:
    status = node.get("status") or {}
    info = status.get("nodeInfo") or {}
    addresses = {a.get("type"): a.get("address") for a in status.get("addresses") or []}
    return [node["metadata"]["name"], _node_status(node), _node_roles(node),
            since(node["metadata"].get("creationTimestamp"), now), info.get("kubeletVersion", ""),
            addresses.get("InternalIP") or "<none>", addresses.get("ExternalIP") or "<none>",
            info.get("osImage") or "<unknown>", info.get("kernelVersion") or "<unknown>",
            info.get("containerRuntimeVersion") or "<unknown>"]


def _subjects(binding: Obj) -> tuple[str, str, str]:
    users, groups, accounts = [], [], []
    for s in binding.get("subjects") or []:
        kind, name = s.get("kind"), str(s.get("name", ""))
        if kind == "User":
            users.append(name)
        elif kind == "Group":
            groups.append(name)
        elif kind == "ServiceAccount":
            accounts.append(f"{s.get('namespace', '')}/{name}")
    return ", ".join(users), ", ".join(groups), ", ".join(accounts)


def binding_row(obj: Obj, now: float) -> Row:
    ref = obj.get("roleRef") or {}
    return [obj["metadata"]["name"], f"{ref.get('kind', '')}/{ref.get('name', '')}",
            since(obj["metadata"].get("creationTimestamp"), now), *_subjects(obj)]


def created_at_row(obj: Obj, now: float) -> Row:
    """The default table's row (and roles'): the name and the creation time in RFC3339."""
    return [obj["metadata"]["name"], obj["metadata"].get("creationTimestamp", "")]


def _data_count(obj: Obj) -> int:
    return len(obj.get("data") or {}) + len(obj.get("binaryData") or {})


Printer = tuple[tuple[Obj, ...], Callable[[Obj, float], Row]]
_CREATED_AT = column("Created At", "date", description=_AGE_DOC)
DEFAULT: Printer = ((NAME, _CREATED_AT), created_at_row)
_EVENT_COLUMNS = (
    column("Last Seen", description="The time at which the most recent occurrence of this event was recorded."),
    column("Type", description="Type of this event (Normal, Warning), new types could be added in the future"),
    column("Reason", description="This should be a short, machine understandable string that gives the reason for "
                                 "the transition into the object's current status."),
    column("Object", description="The object that this event is about."),
    column("Subobject", priority=1, description="If referring to a piece of an object instead of an entire object, "
                                                "this string should contain a valid JSON/Go-field access statement."),
    column("Source", priority=1, description="The component reporting this event."),
    column("Message", description="A human-readable description of the status of this operation."),
    column("First Seen", priority=1, description="The time at which the event was first recorded."),
    column("Count", priority=1, description="The number of times this event has occurred."),
    column("Name", priority=1, fmt="name", description=_NAME_DOC),
)
_BINDING_COLUMNS = (NAME, column("Role", description="Role of the RoleBinding"), AGE,
                    column("Users", priority=1, description="Users in the RoleBinding"),
                    column("Groups", priority=1, description="Groups in the RoleBinding"),
                    column("ServiceAccounts", priority=1, description="ServiceAccounts in the RoleBinding"))


def _simple(*cells: Callable[[Obj], Any]) -> Callable[[Obj, float], Row]:
    """A row of the name, `cells` and the age."""
    def row(obj: Obj, now: float) -> Row:
        return [obj["metadata"]["name"], *(cell(obj) for cell in cells),
                since(obj["metadata"].get("creationTimestamp"), now)]
    return row


PRINTERS: dict[str, Printer] = {
    "/pods": ((NAME, column("Ready", description="The aggregate readiness state of this pod for accepting traffic."),
               column("Status", description="The aggregate status of the containers in this pod."),
               column("Restarts", description="The number of times the containers in this pod have been restarted "
                                              "and when the last container in this pod has restarted."),
               AGE, column("IP", priority=1, description="podIP address allocated to the pod."),
               column("Node", priority=1, description="NodeName indicates in which node this pod is scheduled."),
               column("Nominated Node", priority=1, description="nominatedNodeName is set when this pod preempts "
                                                                "one or more pods on the node."),
               column("Readiness Gates", priority=1, description="If specified, all readiness gates will be "
                                                                 "evaluated for pod readiness.")), pod_row),
    "/services": ((NAME, column("Type", description="type determines how the Service is exposed."),
                   column("Cluster-IP", description="clusterIP is the IP address of the service."),
                   column("External-IP", description="externalIPs is a list of IP addresses for which nodes in the "
                                                     "cluster will also accept traffic for this service."),
                   column("Port(s)", description="The list of ports that are exposed by this service."), AGE,
                   column("Selector", priority=1, description="Route service traffic to pods with label keys and "
                                                              "values matching this selector.")), service_row),
    "apps/deployments": ((NAME, column("Ready", description="Number of the pod with ready state"),
                          column("Up-to-date", "integer", description="Total number of non-terminated pods targeted "
                                 "by this deployment that have the desired template spec."),
                          column("Available", "integer", description="Total number of available pods (ready for at "
                                 "least minReadySeconds) targeted by this deployment."), AGE, *_TEMPLATE_WIDE),
                         deployment_row),
    "apps/replicasets": ((NAME, column("Desired", "integer", description="Replicas is the number of desired pods."),
                          column("Current", "integer", description="Replicas is the most recently observed number "
                                                                       "of replicas."),
                          column("Ready", "integer", description="The number of ready replicas for this replica "
                                                                   "set."), AGE, *_TEMPLATE_WIDE), replicaset_row),
    "/events": (_EVENT_COLUMNS, event_row),
    "events.k8s.io/events": (_EVENT_COLUMNS, events_v1_row),
    "/secrets": ((NAME, column("Type", description="Used to facilitate programmatic handling of secret data."),
                  column("Data", description="Data contains the secret data."), AGE),
                 _simple(lambda o: o.get("type", ""), lambda o: len(o.get("data") or {}))),
    "/serviceaccounts": ((NAME, column("Secrets", description="Secrets is a list of the secrets in the same "
                                                              "namespace that pods running using this "
                                                              "ServiceAccount are allowed to use."), AGE),
                         _simple(lambda o: len(o.get("secrets") or []))),
    "/configmaps": ((NAME, column("Data", description="Data contains the configuration data."), AGE),
                    _simple(_data_count)),
    "/endpoints": ((NAME, column("Endpoints", description="The set of all endpoints is the union of all subsets."),
                    AGE), _simple(_format_endpoints)),
    "/namespaces": ((NAME, column("Status", description="The status of the namespace"), AGE),
                    _simple(lambda o: (o.get("status") or {}).get("phase", ""))),
    "/nodes": ((NAME, column("Status", description="The status of the node"),
                column("Roles", description="The roles of the node"), AGE,
                column("Version", description="Kubelet Version reported by the node."),
                column("Internal-IP", priority=1, description="List of addresses reachable to the node."),
                column("External-IP", priority=1, description="List of addresses reachable to the node."),
                column("OS-Image", priority=1, description="OS Image reported by the node."),
                column("Kernel-Version", priority=1, description="Kernel Version reported by the node."),
                column("Container-Runtime", priority=1, description="ContainerRuntime Version reported by the "
                                                                    "node.")), node_row),
    "coordination.k8s.io/leases": ((NAME, column("Holder", description="The holder of the lease"), AGE),
                                   _simple(lambda o: (o.get("spec") or {}).get("holderIdentity", ""))),
    "rbac.authorization.k8s.io/roles": ((NAME, _CREATED_AT), created_at_row),
    "rbac.authorization.k8s.io/clusterroles": ((NAME, _CREATED_AT), created_at_row),
    "rbac.authorization.k8s.io/rolebindings": (_BINDING_COLUMNS, binding_row),
    "rbac.authorization.k8s.io/clusterrolebindings": (_BINDING_COLUMNS, binding_row),
}


def _custom_printer(rtype: ResourceType) -> Printer:
    """A custom resource: its printer columns, or Age (CRDs declare no other default)."""
    printer = list(rtype.printer_columns) or [
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    columns = (NAME, *(column(c["name"], c.get("type", "string"), int(c.get("priority", 0)),
                              c.get("description", ""), c.get("format", "")) for c in printer))

    def row(obj: Obj, now: float) -> Row:
        cells: Row = [obj["metadata"]["name"]]
        for col in printer:
            values = evaluate(col["jsonPath"], obj)
            value = values[0] if values else None
            if col.get("type") == "date" and isinstance(value, str):
                value = since(value, now)
            cells.append(value)
        return cells
    return columns, row


def printer_for(rtype: ResourceType) -> Printer:
    if rtype.crd:
        return _custom_printer(rtype)
    return PRINTERS.get(rtype.key, DEFAULT)


def table(rtype: ResourceType, items: list[Obj], rv: str, cont: str | None, include: str, now: float) -> Obj:
    """A Table of `items`; `include` is includeObject: None, Metadata (the default) or Object."""
    columns, row = printer_for(rtype)
    rows = []
    for obj in items:
        out: Obj = {"cells": row(obj, now)}
        if rtype.key == "/pods":
            conditions = pod_conditions(obj)
            if conditions:
                out["conditions"] = conditions
        if include == "Object":
            out["object"] = obj
        elif include != "None":
            out["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                             "metadata": obj["metadata"]}
        rows.append(out)
    meta: Obj = {"resourceVersion": rv}
    if cont:
        meta["continue"] = cont
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": meta, "columnDefinitions": list(columns),
            "rows": rows}

