"""One BMC as the agent serves it: the one composition used by a dedicated agent and by every member of a pool.

A BMC is, whether it is alone in its process (`kubevbmc agent`) or one of many (`kubevbmc agent --pool`), so that a
client cannot tell the two apart:
- its Machine: a KubeVirtMachine (its own watches of its VM, VMI and VirtualMachineBMC) over the KubeClient of the
  process (shared by a pool's members), or a MemoryMachine;
- its IpmiServer, with its own socket, session table and backend writer thread (made at its first write), served
  by the process's IPMI loop (vbmc/ipmi/loop.py: one thread and a few workers for every BMC), started once the
  Machine knows its VM (IPMI answers RAKP with the system GUID);
- its serial console and screen (vbmc/machine/console.py, screen.py: one connection to the VM each, shared by IPMI
  SOL and the web page's viewers);
- its page and console WebSockets (vbmc/web), in front of its Redfish app;
- its Redfish app (create_app: its own credentials, sessions, EventService and subscriptions store, bmc uuid
  uuid5(kubevbmc:NS/VM), system id = VM name) behind its own RedfishFront, whose worker threads (--threads, two by
  default, created on the first requests) only this BMC's requests use;
- its own LoginThrottle, shared by its IPMI and Redfish (one BMC's brute-forcer never locks another BMC's clients
  out);
- its HTTP listener and, with a certificate, its HTTPS listener with ITS certificate; each answers /healthz,
  /readyz (this BMC's: its VM is watched and its IPMI is up) and /metrics (this BMC's login counters) without
  credentials; with Redfish off everything else is 404 ServiceDisabled.

Every part (the Machine and app, IPMI, HTTP, HTTPS) that fails to start is logged once per distinct error and
tried again with backoff, alone; the others serve on.

Limits: every BMC has its own connection cap (512 over its HTTP and HTTPS listeners) and its own queue of 64
requests (vbmc/redfish/server.py Limits), so one BMC's flood or stalled clients take neither another's connection
slots nor its worker threads.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import ssl
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..access.throttle import Engaged, LoginThrottle
from ..machine import STALE_READS, Machine
from ..machine.console import MAX_VIEWERS, SerialHub
from ..machine.screen import ScreenHub
from ..redfish.eventservice import SubscriptionStore
from ..redfish.resources import ConsoleAccess
from ..redfish.server import Limits, Listeners, RedfishFront, ServerConfig, connection_slots, hypercorn_config
from ..web import SCREEN_URI, SERIAL_URI, Consoles, MediaUploads, WebFront
from .logstore import LogKeeper

log = logging.getLogger("vbmc.agent")

METRICS_PATH = "/metrics"
RETRY_FIRST, RETRY_MAX = 1.0, 30.0  # backoff of a part that failed to start
RETRY_SOON = 0.5  # seconds before IPMI is tried again while its Machine cannot answer yet


@dataclass(frozen=True)
class BmcSpec:
    """What one BMC serves and where: a pool.json entry (vbmc/agent/pool.py), or a dedicated agent's flags. Equal
    specs mean an untouched BMC; any difference restarts it. A host left empty is the agent's --address."""

    name: str  # the VirtualMachineBMC ("" for a dedicated agent run without --vmbmc)
    vm: str
    username: str
    password: str = field(repr=False)
    ipmi_port: int
    http_port: int  # 0: no HTTP listener (a dedicated agent that serves HTTPS only)
    https_port: int = 0
    ipmi: bool = True
    redfish: bool = True
    require_tls: bool = False
    tls_cert: str = field(default="", repr=False)  # PEM: the certificate (chain)
    tls_key: str = field(default="", repr=False)
    subscriptions_secret: str = ""
    log_config_map: str = ""  # where its SEL and audit trail are kept (vbmc/agent/logstore.py); empty: in memory
    ipmi_host: str = ""
    http_host: str = ""
    https_host: str = ""

    @property
    def serves_https(self) -> bool:
        return bool(self.redfish and self.https_port and self.tls_cert)


