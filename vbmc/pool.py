"""`kubevbmc agent --pool`: one process serving IPMI and Redfish for many VirtualMachineBMCs (issue 14).

The controller writes the pool's members into one Secret (key `pool.json`, see `parse_pool`); the agent watches
that Secret (or, without a cluster, polls a file about once a second) and, at every change of the member list,
starts the new members, stops the removed ones and restarts a member whose entry changed, alone. A member whose
entry is unchanged is not touched: its IPMI sessions, Redfish sessions and connections carry on.

What a member is, as in a dedicated agent (vbmc/agent.py), so that a client cannot tell the two apart:
- its Machine: a KubeVirtMachine (its own watches of its VM, VMI and VirtualMachineBMC) over ONE KubeClient
  shared by the pool, or a MemoryMachine;
- its IpmiServer on (--address, ipmiPort), with its own thread, session table and backend writer thread;
- its Redfish app (create_app: its own credentials, sessions, EventService and subscriptions store, bmc uuid
  uuid5(kubevbmc:NS/VM), system id = VM name) behind its own RedfishFront, whose worker threads (--threads, two by
  default, created on the first requests) only this member's requests use;
- its own LoginThrottle, shared by its IPMI and Redfish as in a dedicated agent (one member's brute-forcer never
  locks another member's clients out);
- its HTTP listener on httpPort and, with a certificate, its HTTPS listener on httpsPort with ITS certificate.
  Each member's port answers /healthz, /readyz (that member's) and /metrics (that member's) as a dedicated
  agent's does; with `redfish: false` everything else is 404 ServiceDisabled.

Limits: every member has the dedicated agent's (vbmc/redfish/server.py Limits and ServerConfig timeouts): its
own connection cap (512 over its HTTP and HTTPS listeners), its own queue of 64 requests; so one member's
flood or stalled clients neither take another member's connection slots nor its worker threads. The cost is
that the pool's worst-case connection memory is the members' summed, as for as many dedicated agents.

Isolation: one asyncio event loop (the main thread) does every member's network I/O and nothing else that
blocks; each request runs on its member's own worker threads, each IPMI command on its member's IPMI thread
(backend writes on its own writer thread), so one member's slow or failing backend calls hold up only that
member. Members start and stop off the loop (threads), so a member that takes long to stop delays no request.
A member that fails to start (a port in use, a certificate that does not load) is logged and retried with
backoff, part by part (IPMI, HTTP, HTTPS); the others never wait for it.

The pool's own port (--redfish-address, the kubelet's probes): /healthz (200 while the process serves), /readyz
(200 once the pool config was read and every member of that first read has settled: started, or failed to start
and logged, or its VM known not to exist; it then stays ready, since every member's Service selects this pod and
a later member must not take the others out of it), /metrics (the members' login counters summed, as the
dedicated agents' would be, plus kubevbmc_agent_pool_* gauges and counters). Anything else there: 404.

Memory (bench/agent.py, the pool section): the members share the interpreter, the imported code, one event
loop, one KubeClient (one urllib3 pool) and the shared port; a member costs about 1 MB PSS (kubevirt backend).
Its Flask app is the largest part, about 540 KB (57 routes, each parsed and matched per app: the routes name the
member's own System), less about 90 KB of werkzeug URL builders that are compiled on first use here
(`_lazy_url_builders`: the Redfish app builds no URLs). Then its Machine's watches (three, six threads, the cached
VM and VMI), the IPMI server (a thread; idle, it sleeps until a packet comes) and the Redfish worker threads
(created on the first requests, about 16 KB each).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import json
import logging
import os
import re
import signal
import ssl
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import vmstate
from .agent import _Metrics, _no_redfish
from .machine import Machine
from .redfish.server import (
    Limits,
    Listeners,
    RedfishFront,
    ServerConfig,
    bind_listener,
    connection_slots,
    hypercorn_config,
)
from .throttle import Engaged, LoginThrottle

log = logging.getLogger("vbmc.pool")

POOL_KEY = "pool.json"  # the pool Secret's data key
POLL_INTERVAL = 1.0  # seconds between two reads of --pool-file
RECONCILE_INTERVAL = 0.5  # seconds between two looks at members' pending parts (IPMI waiting for the VM, retries)
RETRY_FIRST, RETRY_MAX = 1.0, 30.0  # backoff of a part that failed to start
STOP_DEADLINE = 1.5  # seconds SIGTERM gives the members to stop (IPMI servers, watches) together
# Connections the shared KubeClient keeps for reuse (its urllib3 pool's maxsize; an empty slot costs a list entry):
# each member holds up to three watch streams and, now and then, three probes and a write, so this covers about 290
# members at their busiest. Past it, connections still open but are closed after use (a new TLS handshake).
API_CONNECTIONS = 2048

NAME_PATTERN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")  # a Kubernetes object name (DNS subdomain)
VM_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")  # the Redfish System Id (vbmc/redfish/app.py)


# ---- the pool config: pure parsing and validation


class PoolConfigError(ValueError):
    """The pool config cannot be used as a whole; the members already serving are left as they are."""


@dataclass(frozen=True)
class MemberSpec:
    """One member's entry in pool.json. Equal entries mean an untouched member; any difference restarts it."""

    name: str  # the VirtualMachineBMC
    vm: str
    username: str
    password: str = field(repr=False)
    ipmi_port: int
    http_port: int
    https_port: int = 0
    ipmi: bool = True
    redfish: bool = True
    require_tls: bool = False
    tls_cert: str = field(default="", repr=False)
    tls_key: str = field(default="", repr=False)
    subscriptions_secret: str = ""

    @property
    def serves_https(self) -> bool:
        return bool(self.redfish and self.https_port and self.tls_cert)


