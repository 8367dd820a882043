"""The children of one VirtualMachineBMC as plain dicts: pure functions of (VirtualMachineBMC, VM, Secret,
settings), which are exactly what the controller applies with server-side apply.

Every child is named `<vm>-virtbmc` (KubeVirtBMC's names, so in-cluster DNS names carry over), labelled
managed-by kubevbmc plus the owning VirtualMachineBMC, and controlled by it (deleting the CR deletes them).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

from . import rollout
from .certificates import KeyPair, TLSMaterial
from .settings import Settings
from .spec import API_VERSION, KIND, BMCSpec

Obj = dict[str, Any]

MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "kubevbmc"
OWNER_LABEL = "bmc.kubevirt.io/vmbmc"
VM_LABEL = "bmc.kubevirt.io/vm"
NAME_LABEL = "app.kubernetes.io/name"
AGENT = "kubevbmc-agent"
CREDENTIALS_VERSION = "bmc.kubevirt.io/credentials-version"
TLS_CHECKSUM = "bmc.kubevirt.io/tls-checksum"

IPMI_PORT, HTTP_PORT, HTTPS_PORT = 10623, 10080, 10443
TLS_DIR = "/etc/kubevbmc/tls"
RUN_DIR = "/var/run/kubevbmc"
CREDENTIAL_KEYS = ("username", "password")


MAX_LABEL = 63  # a DNS label, and a label value
SUFFIX = "-virtbmc"
_DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # a Service's name (it becomes a DNS name)
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def child_name(vm: str) -> str:
    """The name of every child: `<vm>-virtbmc` (KubeVirtBMC's names, so in-cluster DNS names carry over) whenever
    that is a DNS-1035 label, as a Service's name must be. A VM's name may be a 253-character DNS subdomain, with
    dots, or start with a digit: then the name is made into a label (dots become dashes, a leading `vm-` where
    it would start with a digit), cut to fit 63 characters, and a short hash of the VM's whole name keeps two
    long names that share a prefix apart (as Kubernetes controllers name their children)."""
    simple = vm + SUFFIX
    if len(simple) <= MAX_LABEL and _DNS_1035_LABEL.fullmatch(simple):
        return simple
    tail = f"-{_short_hash(vm)}{SUFFIX}"
    stem = re.sub(r"[^a-z0-9-]+", "-", vm.lower()).strip("-")
    if not stem[:1].isalpha():
        stem = "vm-" + stem
    return stem[:MAX_LABEL - len(tail)].rstrip("-") + tail


def tls_secret_name(vm: str) -> str:
    return child_name(vm) + "-tls"


def events_secret_name(vm: str) -> str:
    """The Secret the agent keeps its Redfish event subscriptions in (vbmc/agent/subscriptions.py): created
    empty by the controller, written by the agent only."""
    return child_name(vm) + "-events"


def log_config_map_name(vm: str) -> str:
    """The ConfigMap the agent keeps the BMC's SEL and audit trail in (vbmc/agent/logstore.py): created by the agent
    on its first entry, owned by the VirtualMachineBMC; the controller only names it (and grants it)."""
    return child_name(vm) + "-log"


def label_value(name: str) -> str:
    """`name` as a label value (at most 63 characters): itself when it fits, else cut with a short hash of the
    whole of it, so that long VirtualMachine and VirtualMachineBMC names still select and label their objects."""
    if len(name) <= MAX_LABEL and _LABEL_VALUE.fullmatch(name):
        return name
    tail = "-" + _short_hash(name)
    return re.sub(r"[^-A-Za-z0-9_.]+", "-", name)[:MAX_LABEL - len(tail)].rstrip("-_.") + tail


def ca_secret_name(vm: str) -> str:
    """The Secret with the BMC's CA and its key (never mounted into the agent): up to 253 characters."""
    return f"{child_name(vm)}-ca"


def selector(vm: str) -> dict[str, str]:
    # From the VM, not the owner: the Deployment's selector is immutable, and the children keep their names if
    # another VirtualMachineBMC takes the VM over.
    return {NAME_LABEL: AGENT, VM_LABEL: label_value(vm)}


def labels(bmc: Obj, vm: str) -> dict[str, str]:
    return {MANAGED_BY: MANAGER, OWNER_LABEL: label_value(bmc["metadata"]["name"]), **selector(vm)}


def owner_reference(bmc: Obj) -> Obj:
    meta = bmc["metadata"]
    return {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"], "controller": True,
            "blockOwnerDeletion": True}


def _meta(bmc: Obj, name: str, vm: str, **extra: Any) -> Obj:
    return {"name": name, "namespace": bmc["metadata"]["namespace"], "labels": labels(bmc, vm),
            "ownerReferences": [owner_reference(bmc)], **extra}


def cdrom_disks(vm: Obj | None) -> list[str]:
    devices = ((((vm or {}).get("spec") or {}).get("template") or {}).get("spec") or {}).get("domain") or {}
    disks = (devices.get("devices") or {}).get("disks") or []
    return [str(d["name"]) for d in disks if isinstance(d, dict) and "cdrom" in d and d.get("name")]


def vm_claims(vm: Obj | None) -> list[str]:
    """The PersistentVolumeClaims whose capacity sizes the VM's disks (the agent reads them, running or not): those
    its volumes name (a dataVolume's claim has the DataVolume's name) and its dataVolumeTemplates'."""
    spec = (vm or {}).get("spec") or {}
    names = {str((t.get("metadata") or {}).get("name") or "") for t in spec.get("dataVolumeTemplates") or []
             if isinstance(t, dict)}
    for volume in ((spec.get("template") or {}).get("spec") or {}).get("volumes") or []:
        if not isinstance(volume, dict):
            continue
        source = volume.get("dataVolume") or volume.get("persistentVolumeClaim") or {}
        if isinstance(source, dict):
            names.add(str(source.get("name") or source.get("claimName") or ""))
    return sorted(n for n in names if n)


def created_disks(vm: Obj | None) -> list[str]:
    """The DataVolumes of the disks the agent added (Redfish Volumes it created, labelled managed-by kubevbmc): it
    may delete them again."""
    templates = ((vm or {}).get("spec") or {}).get("dataVolumeTemplates") or []
    return sorted(str(t["metadata"]["name"]) for t in templates if isinstance(t, dict)
                  and ((t.get("metadata") or {}).get("labels") or {}).get("app.kubernetes.io/managed-by") == "kubevbmc"
                  and t["metadata"].get("name"))


def desired_service_account(bmc: Obj, vm: str) -> Obj:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(bmc, child_name(vm), vm)}


