"""The kubelets of the simulator's nodes (kubesim/nodes.py): they run and report the pods bound to their node.

One Kubelet serves every node: a pod is its node's as soon as the scheduler (kubesim/scheduler.py) binds it. A
node without power (nodes.power_off) is a kubelet that does nothing: its pods' processes are killed, and nothing
about them is reported or done (a pod deleted there stays Terminating), until the node is powered on again. Then
its kubelet restarts their containers (a reboot: restartCount goes up) or finishes their deletion.

Mode "process": containers whose image matches `config.local_image` (the project's own image) run as local
processes, each in its own session and process group, on the pod's IP from `config.pod_cidr` (all of
127.0.0.0/8 is loopback, so a process binds its Pod IP as it would inside a network namespace). Any other image
cannot be pulled: the container waits with ErrImagePull / ImagePullBackOff. Mode "fake" (like kwok): every pod
is Running and Ready at once with an IP and nothing runs.

Mode "container": every container runs from its image with podman and runc (containers.py), as a kubelet runs it
through the CRI: the image's entry point with the container's command and args, the effective user and groups of
the security contexts (runAsNonRoot verified against the image's USER), a read-only root filesystem, dropped
capabilities and no privilege escalation when asked, the pod's volumes bind-mounted at their mountPaths with the
kubelet's file modes and owners (fsGroup, the projected token's owner), the ServiceAccount token at
/var/run/secrets/kubernetes.io/serviceaccount (rotated in place) and in-cluster KUBERNETES_SERVICE_HOST/PORT, and
nothing of the host's environment. The pod shares the host's network (its processes bind the Pod IP, as in process
mode), so probes, Services and clients reach it the same way. The image must be in the node's storage
(imagePullPolicy Always, or an absent image, tries a pull; no registry answers here: ErrImagePull).

What a local process cannot have (process mode), and how it is stood in for:
- no mount namespace: secret, configMap, emptyDir and hostPath volumes are directories on the host, and the
  volumeMount's mountPath prefix is rewritten to that directory in command, args, env values, workingDir and
  exec probes. A program that builds a mounted path some other way will not find the file (known limitation).
- no in-cluster service account mount at a fixed path: the token, ca.crt and namespace are written (as the
  kubelet's AtomicWriter does: a timestamped directory behind a `..data` symlink that is swapped) into the pod's
  directory that stands for /var/run/secrets/kubernetes.io/serviceaccount, and the process gets KUBECONFIG, a
  per-pod kubeconfig whose user for `system:serviceaccount:<ns>:<sa>` names that token file (`tokenFile`) and CA
  file, so a client reads the files as an in-cluster one would; KUBERNETES_SERVICE_HOST/PORT point at the API
  server. Tokens rotate as bound tokens do: with `token_ttl` the kubelet writes a new token at 80% of its
  lifetime and the old one expires at 100%; `rotate_token` does it at once (tests).
- the environment starts from a few host variables (PATH, PYTHONPATH, HOME, LANG, VIRTUAL_ENV, TMPDIR) so the
  image's Python can run, then what Kubernetes would give the container.
- crash-loop back-off is 1 s doubling to 10 s (Kubernetes: 10 s doubling to 5 min): a simulator should recover
  in test time. Init containers, preStop hooks and volume content refresh are not simulated.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from . import errors, nodes
from .containers import POD_LABEL, SIM_PID_LABEL, Mount, Podman, RunSpec
from .cpu import unpinned
from .loop import ControlLoop, status_only
from .network import network_of
from .objects import now, set_condition
from .podlogs import ContainerLog
from .store import Event

log = logging.getLogger(__name__)

Obj = dict[str, Any]

NODE_NAME = nodes.NODE_NAME
HOST_IP = nodes.HOST_IP
BACKOFF_START, BACKOFF_CAP = 1.0, 10.0
RETRY_SECONDS = 1.0  # a missing Secret or ConfigMap is looked for again this often
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
_HOST_ENV = ("PATH", "PYTHONPATH", "HOME", "LANG", "LC_ALL", "VIRTUAL_ENV", "TMPDIR")


class ConfigError(Exception):
    """A container cannot be configured yet (CreateContainerConfigError), with Kubernetes' message."""


# ---- pure decisions


def expand(text: str, lookup: Callable[[str], str | None]) -> str:
    """Kubernetes' $(VAR) expansion (third_party/forked/golang/expansion): `$$` is a literal `$`, an unknown
    or unterminated reference is kept as written, a `$` before anything else is kept."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch != "$" or i + 1 >= n:
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            end = text.find(")", i + 2)
            if end < 0:
                out.append("$(")
                i += 2
                continue
            name = text[i + 2:end]
            value = lookup(name)
            out.append(value if value is not None else f"$({name})")
            i = end + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


_FIELD_LABEL = re.compile(r"^metadata\.(labels|annotations)\['(.*)'\]$")


def pod_field(pod: Obj, path: str, pod_ip: str, host_ip: str) -> str:
    """A downward API fieldRef value."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    simple = {
        "metadata.name": meta.get("name", ""), "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""), "spec.nodeName": spec.get("nodeName") or NODE_NAME,
        "spec.serviceAccountName": spec.get("serviceAccountName") or "default",
        "status.podIP": pod_ip, "status.podIPs": pod_ip, "status.hostIP": host_ip, "status.hostIPs": host_ip,
    }
    if path in simple:
        return str(simple[path])
    match = _FIELD_LABEL.match(path)
    if match:
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1]) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    raise ConfigError(f"unsupported fieldPath: {path}")


Lookup = Callable[[str, str], Obj | None]  # (kind "secret" | "configmap", name) -> object or None


def _source_data(kind: str, obj: Obj) -> dict[str, str]:
    if kind == "secret":
        return {k: base64.b64decode(v).decode("utf-8", "replace") for k, v in (obj.get("data") or {}).items()}
    data = dict(obj.get("data") or {})
    for k, v in (obj.get("binaryData") or {}).items():
        data[k] = base64.b64decode(v).decode("utf-8", "replace")
    return data


def _key_ref(kind: str, ref: Obj, namespace: str, lookup: Lookup) -> str | None:
    label = "Secret" if kind == "secret" else "ConfigMap"
    obj = lookup(kind, ref.get("name", ""))
    if obj is None:
        if ref.get("optional"):
            return None
        raise ConfigError(f'{kind} "{ref.get("name", "")}" not found')
    data = _source_data(kind, obj)
    if ref.get("key") not in data:
        if ref.get("optional"):
            return None
        raise ConfigError(f"couldn't find key {ref.get('key')} in {label} {namespace}/{ref.get('name', '')}")
    return data[ref["key"]]


