"""A whole simulated cluster: the store, the API server and the controllers that play the cluster's parts."""

from __future__ import annotations

import base64
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from importlib import resources as package_files
from typing import Any, Protocol

import yaml

from . import (
    builtin,
    cdi,
    kubelet,
    kubevirt,
    network,
    nodelifecycle,
    nodes,
    scheduler,
    storage,
    tainteviction,
    upload,
    workloads,
)
from .certs import serving_cert
from .crd import CRD_KEY, CRDController
from .gc import GarbageCollector, NamespaceController
from .server import ApiServer
from .store import Store
from .volumes import VolumeFiles

_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

log = logging.getLogger(__name__)

CRD_FILES = ("kubevirt.io_virtualmachines.yaml", "kubevirt.io_virtualmachineinstances.yaml",
             "cdi.kubevirt.io_datavolumes.yaml")
NODE_NAME = nodes.NODE_NAME
ADMIN_USER = "kubernetes-admin"


@dataclass
class SimConfig:
    host: str = "127.0.0.1"
    port: int = 6443
    kubeconfig: str = ""
    history_size: int = 20000
    # kube-apiserver sends a watch that allows bookmarks one about once a minute.
    bookmark_interval: float = 60.0
    # KubeVirt timings (seconds): VMI Scheduled->Running, graceful ACPI shutdown, CDI import.
    vm_start_delay: float = 1.0
    vm_stop_delay: float = 2.0
    import_delay: float = 1.0
    # kubelet: "process" runs the project's image as local processes; "container" runs every image with podman
    # (kubelet.py, containers.py); "fake" marks pods Running and Ready.
    kubelet_mode: str = "process"
    # Container mode: the directory of the node's images and containers (default: containers.default_storage()).
    container_storage: str = ""
    # Images the kubelet runs as local processes (a regular expression on the image reference).
    local_image: str = r"(^|/)kubevbmc(:[^/]*)?(@.*)?$"
    # The command that stands for the image's entrypoint (`kubevbmc`), e.g. [sys.executable, "-m", "vbmc"].
    local_entrypoint: list[str] = field(default_factory=list)
    # Address ranges on loopback; two simulators running at once need ranges of their own.
    pod_cidr: str = "127.1.0.0/16"
    service_cidr: str = "127.2.0.0/16"
    load_balancer_cidr: str = "127.3.0.0/16"
    node_port_host: str = "127.0.0.1"
    log_dir: str = ""
    # The CPUs container processes run on when kubesim's own threads were pinned to one (see cpu.py); None: as
    # the process that starts them.
    process_cpus: frozenset[int] | None = None
    # Lifetime of the ServiceAccount tokens the kubelet gives pods (seconds; 0: they never expire). The kubelet
    # writes a new one at 80% of it, as it refreshes bound tokens; the old one is rejected once expired.
    token_ttl: float = 0.0
    # What runs behind a Running VMI (kubesim/guests.py): "qemu" (a QEMU process per VMI, as virt-launcher runs
    # one) or "simulated" (kubesim/console.py's model of a guest). The command line's default is "auto": qemu
    # where qemu-system-x86_64 is installed.
    guests: str = "simulated"
    # Where the cluster's node keeps its state: volume files, per-VM NVRAM, QEMU's sockets (default: a new
    # temporary directory, removed by stop()).
    state_dir: str = ""
    # Caps on what one QEMU guest gets, so that a fleet fits the machine (the VMI asks for more, it gets this).
    guest_memory_mib: int = 512
    guest_cpus: int = 1
    # "auto" (KVM where the host's KVM runs the guest's firmware, else QEMU's TCG), "kvm" or "tcg".
    accelerator: str = "auto"
    # The cluster network's boot server (served by QEMU's user-mode network over TFTP), and where containerDisk
    # images are found as files (kubesim/volumes.py). Empty: the test guests' cache (scripts/build-guests.sh).
    netboot_dir: str = ""
    container_disk_dir: str = ""
    # Service listeners kept per process before the next Services go to a proxy shard process (0: a quarter of
    # kubesim's limit of descriptors, half of a shard's; network.ProxyController).
    proxy_listeners: int = 0
    # Nodes (kubesim/nodes.py): kubesim-node, kubesim-node-2, ...
    nodes: int = 1
    # kube-controller-manager's --node-monitor-grace-period: how long a node's kubelet may be silent before the
    # node lifecycle controller marks it Unknown and taints it unreachable (kubesim/nodelifecycle.py).
    node_monitor_grace_period: float = 40.0