def desired_role(bmc: Obj, vm: str, cdroms: list[str], claims: Sequence[str] = (),
                 disks: Sequence[str] = ()) -> Obj:
    """What the agent needs, restricted by resourceNames to its own VM, VMI, DataVolumes, claims and
    VirtualMachineBMC: `cdroms` are the VM's cdrom disks (media DataVolumes are named `<vm>-<disk>`), `claims` the
    claims that size its disks (`vm_claims`), `disks` the DataVolumes of disks the agent added (`created_disks`).

    The RBAC docs: a list or watch is allowed by a resourceNames rule only when it carries the field selector
    `metadata.name=<name>` (the agent's watches do); create cannot be restricted by name (the name is not known
    at authorization), so creating DataVolumes, and CDI's UploadTokenRequests for an upload into one, are the
    namespace-wide permissions, and the agent only names them `<vm>-<cdrom disk>`.
    """
    bmc_name = bmc["metadata"]["name"]
    dvs = sorted({f"{vm}-{disk}" for disk in cdroms} | set(disks))
    claim_names = sorted(set(claims) | {f"{vm}-{disk}" for disk in cdroms})
    rules: list[Obj] = [
        {"apiGroups": ["kubevirt.io"], "resources": ["virtualmachines"], "resourceNames": [vm],
         "verbs": ["get", "list", "watch", "patch"]},
        {"apiGroups": ["kubevirt.io"], "resources": ["virtualmachineinstances"], "resourceNames": [vm],
         "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["subresources.kubevirt.io"], "resources": [
            "virtualmachines/start", "virtualmachines/stop", "virtualmachines/restart"],
         "resourceNames": [vm], "verbs": ["update"]},
        {"apiGroups": ["subresources.kubevirt.io"], "resources": [
            "virtualmachineinstances/pause", "virtualmachineinstances/unpause",
            "virtualmachineinstances/softreboot", "virtualmachineinstances/reset"],
         "resourceNames": [vm], "verbs": ["update"]},
        # IPMI SOL and the web consoles: the serial console and the screen, WebSocket GETs (virtctl console and
        # virtctl vnc need the same).
        {"apiGroups": ["subresources.kubevirt.io"], "resources": [
            "virtualmachineinstances/console", "virtualmachineinstances/vnc"],
         "resourceNames": [vm], "verbs": ["get"]},
        {"apiGroups": ["bmc.kubevirt.io"], "resources": ["virtualmachinebmcs"], "resourceNames": [bmc_name],
         "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["bmc.kubevirt.io"], "resources": ["virtualmachinebmcs/status"], "resourceNames": [bmc_name],
         "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
        {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [events_secret_name(vm)],
         "verbs": ["get", "update", "patch"]},
        # The SEL and audit trail's ConfigMap: read back at start, written with its resourceVersion (update). The
        # agent creates it on its first entry, and create cannot be restricted by name: it may create ConfigMaps,
        # never read or change one but its own.
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [log_config_map_name(vm)],
         "verbs": ["get", "update"]},
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
    ]
    ca_map = BMCSpec.of(bmc).redfish.virtual_media.tls.ca_bundle_config_map_ref
    if ca_map is not None:
        # The image servers' CA bundle, read when checking an image URL (the import itself reads it as CDI).
        rules.append({"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [ca_map.name],
                      "verbs": ["get"]})
    if claim_names:
        # Disk sizes: a bound claim's capacity, read whether or not the VM runs.
        rules.append({"apiGroups": [""], "resources": ["persistentvolumeclaims"], "resourceNames": claim_names,
                      "verbs": ["get"]})
    if dvs:
        rules.append({"apiGroups": ["cdi.kubevirt.io"], "resources": ["datavolumes"], "resourceNames": dvs,
                      "verbs": ["get", "delete"]})
        rules.append({"apiGroups": ["cdi.kubevirt.io"], "resources": ["datavolumes"], "verbs": ["create"]})
        # A medium uploaded from the web page: CDI's upload token for its DataVolume's claim (vbmc/web/upload.py).
        # Create only, and not restricted by name either; CDI's token names the claim the upload may write.
        rules.append({"apiGroups": ["upload.cdi.kubevirt.io"], "resources": ["uploadtokenrequests"],
                      "verbs": ["create"]})
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(bmc, child_name(vm), vm),
            "rules": rules}