# JSON key -> (attribute, type, required)
_FIELDS: dict[str, tuple[str, type, bool]] = {
    "name": ("name", str, True),
    "vm": ("vm", str, True),
    "username": ("username", str, True),
    "password": ("password", str, True),
    "ipmiPort": ("ipmi_port", int, True),
    "httpPort": ("http_port", int, True),
    "httpsPort": ("https_port", int, False),
    "ipmi": ("ipmi", bool, True),
    "redfish": ("redfish", bool, True),
    "requireTLS": ("require_tls", bool, False),
    "tlsCert": ("tls_cert", str, False),
    "tlsKey": ("tls_key", str, False),
    "subscriptionsSecret": ("subscriptions_secret", str, False),
}


def parse_pool(raw: bytes | str, left_out: list[str] | None = None) -> tuple[MemberSpec, ...]:
    """The members of a pool.json document, sorted by name. Raises PoolConfigError naming the first problem:
    not JSON, not `{"members": [...]}`, a member without a required field or with a field of the wrong type, a
    name or VM twice, or a port that two listeners would bind (UDP and TCP counted apart; ports of disabled
    listeners are not bound, so not counted). Keys this version does not know are ignored (a newer controller).
    A member that is well formed but cannot be served (an empty user name or password: a dedicated agent would
    refuse to start) is left out, and why is appended to `left_out`; the others are served."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise PoolConfigError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("members"), list):
        raise PoolConfigError('not a pool config: expected {"members": [...]}')
    members = [_member(entry, index) for index, entry in enumerate(doc["members"])]
    _check_unique(members)
    usable = []
    for m in members:
        if m.username and m.password:
            usable.append(m)
        elif left_out is not None:
            left_out.append(f"member {m.name} is left out: its user name or password is empty")
    return tuple(sorted(usable, key=lambda m: m.name))


def _member(entry: Any, index: int) -> MemberSpec:
    where = f"members[{index}]"
    if not isinstance(entry, dict):
        raise PoolConfigError(f"{where} is not an object")
    if isinstance(entry.get("name"), str) and entry["name"]:
        where = f"{where} ({entry['name']})"
    values: dict[str, Any] = {}
    for key, (attribute, kind, required) in _FIELDS.items():
        value = entry.get(key)
        if value is None:
            if required:
                raise PoolConfigError(f"{where}: {key} is missing")
            continue
        # bool is an int in Python: a port of `true` is as wrong as one of "623".
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            # The value itself is not logged: it may be a password or a key.
            raise PoolConfigError(f"{where}: {key} must be a {_TYPE_NAMES[kind]}, not a {_json_type(value)}")
        values[attribute] = value
    spec = MemberSpec(**values)
    if not NAME_PATTERN.match(spec.name):
        raise PoolConfigError(f"{where}: name {spec.name!r} is not a Kubernetes object name")
    if not VM_PATTERN.match(spec.vm):
        raise PoolConfigError(f"{where}: vm {spec.vm!r} is not a usable VM name (1-63 letters, digits, . _ -)")
    for key, port, needed in (("ipmiPort", spec.ipmi_port, spec.ipmi), ("httpPort", spec.http_port, True),
                              ("httpsPort", spec.https_port, False)):
        if not 0 <= port <= 65535 or (needed and port == 0):
            raise PoolConfigError(f"{where}: {key} {port} is not a port{' (1-65535)' if needed else ''}")
    return spec


_TYPE_NAMES = {str: "string", int: "number", bool: "boolean"}


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "list" if isinstance(value, list) else "object"


def _check_unique(members: Sequence[MemberSpec]) -> None:
    seen: dict[tuple[str, str | int], str] = {}
    for m in members:
        keys: list[tuple[str, str | int]] = [("name", m.name), ("vm", m.vm), ("tcp", m.http_port)]
        if m.ipmi:
            keys.append(("udp", m.ipmi_port))
        if m.serves_https:
            keys.append(("tcp", m.https_port))
        for key in keys:
            other = seen.get(key)
            if other is not None:
                what = {"name": "the name", "vm": "the VM", "tcp": "TCP port", "udp": "UDP port"}[key[0]]
                raise PoolConfigError(f"members {other} and {m.name} both have {what} {key[1]}"
                                      if key[0] in ("tcp", "udp") else f"{what} {key[1]} is in the pool twice")
            seen[key] = m.name


@dataclass(frozen=True)
class Plan:
    """What a new member list asks of the running pool: `stop` (removed or changed), then `start` (new or
    changed). Members in neither are left alone."""

    stop: tuple[str, ...]
    start: tuple[MemberSpec, ...]


def plan(running: Mapping[str, MemberSpec], wanted: Iterable[MemberSpec]) -> Plan:
    wanted_by_name = {m.name: m for m in wanted}
    stop = tuple(sorted(n for n, spec in running.items() if wanted_by_name.get(n) != spec))
    start = tuple(m for n, m in sorted(wanted_by_name.items()) if running.get(n) != m)
    return Plan(stop, start)


def secret_pool_json(secret: Mapping[str, Any] | None) -> bytes | None:
    """pool.json from a Secret object (base64 in .data, as the API serves it); None when absent."""
    data = (secret or {}).get("data") or {}
    raw = data.get(POOL_KEY)
    if raw is None:
        return None
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise PoolConfigError(f"data.{POOL_KEY} is not base64: {exc}") from None


# ---- the pool agent's settings


@dataclass
class PoolSettings:
    pool: str
    namespace: str
    address: str  # host the members' ports are bound on (the pod IP)
    redfish_address: str  # host:port of the pool's own port: probes and metrics
    secret: str = ""
    file: str = ""
    backend: str = "kubevirt"
    kubeconfig: str = ""
    threads: int = 2  # Redfish worker threads per member
    event_ca_file: str = ""
    media_max_size: int = 64 * 2**30


def settings_from(args: argparse.Namespace) -> PoolSettings:
    problems = []
    if bool(args.pool_secret) == bool(args.pool_file):
        problems.append("--pool needs exactly one of --pool-secret (the controller's) and --pool-file")
    if args.pool_secret and args.backend != "kubevirt":
        problems.append("--pool-secret needs the kubevirt backend")
    if args.backend == "kubevirt" and not args.namespace:
        problems.append("--namespace is required with the kubevirt backend")
    if not args.redfish_address:
        problems.append("--redfish-address (the pool's probes and metrics) must not be empty")
    if vmstate.quantity_bytes(args.media_max_size) <= 0:
        problems.append(f"--media-max-size {args.media_max_size!r} is not a size (such as 64Gi)")
    if args.event_ca_file and not os.path.exists(args.event_ca_file):
        problems.append(f"{args.event_ca_file} does not exist")
    if args.threads < 1:
        problems.append("--threads must be at least 1")
    if problems:
        raise ValueError("; ".join(problems))
    return PoolSettings(pool=args.pool, namespace=args.namespace or "default", address=args.address or "0.0.0.0",
                        redfish_address=args.redfish_address, secret=args.pool_secret, file=args.pool_file,
                        backend=args.backend, kubeconfig=args.kubeconfig, threads=args.threads,
                        event_ca_file=args.event_ca_file, media_max_size=vmstate.quantity_bytes(args.media_max_size))


# ---- one member


class _Part:
    """One thing a member serves (IPMI, HTTP, HTTPS): up, or waiting to be tried again after a failure."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.error = ""
        self.failures = 0
        self.due = 0.0  # time.monotonic() of the next attempt

    def failed(self, member: str, error: str, now: float) -> None:
        self.failures += 1
        delay = min(RETRY_MAX, RETRY_FIRST * 2 ** (self.failures - 1))
        self.due = now + delay
        if error != self.error:  # one line per distinct error, not one per retry
            log.error("pool: member %s cannot serve %s: %s; retrying every %.0f s at most", member, self.what,
                      error, RETRY_MAX)
        self.error = error