class TokenTable(dict[str, str]):
    """The API server's bearer tokens (token -> user). A token given an expiry is unknown from then on, as
    the TokenRequest API's bound tokens stop authenticating at their `exp`; the server's `token in table`
    then fails with 401. It also remembers when each token first authenticated a request (what a test
    measures a rotation by)."""

    def __init__(self, *args: Any, clock: Any = time.monotonic) -> None:
        super().__init__(*args)
        self._clock = clock
        self._expires: dict[str, float] = {}
        self._first_used: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, token: str, user: str, ttl: float | None = None) -> None:
        with self._lock:
            self._forget_expired()
            self[token] = user
            if ttl is not None:
                self._expires[token] = self._clock() + ttl

    def expire(self, token: str, after: float) -> None:
        """The token stops authenticating `after` seconds from now (or at its own expiry if sooner)."""
        with self._lock:
            at = self._clock() + after
            self._expires[token] = min(at, self._expires.get(token, at))

    def __contains__(self, token: object) -> bool:
        if not super().__contains__(token):
            return False
        expires = self._expires.get(token)  # type: ignore[call-overload]
        return expires is None or self._clock() < expires

    def __getitem__(self, token: str) -> str:
        if token not in self._first_used:
            self._first_used.setdefault(token, self._clock())
        return super().__getitem__(token)

    def first_used(self, token: str) -> float | None:
        """When the token first authenticated a request (time.monotonic), None if never."""
        return self._first_used.get(token)

    def _forget_expired(self) -> None:
        at = self._clock()
        for token in [t for t, expires in self._expires.items() if expires <= at]:
            self.pop(token, None)
            del self._expires[token]
            self._first_used.pop(token, None)