def desired_role_binding(bmc: Obj, vm: str) -> Obj:
    name = child_name(vm)
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _meta(bmc, name, vm),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": bmc["metadata"]["namespace"]}]}


def desired_service(bmc: Obj, vm: str, default_type: str = "ClusterIP") -> Obj:
    spec = BMCSpec.of(bmc)
    ports: list[Obj] = []
    if spec.ipmi.enabled:
        ports.append({"name": "ipmi", "port": 623, "targetPort": "ipmi", "protocol": "UDP"})
    if spec.redfish.enabled:
        ports.append({"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"})
        ports.append({"name": "https", "port": 443, "targetPort": "https", "protocol": "TCP"})
    meta = _meta(bmc, child_name(vm), vm)
    if spec.service.annotations:
        meta["annotations"] = dict(spec.service.annotations)
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"type": spec.service.type or default_type, "selector": selector(vm), "ports": ports}}


def desired_tls_secret(bmc: Obj, vm: str, material: TLSMaterial) -> Obj:
    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    return {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(bmc, tls_secret_name(vm), vm),
            "type": "kubernetes.io/tls",
            "data": {"tls.crt": b64(material.cert_pem), "tls.key": b64(material.key_pem),
                     "ca.crt": b64(material.ca_pem)}}


def desired_events_secret(bmc: Obj, vm: str) -> Obj:
    """The Secret for the agent's event subscriptions, applied without data: the agent writes the data (an
    update, another field manager), so applying this again never takes it away; owned by the VirtualMachineBMC,
    it goes away with it."""
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(bmc, events_secret_name(vm), vm),
            "type": "Opaque"}


def desired_ca_secret(bmc: Obj, vm: str, ca: KeyPair) -> Obj:
    """The CA's Secret, in the `kubernetes.io/tls` layout a cert-manager CA Issuer reads: tls.crt is the CA."""
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(bmc, ca_secret_name(vm), vm),
            "type": "kubernetes.io/tls",
            "data": {"tls.crt": base64.b64encode(ca.cert_pem).decode(),
                     "tls.key": base64.b64encode(ca.key_pem).decode()}}


