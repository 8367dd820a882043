"""`kubevbmc agent`: one process serving IPMI and Redfish for one VM (with --pool, for many: vbmc/pool.py).

One process holds everything: the Machine (and its watch on the VM), the Redfish app with its server
(vbmc/redfish/server.py: an asyncio front that answers the health probes itself and hands whole requests to a
few worker threads) and the IPMI server, so both protocols see one model. SIGTERM stops both servers within two
seconds.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from . import vmstate
from .machine import Machine
from .throttle import Engaged, LoginThrottle

log = logging.getLogger("vbmc.agent")

METRICS_PATH = "/metrics"


@dataclass
class AgentConfig:
    namespace: str
    vm: str
    vmbmc: str
    username: str
    password: str
    backend: str = "kubevirt"
    ipmi_address: str = "0.0.0.0:10623"
    redfish_address: str = "0.0.0.0:10080"
    redfish: bool = True  # False: the HTTP listener serves /healthz and /readyz only
    redfish_tls_address: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    kubeconfig: str = ""
    threads: int = 2
    subscriptions_secret: str = ""  # where Redfish event subscriptions are kept; empty: in memory
    event_ca_file: str = ""  # CA certificates, besides the system's, for HTTPS event destinations
    redfish_require_tls: bool = False  # refuse credentials over plain HTTP
    media_max_size: int = 64 * 2**30  # the largest image virtual media imports


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--namespace", default=env("VBMC_NAMESPACE", ""), help="the VM's namespace")
    parser.add_argument("--vm", default=env("VBMC_VM", ""), help="the VirtualMachine's name")
    parser.add_argument("--vmbmc", default=env("VBMC_VMBMC", ""),
                        help="the VirtualMachineBMC (its status keeps the boot-once record; Events go to it)")
    parser.add_argument("--ipmi-address", default=env("VBMC_IPMI_ADDRESS", "0.0.0.0:10623"), metavar="HOST:PORT",
                        help="UDP address for IPMI; empty disables IPMI (default %(default)s)")
    parser.add_argument("--redfish-address", default=env("VBMC_REDFISH_ADDRESS", "0.0.0.0:10080"),
                        metavar="HOST:PORT", help="HTTP address for Redfish and /healthz, /readyz")
    parser.add_argument("--redfish", default=env("VBMC_REDFISH", "true"), choices=("true", "false"),
                        help="serve Redfish; false leaves the HTTP listener to /healthz and /readyz "
                             "(default %(default)s)")
    parser.add_argument("--redfish-tls-address", default=env("VBMC_REDFISH_TLS_ADDRESS", ""), metavar="HOST:PORT")
    parser.add_argument("--redfish-require-tls", default=env("VBMC_REDFISH_REQUIRE_TLS", "false"),
                        choices=("true", "false"),
                        help="refuse Redfish credentials (Basic, session login, session tokens) that come over plain "
                             "HTTP; the service root stays readable there (default %(default)s)")
    parser.add_argument("--media-max-size", default=env("VBMC_MEDIA_MAX_SIZE", "64Gi"), metavar="QUANTITY",
                        help="the largest image virtual media imports; a larger one is refused before anything is "
                             "created (default %(default)s)")
    parser.add_argument("--tls-cert", default=env("VBMC_TLS_CERT", ""), metavar="FILE")
    parser.add_argument("--tls-key", default=env("VBMC_TLS_KEY", ""), metavar="FILE")
    parser.add_argument("--subscriptions-secret", default=env("VBMC_SUBSCRIPTIONS_SECRET", ""), metavar="NAME",
                        help="the Secret (in --namespace) that keeps the Redfish event subscriptions, so that they "
                             "outlive the process; empty: in memory (the controller passes its own)")
    parser.add_argument("--event-ca-file", default=env("VBMC_EVENT_CA_FILE", ""), metavar="FILE",
                        help="CA certificates trusted, besides the system's, for HTTPS event destinations")
    parser.add_argument("--backend", choices=("kubevirt", "memory"), default=env("VBMC_BACKEND", "kubevirt"),
                        help="memory: an in-memory machine, no cluster (protocol tests and benchmarks)")
    parser.add_argument("--kubeconfig", default="", help="default: $KUBECONFIG, else in-cluster")
    # Two threads: one slow backend call does not block every client, and fewer threads fight less over the GIL
    # (measured with bench/agent.py: 8 threads give p99 20 ms, 2 give 13 ms, at 8 keep-alive connections).
    # Connections take no thread: stalled and idle clients wait on the server's event loop.
    parser.add_argument("--threads", type=int, default=2, help="Redfish worker threads (default %(default)s)")
    pool = parser.add_argument_group("pooled agent (one process for many VirtualMachineBMCs, vbmc/pool.py)")
    pool.add_argument("--pool", default=env("VBMC_POOL", ""), metavar="NAME",
                      help="serve the members of this pool instead of one VM (--vm, VBMC_USERNAME and "
                           "--ipmi-address are then not used)")
    pool.add_argument("--pool-secret", default=env("VBMC_POOL_SECRET", ""), metavar="NAME",
                      help="the Secret (in --namespace) whose pool.json lists the members; watched")
    pool.add_argument("--pool-file", default=env("VBMC_POOL_FILE", ""), metavar="PATH",
                      help="a pool.json file instead of the Secret, read about once a second (tests, benchmarks)")
    pool.add_argument("--address", default=env("VBMC_ADDRESS", "0.0.0.0"), metavar="HOST",
                      help="the address members' ports are bound on (the pod IP; default %(default)s)")
    parser.add_argument("--log-level", default=env("VBMC_LOG_LEVEL", "info"))
    parser.add_argument("--log-format", default=env("VBMC_LOG_FORMAT", "text"), choices=("text", "json"),
                        help="text lines, or json: one object per line, audit fields as keys (default %(default)s)")


def config_from(args: argparse.Namespace) -> AgentConfig:
    username, password = os.environ.get("VBMC_USERNAME", ""), os.environ.get("VBMC_PASSWORD", "")
    problems = []
    if not username or not password:
        problems.append("VBMC_USERNAME and VBMC_PASSWORD must be set (the BMC's credentials)")
    if not args.vm:
        problems.append("--vm is required")
    if args.backend == "kubevirt" and not args.namespace:
        problems.append("--namespace is required with the kubevirt backend")
    if args.redfish_tls_address and args.redfish == "false":
        problems.append("--redfish-tls-address serves Redfish: it cannot go with --redfish false")
    if args.redfish_tls_address and not (args.tls_cert and args.tls_key):
        problems.append("--redfish-tls-address needs --tls-cert and --tls-key")
    if args.subscriptions_secret and args.backend != "kubevirt":
        problems.append("--subscriptions-secret needs the kubevirt backend")
    if vmstate.quantity_bytes(args.media_max_size) <= 0:
        problems.append(f"--media-max-size {args.media_max_size!r} is not a size (such as 64Gi)")
    for path in (args.tls_cert, args.tls_key, args.event_ca_file):
        if path and not os.path.exists(path):
            problems.append(f"{path} does not exist")
    if problems:
        raise ValueError("; ".join(problems))
    return AgentConfig(namespace=args.namespace or "default", vm=args.vm, vmbmc=args.vmbmc, username=username,
                       password=password, backend=args.backend, ipmi_address=args.ipmi_address,
                       redfish_address=args.redfish_address, redfish=args.redfish != "false",
                       redfish_tls_address=args.redfish_tls_address,
                       tls_cert=args.tls_cert, tls_key=args.tls_key, kubeconfig=args.kubeconfig,
                       threads=args.threads, subscriptions_secret=args.subscriptions_secret,
                       event_ca_file=args.event_ca_file, redfish_require_tls=args.redfish_require_tls == "true",
                       media_max_size=vmstate.quantity_bytes(args.media_max_size))


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


class Agent:
    """The Machine, the IPMI server and the Redfish app."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.machine: Machine | None = None
        self.ipmi: Any = None
        self.events: Any = None  # the Redfish EventService, once the app is built
        self.kube: Any = None  # the kubevirt backend's API client
        self._stop = threading.Event()
        self._ipmi_failed = ""
        # One budget of failed logins per source address over IPMI and Redfish.
        self.throttle = LoginThrottle(on_engaged=self._login_throttled)

    def _login_throttled(self, engaged: Engaged) -> None:
        """A Warning Event on the VirtualMachineBMC (at most one per source a minute, see vbmc/throttle.py),
        posted from its own thread: the IPMI server answers every client from one thread."""
        machine = self.machine
        if machine is None:
            return
        message = (f"{engaged.failures} failed {engaged.protocol} logins from {engaged.source}; its logins are "
                   f"refused for {engaged.delay:.0f} s, longer after each further failure")

        def post() -> None:
            machine.record_event("LoginThrottled", message, "Warning")

        threading.Thread(target=post, name="login-throttled-event", daemon=True).start()

    def build_machine(self) -> Machine:
        c = self.config
        if c.backend == "memory":
            from .memory import MemoryMachine

            return MemoryMachine(name=c.vm)
        from .kube import KubeClient, load_credentials
        from .kubevirt import KubeVirtMachine

        # Connections at once: three watch streams, their three probes (vbmc/watchcache.py) and a write. A smaller
        # pool would open a new TLS connection for a probe and throw it away afterwards, every few seconds.
        client = self.kube = KubeClient(load_credentials(c.kubeconfig or None), maxsize=8)
        machine = KubeVirtMachine(client, c.namespace, c.vm, c.vmbmc, media_max_size=c.media_max_size)
        machine.start()
        if not machine.wait_ready(10):
            log.warning("agent: the API server has not answered yet; serving and retrying")
        return machine

    def ready(self) -> bool:
        machine = self.machine
        if machine is None:
            return False
        if getattr(machine, "ready", True) is False:
            return False
        return self.ipmi is not None or not self.config.ipmi_address

    def app(self) -> Any:
        from .redfish import create_app

        c = self.config
        self.machine = self.build_machine()
        if c.ipmi_address:
            threading.Thread(target=self._start_ipmi, name="ipmi-start", daemon=True).start()
        if not c.redfish:
            return _Metrics(_no_redfish, self.throttle.metrics)
        bmc_uuid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"kubevbmc:{c.namespace}/{c.vm}"))
        store = None
        if c.subscriptions_secret:
            from .eventservice import SecretStore

            store = SecretStore(self.kube, c.namespace, c.subscriptions_secret)
        app = create_app(self.machine, c.username, c.password, system_id=c.vm, bmc_uuid=bmc_uuid,
                         throttle=self.throttle, subscriptions=store, event_ca_file=c.event_ca_file,
                         require_tls=c.redfish_require_tls)
        self.events = app.extensions["vbmc.events"]
        app.wsgi_app = _Metrics(app.wsgi_app, self.throttle.metrics)
        return app

    def probes(self) -> dict[str, Callable[[], bool]]:
        """`/healthz` (the process serves) and `/readyz` (the VM is watched and IPMI is up), without auth,
        answered by the server's event loop: no client and no slow backend call can hold them up."""
        return {"/healthz": lambda: True, "/readyz": self.ready}

    def _start_ipmi(self) -> None:
        """IPMI answers RAKP with the system GUID, so it starts once the VM is known."""
        from .ipmi import IpmiServer

        machine = self.machine
        assert machine is not None
        while not self._stop.is_set():
            if getattr(machine, "ready", True):
                try:
                    server = IpmiServer(machine, self.config.username, self.config.password,
                                        address=_host_port(self.config.ipmi_address), throttle=self.throttle)
                    server.start()
                    self.ipmi = server
                    return
                except OSError as exc:
                    if self._ipmi_failed != str(exc):
                        log.error("agent: cannot serve IPMI on %s: %s", self.config.ipmi_address, exc)
                    self._ipmi_failed = str(exc)
                except Exception as exc:
                    log.warning("agent: IPMI not started yet: %s", exc)
            self._stop.wait(0.5)

    def shutdown(self) -> None:
        self._stop.set()
        if self.ipmi is not None:
            self.ipmi.stop()
        if self.events is not None:
            self.events.close()
        stop: Callable[[], None] | None = getattr(self.machine, "stop", None)
        if stop is not None:
            stop()