class Member:
    """One VirtualMachineBMC of the pool: its Machine, IPMI server, Redfish app and listeners."""

    def __init__(self, spec: MemberSpec, pool: Pool) -> None:
        self.spec = spec
        self.pool = pool
        self.machine: Machine | None = None
        self.ipmi: Any = None
        self.events: Any = None
        self.front: RedfishFront | None = None
        self.listeners: Listeners | None = None
        self.https: Listeners | None = None
        self.throttle = LoginThrottle(on_engaged=self._login_throttled)
        self.parts = {"build": _Part("its Machine and Redfish app"), "ipmi": _Part("IPMI"), "http": _Part("HTTP"),
                      "https": _Part("HTTPS")}
        self._slots = connection_slots(Limits().connections)  # shared by its HTTP and HTTPS listeners

    # -- building (a worker thread: create_app may read the subscriptions Secret)

    def build(self) -> None:
        spec, settings = self.spec, self.pool.settings
        self.machine = self.pool.new_machine(spec)
        app: Any
        if spec.redfish:
            from .redfish import create_app

            bmc_uuid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"kubevbmc:{settings.namespace}/{spec.vm}"))
            store = None
            if spec.subscriptions_secret and self.pool.kube is not None:
                from .eventservice import SecretStore

                store = SecretStore(self.pool.kube, settings.namespace, spec.subscriptions_secret)
            flask_app = create_app(self.machine, spec.username, spec.password, system_id=spec.vm,
                                   bmc_uuid=bmc_uuid, throttle=self.throttle, subscriptions=store,
                                   event_ca_file=settings.event_ca_file, require_tls=spec.require_tls)
            self.events = flask_app.extensions["vbmc.events"]
            app = _Metrics(flask_app.wsgi_app, self.throttle.metrics)
            flask_app.wsgi_app = app
            app = flask_app
        else:
            app = _Metrics(_no_redfish, self.throttle.metrics)
        server = self.pool.server_config
        self.front = RedfishFront(app, probes={"/healthz": lambda: True, "/readyz": self.ready},
                                  threads=server.threads, body_timeout=server.body_timeout, limits=server.limits)

    def _login_throttled(self, engaged: Engaged) -> None:
        """A Warning Event on this member's VirtualMachineBMC, from its own thread (as the dedicated agent)."""
        machine = self.machine
        if machine is None:
            return
        message = (f"{engaged.failures} failed {engaged.protocol} logins from {engaged.source}; its logins are "
                   f"refused for {engaged.delay:.0f} s, longer after each further failure")
        threading.Thread(target=machine.record_event, args=("LoginThrottled", message, "Warning"),
                         name="login-throttled-event", daemon=True).start()

    # -- state

    @property
    def machine_ready(self) -> bool:
        return self.machine is not None and getattr(self.machine, "ready", True) is not False

    @property
    def vm_absent(self) -> bool:
        """The API server has answered that the VM does not exist (the member cannot get ready until it does)."""
        watch = getattr(self.machine, "vm_watch", None)
        return watch is not None and watch.synced and watch.obj is None

    def ready(self) -> bool:
        """This member's /readyz, as a dedicated agent's: the VM is watched and IPMI is up (when enabled)."""
        return self.machine_ready and (self.ipmi is not None or not self.spec.ipmi)

    def serving(self) -> bool:
        """Every listener it should have is up."""
        return (self.listeners is not None and (self.https is not None or not self.spec.serves_https)
                and (self.ipmi is not None or not self.spec.ipmi))

    def settled(self) -> bool:
        """Done with its first start, for the pool's readiness: serving, or known to be unable to for now."""
        if self.front is None:
            return self.parts["build"].failures > 0
        http_done = self.listeners is not None or self.parts["http"].failures > 0
        https_done = not self.spec.serves_https or self.https is not None or self.parts["https"].failures > 0
        ipmi_done = not self.spec.ipmi or self.ipmi is not None or self.parts["ipmi"].failures > 0
        machine_done = self.machine_ready or self.vm_absent
        return http_done and https_done and (ipmi_done or self.vm_absent) and machine_done

    # -- listeners (the event loop)

    async def open_pending(self, now: float) -> None:
        """Try whatever is not up yet and due: HTTP, HTTPS, IPMI (once the Machine knows its VM)."""
        spec, host = self.spec, self.pool.settings.address
        if self.front is None:
            return
        part = self.parts["http"]
        if self.listeners is None and now >= part.due:
            try:
                self.listeners = await self.pool.open_listeners(self.front, host, spec.http_port, None, self._slots)
                part.error = ""
            except (OSError, ValueError) as exc:
                part.failed(spec.name, f"{host}:{spec.http_port}: {exc}", now)
        part = self.parts["https"]
        if spec.serves_https and self.https is None and now >= part.due:
            try:
                tls = tls_context(spec.tls_cert, spec.tls_key)
                self.https = await self.pool.open_listeners(self.front, host, spec.https_port, tls, self._slots)
                part.error = ""
            except (OSError, ValueError, ssl.SSLError) as exc:
                part.failed(spec.name, f"{host}:{spec.https_port}: {exc}", now)
        part = self.parts["ipmi"]
        if spec.ipmi and self.ipmi is None and now >= part.due and self.machine_ready:
            self.start_ipmi(now)

    def start_ipmi(self, now: float) -> None:
        """IPMI answers RAKP with the system GUID, so it starts once the VM is known (binding is immediate)."""
        from .ipmi import IpmiServer

        assert self.machine is not None
        part = self.parts["ipmi"]
        try:
            server = IpmiServer(self.machine, self.spec.username, self.spec.password,
                                address=(self.pool.settings.address, self.spec.ipmi_port), throttle=self.throttle)
            server.start()
        except OSError as exc:
            part.failed(self.spec.name, f"{self.pool.settings.address}:{self.spec.ipmi_port}/udp: {exc}", now)
            return
        except Exception as exc:  # the Machine could not answer (a stale cache): not an error, try again soon
            log.debug("pool: member %s: IPMI not started yet: %s", self.spec.name, exc)
            part.due = now + RECONCILE_INTERVAL
            return
        part.error = ""
        self.ipmi = server

    async def close_listeners(self) -> None:
        for listeners in (self.listeners, self.https):
            if listeners is not None:
                await listeners.close()
        self.listeners = self.https = None

    def stop(self) -> None:
        """Blocking (a worker thread): IPMI (returns within a fraction of a second), events, the Machine."""
        if self.ipmi is not None:
            self.ipmi.stop()
        if self.events is not None:
            self.events.close()
        if self.front is not None:
            self.front.close()
        stop: Callable[[], None] | None = getattr(self.machine, "stop", None)
        if stop is not None:
            stop()


