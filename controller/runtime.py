"""What feeds `reconcile`: caches and their events, the work queue, workers, periodic resync, leader election
on a Lease, `/metrics`, `/healthz`, `/readyz`, and a graceful stop on SIGTERM."""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kubernetes import client
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import metrics
from .caches import BMCS, Caches, PoolKey
from .events import EventRecorder
from .informer import Key
from .kubeapi import ApiError, KubeApi, connect
from .leader import LeaderElector
from .reconciler import Reconciler
from .settings import Settings
from .workqueue import WorkQueue

log = logging.getLogger("controller")

CRD_NAME = f"{BMCS.plural}.{BMCS.group}"
CRD_FILE = "controller/crds/bmc.kubevirt.io_virtualmachinebmcs.yaml"
MISSING_CRD = f"CustomResourceDefinition {CRD_NAME} not found: kubectl apply -f {CRD_FILE}"
CRD_WAIT_SECONDS = 10.0


class Manager:
    def __init__(self, settings: Settings, api_client: client.ApiClient) -> None:
        self.settings = settings
        self.api_client = api_client
        self.api = KubeApi(api_client, on_write=lambda verb, _path: metrics.api_writes.labels(verb).inc())
        self.queue = WorkQueue()
        self.caches = Caches(self.api, settings.namespace, self.queue.add)
        self.recorder = EventRecorder(self.api)
        self.reconciler = Reconciler(self.api, self.caches, settings, self.recorder)
        self.stop_event = threading.Event()
        self.leading = threading.Event()
        self.finished = threading.Event()
        self.lost_lease = False  # the Lease was taken: exit 1 without releasing it
        self.failed = False  # the controllers raised: exit 1
        self.elector: LeaderElector | None = None
        metrics.queue_depth.set_function(lambda: len(self.queue))
        metrics.bmcs_ready.set_function(self._count_ready)
        metrics.bmcs_total.set_function(lambda: len(self.caches.bmcs.list()))

    def _count_ready(self) -> int:
        return sum(1 for b in self.caches.bmcs.list()
                   if any(c.get("type") == "Ready" and c.get("status") == "True"
                          for c in (b.get("status") or {}).get("conditions") or []))

    @property
    def ready(self) -> bool:
        """A standby replica is ready (it waits for the Lease); a leader once its caches are synced."""
        return not self.leading.is_set() or self.caches.synced

    # ---- running

    def run_controllers(self) -> None:
        """Caches, then workers and resync, until `stop_event`."""
        self.leading.set()
        metrics.leader.set(1)
        try:
            while not self.caches.start(timeout=30):
                if self.stop_event.is_set():
                    return
                log.warning("caches not synced after 30s; still waiting")
            log.info("caches synced: %d VirtualMachineBMCs", len(self.caches.bmcs.list()))
            self._enqueue_all()
            workers = [threading.Thread(target=self._worker, name=f"worker-{i}", daemon=True)
                       for i in range(self.settings.workers)]
            for w in workers:
                w.start()
            while not self.stop_event.wait(self.settings.resync_seconds):
                self._enqueue_all()
            self.queue.shutdown()
            deadline = time.monotonic() + 5
            for w in workers:
                w.join(max(0.0, deadline - time.monotonic()))
            self.caches.stop()
        except Exception:
            # Holding the Lease without working would keep every standby waiting: stop, and let one take over.
            log.exception("the controllers failed; exiting")
            self.failed = True
            self.stop_event.set()
        finally:
            self.finished.set()

    def _enqueue_all(self) -> None:
        for bmc in self.caches.bmcs.list():
            self.queue.add((bmc["metadata"]["namespace"], bmc["metadata"]["name"]))

    def _worker(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            key: Key | PoolKey = item  # type: ignore[assignment]
            began = time.monotonic()
            try:
                result = self.reconciler.reconcile(key)
            except Exception as exc:
                metrics.reconcile_errors.inc()
                metrics.reconciles.labels("error").inc()
                delay = self.queue.add_rate_limited(key)
                # WARNING means an operator should look: an object deleted or changed while it was reconciled is
                # the normal run of things, retried (the next pass sees it as it is now).
                level = (logging.DEBUG if isinstance(exc, ApiError) and exc.routine
                         else logging.WARNING if isinstance(exc, ApiError) else logging.ERROR)
                log.log(level, "reconcile %s failed (retry in %.2fs): %s", _shown(key), delay, exc,
                        exc_info=not isinstance(exc, ApiError))
            else:
                self.queue.forget(key)
                if result.requeue_after:
                    metrics.reconciles.labels("requeue").inc()
                    self.queue.add_after(key, result.requeue_after)
                else:
                    metrics.reconciles.labels("success").inc()
            finally:
                metrics.reconcile_duration.observe(time.monotonic() - began)
                self.queue.done(key)

    # ---- leader election

    def run_with_leader_election(self) -> None:
        """Wait for the Lease, then run the controllers while renewing it; a lost Lease stops the process."""
        s = self.settings
        # Its own KubeApi: Lease renewals are not the reconcile writes kubevbmc_controller_api_writes_total counts.
        self.elector = LeaderElector(KubeApi(self.api_client), s.lease_namespace, s.lease_name,
                                     f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}",
                                     s.lease_duration, s.renew_deadline, s.retry_period)
        if not self.elector.acquire(self.stop_event):
            return
        threading.Thread(target=self.run_controllers, name="controllers", daemon=True).start()
        if not self.elector.renew(self.stop_event):
            metrics.leader.set(0)
            log.error("lost the leader Lease %s; exiting", self.elector.where)
            self.lost_lease = True
            self.stop_event.set()

    def release_lease(self) -> None:
        """Hand the Lease back on a clean stop, so a standby takes over at once instead of after it expires."""
        if self.elector is not None and self.elector.release():
            metrics.leader.set(0)


