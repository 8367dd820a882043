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
from .caches import Caches
from .events import EventRecorder
from .informer import Key
from .kubeapi import MERGE_PATCH, ApiError, KubeApi, connect
from .reconciler import Reconciler
from .settings import Settings
from .workqueue import WorkQueue

log = logging.getLogger("controller")


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
            key: Key = item  # type: ignore[assignment]
            began = time.monotonic()
            try:
                result = self.reconciler.reconcile(key)
            except Exception as exc:
                metrics.reconcile_errors.inc()
                metrics.reconciles.labels("error").inc()
                delay = self.queue.add_rate_limited(key)
                level = logging.WARNING if isinstance(exc, ApiError) else logging.ERROR
                log.log(level, "reconcile %s/%s failed (retry in %.2fs): %s", *key, delay, exc,
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
        from kubernetes.leaderelection import electionconfig, leaderelection
        from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

        logging.getLogger("leaderelection").setLevel(logging.WARNING)
        # LeaseLock uses the default configuration: make it this client's.
        client.Configuration.set_default(self.api_client.configuration)
        s = self.settings
        self.identity = f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
        lock = LeaseLock(s.lease_name, s.lease_namespace, self.identity)

        def stopped_leading() -> None:
            metrics.leader.set(0)
            if not self.stop_event.is_set():
                log.error("lost the leader Lease %s/%s; exiting", s.lease_namespace, s.lease_name)
                self.lost_lease = True
                self.stop_event.set()

        config = electionconfig.Config(lock, s.lease_duration, s.renew_deadline, s.retry_period,
                                       self.run_controllers, stopped_leading)
        log.info("waiting for the leader Lease %s/%s as %s", s.lease_namespace, s.lease_name, self.identity)
        leaderelection.LeaderElection(config).run()

    def release_lease(self) -> None:
        """Hand the Lease back on a clean stop, so a new replica takes over at once instead of after it expires."""
        s = self.settings
        path = f"/apis/coordination.k8s.io/v1/namespaces/{s.lease_namespace}/leases/{s.lease_name}"
        try:
            lease = self.api.request("GET", path)
            if (lease.get("spec") or {}).get("holderIdentity") == getattr(self, "identity", None):
                self.api.request("PATCH", path, {"metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
                                                 "spec": {"holderIdentity": None}}, content_type=MERGE_PATCH)
                log.info("released the leader Lease")
        except ApiError as exc:
            log.warning("could not release the leader Lease: %s", exc)


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
    target = manager.run_with_leader_election if settings.leader_elect else manager.run_controllers
    threading.Thread(target=target, name="controller", daemon=True).start()
    manager.stop_event.wait()
    log.info("stopping")
    if manager.leading.is_set():
        manager.finished.wait(10)
    manager.recorder.stop()
    if settings.leader_elect and not getattr(manager, "lost_lease", False):
        manager.release_lease()
    server.shutdown()
    sys.stdout.flush()
    return 1 if getattr(manager, "lost_lease", False) else 0
