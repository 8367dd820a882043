"""The cluster network of the simulator: IP allocation, Service admission, Endpoints, and a kube-proxy.

Everything lives on loopback: Linux routes all of 127.0.0.0/8 to `lo`, so a pod process can bind its Pod IP
(127.1.x.y), and the proxy can bind a Service's ClusterIP (127.2.x.y), its LoadBalancer ingress (127.3.x.y) and
`node_port_host:nodePort` without any interface configuration. That is what lets `ipmitool -H <clusterIP>`
reach an agent pod exactly as it would in a real cluster.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import itertools
import json
import logging
import resource
import selectors
import socket
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from . import errors
from .loop import ControlLoop
from .objects import clone
from .store import DELETED, Event, Store

log = logging.getLogger(__name__)

Obj = dict[str, Any]

LB_CIDR = "127.3.0.0/16"  # the simulator's MetalLB pool for LoadBalancer ingress IPs
NODE_PORT_RANGE = (30000, 32767)
UDP_IDLE_SECONDS = 30.0  # like conntrack's UDP stream timeout: a flow forgotten after this much silence
ENDPOINTS_MANAGED_BY = "endpoints.kubernetes.io/managed-by"


# ---- allocation


class IPAllocator:
    """Addresses of one CIDR, handed out round-robin so a just-released address is not reused at once.

    The network and broadcast addresses are never handed out (as Kubernetes' ipallocator), nor any address
    ending in .0 or .255: on a /16 those look like network or broadcast addresses to people and some tools.
    """

    def __init__(self, cidr: str) -> None:
        self.network = ipaddress.ip_network(cidr)
        self.cidr = cidr
        self._first = int(self.network.network_address) + 1
        self._size = max(0, self.network.num_addresses - 2)
        self._used: dict[str, Hashable] = {}  # address -> owner
        self._cursor = 0
        self._lock = threading.Lock()

    def usable(self, ip: str) -> bool:
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            return False
        return (addr in self.network and addr != self.network.network_address
                and addr != self.network.broadcast_address and int(addr) & 0xFF not in (0, 255))

    def allocate(self, owner: Hashable, reclaimable: Callable[[str, Hashable], bool] | None = None) -> str:
        """The next free address, recorded against `owner`; raises `RangeFull`."""
        with self._lock:
            for _ in range(self._size):
                ip = str(ipaddress.ip_address(self._first + self._cursor))
                self._cursor = (self._cursor + 1) % self._size
                if not self.usable(ip):
                    continue
                holder = self._used.get(ip)
                if holder is None or (holder != owner and reclaimable is not None and reclaimable(ip, holder)):
                    self._used[ip] = owner
                    return ip
            raise RangeFull(f"range is full: {self.cidr}")

    def claim(self, ip: str, owner: Hashable, reclaimable: Callable[[str, Hashable], bool] | None = None) -> None:
        """Record a requested address; raises `NotInRange` or `AlreadyAllocated` (Kubernetes' messages)."""
        if not self.usable(ip):
            raise NotInRange(f"the provided IP ({ip}) is not in the valid range. The range of valid IPs is "
                             f"{self.cidr}")
        with self._lock:
            holder = self._used.get(ip)
            if holder is not None and holder != owner and not (reclaimable and reclaimable(ip, holder)):
                raise AlreadyAllocated("provided IP is already allocated")
            self._used[ip] = owner

    def release(self, ip: str, owner: Hashable | None = None) -> None:
        with self._lock:
            if owner is None or self._used.get(ip) == owner:
                self._used.pop(ip, None)

    def owner(self, ip: str) -> Hashable | None:
        return self._used.get(ip)

    def in_use(self) -> int:
        return len(self._used)


class PortAllocator:
    """NodePorts (30000-32767), with Kubernetes' messages for a requested port that cannot be had."""

    def __init__(self, low: int = NODE_PORT_RANGE[0], high: int = NODE_PORT_RANGE[1]) -> None:
        self.low, self.high = low, high
        self._used: dict[int, Hashable] = {}
        self._cursor = 0
        self._lock = threading.Lock()

    def allocate(self, owner: Hashable, reclaimable: Callable[[int, Hashable], bool] | None = None) -> int:
        size = self.high - self.low + 1
        with self._lock:
            for _ in range(size):
                port = self.low + self._cursor
                self._cursor = (self._cursor + 1) % size
                holder = self._used.get(port)
                if holder is None or (holder != owner and reclaimable is not None and reclaimable(port, holder)):
                    self._used[port] = owner
                    return port
        raise RangeFull("range is full")

    def claim(self, port: int, owner: Hashable, reclaimable: Callable[[int, Hashable], bool] | None = None) -> None:
        if not self.low <= port <= self.high:
            raise NotInRange(f"provided port is not in the valid range. The range of valid ports is "
                             f"{self.low}-{self.high}")
        with self._lock:
            holder = self._used.get(port)
            if holder is not None and holder != owner and not (reclaimable and reclaimable(port, holder)):
                raise AlreadyAllocated("provided port is already allocated")
            self._used[port] = owner

    def release(self, port: int, owner: Hashable | None = None) -> None:
        with self._lock:
            if owner is None or self._used.get(port) == owner:
                self._used.pop(port, None)


class RangeFull(Exception):
    pass


class NotInRange(Exception):
    pass


class AlreadyAllocated(Exception):
    pass


@dataclass
class Network:
    """The allocators of one simulated cluster."""

    pod_ips: IPAllocator
    service_ips: IPAllocator
    lb_ips: IPAllocator
    node_ports: PortAllocator = field(default_factory=PortAllocator)


_NETWORKS: weakref.WeakKeyDictionary[Store, Network] = weakref.WeakKeyDictionary()


def network_of(cluster: Any) -> Network:
    """The allocators of `cluster` (made on first use), shared by the kubelet and the Service admission."""
    net = _NETWORKS.get(cluster.store)
    if net is None:
        net = Network(IPAllocator(cluster.config.pod_cidr), IPAllocator(cluster.config.service_cidr),
                      IPAllocator(getattr(cluster.config, "load_balancer_cidr", LB_CIDR)))
        _NETWORKS[cluster.store] = net
    return net


# ---- Service admission: what kube-apiserver's service REST storage allocates


def needs_node_ports(spec: Obj) -> bool:
    svc_type = spec.get("type")
    return svc_type == "NodePort" or (svc_type == "LoadBalancer"
                                      and spec.get("allocateLoadBalancerNodePorts", True) is not False)


class ServiceAdmission:
    """Assigns ClusterIPs, NodePorts and LoadBalancer ingress on write; releases them on delete.

    It runs under the store lock, so every earlier write has either committed or failed: an address recorded
    for a Service that the store does not hold with that address is a leftover of a write that failed later
    in validation, and may be taken again.
    """

    def __init__(self, store: Store, net: Network) -> None:
        self.store = store
        self.net = net

    def _live(self, key: Hashable) -> Obj | None:
        assert isinstance(key, tuple)
        return self.store.find(self.store.type("/services"), key[0], key[1])

    def _ip_stale(self, ip: str, holder: Hashable) -> bool:
        svc = self._live(holder)
        return svc is None or ip not in ((svc.get("spec") or {}).get("clusterIPs") or [])

    def _lb_stale(self, ip: str, holder: Hashable) -> bool:
        svc = self._live(holder)
        ingress = (((svc or {}).get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
        return svc is None or all(i.get("ip") != ip for i in ingress)

    def _port_stale(self, port: int, holder: Hashable) -> bool:
        svc = self._live(holder)
        return svc is None or all(p.get("nodePort") != port for p in (svc.get("spec") or {}).get("ports") or [])

    def __call__(self, op: str, rtype: Any, new: Obj, old: Obj | None) -> None:
        if rtype.key != "/services":
            return
        meta = new["metadata"]
        key = (meta.get("namespace", ""), meta.get("name", ""))
        spec = new.setdefault("spec", {})
        old_spec = (old or {}).get("spec") or {}
        name = meta.get("name", "")
        if old is not None:
            # As the service REST storage's patchAllocatedValues: an update that leaves the allocated values
            # out keeps them (a PUT built from a manifest has no clusterIP).
            if not spec.get("clusterIP") and old_spec.get("clusterIP"):
                spec["clusterIP"] = old_spec["clusterIP"]
                spec["clusterIPs"] = clone(old_spec.get("clusterIPs") or [old_spec["clusterIP"]])
            if needs_node_ports(spec) and needs_node_ports(old_spec):
                old_ports = {(p.get("port"), p.get("protocol")): p.get("nodePort")
                             for p in old_spec.get("ports") or [] if isinstance(p, dict)}
                for port in spec.get("ports") or []:
                    if isinstance(port, dict) and not port.get("nodePort"):
                        kept = old_ports.get((port.get("port"), port.get("protocol")))
                        if kept:
                            port["nodePort"] = kept
        if spec.get("type") == "ExternalName":
            return
        self._assign_cluster_ip(key, name, spec, old_spec)
        self._assign_node_ports(key, name, spec)
        if spec.get("type") == "LoadBalancer":
            # A copy: the status of an update may be the stored one itself, which nobody edits in place.
            status = new["status"] = dict(new.get("status") or {})
            kept = (old.get("status") or {}).get("loadBalancer") if old is not None else None
            lb = status["loadBalancer"] = clone(kept if kept is not None else status.get("loadBalancer") or {})
            if not lb.get("ingress"):
                try:
                    lb["ingress"] = [{"ip": self.net.lb_ips.allocate(key, self._lb_stale), "ipMode": "VIP"}]
                except RangeFull:
                    log.error("no LoadBalancer IP left in %s for service %s/%s", LB_CIDR, *key)

    def _assign_cluster_ip(self, key: tuple[str, str], name: str, spec: Obj, old_spec: Obj) -> None:
        wanted = spec.get("clusterIP") or ((spec.get("clusterIPs") or [None])[0])
        if wanted == "None":
            spec["clusterIP"], spec["clusterIPs"] = "None", ["None"]
            return
        if wanted and wanted == old_spec.get("clusterIP"):
            spec["clusterIPs"] = [wanted]
            return
        try:
            if wanted:
                self.net.service_ips.claim(wanted, key, self._ip_stale)
                ip = wanted
            else:
                ip = self.net.service_ips.allocate(key, self._ip_stale)
        except (NotInRange, AlreadyAllocated, RangeFull) as exc:
            raise errors.invalid("Service", name, [{
                "field": "spec.clusterIPs",
                "message": f"Invalid value: {json.dumps([wanted] if wanted else [])}: failed to allocate IP "
                           f"{wanted or ''}: {exc}".replace("IP : ", "IP: ")}]) from None
        spec["clusterIP"], spec["clusterIPs"] = ip, [ip]

    def _assign_node_ports(self, key: tuple[str, str], name: str, spec: Obj) -> None:
        if not needs_node_ports(spec):
            for port in spec.get("ports") or []:
                if isinstance(port, dict):
                    port.pop("nodePort", None)
            return
        for i, port in enumerate(spec.get("ports") or []):
            if not isinstance(port, dict):
                continue
            try:
                if port.get("nodePort"):
                    self.net.node_ports.claim(int(port["nodePort"]), key, self._port_stale)
                else:
                    port["nodePort"] = self.net.node_ports.allocate(key, self._port_stale)
            except (NotInRange, AlreadyAllocated, RangeFull) as exc:
                raise errors.invalid("Service", name, [{
                    "field": f"spec.ports[{i}].nodePort",
                    "message": f"Invalid value: {port.get('nodePort')}: {exc}"}]) from None

    def release(self, event: Event) -> None:
        """Listener: free what a deleted (or changed) Service no longer holds."""
        if event.rtype.key != "/services" or event.old is None:
            return
        meta = event.obj["metadata"]
        key = (meta.get("namespace", ""), meta["name"])
        held_now = _held(event.obj) if event.type != DELETED else (set(), set(), set())
        held_before = _held(event.old)
        for ip in held_before[0] - held_now[0]:
            self.net.service_ips.release(ip, key)
        for port in held_before[1] - held_now[1]:
            self.net.node_ports.release(port, key)
        for ip in held_before[2] - held_now[2]:
            self.net.lb_ips.release(ip, key)


def _held(svc: Obj) -> tuple[set[str], set[int], set[str]]:
    spec = svc.get("spec") or {}
    ips = {ip for ip in spec.get("clusterIPs") or [] if ip and ip != "None"}
    ports = {int(p["nodePort"]) for p in spec.get("ports") or [] if isinstance(p, dict) and p.get("nodePort")}
    lb = {i["ip"] for i in ((svc.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
          if i.get("ip")}
    return ips, ports, lb


# ---- Endpoints


def pod_ready(pod: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def resolve_target_port(pod: Obj, target: Any, protocol: str) -> int | None:
    """A Service targetPort for one pod: a number, or the name of a container port of that protocol."""
    if isinstance(target, int):
        return target
    if isinstance(target, str) and target.isdigit():
        return int(target)
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == target and port.get("protocol", "TCP") == protocol:
                return int(port["containerPort"])
    return None


def desired_subsets(service: Obj, pods: Iterable[Obj]) -> list[Obj]:
    """core/v1 Endpoints subsets for a Service, as the endpoints controller groups them.

    Pods are grouped by their resolved ports (a named targetPort can differ between pods); ready pods go in
    `addresses`, the others in `notReadyAddresses` (all in `addresses` with publishNotReadyAddresses).
    Terminating and finished pods, and pods without an IP yet, are left out.
    """
    spec = service.get("spec") or {}
    publish = bool(spec.get("publishNotReadyAddresses"))
    groups: dict[tuple[tuple[str, int, str], ...], tuple[list[Obj], list[Obj]]] = {}
    for pod in pods:
        status = pod.get("status") or {}
        if not status.get("podIP") or status.get("phase") in ("Succeeded", "Failed"):
            continue
        if pod["metadata"].get("deletionTimestamp") and not publish:
            continue
        ports: list[tuple[str, int, str]] = []
        for sp in spec.get("ports") or []:
            protocol = sp.get("protocol", "TCP")
            number = resolve_target_port(pod, sp.get("targetPort", sp.get("port")), protocol)
            if number is not None:
                ports.append((sp.get("name", ""), number, protocol))
        if not ports:
            continue
        address: Obj = {"ip": status["podIP"], "targetRef": {
            "kind": "Pod", "namespace": pod["metadata"].get("namespace", ""), "name": pod["metadata"]["name"],
            "uid": pod["metadata"]["uid"]}}
        if (pod.get("spec") or {}).get("nodeName"):
            address["nodeName"] = pod["spec"]["nodeName"]
        ready, not_ready = groups.setdefault(tuple(sorted(ports)), ([], []))
        (ready if publish or pod_ready(pod) else not_ready).append(address)
    subsets: list[Obj] = []
    for ports_key, (ready, not_ready) in sorted(groups.items()):
        subset: Obj = {}
        if ready:
            subset["addresses"] = sorted(ready, key=_ip_key)
        if not_ready:
            subset["notReadyAddresses"] = sorted(not_ready, key=_ip_key)
        subset["ports"] = [{**({"name": n} if n else {}), "port": p, "protocol": proto}
                           for n, p, proto in ports_key]
        subsets.append(subset)
    return subsets


def _ip_key(address: Obj) -> tuple[int, str]:
    return int(ipaddress.ip_address(address["ip"])), address["targetRef"]["name"]


def selector_matches(selector: Obj, labels: Obj) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


class EndpointsController(ControlLoop):
    name = "endpoints-controller"
    kinds = ("/services", "/pods")

    def __init__(self, store: Store) -> None:
        super().__init__(store, workers=2)
        # Indexes kept from events (under the store lock), so that neither a pod event nor a sync scans the
        # namespace: namespace -> service name -> selector; namespace -> selector (as a frozenset) -> services;
        # namespace -> label (key, value) -> pod names.
        self._selectors: dict[str, dict[str, Obj]] = {}
        self._services_by_selector: dict[str, dict[frozenset[tuple[str, str]], set[str]]] = {}
        self._pods_by_label: dict[str, dict[tuple[str, str], set[str]]] = {}
        self._pod_labels: dict[str, dict[str, Obj]] = {}

    def keys_for(self, event: Event) -> Iterable[Hashable]:
        meta = event.obj["metadata"]
        ns = meta.get("namespace", "")
        if event.rtype.key == "/services":
            self._index_service(ns, meta["name"], None if event.type == DELETED else
                                (event.obj.get("spec") or {}).get("selector"))
            return [(ns, meta["name"])]
        labels = meta.get("labels") or {}
        old_labels = ((event.old or {}).get("metadata") or {}).get("labels") or {}
        self._index_pod(ns, meta["name"], {} if event.type == DELETED else labels)
        return [(ns, name) for name in sorted(self._services_selecting(ns, labels) |
                                              self._services_selecting(ns, old_labels))]

    def _services_selecting(self, ns: str, labels: Obj) -> set[str]:
        """The Services whose selector `labels` satisfies: a selector is a subset of the labels."""
        selectors = self._selectors.get(ns, {})
        if len(labels) > 8:  # too many subsets to look up: scan
            return {name for name, sel in selectors.items() if selector_matches(sel, labels)}
        by_selector = self._services_by_selector.get(ns, {})
        pairs = list(labels.items())
        found: set[str] = set()
        for size in range(1, len(pairs) + 1):
            for subset in itertools.combinations(pairs, size):
                found |= by_selector.get(frozenset(subset), set())
        return found

    def _index_service(self, ns: str, name: str, selector: Obj | None) -> None:
        selectors = self._selectors.setdefault(ns, {})
        by_selector = self._services_by_selector.setdefault(ns, {})
        previous = selectors.pop(name, None)
        if previous:
            by_selector.get(frozenset(previous.items()), set()).discard(name)
        if selector:
            selectors[name] = selector
            by_selector.setdefault(frozenset(selector.items()), set()).add(name)

    def _index_pod(self, ns: str, name: str, labels: Obj) -> None:
        by_label = self._pods_by_label.setdefault(ns, {})
        known = self._pod_labels.setdefault(ns, {})
        for pair in (known.pop(name, None) or {}).items():
            if labels.get(pair[0]) != pair[1]:
                by_label.get(pair, set()).discard(name)
        for pair in labels.items():
            by_label.setdefault(pair, set()).add(name)
        if labels:
            known[name] = dict(labels)

    def _pods_selected(self, ns: str, selector: Obj) -> list[Obj]:
        by_label = self._pods_by_label.get(ns, {})
        sets: list[set[str]] = [by_label.get(pair, set()) for pair in selector.items()]
        smallest: set[str] = min(sets, key=len)
        candidates = list(smallest)
        pod_type = self.store.type("/pods")
        pods = [p for p in (self.store.find(pod_type, ns, n) for n in candidates)
                if p is not None and selector_matches(selector, p["metadata"].get("labels") or {})]
        return sorted(pods, key=lambda p: p["metadata"]["name"])

    def sync(self, key: Hashable) -> float | None:
        assert isinstance(key, tuple)
        ns, name = key
        store = self.store
        ep_type = store.type("/endpoints")
        svc = store.find(store.type("/services"), ns, name)
        current = store.find(ep_type, ns, name)
        selector = (svc or {}).get("spec", {}).get("selector")
        if svc is None or not selector:
            # Endpoints of a selector-less Service belong to whoever wrote them; ours go with the Service.
            if current is not None and svc is None and (current["metadata"].get("labels") or {}).get(
                    ENDPOINTS_MANAGED_BY) == "endpoint-controller":
                with contextlib.suppress(errors.ApiError):
                    store.delete(ep_type, ns, name)
            return None
        pods = self._pods_selected(ns, selector)
        subsets = desired_subsets(svc, pods)
        labels = dict(svc["metadata"].get("labels") or {})
        labels[ENDPOINTS_MANAGED_BY] = "endpoint-controller"
        if svc["spec"].get("clusterIP") == "None":
            labels["service.kubernetes.io/headless"] = ""
        if current is None:
            store.create(ep_type, {"apiVersion": "v1", "kind": "Endpoints",
                                   "metadata": {"name": name, "namespace": ns, "labels": labels},
                                   "subsets": subsets}, namespace=ns, manager="endpoint-controller")
            return None
        if current.get("subsets", []) == subsets and current["metadata"].get("labels") == labels:
            return None

        def change(obj: Obj) -> None:
            obj["subsets"] = subsets
            obj["metadata"]["labels"] = labels

        store.mutate(ep_type, ns, name, change, manager="endpoint-controller", only="metadata")
        return None


# ---- the proxy


Frontend = tuple[str, int, str]  # (address, port, protocol)


@dataclass
class Route:
    """Where a frontend leads: a Service port, resolved against its Endpoints at connection time."""

    namespace: str
    service: str
    port_name: str


@dataclass
class _Flow:
    """One UDP client of one frontend: its own socket to the chosen backend."""

    frontend: socket.socket
    client: tuple[str, int]
    upstream: socket.socket
    backend: tuple[str, int]
    last: float


@dataclass(eq=False)
class _Pipe:
    """One side of a proxied TCP connection: what it reads goes to `peer.out`."""

    sock: socket.socket
    peer: _Pipe | None = None
    out: bytearray = field(default_factory=bytearray)  # waiting to be written to `sock`
    connecting: bool = False  # the backend side, until its non-blocking connect completes
    read_eof: bool = False
    write_shut: bool = False
    mask: int = 0  # the selector events currently registered
    closed: bool = False


_MAX_BUFFER = 1 << 20  # stop reading a side while its peer has this much unsent


class Proxy:
    """A kube-proxy in userspace: one selector thread for every listener, UDP flow and TCP connection."""

    def __init__(self, store: Store | None) -> None:
        self.store = store  # None: a shard process, whose backends the parent sends (`set_table`)
        self._table: dict[Frontend, list[tuple[str, int]]] = {}
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._commands: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._listeners: dict[Frontend, tuple[socket.socket, Route]] = {}
        self._by_service: dict[tuple[str, str], set[Frontend]] = {}
        self._flows: dict[tuple[int, tuple[str, int]], _Flow] = {}  # (frontend fd, client) -> flow
        self._rr = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.bind_errors: dict[Frontend, str] = {}

    # ---- control (any thread)

    def set_routes(self, owner: tuple[str, str], routes: dict[Frontend, Route]) -> None:
        """The frontends of one Service; the ones it no longer has are closed."""
        self._call(lambda: self._apply(owner, routes))

    def set_table(self, owner: tuple[str, str], table: dict[Frontend, tuple[Route, list[tuple[str, int]]]]) -> None:
        """A shard's Service: its frontends and the backends of each (what `_choices` reads from the store)."""
        def apply() -> None:
            for frontend in self._by_service.get(owner, set()) - set(table):
                self._table.pop(frontend, None)
            self._table.update((frontend, backends) for frontend, (_, backends) in table.items())
            self._apply(owner, {frontend: route for frontend, (route, _) in table.items()})
        self._call(apply)

    def start(self) -> None:
        _raise_fd_limit()
        self._sel.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        self._thread = threading.Thread(target=self._run, name="kube-proxy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _call(self, command: Callable[[], None]) -> None:
        with self._lock:
            self._commands.append(command)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # ---- the loop (proxy thread only)

    def _run(self) -> None:
        next_sweep = time.monotonic() + 5
        while not self._stopping:
            for key, mask in self._sel.select(timeout=1.0):
                kind, data = key.data
                try:
                    self._handle(kind, data, key.fileobj, mask)  # type: ignore[arg-type]
                except OSError as exc:
                    log.debug("proxy: %s: %s", kind, exc)
            if time.monotonic() >= next_sweep:
                self._expire_flows()
                next_sweep = time.monotonic() + 5
        self._close_all()

    def _handle(self, kind: str, data: Any, sock: socket.socket, mask: int) -> None:
        if kind == "wake":
            with contextlib.suppress(BlockingIOError):
                sock.recv(4096)
            with self._lock:
                commands, self._commands = self._commands, []
            for command in commands:
                command()
        elif kind == "tcp-listen":
            self._accept(sock, data)
        elif kind == "udp-listen":
            self._udp_from_client(sock, data)
        elif kind == "udp-flow":
            self._udp_from_backend(data)
        elif kind == "tcp":
            self._tcp_ready(data, mask)

    def _apply(self, owner: tuple[str, str], routes: dict[Frontend, Route]) -> None:
        mine = self._by_service.setdefault(owner, set())
        for frontend in list(mine):
            if frontend not in routes:
                self._close_listener(frontend)
                mine.discard(frontend)
        for frontend, route in routes.items():
            have = self._listeners.get(frontend)
            if have is not None:
                if (have[1].namespace, have[1].service) != owner:
                    log.error("proxy: %s %s:%d is already served for service %s/%s", frontend[2], frontend[0],
                              frontend[1], have[1].namespace, have[1].service)
                    continue
                self._listeners[frontend] = (have[0], route)
                continue
            bound = self._bind(frontend)
            if bound is not None:
                self._listeners[frontend] = (bound, route)
                mine.add(frontend)
                kind = "udp-listen" if frontend[2] == "UDP" else "tcp-listen"
                self._sel.register(bound, selectors.EVENT_READ, (kind, frontend))
        if not mine:
            del self._by_service[owner]

    def _bind(self, frontend: Frontend) -> socket.socket | None:
        host, port, protocol = frontend
        if protocol not in ("TCP", "UDP"):
            return None
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM if protocol == "UDP" else socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            if protocol == "TCP":
                sock.listen(128)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            why = ("binding a port below 1024 needs root or CAP_NET_BIND_SERVICE"
                   if exc.errno == errno.EACCES and port < 1024 else str(exc))
            self.bind_errors[frontend] = why
            log.error("proxy: cannot listen on %s %s:%d: %s; this frontend is not served", protocol, host,
                      port, why)
            return None
        self.bind_errors.pop(frontend, None)
        return sock

    def _close_listener(self, frontend: Frontend) -> None:
        sock, _ = self._listeners.pop(frontend)
        for flow_key, flow in list(self._flows.items()):
            if flow.frontend is sock:
                self._drop_flow(flow_key)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(sock)
        sock.close()

    def _backend(self, frontend: Frontend) -> tuple[str, int] | None:
        """A ready endpoint of the frontend's Service port, round-robin (kube-proxy's userspace mode)."""
        choices = self._choices(frontend)
        return choices[next(self._rr) % len(choices)] if choices else None

    def _choices(self, frontend: Frontend) -> list[tuple[str, int]]:
        entry = self._listeners.get(frontend)
        if entry is None:
            return []
        if self.store is None:
            return self._table.get(frontend, [])
        return backends(self.store, entry[1], frontend[2])

    # UDP

    def _udp_from_client(self, sock: socket.socket, frontend: Frontend) -> None:
        for _ in range(64):  # drain a burst without starving the other sockets
            try:
                data, client = sock.recvfrom(65535)
            except (BlockingIOError, InterruptedError):
                return
            flow_key = (sock.fileno(), client)
            flow = self._flows.get(flow_key)
            if flow is not None and flow.backend not in self._choices(frontend):
                # The endpoint went away or is no longer ready (a rolled agent pod): forget the flow, as
                # kube-proxy clears a UDP conntrack entry, so the next datagram finds a live endpoint.
                self._drop_flow(flow_key)
                flow = None
            if flow is None:
                backend = self._backend(frontend)
                if backend is None:
                    log.debug("proxy: no ready endpoint for UDP %s:%d", frontend[0], frontend[1])
                    continue
                upstream = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                upstream.setblocking(False)
                upstream.bind(("127.0.0.1", 0))
                upstream.connect(backend)
                flow = _Flow(sock, client, upstream, backend, time.monotonic())
                self._flows[flow_key] = flow
                self._sel.register(upstream, selectors.EVENT_READ, ("udp-flow", flow_key))
            flow.last = time.monotonic()
            with contextlib.suppress(OSError):
                flow.upstream.send(data)

    def _udp_from_backend(self, flow_key: tuple[int, tuple[str, int]]) -> None:
        flow = self._flows.get(flow_key)
        if flow is None:
            return
        for _ in range(64):
            try:
                data = flow.upstream.recv(65535)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # ICMP port unreachable: the backend went away
                self._drop_flow(flow_key)
                return
            flow.last = time.monotonic()
            # Sent from the frontend socket, so the reply comes from ClusterIP:port as the client expects.
            with contextlib.suppress(OSError):
                flow.frontend.sendto(data, flow.client)

    def _drop_flow(self, flow_key: tuple[int, tuple[str, int]]) -> None:
        flow = self._flows.pop(flow_key, None)
        if flow is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(flow.upstream)
            flow.upstream.close()

    def _expire_flows(self) -> None:
        limit = time.monotonic() - UDP_IDLE_SECONDS
        for flow_key, flow in list(self._flows.items()):
            if flow.last < limit:
                self._drop_flow(flow_key)

    # TCP

    def _accept(self, sock: socket.socket, frontend: Frontend) -> None:
        for _ in range(64):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            backend = self._backend(frontend)
            if backend is None:
                log.debug("proxy: no ready endpoint for TCP %s:%d", frontend[0], frontend[1])
                conn.close()
                continue
            conn.setblocking(False)
            upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            upstream.setblocking(False)
            err = upstream.connect_ex(backend)
            if err not in (0, errno.EINPROGRESS):
                conn.close()
                upstream.close()
                continue
            client, server = _Pipe(conn), _Pipe(upstream, connecting=err != 0)
            client.peer, server.peer = server, client
            self._interest(client)
            self._interest(server)

    def _interest(self, pipe: _Pipe) -> None:
        peer = pipe.peer
        if pipe.closed or peer is None:
            return
        mask = 0
        # Nothing is read from a side until the backend is connected, nor while its peer is backed up.
        if not (pipe.connecting or peer.connecting or pipe.read_eof) and len(peer.out) < _MAX_BUFFER:
            mask |= selectors.EVENT_READ
        if pipe.connecting or pipe.out:
            mask |= selectors.EVENT_WRITE
        if mask == pipe.mask:
            return
        if pipe.mask == 0:
            self._sel.register(pipe.sock, mask, ("tcp", pipe))
        elif mask == 0:
            self._sel.unregister(pipe.sock)
        else:
            self._sel.modify(pipe.sock, mask, ("tcp", pipe))
        pipe.mask = mask

    def _tcp_ready(self, pipe: _Pipe, mask: int) -> None:
        peer = pipe.peer
        if pipe.closed or peer is None:
            return
        if pipe.connecting:
            if pipe.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self._close_pair(pipe)
                return
            pipe.connecting = False
        elif mask & selectors.EVENT_READ:
            try:
                data = pipe.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                self._close_pair(pipe)
                return
            if data == b"":
                pipe.read_eof = True
            elif data:
                peer.out += data
            if not self._flush(peer):
                return
        if mask & selectors.EVENT_WRITE and not self._flush(pipe):
            return
        if pipe.read_eof and peer.read_eof and not pipe.out and not peer.out:
            self._close_pair(pipe)
            return
        self._interest(pipe)
        self._interest(peer)

    def _flush(self, pipe: _Pipe) -> bool:
        """Write what is pending to `pipe`; pass on a half-close once drained. False: the pair is closed."""
        if pipe.out:
            try:
                sent = pipe.sock.send(pipe.out)
                del pipe.out[:sent]
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                self._close_pair(pipe)
                return False
        if not pipe.out and pipe.peer is not None and pipe.peer.read_eof and not pipe.write_shut:
            pipe.write_shut = True
            with contextlib.suppress(OSError):
                pipe.sock.shutdown(socket.SHUT_WR)
        return True

    def _close_pair(self, pipe: _Pipe) -> None:
        for p in (pipe, pipe.peer):
            if p is None or p.closed:
                continue
            p.closed = True
            if p.mask:
                with contextlib.suppress(KeyError, ValueError):
                    self._sel.unregister(p.sock)
            p.sock.close()

    def _close_all(self) -> None:
        for frontend in list(self._listeners):
            self._close_listener(frontend)
        for key in list(self._sel.get_map().values()):
            sock = key.fileobj
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(sock)
            if isinstance(sock, socket.socket):
                sock.close()
        self._sel.close()
        self._wake_w.close()

    def frontends(self) -> list[Frontend]:
        return list(self._listeners)


def backends(store: Store, route: Route, protocol: str) -> list[tuple[str, int]]:
    """The ready endpoints of a Service port: (Pod IP, target port) for each."""
    ep = store.find(store.type("/endpoints"), route.namespace, route.service)
    choices: list[tuple[str, int]] = []
    for subset in (ep or {}).get("subsets") or []:
        port = next((p["port"] for p in subset.get("ports") or []
                     if p.get("name", "") == route.port_name and p.get("protocol", "TCP") == protocol), None)
        if port is not None:
            choices.extend((a["ip"], port) for a in subset.get("addresses") or [])
    return choices


class Shard:
    """A kube-proxy in a process of its own (`python -m kubesim.proxyshard`), for the Services that would take
    kubesim past its limit of descriptors: every listener is a descriptor, three per agent Service, and a process
    may hold 20,000 here. The parent sends each of its Services as a JSON line (frontends, routes, backends) and
    again when its Endpoints change; the shard exits when its input closes (kubesim stopped or died)."""

    def __init__(self, index: int) -> None:
        import subprocess
        import sys
        self.index = index
        self.listeners = 0
        self._lock = threading.Lock()
        self._proc = subprocess.Popen([sys.executable, "-m", "kubesim.proxyshard", str(index)],
                                      stdin=subprocess.PIPE, text=True, close_fds=True)

    def set_table(self, owner: tuple[str, str], table: dict[Frontend, tuple[Route, list[tuple[str, int]]]]) -> None:
        line = json.dumps({"owner": list(owner), "frontends": [
            [*frontend, [route.namespace, route.service, route.port_name], [list(b) for b in found]]
            for frontend, (route, found) in table.items()]})
        with self._lock:
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write(line + "\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                log.error("proxy shard %d is gone (exit status %s): its Services are not served", self.index,
                          self._proc.poll())

    def stop(self) -> None:
        with self._lock, contextlib.suppress(OSError):
            assert self._proc.stdin is not None
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=5)
        except Exception:
            self._proc.kill()
            self._proc.wait()


def _raise_fd_limit() -> None:
    """Thousands of Services mean thousands of listening sockets: use the whole hard limit of descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))


def service_frontends(svc: Obj, node_host: str) -> dict[Frontend, Route]:
    """Every address:port a Service is reachable on, and the Service port each one leads to."""
    spec = svc.get("spec") or {}
    meta = svc["metadata"]
    out: dict[Frontend, Route] = {}
    if spec.get("type") == "ExternalName" or svc["metadata"].get("deletionTimestamp"):
        return out
    ingress = [i["ip"] for i in ((svc.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
               if i.get("ip")] if spec.get("type") == "LoadBalancer" else []
    cluster_ips = [ip for ip in spec.get("clusterIPs") or [spec.get("clusterIP")] if ip and ip != "None"]
    for port in spec.get("ports") or []:
        protocol = port.get("protocol", "TCP")
        route = Route(meta.get("namespace", ""), meta["name"], port.get("name", ""))
        for ip in cluster_ips + ingress:
            out[(ip, int(port["port"]), protocol)] = route
        if port.get("nodePort"):
            out[(node_host, int(port["nodePort"]), protocol)] = route
    return out


class ProxyController(ControlLoop):
    """Keeps the proxy's listeners in step with Services (the kube-proxy's service config handler).

    A Service is listened on from the moment its Endpoints first name an address (ready or not yet: a pod that
    has its IP, so the listener is there before the pod is Ready and a client that waited for readiness finds
    it) until the Service goes. Until then a connection is refused, as kube-proxy rejects one to a Service
    without endpoints. Pods of the fake kubelet run nothing, so their addresses do not count (a kwok cluster has
    no data path either). Endpoints written by hand (no pod behind them) count as any other.

    Every listener is a descriptor, and a process may hold 20,000 here: an agent's Service has three frontends,
    so 10,000 of them need 30,000. kubesim keeps `listeners` of them itself (a quarter of its limit: its API
    connections, watches and files need the rest) and gives the next Services to shard processes
    (`proxyshard.py`, `listeners` each, half a shard's limit: its proxied connections need the rest). A Service
    stays where it was first placed."""

    name = "kube-proxy"
    kinds = ("/services", "/endpoints")

    def __init__(self, store: Store, node_host: str, fake_pods: bool = False, listeners: int = 0) -> None:
        super().__init__(store)
        self.proxy = Proxy(store)
        self.node_host = node_host
        self.fake_pods = fake_pods
        self.listeners = listeners  # per process; 0: from the limit of descriptors when started
        self.shards: list[Shard] = []
        self._listened: set[Hashable] = set()  # Services whose frontends are bound (one worker: no lock)
        self._placed: dict[Hashable, tuple[Proxy | Shard, int]] = {}  # Service -> (where, its listeners)
        self._in_process = 0

    def start(self) -> None:
        self.proxy.start()  # raises this process's soft limit of descriptors to the hard one
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        self._own_budget = self.listeners or max(64, soft // 4)
        self._shard_budget = self.listeners or max(64, min(hard, 1 << 20) // 2)
        super().start()

    def stop(self) -> None:
        super().stop()
        self.proxy.stop()
        for shard in self.shards:
            shard.stop()

    def sync(self, key: Hashable) -> float | None:
        assert isinstance(key, tuple)
        svc = self.store.find(self.store.type("/services"), key[0], key[1])
        if svc is None:
            if key in self._listened:
                self._listened.discard(key)
                self._send(key, {})
            return None
        if key not in self._listened:
            if not self._has_backend(key[0], key[1]):
                return None
            self._listened.add(key)
        self._send(key, service_frontends(svc, self.node_host))
        return None

    def _send(self, key: tuple[str, str], routes: dict[Frontend, Route]) -> None:
        where, held = self._placed.get(key) or (self._place(len(routes)), 0)
        if isinstance(where, Shard):
            where.set_table(key, {frontend: (route, backends(self.store, route, frontend[2]))
                                  for frontend, route in routes.items()})
            where.listeners += len(routes) - held
        else:
            where.set_routes(key, routes)
            self._in_process += len(routes) - held
        if routes:
            self._placed[key] = (where, len(routes))
        else:
            self._placed.pop(key, None)

    def _place(self, count: int) -> Proxy | Shard:
        if self._in_process + count <= self._own_budget:
            return self.proxy
        for shard in self.shards:
            if shard.listeners + count <= self._shard_budget:
                return shard
        shard = Shard(len(self.shards) + 1)
        self.shards.append(shard)
        log.info("kube-proxy: %d listeners in kubesim, a proxy shard process (%d) takes the next Services",
                 self._in_process, shard.index)
        return shard

    def _has_backend(self, namespace: str, name: str) -> bool:
        """Whether the Service's Endpoints name an address that something may answer on."""
        ep = self.store.find(self.store.type("/endpoints"), namespace, name)
        for subset in (ep or {}).get("subsets") or []:
            for address in [*(subset.get("addresses") or []), *(subset.get("notReadyAddresses") or [])]:
                if not (self.fake_pods and (address.get("targetRef") or {}).get("kind") == "Pod"):
                    return True
        return False


def install(cluster: Any) -> None:
    """Allocators, the Service admission hook, the endpoints controller and the proxy."""
    net = network_of(cluster)
    admission = ServiceAdmission(cluster.store, net)
    cluster.store.add_admission(admission)
    cluster.store.add_listener(admission.release)
    cluster.add_component(EndpointsController(cluster.store))
    cluster.add_component(ProxyController(cluster.store, cluster.config.node_port_host,
                                          fake_pods=cluster.config.kubelet_mode == "fake",
                                          listeners=cluster.config.proxy_listeners))
