"""CDI's part of the simulated cluster: the DataVolume import controller and its importer.

A DataVolume goes Pending → ImportScheduled → ImportInProgress (progress "N.NN%") → Succeeded over
`import_delay`, with CDI's Bound, Ready and Running conditions and `status.claimName`: the PersistentVolumeClaim
CDI creates, of the DataVolume's name and owned by it (kubesim/storage.py binds it). Phases, reasons and messages follow
kubevirt/containerized-data-importer pkg/controller/datavolume (conditions.go, import-controller.go).

The claim's bytes are a file (kubesim/volumes.py, `<state_dir>/volumes/<namespace>/<claim>.img`), put in place
just before the DataVolume turns Succeeded, never before, and never half-written:
- an http(s) source on loopback is really imported: the importer downloads the whole body (following redirects,
  verifying https with the system's CAs and the certConfigMap's), streaming it in chunks into a temporary file
  beside the claim's file, bounded by the claim's usable size, each read with a timeout. A qcow2 image (magic
  `QFI\xfb`) is converted to raw with `qemu-img convert -O raw`, as CDI's importer writes a raw `disk.img`; without
  qemu-img installed, the qcow2 bytes are kept as they are, with a warning (the guest would see the qcow2
  container). A qcow2 image with a backing file or an external data file is refused, as CDI refuses a backing file.
  The download starts when CDI first sees the DataVolume, in a thread of its own (off the store lock and off the
  controller's workers); its outcome shows when the phases get there: the DataVolume stays ImportInProgress until
  both the download is complete and `import_delay` has passed; a failed download that began before
  ImportInProgress is tried once more, if the source answers CDI's probe (as CDI restarts its importer pod), so
  that a server started after its DataVolume was created still serves the import. An image larger than the claim,
  a download failing midway, a stalled server (no byte for DOWNLOAD_READ_TIMEOUT) fail the DataVolume and leave no
  file. A server answering a request without Range with 206 (a test double stating the size of an image it does
  not serve) gets a file of the stated total size: the bytes it sent at their offsets, the rest zeros.
- an upload source is CDI's upload (kubesim/upload.py): Pending → UploadScheduled → UploadReady, where it stays until
  a client has streamed the image through the upload proxy, which writes the claim's file; then Succeeded (progress
  "100.0%"). The claim carries CDI's annotations: `storage.upload.target` (an upload target), and the upload pod's
  phase and readiness (`storage.pod.phase` Pending/Running/Succeeded, `storage.pod.ready`), which the proxy reads as
  CDI's does (pkg/controller/datavolume/upload-controller.go, pkg/uploadproxy/uploadproxy.go).
- every other source is simulated, and its file is a stand-in: a sparse file (all zeros) of the claim's requested
  size, for a `blank` image (what CDI writes too), an http(s) source whose host is not loopback, and every source
  kubesim does not implement (registry, s3, clone...).
When the controller is built without volume files (`volumes=None`), no file is written, as before.

Network rule: kubesim never sends traffic outside loopback. An http(s) source whose host is a loopback literal
(127.0.0.0/8, ::1, or `localhost`, which is not resolved but taken as 127.0.0.1) is really fetched: the whole image
by the importer's thread, and its first bytes, with a short timeout, by the controller's sync at ImportInProgress
(which reports an unreachable source as before). Any other host is never contacted, not even resolved through DNS,
nor is a redirect to one followed, and its import is simulated as a success.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import logging
import re
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import time
import traceback
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

from . import errors
from .loop import ControlLoop
from .objects import clone, set_condition
from .store import DELETED, Event, Store
from .volumes import VolumeFiles, quantity_bytes

log = logging.getLogger(__name__)
Obj = dict[str, Any]

DV_KEY = "cdi.kubevirt.io/datavolumes"
CLAIM_KEY = "/persistentvolumeclaims"
PENDING, IMPORT_SCHEDULED, IMPORT_IN_PROGRESS = "Pending", "ImportScheduled", "ImportInProgress"
UPLOAD_SCHEDULED, UPLOAD_READY = "UploadScheduled", "UploadReady"
SUCCEEDED, FAILED = "Succeeded", "Failed"
FINAL_PHASES = (SUCCEEDED, FAILED)
PROBE_TIMEOUT = 2.0
MAX_REDIRECTS = 5
# The importer's download: connecting (loopback), then each read of the body; a server that sends nothing for this
# long fails the import (CDI's importer: "i/o timeout").
CONNECT_TIMEOUT = PROBE_TIMEOUT
DOWNLOAD_READ_TIMEOUT = 30.0
CHUNK = 1 << 20  # bytes copied at a time: the download's memory
QCOW2_MAGIC = b"QFI\xfb"
TRANSFER_FAILED = "Unable to transfer source data to target file"

# Fractions of import_delay at which the importer pod is scheduled and starts transferring (an upload pod: is
# scheduled, and is ready to take the upload).
SCHEDULED_AT, TRANSFER_AT = 0.1, 0.25
# CDI's annotations on an upload's claim (pkg/controller/common/util.go): it is an upload target, and the upload
# pod's phase and readiness, which the upload proxy reads (kubesim/upload.py).
UPLOAD_TARGET = "cdi.kubevirt.io/storage.upload.target"
POD_PHASE = "cdi.kubevirt.io/storage.pod.phase"
POD_READY = "cdi.kubevirt.io/storage.pod.ready"


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


class _NotLoopback(Exception):
    """The source (or a redirect) names a host kubesim must not contact."""


_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/?#@\s\"']*@")


def redacted(text: str) -> str:
    """`text` with the user and password taken out of every URL in it (`https://user:pw@host/x` becomes
    `https://host/x`): what goes into kubesim's log of a source URL, or of an error naming one."""
    return _USERINFO.sub(r"\1", text)


