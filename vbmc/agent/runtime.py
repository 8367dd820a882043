"""The agent's runtime: a set of BMCs (vbmc/agent/bmc.py) served on one event loop.

A dedicated agent (`kubevbmc agent`) is a set of one, fixed by its flags; a pooled agent (`kubevbmc agent --pool`)
serves the members its pool config offers (vbmc/agent/pool.py) and, at every change of that list, starts the new
members, stops the removed ones and restarts a member whose entry changed, alone (`plan`).

Isolation: one asyncio event loop (the main thread) does every BMC's network I/O and nothing else that blocks;
each request runs on its BMC's own worker threads, each IPMI command in its BMC's turn on one of the IPMI loop's
workers (vbmc/ipmi/loop.py; backend writes on the BMC's own writer thread), so one BMC's slow or failing backend
calls hold up only that BMC. BMCs start and stop off the loop (threads), so one that takes long to stop delays no
request.

A dedicated agent's listeners must open at its first attempt: a port in use or a certificate that does not load
ends the process (exit 1, so that the kubelet shows the crash). A pool instead logs a member that fails to start
and retries it with backoff, part by part (IPMI, HTTP, HTTPS); the others never wait for it.

A pool's own port (--redfish-address, the kubelet's probes): /healthz (200 while the process serves), /readyz
(200 once the pool config was read and every member of that first read has settled: started, or failed to start
and logged, or its VM known not to exist; it then stays ready, since every member's Service selects this pod and
a later member must not take the others out of it), /metrics (the members' login counters summed, as the
dedicated agents' would be, plus kubevbmc_agent_pool_* gauges and counters). Anything else there: 404.

Memory (bench/agent.py): the BMCs of a pool share the interpreter, the imported code, one event loop, one
KubeClient (one urllib3 pool) and the pool's port; a member costs about 1 MB PSS (kubevirt backend). Its Flask app
is the largest part, about 540 KB (57 routes, each parsed and matched per app: the routes name the BMC's own
System), less about 90 KB of werkzeug URL builders that are compiled on first use here (`lazy_url_builders`: the
Redfish app builds no URLs), and its routes' parsed parts are shared with the other members' (`shared_rule_parts`).
Then its Machine's watches (three, the cached VM and VMI), the IPMI server (no thread of its own: the process's
IPMI loop watches its socket) and the Redfish worker threads (created on the first requests, about 16 KB each).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import ssl
import sys
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..machine import Machine
from ..redfish.eventservice import SubscriptionStore
from ..redfish.server import (
    Limits,
    Listeners,
    RedfishFront,
    ServerConfig,
    bind_listener,
    connection_slots,
    hypercorn_config,
    quiet_loop_errors,
)
from .bmc import Bmc, BmcSpec, stale_reads_metric
from .logstore import LogKeeper
from .pool import POOL_KEY, PoolConfigError, Source, parse_pool, plan

log = logging.getLogger("vbmc.agent")

RECONCILE_INTERVAL = 0.5  # seconds between two looks at BMCs' pending parts (IPMI waiting for the VM, retries)
STOP_DEADLINE = 1.5  # seconds SIGTERM gives the BMCs to stop (IPMI servers, watches) together


@dataclass
class Settings:
    namespace: str
    pool: str = ""  # the pool's name; "" for a dedicated agent
    address: str = "0.0.0.0"  # the host of listeners whose BMC spec leaves it empty (the pod IP)
    redfish_address: str = ""  # a pool's own port (probes and metrics), host:port
    backend: str = "kubevirt"
    threads: int = 2  # Redfish worker threads per BMC
    event_ca_file: str = ""
    media_max_size: int = 64 * 2**30
    cdi_upload_proxy: str = ""  # CDI's upload proxy and its CA file (vbmc/machine/kubevirt/upload.py)
    cdi_upload_proxy_ca: str = ""
    keep_ejected_media: float = 120.0  # seconds (KubeVirtMachine.keep_ejected)
    source: str = ""  # where the BMCs come from, for the start line


class Agent:
    """The BMCs, reconciled on one event loop against the latest list offered (by `offer_specs`, or as a pool.json
    by `offer`)."""

    def __init__(self, settings: Settings, kube: Any = None) -> None:
        self.settings = settings
        self.kube = kube  # the KubeClient every BMC's Machine shares (kubevirt backend)
        self.server_config = ServerConfig(threads=settings.threads)
        self.pooled = bool(settings.pool)
        self._hc = hypercorn_config(ServerConfig(http="127.0.0.1:0"))
        self.bmcs: dict[str, Bmc] = {}
        self._wanted: tuple[BmcSpec, ...] | None = None  # offered, not yet applied
        self._lock = threading.Lock()
        self._first: frozenset[str] | None = None  # the BMCs of the first list applied
        self._ready = False
        self.failed = ""  # why a dedicated agent stopped: its listeners could not open
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._stop_hook: Callable[[], None] | None = None
        self._context: Any = None
        self._state: dict[str, Any] = {}
        self._last_raw: bytes | None = None
        # Counters: kept over members' restarts so that the summed login counters never go down.
        self._retired: dict[str, dict[str, int]] = {"failures": {}, "refused": {}, "lockouts": {}}
        self.counters = {"applied": 0, "rejected": 0, "start_failures": 0}
        # A pool's members' own readiness, as last reported to their VirtualMachineBMCs, and reports on their way.
        self._reported: dict[str, tuple[bool, str]] = {}
        self._reporting: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    # -- what a BMC needs of its host (bmc.Host)

    @property
    def namespace(self) -> str:
        return self.settings.namespace

    @property
    def address(self) -> str:
        return self.settings.address

    @property
    def event_ca_file(self) -> str:
        return self.settings.event_ca_file

    def who(self, spec: BmcSpec) -> str:
        if self.pooled:
            return f"pool: member {spec.name}"
        return f"agent: vm {self.settings.namespace}/{spec.vm}"

    def new_machine(self, spec: BmcSpec) -> Machine:
        if self.settings.backend == "memory":
            from ..machine.memory import MemoryMachine

            return MemoryMachine(name=spec.vm)
        from ..machine.kubevirt import KubeVirtMachine
        from ..machine.kubevirt.upload import ProxySettings

        machine = KubeVirtMachine(self.kube, self.settings.namespace, spec.vm, spec.name,
                                  media_max_size=self.settings.media_max_size,
                                  upload_proxy=ProxySettings(self.settings.cdi_upload_proxy,
                                                             self.settings.cdi_upload_proxy_ca),
                                  keep_ejected=self.settings.keep_ejected_media)
        machine.start()
        return machine

    def subscriptions_store(self, spec: BmcSpec) -> SubscriptionStore | None:
        if not spec.subscriptions_secret or self.kube is None:
            return None  # kept in memory
        from .subscriptions import SecretStore

        return SecretStore(self.kube, self.settings.namespace, spec.subscriptions_secret)

    def log_keeper(self, spec: BmcSpec, machine: Machine) -> LogKeeper | None:
        bmc_watch = getattr(machine, "bmc_watch", None)
        if not spec.log_config_map or self.kube is None or bmc_watch is None:
            return None  # kept in memory
        keeper = LogKeeper(self.kube, self.settings.namespace, spec.log_config_map, machine.event_log,
                           machine.audit_trail, owner=lambda: bmc_watch.obj, who=self.who(spec))
        keeper.start()
        return keeper

    async def open_listeners(self, front: RedfishFront, host: str, port: int, tls: ssl.SSLContext | None,
                             slots: Any) -> Listeners:
        sock = bind_listener(host, port, slots, self._hc.backlog)
        listeners = Listeners(front, self._hc, [(sock, tls)], self._context, self._state)
        await listeners.start()
        return listeners

    # -- what to serve (any thread)

    def offer_specs(self, specs: Iterable[BmcSpec]) -> None:
        """Serve exactly these BMCs from now on."""
        loop, changed = self._loop, self._changed
        with self._lock:
            self._wanted = tuple(specs)
        if loop is not None and changed is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: shutting down
                loop.call_soon_threadsafe(changed.set)

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
            self.refuse(source, f"the pool config is not valid, nothing changes: {exc}")
            return
        for problem in left_out:
            log.error("pool: %s: %s", source, problem)
        self.offer_specs(members)

    def refuse(self, source: str, problem: str) -> None:
        self.counters["rejected"] += 1
        log.error("pool: %s: %s", source, problem)

    # -- the BMCs (the event loop)

    async def _start(self, spec: BmcSpec) -> Bmc:
        bmc = Bmc(spec, self)
        await self._build(bmc)
        return bmc

    async def _build(self, bmc: Bmc) -> None:
        """Build a BMC (off the loop) and open what it serves; a failure is logged and tried again later."""
        try:
            await asyncio.to_thread(bmc.build)
        except Exception as exc:
            self.counters["start_failures"] += 1
            bmc.parts["build"].failed(self.who(bmc.spec), f"{type(exc).__name__}: {exc}", time.monotonic())
            try:
                await asyncio.to_thread(bmc.stop)  # whatever it had started (its Machine's watches)
            except Exception as stop_error:
                log.error("%s did not stop cleanly: %r", self.who(bmc.spec), stop_error)
            bmc.machine = bmc.events = bmc.front = bmc.keeper = None
            return
        await self._open(bmc)
        self._log_started(bmc)

    async def _open(self, bmc: Bmc) -> None:
        before = sum(p.failures for p in bmc.parts.values())
        try:
            await bmc.open_pending(time.monotonic())
        except Exception:  # a bug, not a port in use: logged, and the BMC is tried again at the next tick
            log.exception("%s: opening its listeners failed", self.who(bmc.spec))
        self.counters["start_failures"] += sum(p.failures for p in bmc.parts.values()) - before

    def _log_started(self, bmc: Bmc) -> None:
        if not self.pooled:
            return  # the dedicated agent's start line says it all (vbmc/agent/command.py)
        spec = bmc.spec
        log.info("pool: member started name=%s vm=%s ipmi=%s http=%s:%d https=%s redfish=%s", spec.name, spec.vm,
                 f"{bmc.host(spec.ipmi_host)}:{spec.ipmi_port}" if spec.ipmi else "-",
                 bmc.host(spec.http_host), spec.http_port,
                 f"{bmc.host(spec.https_host)}:{spec.https_port}" if spec.serves_https else "-",
                 "on" if spec.redfish else "off")

    async def _stop(self, bmc: Bmc) -> None:
        self._reported.pop(bmc.spec.name, None)
        results = await asyncio.gather(bmc.close_listeners(), asyncio.to_thread(bmc.stop), return_exceptions=True)
        for result in results:
            if isinstance(result, Exception):
                log.error("%s did not stop cleanly: %r", self.who(bmc.spec), result)
        self._retire(bmc)
        if self.pooled:
            log.info("pool: member stopped name=%s vm=%s", bmc.spec.name, bmc.spec.vm)

    def _retire(self, bmc: Bmc) -> None:
        t = bmc.throttle
        for key, counts in (("failures", dict(t.failures_total)), ("refused", dict(t.refused_total)),
                            ("lockouts", {"": t.engaged_total})):
            for label, n in counts.items():
                self._retired[key][label] = self._retired[key].get(label, 0) + n

    async def reconcile(self) -> None:
        with self._lock:  # the newest list offered, once
            wanted, self._wanted = self._wanted, None
        if wanted is not None:
            steps = plan({n: b.spec for n, b in self.bmcs.items()}, wanted)
            if self.pooled and (steps.stop or steps.start):
                log.info("pool: %d member(s) to stop, %d to start, %d unchanged", len(steps.stop),
                         len(steps.start), len(self.bmcs) - len(steps.stop))
            stopping = [self.bmcs.pop(name) for name in steps.stop]
            await asyncio.gather(*(self._stop(b) for b in stopping))
            started = await asyncio.gather(*(self._start(spec) for spec in steps.start))
            for bmc in started:
                self.bmcs[bmc.spec.name] = bmc
            if self._first is None:
                self._first = frozenset(s.name for s in wanted)
            self.counters["applied"] += 1
            if not self.pooled:
                self._check_listeners()
        now = time.monotonic()
        for bmc in list(self.bmcs.values()):
            if bmc.front is None and now >= bmc.parts["build"].due:
                await self._build(bmc)
            elif bmc.front is not None and not bmc.serving():
                await self._open(bmc)
        if not self._ready and self._first is not None:
            self._ready = all(b.settled() for n, b in self.bmcs.items() if n in self._first)
            if self._ready and self.pooled:
                log.info("pool: ready: %d member(s)", len(self.bmcs))
        if self.pooled:
            self._report_serving()

    def _report_serving(self) -> None:
        """Each member's own readiness to its VirtualMachineBMC (Machine.report_serving), when it changed: the pod
        stays ready for the others while one member cannot serve, so its BMC's status has to say so."""
        for name, bmc in self.bmcs.items():
            report = bmc.serving_report()
            if report is None or self._reported.get(name) == report or name in self._reporting:
                continue
            machine = bmc.machine
            assert machine is not None
            self._reporting.add(name)
            task = asyncio.get_running_loop().create_task(self._report(name, machine, report))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _report(self, name: str, machine: Machine, report: tuple[bool, str]) -> None:
        try:
            await asyncio.to_thread(machine.report_serving, *report)
            self._reported[name] = report
        except Exception as exc:  # tried again at the next tick
            log.warning("pool: could not report member %s %s: %s", name, "serving" if report[0] else "not serving",
                        exc)
        finally:
            self._reporting.discard(name)

    def _check_listeners(self) -> None:
        """A dedicated agent whose listeners did not open stops (see the module's docstring)."""
        for bmc in self.bmcs.values():
            error = bmc.listener_error()
            if error:
                self.failed = error
                self.stop()

    def ready(self) -> bool:
        return self._ready

    def stop(self) -> None:
        """Stop serving, as SIGTERM does (from any thread: tests and benchmarks that run an agent in-process)."""
        loop, hook = self._loop, self._stop_hook
        if loop is not None and hook is not None:
            loop.call_soon_threadsafe(hook)

    # -- a pool's own port

    def metrics(self) -> str:
        bmcs = list(self.bmcs.values())
        failures, refused = dict(self._retired["failures"]), dict(self._retired["refused"])
        lockouts = sum(self._retired["lockouts"].values())
        sources = 0
        for b in bmcs:
            t = b.throttle
            for total, counts in ((failures, dict(t.failures_total)), (refused, dict(t.refused_total))):
                for label, n in counts.items():
                    total[label] = total.get(label, 0) + n
            lockouts += t.engaged_total
            sources += t.sources()
        serving = sum(1 for b in bmcs if b.serving())
        ready = sum(1 for b in bmcs if b.ready())
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
            "# TYPE kubevbmc_agent_pool_members gauge", f"kubevbmc_agent_pool_members {len(bmcs)}",
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
        return "\n".join(lines) + "\n" + stale_reads_metric()

    def _own_port_app(self) -> Any:
        metrics = self.metrics

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            if environ.get("PATH_INFO", "") == "/metrics":
                text = metrics().encode()
                start_response("200 OK", [("Content-Type", "text/plain; version=0.0.4"),
                                          ("Content-Length", str(len(text)))])
                return [text]
            from ..redfish.errors import not_found

            body = json.dumps(not_found(environ.get("PATH_INFO", "")).body()).encode()
            start_response("404 Not Found", [("Content-Type", "application/json"),
                                             ("Content-Length", str(len(body)))])
            return [body]

        return app

    # -- running

    async def run(self, source: Source) -> None:
        """Serve until SIGTERM/SIGINT (or stop()). `source()` starts what offers the BMCs (on the loop's thread,
        once the loop runs) and returns its stop. A pool with --redfish-address also serves its own port."""
        from hypercorn.asyncio.worker_context import WorkerContext

        loop = self._loop = asyncio.get_running_loop()
        loop.set_exception_handler(quiet_loop_errors)
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
        front: RedfishFront | None = None
        own: Listeners | None = None
        if self.settings.redfish_address:
            host, _, port = self.settings.redfish_address.rpartition(":")
            front = RedfishFront(self._own_port_app(), probes={"/healthz": lambda: True, "/readyz": self.ready},
                                 threads=1, body_timeout=self.server_config.body_timeout)
            own = await self.open_listeners(front, host.strip("[]") or "0.0.0.0", int(port), None,
                                            connection_slots(Limits().connections))
        stop_source = source()
        if self.pooled:
            log.info("pool: serving pool=%s/%s probes=%s members-on=%s backend=%s config=%s",
                     self.settings.namespace, self.settings.pool, self.settings.redfish_address,
                     self.settings.address, self.settings.backend, self.settings.source)
        try:
            while not stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), RECONCILE_INTERVAL)
                if stopping.is_set():
                    break
                changed.clear()
                try:
                    await self.reconcile()
                except Exception:  # a bug: logged, and the next tick tries again; the BMCs serve on
                    log.exception("%s: reconciling the BMCs failed", "pool" if self.pooled else "agent")
        finally:
            stop_source()
            bmcs = list(self.bmcs.values())
            await self._drain(bmcs)
            await self._context.terminated.set()
            await asyncio.gather(*([own.close()] if own is not None else []), *(b.close_listeners() for b in bmcs))
            if front is not None:
                front.close()
            stop_all(bmcs, STOP_DEADLINE)
            log.info("%s: stopped", "pool" if self.pooled else "agent")


    async def _drain(self, bmcs: Sequence[Bmc]) -> None:
        """Stop accepting, and give requests already on a worker thread `graceful_timeout` seconds to answer."""
        for bmc in bmcs:
            for listeners in (bmc.listeners, bmc.https):
                if listeners is not None:
                    listeners.stop_accepting()
        deadline = time.monotonic() + self.server_config.graceful_timeout
        while any(b.front is not None and b.front.queued for b in bmcs) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0)  # their answers are written before the connections close