def credentials_version(secret: Obj) -> str:
    """What rolls the agent when its credentials Secret changes: the Secret's uid and resourceVersion.

    Never a digest of the data: a hash of a username and password on the Deployment (readable by more people than
    the Secret) would let anyone who reads Deployments test password guesses offline. The resourceVersion changes
    with every write that changes the Secret (the API server skips no-op updates), so a change of its labels or
    annotations also restarts the agent: rare, and harmless. A Secret deleted and created again has a new uid. The
    same Secret gives the same value at every reconcile and after a controller restart, so nothing is written."""
    meta = secret.get("metadata") or {}
    return f"{meta.get('uid', '')}/{meta.get('resourceVersion', '')}"


def checksum(secret: Obj | None, keys: tuple[str, ...] | None = None) -> str:
    """sha256 of a Secret's data (only `keys` if given): a pod template annotation, so a change rolls the agent.
    Only for data that cannot be guessed (a generated private key), never for a password (`credentials_version`)."""
    data = (secret or {}).get("data") or {}
    digest = hashlib.sha256()
    for key in sorted(keys if keys is not None else data):
        digest.update(f"{key}={data.get(key, '')}\n".encode())
    return digest.hexdigest()


def desired_deployment(bmc: Obj, vm: str, settings: Settings, credentials: Obj, tls_secret: Obj | None) -> Obj:
    spec = BMCSpec.of(bmc)
    name = child_name(vm)
    secret_name = credentials["metadata"]["name"]
    args = ["agent", "--namespace", "$(POD_NAMESPACE)", "--vm", vm, "--vmbmc", bmc["metadata"]["name"],
            "--ipmi-address", f"$(POD_IP):{IPMI_PORT}" if spec.ipmi.enabled else "",
            "--redfish-address", f"$(POD_IP):{HTTP_PORT}", "--log-config-map", log_config_map_name(vm),
            "--log-level", settings.agent_log_level]
    if not spec.redfish.enabled:
        args += ["--redfish", "false"]  # the HTTP listener then serves the probes only
    else:
        args += ["--subscriptions-secret", events_secret_name(vm)]
        if spec.redfish.require_tls:
            args += ["--redfish-require-tls", "true"]
    ports: list[Obj] = [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}]
    if spec.ipmi.enabled:
        ports.insert(0, {"name": "ipmi", "containerPort": IPMI_PORT, "protocol": "UDP"})
    mounts: list[Obj] = []
    volumes: list[Obj] = []
    annotations = {CREDENTIALS_VERSION: credentials_version(credentials)}
    if spec.redfish.enabled and tls_secret is not None:
        args += ["--redfish-tls-address", f"$(POD_IP):{HTTPS_PORT}",
                 "--tls-cert", f"{TLS_DIR}/tls.crt", "--tls-key", f"{TLS_DIR}/tls.key"]
        ports.append({"name": "https", "containerPort": HTTPS_PORT, "protocol": "TCP"})
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
        volumes.append({"name": "tls", "secret": {"secretName": tls_secret["metadata"]["name"],
                                                  "defaultMode": 0o440}})
        annotations[TLS_CHECKSUM] = checksum(tls_secret, ("tls.crt", "tls.key"))

    def from_secret(env: str, key: str) -> Obj:
        return {"name": env, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": key}}}

    env = [from_secret("VBMC_USERNAME", "username"), from_secret("VBMC_PASSWORD", "password")]
    container = _agent_container(settings, args, ports, env, mounts, {"cpu": "10m", "memory": "64Mi"}, "128Mi")
    return _agent_deployment(_meta(bmc, name, vm), selector(vm), labels(bmc, vm), annotations, name, settings,
                             container, volumes)


# The agent's probes, sized for a fleet: the kubelet sends every one of them, for every agent on its node. Until
# the agent is first ready, /readyz every second (startupProbe: a new agent is in its Service within about a
# second, and the kubelet probes readiness at once when startup succeeds); then readiness every 10 s and liveness
# every 20 s, 0.15 probes a second per agent where 1 s and 10 s cost 1.1 (1,100 a second for 1,000 agents on
# the kubelets, each a connection the agent accepts). Once ready, an agent's /readyz stays 200 (it answers from
# memory, and stays ready while the API server is silent), so a shorter readiness period would buy nothing; a hung
# agent is restarted after 3 x 20 s. An agent not ready within STARTUP_SECONDS is restarted.
PROBE_PERIOD_STARTUP, PROBE_PERIOD_READINESS, PROBE_PERIOD_LIVENESS = 1, 10, 20
STARTUP_SECONDS = 600


def agent_probes() -> dict[str, Obj]:
    """The agent container's startupProbe, readinessProbe and livenessProbe (dedicated and pooled alike: both
    answer /healthz and /readyz on the `http` port, from memory, without credentials)."""

    def on(path: str, period: int, failures: int) -> Obj:
        return {"httpGet": {"path": path, "port": "http", "scheme": "HTTP"}, "periodSeconds": period,
                "timeoutSeconds": 2, "failureThreshold": failures, "successThreshold": 1}

    return {"startupProbe": on("/readyz", PROBE_PERIOD_STARTUP, STARTUP_SECONDS // PROBE_PERIOD_STARTUP),
            "readinessProbe": on("/readyz", PROBE_PERIOD_READINESS, 3),
            "livenessProbe": on("/healthz", PROBE_PERIOD_LIVENESS, 3)}


def _agent_container(settings: Settings, args: list[str], ports: list[Obj], env: list[Obj], mounts: list[Obj],
                     requests: dict[str, str], memory_limit: str) -> Obj:
    return {
        "name": "agent", "image": settings.agent_image, "args": args,
        **({"imagePullPolicy": settings.agent_image_pull_policy} if settings.agent_image_pull_policy else {}),
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}},
                {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"apiVersion": "v1",
                                                                     "fieldPath": "metadata.namespace"}}},
                {"name": "TMPDIR", "value": RUN_DIR}, *env],
        "ports": ports,
        **agent_probes(),
        "resources": {"requests": requests, "limits": {"memory": memory_limit}},
        "securityContext": {"runAsNonRoot": True, "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
        # The root filesystem is read-only; Python's tempfile needs a writable TMPDIR.
        "volumeMounts": [{"name": "tmp", "mountPath": RUN_DIR}, *mounts],
    }