class SourceError(Exception):
    def __init__(self, message: str, contacted: bool = True) -> None:
        super().__init__(message)
        self.message = message
        self.contacted = contacted


@dataclass
class _Answer:
    url: str  # the URL that answered, after redirects
    conn: http.client.HTTPConnection
    response: http.client.HTTPResponse
    sock: socket.socket | None  # the connection's socket (http.client drops it from `conn` for an HTTP/1.0 reply)


def _open(url: str, headers: dict[str, str], timeout: float, ca_pem: str | None) -> _Answer:
    """GET `url` from a loopback host, following redirects (to loopback hosts only), to a 200 or 206 response.
    Raises _NotLoopback before contacting any other host, SourceError with CDI's message for every other
    failure."""
    for _ in range(MAX_REDIRECTS + 1):
        parts = urlsplit(url)
        address = loopback_address(parts.hostname)
        if address is None:
            raise _NotLoopback(url)
        if parts.scheme not in ("http", "https"):
            raise SourceError(f"unsupported scheme {parts.scheme!r}", contacted=False)
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
            conn.request("GET", path, headers={"Host": parts.netloc.rsplit("@", 1)[-1],
                                               "User-Agent": "kubesim-cdi-importer", **headers})
            sock = conn.sock
            response = conn.getresponse()
        except ssl.SSLCertVerificationError as exc:
            conn.close()
            raise SourceError(f'HTTP request errored: Get "{url}": tls: failed to verify certificate: '
                              f"x509: {exc.verify_message}") from exc
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise SourceError(f'HTTP request errored: Get "{url}": {exc}') from exc
        status, reason, location = response.status, response.reason, response.getheader("Location")
        if status in (200, 206):
            return _Answer(url, conn, response, sock)
        conn.close()
        if status in (301, 302, 303, 307, 308) and location:
            url = urljoin(url, location)
            continue
        raise SourceError(f"expected status code 200, got {status}. Status: {status} {reason}")
    raise SourceError("stopped after too many redirects")


