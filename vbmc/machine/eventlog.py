"""The system event log: the record of what happened to a machine that a BMC keeps, one record with two views
(IPMI's SEL, vbmc/ipmi/sel.py; Redfish's LogService "SEL", vbmc/redfish/logs.py).

It follows the machine's event bus (vbmc/machine/events.py) and keeps the events a physical BMC's SEL keeps: where
power went (not the way there: PoweringOn and PoweringOff are not logged), boot overrides set, cleared and
consumed, media inserted, ejected, imported and failed. A client may add entries of its own (IPMI Add SEL Entry:
16 raw bytes). Record IDs run 1 to FFFEh and wrap (IPMI reserves 0000h and FFFFh). The log holds `capacity`
records; when full it logs no more and says so (`overflow`), as a physical BMC does until someone clears it.

Its clock is the BMC's SEL clock: the machine's time, moved by IPMI Set SEL Time; every record is stamped with it
when logged. Thread-safe: the bus publishes on other threads.

Kept beyond the process by its `keeper` (vbmc/access/keeping.py; the agent's writes it to a ConfigMap): told of every
record, clear and overflow, and asked to settle by the frontends before a client reads the log (`settle`). What it
reads back becomes the log with `adopt`, which also merges what was logged here meanwhile (see there). The SEL
clock's offset (Set SEL Time) is not kept: a new process starts on the machine's time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..access.keeping import NOT_KEPT, Keeper
from .events import POWER_STATE_CHANGED, Event, EventBus

CAPACITY = 256
NEVER = 0xFFFFFFFF  # IPMI's "unspecified" timestamp: no addition, no erase yet
# The reasons the log keeps, besides power reaching a state.
LOGGED = frozenset(("BootOverrideSet", "BootOverrideCleared", "BootOverrideConsumed", "VirtualMediaInserted",
                    "VirtualMediaEjected", "VirtualMediaImported", "VirtualMediaFailed"))
LOGGED_POWER = frozenset(("On", "Off", "Paused"))


def logged(event: Event) -> bool:
    """Whether the system event log keeps `event`."""
    if event.reason == POWER_STATE_CHANGED:
        return event.detail.get("to", "") in LOGGED_POWER
    return event.reason in LOGGED


@dataclass(frozen=True)
class LogRecord:
    record_id: int
    stamp: int  # seconds on the SEL clock when logged
    reason: str  # the bus event's reason; "" for an entry a client added
    message: str
    kind: str = "Normal"  # or Warning
    detail: dict[str, str] = field(default_factory=dict)
    raw: bytes = b""  # the 16 bytes a client added (IPMI Add SEL Entry), with the log's record ID and stamp


def next_record_id(record_id: int) -> int:
    """IPMI's record IDs run 1 to FFFEh and wrap (0000h and FFFFh are reserved)."""
    return record_id % 0xFFFE + 1


@dataclass(frozen=True)
class SelState:
    """The log without its clock: what a keeper writes and reads back."""

    records: tuple[LogRecord, ...] = ()
    next_id: int = 1
    added: int = NEVER
    erased: int = NEVER
    overflow: bool = False


class SystemEventLog:
    def __init__(self, capacity: int = CAPACITY, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._capacity = capacity
        self._clock = clock
        self._offset = 0.0
        self._records: list[LogRecord] = []
        self._next_id = 1
        self._seen = 0  # the last bus event looked at
        self._following = False
        self.added = NEVER  # SEL-clock stamps of the last addition and the last erase
        self.erased = NEVER
        self.overflow = False
        self.keeper: Keeper = NOT_KEPT

    @property
    def capacity(self) -> int:
        return self._capacity

    def follow(self, bus: EventBus) -> None:
        """Log what the bus publishes from now on, and what its history still holds from before (once)."""
        with self._lock:
            if self._following:
                return
            self._following = True
            bus.subscribe(self._hear)
            backlog = bus.since(0)
        for event in backlog:
            self._hear(event)

    def _hear(self, event: Event) -> None:
        with self._lock:
            if event.seq <= self._seen:
                return  # the backlog and the subscription may both bring it
            self._seen = event.seq
        self.record(event)

    def record(self, event: Event) -> LogRecord | None:
        """Log `event`, stamped with when it happened on the SEL clock, if the log keeps its kind."""
        if not logged(event):
            return None
        stamp = int(event.timestamp + self._offset) if event.timestamp else self.now()
        return self._add(lambda record_id: LogRecord(record_id, stamp, event.reason, event.message, event.kind,
                                                     dict(event.detail)), stamp)

    def add_raw(self, build: Callable[[int, int], bytes]) -> LogRecord | None:
        """A client's entry: `build(record_id, stamp)` makes its bytes; None when the log is full."""
        stamp = self.now()
        return self._add(lambda record_id: LogRecord(record_id, stamp, "", "", raw=build(record_id, stamp)), stamp)

    def _add(self, make: Callable[[int], LogRecord], stamp: int) -> LogRecord | None:
        with self._lock:
            if len(self._records) >= self._capacity:
                changed, self.overflow = not self.overflow, True  # the overflow flag is kept too
                record = None
            else:
                changed = True
                record = make(self._next_id)
                self._next_id = next_record_id(self._next_id)
                self._records.append(record)
                self.added = stamp
        if changed:
            self.keeper.changed()
        return record

    def records(self) -> list[LogRecord]:
        with self._lock:
            return list(self._records)

    def find(self, record_id: int) -> LogRecord | None:
        with self._lock:
            return next((r for r in self._records if r.record_id == record_id), None)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()
            self.overflow = False
            self.erased = self.now()
        self.keeper.changed()

    def settle(self) -> None:
        """Before a client reads the log or hears that it changed: what it will see is kept (vbmc/access/keeping.py)."""
        self.keeper.settle()

    def state(self) -> SelState:
        with self._lock:
            return SelState(tuple(self._records), self._next_id, self.added, self.erased, self.overflow)

    def adopt(self, kept: SelState, synced: SelState) -> SelState:
        """Become `kept` (what the keeper read back), followed by what was logged here since `synced` (the state
        last kept from here, or read back): those records take the next IDs after `kept`'s, as they would have had
        they been logged there, up to the capacity. A clear done here since `synced` clears `kept`'s records too.
        Another writer's records (a second agent for a while) and this one's are so both kept. Returns the new
        state, to be kept."""
        with self._lock:
            known = {r.record_id for r in synced.records}
            fresh = [r for r in self._records if r.record_id not in known]
            cleared_here = self.erased != synced.erased
            records = [] if cleared_here else list(kept.records)
            overflow = (not cleared_here and kept.overflow) or (self.overflow and (cleared_here or not synced.overflow))
            next_id, added = kept.next_id, kept.added
            for record in fresh:
                if len(records) >= self._capacity:
                    overflow = True
                    break
                raw = next_id.to_bytes(2, "little") + record.raw[2:] if record.raw else b""
                records.append(replace(record, record_id=next_id, raw=raw))
                next_id, added = next_record_id(next_id), record.stamp
            self._records, self._next_id, self.added, self.overflow = records, next_id, added, overflow
            self.erased = self.erased if cleared_here else kept.erased
            return SelState(tuple(records), next_id, added, self.erased, overflow)

    def now(self) -> int:
        return int(self._clock() + self._offset)

    def set_time(self, stamp: int) -> None:
        """Move the SEL clock (IPMI Set SEL Time): records logged from now on carry its time."""
        self._offset = stamp - self._clock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)