NODE_LOSS_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


def node_loss_tolerations(seconds: int) -> list[Obj]:
    """How long an agent waits on a lost node before it is evicted and started elsewhere. Without tolerations of
    its own a pod gets 300 s of each from the API server (the DefaultTolerationSeconds admission plugin): a BMC
    dark for the node monitor grace period (40 s) plus five minutes plus its start. An agent holds no state of its
    own (the VM, its status and the BMC's live in the API server), so another one can take over at once; the
    toleration only rides out a brief outage of its node (a kubelet restart) before giving up on it."""
    return [{"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": seconds}
            for key in NODE_LOSS_TAINTS]


def _agent_deployment(meta: Obj, match: dict[str, str], pod_labels: dict[str, str], annotations: dict[str, str],
                      service_account: str, settings: Settings, container: Obj, volumes: list[Obj]) -> Obj:
    pull_secrets = [{"name": secret} for secret in settings.agent_image_pull_secrets]
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": {
        "replicas": 1, "strategy": {"type": "Recreate"}, "selector": {"matchLabels": match},
        # The deployment controller's verdict on a rollout that does not become ready: what halts the fleet's.
        "progressDeadlineSeconds": settings.rollout_timeout,
        "template": {"metadata": {"labels": pod_labels, "annotations": {
            **annotations, rollout.REVISION: rollout.revision(settings)}}, "spec": {
            "serviceAccountName": service_account, "automountServiceAccountToken": True,
            # fsGroup: the kubelet writes Secret volumes as root with their defaultMode; only with an fsGroup does it
            # give them the pod's group (and group read), so that user 65532 can read the TLS key at 0440.
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            **({"imagePullSecrets": pull_secrets} if pull_secrets else {}),
            "tolerations": node_loss_tolerations(settings.agent_node_loss_toleration),
            "containers": [container],
            "volumes": [{"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}}, *volumes]}}}}


# ---- pools: one agent Deployment serving every BMC of a namespace that names the pool (spec.agentPool)

POOL_LABEL = "bmc.kubevirt.io/pool"
POOL_SUFFIX = "-virtbmc-pool"  # never a dedicated child's name: those end in -virtbmc
POOL_CONFIG_KEY = "pool.json"
# Member slot k listens on these plus k; its Service maps 623, 80 and 443 to them.
POOL_IPMI_BASE, POOL_HTTP_BASE, POOL_HTTPS_BASE = 20000, 30000, 40000
# The pool's Secret carries every member's credentials and certificate (about 1.6 KB each with short names, 3 KB with
# the longest a DNS label allows): this many stay within the API's 1 MiB object size whatever the names
# (tests/controller/test_fleet_units.py; 500 of the longest would need 1.5 MB), and one agent serves them within
# its memory limit (docs/reference.md: about 1 MB each).
MAX_POOL_MEMBERS = 200


def pool_name(pool: str) -> str:
    """The pool's Deployment, ServiceAccount, Role, RoleBinding and Secret (spec.agentPool is a DNS label of at
    most 40 characters, so this is one too)."""
    return pool + POOL_SUFFIX


def pool_selector(pool: str) -> dict[str, str]:
    return {NAME_LABEL: AGENT, POOL_LABEL: pool}


def pool_labels(pool: str) -> dict[str, str]:
    return {MANAGED_BY: MANAGER, **pool_selector(pool)}


def slot_ports(slot: int) -> tuple[int, int, int]:
    """(IPMI, HTTP, HTTPS) ports of member slot `slot` on the pool's pod."""
    return POOL_IPMI_BASE + slot, POOL_HTTP_BASE + slot, POOL_HTTPS_BASE + slot


def slot_of(service: Obj | None) -> int | None:
    """The slot a member's Service points at (its targetPorts), None for a dedicated agent's Service."""
    for port in ((service or {}).get("spec") or {}).get("ports") or []:
        target = port.get("targetPort")
        for base in (POOL_IPMI_BASE, POOL_HTTP_BASE, POOL_HTTPS_BASE):
            if isinstance(target, int) and base <= target < base + MAX_POOL_MEMBERS:
                return target - base
    return None


def pool_owner_reference(bmc: Obj) -> Obj:
    """Every member owns the pool's objects (none controls them): the garbage collector removes them with the
    last member."""
    return {**owner_reference(bmc), "controller": False}


def pool_owner_references(have: list[Obj], members: list[Obj], left: set[str]) -> list[Obj]:
    """The ownerReferences of a pool's object: the ones it has, in their order, less those of BMCs known to have
    left the pool (`left`: uids of live BMCs that name another pool or none), then one for each member not among
    them yet (by name).

    A reference is never dropped because the cache no longer shows its BMC: that BMC was deleted, and
    kube-controller-manager's garbage collector removes the dangling reference itself (a patch by uid,
    pkg/controller/garbagecollector attemptToDeleteItem) or deletes the object when no owner is left. A controller
    that rewrote the list from its cache's members raced that patch: each side removed what the other kept, and
    the object could end with no owner at all, never collected (issue 21). A pool with no member left is deleted
    by the controller itself (reconciler.reconcile_pool)."""
    out = [ref for ref in have if ref.get("uid") not in left]
    known = {ref.get("uid") for ref in out}
    for bmc in sorted(members, key=lambda b: b["metadata"]["name"]):
        if bmc["metadata"]["uid"] not in known:
            out.append(pool_owner_reference(bmc))
    return out


def _pool_meta(namespace: str, pool: str, owners: list[Obj]) -> Obj:
    return {"name": pool_name(pool), "namespace": namespace, "labels": pool_labels(pool), "ownerReferences": owners}


def desired_member_service(bmc: Obj, vm: str, pool: str, slot: int, default_type: str = "ClusterIP") -> Obj:
    """A pooled BMC's own Service: the same name, type and ports as a dedicated agent's, pointing at its slot on
    the pool's pod."""
    service = desired_service(bmc, vm, default_type)
    ports = dict(zip(("ipmi", "http", "https"), slot_ports(slot), strict=True))
    service["spec"]["selector"] = pool_selector(pool)
    service["spec"]["ports"] = [{**p, "targetPort": ports[p["name"]]} for p in service["spec"]["ports"]]
    return service


def desired_pool_service_account(namespace: str, pool: str, owners: list[Obj]) -> Obj:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _pool_meta(namespace, pool, owners)}


def desired_pool_role(namespace: str, pool: str, owners: list[Obj],
                      served: Sequence[tuple[Obj, str, list[str]] | tuple[Obj, str, list[str], Obj | None]]) -> Obj:
    """The union of the served members' Roles (`desired_role`: their VMs, VMIs, VirtualMachineBMCs, Secrets and
    DataVolumes by name), and the pool's own Secret: exactly what the members' agents would hold."""
    named: dict[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]], set[str]] = {}
    unnamed: list[Obj] = []
    for bmc, vm, cdroms, *of in served:
        vm_obj = of[0] if of else None
        for rule in desired_role(bmc, vm, cdroms, vm_claims(vm_obj), created_disks(vm_obj))["rules"]:
            key = (tuple(rule["apiGroups"]), tuple(rule["resources"]), tuple(rule["verbs"]))
            if "resourceNames" in rule:
                named.setdefault(key, set()).update(rule["resourceNames"])
            elif rule not in unnamed:
                unnamed.append(rule)
    rules: list[Obj] = [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": [pool_name(pool)],
                         "verbs": ["get", "list", "watch"]}]
    rules += [{"apiGroups": list(groups), "resources": list(resources), "resourceNames": sorted(names),
               "verbs": list(verbs)} for (groups, resources, verbs), names in sorted(named.items())]
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": _pool_meta(namespace, pool, owners), "rules": rules + unnamed}


