"""Keeping a BMC's records beyond its process: the audit trail (audit.py) and the machine's system event log
(vbmc/machine/eventlog.py) each tell a Keeper of every change, and ask it to settle before a client is shown them.

The agent's keeper writes both to a ConfigMap (vbmc/agent/logstore.py); without one (an agent run by hand, the
memory backend, the tests of a frontend) they live in memory only, as NOT_KEPT says.
"""

from __future__ import annotations

from typing import Protocol


class Keeper(Protocol):
    def changed(self) -> None:
        """Something was logged or cleared: keep it soon. Never blocks (the event bus and the IPMI loop call it)."""

    def settle(self) -> None:
        """A client is about to read the log, or to be told its entry was added or the log cleared: return once
        what changed so far is kept, or once keeping it has taken longer than a client can wait (it is kept
        later)."""


class _NotKept:
    def changed(self) -> None:
        return None

    def settle(self) -> None:
        return None


NOT_KEPT: Keeper = _NotKept()
