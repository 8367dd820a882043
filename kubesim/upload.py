"""CDI's upload, as a client sees it: the UploadTokenRequest API (cdi-apiserver) and the upload proxy
(cdi-uploadproxy), writing into the claims of DataVolumes with an upload source (kubesim/cdi.py runs their phases).

What CDI does, and kubesim with it (kubevirt/containerized-data-importer: pkg/apiserver/apiserver.go uploadHandler,
pkg/token/token.go, pkg/uploadproxy/uploadproxy.go, pkg/uploadserver/uploadserver.go, pkg/common/common.go):
- `POST /apis/upload.cdi.kubevirt.io/v1beta1/namespaces/<ns>/uploadtokenrequests` with `{"spec": {"pvcName": P}}`
  answers 200 with the request and `status.token`: a JWT (PS256, issuer "cdi-apiserver", five minutes) whose
  claims name the operation ("Upload"), the claim (`name`, `namespace`) and the resource (`persistentvolumeclaims`).
  CDI does not look at the claim then (nor does kubesim): the proxy does.
- The proxy serves HTTPS with a certificate of its own CA (CDI's `cdi-uploadproxy-signer`, not the cluster's), on a
  loopback address here. kubesim publishes where it is as CDI's config controller does: in the CDIConfig `config`,
  `status.uploadProxyURL` (a host:port, no scheme, as an Ingress or Route host is given) and `status.uploadProxyCA`
  (the PEM that verifies it).
- `POST /v1beta1/upload` (sync: answered once the image is written) or `/v1beta1/upload-async` (the `v1alpha1`
  paths too) with `Authorization: Bearer <token>` and the image as the body. No Authorization header, or not a
  Bearer token: 400. A token that does not verify (signature, issuer, expiry with CDI's 10 s leeway): 401. A token
  for anything but an upload to a claim: 400. No such claim: 503 "rejecting Upload Request for PVC P that doesn't
  exist"; a claim that is no upload target: 503 "PVC P is not an upload target"; an upload already completed: 503
  "rejecting Upload Request for PVC P that already finished uploading"; an upload pod that is not ready: the proxy
  waits up to READY_WAIT seconds for it (CDI: 10 s), then 503. Another upload into the same claim in progress: 503
  (the upload server's "concurrent upload"). A method other than POST: 404 (HEAD on an async path: 200).
- The body (Content-Length or chunked) is streamed into a temporary file beside the claim's file (kubesim/volumes.py)
  CHUNK bytes at a time, leaving a hole for every all-zero chunk (a sparse image stays sparse), and bounded by the
  claim's usable size (CDI: 400 "Saving stream failed: effective image size is larger than the reported available
  storage..."). Complete, it is installed as the claim's file, the claim is annotated with the upload pod
  Succeeded, and the DataVolume turns Succeeded (progress "100.0%"); the answer is 200 with an empty body. A client
  that goes away midway (or a claim deleted meanwhile) leaves no file, and the DataVolume stays UploadReady for
  another attempt, as CDI's upload server stays up after a failed stream.
- Not done: the form paths (multipart uploads: 404 here), archive content, and qcow2 conversion of an upload (the
  bytes are kept as sent).
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import logging
import re
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from . import errors
from .cdi import CHUNK, CLAIM_KEY, POD_PHASE, POD_READY, UPLOAD_TARGET, DataVolumeImporter, too_large
from .certs import serving_cert
from .resources import ResourceType
from .server import SubresourceAPI
from .store import Store
from .volumes import VolumeFiles, quantity_bytes

log = logging.getLogger(__name__)
Obj = dict[str, Any]

GROUP, VERSION = "upload.cdi.kubevirt.io", "v1beta1"
ISSUER = "cdi-apiserver"  # common.UploadTokenIssuer
TOKEN_LIFETIME = 300.0  # newUploadTokenGenerator: five minutes
TOKEN_LEEWAY = 10.0  # uploadTokenLeeway
READY_WAIT, READY_POLL = 10.0, 0.2  # the proxy's wait for the upload pod (waitReadyTime; CDI polls every second)
SYNC_PATHS = ("/v1beta1/upload", "/v1alpha1/upload")
ASYNC_PATHS = ("/v1beta1/upload-async", "/v1alpha1/upload-async")
READ_TIMEOUT = 60.0  # a client that sends nothing for this long is dropped (CDI's servers have no such limit)
CLAIM_CHECK_EVERY = 64  # chunks between two looks at whether the claim is still there
FILESYSTEM_OVERHEAD = 0.055  # CDI's default: a Filesystem-mode claim holds 5.5% less than it requests
CDI_CONFIG_KEY = "cdi.kubevirt.io/cdiconfigs"
PROXY_HOSTS = ["127.0.0.1", "localhost", "cdi-uploadproxy", "cdi-uploadproxy.cdi", "cdi-uploadproxy.cdi.svc"]
_BEARER = re.compile(r"(?i)^Bearer\s+([A-Za-z0-9\-._~+/]+)$")  # uploadproxy.go authHeaderMatcher
_ZEROS = bytes(CHUNK)


# ---- tokens: a JWT as go-jose writes one (compact serialisation, PS256)


class TokenError(Exception):
    """The token does not verify: 401."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=32)  # go-jose: salt length = hash length


