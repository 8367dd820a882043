"""The Redfish EventService behind the routes: subscriptions, where they are kept, and delivery.

Events come from the machine's bus (vbmc/machine/events.py). `event_record` turns a bus event into a Redfish event
record (ResourceEvent 1.4 messages, with the System or the VirtualMedia as OriginOfCondition); the bus's reasons without
a Redfish meaning (PowerAction, LoginThrottled, ...) are not sent.

Delivery: the bus calls `EventService.on_event` on the publisher's thread, which only appends the record to each
matching subscription's bounded queue (the oldest is dropped, with a log line, when a destination cannot keep up);
each subscription has its own thread that POSTs, retrying `DeliveryRetryAttempts` times `DeliveryRetryIntervalSeconds`
apart. When the retries are used up the subscription is suspended (DeliveryRetryPolicy SuspendRetries, the default
here: `Status.State` Disabled, its queue emptied, nothing more sent; a client resumes by subscribing again) or deleted
(TerminateAfterRetries), as DSP0266 and the EventDestination schema say; RetryForever keeps retrying at that interval,
RetryForeverWithBackoff doubles it after the retries, up to an hour (the queue still bounds what waits).

SSE: each `EventStream` is a bounded queue fed the same way; the server (vbmc/redfish/server.py) writes it out.

Subscriptions are kept by a `SubscriptionStore`: in memory (an agent without a VirtualMachineBMC), or in a Secret
the controller creates for the BMC (HttpHeaders may carry credentials), so they survive an agent restart."""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import urllib3

from ..machine.events import POWER_STATE_CHANGED, Event, EventBus

log = logging.getLogger("vbmc.eventservice")

REGISTRY = "ResourceEvent.1.4"
REGISTRY_PREFIXES = ("ResourceEvent",)
RESOURCE_TYPES = ("ComputerSystem", "VirtualMedia")
DELIVERY_RETRY_ATTEMPTS = 3
DELIVERY_RETRY_INTERVAL = 10  # seconds
MAX_SUBSCRIPTIONS = 16
MAX_STREAMS = 4  # each open SSE stream holds a connection and a queue
QUEUE_LENGTH = 128  # records waiting per destination or stream; the oldest goes first
POST_TIMEOUT = 5.0
SECRET_KEY = "subscriptions.json"
RETRY_POLICIES = ("SuspendRetries", "TerminateAfterRetries", "RetryForever", "RetryForeverWithBackoff")
FOREVER_POLICIES = ("RetryForever", "RetryForeverWithBackoff")
MAX_BACKOFF = 3600.0  # seconds: RetryForeverWithBackoff's longest wait
SSE_ENVIRON = "vbmc.sse"  # where the SSE route leaves its stream for the server (vbmc/redfish/server.py)

_POWER_MESSAGES = {
    "On": ("ResourcePoweredOn", "The resource '%1' has powered on."),
    "Off": ("ResourcePoweredOff", "The resource '%1' has powered off."),
    "PoweringOn": ("ResourcePoweringOn", "The resource '%1' is powering on."),
    "PoweringOff": ("ResourcePoweringOff", "The resource '%1' is powering off."),
    "Paused": ("ResourcePaused", "The resource '%1' was paused."),
}
_CHANGED = ("ResourceChanged", "One or more resource properties have changed.")
_SYSTEM_CHANGES = ("BootOverrideSet", "BootOverrideConsumed", "BootOverrideCleared", "IdentifyOn", "IdentifyOff")
_MEDIA_CHANGES = ("VirtualMediaInserted", "VirtualMediaEjected", "VirtualMediaImported")