def resolve_env(container: Obj, pod: Obj, lookup: Lookup, service_env: dict[str, str], pod_ip: str,
                host_ip: str = HOST_IP) -> dict[str, str]:
    """The container's environment as the kubelet builds it (makeEnvironmentVariables): envFrom, then env in
    order, each `value` expanded against what is defined so far; service variables fill in the rest."""
    namespace = (pod.get("metadata") or {}).get("namespace", "")
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, ref_key in (("configmap", "configMapRef"), ("secret", "secretRef")):
            ref = source.get(ref_key)
            if not isinstance(ref, dict):
                continue
            obj = lookup(kind, ref.get("name", ""))
            if obj is None:
                if ref.get("optional"):
                    continue
                raise ConfigError(f'{kind} "{ref.get("name", "")}" not found')
            for k, v in _source_data(kind, obj).items():
                env[prefix + k] = v
    for var in container.get("env") or []:
        name = var.get("name", "")
        source = var.get("valueFrom")
        if not isinstance(source, dict):
            env[name] = expand(str(var.get("value", "")),
                               lambda n: env[n] if n in env else service_env.get(n))
            continue
        value: str | None
        if "secretKeyRef" in source:
            value = _key_ref("secret", source["secretKeyRef"], namespace, lookup)
        elif "configMapKeyRef" in source:
            value = _key_ref("configmap", source["configMapKeyRef"], namespace, lookup)
        elif "fieldRef" in source:
            value = pod_field(pod, source["fieldRef"].get("fieldPath", ""), pod_ip, host_ip)
        elif "resourceFieldRef" in source:
            value = _resource_field(container, source["resourceFieldRef"])
        else:
            raise ConfigError(f"env {name}: unsupported valueFrom {sorted(source)}")
        if value is not None:
            env[name] = value
    return {**service_env, **env}


def _resource_field(container: Obj, ref: Obj) -> str:
    section, _, resource = str(ref.get("resource", "")).partition(".")
    value = ((container.get("resources") or {}).get(section) or {}).get(resource)
    return str(value) if value is not None else "0"


def rewrite_paths(text: str, mounts: list[tuple[str, str]]) -> str:
    """Mount paths replaced by the host directories standing in for them (longest first, whole segments)."""
    # One pass over all mounts: a host directory may itself lie below another mount's path (an emptyDir at
    # /tmp while the kubelet's directories are under /tmp), and a second pass would rewrite it again.
    table = {(m.rstrip("/") or "/"): local for m, local in mounts}
    table.pop("/", None)
    if not table:
        return text
    alternatives = "|".join(re.escape(m) for m in sorted(table, key=len, reverse=True))
    pattern = re.compile(r"(?<![\w./-])(" + alternatives + r")(?=/|$|[^\w.-])")
    return pattern.sub(lambda m: table[m.group(1)], text)


def container_argv(container: Obj, env: dict[str, str], entrypoint: list[str]) -> list[str]:
    """command + args with $(VAR) expanded; no command means the image's entrypoint with the args."""
    def lookup(name: str) -> str | None:
        return env.get(name)

    command = [expand(str(c), lookup) for c in container.get("command") or []]
    args = [expand(str(a), lookup) for a in container.get("args") or []]
    return command + args if command else list(entrypoint) + args


def pod_phase(states: list[str], restart_policy: str) -> str:
    """Phase from container states: "waiting" (never ran), "running", "restarting", "succeeded", "failed"."""
    if not states or "waiting" in states:
        return "Pending"
    if "running" in states or "restarting" in states:
        return "Running"
    if "failed" in states:
        return "Failed" if restart_policy != "Always" else "Running"
    return "Succeeded" if restart_policy != "Always" else "Running"


def next_backoff(current: float) -> float:
    return BACKOFF_START if current <= 0 else min(BACKOFF_CAP, current * 2)


# ---- security contexts and volume files (container mode)

_POD_LEVEL = ("runAsUser", "runAsGroup", "runAsNonRoot", "seccompProfile", "seLinuxOptions")


def effective_security(pod: Obj, container: Obj) -> Obj:
    """The container's securityContext over the pod's (securitycontext.DetermineEffectiveSecurityContext)."""
    pod_context = (pod.get("spec") or {}).get("securityContext") or {}
    merged = {k: pod_context[k] for k in _POD_LEVEL if k in pod_context}
    merged.update(container.get("securityContext") or {})
    return merged


def non_root_problem(security: Obj, image_user: str, pod: Obj, container: str) -> str | None:
    """The kubelet's verifyRunAsNonRoot (pkg/kubelet/kuberuntime/security_context_others.go), with its messages:
    runAsNonRoot holds only for a non-zero numeric uid, from runAsUser or else from the image's USER."""
    if not security.get("runAsNonRoot"):
        return None
    meta = pod.get("metadata") or {}
    pod_ref = f'{meta.get("name", "")}_{meta.get("namespace", "")}({meta.get("uid", "")})'
    where = f'(pod: "{pod_ref}", container: {container})'
    if security.get("runAsUser") is not None:
        return f"container's runAsUser breaks non-root policy {where}" if int(security["runAsUser"]) == 0 else None
    user = image_user.partition(":")[0]
    if user and not user.isdigit():
        return f"container has runAsNonRoot and image has non-numeric user ({user}), cannot verify user is non-root " \
               f"{where}"
    if not user or int(user) == 0:
        return f"container has runAsNonRoot and image will run as root {where}"
    return None


def fs_user(pod: Obj) -> int | None:
    """volumeutil.FsUserFrom: the one runAsUser every container runs with, else None."""
    users = {effective_security(pod, c).get("runAsUser") for c in (pod.get("spec") or {}).get("containers") or []}
    only = users.pop() if len(users) == 1 else None
    return None if only is None else int(only)


@dataclass(frozen=True)
class FileMode:
    mode: int
    uid: int = 0
    gid: int = 0


def volume_file(mode: int, fs_group: int | None, read_only: bool = True) -> FileMode:
    """A file of a secret, configMap or projected volume as the kubelet leaves it: written by root with its mode;
    with an fsGroup, volume.SetVolumeOwnership gives it that group and adds group read (and write when the volume
    is not read-only: roMask 0440, rwMask 0660)."""
    if fs_group is None:
        return FileMode(mode)
    return FileMode(mode | (0o440 if read_only else 0o660), 0, fs_group)