def _stated_size(response: http.client.HTTPResponse) -> int | None:
    """The image's size as the response states it: a 206's Content-Range total, a 200's Content-Length."""
    total = (response.getheader("Content-Range") or "").rpartition("/")[2]
    length = response.getheader("Content-Length") or ""
    if total.isdigit():
        return int(total)
    return int(length) if response.status == 200 and length.isdigit() else None


def probe(url: str, timeout: float = PROBE_TIMEOUT, ca_pem: str | None = None) -> ProbeResult:
    """Check that an http(s) import source answers, fetching only its first bytes, for loopback hosts only.

    Real CDI keeps retrying a failing import (restartCount grows, the phase stays ImportInProgress); kubesim
    fails fast so a test or a BMC sees the error at once.
    """
    try:
        answer = _open(url, {"Range": "bytes=0-1023"}, timeout, ca_pem)
    except _NotLoopback:
        # Not loopback: kubesim never connects; the import is simulated as a success.
        return ProbeResult(True, contacted=False)
    except SourceError as exc:
        return ProbeResult(False, exc.message, contacted=exc.contacted)
    try:
        answer.response.read(1024)
        size = _stated_size(answer.response)
    except (OSError, http.client.HTTPException) as exc:
        return ProbeResult(False, f'HTTP request errored: Get "{answer.url}": {exc}', contacted=True)
    finally:
        answer.response.close()
        answer.conn.close()
    return ProbeResult(True, contacted=True, size=size)


def qemu_img_command() -> str | None:
    """The qemu-img that converts qcow2 images to raw (None: not installed)."""
    return shutil.which("qemu-img")


def too_large(size: int, available: int) -> str:
    """CDI's importer (pkg/importer/data-processor.go): the image does not fit the claim."""
    return (f"Virtual image size {size} is larger than the reported available storage {available}. "
            "A larger PVC is required.")


class _Cancelled(Exception):
    pass


