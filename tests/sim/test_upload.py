"""CDI's upload in kubesim (kubesim/upload.py), reached as a client reaches CDI: an UploadTokenRequest through the API
server, then the upload proxy over HTTPS with a plain HTTP client, verified with the CA that CDIConfig publishes.

Each answer is CDI's (pkg/uploadproxy/uploadproxy.go, pkg/uploadserver/uploadserver.go, pkg/apiserver/apiserver.go):
a test here fails if kubesim drifts from it. In-process clusters whose state directory is the test's, as in
tests/sim/test_volumes.py: one whose upload pods are ready in a moment, one whose pods never get ready."""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import random
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from kubesim.cluster import Cluster
from kubesim.upload import TOKEN_LIFETIME, UploadProxy

from ..support.cluster import call, wait_for
from .test_volumes import (
    api_of,
    create_claim,
    create_datavolume,
    datavolume,
    delete_datavolume,
    files_in,
    in_process_cluster,
    new_namespace,
    sha256_of,
    wait_phase,
)

Obj = dict[str, Any]
MI = 2**20
TOKENS = "/apis/upload.cdi.kubevirt.io/v1beta1/namespaces/{ns}/uploadtokenrequests"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Upload pods ready 0.075 s after their DataVolume (an import delay of 0.3 s)."""
    c = in_process_cluster(tmp_path_factory.mktemp("upload-node"), 0.3)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def unready(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Upload pods that stay unready for minutes, and a proxy that waits 0.3 s for them (CDI: 10 s)."""
    c = in_process_cluster(tmp_path_factory.mktemp("unready-node"), 3600.0)
    proxy_of(c).ready_wait = 0.3
    yield c
    c.stop()


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    with new_namespace(cluster) as name:
        yield name


def proxy_of(c: Cluster) -> UploadProxy:
    return next(component for component in c.components if isinstance(component, UploadProxy))


def cdi_config(c: Cluster) -> Obj:
    return dict(client.CustomObjectsApi(api_of(c)).get_cluster_custom_object("cdi.kubevirt.io", "v1beta1",
                                                                             "cdiconfigs", "config"))


def token_for(c: Cluster, ns: str, claim: str) -> str:
    reply = call(api_of(c), "POST", TOKENS.format(ns=ns), {
        "apiVersion": "upload.cdi.kubevirt.io/v1beta1", "kind": "UploadTokenRequest",
        "metadata": {"name": "upload"}, "spec": {"pvcName": claim}})
    assert reply.status == 200, reply.body
    return str(reply.body["status"]["token"])


def claims_of(token: str) -> Obj:
    payload = token.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))


class Answer:
    def __init__(self, status: int, body: str, sent: int) -> None:
        self.status, self.body, self.sent = status, body, sent


def connect(c: Cluster) -> http.client.HTTPSConnection:
    """A connection to the proxy where CDIConfig says it is, trusting only the CA it names there."""
    status = cdi_config(c)["status"]
    host, _, port = status["uploadProxyURL"].rpartition(":")
    tls = ssl.create_default_context(cadata=status["uploadProxyCA"])
    return http.client.HTTPSConnection(host, int(port), context=tls, timeout=30)


