"""Logs: the System's SEL (the machine's system event log, vbmc/machine/eventlog.py: the records IPMI's SEL shows,
one record with two views) and the Manager's audit trail (vbmc/access/audit.py: who did what through this BMC),
each a LogService with its entries and ClearLog. Both settle (vbmc/access/keeping.py) before their entries are
read and before a ClearLog is answered: what a client has seen is kept."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from flask import Blueprint, Response, request

from . import payloads, resources
from .errors import not_found
from .service import Service

SEL_DESCRIPTION = ("What happened to the system, as its IPMI SEL records it (the same records): where power went, "
                   "boot overrides, virtual media.")
AUDIT_DESCRIPTION = ("Who did what through this BMC, over IPMI and Redfish, and every refused login or request; reads "
                     "are not recorded.")


def blueprint(svc: Service) -> Blueprint:
    bp = Blueprint("logs", __name__)
    route, machine, ids = svc.route, svc.machine, svc.ids

    def log_routes(owner: str, log_id: str, kind: str, entries: Callable[[], list[Any]],
                   find: Callable[[int], Any], render: Callable[[str, Any], dict[str, Any]],
                   service: Callable[[str], dict[str, Any]], clear: Callable[[], None],
                   settle: Callable[[], None]) -> None:
        base = f"{owner}/LogServices"
        path = f"{base}/{log_id}"

        @route(bp, base, endpoint=f"{kind}_services")
        def services() -> Response:
            return svc.send_doc("LogServiceCollection", resources.collection(
                "LogServiceCollection", base, "Log Services", [path]))

        @route(bp, path, endpoint=f"{kind}_service")
        def log_service() -> Response:
            return svc.send_doc("LogService", service(path))

        @route(bp, f"{path}/Entries", endpoint=f"{kind}_entries")
        def log_entries() -> Response:
            # LogEntryCollection's Members are auto-expanded (Redfish.AutoExpand): whole entries, not links.
            settle()
            doc = resources.collection("LogEntryCollection", f"{path}/Entries", "Log Entries", [])
            doc["Members"] = [render(path, e) for e in entries()]
            doc["Members@odata.count"] = len(doc["Members"])
            return svc.send_doc("LogEntryCollection", doc)

        @route(bp, f"{path}/Entries/<entry_id>", endpoint=f"{kind}_entry")
        def log_entry(entry_id: str) -> Response:
            settle()
            found = find(int(entry_id)) if entry_id.isdigit() and len(entry_id) < 8 else None
            if found is None:
                raise not_found(request.path)
            return svc.send_doc("LogEntry", render(path, found))

        @route(bp, f"{path}/Actions/LogService.ClearLog", ("POST",), endpoint=f"{kind}_clear")
        def clear_log() -> Response:
            payloads.parse_action(payloads.ClearLogAction, svc.body(), "LogService.ClearLog")
            clear()
            settle()
            return svc.no_content()

    events = machine.event_log
    log_routes(ids.system, resources.SEL_LOG, "sel", events.records, events.find, resources.sel_entry,
               lambda path: resources.log_service(path, resources.SEL_LOG, "System Event Log", SEL_DESCRIPTION,
                                                  "SEL", events.capacity, "NeverOverWrites", events.now()),
               events.clear, events.settle)
    trail = machine.audit_trail
    log_routes(ids.manager, resources.AUDIT_LOG, "audit", trail.entries, trail.find, resources.audit_entry,
               lambda path: resources.log_service(path, resources.AUDIT_LOG, "Audit Log", AUDIT_DESCRIPTION,
                                                  "Event", trail.capacity, "WrapsWhenFull", time.time()),
               trail.clear, trail.settle)
    return bp