class UploadTokens:
    """The cdi-apiserver's upload token signer and the proxy's validator (one RSA key, made on first use)."""

    def __init__(self, clock: Any = time.time) -> None:
        self._clock = clock
        self._key: rsa.RSAPrivateKey | None = None
        self._lock = threading.Lock()

    def _private(self) -> rsa.RSAPrivateKey:
        with self._lock:
            if self._key is None:
                self._key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            return self._key

    def issue(self, namespace: str, claim: str, issued_at: float | None = None) -> str:
        at = int(self._clock() if issued_at is None else issued_at)
        claims = {"operation": "Upload", "name": claim, "namespace": namespace,
                  "resource": {"group": "", "version": "v1", "resource": "persistentvolumeclaims"},
                  "iss": ISSUER, "iat": at, "nbf": at, "exp": at + int(TOKEN_LIFETIME)}
        signing = _b64(b'{"alg":"PS256"}') + "." + _b64(json.dumps(claims, separators=(",", ":")).encode())
        signature = self._private().sign(signing.encode(), _PSS, hashes.SHA256())
        return signing + "." + _b64(signature)

    def validate(self, token: str) -> Obj:
        """The token's claims; TokenError when its signature, issuer or times do not hold."""
        parts = token.split(".")
        if len(parts) != 3:
            raise TokenError("not a compact JWS")
        try:
            header, claims = json.loads(_unb64(parts[0])), json.loads(_unb64(parts[1]))
            signature = _unb64(parts[2])
        except ValueError as exc:
            raise TokenError(f"malformed token: {exc}") from None
        if not isinstance(header, dict) or header.get("alg") != "PS256" or not isinstance(claims, dict):
            raise TokenError("unexpected token header")
        try:
            self._private().public_key().verify(signature, f"{parts[0]}.{parts[1]}".encode(), _PSS, hashes.SHA256())
        except InvalidSignature:
            raise TokenError("bad signature") from None
        now = self._clock()
        if claims.get("iss") != ISSUER:
            raise TokenError("wrong issuer")
        if not isinstance(claims.get("exp"), int) or now > claims["exp"] + TOKEN_LEEWAY:
            raise TokenError("expired")
        if isinstance(claims.get("nbf"), int) and now < claims["nbf"] - TOKEN_LEEWAY:
            raise TokenError("not valid yet")
        return claims


class TokenRequests:
    """The cdi-apiserver's aggregated API: UploadTokenRequests, create only."""

    def __init__(self, tokens: UploadTokens) -> None:
        self.tokens = tokens

    def api(self) -> SubresourceAPI:
        return SubresourceAPI(GROUP, VERSION, [], self.handle, creates={"uploadtokenrequests": "UploadTokenRequest"})

    def handle(self, method: str, namespace: str, resource: str, name: str, sub: str, body: Any) -> tuple[int, Any]:
        if not isinstance(body, dict):
            raise errors.bad_request("the body of the request is not an UploadTokenRequest")
        spec: Obj = body["spec"] if isinstance(body.get("spec"), dict) else {}
        claim = str(spec.get("pvcName") or "")
        # As CDI: the request as sent (apiVersion, kind, metadata, spec) with the token; the claim is not looked
        # at (the proxy refuses a token for a claim that is not an upload target).
        out = {"kind": "UploadTokenRequest", "apiVersion": f"{GROUP}/{VERSION}", **body,
               "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
               "spec": {"pvcName": claim},
               "status": {"token": self.tokens.issue(namespace, claim)}}
        return 200, out


