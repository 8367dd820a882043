"""The audit trail: who did what to the VM, through which protocol, from where, and how it ended.

Each frontend says once per request or command who is acting (`bind`: the protocol, the source address, the user,
the session); the record is written where the command ends or a login fails (`record`): one log line on the
`vbmc.audit` logger, with the same fields as attributes of the log record, so that `--log-format json` prints
them as JSON keys. The backend names the actor in the Events it records (`describe`). Nothing here ever holds a
password; URLs go through `redact_url` before they reach a log line, an Event or a Redfish property. The user name
of a failed login goes through `attempted_user`: what was typed as a user name is sometimes the password, typed in
the wrong field, so only the BMC's own account's name is ever written.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, replace

from .keeping import NOT_KEPT, Keeper

log = logging.getLogger("vbmc.audit")

FIELDS = ("protocol", "source", "user", "session", "action", "vm", "result", "duration_ms")
UNKNOWN_USER = "(unknown user)"  # a failed login's user name when it is not the account's


@dataclass(frozen=True)
class Actor:
    protocol: str  # "ipmi" or "redfish"
    source: str  # the client's address, as the agent sees it
    user: str = ""  # empty before (or without) a login
    session: str = ""  # the IPMI session id, or the Redfish session's Id; empty for HTTP Basic


_actor: ContextVar[Actor | None] = ContextVar("vbmc_audit_actor", default=None)


def bind(actor: Actor) -> None:
    """Who acts in the current request or command (a thread's context; set again at every request)."""
    _actor.set(actor)


def current() -> Actor | None:
    return _actor.get()


def describe(actor: Actor | None = None) -> str:
    """For an Event's message: "through redfish from 10.0.0.7 (user admin)"; empty when no frontend acts (the
    agent on its own, such as a boot-once override consumed)."""
    actor = actor or current()
    if actor is None:
        return ""
    who = f" (user {actor.user})" if actor.user else ""
    return f"through {actor.protocol} from {actor.source or 'an unknown address'}{who}"


@dataclass(frozen=True)
class Entry:
    entry_id: int  # 1, 2, ... per trail, never reused
    stamp: float  # time.time() when recorded
    fields: dict[str, object]  # FIELDS
    warning: bool  # a refusal or a failure (logged at WARNING)


@dataclass(frozen=True)
class TrailState:
    """The trail as a keeper writes it and reads it back."""

    entries: tuple[Entry, ...] = ()
    next_id: int = 1
    cleared: float = 0.0  # time.time() of the last clear; 0: never


class Trail:
    """The recent audit records of one BMC (its Redfish Manager shows them as a LogService): what changed something
    and every refusal, the last `capacity` of them, the oldest dropped first. Reads are not kept (they are logged at
    DEBUG). Kept beyond the process by its `keeper` (vbmc/access/keeping.py), as the SEL is."""

    def __init__(self, capacity: int = 512, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._entries: deque[Entry] = deque(maxlen=capacity)
        self._next = 1
        self._cleared = 0.0
        self._clock = clock
        self.capacity = capacity
        self.keeper: Keeper = NOT_KEPT

    def add(self, fields: dict[str, object], warning: bool) -> None:
        with self._lock:
            self._entries.append(Entry(self._next, self._clock(), fields, warning))
            self._next += 1
        self.keeper.changed()

    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._entries)

    def find(self, entry_id: int) -> Entry | None:
        with self._lock:
            return next((e for e in self._entries if e.entry_id == entry_id), None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._cleared = self._clock()
        self.keeper.changed()

    def settle(self) -> None:
        """Before a client reads the trail or hears that it was cleared: what it will see is kept."""
        self.keeper.settle()

    def state(self) -> TrailState:
        with self._lock:
            return TrailState(tuple(self._entries), self._next, self._cleared)

    def adopt(self, kept: TrailState, synced: TrailState) -> TrailState:
        """Become `kept` (what the keeper read back), followed by what was recorded here since `synced` (the state
        last kept from here, or read back), numbered on from `kept`'s ids, the oldest dropped past the capacity; a
        clear done here since `synced` clears `kept`'s entries too (as SystemEventLog.adopt). Returns the new
        state, to be kept."""
        with self._lock:
            fresh = [e for e in self._entries if e.entry_id >= synced.next_id]
            cleared_here = self._cleared != synced.cleared
            entries = deque([] if cleared_here else kept.entries, maxlen=self.capacity)
            next_id = kept.next_id
            for entry in fresh:
                entries.append(replace(entry, entry_id=next_id))
                next_id += 1
            self._entries, self._next = entries, next_id
            self._cleared = self._cleared if cleared_here else kept.cleared
            return TrailState(tuple(entries), next_id, self._cleared)


def record(action: str, vm: str, result: str, duration: float = 0.0, *, actor: Actor | None = None,
           level: int = logging.INFO, trail: Trail | None = None) -> None:
    """One audit line: `action` on `vm` ended with `result` after `duration` seconds; kept in `trail` too when it
    is an action or a refusal (INFO and above)."""
    actor = actor or current() or Actor("", "")
    fields = {"protocol": actor.protocol or "-", "source": actor.source or "-", "user": actor.user or "-",
              "session": actor.session or "-", "action": action, "vm": vm, "result": result,
              "duration_ms": round(duration * 1000, 1)}
    if trail is not None and level >= logging.INFO:
        trail.add(fields, level >= logging.WARNING)
    if log.isEnabledFor(level):
        log.log(level, "audit " + " ".join(f"{k}=%r" if k in ("action", "result", "user") else f"{k}=%s"
                                            for k in FIELDS), *fields.values(), extra={"audit": fields})


def attempted_user(name: str, account: str) -> str:
    """The user name a failed login may be logged with: `name` when it is the BMC's `account`, else UNKNOWN_USER
    (never the text: it may be a password typed in the user name field). Compared in constant time, as the
    password is."""
    return name if hmac.compare_digest(name.encode(), account.encode()) else UNKNOWN_USER


def redact_url(url: str) -> str:
    """`url` without its userinfo: `http://user:pw@host/x.iso` becomes `http://host/x.iso`. Pure string work, so
    that a malformed URL (`http://[::1/x`) is redacted too, never an exception."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority = rest[:end]
    if "@" not in authority:
        return url
    return f"{scheme}://{authority.rpartition('@')[2]}{rest[end:]}"