class Download:
    """CDI's importer pod for one DataVolume with a loopback http(s) source: downloads the image into a temporary
    file beside the claim's file (kubesim/volumes.py), in a thread of its own. When it ends, `path` is the complete
    raw image (for the controller to install when the DataVolume turns Succeeded) or `failure` says why not (and no
    file is left); `on_done` is called either way."""

    def __init__(self, volumes: VolumeFiles, namespace: str, claim: str, url: str, ca_pem: str | None,
                 limit: int, on_done: Callable[[], None]) -> None:
        self.volumes, self.namespace, self.claim = volumes, namespace, claim
        self.url, self.ca_pem, self.limit = url, ca_pem, limit
        self.on_done = on_done
        self.path: Path | None = None
        self.failure = ""
        self.received = 0
        self.total: int | None = None
        self.in_transfer = False  # started once the import was in its transfer phase (ImportInProgress)
        self._files: list[Path] = []  # temporary files this download made and has not handed over
        self._lock = threading.Lock()
        self._finished = False
        self._cancelled = threading.Event()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.thread = threading.Thread(target=self._run, name=f"cdi-importer-{namespace}/{claim}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def finished(self) -> bool:
        with self._lock:
            return self._finished

    def cancel(self) -> None:
        """Stop the download (its DataVolume is gone): its temporary files are removed, now if it has ended, else by
        its thread as it stops (a blocked read is woken by shutting the socket down)."""
        with self._lock:
            self._cancelled.set()
            files, self._files = (self._files, []) if self._finished else ([], self._files)
            if self._finished:
                self.path = None
            sock, proc = self._sock, self._proc
        for path in files:
            self.volumes.discard(path)
        if sock is not None:
            with contextlib.suppress(OSError, ValueError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)  # wakes a blocked read (TLS too: the raw socket)
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()

    def hand_over(self) -> Path | None:
        """The complete image's temporary file, now the caller's to install (or discard)."""
        with self._lock:
            path, self.path = self.path, None
            self._files = [f for f in self._files if f != path]
            return path

    def _new_file(self) -> Path:
        path = self.volumes.temporary(self.namespace, self.claim)
        with self._lock:
            self._files.append(path)
        return path

    def _drop_file(self, path: Path) -> None:
        with self._lock:
            self._files = [f for f in self._files if f != path]
        self.volumes.discard(path)

    def _run(self) -> None:
        try:
            self.path = self._transfer()
        except _Cancelled:
            pass
        except SourceError as exc:
            self.failure = exc.message
        except _NotLoopback as exc:
            self.failure = f'HTTP request errored: Get "{exc}": redirected to a host that is not loopback'
        except Exception as exc:
            if not self._cancelled.is_set():
                log.warning("datavolume %s/%s: import failed: %s", self.namespace, self.claim,
                            redacted("".join(traceback.format_exception(exc))))
            self.failure = f"{TRANSFER_FAILED}: {exc}"
        with self._lock:
            self._finished = True
            if self._cancelled.is_set() or self.failure:
                files, self._files, self.path = self._files, [], None
            else:
                files = []
        for path in files:
            self.volumes.discard(path)
        if self.failure and not self._cancelled.is_set():
            log.info("datavolume %s/%s: import from %s failed: %s", self.namespace, self.claim, redacted(self.url),
                     redacted(self.failure))
        self.on_done()

    def _transfer(self) -> Path:
        target = self._new_file()
        with self._lock:
            if self._cancelled.is_set():
                raise _Cancelled
        answer = _open(self.url, {}, CONNECT_TIMEOUT, self.ca_pem)
        try:
            with self._lock:
                self._sock = answer.sock
                if self._cancelled.is_set():
                    raise _Cancelled
            end = self._copy(answer, target)
        finally:
            with self._lock:
                self._sock = None
            answer.response.close()
            answer.conn.close()
        if self._cancelled.is_set():
            raise _Cancelled
        with open(target, "rb") as fh:
            header = fh.read(104)
        if end > 0 and header.startswith(QCOW2_MAGIC):
            return self._qcow2_to_raw(answer.url, target, header)
        return target

    def _copy(self, answer: _Answer, target: Path) -> int:
        """Stream the body into `target` (CHUNK bytes at a time); returns the file's final size."""
        url, response = answer.url, answer.response
        offset = 0
        expected = response.length  # this response's body, when stated (http.client counts it down)
        if response.status == 206:
            # Never asked for: a server that sends part of the image anyway (see the module's docstring).
            match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", response.getheader("Content-Range") or "")
            offset = int(match.group(1)) if match else 0
        self.total = _stated_size(response)
        if self.total is not None and self.total > self.limit:
            raise SourceError(too_large(self.total, self.limit))
        if answer.sock is not None:
            answer.sock.settimeout(DOWNLOAD_READ_TIMEOUT)
        buffer = memoryview(bytearray(CHUNK))
        written = offset
        with open(target, "r+b") as fh:
            fh.seek(offset)
            while True:
                if self._cancelled.is_set():
                    raise _Cancelled
                try:
                    n = response.readinto(buffer)
                except TimeoutError as exc:
                    raise SourceError(f"{TRANSFER_FAILED}: read {url}: i/o timeout") from exc
                except (OSError, http.client.HTTPException, ValueError) as exc:
                    if self._cancelled.is_set():
                        raise _Cancelled from exc
                    raise SourceError(f"{TRANSFER_FAILED}: unexpected EOF") from exc
                if not n:
                    break
                written += n
                if written > self.limit:
                    raise SourceError(too_large(max(written, self.total or 0), self.limit))
                fh.write(buffer[:n])
                self.received = written - offset
            if self._cancelled.is_set():
                raise _Cancelled
            if expected is not None and response.length:
                # The connection closed before the body it announced was complete.
                raise SourceError(f"{TRANSFER_FAILED}: unexpected EOF")
            if self.total is not None and self.total > written:
                fh.truncate(self.total)
                written = self.total
        return written

    def _qcow2_to_raw(self, url: str, image: Path, header: bytes) -> Path:
        """What CDI's importer does with a qcow2 image: validate it (no backing file), check its virtual size
        against the claim and convert it to raw (qemu-img convert -O raw)."""
        if len(header) < 32:
            raise SourceError(f"{TRANSFER_FAILED}: qcow2 header truncated")
        version, backing_offset, backing_size = struct.unpack(">IQI", header[4:20])
        virtual_size = struct.unpack(">Q", header[24:32])[0]
        if backing_offset:
            with open(image, "rb") as fh:
                fh.seek(backing_offset)
                backing = fh.read(min(backing_size, 1023)).decode(errors="replace")
            raise SourceError(f"Image {url} is invalid because it has backing file {backing}")
        if version >= 3 and len(header) >= 80 and struct.unpack(">Q", header[72:80])[0] & 0x4:
            raise SourceError(f"Image {url} is invalid because it has an external data file")
        if virtual_size > self.limit:
            raise SourceError(too_large(virtual_size, self.limit))
        qemu_img = qemu_img_command()
        if qemu_img is None:
            log.warning("datavolume %s/%s: %s is a qcow2 image and qemu-img is not installed: its file keeps the "
                        "qcow2 bytes, not converted to raw", self.namespace, self.claim, redacted(url))
            return image
        raw = self._new_file()
        command = [qemu_img, "convert", "-f", "qcow2", "-O", "raw", str(image), str(raw)]
        with self._lock:
            if self._cancelled.is_set():
                raise _Cancelled
            self._proc = proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                 stderr=subprocess.PIPE)
        _, stderr = proc.communicate()
        with self._lock:
            self._proc = None
        if self._cancelled.is_set():
            raise _Cancelled
        if proc.returncode != 0:
            raise SourceError(f"{TRANSFER_FAILED}: could not convert image to raw: "
                              f"{stderr.decode(errors='replace').strip()}")
        self._drop_file(image)
        return raw


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


