"""Brute-force resistance for every login the agent checks: IPMI RAKP, Redfish Basic auth and session login.

Per source address, exponential backoff on failed logins: the first FREE_FAILURES failures cost nothing (a typo,
a client tried with an old password), then each further failure locks the source out for BASE_DELAY, twice that,
and so on up to MAX_DELAY. While locked out a source's logins are refused at once without looking at the password
(so the lockout cannot be used as an oracle) and without holding a server thread; every other source logs in as
before, so the owner is never locked out by someone else's failures. A success from the source clears its record.

IPv6 sources count per /64 (one host usually owns a whole /64); memory is bounded by MAX_SOURCES records, the
stalest dropped first. The clock is injectable so tests step time instead of sleeping.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("vbmc.throttle")

FREE_FAILURES = 5
BASE_DELAY = 1.0  # seconds of lockout after the first failure beyond the free ones
MAX_DELAY = 60.0
FORGET_AFTER = 900.0  # a source without a failure for this long starts afresh
MAX_SOURCES = 10_000  # records kept; about 150 bytes each
WARNING_INTERVAL = 60.0  # at most one Warning Event per source in this many seconds
MAX_WARNINGS_PER_INTERVAL = 10  # and at most this many over all sources


@dataclass(frozen=True)
class Engaged:
    """Throttling started (or continued) for a source: what the Warning Event and the log line say."""

    source: str
    protocol: str  # "ipmi", "redfish-basic", "redfish-session"
    user: str
    failures: int
    delay: float  # seconds the source is now locked out


@dataclass
class _Record:
    failures: int = 0
    locked_until: float = 0.0
    last_failure: float = 0.0
    last_warning: float = float("-inf")


@functools.lru_cache(maxsize=1024)  # on every Basic-auth request: parsing costs 6 us (IPv4) to 30 us (IPv6)
def source_key(address: str) -> str:
    """The unit a budget is kept for: the IPv4 address, or the /64 of an IPv6 address (an IPv4-mapped IPv6
    address counts as its IPv4 address). Anything unparsable (a Unix socket, a test client) is its own source."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def lockout(failures: int, free: int = FREE_FAILURES, base: float = BASE_DELAY, most: float = MAX_DELAY) -> float:
    """Seconds a source is locked out after its `failures`-th consecutive failure."""
    beyond = failures - free
    if beyond <= 0:
        return 0.0
    return min(most, base * 2.0 ** min(beyond - 1, 32))


