"""Leader election on a coordination.k8s.io Lease, as client-go's leaderelection package does it.

- A candidate reads the Lease every retry period. It takes the Lease when the Lease does not exist, when its
  holder is empty (a released Lease) or when the record has not changed for a whole lease duration, measured on
  the candidate's own clock from when it last saw the record change (client-go's observedTime: no clock skew).
- The leader renews every retry period; when no renewal succeeds for the renew deadline it has lost the Lease.
- On a clean stop the leader releases the Lease as client-go's ReleaseOnCancel does: holderIdentity "" and
  leaseDurationSeconds 1, written with the resourceVersion it last saw (a Lease someone else took is left alone),
  so the next candidate takes over on its next read instead of after the lease duration.
- A Lease that cannot be read or written (Forbidden, a missing namespace, an unreachable API server) is logged at
  WARNING with the Lease's namespace/name and the API's reason, again when the reason changes and every minute
  while it lasts: a wrong --lease-name or missing RBAC must not wait in silence.

The official Python client's leaderelection module cannot be stopped (its loops sleep and never look at a stop
signal, so it kept renewing while the controller released), logs failures at INFO and dies on a connection error.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .kubeapi import ApiError, KubeApi, Obj

log = logging.getLogger("controller.leader")

WARN_EVERY = 60.0  # seconds between repeated warnings about the same failure


@dataclass(frozen=True)
class Record:
    """The leader election fields of a Lease's spec."""

    holder: str = ""
    duration: int = 0
    acquire_time: str | None = None
    renew_time: str | None = None
    transitions: int = 0


def record_of(lease: Obj) -> Record:
    spec = lease.get("spec") or {}
    return Record(str(spec.get("holderIdentity") or ""), int(spec.get("leaseDurationSeconds") or 0),
                  spec.get("acquireTime"), spec.get("renewTime"), int(spec.get("leaseTransitions") or 0))


def spec_of(record: Record) -> Obj:
    return {"holderIdentity": record.holder, "leaseDurationSeconds": record.duration,
            "acquireTime": record.acquire_time, "renewTime": record.renew_time,
            "leaseTransitions": record.transitions}


def to_lead(current: Record | None, identity: str, now: str, duration: int, expired: bool) -> Record | None:
    """The record `identity` writes to take or keep the Lease, or None while another holder's lease is valid.

    `expired`: the current record has not changed for a whole lease duration (as this candidate observed it)."""
    if current is None:
        return Record(identity, duration, now, now, 0)
    if current.holder == identity:
        return Record(identity, duration, current.acquire_time or now, now, current.transitions)
    if current.holder and not expired:
        return None
    return Record(identity, duration, now, now, current.transitions + 1)


def released(current: Record, now: str) -> Record:
    """client-go's release: no holder, a one-second lease, the transitions count kept."""
    return Record("", 1, now, now, current.transitions)