class _Metrics:
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
def _service_disabled() -> bytes:
    from .redfish.errors import RedfishError

    error = RedfishError(404, "ServiceDisabled", "/redfish", detail="spec.redfish.enabled is false for this BMC.")
    return json.dumps(error.body()).encode()


def _no_redfish(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    """Every path but the probes' when Redfish is off (a VirtualMachineBMC with spec.redfish.enabled false): 404
    with the Base registry's ServiceDisabled, so a Redfish client says why."""
    body = _service_disabled()
    start_response("404 Not Found", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


class JsonFormatter(logging.Formatter):
    """`--log-format json`: one object per line; an audit line's fields (vbmc/audit.py) are keys of it."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        fields = getattr(record, "audit", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line)


def configure_logging(level: str, log_format: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json"
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, str(level).upper(), logging.INFO), handlers=[handler])


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, getattr(args, "log_format", "text"))
    if getattr(args, "pool", ""):
        from . import pool

        return pool.run(args)
    try:
        config = config_from(args)
    except ValueError as exc:
        print(f"kubevbmc agent: {exc}", file=sys.stderr)
        return 2
    from .redfish.server import ServerConfig, serve

    agent = Agent(config)
    server_config = ServerConfig(
        http=config.redfish_address or None, https=config.redfish_tls_address or None,
        certfile=config.tls_cert or None, keyfile=config.tls_key or None, threads=config.threads)
    log.info("agent: serving vm=%s/%s ipmi=%s redfish=%s redfish-tls=%s backend=%s", config.namespace, config.vm,
             config.ipmi_address or "-", (config.redfish_address or "-") if config.redfish else "off",
             config.redfish_tls_address or "-",
             config.backend)
    if config.redfish_require_tls and config.redfish and not config.redfish_tls_address:
        log.warning("agent: --redfish-require-tls without --redfish-tls-address: every Redfish request with "
                    "credentials is refused until the agent serves HTTPS")
    try:
        serve(agent.app, server_config, probes=agent.probes(), on_stop=agent.shutdown)
    except (OSError, ValueError) as exc:
        log.error("agent: cannot serve Redfish: %s", exc)
        return 1
    return 0
