"""CDI's part of the simulated cluster: the DataVolume import controller.

A DataVolume goes Pending → ImportScheduled → ImportInProgress (progress "N.NN%") → Succeeded over
`import_delay`, with CDI's Bound, Ready and Running conditions and `status.claimName`: the PersistentVolumeClaim
CDI creates, of the DataVolume's name and owned by it (kubesim/storage.py binds it). Phases, reasons and messages follow
kubevirt/containerized-data-importer pkg/controller/datavolume (conditions.go, import-controller.go).

Network rule: kubesim never sends traffic outside loopback. An http(s) source whose host is a loopback literal
(127.0.0.0/8, ::1, or `localhost`, which is not resolved but taken as 127.0.0.1) is really fetched (the first
bytes, short timeout, off the store lock); any other host is never contacted, not even resolved through DNS, and
its import is simulated as a success.
"""

from __future__ import annotations

import http.client
import ipaddress
import logging
import ssl
import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

from . import errors
from .loop import ControlLoop
from .objects import clone, set_condition
from .store import DELETED, Event, Store

log = logging.getLogger(__name__)
Obj = dict[str, Any]

DV_KEY = "cdi.kubevirt.io/datavolumes"
CLAIM_KEY = "/persistentvolumeclaims"
PENDING, IMPORT_SCHEDULED, IMPORT_IN_PROGRESS = "Pending", "ImportScheduled", "ImportInProgress"
SUCCEEDED, FAILED = "Succeeded", "Failed"
FINAL_PHASES = (SUCCEEDED, FAILED)
PROBE_TIMEOUT = 2.0
MAX_REDIRECTS = 5

# Fractions of import_delay at which the importer pod is scheduled and starts transferring.
SCHEDULED_AT, TRANSFER_AT = 0.1, 0.25


def loopback_address(host: str | None) -> str | None:
    """The address to connect to when `host` is loopback, else None (and kubesim must not connect)."""
    if not host:
        return None
    if host.lower().rstrip(".") == "localhost":
        return "127.0.0.1"
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None  # a DNS name: never resolved, never contacted
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return str(addr) if addr.is_loopback else None


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    message: str = ""
    contacted: bool = False
    size: int | None = None  # the image's size, when the server states it


def probe(url: str, timeout: float = PROBE_TIMEOUT, ca_pem: str | None = None) -> ProbeResult:
    """Check that an http(s) import source answers, fetching only its first bytes, for loopback hosts only.

    Real CDI keeps retrying a failing import (restartCount grows, the phase stays ImportInProgress); kubesim
    fails fast so a test or a BMC sees the error at once.
    """
    for _ in range(MAX_REDIRECTS + 1):
        parts = urlsplit(url)
        address = loopback_address(parts.hostname)
        if address is None:
            # Not loopback: kubesim never connects; the import is simulated as a success.
            return ProbeResult(True, contacted=False)
        if parts.scheme not in ("http", "https"):
            return ProbeResult(False, f"unsupported scheme {parts.scheme!r}", contacted=False)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        conn: http.client.HTTPConnection
        if parts.scheme == "https":
            # As CDI's importer: the system's CAs plus the DataVolume's certConfigMap, and the URL's host name.
            context = ssl.create_default_context()
            if ca_pem:
                context.load_verify_locations(cadata=ca_pem)
            conn = http.client.HTTPSConnection(address, port, timeout=timeout, context=context)
        else:
            conn = http.client.HTTPConnection(address, port, timeout=timeout)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        try:
            conn.request("GET", path, headers={"Host": parts.netloc.rsplit("@", 1)[-1], "Range": "bytes=0-1023",
                                               "User-Agent": "kubesim-cdi-importer"})
            response = conn.getresponse()
            response.read(1024)
            status, reason, location = response.status, response.reason, response.getheader("Location")
            total = (response.getheader("Content-Range") or "").rpartition("/")[2]
            length = response.getheader("Content-Length") or ""
            size = int(total) if total.isdigit() else (int(length) if status == 200 and length.isdigit() else None)
        except ssl.SSLCertVerificationError as exc:
            return ProbeResult(False, f'HTTP request errored: Get "{url}": tls: failed to verify certificate: '
                                      f"x509: {exc.verify_message}", contacted=True)
        except (OSError, http.client.HTTPException) as exc:
            return ProbeResult(False, f'HTTP request errored: Get "{url}": {exc}', contacted=True)
        finally:
            conn.close()
        if status in (301, 302, 303, 307, 308) and location:
            url = urljoin(url, location)
            continue
        if status in (200, 206):
            return ProbeResult(True, contacted=True, size=size)
        return ProbeResult(False, f"expected status code 200, got {status}. Status: {status} {reason}",
                           contacted=True)
    return ProbeResult(False, "stopped after too many redirects", contacted=True)