def tls_context(cert_pem: str, key_pem: str) -> ssl.SSLContext:
    """The server TLS context of a member, as the dedicated agent's (hypercorn's, HTTP/1.1 only), from PEM text.
    OpenSSL loads a chain from files only: the PEM goes through anonymous memory files (memfd: no file on the
    pod's read-only filesystem, nothing left behind), else through a private directory removed at once."""
    if not cert_pem or not key_pem:
        raise ValueError("tlsCert and tlsKey must both be set")
    with _pem_files(cert_pem.encode(), key_pem.encode()) as (cert_path, key_path):
        hc = hypercorn_config(ServerConfig(http=None, https="127.0.0.1:0", certfile=cert_path, keyfile=key_path))
        context: ssl.SSLContext = hc.create_ssl_context()
    return context


@contextlib.contextmanager
def _pem_files(cert: bytes, key: bytes) -> Iterator[tuple[str, str]]:
    memfd = getattr(os, "memfd_create", None)
    if memfd is not None and os.path.isdir("/proc/self/fd"):
        fds: list[int] = []
        try:
            for data in (cert, key):
                fd = memfd("kubevbmc-tls", getattr(os, "MFD_CLOEXEC", 0))
                fds.append(fd)
                os.write(fd, data)
            yield f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}"
        finally:
            for fd in fds:
                os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="kubevbmc-") as directory:  # mode 0700
        paths = []
        for name, data in (("tls.crt", cert), ("tls.key", key)):
            path = os.path.join(directory, name)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "wb") as fh:
                fh.write(data)
            paths.append(path)
        yield paths[0], paths[1]