def micro_time(at: datetime.datetime) -> str:
    """metav1.MicroTime's RFC 3339 form."""
    return at.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(self, api: KubeApi, namespace: str, name: str, identity: str, lease_duration: float,
                 renew_deadline: float, retry_period: float,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC)) -> None:
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.lease_duration, self.renew_deadline, self.retry_period = lease_duration, renew_deadline, retry_period
        self.clock, self.wall_clock = clock, wall_clock
        self.lease: Obj | None = None  # the Lease as last read or written
        self.observed: Record | None = None
        self.observed_at = 0.0
        self.leading = False
        self._trouble = ""
        self._warned_at = 0.0
        # A request must not outlast a renewal round (client-go bounds each one by the renew deadline).
        self.request_timeout = max(1.0, min(renew_deadline, lease_duration) / 2)

    @property
    def where(self) -> str:
        return f"{self.namespace}/{self.name}"

    def _path(self, name: str = "") -> str:
        return f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases" + (f"/{name}" if name else "")

    # ---- one attempt

    def try_acquire_or_renew(self) -> bool:
        try:
            lease: Obj | None = self.api.request("GET", self._path(self.name), timeout=self.request_timeout)
        except ApiError as exc:
            if exc.status != 404:
                self._failed("read", exc)
                return False
            lease = None
        now = micro_time(self.wall_clock())
        if lease is None:
            record = to_lead(None, self.identity, now, int(self.lease_duration), expired=True)
            assert record is not None
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": self.name},
                    "spec": spec_of(record)}
            return self._write("create", "POST", self._path(), body, record)
        current = record_of(lease)
        if current != self.observed:
            if self.observed is not None and current.holder != self.observed.holder and current.holder:
                log.info("leader Lease %s is held by %s", self.where, current.holder)
            self.observed, self.observed_at = current, self.clock()
        self._recovered()
        expired = self.clock() >= self.observed_at + self.lease_duration
        record = to_lead(current, self.identity, now, int(self.lease_duration), expired)
        if record is None:
            return False
        body = {**lease, "spec": {**(lease.get("spec") or {}), **spec_of(record)}}
        return self._write("update", "PUT", self._path(self.name), body, record)

    def _write(self, verb: str, method: str, path: str, body: Obj, record: Record) -> bool:
        try:
            self.lease = self.api.request(method, path, body, timeout=self.request_timeout)
        except ApiError as exc:
            if exc.status == 409:  # another candidate wrote first: the next read tells who leads
                log.debug("leader Lease %s: %s lost a race: %s", self.where, verb, exc)
            else:
                self._failed(verb, exc)
            return False
        self._recovered()
        self.observed, self.observed_at = record, self.clock()
        return True

    def _failed(self, verb: str, exc: ApiError) -> None:
        trouble = f"cannot {verb} the leader Lease {self.where}: {exc.status} {exc.reason}: {exc.message}"
        now = self.clock()
        if trouble != self._trouble or now - self._warned_at >= WARN_EVERY:
            log.warning("%s", trouble)
            self._warned_at = now
        self._trouble = trouble

    def _recovered(self) -> None:
        if self._trouble:
            log.info("the leader Lease %s can be read and written again", self.where)
            self._trouble = ""

    # ---- the loops

    def acquire(self, stop: threading.Event) -> bool:
        """Try every retry period until this candidate holds the Lease (True) or `stop` is set (False)."""
        log.info("waiting for the leader Lease %s as %s", self.where, self.identity)
        while not stop.is_set():
            if self.try_acquire_or_renew():
                self.leading = True
                log.info("became the leader: holding the Lease %s as %s", self.where, self.identity)
                return True
            stop.wait(self.retry_period)
        return False

    def renew(self, stop: threading.Event) -> bool:
        """Renew every retry period until `stop` (True), or until no renewal succeeded within the renew deadline:
        the Lease is lost (False)."""
        while not stop.wait(self.retry_period):
            deadline = self.clock() + self.renew_deadline
            while not self.try_acquire_or_renew():
                if stop.is_set():
                    return True
                if self.clock() >= deadline:
                    self.leading = False
                    return False
                stop.wait(min(self.retry_period, max(0.0, deadline - self.clock())))
        return True

    def release(self) -> bool:
        """Hand the Lease back (see the module's doc). Call it once renewals have stopped."""
        if not self.leading or self.lease is None or record_of(self.lease).holder != self.identity:
            return False
        self.leading = False
        record = released(record_of(self.lease), micro_time(self.wall_clock()))
        body = {**self.lease, "spec": {**(self.lease.get("spec") or {}), **spec_of(record)}}
        try:
            self.lease = self.api.request("PUT", self._path(self.name), body, timeout=self.request_timeout)
        except ApiError as exc:
            log.warning("could not release the leader Lease %s: %s", self.where, exc)
            return False
        log.info("released the leader Lease %s", self.where)
        return True
