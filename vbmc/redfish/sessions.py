"""Redfish sessions: tokens handed out by POST to the Sessions collection, valid until `timeout` seconds pass
without a request on them (SessionService.SessionTimeout is an inactivity timeout), revoked by DELETE.

The timeout can change while sessions live (a PATCH of SessionService.SessionTimeout): every session is measured
against the current one at its next look-up, so a shorter timeout ends the sessions idle for longer at once. It
lives in memory, as the sessions do: an agent restart starts again from the configured value."""

from __future__ import annotations

import contextlib
import hmac
import itertools
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime


@dataclass(frozen=True, eq=False)
class Viewer:
    """A console a session has open (vbmc/web/consoles.py registers it): shown with the session, ended with it."""

    console: str  # "serial" or "screen"
    origin: str  # the viewer's client address
    since: str  # ISO 8601


@dataclass
class Session:
    id: str
    token: str
    username: str
    created: str  # ISO 8601, for CreatedTime
    last_used: float
    origin: str = ""
    kind: str = "Redfish"  # Session.SessionType: "Redfish", or "WebUI" for the BMC's own page
    viewers: list[Viewer] = field(default_factory=list)


class SessionStore:
    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic, limit: int = 64) -> None:
        self.timeout = timeout
        self._clock = clock
        self._limit = limit
        self._lock = threading.Lock()
        self._by_token: dict[str, Session] = {}
        self._ids = itertools.count(1)

    def create(self, username: str, origin: str = "", kind: str = "Redfish") -> Session:
        now = self._clock()
        with self._lock:
            self._expire(now)
            if len(self._by_token) >= self._limit:
                # A BMC has a small session table; drop the idlest rather than refuse a new login.
                idlest = min(self._by_token.values(), key=lambda s: s.last_used)
                del self._by_token[idlest.token]
            session = Session(id=str(next(self._ids)), token=secrets.token_urlsafe(24), username=username,
                              created=datetime.now(UTC).isoformat(timespec="seconds"), last_used=now,
                              origin=origin, kind=kind)
            self._by_token[session.token] = session
            return session

    def authenticate(self, token: str) -> Session | None:
        """The live session for `token`, touched; None if unknown or expired."""
        now = self._clock()
        with self._lock:
            session = self._by_token.get(token)
            if session is None:
                return None
            if now - session.last_used > self.timeout:
                del self._by_token[token]
                return None
            session.last_used = now
            return session

    def get(self, session_id: str) -> Session | None:
        now = self._clock()
        with self._lock:
            self._expire(now)
            return next((s for s in self._by_token.values() if s.id == session_id), None)

    def delete(self, session_id: str) -> bool:
        with self._lock:
            for token, session in self._by_token.items():
                if hmac.compare_digest(session.id, session_id):
                    del self._by_token[token]
                    return True
            return False

    def list(self) -> list[Session]:
        now = self._clock()
        with self._lock:
            self._expire(now)
            return sorted(self._by_token.values(), key=lambda s: int(s.id))

    def open_console(self, session: Session, console: str, origin: str) -> Viewer:
        """Record that `session` has `console` open from `origin`, until close_console."""
        viewer = Viewer(console, origin, datetime.now(UTC).isoformat(timespec="seconds"))
        with self._lock:
            session.viewers.append(viewer)
        return viewer

    def close_console(self, session: Session, viewer: Viewer) -> None:
        with self._lock, contextlib.suppress(ValueError):
            session.viewers.remove(viewer)

    def viewers(self, session: Session) -> tuple[Viewer, ...]:
        """The consoles `session` has open now (a copy: the consoles' threads change the list)."""
        with self._lock:
            return tuple(session.viewers)

    def set_timeout(self, seconds: float) -> None:
        """A new inactivity timeout, for every session from its next look-up on."""
        with self._lock:
            self.timeout = seconds

    def clear(self) -> None:
        with self._lock:
            self._by_token.clear()

    def _expire(self, now: float) -> None:
        for token in [t for t, s in self._by_token.items() if now - s.last_used > self.timeout]:
            del self._by_token[token]