def _bytes(quantity: str) -> int | None:
    return quantity_bytes(quantity)


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
    if kind == "upload":
        annotations = {UPLOAD_TARGET: ""}  # the upload controller's updateAnnotations
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": meta["name"], "namespace": meta.get("namespace", ""),
                         "labels": {"app": "containerized-data-importer"}, "annotations": annotations,
                         "ownerReferences": [{"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
                                              "name": meta["name"], "uid": meta["uid"], "controller": True,
                                              "blockOwnerDeletion": True}]},
            "spec": claim_spec}


def import_source(spec: Obj) -> tuple[str, str]:
    """(kind, url): "http" with its url, "blank", "upload", or "other" (registry, s3, clone…: simulated)."""
    source: Obj = spec["source"] if isinstance(spec.get("source"), dict) else {}
    if isinstance(source.get("http"), dict):
        return "http", str(source["http"].get("url") or "")
    if "blank" in source:
        return "blank", ""
    if "upload" in source:
        return "upload", ""
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


def upload_phase(elapsed: float, delay: float, uploaded: bool) -> str:
    """An upload DataVolume's phase: its pod scheduled, then ready (UploadReady) until an upload has completed."""
    if uploaded:
        return SUCCEEDED
    if elapsed < SCHEDULED_AT * delay:
        return PENDING
    return UPLOAD_SCHEDULED if elapsed < TRANSFER_AT * delay else UPLOAD_READY


def upload_pod(phase: str) -> tuple[str, str] | None:
    """The upload pod's (phase, ready) annotations on the claim in a DataVolume phase (None: no pod yet)."""
    return {UPLOAD_SCHEDULED: ("Pending", "false"), UPLOAD_READY: ("Running", "true")}.get(phase)


def progress(elapsed: float, delay: float) -> str:
    span = max(delay * (1 - TRANSFER_AT), 1e-9)
    pct = min(max((elapsed - TRANSFER_AT * delay) / span, 0.0), 0.9999) * 100
    return f"{pct:.2f}%"