def token_file(default_mode: int, user: int | None, fs_group: int | None) -> FileMode:
    """The projected ServiceAccount token (pkg/volume/projected/projected.go): mode 0600 once the pod runs as one
    user or has an fsGroup, else the volume's defaultMode; owned by that user (the AtomicWriter's FsUser), then
    given the fsGroup by SetVolumeOwnership (0600 becomes 0640)."""
    mode = 0o600 if user is not None or fs_group is not None else default_mode
    owned = volume_file(mode, fs_group)
    return FileMode(owned.mode, user if user is not None else 0, owned.gid)


def probe_port(container: Obj, port: Any) -> int:
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"no container port named {port!r}")


def run_probe(probe: Obj, container: Obj, pod_ip: str, env: dict[str, str], mounts: list[tuple[str, str]],
              in_container: Callable[[list[str]], list[str]] | None = None) -> tuple[bool, str]:
    """One probe attempt: (success, why it failed). An exec probe runs as a local process with the container's
    environment and paths, or through `in_container` (container mode: `podman exec`)."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "httpGet" in probe:
            get = probe["httpGet"]
            host, port = get.get("host") or pod_ip, probe_port(container, get.get("port"))
            conn: http.client.HTTPConnection
            if str(get.get("scheme", "HTTP")).upper() == "HTTPS":
                context = ssl.create_default_context()
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE  # the kubelet does not verify probe certificates either
                conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=context)
            else:
                conn = http.client.HTTPConnection(host, port, timeout=timeout)
            try:
                headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
                headers.setdefault("User-Agent", "kube-probe/1.36")
                conn.request("GET", get.get("path", "/"), headers=headers)
                code = conn.getresponse().status
            finally:
                conn.close()
            return 200 <= code < 400, f"HTTP probe failed with statuscode: {code}"
        if "tcpSocket" in probe:
            tcp = probe["tcpSocket"]
            with socket.create_connection((tcp.get("host") or pod_ip, probe_port(container, tcp.get("port"))),
                                          timeout=timeout):
                return True, ""
        if "exec" in probe:
            command = [expand(str(a), env.get) for a in probe["exec"].get("command") or []]
            argv = in_container(command) if in_container else [rewrite_paths(a, mounts) for a in command]
            done = subprocess.run(argv, env=None if in_container else env, timeout=timeout, check=False,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return done.returncode == 0, f"command exited with {done.returncode}"
    except (OSError, ValueError, subprocess.TimeoutExpired, http.client.HTTPException) as exc:
        return False, str(exc)
    return False, "unsupported probe handler"


# ---- runtime state


@dataclass
class Probe:
    kind: str  # readiness, liveness, startup
    spec: Obj
    due: float
    successes: int = 0
    failures: int = 0


@dataclass
class Container:
    """One container of a running pod: its process and what its status says about it."""

    name: str
    spec: Obj
    proc: subprocess.Popen[bytes] | None = None
    started_at: str = ""
    started_mono: float = 0.0
    restart_count: int = 0
    last_state: Obj = field(default_factory=dict)
    terminated: Obj | None = None  # the current state when the process has exited
    waiting: tuple[str, str] | None = ("ContainerCreating", "")
    backoff: float = 0.0
    restart_at: float = 0.0
    ready: bool = False
    started: bool = False
    pulls: int = 0
    final: bool = False  # exited and will not be restarted
    stopping: bool = False
    runner: threading.Thread | None = None
    fake: bool = False  # fake mode: running without a process
    log: ContainerLog | None = None  # its output, every run (process and container modes)
    runtime_name: str = ""  # container mode: the podman container of the current run
    image_id: str = ""  # container mode: the image it runs, and that image's USER
    image_user: str = ""

    def running(self) -> bool:
        return self.fake or (self.proc is not None and self.terminated is None)

    def container_id(self) -> str:
        """The current run's ID in pod status (and the key of its output for pods/log)."""
        if self.fake:
            return f"fake://{self.name}"
        if self.runtime_name:
            return f"podman://{self.runtime_name}"
        return f"process://{self.proc.pid}" if self.proc is not None else ""


@dataclass
class PodRuntime:
    uid: str
    ip: str
    dir: str
    start_time: str
    node: str
    containers: dict[str, Container] = field(default_factory=dict)
    env: dict[str, dict[str, str]] = field(default_factory=dict)
    mounts: list[tuple[str, str]] = field(default_factory=list)  # process mode: (mountPath, host directory)
    volumes: dict[str, str] = field(default_factory=dict)  # volume name -> the host directory (or hostPath)
    kill_at: float | None = None  # when terminating: SIGKILL after this
    prepared: bool = False
    # The projected service account token: its user, the files written with it, the token, when to renew it.
    sa_user: str = ""
    sa_dir: str = ""
    sa_files: dict[str, str] = field(default_factory=dict)
    sa_modes: Callable[[str], FileMode] | None = None  # container mode: their modes and owners
    token: str = ""
    token_refresh_at: float = 0.0