def _claim_bytes(spec: Obj) -> int | None:
    """The usable bytes of the claim a DataVolume asks for (Filesystem mode: less CDI's 5.5% overhead)."""
    claim = spec.get("storage") or spec.get("pvc") or {}
    request = ((claim.get("resources") or {}).get("requests") or {}).get("storage")
    if not request:
        return None
    size = _bytes(str(request))
    if size is None:
        return None
    return int(size if claim.get("volumeMode") == "Block" else size * (1 - 0.055))


_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def _bytes(quantity: str) -> int | None:
    for suffix, factor in _SUFFIXES.items():
        if quantity.endswith(suffix):
            number = quantity[: -len(suffix)]
            return int(float(number) * factor) if number.replace(".", "", 1).isdigit() else None
    return int(quantity) if quantity.isdigit() else None


def desired_claim(dv: Obj) -> Obj:
    """The PersistentVolumeClaim CDI creates for a DataVolume: its storage request, access modes (ReadWriteOnce when
    the DataVolume names none), volume mode and class, owned by the DataVolume."""
    meta, spec = dv["metadata"], dv.get("spec") or {}
    wanted = spec.get("storage") or spec.get("pvc") or {}
    claim_spec: Obj = {"accessModes": list(wanted.get("accessModes") or ["ReadWriteOnce"]),
                       "resources": {"requests": dict((wanted.get("resources") or {}).get("requests") or {})},
                       "volumeMode": wanted.get("volumeMode") or "Filesystem"}
    if wanted.get("storageClassName"):
        claim_spec["storageClassName"] = wanted["storageClassName"]
    kind, url = import_source(spec)
    annotations = {"cdi.kubevirt.io/storage.import.endpoint": url} if kind == "http" else {}
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": meta["name"], "namespace": meta.get("namespace", ""),
                         "labels": {"app": "containerized-data-importer"}, "annotations": annotations,
                         "ownerReferences": [{"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
                                              "name": meta["name"], "uid": meta["uid"], "controller": True,
                                              "blockOwnerDeletion": True}]},
            "spec": claim_spec}


def import_source(spec: Obj) -> tuple[str, str]:
    """(kind, url): "http" with its url, "blank", or "other" (registry, s3, upload, clone…: simulated)."""
    source: Obj = spec["source"] if isinstance(spec.get("source"), dict) else {}
    if isinstance(source.get("http"), dict):
        return "http", str(source["http"].get("url") or "")
    if "blank" in source:
        return "blank", ""
    return "other", ""


def import_phase(elapsed: float, delay: float, kind: str) -> str:
    """The phase `elapsed` seconds after CDI first saw the DataVolume (before any failure)."""
    if elapsed < SCHEDULED_AT * delay:
        return PENDING
    if kind == "blank":
        # A blank image needs no transfer: the pod writes an empty disk and completes.
        return SUCCEEDED if elapsed >= TRANSFER_AT * delay else IMPORT_SCHEDULED
    if elapsed < TRANSFER_AT * delay:
        return IMPORT_SCHEDULED
    if elapsed < delay:
        return IMPORT_IN_PROGRESS
    return SUCCEEDED


def progress(elapsed: float, delay: float) -> str:
    span = max(delay * (1 - TRANSFER_AT), 1e-9)
    pct = min(max((elapsed - TRANSFER_AT * delay) / span, 0.0), 0.9999) * 100
    return f"{pct:.2f}%"


def datavolume_status(status: Obj, name: str, phase: str, elapsed: float, delay: float,
                      failure: str = "") -> Obj:
    """The status CDI's controller writes for `phase` (conditions as in conditions.go)."""
    out = dict(status)
    conditions = list(status.get("conditions") or [])
    out["claimName"] = name
    out.setdefault("restartCount", 0)
    if phase == PENDING:
        conditions = set_condition(conditions, "Bound", "False", "Pending", f"PVC {name} Pending")
    else:
        conditions = set_condition(conditions, "Bound", "True", "Bound", f"PVC {name} Bound")
    if phase in (PENDING, IMPORT_SCHEDULED):
        out["progress"] = "N/A"
        conditions = set_condition(conditions, "Ready", "False")
        conditions = set_condition(conditions, "Running", "False")
    elif phase == IMPORT_IN_PROGRESS:
        out["progress"] = progress(elapsed, delay)
        conditions = set_condition(conditions, "Ready", "False", "TransferRunning")
        conditions = set_condition(conditions, "Running", "True", "Pod is running")
    elif phase == SUCCEEDED:
        out["progress"] = "100.0%"
        conditions = set_condition(conditions, "Ready", "True")
        conditions = set_condition(conditions, "Running", "False", "Completed", "Import Complete")
    elif phase == FAILED:
        out.setdefault("progress", "N/A")
        conditions = set_condition(conditions, "Ready", "False")
        conditions = set_condition(conditions, "Running", "False", "Error", failure)
    out["phase"] = phase
    out["conditions"] = conditions
    return out