# ---- the pool


class Pool:
    """The members, reconciled on one event loop against the latest member list the config source offered."""

    def __init__(self, settings: PoolSettings, kube: Any = None) -> None:
        self.settings = settings
        self.kube = kube  # the KubeClient every member's Machine shares (kubevirt backend)
        self.server_config = ServerConfig(threads=settings.threads)
        self._hc = hypercorn_config(ServerConfig(http="127.0.0.1:0"))
        self.members: dict[str, Member] = {}
        self._wanted: tuple[MemberSpec, ...] | None = None  # offered, not yet applied
        self._lock = threading.Lock()
        self._first: frozenset[str] | None = None  # the members of the first config read
        self._ready = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._stop_hook: Callable[[], None] | None = None
        self._context: Any = None
        self._state: dict[str, Any] = {}
        self._last_raw: bytes | None = None
        # Counters: kept over members' restarts so that the summed login counters never go down.
        self._retired: dict[str, dict[str, int]] = {"failures": {}, "refused": {}, "lockouts": {}}
        self.counters = {"applied": 0, "rejected": 0, "start_failures": 0}

    # -- the config source (any thread)

    def offer(self, raw: bytes | None, source: str) -> None:
        """A pool.json as read from the Secret or the file (None: not there). Parsed here; a bad one is logged,
        counted and ignored, so that the members keep serving as they were."""
        if raw == self._last_raw:
            return
        self._last_raw = raw
        if raw is None:
            log.warning("pool: %s has no %s; the members serve on as they are", source, POOL_KEY)
            return
        left_out: list[str] = []
        try:
            members = parse_pool(raw, left_out)
        except PoolConfigError as exc:
            self.counters["rejected"] += 1
            log.error("pool: %s: the pool config is not valid, nothing changes: %s", source, exc)
            return
        for problem in left_out:
            log.error("pool: %s: %s", source, problem)
        loop, changed = self._loop, self._changed
        with self._lock:
            self._wanted = members
        if loop is not None and changed is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: shutting down
                loop.call_soon_threadsafe(changed.set)

    def offer_secret(self, secret: Mapping[str, Any] | None) -> None:
        source = f"Secret {self.settings.namespace}/{self.settings.secret}"
        if secret is None:
            log.warning("pool: %s does not exist; the members serve on as they are", source)
            return
        try:
            raw = secret_pool_json(secret)
        except PoolConfigError as exc:
            self.counters["rejected"] += 1
            log.error("pool: %s: %s; nothing changes", source, exc)
            return
        self.offer(raw, source)

    # -- members

    def new_machine(self, spec: MemberSpec) -> Machine:
        if self.settings.backend == "memory":
            from .memory import MemoryMachine

            return MemoryMachine(name=spec.vm)
        from .kubevirt import KubeVirtMachine

        machine = KubeVirtMachine(self.kube, self.settings.namespace, spec.vm, spec.name,
                                  media_max_size=self.settings.media_max_size)
        machine.start()
        return machine

    async def open_listeners(self, front: RedfishFront, host: str, port: int, tls: ssl.SSLContext | None,
                             slots: Any) -> Listeners:
        sock = bind_listener(host, port, slots, self._hc.backlog)
        listeners = Listeners(front, self._hc, [(sock, tls)], self._context, self._state)
        await listeners.start()
        return listeners

    async def _start(self, spec: MemberSpec) -> Member:
        member = Member(spec, self)
        await self._build(member)
        return member

    async def _build(self, member: Member) -> None:
        """Build a member (off the loop) and open what it serves; a failure is logged and tried again later."""
        try:
            await asyncio.to_thread(member.build)
        except Exception as exc:
            self.counters["start_failures"] += 1
            member.parts["build"].failed(member.spec.name, f"{type(exc).__name__}: {exc}", time.monotonic())
            try:
                await asyncio.to_thread(member.stop)  # whatever it had started (its Machine's watches)
            except Exception as stop_error:
                log.error("pool: member %s did not stop cleanly: %r", member.spec.name, stop_error)
            member.machine = member.events = member.front = None
            return
        await self._open(member)
        self._log_started(member)

    async def _open(self, member: Member) -> None:
        before = sum(p.failures for p in member.parts.values())
        try:
            await member.open_pending(time.monotonic())
        except Exception:  # a bug, not a port in use: logged, and the member is tried again at the next tick
            log.exception("pool: member %s: opening its listeners failed", member.spec.name)
        self.counters["start_failures"] += sum(p.failures for p in member.parts.values()) - before

    def _log_started(self, member: Member) -> None:
        spec, host = member.spec, self.settings.address
        log.info("pool: member started name=%s vm=%s ipmi=%s http=%s:%d https=%s redfish=%s", spec.name, spec.vm,
                 f"{host}:{spec.ipmi_port}" if spec.ipmi else "-", host, spec.http_port,
                 f"{host}:{spec.https_port}" if spec.serves_https else "-", "on" if spec.redfish else "off")

    async def _stop(self, member: Member) -> None:
        results = await asyncio.gather(member.close_listeners(), asyncio.to_thread(member.stop),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, Exception):
                log.error("pool: member %s did not stop cleanly: %r", member.spec.name, result)
        self._retire(member)
        log.info("pool: member stopped name=%s vm=%s", member.spec.name, member.spec.vm)

    def _retire(self, member: Member) -> None:
        t = member.throttle
        for key, counts in (("failures", dict(t.failures_total)), ("refused", dict(t.refused_total)),
                            ("lockouts", {"": t.engaged_total})):
            for label, n in counts.items():
                self._retired[key][label] = self._retired[key].get(label, 0) + n

    async def reconcile(self) -> None:
        with self._lock:  # the newest list offered, once
            wanted, self._wanted = self._wanted, None
        if wanted is not None:
            steps = plan({n: m.spec for n, m in self.members.items()}, wanted)
            if steps.stop or steps.start:
                log.info("pool: %d member(s) to stop, %d to start, %d unchanged", len(steps.stop),
                         len(steps.start), len(self.members) - len(steps.stop))
            stopping = [self.members.pop(name) for name in steps.stop]
            await asyncio.gather(*(self._stop(m) for m in stopping))
            started = await asyncio.gather(*(self._start(spec) for spec in steps.start))
            for member in started:
                self.members[member.spec.name] = member
            if self._first is None:
                self._first = frozenset(m.name for m in wanted)
            self.counters["applied"] += 1
        now = time.monotonic()
        for member in list(self.members.values()):
            if member.front is None and now >= member.parts["build"].due:
                await self._build(member)
            elif member.front is not None and not member.serving():
                await self._open(member)
        if not self._ready and self._first is not None:
            self._ready = all(m.settled() for n, m in self.members.items() if n in self._first)
            if self._ready:
                log.info("pool: ready: %d member(s)", len(self.members))

    def ready(self) -> bool:
        return self._ready

    def stop(self) -> None:
        """Stop serving, as SIGTERM does (from any thread: tests and benchmarks that run a pool in-process)."""
        loop, hook = self._loop, self._stop_hook
        if loop is not None and hook is not None:
            loop.call_soon_threadsafe(hook)

    # -- the pool's own port

    def metrics(self) -> str:
        members = list(self.members.values())
        failures, refused = dict(self._retired["failures"]), dict(self._retired["refused"])
        lockouts = sum(self._retired["lockouts"].values())
        sources = 0
        for m in members:
            t = m.throttle
            for total, counts in ((failures, dict(t.failures_total)), (refused, dict(t.refused_total))):
                for label, n in counts.items():
                    total[label] = total.get(label, 0) + n
            lockouts += t.engaged_total
            sources += t.sources()
        serving = sum(1 for m in members if m.serving())
        ready = sum(1 for m in members if m.ready())
        lines = [
            "# HELP kubevbmc_login_failures_total Failed logins (wrong user name or password).",
            "# TYPE kubevbmc_login_failures_total counter",
            *(f'kubevbmc_login_failures_total{{protocol="{p}"}} {n}' for p, n in sorted(failures.items())),
            "# HELP kubevbmc_login_throttled_total Logins refused because their source was locked out.",
            "# TYPE kubevbmc_login_throttled_total counter",
            *(f'kubevbmc_login_throttled_total{{protocol="{p}"}} {n}' for p, n in sorted(refused.items())),
            "# HELP kubevbmc_login_lockouts_total Failed logins that locked their source out.",
            "# TYPE kubevbmc_login_lockouts_total counter", f"kubevbmc_login_lockouts_total {lockouts}",
            "# HELP kubevbmc_login_throttle_sources Sources with failed logins on record (summed over members).",
            "# TYPE kubevbmc_login_throttle_sources gauge", f"kubevbmc_login_throttle_sources {sources}",
            "# HELP kubevbmc_agent_pool_members Members in the pool config being served.",
            "# TYPE kubevbmc_agent_pool_members gauge", f"kubevbmc_agent_pool_members {len(members)}",
            "# HELP kubevbmc_agent_pool_members_serving Members with every listener up.",
            "# TYPE kubevbmc_agent_pool_members_serving gauge", f"kubevbmc_agent_pool_members_serving {serving}",
            "# HELP kubevbmc_agent_pool_members_ready Members whose own /readyz answers 200.",
            "# TYPE kubevbmc_agent_pool_members_ready gauge", f"kubevbmc_agent_pool_members_ready {ready}",
            "# HELP kubevbmc_agent_pool_member_start_failures_total Failed starts of a member or of one of its "
            "listeners (each is retried).",
            "# TYPE kubevbmc_agent_pool_member_start_failures_total counter",
            f"kubevbmc_agent_pool_member_start_failures_total {self.counters['start_failures']}",
            "# HELP kubevbmc_agent_pool_config_applied_total Pool configs applied.",
            "# TYPE kubevbmc_agent_pool_config_applied_total counter",
            f"kubevbmc_agent_pool_config_applied_total {self.counters['applied']}",
            "# HELP kubevbmc_agent_pool_config_rejected_total Pool configs refused as not valid (nothing changed).",
            "# TYPE kubevbmc_agent_pool_config_rejected_total counter",
            f"kubevbmc_agent_pool_config_rejected_total {self.counters['rejected']}",
        ]
        return "\n".join(lines) + "\n"

    def _pool_port_app(self) -> Any:
        metrics = self.metrics

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            if environ.get("PATH_INFO", "") == "/metrics":
                text = metrics().encode()
                start_response("200 OK", [("Content-Type", "text/plain; version=0.0.4"),
                                          ("Content-Length", str(len(text)))])
                return [text]
            from .redfish.errors import not_found

            body = json.dumps(not_found(environ.get("PATH_INFO", "")).body()).encode()
            start_response("404 Not Found", [("Content-Type", "application/json"),
                                             ("Content-Length", str(len(body)))])
            return [body]

        return app

    # -- running

    async def run(self, source: Callable[[], Callable[[], None]]) -> None:
        """Serve until SIGTERM/SIGINT. `source()` starts the config source (on the loop's thread, once the loop
        runs) and returns its stop."""
        from hypercorn.asyncio.worker_context import WorkerContext

        from .redfish.server import _quiet_loop_errors

        loop = self._loop = asyncio.get_running_loop()
        loop.set_exception_handler(_quiet_loop_errors)
        self._changed = asyncio.Event()
        stopping = asyncio.Event()
        self._context = WorkerContext(None)
        changed = self._changed

        def stop() -> None:
            stopping.set()
            changed.set()

        self._stop_hook = stop
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                loop.add_signal_handler(signum, stop)
        host, _, port = self.settings.redfish_address.rpartition(":")
        front = RedfishFront(self._pool_port_app(), probes={"/healthz": lambda: True, "/readyz": self.ready},
                             threads=1, body_timeout=self.server_config.body_timeout)
        own = await self.open_listeners(front, host.strip("[]") or "0.0.0.0", int(port), None,
                                        connection_slots(Limits().connections))
        stop_source = source()
        log.info("pool: serving pool=%s/%s probes=%s members-on=%s backend=%s config=%s",
                 self.settings.namespace, self.settings.pool, self.settings.redfish_address, self.settings.address,
                 self.settings.backend, self.settings.file or f"Secret {self.settings.secret}")
        try:
            while not stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), RECONCILE_INTERVAL)
                if stopping.is_set():
                    break
                changed.clear()
                try:
                    await self.reconcile()
                except Exception:  # a bug: logged, and the next tick tries again; the members serve on
                    log.exception("pool: reconciling the members failed")
        finally:
            stop_source()
            await self._context.terminated.set()
            members = list(self.members.values())
            await asyncio.gather(own.close(), *(m.close_listeners() for m in members))
            front.close()
            stop_all(members, STOP_DEADLINE)
            log.info("pool: stopped")