# ---- the upload proxy (and the upload server behind it)


@dataclass
class _Refused(Exception):
    status: int
    message: str = ""
    close: bool = False  # the body was not read: the connection cannot carry another request


class UploadProxy:
    """cdi-uploadproxy and the upload servers behind it, on a loopback address with a CA of its own."""

    name = "cdi-uploadproxy"

    def __init__(self, store: Store, tokens: UploadTokens, importer: DataVolumeImporter,
                 volumes: VolumeFiles | None, host: str = "127.0.0.1") -> None:
        self.store, self.tokens, self.importer, self.volumes = store, tokens, importer, volumes
        self.host = host
        self.ready_wait = READY_WAIT
        self.certs = serving_cert(sorted({host, *PROXY_HOSTS}), ca_name="cdi-uploadproxy-signer",
                                  common_name="cdi-uploadproxy")
        self.address = ""  # host:port once started
        self._uploading: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._httpd: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"https://{self.address}"

    def start(self) -> None:
        proxy = self

        class Handler(_ProxyHandler):
            owner = proxy

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._httpd = Server((self.host, 0), Handler)
        self._httpd.socket = self.certs.server_context().wrap_socket(
            self._httpd.socket, server_side=True, do_handshake_on_connect=False)
        self.address = f"{self.host}:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="cdi-uploadproxy", daemon=True)
        self._thread.start()
        self._publish()
        log.info("cdi-uploadproxy: serving on %s", self.url)

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    def _publish(self) -> None:
        """CDIConfig `config`: status.uploadProxyURL and status.uploadProxyCA, as CDI's config controller writes them
        for an Ingress or Route of the proxy (pkg/controller/config-controller.go)."""
        rtype = self.store.type(CDI_CONFIG_KEY)
        if self.store.find(rtype, "", "config") is None:
            with contextlib.suppress(errors.ApiError):
                self.store.create(rtype, {"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "CDIConfig",
                                          "metadata": {"name": "config"}, "spec": {}}, manager="cdi-operator")
        status = {"uploadProxyURL": self.address, "uploadProxyCA": self.certs.ca_pem.decode().strip(),
                  "filesystemOverhead": {"global": str(FILESYSTEM_OVERHEAD)}}
        self.store.mutate(rtype, "", "config", lambda o: o.__setitem__("status", {**(o.get("status") or {}),
                                                                                  **status}),
                          subresource="status", manager="cdi-controller")

    # ---- what a request may do (each raises _Refused)

    def authorize(self, header: str) -> tuple[str, str]:
        """(namespace, claim) of a valid upload token (handleUploadRequest)."""
        if not header:
            raise _Refused(400, close=True)
        match = _BEARER.match(header)
        if match is None:
            raise _Refused(400, close=True)
        try:
            claims = self.tokens.validate(match.group(1))
        except TokenError as exc:
            log.info("cdi-uploadproxy: token refused: %s", exc)
            raise _Refused(401, close=True) from None
        resource: Obj = claims["resource"] if isinstance(claims.get("resource"), dict) else {}
        if (claims.get("operation") != "Upload" or not claims.get("name") or not claims.get("namespace")
                or resource.get("resource") != "persistentvolumeclaims"):
            raise _Refused(400, close=True)
        return str(claims["namespace"]), str(claims["name"])

    def ready_claim(self, namespace: str, claim: str) -> Obj:
        """The claim, once its upload pod is ready (uploadReady): 503 at once for a claim that is missing, no upload
        target or done; after ready_wait seconds for one whose pod is not ready."""
        rtype = self.store.type(CLAIM_KEY)
        deadline = time.monotonic() + self.ready_wait
        while True:
            found = self.store.find(rtype, namespace, claim)
            if found is None or found["metadata"].get("deletionTimestamp"):
                raise _Refused(503, f"rejecting Upload Request for PVC {claim} that doesn't exist", close=True)
            annotations = found["metadata"].get("annotations") or {}
            if UPLOAD_TARGET not in annotations:
                raise _Refused(503, f"PVC {claim} is not an upload target", close=True)
            if annotations.get(POD_PHASE) == "Succeeded":
                raise _Refused(503, f"rejecting Upload Request for PVC {claim} that already finished uploading",
                               close=True)
            if annotations.get(POD_READY) == "true":
                return found
            if time.monotonic() >= deadline:
                raise _Refused(503, "context deadline exceeded", close=True)
            time.sleep(READY_POLL)

    def begin(self, namespace: str, claim: str) -> None:
        with self._lock:
            if (namespace, claim) in self._uploading:
                raise _Refused(503, close=True)  # the upload server: "Got concurrent upload request"
            self._uploading.add((namespace, claim))

    def end(self, namespace: str, claim: str) -> None:
        with self._lock:
            self._uploading.discard((namespace, claim))

    def claim_alive(self, namespace: str, claim: str, uid: str) -> bool:
        found = self.store.find(self.store.type(CLAIM_KEY), namespace, claim)
        return found is not None and found["metadata"]["uid"] == uid and not found["metadata"].get("deletionTimestamp")

    def complete(self, namespace: str, claim: Obj, path: Path | None) -> bool:
        """Install the uploaded image (None: no volume files are kept) as the claim's file and mark its upload pod
        Succeeded; False when the claim went meanwhile (the file is discarded)."""
        meta = claim["metadata"]
        name, uid = meta["name"], meta["uid"]
        if self.volumes is not None and path is not None and not self.volumes.install(
                path, namespace, name, uid, lambda: self.claim_alive(namespace, name, uid)):
            return False

        def succeeded(obj: Obj) -> bool:
            if obj["metadata"]["uid"] != uid:
                return False
            obj["metadata"].setdefault("annotations", {}).update({POD_PHASE: "Succeeded", POD_READY: "false"})
            return True

        self.store.mutate(self.store.type(CLAIM_KEY), namespace, name, succeeded, manager="cdi-controller",
                          only="metadata")
        self.importer.upload_completed(namespace, name)
        return True