class Host(Protocol):
    """What a BMC needs of the process that serves it (vbmc/agent/runtime.py's Agent)."""

    server_config: ServerConfig

    @property
    def namespace(self) -> str: ...

    @property
    def address(self) -> str: ...  # the host of listeners whose spec leaves it empty

    @property
    def event_ca_file(self) -> str: ...

    def who(self, spec: BmcSpec) -> str: ...  # for log lines: "pool: member bmc-01"

    def new_machine(self, spec: BmcSpec) -> Machine: ...

    def subscriptions_store(self, spec: BmcSpec) -> SubscriptionStore | None: ...

    def log_keeper(self, spec: BmcSpec, machine: Machine) -> LogKeeper | None: ...  # started; None: in memory

    async def open_listeners(self, front: RedfishFront, host: str, port: int, tls: ssl.SSLContext | None,
                             slots: Any) -> Listeners: ...


class _Part:
    """One thing a BMC serves (its Machine and app, IPMI, HTTP, HTTPS): up, or waiting to be tried again after a
    failure."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.error = ""
        self.failures = 0
        self.due = 0.0  # time.monotonic() of the next attempt

    def failed(self, who: str, error: str, now: float) -> None:
        self.failures += 1
        delay = min(RETRY_MAX, RETRY_FIRST * 2 ** (self.failures - 1))
        self.due = now + delay
        if error != self.error:  # one line per distinct error, not one per retry
            log.error("%s cannot serve %s: %s; retrying every %.0f s at most", who, self.what, error, RETRY_MAX)
        self.error = error


class Bmc:
    """One BMC: its Machine, IPMI server, Redfish app and listeners (see the module's docstring)."""

    def __init__(self, spec: BmcSpec, agent: Host) -> None:
        self.spec = spec
        self.agent = agent
        self.machine: Machine | None = None
        self.keeper: LogKeeper | None = None  # its SEL and audit trail kept in the cluster
        self.serial: SerialHub | None = None  # the serial console, shared by IPMI SOL and the web consoles
        self.screen: ScreenHub | None = None
        self.ipmi: Any = None
        self.events: Any = None
        self.front: RedfishFront | None = None
        self.uploads: MediaUploads | None = None  # the page's virtual media uploads
        self.listeners: Listeners | None = None
        self.https: Listeners | None = None
        self.throttle = LoginThrottle(on_engaged=self._login_throttled)
        self.parts = {"build": _Part("its Machine and Redfish app"), "ipmi": _Part("IPMI"), "http": _Part("HTTP"),
                      "https": _Part("HTTPS")}
        self._slots = connection_slots(Limits().connections)  # shared by its HTTP and HTTPS listeners

    def host(self, given: str) -> str:
        return given or self.agent.address

    # -- building (a worker thread: create_app may read the subscriptions Secret)

    def build(self) -> None:
        spec, agent = self.spec, self.agent
        self.machine = self.agent.new_machine(spec)
        # Before any frontend shows them: the SEL and the audit trail read back from where they are kept.
        self.keeper = self.agent.log_keeper(spec, self.machine)
        self.serial = SerialHub(self.machine, spec.vm)
        app: Any
        web: WebFront | None = None
        if spec.redfish:
            from ..redfish import create_app
            from ..redfish.app import DEFAULT_PORTS

            self.screen = ScreenHub(self.machine, spec.vm)
            bmc_uuid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"kubevbmc:{agent.namespace}/{spec.vm}"))
            access = ConsoleAccess(ipmi_sol=spec.ipmi, serial_uri=SERIAL_URI, screen_uri=SCREEN_URI,
                                   max_sessions=MAX_VIEWERS)
            flask_app = create_app(self.machine, spec.username, spec.password, system_id=spec.vm,
                                   bmc_uuid=bmc_uuid, throttle=self.throttle,
                                   subscriptions=self.agent.subscriptions_store(spec),
                                   event_ca_file=agent.event_ca_file, require_tls=spec.require_tls, consoles=access,
                                   ports=served_ports(spec, DEFAULT_PORTS),
                                   tls_cert=spec.tls_cert if spec.serves_https else "")
            self.events = flask_app.extensions["vbmc.events"]
            flask_app.wsgi_app = MetricsApp(flask_app.wsgi_app, self.metrics)
            app = flask_app
            consoles = Consoles(flask_app.extensions["vbmc.sessions"], self.throttle, spec.vm, self.serial,
                                self.screen, require_tls=spec.require_tls)
            self.uploads = MediaUploads(self.machine, flask_app.extensions["vbmc.sessions"], self.throttle, spec.vm,
                                        require_tls=spec.require_tls)
            web = WebFront(consoles, require_tls=spec.require_tls,
                           https_port=lambda: spec.https_port if self.https is not None else 0, uploads=self.uploads)
        else:
            app = MetricsApp(service_disabled, self.metrics)
        server = self.agent.server_config
        self.front = RedfishFront(app, probes={"/healthz": lambda: True, "/readyz": self.ready},
                                  threads=server.threads, body_timeout=server.body_timeout, limits=server.limits,
                                  web=web, arrived=self.machine.client_arrived, monitoring=(METRICS_PATH,))

    def _login_throttled(self, engaged: Engaged) -> None:
        """A Warning Event on this BMC's VirtualMachineBMC (at most one per source a minute, see
        vbmc/access/throttle.py), posted from its own thread: the IPMI server answers clients from the IPMI loop's."""
        machine = self.machine
        if machine is None:
            return
        message = (f"{engaged.failures} failed {engaged.protocol} logins from {engaged.source}; its logins are "
                   f"refused for {engaged.delay:.0f} s, longer after each further failure")

        def post() -> None:
            machine.record_event("LoginThrottled", message, "Warning")

        threading.Thread(target=post, name="login-throttled-event", daemon=True).start()

    # -- state

    @property
    def machine_ready(self) -> bool:
        return self.machine is not None and getattr(self.machine, "ready", True) is not False

    @property
    def vm_absent(self) -> bool:
        """The API server has answered that the VM does not exist (the BMC cannot get ready until it does)."""
        watch = getattr(self.machine, "vm_watch", None)
        return watch is not None and watch.synced and watch.obj is None

    def metrics(self) -> str:
        """This BMC's /metrics: its login counters and the process's stale reads."""
        return self.throttle.metrics() + stale_reads_metric()

    def ready(self) -> bool:
        """This BMC's /readyz: the VM is watched and IPMI is up (when enabled)."""
        return self.machine_ready and (self.ipmi is not None or not self.spec.ipmi)

    def serving(self) -> bool:
        """Every listener it should have is up."""
        return ((self.listeners is not None or not self.spec.http_port)
                and (self.https is not None or not self.spec.serves_https)
                and (self.ipmi is not None or not self.spec.ipmi))

    def settled(self) -> bool:
        """Done with its first start, for a pool's readiness: serving, or known to be unable to for now."""
        if self.front is None:
            return self.parts["build"].failures > 0
        http_done = self.listeners is not None or not self.spec.http_port or self.parts["http"].failures > 0
        https_done = not self.spec.serves_https or self.https is not None or self.parts["https"].failures > 0
        ipmi_done = not self.spec.ipmi or self.ipmi is not None or self.parts["ipmi"].failures > 0
        machine_done = self.machine_ready or self.vm_absent
        return http_done and https_done and (ipmi_done or self.vm_absent) and machine_done

    def serving_report(self) -> tuple[bool, str] | None:
        """(serving everything its spec asks for, why not) once its first start settled; None before, or while
        its VM does not exist (the controller knows that without being told)."""
        if not self.settled() or self.vm_absent or self.machine is None:
            return None
        if self.serving():
            return True, ""
        errors = [f"{part.what}: {part.error}" for key, part in self.parts.items()
                  if key in ("http", "https", "ipmi") and part.error]
        return False, "; ".join(errors) or "not serving every listener yet"

    def listener_error(self) -> str:
        """Why its HTTP or HTTPS listener failed to open, "" when neither did."""
        return self.parts["http"].error or self.parts["https"].error

    # -- listeners (the event loop)

    async def open_pending(self, now: float) -> None:
        """Try whatever is not up yet and due: HTTP, HTTPS, IPMI (once the Machine knows its VM)."""
        spec, who = self.spec, self.agent.who(self.spec)
        if self.front is None:
            return
        part = self.parts["http"]
        if spec.http_port and self.listeners is None and now >= part.due:
            host = self.host(spec.http_host)
            try:
                self.listeners = await self.agent.open_listeners(self.front, host, spec.http_port, None, self._slots)
                part.error = ""
            except (OSError, ValueError) as exc:
                part.failed(who, f"{host}:{spec.http_port}: {exc}", now)
        part = self.parts["https"]
        if spec.serves_https and self.https is None and now >= part.due:
            host = self.host(spec.https_host)
            try:
                tls = tls_context(spec.tls_cert, spec.tls_key)
                self.https = await self.agent.open_listeners(self.front, host, spec.https_port, tls, self._slots)
                part.error = ""
            except (OSError, ValueError, ssl.SSLError) as exc:
                part.failed(who, f"{host}:{spec.https_port}: {exc}", now)
        part = self.parts["ipmi"]
        if spec.ipmi and self.ipmi is None and now >= part.due and self.machine_ready:
            self.start_ipmi(now)

    def start_ipmi(self, now: float) -> None:
        """IPMI answers RAKP with the system GUID, so it starts once the VM is known (binding is immediate)."""
        from ..ipmi import IpmiServer

        assert self.machine is not None
        part, host = self.parts["ipmi"], self.host(self.spec.ipmi_host)
        try:
            server = IpmiServer(self.machine, self.spec.username, self.spec.password,
                                address=(host, self.spec.ipmi_port), throttle=self.throttle, console=self.serial)
            server.start()
        except OSError as exc:
            part.failed(self.agent.who(self.spec), f"{host}:{self.spec.ipmi_port}/udp: {exc}", now)
            return
        except Exception as exc:  # the Machine could not answer (a stale cache): not an error, try again soon
            log.debug("%s: IPMI not started yet: %s", self.agent.who(self.spec), exc)
            part.due = now + RETRY_SOON
            return
        part.error = ""
        self.ipmi = server

    async def close_listeners(self) -> None:
        for listeners in (self.listeners, self.https):
            if listeners is not None:
                await listeners.close()
        self.listeners = self.https = None

    def stop(self) -> None:
        """Blocking (a worker thread): IPMI (returns within a fraction of a second), events, what its logs have not
        kept yet (vbmc/agent/logstore.py STOP_WAIT), the Machine."""
        if self.ipmi is not None:
            self.ipmi.stop()
        if self.keeper is not None:
            self.keeper.stop()
        for hub in (self.serial, self.screen):
            if hub is not None:
                hub.stop()
        if self.events is not None:
            self.events.close()
        if self.front is not None:
            self.front.close()
        if self.uploads is not None:
            self.uploads.close()
        stop: Callable[[], None] | None = getattr(self.machine, "stop", None)
        if stop is not None:
            stop()