def stop_all(members: Sequence[Member], deadline: float) -> None:
    """Stop the members together (each IPMI server takes up to a fraction of a second to stop: one after
    another, a hundred would outlast SIGTERM's two seconds)."""
    threads = [threading.Thread(target=m.stop, name=f"stop-{m.spec.name}", daemon=True) for m in members]
    for t in threads:
        t.start()
    end = time.monotonic() + deadline
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))


# ---- config sources


def file_source(pool: Pool, path: str) -> Callable[[], Callable[[], None]]:
    """--pool-file: read about once a second; a change of content is offered (a missing file: nothing changes)."""

    def start() -> Callable[[], None]:
        stop = threading.Event()

        def read() -> None:
            try:
                pool.offer(Path(path).read_bytes(), path)
            except FileNotFoundError:
                pool.offer(None, path)
            except OSError as exc:
                log.warning("pool: cannot read %s: %s", path, exc)

        def loop() -> None:
            while not stop.wait(POLL_INTERVAL):
                read()

        read()
        threading.Thread(target=loop, name="pool-file", daemon=True).start()
        return stop.set

    return start


def secret_source(pool: Pool, client: Any) -> Callable[[], Callable[[], None]]:
    """--pool-secret: a watch on that one Secret (list and watch with fieldSelector metadata.name, which a Role
    restricted by resourceNames allows), offered at every change."""
    from .watchcache import ObjectWatch

    def start() -> Callable[[], None]:
        settings = pool.settings
        watch = ObjectWatch(client, f"/api/v1/namespaces/{settings.namespace}/secrets", settings.secret,
                            on_change=pool.offer_secret)
        watch.start()
        return watch.stop

    return start