def write_atomically(directory: str, files: dict[str, str], modes: Callable[[str], FileMode] | None = None) -> None:
    """The kubelet's AtomicWriter (pkg/volume/util/atomic_writer.go): the files go into a new timestamped
    directory, the `..data` symlink is renamed over to point at it, and each visible name is a symlink through
    `..data` (made once). A reader sees all the old files or all the new ones, never a half-written token."""
    os.makedirs(directory, exist_ok=True)
    stamp = tempfile.mkdtemp(prefix=time.strftime("..%Y_%m_%d_%H_%M_%S."), dir=directory)
    os.chmod(stamp, 0o755)  # mkdtemp's 0700 would hide the files from a container's non-root user
    for name, content in files.items():
        path = os.path.join(stamp, name)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(content)
        owned = modes(name) if modes else FileMode(0o644)
        os.chmod(path, owned.mode)
        if modes:
            os.chown(path, owned.uid, owned.gid)
    data = os.path.join(directory, "..data")
    previous = os.readlink(data) if os.path.islink(data) else None
    link = os.path.join(directory, "..data_tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(link)
    os.symlink(os.path.basename(stamp), link)
    os.rename(link, data)
    for name in files:
        visible = os.path.join(directory, name)
        if not os.path.islink(visible):
            os.symlink(os.path.join("..data", name), visible)
    if previous and previous != os.path.basename(stamp):
        shutil.rmtree(os.path.join(directory, previous), ignore_errors=True)


def _podman_environment() -> dict[str, str]:
    """podman's own environment (the container's is given with --env)."""
    return {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}


def _own_volume(directory: str, files: VolumeFiles, pod: Obj, name: str) -> None:
    """Container mode: a volume's files as the kubelet leaves them for the pod's user (volume_file): an emptyDir
    is a world-writable directory (emptydir's 0777); with an fsGroup the directory is that group's, setgid."""
    volume: Obj = next((v for v in pod["spec"].get("volumes") or [] if v.get("name") == name), {})
    fs_group = (pod["spec"].get("securityContext") or {}).get("fsGroup")
    empty_dir = "emptyDir" in volume
    os.chmod(directory, 0o777 if empty_dir else 0o755)
    if fs_group is not None:
        os.chown(directory, 0, int(fs_group))
        mask = 0o660 if empty_dir else 0o440  # SetVolumeOwnership (volume_linux.go): rwMask, roMask; dirs also
        os.chmod(directory, os.stat(directory).st_mode & 0o7777 | mask | 0o2000 | 0o110)  # setgid and execMask
    for rel, (_, mode) in files.items():
        owned = volume_file(mode, None if fs_group is None else int(fs_group), read_only=not empty_dir)
        path = os.path.join(directory, rel)
        os.chown(path, owned.uid, owned.gid)
        os.chmod(path, owned.mode)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


# ---- the kubelet


class Kubelet(ControlLoop):
    name = "kubelet"
    kinds = ("/pods",)

    def __init__(self, cluster: Any) -> None:
        super().__init__(cluster.store, workers=4)
        self.cluster = cluster
        self.config = cluster.config
        self.net = network_of(cluster)
        self.nodes: nodes.Nodes = cluster.nodes
        self.fake = self.config.kubelet_mode == "fake"
        self.podman = Podman(self.config.container_storage) if self.config.kubelet_mode == "container" else None
        self.local_image = re.compile(self.config.local_image)
        self.work_dir = tempfile.mkdtemp(prefix="kubesim-kubelet-")
        self.log_dir = self.config.log_dir or os.path.join(self.work_dir, "logs")
        self.pods: dict[tuple[str, str], PodRuntime] = {}
        self._lock = threading.Lock()

    def start(self) -> None:
        if self.podman is not None:
            problem = self.podman.problem()
            if problem:
                raise RuntimeError(f"kubelet: containers cannot run here: {problem}")
            # A kubesim that was killed could not stop its containers: they would hold their Pod IPs' ports.
            self.podman.remove(*self.podman.orphans())
        super().start()

    def keys_for(self, event: Event) -> Iterable[Hashable]:
        if status_only(event):
            return []  # its own status writes
        meta = event.obj["metadata"]
        return [(meta.get("namespace", ""), meta["name"])]

    # ---- sync

    def sync(self, key: Hashable) -> float | None:
        assert isinstance(key, tuple)
        ns, name = key
        store = self.store
        pod_type = store.type("/pods")
        pod = store.find(pod_type, ns, name)
        with self._lock:
            rt = self.pods.get(key)
        if rt is not None and (pod is None or pod["metadata"]["uid"] != rt.uid):
            self._discard(key, rt)
            rt = None
        if pod is None:
            return None
        node = (pod.get("spec") or {}).get("nodeName") or ""
        if not self.nodes.up(node):
            return None  # not scheduled yet, bound to a node that does not exist here, or to one without power
        if pod["metadata"].get("deletionTimestamp"):
            return self._terminate(key, pod, rt)
        if rt is None:
            rt = PodRuntime(pod["metadata"]["uid"], self.net.pod_ips.allocate(pod["metadata"]["uid"]),
                            os.path.join(self.work_dir, f"{ns}_{name}_{pod['metadata']['uid'][:8]}"), now(), node)
            with self._lock:
                self.pods[key] = rt
        if self.fake:
            for c in pod["spec"].get("containers") or []:
                rt.containers.setdefault(c["name"], Container(c["name"], c, started_at=now(), waiting=None,
                                                              ready=True, started=True, fake=True))
            self._write_status(pod, rt)
            return None
        again = self._run_containers(pod, rt)
        self._write_status(pod, rt)
        ttl = self.config.token_ttl
        if ttl > 0 and rt.token:
            wait = rt.token_refresh_at - time.monotonic()
            if wait <= 0:
                with self._lock:
                    self._rotate(rt, grace=None)  # the old token expires by its own TTL
                wait = rt.token_refresh_at - time.monotonic()
            again = wait if again is None else min(again, wait)
        return again

    # ---- node power (kubesim/nodes.py)

    def power_off(self, node: str) -> None:
        """The node lost power: every process of its pods dies, and nothing about it is reported (sync does nothing
        for a node without power)."""
        with self._lock:
            runtimes = [rt for rt in self.pods.values() if rt.node == node]
        for rt in runtimes:
            for c in rt.containers.values():
                if c.proc is not None and c.proc.poll() is None:
                    self._signal(c, signal.SIGKILL)

    def power_on(self, node: str) -> None:
        """The node booted: its kubelet goes through every pod bound to it."""
        pods, _ = self.store.list(self.store.type("/pods"), fields_=lambda pod: pod["spec"].get("nodeName") == node)
        for pod in pods:
            self.enqueue((pod["metadata"].get("namespace", ""), pod["metadata"]["name"]))

    # ---- service account tokens

    def rotate_token(self, namespace: str, name: str, grace: float) -> tuple[str, str]:
        """A new token for the pod's service account, written to its token file and valid at once; the old one
        is rejected after `grace` seconds. (old, new); KeyError for a pod this kubelet has not started."""
        with self._lock:
            rt = self.pods.get((namespace, name))
            if rt is None or not rt.token:
                raise KeyError(f"pod {namespace}/{name} has no service account token from this kubelet")
            return self._rotate(rt, grace)

    def kubeconfig_of(self, namespace: str, name: str) -> str:
        with self._lock:
            rt = self.pods.get((namespace, name))
        if rt is None or not rt.prepared:
            raise KeyError(f"pod {namespace}/{name} has not been started by this kubelet")
        return os.path.join(rt.dir, "kubeconfig")

    def _rotate(self, rt: PodRuntime, grace: float | None) -> tuple[str, str]:
        ttl = self.config.token_ttl or None
        old, new = rt.token, self.cluster.new_token(rt.sa_user, ttl)
        write_atomically(rt.sa_dir, {**rt.sa_files, "token": new}, rt.sa_modes)
        rt.token = new
        rt.token_refresh_at = time.monotonic() + 0.8 * ttl if ttl else 0.0
        if grace is not None:
            self.cluster.tokens.expire(old, grace)
        log.info("kubelet: rotated the service account token of pod %s", os.path.basename(rt.dir))
        return old, new

    def _discard(self, key: tuple[str, str], rt: PodRuntime) -> None:
        """The pod is gone (or replaced under the same name): kill what is left and free its IP."""
        for c in rt.containers.values():
            c.stopping = True
            if c.proc is not None and c.proc.poll() is None:
                self._signal(c, signal.SIGKILL)
        self.net.pod_ips.release(rt.ip, rt.uid)
        if rt.token:
            self.cluster.tokens.expire(rt.token, 0)  # a bound token dies with its pod
        with self._lock:
            if self.pods.get(key) is rt:
                del self.pods[key]
        shutil.rmtree(rt.dir, ignore_errors=True)

    def _terminate(self, key: tuple[str, str], pod: Obj, rt: PodRuntime | None) -> float | None:
        """SIGTERM to every container's process group, SIGKILL after the grace period, then the pod goes."""
        alive = [c for c in (rt.containers.values() if rt else ()) if c.proc is not None and c.proc.poll() is None]
        if rt is not None and alive:
            at = time.monotonic()
            if rt.kill_at is None:
                grace = pod["metadata"].get("deletionGracePeriodSeconds")
                if grace is None:
                    grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
                rt.kill_at = at + float(grace)
                for c in alive:
                    c.stopping = True
                    self._signal(c, signal.SIGTERM)
            if at < rt.kill_at:
                return min(rt.kill_at - at, 1.0)  # the runner threads also wake us when a process exits
            for c in alive:
                assert c.proc is not None
                self._signal(c, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(timeout=2)
        try:
            self.store.delete(self.store.type("/pods"), key[0], key[1], grace_period=0,
                              preconditions={"uid": pod["metadata"]["uid"]})
        except errors.ApiError as exc:
            if exc.code not in (404, 409):
                raise
        if rt is not None and self.store.find(self.store.type("/pods"), key[0], key[1]) is None:
            self._discard(key, rt)
        return None

    # ---- containers (process mode)

    def _run_containers(self, pod: Obj, rt: PodRuntime) -> float | None:
        at = time.monotonic()
        wake: list[float] = []
        policy = pod["spec"].get("restartPolicy", "Always")
        for spec in pod["spec"].get("containers") or []:
            c = rt.containers.setdefault(spec["name"], Container(spec["name"], spec))
            if c.final or c.running():
                continue
            if self.podman is None and not self.local_image.search(str(spec.get("image", ""))):
                c.pulls += 1
                if c.pulls == 1:
                    c.waiting = ("ErrImagePull", f'kubesim runs only images matching "{self.config.local_image}" '
                                 f'as local processes; image "{spec.get("image")}" cannot be pulled')
                    wake.append(RETRY_SECONDS)
                else:
                    c.waiting = ("ImagePullBackOff", f'Back-off pulling image "{spec.get("image")}": kubesim runs '
                                 f'only images matching "{self.config.local_image}"')
                continue
            if self.podman is not None and not self._pulled(c, spec):
                wake.append(max(c.backoff, RETRY_SECONDS))
                continue
            if c.terminated is not None:
                code = int(c.terminated.get("exitCode", 0))
                if policy == "Never" or (policy == "OnFailure" and code == 0):
                    c.final = True
                    continue
                if at < c.restart_at:
                    c.waiting = ("CrashLoopBackOff", f"back-off {c.backoff:g}s restarting failed container="
                                 f"{c.name} pod={pod['metadata']['name']}_{pod['metadata'].get('namespace', '')}"
                                 f"({pod['metadata']['uid']})")
                    wake.append(c.restart_at - at)
                    continue
                c.last_state = {"terminated": c.terminated}
                c.terminated = None
                c.restart_count += 1
            try:
                self._prepare(pod, rt)
                env = self._environment(pod, rt, spec)
                if self.podman is not None:
                    problem = non_root_problem(effective_security(pod, spec), c.image_user, pod, c.name)
                    if problem:
                        raise ConfigError(problem)
            except ConfigError as exc:
                c.waiting = ("CreateContainerConfigError", str(exc))
                wake.append(RETRY_SECONDS)
                continue
            except VolumeError as exc:
                c.waiting = ("ContainerCreating", str(exc))
                wake.append(RETRY_SECONDS)
                continue
            self._start(pod, rt, c, env)
            if c.terminated is not None:
                wake.append(0.05)
        return min(wake) if wake else None

    def _pulled(self, c: Container, spec: Obj) -> bool:
        """Container mode: is the image in the node's storage? Pulls it first when the policy says so (Always, or
        IfNotPresent and absent), as the kubelet's image manager does; False leaves the container waiting."""
        assert self.podman is not None
        image = str(spec.get("image", ""))
        policy = spec.get("imagePullPolicy") or "IfNotPresent"  # the API server defaults it (builtin.py)
        found = self.podman.image(image)
        if found is None and policy == "Never":
            c.waiting = ("ErrImageNeverPull", f'Container image "{image}" is not present with pull policy of Never')
            return False
        if found is None or (policy == "Always" and not c.image_id):
            failure = self.podman.pull(image)
            found = self.podman.image(image) if failure is None else None
            if found is None:
                c.pulls += 1
                c.backoff = next_backoff(c.backoff)
                c.waiting = ("ErrImagePull", f'failed to pull image "{image}": {failure}') if c.pulls == 1 else (
                    "ImagePullBackOff", f'Back-off pulling image "{image}": {failure}')
                return False
        c.pulls, c.image_id, c.image_user = 0, found.id, found.user
        return True

    def _signal(self, c: Container, sig: int) -> None:
        """A signal for the container's main process: to the process group (process mode); through podman in
        container mode (SIGKILL removes the container, so nothing is left running when podman itself dies)."""
        if c.proc is None:
            return
        if self.podman is not None and c.runtime_name:
            if sig == signal.SIGKILL:
                self.podman.remove(c.runtime_name)
            elif self.podman.kill(c.runtime_name, sig):
                return
        _signal_group(c.proc, sig)

    def _lookup(self, namespace: str) -> Lookup:
        def lookup(kind: str, name: str) -> Obj | None:
            return self.store.find(self.store.type("/secrets" if kind == "secret" else "/configmaps"),
                                   namespace, name)
        return lookup

    def _environment(self, pod: Obj, rt: PodRuntime, spec: Obj) -> dict[str, str]:
        host, _, port = str(self.cluster.address).rpartition(":")
        service_env = {"KUBERNETES_SERVICE_HOST": host or "127.0.0.1", "KUBERNETES_SERVICE_PORT": port,
                       "KUBERNETES_SERVICE_PORT_HTTPS": port}
        env = resolve_env(spec, pod, self._lookup(pod["metadata"].get("namespace", "")), service_env, rt.ip)
        if self.podman is not None:  # the image's own environment, then the container's: nothing of the host's
            rt.env[spec["name"]] = env
            return env
        env = {k: rewrite_paths(v, rt.mounts) for k, v in env.items()}
        base = {k: os.environ[k] for k in _HOST_ENV if k in os.environ}
        base.update(HOSTNAME=pod["metadata"]["name"], KUBECONFIG=os.path.join(rt.dir, "kubeconfig"))
        full = {**base, **env}
        rt.env[spec["name"]] = full
        return full

    def _prepare(self, pod: Obj, rt: PodRuntime) -> None:
        """The pod's directory: kubeconfig, service account files and volumes (once, when all are there)."""
        if rt.prepared:
            return
        ns = pod["metadata"].get("namespace", "")
        volumes = _volume_files(pod, self._lookup(ns))  # raises VolumeError before anything is written
        os.makedirs(rt.dir, exist_ok=True)
        sa = pod["spec"].get("serviceAccountName") or "default"
        rt.sa_user = f"system:serviceaccount:{ns}:{sa}"
        rt.sa_dir = sa_dir = os.path.join(rt.dir, "serviceaccount")
        rt.sa_files = {"namespace": ns, "ca.crt": self.cluster.certs.ca_pem.decode()}
        ttl = self.config.token_ttl or None
        rt.token = self.cluster.new_token(rt.sa_user, ttl)
        rt.token_refresh_at = time.monotonic() + 0.8 * ttl if ttl else 0.0
        if self.podman is not None:
            rt.sa_modes = self._token_volume_modes(pod)
        write_atomically(sa_dir, {**rt.sa_files, "token": rt.token}, rt.sa_modes)
        self.cluster.write_kubeconfig(os.path.join(rt.dir, "kubeconfig"), "", rt.sa_user, ns or "default",
                                      token_file=os.path.join(sa_dir, "token"),
                                      ca_file=os.path.join(sa_dir, "ca.crt"))
        local: dict[str, str] = {}
        for vol_name, files in volumes.items():
            if isinstance(files, str):  # a hostPath: the host directory itself
                local[vol_name] = files
                continue
            vdir = os.path.join(rt.dir, "volumes", vol_name)
            os.makedirs(vdir, exist_ok=True)
            for rel, (data, mode) in files.items():
                path = os.path.join(vdir, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as fb:
                    fb.write(data)
                os.chmod(path, mode)
            local[vol_name] = vdir
            if self.podman is not None:
                _own_volume(vdir, files, pod, vol_name)
        rt.volumes = local
        mounts: list[tuple[str, str]] = [(SERVICE_ACCOUNT_DIR, sa_dir)]
        for c in pod["spec"].get("containers") or []:
            for m in c.get("volumeMounts") or []:
                target = local.get(m.get("name", ""))
                if target and m.get("mountPath"):
                    sub = m.get("subPath")
                    mounts.append((m["mountPath"], os.path.join(target, sub) if sub else target))
        rt.mounts = mounts
        rt.prepared = True

    def _token_volume_modes(self, pod: Obj) -> Callable[[str], FileMode]:
        """Modes and owners of the ServiceAccount volume's files (kube-api-access: defaultMode 0644)."""
        fs_group = ((pod["spec"].get("securityContext") or {}).get("fsGroup"))
        user = fs_user(pod)

        def modes(name: str) -> FileMode:
            return token_file(0o644, user, fs_group) if name == "token" else volume_file(0o644, fs_group)
        return modes

    def _run_spec(self, pod: Obj, rt: PodRuntime, c: Container, env: dict[str, str], attempt: int) -> RunSpec:
        """Container mode: the container as the CRI would create it from the pod spec."""
        meta, spec = pod["metadata"], c.spec
        security = effective_security(pod, spec)
        pod_security = pod["spec"].get("securityContext") or {}
        user = None
        if security.get("runAsUser") is not None:
            user = str(security["runAsUser"])
            if security.get("runAsGroup") is not None:
                user += f":{security['runAsGroup']}"
        groups = [int(g) for g in [pod_security.get("fsGroup"), *(pod_security.get("supplementalGroups") or [])]
                  if g is not None]
        capabilities = security.get("capabilities") or {}
        mounts: list[Mount] = []
        declared = {m.get("mountPath") for m in spec.get("volumeMounts") or []}
        if pod["spec"].get("automountServiceAccountToken", True) and SERVICE_ACCOUNT_DIR not in declared:
            mounts.append(Mount(rt.sa_dir, SERVICE_ACCOUNT_DIR, read_only=True))
        # Secret, ConfigMap, projected and downward API volumes are always mounted read-only (ReadOnlyAPIDataVolumes).
        api_data = {v.get("name") for v in pod["spec"].get("volumes") or []
                    if {"secret", "configMap", "projected", "downwardAPI"} & set(v)}
        for m in spec.get("volumeMounts") or []:
            source = rt.volumes.get(m.get("name", ""))
            if source and m.get("mountPath"):
                sub = m.get("subPath")
                mounts.append(Mount(os.path.join(source, sub) if sub else source, m["mountPath"],
                                    bool(m.get("readOnly")) or m.get("name") in api_data))
        lookup = env.get
        command = [expand(str(a), lookup) for a in spec.get("command") or []]
        name = f"k8s_{c.name}_{meta['name']}_{meta.get('namespace', '')}_{meta['uid']}_{attempt}"
        return RunSpec(
            name=name, image=str(spec.get("image", "")), entrypoint=command or None,
            args=[expand(str(a), lookup) for a in spec.get("args") or []], env=env, hostname=meta["name"][:63],
            user=user, groups=groups, read_only=bool(security.get("readOnlyRootFilesystem")),
            cap_add=[str(x) for x in capabilities.get("add") or []],
            cap_drop=[str(x) for x in capabilities.get("drop") or []],
            no_new_privileges=security.get("allowPrivilegeEscalation") is False,
            seccomp_unconfined=(security.get("seccompProfile") or {}).get("type") != "RuntimeDefault",
            mounts=mounts, workdir=spec.get("workingDir") or None,
            labels={SIM_PID_LABEL: str(os.getpid()), POD_LABEL: meta["uid"]})

    def _start(self, pod: Obj, rt: PodRuntime, c: Container, env: dict[str, str]) -> None:
        if self.podman is not None:
            run_spec = self._run_spec(pod, rt, c, env, c.restart_count)
            c.runtime_name = run_spec.name
            argv, workdir, env = self.podman.run_command(run_spec), None, _podman_environment()
            shown = [run_spec.name, run_spec.image, *run_spec.args]  # not --env: Secrets' values stay out of logs
        else:
            argv = [rewrite_paths(a, rt.mounts) for a in container_argv(c.spec, env, self.config.local_entrypoint)]
            workdir = rewrite_paths(c.spec["workingDir"], rt.mounts) if c.spec.get("workingDir") else None
            shown = argv
        os.makedirs(self.log_dir, exist_ok=True)
        log_path = os.path.join(self.log_dir, f"{pod['metadata'].get('namespace', '')}_{pod['metadata']['name']}_"
                                              f"{c.name}.log")
        c.started_at, c.started_mono = now(), time.monotonic()
        c.ready = c.started = False
        c.waiting = None
        if c.log is None:
            c.log = ContainerLog(log_path)
        # The output goes through a pipe that `ContainerLog.capture` copies into the file: pods/log needs to know
        # when each line came (timestamps, sinceSeconds), as the CRI log file tells a real kubelet.
        read_fd, write_fd = os.pipe()
        try:
            if not argv:
                raise FileNotFoundError("no command given and no local entrypoint configured for the image")
            with unpinned(self.config.process_cpus):
                c.proc = subprocess.Popen(argv, env=env, cwd=workdir if workdir and os.path.isdir(workdir) else None,
                                          stdin=subprocess.DEVNULL, stdout=write_fd, stderr=subprocess.STDOUT,
                                          start_new_session=True, close_fds=True)
        except OSError as exc:
            os.close(read_fd)
            os.close(write_fd)
            c.proc = None
            c.terminated = {"exitCode": 128, "reason": "StartError", "message": f"failed to start container "
                            f"process: exec: {argv[:1]}: {exc.strerror or exc}", "startedAt": c.started_at,
                            "finishedAt": now(), "containerID": ""}
            self._schedule_restart(c)
            return
        os.close(write_fd)
        run = c.log.begin(c.container_id())
        threading.Thread(target=c.log.capture, args=(run, read_fd), daemon=True,
                         name=f"output-{pod['metadata']['name']}-{c.name}").start()
        c.terminated = None
        log.info("kubelet: started %s/%s container %s (pid %d): %.160s", pod["metadata"].get("namespace", ""),
                 pod["metadata"]["name"], c.name, c.proc.pid, shlex.join(shown).replace("\n", "\\n"))
        key = (pod["metadata"].get("namespace", ""), pod["metadata"]["name"])
        c.runner = threading.Thread(target=self._watch_container, args=(key, rt, c, c.proc), daemon=True,
                                    name=f"container-{key[1]}-{c.name}")
        c.runner.start()

    def _schedule_restart(self, c: Container) -> None:
        # A container that ran long enough starts its back-off afresh, as the kubelet forgets old crashes.
        if c.started_mono and time.monotonic() - c.started_mono > 2 * BACKOFF_CAP:
            c.backoff = 0.0
        c.restart_at = time.monotonic() + c.backoff
        c.backoff = next_backoff(c.backoff)

    # ---- one thread per running container: waits for its exit and runs its probes

    def _watch_container(self, key: tuple[str, str], rt: PodRuntime, c: Container,
                         proc: subprocess.Popen[bytes]) -> None:
        start = time.monotonic()
        probes = [Probe(kind, c.spec[f"{kind}Probe"], start + float(c.spec[f"{kind}Probe"].get(
            "initialDelaySeconds", 0))) for kind in ("startup", "readiness", "liveness")
            if isinstance(c.spec.get(f"{kind}Probe"), dict)]
        has_startup = any(p.kind == "startup" for p in probes)
        c.started = not has_startup
        if not any(p.kind == "readiness" for p in probes):
            c.ready = c.started
        self.enqueue(key)
        while True:
            active = [p for p in probes if not c.stopping and (p.kind == "startup") != c.started]
            due = min((p.due for p in active), default=None)
            try:
                proc.wait(timeout=None if due is None else max(0.0, due - time.monotonic()))
                break
            except subprocess.TimeoutExpired:
                pass
            at = time.monotonic()
            for p in active:
                if p.due <= at and not c.stopping:
                    self._probe_once(key, rt, c, proc, p, has_startup)
        code = proc.returncode
        c.ready = False
        c.terminated = {"exitCode": code if code >= 0 else 128 - code, "reason": "Completed" if code == 0 else
                        "Error", "startedAt": c.started_at, "finishedAt": now(), "containerID": c.container_id()}
        if code < 0:
            c.terminated["signal"] = -code
        if not c.stopping:
            self._schedule_restart(c)
            log.info("kubelet: %s/%s container %s exited with %s", key[0], key[1], c.name, code)
        self.enqueue(key)

    def _probe_once(self, key: tuple[str, str], rt: PodRuntime, c: Container, proc: subprocess.Popen[bytes],
                    p: Probe, has_startup: bool) -> None:
        in_container = None
        if self.podman is not None:
            podman, name = self.podman, c.runtime_name

            def in_container(argv: list[str]) -> list[str]:
                return podman.exec_command(name, argv)
        ok, why = run_probe(p.spec, c.spec, rt.ip, rt.env.get(c.name, {}), rt.mounts, in_container)
        p.due = time.monotonic() + float(p.spec.get("periodSeconds", 10))
        if ok:
            p.successes, p.failures = p.successes + 1, 0
        else:
            p.failures, p.successes = p.failures + 1, 0
        if p.kind == "readiness":
            if ok and p.successes >= int(p.spec.get("successThreshold", 1)) and not c.ready:
                c.ready = True
                self.enqueue(key)
            elif not ok and p.failures >= int(p.spec.get("failureThreshold", 3)) and c.ready:
                c.ready = False
                self.enqueue(key)
            return
        if p.kind == "startup" and ok:
            c.started = True
            if "readinessProbe" not in c.spec:
                c.ready = True
            self.enqueue(key)
            return
        if not ok and p.failures >= int(p.spec.get("failureThreshold", 3)):
            log.info("kubelet: %s/%s container %s failed its %s probe (%s); killing it", key[0], key[1], c.name,
                     p.kind, why)
            p.failures = 0
            self._signal(c, signal.SIGTERM)
            try:
                proc.wait(timeout=float(p.spec.get("terminationGracePeriodSeconds", 2)))
            except subprocess.TimeoutExpired:
                self._signal(c, signal.SIGKILL)

    # ---- status

    def _write_status(self, pod: Obj, rt: PodRuntime) -> None:
        status = self._status(pod, rt)
        if status == pod.get("status"):
            return
        meta = pod["metadata"]

        def change(obj: Obj) -> bool:
            if obj["metadata"]["uid"] != rt.uid or obj["metadata"].get("deletionTimestamp"):
                return False
            obj["status"] = self._status(obj, rt)
            return True

        self.store.mutate(self.store.type("/pods"), meta.get("namespace", ""), meta["name"], change,
                          subresource="status", manager="kubelet")

    def _status(self, pod: Obj, rt: PodRuntime) -> Obj:
        old = pod.get("status") or {}
        policy = pod["spec"].get("restartPolicy", "Always")
        statuses, states = [], []
        for spec in pod["spec"].get("containers") or []:
            c = rt.containers.get(spec["name"]) or Container(spec["name"], spec)
            statuses.append(self._container_status(c, spec))
            if c.running():
                states.append("running")
            elif c.terminated is not None and c.final:
                states.append("succeeded" if c.terminated.get("exitCode") == 0 else "failed")
            elif c.terminated is not None or c.last_state:
                states.append("restarting")
            else:
                states.append("waiting")
        phase = pod_phase(states, policy)
        conditions = list(old.get("conditions") or [])
        conditions = set_condition(conditions, "PodReadyToStartContainers", "True")
        conditions = set_condition(conditions, "Initialized", "True")
        unready = sorted(s["name"] for s in statuses if not s["ready"])
        if phase in ("Succeeded", "Failed"):
            reason, message, ready = "PodCompleted", "", "False"
        elif unready:
            reason, message, ready = "ContainersNotReady", f"containers with unready status: [{' '.join(unready)}]", \
                "False"
        else:
            reason, message, ready = "", "", "True"
        conditions = set_condition(conditions, "Ready", ready, reason, message)
        conditions = set_condition(conditions, "ContainersReady", ready, reason, message)
        conditions = set_condition(conditions, "PodScheduled", "True")
        order = ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled")
        conditions.sort(key=lambda cond: order.index(cond["type"]) if cond["type"] in order else len(order))
        status = {k: v for k, v in old.items() if k not in ("containerStatuses", "conditions")}
        status.update(phase=phase, conditions=conditions, hostIP=HOST_IP, hostIPs=[{"ip": HOST_IP}],
                      podIP=rt.ip, podIPs=[{"ip": rt.ip}], startTime=old.get("startTime") or rt.start_time,
                      containerStatuses=sorted(statuses, key=lambda s: s["name"]))
        status.setdefault("qosClass", "BestEffort")
        return status

    def _container_status(self, c: Container, spec: Obj) -> Obj:
        image = str(spec.get("image", ""))
        state: Obj
        if c.running():
            state = {"running": {"startedAt": c.started_at}}
        elif c.terminated is not None and (c.final or c.waiting is None):
            state = {"terminated": c.terminated}
        else:
            reason, message = c.waiting or ("ContainerCreating", "")
            state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        # Waiting to restart (CrashLoopBackOff), the run that just ended is already the last state, as the kubelet
        # reports it: `kubectl logs` then shows that run's output.
        last = {"terminated": c.terminated} if "waiting" in state and c.terminated is not None else c.last_state
        out: Obj = {"name": c.name, "image": image, "imageID": "", "ready": bool(c.running() and c.ready),
                    "started": bool(c.running() and c.started), "restartCount": c.restart_count, "state": state,
                    "lastState": last}
        if c.proc is not None or c.fake:
            out["imageID"] = c.image_id or f"kubesim.local/{image}"
            out["containerID"] = c.container_id()
        return out

    # ---- pods/log

    def container_log(self, namespace: str, name: str, uid: str, container: str) -> ContainerLog | None:
        """The captured output of a container of the pod with this uid (None: it never ran a process here)."""
        with self._lock:
            rt = self.pods.get((namespace, name))
        if rt is None or rt.uid != uid:
            return None
        c = rt.containers.get(container)
        return c.log if c is not None else None

    # ---- shutdown

    def stop(self) -> None:
        super().stop()
        with self._lock:
            runtimes = list(self.pods.values())
        procs = [c.proc for rt in runtimes for c in rt.containers.values() if c.proc is not None]
        names = [c.runtime_name for rt in runtimes for c in rt.containers.values() if c.runtime_name]
        for rt in runtimes:
            for c in rt.containers.values():
                c.stopping = True
        for proc in procs:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)  # `podman run` hands it to its container (--sig-proxy)
        deadline = time.monotonic() + 3
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if self.podman is not None:
                    self.podman.remove(*names)
                _signal_group(proc, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=1)
        if self.podman is not None:
            self.podman.remove(*names)  # whatever a `podman run` that died left behind
        shutil.rmtree(self.work_dir, ignore_errors=True)


class VolumeError(Exception):
    """A volume's source is missing (the pod stays ContainerCreating, as with FailedMount)."""


VolumeFiles = dict[str, tuple[bytes, int]]


def _volume_files(pod: Obj, lookup: Lookup) -> dict[str, VolumeFiles | str]:
    """Files of each volume (relative path -> (content, mode)), or a host path for hostPath volumes."""
    out: dict[str, VolumeFiles | str] = {}
    for vol in pod["spec"].get("volumes") or []:
        name = vol.get("name", "")
        for kind, key, ref_name in (("secret", "secret", "secretName"), ("configmap", "configMap", "name")):
            source = vol.get(key)
            if not isinstance(source, dict):
                continue
            obj = lookup(kind, source.get(ref_name, ""))
            if obj is None:
                if source.get("optional"):
                    out[name] = {}
                    break
                raise VolumeError(f'MountVolume.SetUp failed for volume "{name}" : {kind} '
                                  f'"{source.get(ref_name, "")}" not found')
            data = {k: (base64.b64decode(v) if kind == "secret" else str(v).encode())
                    for k, v in (obj.get("data") or {}).items()}
            mode = int(source.get("defaultMode", 0o644))
            items = source.get("items")
            if items:
                out[name] = {i["path"]: (data.get(i["key"], b""), int(i.get("mode", mode))) for i in items}
            else:
                out[name] = {k: (v, mode) for k, v in data.items()}
            break
        else:
            if isinstance(vol.get("hostPath"), dict):
                out[name] = str(vol["hostPath"].get("path", ""))
            else:
                out[name] = {}  # emptyDir and anything else: an empty directory
    return out


def install(cluster: Any) -> None:
    """The node's kubelet (process or fake mode, from `cluster.config.kubelet_mode`)."""
    kubelet = Kubelet(cluster)
    cluster.add_component(kubelet)
    cluster.server.container_logs = kubelet.container_log


