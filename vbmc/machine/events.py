"""What happened to a machine, as one stream of events that every frontend can follow.

A Machine owns one `EventBus` (`Machine.events`). Two sources publish to it:
- actions: the backend's `record_event(reason, message)` (BootOverrideSet, BootOverrideConsumed, VirtualMediaInserted,
  VirtualMediaEjected, PowerAction, RunStrategyManual, LoginThrottled...), the same reasons as its Kubernetes Events;
- observations: `Machine.notify_changed()`, which a backend calls whenever its view of the machine may have changed
  (a watch event, a write), publishes PowerStateChanged when the power state differs from the last one seen,
  whoever caused the change (the BMC, kubectl, the guest). Other observed changes (an import that completed or
  failed) are published by the backend that observes them, with their own reason.

Consumers (the Redfish EventService, the IPMI SEL) subscribe with a callback, called on the publishing thread: a
consumer that does I/O hands the event to its own thread. The bus keeps the last `history` events, numbered, so a
consumer that starts late (or an SSE client resuming with Last-Event-ID) can catch up with `since`."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("vbmc.events")

POWER_STATE_CHANGED = "PowerStateChanged"
# The BMC itself was reset (Redfish Manager.Reset): every frontend ends its sessions.
MANAGER_RESET = "ManagerReset"


@dataclass(frozen=True)
class Event:
    seq: int  # 1, 2, ... in publication order, per bus
    reason: str  # CamelCase, as a Kubernetes Event's reason
    message: str
    kind: str = "Normal"  # or Warning
    timestamp: float = 0.0  # time.time() when published
    detail: dict[str, str] = field(default_factory=dict)  # e.g. {"from": "Off", "to": "On"}, {"slot": "Cd"}


Listener = Callable[[Event], None]


class EventBus:
    def __init__(self, history: int = 512, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self._history: deque[Event] = deque(maxlen=history)
        self._seq = 0
        self._clock = clock

    def publish(self, reason: str, message: str, kind: str = "Normal", **detail: str) -> Event:
        with self._lock:
            self._seq += 1
            event = Event(self._seq, reason, message, kind, self._clock(), dict(detail))
            self._history.append(event)
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(event)
            except Exception:
                log.exception("event listener failed on %s", reason)
        return event

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call `listener` for every event published from now on; returns the function that unsubscribes."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def since(self, seq: int) -> list[Event]:
        """The events still in the history that were published after event `seq` (0: all of them)."""
        with self._lock:
            return [e for e in self._history if e.seq > seq]

    @property
    def last_seq(self) -> int:
        return self._seq