def upload(c: Cluster, token: str | None, pieces: Iterator[bytes] | list[bytes], size: int | None, *,
           path: str = "/v1beta1/upload", method: str = "POST", auth: str | None = None) -> Answer:
    """One request to the proxy; the body sent a piece at a time (`size`: its Content-Length; None: chunked)."""
    conn = connect(c)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        if auth is not None:
            conn.putheader("Authorization", auth)
        elif token is not None:
            conn.putheader("Authorization", f"Bearer {token}")
        conn.putheader("Content-Type", "application/octet-stream")
        if size is None:
            conn.putheader("Transfer-Encoding", "chunked")
        else:
            conn.putheader("Content-Length", str(size))
        conn.endheaders()
        sent = 0
        try:
            for piece in pieces:
                conn.send(b"%x\r\n%s\r\n" % (len(piece), piece) if size is None else piece)
                sent += len(piece)
            if size is None:
                conn.send(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            pass  # answered before the whole body: the answer says why
        response = conn.getresponse()
        return Answer(response.status, response.read().decode(errors="replace"), sent)
    finally:
        conn.close()


def image(size: int, seed: int = 1) -> tuple[list[bytes], str]:
    """An image of `size` bytes in 1 MiB pieces: random blocks with runs of zeros between (sparse-ish); its sha256."""
    rnd = random.Random(seed)
    pieces, digest = [], hashlib.sha256()
    for start in range(0, size, MI):
        n = min(MI, size - start)
        piece = rnd.randbytes(n) if (start // MI) % 3 == 0 else bytes(n)
        pieces.append(piece)
        digest.update(piece)
    return pieces, digest.hexdigest()


def upload_dv(c: Cluster, ns: str, name: str, size: str = "64Mi") -> Obj:
    create_datavolume(c, ns, name, {"upload": {}}, size)
    return wait_phase(c, ns, name, "UploadReady")


def claim(c: Cluster, ns: str, name: str) -> Obj:
    return client.CoreV1Api(api_of(c)).read_namespaced_persistent_volume_claim(name, ns).to_dict()


# ---------------------------------------------------------------- the token API


def test_a_token_request_answers_200_with_a_short_lived_token_naming_the_namespace_and_claim(
        cluster: Cluster, namespace: str) -> None:
    reply = call(api_of(cluster), "POST", TOKENS.format(ns=namespace), {
        "apiVersion": "upload.cdi.kubevirt.io/v1beta1", "kind": "UploadTokenRequest",
        "metadata": {"name": "u"}, "spec": {"pvcName": "disk"}})
    assert reply.status == 200
    assert reply.body["kind"] == "UploadTokenRequest" and reply.body["spec"] == {"pvcName": "disk"}
    token = reply.body["status"]["token"]
    header = json.loads(base64.urlsafe_b64decode(token.split(".")[0] + "=="))
    assert header["alg"] == "PS256"
    claims = claims_of(token)
    assert claims["operation"] == "Upload" and claims["name"] == "disk" and claims["namespace"] == namespace
    assert claims["resource"] == {"group": "", "version": "v1", "resource": "persistentvolumeclaims"}
    assert claims["iss"] == "cdi-apiserver" and claims["exp"] - claims["iat"] == TOKEN_LIFETIME == 300


def test_the_token_api_is_discoverable_and_create_only_and_needs_a_valid_bearer(cluster: Cluster,
                                                                                namespace: str) -> None:
    api = api_of(cluster)
    resources = call(api, "GET", "/apis/upload.cdi.kubevirt.io/v1beta1").body["resources"]
    assert {"name": "uploadtokenrequests", "kind": "UploadTokenRequest", "verbs": ["create"], "namespaced": True} \
        .items() <= next(r for r in resources if r["name"] == "uploadtokenrequests").items()
    assert call(api, "POST", TOKENS.format(ns=namespace), {"spec": {"pvcName": "d"}}, token="nope").status == 401
    assert call(api, "GET", TOKENS.format(ns=namespace)).status == 405


def test_the_proxy_is_published_in_cdiconfig_and_verified_by_its_own_ca_not_the_clusters(cluster: Cluster) -> None:
    status = cdi_config(cluster)["status"]
    assert status["uploadProxyURL"].startswith("127.") and "://" not in status["uploadProxyURL"]
    conn = connect(cluster)
    conn.request("GET", "/healthz")
    response = conn.getresponse()
    assert (response.status, response.read()) == (200, b"OK")
    conn.close()
    host, _, port = status["uploadProxyURL"].rpartition(":")
    cluster_ca = ssl.create_default_context(cadata=cluster.certs.ca_pem.decode())
    with pytest.raises(ssl.SSLCertVerificationError):
        http.client.HTTPSConnection(host, int(port), context=cluster_ca, timeout=5).request("GET", "/healthz")


# ---------------------------------------------------------------- an upload


def test_an_upload_datavolume_goes_scheduled_then_ready_and_annotates_its_claim(cluster: Cluster,
                                                                               namespace: str) -> None:
    create_datavolume(cluster, namespace, "disk", {"upload": {}})
    seen: set[str] = set()

    def ready() -> bool:
        seen.add(datavolume(cluster, namespace, "disk").get("status", {}).get("phase", ""))
        return "UploadReady" in seen

    wait_for(ready, interval=0.005, what="UploadReady")
    dv = datavolume(cluster, namespace, "disk")
    assert seen <= {"", "Pending", "UploadScheduled", "UploadReady"}
    assert dv["status"]["progress"] == "N/A"
    running = next(c for c in dv["status"]["conditions"] if c["type"] == "Running")
    assert running["status"] == "True"
    annotations = claim(cluster, namespace, "disk")["metadata"]["annotations"]
    assert annotations["cdi.kubevirt.io/storage.upload.target"] == ""
    assert annotations["cdi.kubevirt.io/storage.pod.phase"] == "Running"
    assert annotations["cdi.kubevirt.io/storage.pod.ready"] == "true"


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_upload_writes_the_bytes_sparse_and_the_datavolume_succeeds(cluster: Cluster, namespace: str,
                                                                       chunked: bool) -> None:
    upload_dv(cluster, namespace, "disk")
    pieces, digest = image(20 * MI + 123)
    answer = upload(cluster, token_for(cluster, namespace, "disk"), pieces,
                    None if chunked else sum(map(len, pieces)))
    assert (answer.status, answer.body) == (200, "")
    dv = wait_phase(cluster, namespace, "disk", "Succeeded")
    assert dv["status"]["progress"] == "100.0%"
    path = cluster.volumes.claim_file(namespace, "disk")
    assert sha256_of(path) == digest and path.stat().st_size == 20 * MI + 123
    assert path.stat().st_blocks * 512 < 10 * MI, "the zero runs were written, not left as holes"
    assert claim(cluster, namespace, "disk")["metadata"]["annotations"][
        "cdi.kubevirt.io/storage.pod.phase"] == "Succeeded"


def test_a_second_upload_into_a_finished_claim_is_refused(cluster: Cluster, namespace: str) -> None:
    upload_dv(cluster, namespace, "disk")
    token = token_for(cluster, namespace, "disk")
    assert upload(cluster, token, [b"\x01" * MI], MI).status == 200
    again = upload(cluster, token, [b"\x02" * MI], MI)
    assert (again.status, again.body) == (503, "rejecting Upload Request for PVC disk that already finished uploading")
    assert sha256_of(cluster.volumes.claim_file(namespace, "disk")) == hashlib.sha256(b"\x01" * MI).hexdigest()


def test_an_upload_larger_than_the_claim_is_400_and_leaves_no_file(cluster: Cluster, namespace: str) -> None:
    upload_dv(cluster, namespace, "disk", "4Mi")  # 3.78 MiB usable: 5.5% of a Filesystem claim is overhead
    answer = upload(cluster, token_for(cluster, namespace, "disk"), [b"\x01" * MI] * 4, 4 * MI)
    assert answer.status == 400
    assert answer.body.startswith("Saving stream failed: effective image size is larger than the reported available")
    chunked = upload(cluster, token_for(cluster, namespace, "disk"), [b"\x01" * MI] * 4, None)
    assert chunked.status == 400
    assert files_in(cluster, namespace) == []
    assert datavolume(cluster, namespace, "disk")["status"]["phase"] == "UploadReady"


def test_a_client_that_goes_away_midway_leaves_no_file_and_may_upload_again(cluster: Cluster,
                                                                          namespace: str) -> None:
    upload_dv(cluster, namespace, "disk")
    token = token_for(cluster, namespace, "disk")
    conn = connect(cluster)
    conn.putrequest("POST", "/v1beta1/upload")
    conn.putheader("Authorization", f"Bearer {token}")
    conn.putheader("Content-Length", str(8 * MI))
    conn.endheaders()
    conn.send(b"\x07" * (3 * MI))
    wait_for(lambda: any(f.endswith(".part") for f in files_in(cluster, namespace)), what="the upload's file")
    conn.sock.shutdown(2)
    conn.close()
    wait_for(lambda: files_in(cluster, namespace) == [], what="the half upload removed")
    assert datavolume(cluster, namespace, "disk")["status"]["phase"] == "UploadReady"
    assert upload(cluster, token, [b"\x08" * MI], MI).status == 200
    wait_phase(cluster, namespace, "disk", "Succeeded")


def test_a_concurrent_upload_into_the_same_claim_is_503(cluster: Cluster, namespace: str) -> None:
    upload_dv(cluster, namespace, "disk")
    token = token_for(cluster, namespace, "disk")
    first = connect(cluster)
    first.putrequest("POST", "/v1beta1/upload")
    first.putheader("Authorization", f"Bearer {token}")
    first.putheader("Content-Length", str(2 * MI))
    first.endheaders()
    first.send(b"\x01" * MI)
    wait_for(lambda: any(f.endswith(".part") for f in files_in(cluster, namespace)), what="the first upload")
    assert upload(cluster, token, [b"\x02" * MI], MI).status == 503
    first.send(b"\x01" * MI)
    assert first.getresponse().status == 200
    first.close()


# ---------------------------------------------------------------- refusals


def test_a_request_without_a_bearer_token_is_400_and_a_bad_token_401(cluster: Cluster, namespace: str) -> None:
    upload_dv(cluster, namespace, "disk")
    token = token_for(cluster, namespace, "disk")
    assert upload(cluster, None, [b"x"], 1).status == 400
    assert upload(cluster, None, [b"x"], 1, auth=f"Basic {token}").status == 400
    head, payload, signature = token.split(".")
    forged = json.dumps({**claims_of(token), "name": "other"}, separators=(",", ":")).encode()
    forged_payload = base64.urlsafe_b64encode(forged).rstrip(b"=").decode()
    assert upload(cluster, f"{head}.{forged_payload}.{signature}", [b"x"], 1).status == 401
    assert upload(cluster, f"{head}.{payload}.{signature[:-4]}AAAA", [b"x"], 1).status == 401
    stale = proxy_of(cluster).tokens.issue(namespace, "disk", issued_at=time.time() - TOKEN_LIFETIME - 11)
    assert upload(cluster, stale, [b"x"], 1).status == 401
    other = in_process_token(namespace, "disk")
    assert upload(cluster, other, [b"x"], 1).status == 401
    assert files_in(cluster, namespace) == []


def in_process_token(namespace: str, claim_name: str) -> str:
    """A well-formed token signed by another key (another cluster's CDI)."""
    from kubesim.upload import UploadTokens

    return UploadTokens().issue(namespace, claim_name)


def test_a_token_for_a_missing_claim_or_one_that_is_no_upload_target_is_503(cluster: Cluster,
                                                                            namespace: str) -> None:
    missing = upload(cluster, token_for(cluster, namespace, "nothing"), [b"x"], 1)
    assert (missing.status, missing.body) == (503, "rejecting Upload Request for PVC nothing that doesn't exist")
    create_claim(cluster, namespace, "plain", "8Mi")
    plain = upload(cluster, token_for(cluster, namespace, "plain"), [b"x"], 1)
    assert (plain.status, plain.body) == (503, "PVC plain is not an upload target")
    create_datavolume(cluster, namespace, "imported", {"blank": {}})
    blank = upload(cluster, token_for(cluster, namespace, "imported"), [b"x"], 1)
    assert (blank.status, blank.body) == (503, "PVC imported is not an upload target")


def test_a_token_names_its_namespace_a_claim_of_the_same_name_elsewhere_is_not_reached(cluster: Cluster,
                                                                                      namespace: str) -> None:
    upload_dv(cluster, namespace, "disk")
    with new_namespace(cluster) as other:
        answer = upload(cluster, token_for(cluster, other, "disk"), [b"x"], 1)
        assert (answer.status, answer.body) == (503, "rejecting Upload Request for PVC disk that doesn't exist")
    assert datavolume(cluster, namespace, "disk")["status"]["phase"] == "UploadReady"


def test_an_upload_before_the_upload_pod_is_ready_waits_then_is_503(unready: Cluster) -> None:
    with new_namespace(unready) as ns:
        create_datavolume(unready, ns, "disk", {"upload": {}})
        wait_for(lambda: datavolume(unready, ns, "disk").get("status", {}).get("phase") == "Pending",
                 what="Pending")
        started = time.monotonic()
        answer = upload(unready, token_for(unready, ns, "disk"), [b"x" * 1024], 1024)
        assert answer.status == 503
        assert time.monotonic() - started >= 0.3  # the proxy waited for the pod before refusing
        assert files_in(unready, ns) == []
        assert datavolume(unready, ns, "disk")["status"]["phase"] == "Pending"


def test_other_methods_reach_the_upload_server_which_takes_only_post(cluster: Cluster, namespace: str) -> None:
    upload_dv(cluster, namespace, "disk")
    token = token_for(cluster, namespace, "disk")
    assert upload(cluster, token, [], 0, method="PUT").status == 404
    assert upload(cluster, token, [], 0, method="HEAD", path="/v1beta1/upload-async").status == 200
    assert upload(cluster, token, [], 0, path="/v1beta1/upload-form").status == 404
    assert upload(cluster, token, [b"\x05" * 1000], 1000, path="/v1beta1/upload-async").status == 200
    wait_phase(cluster, namespace, "disk", "Succeeded")


def test_deleting_the_datavolume_removes_the_uploaded_file(cluster: Cluster, namespace: str) -> None:
    upload_dv(cluster, namespace, "disk")
    assert upload(cluster, token_for(cluster, namespace, "disk"), [b"\x03" * MI], MI).status == 200
    wait_phase(cluster, namespace, "disk", "Succeeded")
    path: Path = cluster.volumes.claim_file(namespace, "disk")
    assert path.exists()
    delete_datavolume(cluster, namespace, "disk")
    wait_for(lambda: not os.path.exists(path), what="the claim's file removed with its DataVolume")