class DataVolumeImporter(ControlLoop):
    """CDI's import controller and importer pod, for DataVolumes."""

    name = "cdi-import-controller"
    kinds = (DV_KEY,)
    manager = "cdi-controller"

    def __init__(self, store: Store, import_delay: float) -> None:
        # Two workers: a probe of a slow loopback server must not hold up every other import.
        super().__init__(store, workers=2)
        self.delay = import_delay
        self._seen: dict[str, float] = {}  # DataVolume uid → when CDI first saw it
        self._probed: dict[str, ProbeResult] = {}

    def _ca_bundle(self, ns: str, dv: Obj) -> str | None:
        """The PEM data of the DataVolume's http.certConfigMap (CDI mounts every key as a file of CAs)."""
        name = (((dv.get("spec") or {}).get("source") or {}).get("http") or {}).get("certConfigMap")
        if not name:
            return None
        try:
            cm = self.store.find(self.store.type("/configmaps"), ns, str(name))
        except KeyError:
            return None
        return "\n".join(str(v) for v in ((cm or {}).get("data") or {}).values()) or None

    def _ensure_claim(self, ns: str, dv: Obj) -> None:
        """The claim the import writes into: named as its DataVolume and owned by it, so that deleting the
        DataVolume deletes the claim (pkg/controller/datavolume: newPersistentVolumeClaim)."""
        try:
            rtype = self.store.type(CLAIM_KEY)
        except KeyError:
            return
        name = dv["metadata"]["name"]
        if self.store.find(rtype, ns, name) is not None:
            return
        try:
            self.store.create(rtype, desired_claim(dv), namespace=ns, manager=self.manager)
        except errors.ApiError as exc:
            if exc.code != 409:
                raise

    def keys_for(self, event: Event) -> Iterable[Hashable]:
        meta = event.obj["metadata"]
        if event.type == DELETED:
            self._seen.pop(meta.get("uid", ""), None)
            self._probed.pop(meta.get("uid", ""), None)
            return []
        return [(meta.get("namespace", ""), meta["name"])]

    def sync(self, key: Hashable) -> float | None:
        assert isinstance(key, tuple)
        ns, name = key
        try:
            rtype = self.store.type(DV_KEY)
        except KeyError:
            return 0.5
        dv = self.store.find(rtype, ns, name)
        if dv is None or dv["metadata"].get("deletionTimestamp"):
            return None
        status: Obj = dv["status"] if isinstance(dv.get("status"), dict) else {}
        if status.get("phase") in FINAL_PHASES:
            return None
        uid = dv["metadata"]["uid"]
        self._ensure_claim(ns, dv)
        elapsed = time.monotonic() - self._seen.setdefault(uid, time.monotonic())
        kind, url = import_source(dv.get("spec") or {})
        phase = import_phase(elapsed, self.delay, kind)
        failure = ""
        if phase in (IMPORT_IN_PROGRESS, SUCCEEDED) and kind == "http":
            result = self._probed.get(uid)
            if result is None:
                result = self._probed[uid] = probe(url, ca_pem=self._ca_bundle(ns, dv))  # I/O: off the lock
                log.info("datavolume %s/%s: source %s %s", ns, name, url,
                         ("reachable" if result.ok else f"failed: {result.message}") if result.contacted
                         else "not contacted (not loopback): import simulated")
            claim = _claim_bytes(dv.get("spec") or {})
            if not result.ok:
                phase, failure = FAILED, result.message
            elif result.size is not None and claim is not None and result.size > claim:
                # CDI's importer (pkg/importer/data-processor.go): the image does not fit the claim.
                phase, failure = FAILED, (f"Virtual image size {result.size} is larger than the reported available "
                                          f"storage {claim}. A larger PVC is required.")
        new_status = datavolume_status(status, name, phase, elapsed, self.delay, failure)
        if new_status != status:
            self.store.mutate(rtype, ns, name, lambda o: o.__setitem__("status", clone(new_status)),
                              subresource="status", manager=self.manager)
        if phase in FINAL_PHASES:
            return None
        step = self.delay / 5 if phase == IMPORT_IN_PROGRESS else self.delay * 0.05
        return max(step, 0.02)


def install(cluster: Any) -> None:
    """Register CDI's import controller with `cluster`."""
    cluster.add_component(DataVolumeImporter(cluster.store, cluster.config.import_delay))