def fixed_source(agent: Agent, specs: Sequence[BmcSpec]) -> Source:
    """A dedicated agent's one BMC, from its flags: offered once."""

    def start() -> Callable[[], None]:
        agent.offer_specs(specs)
        return lambda: None

    return start


def stop_all(bmcs: Sequence[Bmc], deadline: float) -> None:
    """Stop the BMCs together (each IPMI server takes up to a fraction of a second to stop: one after another, a
    hundred would outlast SIGTERM's two seconds)."""
    threads = [threading.Thread(target=b.stop, name=f"stop-{b.spec.name}", daemon=True) for b in bmcs]
    for t in threads:
        t.start()
    end = time.monotonic() + deadline
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))


# ---- werkzeug's URL builders, compiled on first use


def lazy_url_builders() -> None:
    """werkzeug compiles two URL-building functions per route when an app is created (Rule.compile); the Redfish
    app builds no URLs. Here each is compiled when first called instead (the same function as before), which
    takes a BMC's app from about 540 KB to 450 KB (PSS; werkzeug is pinned, and tests check that url_for still
    works)."""
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


def shared_rule_parts() -> None:
    """werkzeug parses every route of every app into parts (one per path segment: its text or regex, its weights)
    and a trace; a pool's members have the same routes but for their own System's name. Here each compiled rule
    takes the parts an earlier rule already has, equal in every field, and its trace's strings are interned, so the
    members share what they have in common ("redfish", "v1", "Systems", ...). werkzeug only reads them once a rule
    is compiled (the matcher, the URL builders); a part stays shared while a rule holds it (weak references)."""
    from werkzeug.routing.rules import Rule, RulePart

    if getattr(Rule, "_kubevbmc_shared_parts", False):
        return
    compile_rule = Rule.compile
    parts: weakref.WeakValueDictionary[Hashable, RulePart] = weakref.WeakValueDictionary()

    def compile(rule: Rule) -> None:
        compile_rule(rule)
        rule._parts = [_shared_part(parts, part) for part in rule._parts]
        rule._trace = [(dynamic, sys.intern(text)) for dynamic, text in rule._trace]

    Rule.compile = compile  # type: ignore[method-assign,assignment]
    Rule._kubevbmc_shared_parts = True  # type: ignore[attr-defined]


def _shared_part(parts: weakref.WeakValueDictionary[Hashable, Any], part: Any) -> Any:
    weight = part.weight
    key = (part.content, part.final, part.static, part.suffixed, weight.number_static_weights,
           tuple(weight.static_weights), weight.number_argument_weights, tuple(weight.argument_weights))
    shared = parts.get(key)
    if shared is None:
        parts[key] = shared = part
    return shared