class LoginThrottle:
    """Per-source failed-login backoff, shared by every protocol of one agent (thread-safe).

    `retry_after(address)` before checking credentials: > 0 means refuse now and tell the client to come back in
    that many seconds. Then `failed(...)` or `succeeded(address)` (IPMI: `charge(...)` first, see there).
    `on_engaged` is called (rate-limited per source
    and overall) when a failure locks a source out; it must not block (the agent hands it to a thread)."""

    def __init__(self, *, free_failures: int = FREE_FAILURES, base_delay: float = BASE_DELAY,
                 max_delay: float = MAX_DELAY, forget_after: float = FORGET_AFTER, max_sources: int = MAX_SOURCES,
                 clock: Callable[[], float] = time.monotonic,
                 on_engaged: Callable[[Engaged], None] | None = None) -> None:
        self.free_failures = free_failures
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.forget_after = forget_after
        self.max_sources = max_sources
        self.on_engaged = on_engaged
        self._clock = clock
        self._lock = threading.Lock()
        self._records: OrderedDict[str, _Record] = OrderedDict()  # least recently failed first
        self._warnings: list[float] = []  # times of recent Warning Events, over all sources
        # Counters for the metrics endpoint (Prometheus text, see metrics()).
        self.failures_total: dict[str, int] = {}
        self.refused_total: dict[str, int] = {}
        self.engaged_total = 0

    def retry_after(self, address: str) -> float:
        """Seconds until `address` may try a login again; 0 if it may now."""
        record = self._records.get(source_key(address))  # a lock-free read: the common case has no record
        if record is None:
            return 0.0
        return max(0.0, record.locked_until - self._clock())

    def refused(self, protocol: str) -> None:
        """A login refused because its source was locked out (for the metrics)."""
        with self._lock:
            self.refused_total[protocol] = self.refused_total.get(protocol, 0) + 1

    def failed(self, address: str, protocol: str, user: str = "", charged: bool = False) -> float:
        """A login from `address` failed; returns the lockout it now has (0 while it has free failures left).
        `charged`: the attempt was counted against its source when it began (see charge()), so only the metrics
        learn of it now."""
        if charged:
            with self._lock:
                self.failures_total[protocol] = self.failures_total.get(protocol, 0) + 1
            return self.retry_after(address)
        return self._count(address, protocol, user, failure=True)

    def charge(self, address: str, protocol: str, user: str = "") -> float:
        """An attempt that counts as failed unless succeeded() follows. IPMI's RAKP 2 carries an HMAC of the
        password that the client can check offline, so a guesser learns the outcome without ever sending RAKP 3:
        the attempt has to count when RAKP 2 goes out. Returns the lockout the source now has."""
        return self._count(address, protocol, user, failure=False)

    def _count(self, address: str, protocol: str, user: str, failure: bool) -> float:
        key = source_key(address)
        now = self._clock()
        engaged: Engaged | None = None
        with self._lock:
            if failure:
                self.failures_total[protocol] = self.failures_total.get(protocol, 0) + 1
            record = self._records.pop(key, None)
            if record is None or now - record.last_failure > self.forget_after:
                record = _Record()
            record.failures += 1
            record.last_failure = now
            delay = lockout(record.failures, self.free_failures, self.base_delay, self.max_delay)
            record.locked_until = now + delay
            self._records[key] = record  # most recently failed last
            self._trim(now)
            if delay > 0:
                self.engaged_total += 1
                if self._may_warn(record, now):
                    engaged = Engaged(key, protocol, user, record.failures, delay)
        if delay > 0:
            log.warning("login throttled protocol=%s client=%s user=%r failures=%d locked_out_s=%.0f", protocol,
                        key, user, record.failures, delay)
        if engaged is not None and self.on_engaged is not None:
            try:
                self.on_engaged(engaged)
            except Exception:  # reporting must never break a login path
                log.exception("throttle: on_engaged failed")
        return delay

    def succeeded(self, address: str) -> None:
        """A login from `address` succeeded: its failures are forgotten."""
        key = source_key(address)
        if key in self._records:
            with self._lock:
                self._records.pop(key, None)

    def sources(self) -> int:
        return len(self._records)

    def metrics(self) -> str:
        """The counters in Prometheus text format."""
        lines = ["# HELP kubevbmc_login_failures_total Failed logins (wrong user name or password).",
                 "# TYPE kubevbmc_login_failures_total counter"]
        with self._lock:
            lines += [f'kubevbmc_login_failures_total{{protocol="{p}"}} {n}'
                      for p, n in sorted(self.failures_total.items())]
            lines += ["# HELP kubevbmc_login_throttled_total Logins refused because their source was locked out.",
                      "# TYPE kubevbmc_login_throttled_total counter"]
            lines += [f'kubevbmc_login_throttled_total{{protocol="{p}"}} {n}'
                      for p, n in sorted(self.refused_total.items())]
            lines += ["# HELP kubevbmc_login_lockouts_total Failed logins that locked their source out.",
                      "# TYPE kubevbmc_login_lockouts_total counter", f"kubevbmc_login_lockouts_total "
                      f"{self.engaged_total}",
                      "# HELP kubevbmc_login_throttle_sources Sources with failed logins on record.",
                      "# TYPE kubevbmc_login_throttle_sources gauge",
                      f"kubevbmc_login_throttle_sources {len(self._records)}"]
        return "\n".join(lines) + "\n"

    def _trim(self, now: float) -> None:
        while self._records:
            key, oldest = next(iter(self._records.items()))
            if len(self._records) > self.max_sources or now - oldest.last_failure > self.forget_after:
                del self._records[key]
            else:
                return

    def _may_warn(self, record: _Record, now: float) -> bool:
        if now - record.last_warning < WARNING_INTERVAL:
            return False
        self._warnings = [t for t in self._warnings if now - t < WARNING_INTERVAL]
        if len(self._warnings) >= MAX_WARNINGS_PER_INTERVAL:
            return False
        self._warnings.append(now)
        record.last_warning = now
        return True