def _shown(key: Key | PoolKey) -> str:
    return f"pool {key.namespace}/{key.pool}" if isinstance(key, PoolKey) else "/".join(key)


def wait_for_crd(api: KubeApi, stop: threading.Event, timeout: float = CRD_WAIT_SECONDS) -> bool:
    """Whether the API server serves VirtualMachineBMCs, asking through discovery (every authenticated user may)
    for up to `timeout` seconds: a CRD applied together with the controller gets a moment to be established.

    Without the CRD the controller exits non-zero, as a controller-runtime manager does (its Kind source fails
    after the cache sync timeout with "no matches for kind"): the pod restarts and its status shows why, where a
    controller waiting in silence would look healthy."""
    deadline = time.monotonic() + timeout
    said = ""
    while True:
        try:
            served = api.request("GET", f"/apis/{BMCS.group}/{BMCS.version}", timeout=5)
        except ApiError as exc:
            problem = MISSING_CRD if exc.status == 404 else f"cannot tell whether {CRD_NAME} is installed: {exc}"
        else:
            problem = "" if any(r.get("name") == BMCS.plural for r in served.get("resources") or []) else MISSING_CRD
        if not problem:
            if said:
                log.info("CustomResourceDefinition %s is served", CRD_NAME)
            return True
        if problem != said:
            log.error("%s (waiting up to %.0fs)", problem, timeout)
            said = problem
        if stop.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
            return False
        if time.monotonic() >= deadline:
            log.error("%s; exiting", problem)
            return False


class _Probes(BaseHTTPRequestHandler):
    manager: Manager

    def do_GET(self) -> None:
        if self.path == "/metrics":
            code, body, ctype = 200, generate_latest(metrics.registry), CONTENT_TYPE_LATEST
        elif self.path == "/healthz":
            code, body, ctype = 200, b"ok\n", "text/plain"
        elif self.path == "/readyz":
            ok = self.manager.ready
            code, body, ctype = (200 if ok else 503), (b"ok\n" if ok else b"caches not synced\n"), "text/plain"
        else:
            code, body, ctype = 404, b"not found\n", "text/plain"
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_probes(manager: Manager, address: str) -> ThreadingHTTPServer:
    host, _, port = address.rpartition(":")
    handler = type("Probes", (_Probes,), {"manager": manager})
    server = ThreadingHTTPServer((host or "0.0.0.0", int(port)), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="probes", daemon=True).start()
    return server


def run(settings: Settings, kubeconfig: str) -> int:
    manager = Manager(settings, connect(kubeconfig))
    server = serve_probes(manager, settings.metrics_address)
    host, port = str(server.server_address[0]), int(server.server_address[1])
    print(f"metrics: http://{host}:{port}/metrics", flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: manager.stop_event.set())
    if not wait_for_crd(manager.api, manager.stop_event):
        server.shutdown()
        return 0 if manager.stop_event.is_set() else 1
    target = manager.run_with_leader_election if settings.leader_elect else manager.run_controllers
    main_loop = threading.Thread(target=target, name="controller", daemon=True)
    main_loop.start()
    # With a timeout: a signal the kernel delivers to another thread leaves a main thread blocked on a lock
    # asleep, and Python runs the handler only once the main thread wakes.
    while not manager.stop_event.wait(0.5):
        pass
    log.info("stopping")
    if manager.leading.is_set():
        manager.finished.wait(10)
    manager.recorder.stop()
    if settings.leader_elect and not manager.lost_lease:
        # Renewals stop with stop_event; one still in flight would race the release.
        main_loop.join(timeout=settings.renew_deadline)
        manager.release_lease()
    server.shutdown()
    sys.stdout.flush()
    return 1 if manager.lost_lease or manager.failed else 0
