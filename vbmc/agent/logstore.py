"""A BMC's system event log and audit trail kept in a ConfigMap, so that an agent's restart, a rollout or a node
drain does not erase them (a physical BMC keeps its SEL in flash).

One ConfigMap per BMC, `<vm>-virtbmc-log` (the controller passes its name: --log-config-map, or a pool member's
`logConfigMap`), created by the agent on its first entry, owned by the VirtualMachineBMC (it goes with it; no
blockOwnerDeletion, which would need permission on the owner's finalizers), with two keys: `sel.json` (the records,
the next record ID, the last addition and erase stamps, the overflow flag) and `audit.json` (the entries, the next
id, the last clear). Both logs are rings of bounded size (256 SEL records, 512 audit entries) whose free text is
cut to a bounded size here (`_fit`), so the object stays under the API server's 1 MiB whatever was logged
(tests/agent/test_logstore.py fills both with the longest values).

When it is written:
- never at rest: only after something was logged or cleared (or the log could not be read yet);
- in batches: the first change of a burst starts a wait of BATCH_SECONDS, then one write keeps everything logged
  by then; a write under way and the changes made during it are followed by one more write;
- before a client sees an entry: IPMI Get SEL Info and Get SEL Entry and the Redfish LogServices settle first, Add
  SEL Entry, Clear SEL and ClearLog before they answer (vbmc/access/keeping.py). Settling writes at once (no
  batch wait) and waits at most SETTLE_WAIT seconds; while the API server refuses or cannot be reached it does not
  wait at all, and the client is answered from memory.
So an agent killed (SIGKILL) loses at most what was logged in the last BATCH_SECONDS plus one write's duration,
and none of it was read by a client, unless the API server was failing when it was read. A SIGTERM writes what
is pending before the agent stops (within STOP_WAIT).

Writes are updates carrying the resourceVersion last read or written (optimistic concurrency: another agent may
write too, for a while, during a move into a pool or a node's loss), each tagged so that a write whose answer was
lost (a timeout) is recognised when read back rather than merged twice. A conflict reads the ConfigMap again and
merges: what it holds, then what was logged here since the last write, numbered on after it
(SystemEventLog.adopt, Trail.adopt). Reading it back when the agent starts is the same merge, so IDs and record
numbers continue where the kept log ends; if the API server cannot be reached then, the agent serves from memory
and merges when it can (entries logged meanwhile are renumbered after the kept ones).

A write the API server refuses or cannot take is retried with backoff (up to RETRY_MAX seconds apart); the first
failure of a run of them is logged once at WARNING, the recovery at INFO. Redfish sessions are not kept: a client
logs in again after a restart.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import uuid
from collections.abc import Callable
from typing import Any

from ..access import audit
from ..access.audit import Entry, Trail, TrailState
from ..machine.eventlog import LogRecord, SelState, SystemEventLog
from ..machine.kubevirt.client import KubeError, Unreachable

log = logging.getLogger("vbmc.logstore")

Obj = dict[str, Any]
SEL_KEY, AUDIT_KEY = "sel.json", "audit.json"
FORMAT = 1
MANAGED_BY, MANAGER = "app.kubernetes.io/managed-by", "kubevbmc"
OWNER_LABEL = "bmc.kubevirt.io/vmbmc"
WRITE_ANNOTATION = "bmc.kubevirt.io/log-write"  # which write the ConfigMap holds: the writer's id and a count
BATCH_SECONDS = 1.0  # from a burst's first change to its write
SETTLE_WAIT = 0.5  # the longest a client's command waits for its entries to be kept (IPMI answers within 1 s)
STOP_WAIT = 0.5  # what SIGTERM gives the pending write (after IPMI's stop; the agent stops within two seconds)
REQUEST_TIMEOUT = 2.0
RETRY_FIRST, RETRY_MAX = 1.0, 30.0
CONFLICT_TRIES = 5

# The most a free-text field takes in the ConfigMap as sent (JSON inside JSON: up to 12 bytes a character). With
# these, a full SEL takes at most about 290 KB and a full trail 480 KB: with the metadata, under 1 MiB.
MESSAGE_ROOM, WORD_ROOM, DETAIL_ROOM, DETAIL_KEYS = 384, 48, 96, 4
AUDIT_ROOM = {"protocol": 64, "source": 64, "user": 64, "session": 64, "vm": 128, "action": 160, "result": 224}
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


class NotKeptHere(Exception):
    """The ConfigMap cannot be written now: no owner to create it with yet, or conflicting writes over and over."""


class NotOurs(NotKeptHere):
    """A ConfigMap of that name exists and is not the agent's: tried again at the next change only, never on a
    timer (an agent at rest makes no request)."""


# ---- the documents (pure)


def _stored_size(text: str) -> int:
    return len(json.dumps(json.dumps(text, ensure_ascii=False)))


def _fit(text: str, room: int) -> str:
    """`text`, cut so that it takes at most `room` bytes in the ConfigMap as sent (a JSON string inside the JSON
    body)."""
    if len(text) * 12 + 8 <= room or _stored_size(text) <= room:
        return text
    low, high = 0, len(text)
    while low < high:  # the longest prefix that fits
        middle = (low + high + 1) // 2
        if _stored_size(text[:middle]) <= room:
            low = middle
        else:
            high = middle - 1
    return text[:low]


def sel_document(state: SelState) -> str:
    records = [{"id": r.record_id, "stamp": r.stamp, "reason": _fit(r.reason, WORD_ROOM),
                "message": _fit(r.message, MESSAGE_ROOM), "kind": _fit(r.kind, WORD_ROOM),
                "detail": {_fit(k, WORD_ROOM): _fit(v, DETAIL_ROOM) for k, v in list(r.detail.items())[:DETAIL_KEYS]},
                "raw": r.raw[:16].hex()} for r in state.records]
    return json.dumps({"format": FORMAT, "nextId": state.next_id, "added": state.added, "erased": state.erased,
                       "overflow": state.overflow, "records": records}, ensure_ascii=False, separators=(",", ":"))


def audit_document(state: TrailState) -> str:
    entries = [{"id": e.entry_id, "stamp": e.stamp, "warning": e.warning,
                "fields": {k: _fit(str(e.fields.get(k, "-")), room) for k, room in AUDIT_ROOM.items()}
                | {"duration_ms": _duration(e.fields.get("duration_ms"))}} for e in state.entries]
    return json.dumps({"format": FORMAT, "nextId": state.next_id, "cleared": state.cleared, "entries": entries},
                      ensure_ascii=False, separators=(",", ":"))


def _duration(value: object) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def read_sel(text: str | None) -> SelState:
    """The SEL a ConfigMap keeps (absent: empty). Raises ValueError for a document this version cannot read."""
    if not text:
        return SelState()
    doc = json.loads(text)
    records = tuple(LogRecord(int(r["id"]), int(r["stamp"]), str(r["reason"]), str(r["message"]), str(r["kind"]),
                              {str(k): str(v) for k, v in dict(r["detail"]).items()}, bytes.fromhex(r["raw"]))
                    for r in doc["records"])
    return SelState(records, int(doc["nextId"]), int(doc["added"]), int(doc["erased"]), bool(doc["overflow"]))


def read_trail(text: str | None) -> TrailState:
    """The audit trail a ConfigMap keeps (absent: empty). Raises ValueError as read_sel."""
    if not text:
        return TrailState()
    doc = json.loads(text)
    entries = tuple(Entry(int(e["id"]), float(e["stamp"]), {k: e["fields"][k] for k in audit.FIELDS},
                          bool(e["warning"])) for e in doc["entries"])
    return TrailState(entries, int(doc["nextId"]), float(doc["cleared"]))


def config_map(namespace: str, name: str, owner: Obj, sel: SelState, trail: TrailState) -> Obj:
    """The ConfigMap as first created: labelled as the controller labels a BMC's children, owned by its
    VirtualMachineBMC `owner`."""
    meta = owner.get("metadata") or {}
    labels = {MANAGED_BY: MANAGER}
    if _LABEL_VALUE.fullmatch(str(meta.get("name", ""))):
        labels[OWNER_LABEL] = str(meta["name"])
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace, "labels": labels,
                         "ownerReferences": [{"apiVersion": owner.get("apiVersion", "bmc.kubevirt.io/v1beta1"),
                                              "kind": owner.get("kind", "VirtualMachineBMC"),
                                              "name": meta.get("name", ""), "uid": meta.get("uid", "")}]},
            "data": {SEL_KEY: sel_document(sel), AUDIT_KEY: audit_document(trail)}}


# ---- the keeper


class LogKeeper:
    """Keeps one BMC's SEL and audit trail in its ConfigMap (see the module's docstring); their Keeper
    (vbmc/access/keeping.py). Its writer thread runs while there is something to write, and ends when all is kept."""

    def __init__(self, client: Any, namespace: str, name: str, sel: SystemEventLog, trail: Trail,
                 owner: Callable[[], Obj | None], who: str, *, batch: float = BATCH_SECONDS,
                 settle_wait: float = SETTLE_WAIT) -> None:
        self.client = client
        self.namespace = namespace
        self.name = name
        self.path = f"/api/v1/namespaces/{namespace}/configmaps/{name}"
        self.sel = sel
        self.trail = trail
        self._owner = owner
        self._who = who
        self._batch = batch
        self._settle_wait = settle_wait
        self._cond = threading.Condition()
        self._sync_lock = threading.Lock()
        self._changes = 0  # bumped at every change
        self._kept = 0  # the changes kept by the last write (or read)
        self._urgent = False  # a client waits: write without the batch wait
        self._writing = False  # the writer thread runs
        self._failing = False  # the last attempt failed: clients do not wait
        self._stopped = False
        # What the ConfigMap held after the last read or write from here, its resourceVersion (None: absent, or
        # not read yet) and metadata.
        self._synced: tuple[SelState, TrailState] = (SelState(), TrailState())
        self._version: str | None = None
        self._meta: Obj = {}
        self._read = False  # read at least once (or known absent)
        # Every write is tagged (WRITE_ANNOTATION): this process's id and a count. The last one whose answer was
        # lost (a timeout), with the states it wrote.
        self._writer = uuid.uuid4().hex[:12]
        self._attempts = 0
        self._attempt: tuple[str, SelState, TrailState] | None = None
        self.writes = 0  # successful writes (tests, bench/durable.py)

    def start(self) -> None:
        """Keep the logs from now on; read back what the ConfigMap keeps first (one GET, in the caller's thread).
        If it cannot be read now, the logs start empty and the writer reads and merges it as soon as it can."""
        self.sel.keeper = self
        self.trail.keeper = self
        try:
            self._sync()
        except NotOurs as exc:
            self._failed(exc)
        except (KubeError, Unreachable, NotKeptHere) as exc:
            self._failed(exc)
            self.changed()  # still to be read: the writer tries again

    # -- Keeper

    def changed(self) -> None:
        with self._cond:
            self._changes += 1
            self._cond.notify_all()
            if self._writing or self._stopped:
                return
            self._writing = True
        threading.Thread(target=self._run, name=f"log-keeper-{self.name}", daemon=True).start()

    def settle(self) -> None:
        with self._cond:
            wanted = self._changes
            if self._kept >= wanted or self._failing or self._stopped:
                return
            self._urgent = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._kept >= wanted or self._failing, self._settle_wait)

    def stop(self, timeout: float = STOP_WAIT) -> None:
        """Write what is pending (SIGTERM, a member removed), waiting at most `timeout` seconds; keep nothing after."""
        with self._cond:
            self._urgent = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._kept >= self._changes or self._failing or not self._writing, timeout)
            self._stopped = True
            self._cond.notify_all()

    # -- the writer

    def _run(self) -> None:
        delay, failures = self._batch, 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: (self._urgent and not self._failing) or self._stopped, delay)
                if self._kept >= self._changes or self._stopped:
                    self._writing = False
                    self._cond.notify_all()
                    return
                self._urgent = False
                changes = self._changes
            try:
                self._sync()
            except NotOurs as exc:
                self._failed(exc)
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()
                return
            except (KubeError, Unreachable, NotKeptHere) as exc:
                failures += 1
                self._failed(exc)
                delay = min(RETRY_MAX, RETRY_FIRST * 2 ** (failures - 1))
                continue
            with self._cond:
                self._kept = max(self._kept, changes)
                recovered, self._failing = self._failing, False
                self._cond.notify_all()
            if recovered:
                log.info("%s: its SEL and audit trail are kept again in ConfigMap %s", self._who, self.name)
            delay, failures = self._batch, 0

    def _failed(self, exc: Exception) -> None:
        with self._cond:
            first, self._failing = not self._failing, True
            self._cond.notify_all()
        if first:  # once per run of failures: the API server may be away for a while
            log.warning("%s: cannot keep its SEL and audit trail in ConfigMap %s (they are kept in memory and "
                        "written when it can be): %s", self._who, self.name, _why(exc))
        else:
            log.debug("%s: ConfigMap %s still not written: %s", self._who, self.name, _why(exc))

    def _sync(self) -> None:
        """One write of both logs (merged with what the ConfigMap holds when it was not read yet or another
        writer got there first); nothing when the ConfigMap already holds them."""
        with self._sync_lock:  # start() and the writer thread
            self._sync_once()

    def _sync_once(self) -> None:
        for _ in range(CONFLICT_TRIES):
            if not self._read:
                self._load()
            sel, trail = self.sel.state(), self.trail.state()
            if (sel, trail) == self._synced:
                return
            self._attempts += 1
            tag = f"{self._writer}-{self._attempts}"
            self._attempt = (tag, sel, trail)
            try:
                if self._version is None:
                    owner = self._owner()
                    if owner is None:
                        raise NotKeptHere("its VirtualMachineBMC is not known yet (it owns the ConfigMap)")
                    body = config_map(self.namespace, self.name, owner, sel, trail)
                    body["metadata"]["annotations"] = {WRITE_ANNOTATION: tag}
                    answer = self.client.request("POST", f"/api/v1/namespaces/{self.namespace}/configmaps", body,
                                                 timeout=REQUEST_TIMEOUT)
                else:
                    annotations = {**(self._meta.get("annotations") or {}), WRITE_ANNOTATION: tag}
                    body = {"apiVersion": "v1", "kind": "ConfigMap",
                            "metadata": {**self._meta, "annotations": annotations, "resourceVersion": self._version},
                            "data": {SEL_KEY: sel_document(sel), AUDIT_KEY: audit_document(trail)}}
                    answer = self.client.request("PUT", self.path, body, timeout=REQUEST_TIMEOUT)
            except KubeError as exc:
                if exc.status in (404, 409):  # deleted, created or written by another: read again and merge
                    self._attempt = None
                    self._read = False
                    continue
                self._read = False  # a 5xx may have been written all the same: read before writing again
                raise
            except Unreachable:
                self._read = False  # it may have been written, the answer lost: `_load` tells by its tag
                raise
            self._attempt = None
            self._took(answer)
            self._synced = (sel, trail)
            self.writes += 1
            return
        raise NotKeptHere(f"{CONFLICT_TRIES} conflicting writes in a row")

    def _load(self) -> None:
        """Read the ConfigMap and merge it into the logs (the merge is the logs' state to write next). A write whose
        answer was lost is recognised by its tag (WRITE_ANNOTATION): when it was written, there is nothing to
        merge (merging would log its entries twice)."""
        try:
            found = self.client.request("GET", self.path, timeout=REQUEST_TIMEOUT)
        except KubeError as exc:
            if exc.status != 404:
                raise
            found = None
        attempt, self._attempt = self._attempt, None
        annotations = ((found or {}).get("metadata") or {}).get("annotations") or {}
        if attempt is not None and found is not None and annotations.get(WRITE_ANNOTATION) == attempt[0]:
            self._took(found)
            self._synced = attempt[1:]
            self._read = True
            self.writes += 1
            return
        if found is None:
            kept: tuple[SelState, TrailState] = (SelState(), TrailState())
            self._version, self._meta = None, {}
        else:
            labels = (found.get("metadata") or {}).get("labels") or {}
            if labels.get(MANAGED_BY) != MANAGER:
                raise NotOurs(f"ConfigMap {self.name} exists and is not managed by {MANAGER}; it is left alone")
            data = found.get("data") or {}
            try:
                kept = (read_sel(data.get(SEL_KEY)), read_trail(data.get(AUDIT_KEY)))
            except (ValueError, KeyError, TypeError) as exc:
                log.error("%s: ConfigMap %s cannot be read (%s); its logs start again from here", self._who,
                          self.name, exc)
                kept = (SelState(), TrailState())
            self._took(found)
        self.sel.adopt(kept[0], self._synced[0])
        self.trail.adopt(kept[1], self._synced[1])
        self._synced = kept
        self._read = True

    def _took(self, obj: Any) -> None:
        meta = (obj or {}).get("metadata") or {}
        self._version = str(meta.get("resourceVersion") or "") or None
        self._meta = {k: meta[k] for k in ("name", "namespace", "labels", "annotations", "ownerReferences")
                      if k in meta}


def _why(exc: Exception) -> str:
    """An error for a log line: the API's status and message, or why it could not be reached (never a body)."""
    if isinstance(exc, KubeError):
        return f"{exc.status} {exc.reason}: {exc.message}"
    return str(exc) or type(exc).__name__