class Component(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


class Cluster:
    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        self.store = Store(history_size=self.config.history_size)
        self.admin_token = secrets.token_hex(16)
        self.tokens = TokenTable({self.admin_token: ADMIN_USER})
        self.certs = serving_cert(["127.0.0.1", "localhost", self.config.host, "kubernetes.default.svc"])
        tls = self.certs.server_context()  # no key file is left behind
        self._temporary: list[str] = []  # directories this cluster made, removed by stop()
        self.state_dir = self.config.state_dir or self._temporary_dir("kubesim-node-")
        self.volumes = VolumeFiles(os.path.join(self.state_dir, "volumes"), self.config.container_disk_dir)
        self.server = ApiServer(self.store, self.tokens, self.config.bookmark_interval, tls)
        self.server.admin_user = ADMIN_USER
        self.server.node_power = lambda name, on: (self.power_on_node if on else self.power_off_node)(name)
        self.server.node_report = lambda: self.nodes.report()
        self.components: list[Component] = []
        self.address = ""
        self.kubeconfig = ""
        for rtype in builtin.builtin_types():
            self.store.add_type(rtype)
        self.components += [CRDController(self.store), GarbageCollector(self.store),
                            NamespaceController(self.store)]
        self.nodes: nodes.Nodes
        for part in (nodes, network, scheduler, workloads, kubelet, nodelifecycle, tainteviction, storage, kubevirt,
                     cdi, upload):
            part.install(self)

    @property
    def url(self) -> str:
        return f"https://{self.address}"

    def add_component(self, component: Component) -> None:
        self.components.append(component)

    def new_token(self, user: str, ttl: float | None = None) -> str:
        """A bearer token for `user`, valid for `ttl` seconds (None: until the cluster stops)."""
        token = secrets.token_hex(16)
        self.tokens.add(token, user, ttl)
        return token

    def rotate_service_account_token(self, namespace: str, pod: str, grace: float) -> tuple[str, str]:
        """What the kubelet does when a pod's bound token nears its expiry: a new token is written to the pod's
        token file (atomically) and is valid at once; the old one is rejected with 401 after `grace` seconds.
        Returns (old, new). Raises KeyError for a pod the kubelet has not started."""
        return self._kubelet().rotate_token(namespace, pod, grace)

    def pod_kubeconfig(self, namespace: str, pod: str) -> str:
        """The kubeconfig the kubelet gave a pod's processes (KUBECONFIG). KeyError for a pod it has not started."""
        return self._kubelet().kubeconfig_of(namespace, pod)

    def power_off_node(self, name: str) -> None:
        """Node `name` loses power: its kubelet stops renewing its Lease and posting its status, and its pods'
        processes die unreported, as a powered-off machine's would. KeyError for an unknown node."""
        self.nodes.power_off(name)
        self._kubelet().power_off(name)

    def power_on_node(self, name: str) -> None:
        """Node `name` boots again: its kubelet reports Ready and goes through the pods still bound to it."""
        self.nodes.power_on(name)
        self._kubelet().power_on(name)

    def _temporary_dir(self, prefix: str) -> str:
        directory = tempfile.mkdtemp(prefix=prefix)
        self._temporary.append(directory)
        return directory

    def _kubelet(self) -> kubelet.Kubelet:
        return next(c for c in self.components if isinstance(c, kubelet.Kubelet))

    def start(self) -> None:
        for component in self.components:
            component.start()
        self._bootstrap()
        host, port = self.server.start(self.config.host, self.config.port)
        self.address = f"{host}:{port}"
        self.kubeconfig = self.write_kubeconfig(self.config.kubeconfig, self.admin_token, ADMIN_USER)

    def stop(self) -> None:
        self.server.stop()
        self.nodes.stop()
        for component in reversed(self.components):
            try:
                component.stop()
            except Exception:
                log.exception("stopping %s", component)
        for directory in self._temporary:
            shutil.rmtree(directory, ignore_errors=True)  # kubeconfigs hold tokens
        self._temporary.clear()

    def write_kubeconfig(self, path: str, token: str, user: str, namespace: str = "default", *,
                         token_file: str = "", ca_file: str = "") -> str:
        """A kubeconfig for `user`: with `token` inline, or naming `token_file` (read again by clients as it
        rotates); the CA inline, or as `ca_file`."""
        if not path:
            directory = tempfile.mkdtemp(prefix="kubesim-")
            self._temporary.append(directory)
            path = os.path.join(directory, "kubeconfig")
        cluster: dict[str, Any] = {"server": self.url}
        if ca_file:
            cluster["certificate-authority"] = ca_file
        else:
            cluster["certificate-authority-data"] = base64.b64encode(self.certs.ca_pem).decode()
        config: dict[str, Any] = {
            "apiVersion": "v1", "kind": "Config", "current-context": "kubesim", "preferences": {},
            "clusters": [{"name": "kubesim", "cluster": cluster}],
            "users": [{"name": user, "user": {"tokenFile": token_file} if token_file else {"token": token}}],
            "contexts": [{"name": "kubesim", "context": {"cluster": "kubesim", "user": user,
                                                          "namespace": namespace}}],
        }
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            yaml.safe_dump(config, fh)
        os.chmod(path, 0o600)
        return path

    def _bootstrap(self) -> None:
        store = self.store
        for name in ("default", "kube-system", "kube-public", "kube-node-lease"):
            store.create(store.type("/namespaces"), {"metadata": {"name": name}})
        self.nodes.start()  # the kubelets register their nodes and take their Leases in kube-node-lease
        crd_type = store.type(CRD_KEY)
        for filename in CRD_FILES:
            text = package_files.files("kubesim").joinpath("crds", filename).read_text(encoding="utf-8")
            # libyaml's loader: KubeVirt's CRDs are 450 kB of YAML, three seconds for the pure-Python one.
            store.create(crd_type, yaml.load(text, Loader=_YAML_LOADER), manager="kubesim")