def served_ports(spec: BmcSpec, service_ports: dict[str, int]) -> dict[str, int]:
    """The Service's ports (`service_ports`) of the protocols this BMC serves, as its Manager's NetworkProtocol and
    Endpoints show them."""
    served = {"HTTP": bool(spec.http_port), "HTTPS": spec.serves_https, "IPMI": spec.ipmi}
    return {name: port for name, port in service_ports.items() if served.get(name)}


# ---- what a BMC's port answers besides Redfish


def stale_reads_metric() -> str:
    """kubevbmc_agent_stale_reads_total: the process's reads refused from a stale watch cache (every BMC it serves)."""
    return ("# HELP kubevbmc_agent_stale_reads_total Reads refused (IPMI 0xC0, Redfish 503) because a watch cache had "
            "not heard from the API server.\n# TYPE kubevbmc_agent_stale_reads_total counter\n"
            f"kubevbmc_agent_stale_reads_total {STALE_READS.value}\n")


class MetricsApp:
    """`/metrics` (failed and throttled logins, Prometheus text: counts only, no addresses or names), without
    auth; everything else goes to the app."""

    def __init__(self, app: Any, metrics: Callable[[], str]) -> None:
        self.app = app
        self.metrics = metrics

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") != METRICS_PATH:
            return self.app(environ, start_response)
        text = self.metrics().encode()
        start_response("200 OK", [("Content-Type", "text/plain; version=0.0.4"), ("Content-Length", str(len(text)))])
        return [text]


@functools.cache
def _service_disabled_body() -> bytes:
    from ..redfish.errors import RedfishError

    error = RedfishError(404, "ServiceDisabled", "/redfish", detail="spec.redfish.enabled is false for this BMC.")
    return json.dumps(error.body()).encode()


def service_disabled(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    """Every path but the probes' when Redfish is off (a VirtualMachineBMC with spec.redfish.enabled false): 404
    with the Base registry's ServiceDisabled, so a Redfish client says why."""
    body = _service_disabled_body()
    start_response("404 Not Found", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


# ---- its certificate


def tls_context(cert_pem: str, key_pem: str) -> ssl.SSLContext:
    """The server TLS context of a BMC (hypercorn's, HTTP/1.1 only), from PEM text. OpenSSL loads a chain from
    files only: the PEM goes through anonymous memory files (memfd: no file on the pod's read-only filesystem,
    nothing left behind), else through a private directory removed at once."""
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