@dataclass(frozen=True)
class Record:
    """One Redfish event record (Event.v1 EventRecord), before the Context of a subscription is added."""

    event_id: str
    timestamp: str  # ISO 8601, UTC
    message_id: str
    message: str
    args: tuple[str, ...]
    severity: str  # OK, Warning, Critical
    origin: str  # @odata.id of the OriginOfCondition
    resource_type: str  # schema name of the origin
    seq: int = 0  # the bus's number: the SSE id
    group_id: int | None = None  # EventGroupId, from SubmitTestEvent only

    @property
    def registry_prefix(self) -> str:
        return self.message_id.split(".", 1)[0]

    def entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"EventId": self.event_id, "EventTimestamp": self.timestamp, "MemberId": "0",
                "MessageId": self.message_id, "Message": self.message, "MessageArgs": list(self.args),
                "MessageSeverity": self.severity, "Severity": self.severity,
                "OriginOfCondition": {"@odata.id": self.origin}}
        if self.group_id is not None:
            entry["EventGroupId"] = self.group_id
        return entry


def iso_timestamp(epoch: float) -> str:
    millis = round(epoch * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(millis // 1000)) + f".{millis % 1000:03d}Z"


def event_record(event: Event, system: str, system_name: str, media_base: str) -> Record | None:
    """The Redfish record of a bus event, or None for one that has none. Pure."""
    stamp, seq = iso_timestamp(event.timestamp), event.seq
    if event.reason == POWER_STATE_CHANGED:
        found = _POWER_MESSAGES.get(event.detail.get("to", ""))
        if found is None:
            return None
        key, text = found
        return Record(str(seq), stamp, f"{REGISTRY}.{key}", text.replace("%1", system_name), (system_name,), "OK",
                      system, "ComputerSystem", seq)
    if event.reason in _SYSTEM_CHANGES:
        return Record(str(seq), stamp, f"{REGISTRY}.{_CHANGED[0]}", _CHANGED[1], (), "OK", system,
                      "ComputerSystem", seq)
    slot = event.detail.get("slot", "Cd")
    if event.reason in _MEDIA_CHANGES:
        return Record(str(seq), stamp, f"{REGISTRY}.{_CHANGED[0]}", _CHANGED[1], (), "OK", f"{media_base}/{slot}",
                      "VirtualMedia", seq)
    if event.reason == "VirtualMediaFailed":
        args = ("Image", event.message)
        return Record(str(seq), stamp, f"{REGISTRY}.ResourceErrorsDetected",
                      f"The resource property Image has detected errors of type '{event.message}'.", args, "Warning",
                      f"{media_base}/{slot}", "VirtualMedia", seq)
    return None


@dataclass
class Subscription:
    """An EventDestination, as stored (HttpHeaders included: the store is a Secret)."""

    id: str
    destination: str
    context: str = ""
    registry_prefixes: list[str] = field(default_factory=list)
    resource_types: list[str] = field(default_factory=list)
    origin_resources: list[str] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    verify_certificate: bool = True
    retry_policy: str = "SuspendRetries"  # one of RETRY_POLICIES
    state: str = "Enabled"  # Disabled: suspended after its retries were used up

    def matches(self, record: Record) -> bool:
        return matches(record, self.registry_prefixes, self.resource_types, self.origin_resources)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Subscription:
        known = {k: v for k, v in doc.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def matches(record: Record, prefixes: list[str], types: list[str], origins: list[str]) -> bool:
    """DSP0266 event filtering: each non-empty list must hold the record's value (an origin also covers what is
    under it)."""
    if prefixes and record.registry_prefix not in prefixes:
        return False
    if types and record.resource_type not in types:
        return False
    return not origins or any(record.origin == o or record.origin.startswith(o + "/") for o in origins)


def payload(record: Record, context: str) -> bytes:
    doc = {"@odata.type": "#Event.v1_13_0.Event", "Id": record.event_id, "Name": "KubeVBMC event",
           "Context": context, "Events": [record.entry()]}
    return json.dumps(doc, separators=(",", ":")).encode()


# ---- where subscriptions are kept


class SubscriptionStore(Protocol):
    def load(self) -> list[Subscription]: ...

    def save(self, subscriptions: list[Subscription]) -> None: ...


class MemoryStore:
    """An agent run by hand (no VirtualMachineBMC): the subscriptions go with the process."""

    def __init__(self) -> None:
        self.saved: list[Subscription] = []

    def load(self) -> list[Subscription]:
        return list(self.saved)

    def save(self, subscriptions: list[Subscription]) -> None:
        self.saved = list(subscriptions)


# ---- delivery


def _tls_context(verify: bool, ca_file: str) -> ssl.SSLContext:
    if not verify:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    context = ssl.create_default_context()
    if ca_file:
        context.load_verify_locations(cafile=ca_file)
    return context


class Deliverer:
    """One subscription's queue and thread."""

    def __init__(self, service: EventService, subscription: Subscription) -> None:
        self.service = service
        self.subscription = subscription
        self._queue: deque[Record] = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self.dropped = 0
        ctx = _tls_context(subscription.verify_certificate, service.ca_file)
        self._pool = urllib3.PoolManager(num_pools=2, maxsize=1, retries=False, ssl_context=ctx)
        self._thread = threading.Thread(target=self._run, name=f"event-delivery-{subscription.id}", daemon=True)
        self._thread.start()

    def put(self, record: Record) -> None:
        with self._cond:
            if self._stopped:
                return
            if len(self._queue) >= QUEUE_LENGTH:
                dropped = self._queue.popleft()
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 100 == 0:  # a line, not a flood of them
                    log.warning("eventservice: subscription %s: %d events waiting, the oldest dropped (event %s; %d "
                                "dropped so far)", self.subscription.id, QUEUE_LENGTH, dropped.event_id,
                                self.dropped)
            self._queue.append(record)
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._queue.clear()
            self._cond.notify()

    def _next(self) -> Record | None:
        with self._cond:
            while not self._queue and not self._stopped:
                self._cond.wait()
            return None if self._stopped else self._queue.popleft()

    def _run(self) -> None:
        while True:
            record = self._next()
            if record is None:
                break
            if not self._deliver(record):
                self.service.delivery_failed(self.subscription.id)
                break
        self._pool.clear()

    def _deliver(self, record: Record) -> bool:
        """POST one Event until it is taken; False when the retries allowed by the policy are used up."""
        sub, service = self.subscription, self.service
        body = payload(record, sub.context)
        headers = {**sub.headers, "Content-Type": "application/json"}
        forever = sub.retry_policy in FOREVER_POLICIES
        attempt = 0
        while True:
            try:
                resp = self._pool.request("POST", sub.destination, body=body, headers=headers,
                                          timeout=urllib3.Timeout(total=POST_TIMEOUT), redirect=False)
                if 200 <= resp.status < 300:
                    return True
                problem = f"HTTP {resp.status}"
            except Exception as exc:  # urllib3 errors, TLS verification failures: all a failed attempt
                problem = " ".join(str(exc).split())[:200]
            attempt += 1
            allowed = service.retry_attempts + 1
            if attempt <= allowed or attempt % 10 == 0:  # a policy that retries forever logs every tenth
                log.warning("eventservice: subscription %s: event %s to %s failed (attempt %d%s): %s", sub.id,
                            record.event_id, sub.destination, attempt, "" if forever else f" of {allowed}",
                            problem)
            if not forever and attempt >= allowed:
                return False
            with self._cond:
                self._cond.wait_for(lambda: self._stopped, timeout=retry_delay(
                    sub.retry_policy, attempt, service.retry_attempts, service.retry_interval))
                if self._stopped:
                    return True


def retry_delay(policy: str, failures: int, attempts: int, interval: float) -> float:
    """Seconds before the next attempt after `failures` failed ones: DeliveryRetryIntervalSeconds, except that
    RetryForeverWithBackoff doubles it after each failure past DeliveryRetryAttempts, up to MAX_BACKOFF."""
    if policy != "RetryForeverWithBackoff" or failures <= attempts:
        return interval
    return float(min(interval * 2 ** min(failures - attempts, 20), MAX_BACKOFF))


# ---- SSE


class EventStream:
    """One SSE client. Fed on the publisher's thread; read by the server (`drain` with a waker on its event loop,
    or as a blocking iterator under a plain WSGI server)."""

    def __init__(self, service: EventService, prefixes: list[str], types: list[str], origins: list[str],
                 keepalive: float) -> None:
        self.service = service
        self.filters = (prefixes, types, origins)
        self.keepalive = keepalive
        self._queue: deque[bytes] = deque(maxlen=QUEUE_LENGTH)
        self._cond = threading.Condition()
        self._closed = False
        self._waker: Callable[[], None] | None = None
        self._last_seq = 0
        self.dropped = 0

    def offer(self, record: Record) -> None:
        if not matches(record, *self.filters):
            return
        with self._cond:
            if self._closed or record.seq <= self._last_seq:
                return
            self._last_seq = record.seq
            if len(self._queue) == self._queue.maxlen:
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 100 == 0:
                    log.warning("eventservice: an SSE client is not reading; %d events dropped", self.dropped)
            self._queue.append(self.frame(record))
            self._cond.notify()
            waker = self._waker
        self._wake(waker)

    @staticmethod
    def frame(record: Record) -> bytes:
        return b"id: %d\ndata: %s\n\n" % (record.seq, payload(record, ""))

    def set_waker(self, waker: Callable[[], None]) -> None:
        with self._cond:
            self._waker = waker

    def drain(self) -> list[bytes]:
        with self._cond:
            out = list(self._queue)
            self._queue.clear()
            return out

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            waker = self._waker
        self.service.stream_closed(self)
        self._wake(waker)

    @staticmethod
    def _wake(waker: Callable[[], None] | None) -> None:
        if waker is None:
            return
        with contextlib.suppress(RuntimeError):  # the server's event loop has closed (shutdown): nobody to wake
            waker()

    def __iter__(self) -> Iterator[bytes]:
        """The blocking form, for a WSGI server that gives each request a thread (werkzeug in tests); a client
        that goes away is noticed at the next write (a keep-alive comment at the latest), which closes this."""
        try:
            yield b": stream open\n\n"
            while True:
                with self._cond:
                    if not self._queue and not self._closed:
                        self._cond.wait(self.keepalive)
                    if self._closed:
                        return
                    chunks = list(self._queue)
                    self._queue.clear()
                yield b"".join(chunks) if chunks else b": keep-alive\n\n"
        finally:
            self.close()


# ---- the service


class EventService:
    def __init__(self, bus: EventBus, *, system: str, system_name: str, media_base: str,
                 store: SubscriptionStore | None = None, retry_attempts: int = DELIVERY_RETRY_ATTEMPTS,
                 retry_interval: float = DELIVERY_RETRY_INTERVAL, ca_file: str = "", keepalive: float = 15.0,
                 max_streams: int = MAX_STREAMS) -> None:
        self.bus = bus
        self.system, self.system_name, self.media_base = system, system_name, media_base
        self.store: SubscriptionStore = store if store is not None else MemoryStore()
        self.retry_attempts = retry_attempts
        self.retry_interval = retry_interval
        self.ca_file = ca_file
        self.keepalive = keepalive
        self.max_streams = max_streams
        self._lock = threading.RLock()
        self._writing = threading.Lock()
        self._subs: dict[str, Subscription] = {}
        self._deliverers: dict[str, Deliverer] = {}
        self._streams: set[EventStream] = set()
        self._unsubscribe: Callable[[], None] | None = None
        self._loaded = False
        self._load_failures = 0
        self._closed = threading.Event()

    def start(self) -> None:
        self._unsubscribe = self.bus.subscribe(self.on_event)
        if not self.reload():
            # The store did not answer (the API server, or a Secret not created yet): keep trying in the background,
            # so that stored subscriptions get their events without waiting for a request about them.
            threading.Thread(target=self._load_until_done, name="event-subscriptions-load", daemon=True).start()

    def _load_until_done(self) -> None:
        while not self._closed.wait(2.0):
            if self._loaded or self.reload():
                return

    def reload(self) -> bool:
        """Read the subscriptions from the store; False (and retried at the next call) when it cannot answer."""
        try:
            subs = self.store.load()
        except Exception as exc:
            self._load_failures += 1
            if self._load_failures % 30 == 1:  # the first failure, then one line a minute from the retry loop
                log.warning("eventservice: cannot read the subscriptions yet (%d attempts): %s", self._load_failures,
                            exc)
            return False
        with self._lock:
            if self._loaded:
                return True
            for sub in subs:
                if sub.id not in self._subs:
                    self._subs[sub.id] = sub
                    if sub.state == "Enabled":
                        self._deliverers[sub.id] = Deliverer(self, sub)
            self._loaded = True
        return True

    def ensure_loaded(self) -> None:
        """Before any answer about subscriptions: the store must have been read (else 503, by the caller)."""
        if not self._loaded and not self.reload():
            raise StoreUnavailable("the subscriptions cannot be read from the cluster yet")

    def close(self) -> None:
        self._closed.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
        with self._lock:
            deliverers, streams = list(self._deliverers.values()), list(self._streams)
            self._deliverers.clear()
        for d in deliverers:
            d.stop()
        for s in streams:
            s.close()

    # ---- events

    def record_of(self, event: Event) -> Record | None:
        return event_record(event, self.system, self.system_name, self.media_base)

    def on_event(self, event: Event) -> None:
        record = self.record_of(event)
        if record is not None:
            self.dispatch(record)

    def dispatch(self, record: Record) -> None:
        with self._lock:
            targets = [(self._subs[i], d) for i, d in self._deliverers.items() if i in self._subs]
            streams = list(self._streams)
        for sub, deliverer in targets:
            if sub.matches(record):
                deliverer.put(record)
        for stream in streams:
            stream.offer(record)

    def test_record(self, message_id: str, message: str, args: list[str], severity: str, origin: str,
                    event_id: str, timestamp: str, group_id: int | None = None) -> Record:
        """A SubmitTestEvent record: what the client gave, the rest filled in."""
        return Record(event_id or f"test-{secrets.token_hex(4)}", timestamp or iso_timestamp(time.time()),
                      message_id, message, tuple(args), severity, origin or self.system,
                      "VirtualMedia" if origin.startswith(self.media_base) else "ComputerSystem", 0, group_id)

    def submit_test(self, record: Record) -> None:
        """SubmitTestEvent: to every enabled subscription whose filters pass it (not to SSE streams: the bus
        numbers their ids)."""
        with self._lock:
            targets = [(self._subs[i], d) for i, d in self._deliverers.items() if i in self._subs]
        for sub, deliverer in targets:
            if sub.matches(record):
                deliverer.put(record)

    # ---- subscriptions
    #
    # `_lock` guards the in-memory state and is never held across I/O (the publisher's thread takes it to dispatch);
    # `_writing` orders the writes to the store, each of which is the whole list after one change.

    def subscriptions(self) -> list[Subscription]:
        self.ensure_loaded()
        with self._lock:
            return sorted(self._subs.values(), key=lambda s: s.id)

    def get(self, sub_id: str) -> Subscription | None:
        self.ensure_loaded()
        with self._lock:
            return self._subs.get(sub_id)

    def _store(self, change: Callable[[dict[str, Subscription]], None]) -> None:
        """Apply `change` to a copy of the subscriptions, store the result, then make it the current state (on a
        failure nothing changes)."""
        with self._writing:
            with self._lock:
                subs = {k: Subscription(**asdict(v)) for k, v in self._subs.items()}
            change(subs)
            self.store.save(sorted(subs.values(), key=lambda s: s.id))
            with self._lock:
                for sub_id in list(self._subs):
                    if sub_id not in subs:
                        del self._subs[sub_id]
                        deliverer = self._deliverers.pop(sub_id, None)
                        if deliverer is not None:
                            deliverer.stop()
                for sub_id, sub in subs.items():
                    current = self._subs.get(sub_id)
                    if current is None:
                        self._subs[sub_id] = sub
                        if sub.state == "Enabled":
                            self._deliverers[sub_id] = Deliverer(self, sub)
                    else:  # the same object stays: its Deliverer holds it
                        current.context, current.state = sub.context, sub.state
                        if current.state != "Enabled":
                            deliverer = self._deliverers.pop(sub_id, None)
                            if deliverer is not None:
                                deliverer.stop()

    def create(self, sub: Subscription) -> Subscription:
        self.ensure_loaded()

        def add(subs: dict[str, Subscription]) -> None:
            if len(subs) >= MAX_SUBSCRIPTIONS:
                raise TooMany(f"this BMC keeps at most {MAX_SUBSCRIPTIONS} subscriptions")
            sub.id = secrets.token_hex(4)
            while sub.id in subs:
                sub.id = secrets.token_hex(4)
            subs[sub.id] = sub

        self._store(add)
        log.info("eventservice: subscription %s to %s created", sub.id, sub.destination)
        return sub

    def delete(self, sub_id: str) -> bool:
        self.ensure_loaded()
        found = False

        def remove(subs: dict[str, Subscription]) -> None:
            nonlocal found
            found = subs.pop(sub_id, None) is not None

        self._store(remove)
        if found:
            log.info("eventservice: subscription %s deleted", sub_id)
        return found

    def update(self, sub_id: str, context: str) -> Subscription | None:
        """PATCH of Context (the one property a client may change; a suspended subscription is resumed by
        creating it again)."""
        self.ensure_loaded()

        def change(subs: dict[str, Subscription]) -> None:
            if sub_id in subs:
                subs[sub_id].context = context

        self._store(change)
        return self.get(sub_id)

    def delivery_failed(self, sub_id: str) -> None:
        """A destination that failed every retry: suspended or terminated by its DeliveryRetryPolicy (on the
        deliverer's own thread)."""
        with self._lock:
            sub = self._subs.get(sub_id)
            deliverer = self._deliverers.pop(sub_id, None)
        if deliverer is not None:
            deliverer.stop()
        if sub is None:
            return
        terminate = sub.retry_policy == "TerminateAfterRetries"

        def change(subs: dict[str, Subscription]) -> None:
            if terminate:
                subs.pop(sub_id, None)
            elif sub_id in subs:
                subs[sub_id].state = "Disabled"

        try:
            self._store(change)
        except Exception as exc:
            # Not delivering either way; the stored state says Enabled until the next write succeeds.
            log.error("eventservice: subscription %s: cannot store its new state: %s", sub_id, exc)
            with self._lock:
                if terminate:
                    self._subs.pop(sub_id, None)
                elif sub_id in self._subs:
                    self._subs[sub_id].state = "Disabled"
        what = "terminated (deleted)" if terminate else "suspended (Status.State Disabled)"
        log.warning("eventservice: subscription %s to %s %s after %d retries", sub_id, sub.destination, what,
                    self.retry_attempts)

    # ---- SSE streams

    def open_stream(self, prefixes: list[str], types: list[str], origins: list[str],
                    last_event_id: int | None) -> EventStream | None:
        """A new SSE stream, caught up from the bus's history after `last_event_id`; None when `max_streams` are
        open already."""
        stream = EventStream(self, prefixes, types, origins, self.keepalive)
        with self._lock:
            if len(self._streams) >= self.max_streams:
                return None
            self._streams.add(stream)
            # Under the lock: an event published from now on is dispatched after these, and one already in the
            # history is offered twice at most, the second time dropped (the stream skips ids it has sent).
            if last_event_id is not None:
                if last_event_id > self.bus.last_seq:
                    last_event_id = 0  # an id from before this process started (ids restart at 1): replay all
                for event in self.bus.since(last_event_id):
                    record = self.record_of(event)
                    if record is not None:
                        stream.offer(record)
        return stream

    def stream_closed(self, stream: EventStream) -> None:
        with self._lock:
            self._streams.discard(stream)

    @property
    def open_streams(self) -> int:
        with self._lock:
            return len(self._streams)


class StoreUnavailable(Exception):
    pass


class TooMany(Exception):
    pass