def usable_bytes(claim: Obj) -> int | None:
    """What an image may take of the claim: its request, less CDI's filesystem overhead in Filesystem mode."""
    spec = claim.get("spec") or {}
    size = quantity_bytes(((spec.get("resources") or {}).get("requests") or {}).get("storage"))
    if size is None:
        return None
    return size if spec.get("volumeMode") == "Block" else int(size * (1 - FILESYSTEM_OVERHEAD))


class _Disconnected(Exception):
    """The client went away (or stopped sending) before the whole body was in."""


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    owner: UploadProxy
    protocol_version = "HTTP/1.1"
    server_version = "cdi-uploadproxy"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("cdi-uploadproxy: " + format, *args)

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(READ_TIMEOUT)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_HEAD(self) -> None:
        self._serve("HEAD")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def _serve(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            return self._answer(200, "OK")
        if path not in SYNC_PATHS + ASYNC_PATHS:
            return self._answer(404, "404 page not found\n", close=True)
        proxy = self.owner
        try:
            namespace, claim_name = proxy.authorize(self.headers.get("Authorization", ""))
            claim = proxy.ready_claim(namespace, claim_name)
            if method != "POST":  # the upload server's answer to anything but an upload
                return self._answer(200 if method == "HEAD" and path in ASYNC_PATHS else 404, close=True)
            proxy.begin(namespace, claim_name)
            try:
                self._upload(namespace, claim)
            finally:
                proxy.end(namespace, claim_name)
        except _Refused as refused:
            self._answer(refused.status, refused.message, close=refused.close)
        except _Disconnected as exc:
            log.info("cdi-uploadproxy: upload into %s abandoned: %s", self.path, exc)
            self.close_connection = True
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, TimeoutError):
            self.close_connection = True

    def _upload(self, namespace: str, claim: Obj) -> None:
        proxy = self.owner
        name, uid = claim["metadata"]["name"], claim["metadata"]["uid"]
        limit = usable_bytes(claim)
        chunked = self.headers.get("Transfer-Encoding", "").lower() == "chunked"
        length_header = self.headers.get("Content-Length")
        if not chunked and (length_header is None or not length_header.strip().isdigit()):
            raise _Refused(411 if length_header is None else 400, close=True)
        length = None if chunked else int(str(length_header))
        if limit is not None and length is not None and length > limit:
            raise _Refused(400, "Saving stream failed: effective image size is larger than the reported available "
                                f"storage: {too_large(length, limit)}", close=True)
        if proxy.volumes is None:
            self._drain(length, chunked)
            self._finish(namespace, claim, None)
            return
        path = proxy.volumes.temporary(namespace, name)
        try:
            written = self._copy(path, length, chunked, limit, lambda: proxy.claim_alive(namespace, name, uid))
            log.info("cdi-uploadproxy: %d bytes uploaded into %s/%s", written, namespace, name)
            self._finish(namespace, claim, path)
        finally:
            proxy.volumes.discard(path)  # nothing left if it was installed

    def _finish(self, namespace: str, claim: Obj, path: Path | None) -> None:
        if not self.owner.complete(namespace, claim, path):
            raise _Refused(500, "Saving stream failed: the PVC was deleted", close=True)
        self._answer(200)

    def _pieces(self, length: int | None, chunked: bool) -> Any:
        """The body, CHUNK bytes at most at a time (a memoryview of one reused buffer)."""
        buffer = bytearray(CHUNK)
        view = memoryview(buffer)
        if not chunked:
            left = length or 0
            while left:
                n = self._read_into(view[: min(CHUNK, left)])
                left -= n
                yield view[:n]
            return
        while True:
            line = self.rfile.readline(1024)
            if not line:
                raise _Disconnected("the chunked body ended early")
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise _Refused(400, "malformed chunked body", close=True) from None
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return
            while size:
                n = self._read_into(view[: min(CHUNK, size)])
                size -= n
                yield view[:n]
            self.rfile.readline(1024)

    def _read_into(self, view: memoryview) -> int:
        try:
            n = self.rfile.readinto(view)
        except (TimeoutError, OSError) as exc:
            raise _Disconnected(str(exc) or type(exc).__name__) from None
        if not n:
            raise _Disconnected("unexpected EOF")
        return int(n)

    def _copy(self, path: Path, length: int | None, chunked: bool, limit: int | None, alive: Any) -> int:
        """The body into `path`, sparse where it is zeros; its size."""
        written = 0
        with open(path, "r+b") as fh:
            for count, piece in enumerate(self._pieces(length, chunked), start=1):
                n = len(piece)
                if limit is not None and written + n > limit:
                    raise _Refused(400, "Saving stream failed: effective image size is larger than the reported "
                                        f"available storage: {too_large(written + n, limit)}", close=True)
                data = piece.tobytes()  # compared as bytes (memcmp): a memoryview compares item by item, 100x slower
                if data == (_ZEROS if n == CHUNK else bytes(n)):
                    fh.seek(n, 1)  # a hole: a sparse image stays sparse
                else:
                    fh.write(data)
                written += n
                if count % CLAIM_CHECK_EVERY == 0 and not alive():
                    raise _Disconnected("the PVC was deleted")  # CDI: its upload pod goes with it
            fh.truncate(written)
        return written

    def _drain(self, length: int | None, chunked: bool) -> None:
        for _ in self._pieces(length, chunked):
            pass

    def _answer(self, status: int, text: str = "", close: bool = False) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            with contextlib.suppress(OSError):
                self.wfile.write(data)


def install(cluster: Any) -> None:
    """CDI's upload in `cluster`: the CDIConfig kind, the UploadTokenRequest API, and the upload proxy (after CDI's
    import controller, kubesim/cdi.py, which runs the upload DataVolumes' phases)."""
    cluster.store.add_type(ResourceType("cdi.kubevirt.io", "v1beta1", "CDIConfig", "cdiconfigs", "cdiconfig",
                                        namespaced=False, status_subresource=True))
    importer = next(c for c in cluster.components if isinstance(c, DataVolumeImporter))
    tokens = UploadTokens()
    cluster.server.add_subresource_api(TokenRequests(tokens).api())
    cluster.add_component(UploadProxy(cluster.store, tokens, importer, getattr(cluster, "volumes", None),
                                      cluster.config.host if _loopback(cluster.config.host) else "127.0.0.1"))


def _loopback(host: str) -> bool:
    try:
        return socket.inet_aton(host)[0] == 127
    except OSError:
        return False