def desired_pool_role_binding(namespace: str, pool: str, owners: list[Obj]) -> Obj:
    name = pool_name(pool)
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": _pool_meta(namespace, pool, owners),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]}


def pool_member(bmc: Obj, vm: str, slot: int, credentials: Obj, tls_secret: Obj | None) -> Obj:
    """One member as the pool's agent reads it (vbmc/agent/pool.py): who, where, its credentials and certificate."""
    spec = BMCSpec.of(bmc)
    ipmi, http, https = slot_ports(slot)
    data = credentials.get("data") or {}
    cert = _b64text((tls_secret or {}).get("data", {}).get("tls.crt")) if spec.redfish.enabled else ""
    key = _b64text((tls_secret or {}).get("data", {}).get("tls.key")) if spec.redfish.enabled else ""
    return {"name": bmc["metadata"]["name"], "vm": vm, "username": _b64text(data.get("username")),
            "password": _b64text(data.get("password")), "ipmi": spec.ipmi.enabled, "redfish": spec.redfish.enabled,
            "requireTLS": spec.redfish.require_tls, "ipmiPort": ipmi, "httpPort": http,
            "httpsPort": https if cert and key else 0, "tlsCert": cert, "tlsKey": key,
            "subscriptionsSecret": events_secret_name(vm) if spec.redfish.enabled else "",
            "logConfigMap": log_config_map_name(vm)}