# ---- werkzeug's URL builders, compiled on first use


def _lazy_url_builders() -> None:
    """werkzeug compiles two URL-building functions per route when an app is created (Rule.compile); the Redfish
    app builds no URLs. Here each is compiled when first called instead (the same function as before), which
    takes a member's app from about 540 KB to 450 KB (PSS; werkzeug is pinned, and tests/test_pool_agent.py checks
    that url_for still works)."""
    from werkzeug.routing.rules import Rule

    if getattr(Rule, "_kubevbmc_lazy", False):
        return
    compile_builder = Rule._compile_builder

    def compiled(rule: Rule, append_unknown: bool) -> Callable[..., tuple[str, str]]:
        real: Callable[..., tuple[str, str]] = compile_builder(rule, append_unknown).__get__(rule, None)
        setattr(rule, "_build_unknown" if append_unknown else "_build", real)
        return real

    # Two functions for every rule (Rule.compile binds them to it): no closure per rule.
    def build(rule: Rule, *args: Any, **kwargs: Any) -> tuple[str, str]:
        return compiled(rule, False)(*args, **kwargs)

    def build_unknown(rule: Rule, *args: Any, **kwargs: Any) -> tuple[str, str]:
        return compiled(rule, True)(*args, **kwargs)

    def lazy(self: Rule, append_unknown: bool = True) -> Callable[..., tuple[str, str]]:
        return build_unknown if append_unknown else build

    Rule._compile_builder = lazy  # type: ignore[method-assign]
    Rule._kubevbmc_lazy = True  # type: ignore[attr-defined]


# ---- the command


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from(args)
    except ValueError as exc:
        print(f"kubevbmc agent: {exc}", file=sys.stderr)
        return 2
    _lazy_url_builders()
    kube = None
    if settings.backend == "kubevirt":
        from .kube import KubeClient, Unreachable, load_credentials

        try:
            kube = KubeClient(load_credentials(settings.kubeconfig or None), maxsize=API_CONNECTIONS)
        except (Unreachable, OSError, ssl.SSLError) as exc:
            log.error("pool: cannot reach the Kubernetes API: %s", exc)
            return 1
    pool = Pool(settings, kube)
    source = file_source(pool, settings.file) if settings.file else secret_source(pool, kube)
    try:
        asyncio.run(pool.run(source))
    except OSError as exc:
        log.error("pool: cannot serve on %s: %s", settings.redfish_address, exc)
        return 1
    finally:
        if kube is not None:
            kube.close()
    return 0


__all__ = ["MemberSpec", "Plan", "Pool", "PoolConfigError", "PoolSettings", "parse_pool", "plan",
           "secret_pool_json", "settings_from", "tls_context"]