def datavolume_status(status: Obj, name: str, phase: str, elapsed: float, delay: float,
                      failure: str = "", complete: str = "Import Complete") -> Obj:
    """The status CDI's controller writes for `phase` (conditions as in conditions.go)."""
    out = dict(status)
    conditions = list(status.get("conditions") or [])
    out["claimName"] = name
    out.setdefault("restartCount", 0)
    if phase == PENDING:
        conditions = set_condition(conditions, "Bound", "False", "Pending", f"PVC {name} Pending")
    else:
        conditions = set_condition(conditions, "Bound", "True", "Bound", f"PVC {name} Bound")
    if phase in (PENDING, IMPORT_SCHEDULED, UPLOAD_SCHEDULED):
        out["progress"] = "N/A"
        conditions = set_condition(conditions, "Ready", "False")
        conditions = set_condition(conditions, "Running", "False")
    elif phase == UPLOAD_READY:
        out["progress"] = "N/A"  # CDI reports no progress of an upload
        conditions = set_condition(conditions, "Ready", "False")
        conditions = set_condition(conditions, "Running", "True", "Pod is running")
    elif phase == IMPORT_IN_PROGRESS:
        out["progress"] = progress(elapsed, delay)
        conditions = set_condition(conditions, "Ready", "False", "TransferRunning")
        conditions = set_condition(conditions, "Running", "True", "Pod is running")
    elif phase == SUCCEEDED:
        out["progress"] = "100.0%"
        conditions = set_condition(conditions, "Ready", "True")
        conditions = set_condition(conditions, "Running", "False", "Completed", complete)
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

    def __init__(self, store: Store, import_delay: float, volumes: VolumeFiles | None = None) -> None:
        # Two workers: a probe of a slow loopback server must not hold up every other import. Downloads run in
        # threads of their own.
        super().__init__(store, workers=2)
        self.delay = import_delay
        self.volumes = volumes  # None: no volume files are written
        self._seen: dict[str, float] = {}  # DataVolume uid → when CDI first saw it
        self._probed: dict[str, ProbeResult] = {}
        self._downloads: dict[str, tuple[tuple[str, str], Download]] = {}  # DataVolume uid → (its key, download)
        self._downloads_lock = threading.Lock()

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

    def _claim(self, ns: str, name: str) -> Obj | None:
        """The DataVolume's claim, unless it is being deleted."""
        try:
            claim = self.store.find(self.store.type(CLAIM_KEY), ns, name)
        except KeyError:
            return None
        return None if claim is None or claim["metadata"].get("deletionTimestamp") else claim

    def keys_for(self, event: Event) -> Iterable[Hashable]:
        meta = event.obj["metadata"]
        key = (meta.get("namespace", ""), meta["name"])
        if event.type == DELETED:
            uid = meta.get("uid", "")
            self._seen.pop(uid, None)
            self._probed.pop(uid, None)
            # Its download is stopped and its files removed by the sync this key gets (no I/O here: under the lock).
            return [key] if self._downloads else []
        return [key]

    # ---- downloads

    def _download(self, key: tuple[str, str], uid: str, url: str, dv: Obj, limit: int,
                  in_transfer: bool) -> Download:
        """The DataVolume's download, started on the first call (`in_transfer`: in the import's transfer phase)."""
        assert self.volumes is not None
        with self._downloads_lock:
            entry = self._downloads.get(uid)
            if entry is not None:
                return entry[1]
            ns, name = key
            download = Download(self.volumes, ns, name, url, self._ca_bundle(ns, dv), limit,
                                on_done=lambda: self.enqueue(key))
            download.in_transfer = in_transfer
            self._downloads[uid] = (key, download)
        log.info("datavolume %s/%s: importing %s", ns, name, redacted(url))
        download.start()
        return download

    def _forget_downloads(self, key: tuple[str, str], keep: str | None) -> None:
        """Stop the downloads of DataVolumes of this key other than the one of uid `keep` (deleted ones)."""
        with self._downloads_lock:
            gone = [uid for uid, (k, _) in self._downloads.items() if k == key and uid != keep]
            stopped = [self._downloads.pop(uid)[1] for uid in gone]
        for download in stopped:
            download.cancel()

    def _drop_download(self, uid: str) -> None:
        with self._downloads_lock:
            entry = self._downloads.pop(uid, None)
        if entry is not None:
            entry[1].cancel()

    def _place_volume(self, ns: str, name: str, dv: Obj, claim: Obj, download: Download | None) -> bool:
        """Put the claim's file in place as the import completes: the downloaded image, or a sparse stand-in of the
        claim's requested size. False when it could not be (the claim went meanwhile: the next sync makes a new
        one and imports again)."""
        assert self.volumes is not None
        claim_uid = claim["metadata"]["uid"]
        if self.volumes.holds(ns, name, claim_uid):
            return True
        if download is not None:
            path = download.hand_over()
            self._drop_download(dv["metadata"]["uid"])
            if path is None:
                return False
        else:
            request = (((claim.get("spec") or {}).get("resources") or {}).get("requests") or {}).get("storage")
            size = quantity_bytes(request)
            if size is None:
                log.warning("datavolume %s/%s: its claim requests no size: no volume file", ns, name)
                return True
            path = self.volumes.sparse(ns, name, size)

        def wanted() -> bool:
            current = self._claim(ns, name)
            return current is not None and current["metadata"]["uid"] == claim_uid

        return self.volumes.install(path, ns, name, claim_uid, wanted)

    def stop(self) -> None:
        super().stop()  # no sync starts a download from now on
        with self._downloads_lock:
            downloads = [d for _, d in self._downloads.values()]
            self._downloads.clear()
        for download in downloads:
            download.cancel()
        deadline = time.monotonic() + 5
        for download in downloads:
            if download.thread.is_alive():
                download.thread.join(timeout=max(deadline - time.monotonic(), 0.01))

    # ---- the controller

    def sync(self, key: Hashable) -> float | None:
        assert isinstance(key, tuple)
        ns, name = key
        try:
            rtype = self.store.type(DV_KEY)
        except KeyError:
            return 0.5
        dv = self.store.find(rtype, ns, name)
        if dv is None or dv["metadata"].get("deletionTimestamp"):
            self._forget_downloads(key, keep=None)
            return None
        uid = dv["metadata"]["uid"]
        self._forget_downloads(key, keep=uid)
        status: Obj = dv["status"] if isinstance(dv.get("status"), dict) else {}
        if status.get("phase") in FINAL_PHASES:
            return None
        self._ensure_claim(ns, dv)
        elapsed = time.monotonic() - self._seen.setdefault(uid, time.monotonic())
        kind, url = import_source(dv.get("spec") or {})
        if kind == "upload":
            return self._sync_upload(rtype, ns, name, dv, status, elapsed)
        phase = import_phase(elapsed, self.delay, kind)
        failure = ""
        claim_size = _claim_bytes(dv.get("spec") or {})
        claim = self._claim(ns, name) if self.volumes is not None else None
        download: Download | None = None
        transferring = phase in (IMPORT_IN_PROGRESS, SUCCEEDED)
        if (kind == "http" and self.volumes is not None and claim is not None and claim_size is not None
                and loopback_address(urlsplit(url).hostname) is not None
                and not self.volumes.holds(ns, name, claim["metadata"]["uid"])):
            # The importer: the whole image into a temporary file, in a thread of its own, from the moment CDI
            # sees the DataVolume (its outcome shows when the phases get there).
            download = self._download(key, uid, url, dv, claim_size, transferring)
        if transferring and kind == "http":
            result = self._probed.get(uid)
            if result is None:
                result = self._probed[uid] = probe(url, ca_pem=self._ca_bundle(ns, dv))  # I/O: off the lock
                log.info("datavolume %s/%s: source %s %s", ns, name, redacted(url),
                         ("reachable" if result.ok else f"failed: {redacted(result.message)}") if result.contacted
                         else "not contacted (not loopback): import simulated")
            if not result.ok:
                phase, failure = FAILED, result.message
            elif result.size is not None and claim_size is not None and result.size > claim_size:
                phase, failure = FAILED, too_large(result.size, claim_size)
            elif not result.contacted:
                download = None  # redirected away from loopback: simulated, a stand-in file
                self._drop_download(uid)
            elif download is not None:
                if download.finished and download.failure and not download.in_transfer and claim_size is not None:
                    # It began before the transfer's time, and the source answers CDI's probe now: once more, as
                    # CDI restarts its importer pod.
                    self._drop_download(uid)
                    download = self._download(key, uid, url, dv, claim_size, True)
                if not download.finished:
                    phase = IMPORT_IN_PROGRESS  # the transfer takes what it takes, whatever import_delay says
                elif download.failure:  # read after `finished`: final by then
                    phase, failure = FAILED, download.failure
        if phase == FAILED:
            self._drop_download(uid)  # stopped, its files removed
        if (phase == SUCCEEDED and self.volumes is not None
                and (claim is None or not self._place_volume(ns, name, dv, claim, download))):
            return 0.2  # the claim is not there (yet): Succeeded waits for its file
        new_status = datavolume_status(status, name, phase, elapsed, self.delay, failure)
        if new_status != status:
            self.store.mutate(rtype, ns, name, lambda o: o.__setitem__("status", clone(new_status)),
                              subresource="status", manager=self.manager)
        if phase in FINAL_PHASES:
            return None
        step = self.delay / 5 if phase == IMPORT_IN_PROGRESS else self.delay * 0.05
        return max(step, 0.02)


    # ---- uploads (the upload proxy, kubesim/upload.py, writes the claim's file)

    def _sync_upload(self, rtype: Any, ns: str, name: str, dv: Obj, status: Obj, elapsed: float) -> float | None:
        """CDI's upload controller: the upload pod is scheduled, then ready for the upload proxy, whose completed
        upload (the claim annotated with the pod Succeeded, its file in place) makes the DataVolume Succeeded."""
        claim = self._claim(ns, name)
        annotations = ((claim or {}).get("metadata") or {}).get("annotations") or {}
        phase = upload_phase(elapsed, self.delay, annotations.get(POD_PHASE) == "Succeeded")
        pod = upload_pod(phase)
        if claim is not None and pod is not None:
            self._annotate_upload_pod(ns, name, pod)
        if (phase == SUCCEEDED and self.volumes is not None
                and (claim is None or not self._place_volume(ns, name, dv, claim, None))):
            return 0.2
        new_status = datavolume_status(status, name, phase, elapsed, self.delay, complete="Upload Complete")
        if new_status != status:
            self.store.mutate(rtype, ns, name, lambda o: o.__setitem__("status", clone(new_status)),
                              subresource="status", manager=self.manager)
        if phase in (SUCCEEDED, UPLOAD_READY):
            return None  # done, or ready until the upload proxy tells of an upload (upload_completed)
        return max(self.delay * 0.05, 0.02)

    def _annotate_upload_pod(self, ns: str, name: str, pod: tuple[str, str]) -> None:
        def annotate(claim: Obj) -> bool:
            found = claim["metadata"].setdefault("annotations", {})
            if found.get(POD_PHASE) == "Succeeded" or (found.get(POD_PHASE), found.get(POD_READY)) == pod:
                return False  # the upload's end is the proxy's to write
            found[POD_PHASE], found[POD_READY] = pod
            return True

        self.store.mutate(self.store.type(CLAIM_KEY), ns, name, annotate, manager=self.manager, only="metadata")

    def upload_completed(self, ns: str, name: str) -> None:
        """From the upload proxy: the claim's upload is complete (its file installed, the pod Succeeded)."""
        self.enqueue((ns, name))


def install(cluster: Any) -> None:
    """Register CDI's import controller with `cluster`, writing into the cluster's volume files (CDI's upload API and
    proxy, kubesim/upload.py, are installed after it)."""
    cluster.add_component(DataVolumeImporter(cluster.store, cluster.config.import_delay,
                                             getattr(cluster, "volumes", None)))