def _b64text(value: Any) -> str:
    try:
        return base64.b64decode(str(value or "")).decode()
    except (ValueError, UnicodeDecodeError):
        return ""


def desired_pool_secret(namespace: str, pool: str, owners: list[Obj], entries: list[Obj]) -> Obj:
    """The pool's membership, read by its agent through a watch: adding or removing a member changes this
    Secret, never the pod template, so the agent restarts for nobody."""
    config = json.dumps({"members": sorted(entries, key=lambda e: e["name"])}, sort_keys=True, separators=(",", ":"))
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _pool_meta(namespace, pool, owners), "type": "Opaque",
            "data": {POOL_CONFIG_KEY: base64.b64encode(config.encode()).decode()}}


def desired_pool_deployment(namespace: str, pool: str, owners: list[Obj], settings: Settings) -> Obj:
    """The pool's agent: one process for every member, configured by the pool's Secret (nothing about the
    members is in the pod template)."""
    name = pool_name(pool)
    args = ["agent", "--pool", pool, "--namespace", "$(POD_NAMESPACE)", "--pool-secret", name,
            "--address", "$(POD_IP)", "--redfish-address", f"$(POD_IP):{HTTP_PORT}",
            "--log-level", settings.agent_log_level]
    ports = [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}]
    container = _agent_container(settings, args, ports, [], [], {"cpu": "50m", "memory": "128Mi"}, "1Gi")
    return _agent_deployment(_pool_meta(namespace, pool, owners), pool_selector(pool), pool_labels(pool), {},
                             name, settings, container, [])


def credentials_problem(spec: BMCSpec, secret: Obj | None) -> tuple[str, str] | None:
    """(reason, message) when the credentials Secret cannot be used, else None."""
    if spec.auth_secret_ref is None:
        return "SecretNotSpecified", "spec.authSecretRef names no Secret with the BMC's username and password"
    name = spec.auth_secret_ref.name
    if secret is None:
        return "SecretNotFound", f"Secret {name} not found"
    data = secret.get("data") or {}
    missing = [k for k in CREDENTIAL_KEYS if not data.get(k)]
    if missing:
        return "SecretMissingKeys", f"Secret {name} lacks {' and '.join(missing)}"
    return None
