"""The node's volume files (kubesim/volumes.py): what CDI's importer (kubesim/cdi.py) and the volume binder
(kubesim/storage.py) write for DataVolumes and claims, and what their deletion removes.

The behaviour is tested on in-process clusters whose state directory is the test's (two: imports of 0.3 s, and
imports held in ImportInProgress for an hour), importing from an HTTP server on 127.0.0.1 in this process; the
lookups (containerDisk names, quantities, a file's owner) are tested on their own."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import logging
import os
import random
import shutil
import ssl
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from kubesim import cdi
from kubesim.cdi import CHUNK
from kubesim.certs import serving_cert
from kubesim.cluster import Cluster, SimConfig
from kubesim.volumes import TEMPORARY_SUFFIX, VolumeFiles, quantity_bytes

from ..support.cluster import address_ranges, wait_for
from ..support.images import ImageServer

Obj = dict[str, Any]
MI = 2**20
GI = 2**30


# ---------------------------------------------------------------- the loopback image server


class Images:
    """An HTTP server on 127.0.0.1 serving routes a test adds; `sent[path]` is set once a whole body has gone out
    to a request without Range (the importer's download; CDI's probe asks for a range first)."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.routes: dict[str, Callable[[http.server.BaseHTTPRequestHandler], None]] = {}
        self.sent: dict[str, threading.Event] = {}
        self.release = threading.Event()  # ends stalled responses
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                route = outer.routes.get(self.path)
                if route is None:
                    self.send_error(404)
                    return
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    route(self)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.base = f"{'https' if tls else 'http'}://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def url(self, path: str) -> str:
        return self.base + path

    def add(self, path: str, route: Callable[[http.server.BaseHTTPRequestHandler], None]) -> str:
        self.routes[path] = route
        self.sent[path] = threading.Event()
        return self.url(path)

    def add_blocks(self, path: str, size: int, *, chunked: bool = False, ranges: bool = True) -> str:
        """`size` pseudo-random bytes, made a chunk at a time (never whole in memory); returns their sha256. With
        `ranges`, a ranged GET gets its range and the total (206), as most servers answer CDI's probe; `chunked`:
        no Content-Length (the size is only known at the end)."""
        block = random.Random(size).randbytes(CHUNK)

        def chunk(index: int) -> bytes:
            start = index * CHUNK
            data = index.to_bytes(8, "big") + block[8:]
            return data[: min(CHUNK, size - start)]

        digest = hashlib.sha256()
        for i in range((size + CHUNK - 1) // CHUNK):
            digest.update(chunk(i))

        def route(h: http.server.BaseHTTPRequestHandler) -> None:
            wanted = h.headers.get("Range", "")
            if ranges and wanted.startswith("bytes=0-"):
                end = min(int(wanted.removeprefix("bytes=0-")), size - 1)
                h.send_response(206)
                h.send_header("Content-Range", f"bytes 0-{end}/{size}")
                h.send_header("Content-Length", str(end + 1))
                h.end_headers()
                h.wfile.write(chunk(0)[: end + 1])
                return
            h.send_response(200)
            h.send_header("Connection", "close")
            if chunked:
                h.send_header("Transfer-Encoding", "chunked")
            else:
                h.send_header("Content-Length", str(size))
            h.end_headers()
            for i in range((size + CHUNK - 1) // CHUNK):
                data = chunk(i)
                h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            if chunked:
                h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
            if not wanted:
                self.sent[path].set()

        self.add(path, route)
        return digest.hexdigest()

    def add_bytes(self, path: str, data: bytes) -> str:
        """`data`, answering a request with or without Range (a ranged one: 206 with the total)."""

        def route(h: http.server.BaseHTTPRequestHandler) -> None:
            wanted = h.headers.get("Range", "")
            body = data
            if wanted.startswith("bytes=0-"):
                body = data[: int(wanted.removeprefix("bytes=0-")) + 1]
                h.send_response(206)
                h.send_header("Content-Range", f"bytes 0-{len(body) - 1}/{len(data)}")
            else:
                h.send_response(200)
            h.send_header("Content-Length", str(len(body)))
            h.send_header("Connection", "close")
            h.end_headers()
            h.wfile.write(body)
            if not wanted:
                self.sent[path].set()

        return self.add(path, route)

    def add_truncated(self, path: str, size: int, cut: int) -> str:
        """States `size` bytes, sends `cut` of them and closes the connection (ranged requests answered whole)."""

        def route(h: http.server.BaseHTTPRequestHandler) -> None:
            h.send_response(200)
            h.send_header("Content-Length", str(size))
            h.send_header("Connection", "close")
            h.end_headers()
            h.wfile.write(b"\x5a" * min(cut, size))
            h.wfile.flush()
            h.close_connection = True

        return self.add(path, route)

    def add_stalled(self, path: str, size: int) -> str:
        """States `size` bytes, sends one chunk of them, then nothing until the server closes."""

        def route(h: http.server.BaseHTTPRequestHandler) -> None:
            h.send_response(200)
            h.send_header("Content-Length", str(size))
            h.end_headers()
            h.wfile.write(b"\x01" * min(CHUNK, size))
            h.wfile.flush()
            if not h.headers.get("Range"):
                self.sent[path].set()
                self.release.wait()

        return self.add(path, route)

    def add_redirect(self, path: str, to: str) -> str:
        def route(h: http.server.BaseHTTPRequestHandler) -> None:
            h.send_response(302)
            h.send_header("Location", to)
            h.send_header("Content-Length", "0")
            h.end_headers()

        return self.add(path, route)


@pytest.fixture
def images() -> Iterator[Images]:
    server = Images()
    yield server
    server.close()


# ---------------------------------------------------------------- clusters


def in_process_cluster(state_dir: Path, import_delay: float) -> Cluster:
    flags = address_ranges()
    ranges = dict(zip(flags[::2], flags[1::2], strict=True))
    cluster = Cluster(SimConfig(port=0, import_delay=import_delay, vm_start_delay=0.1, vm_stop_delay=0.1,
                                kubelet_mode="fake", state_dir=str(state_dir), pod_cidr=ranges["--pod-cidr"],
                                service_cidr=ranges["--service-cidr"],
                                load_balancer_cidr=ranges["--load-balancer-cidr"]))
    cluster.start()
    return cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Imports of 0.3 s."""
    c = in_process_cluster(tmp_path_factory.mktemp("node"), 0.3)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Imports that take an hour (what a test of an import in flight uses --import-delay for)."""
    c = in_process_cluster(tmp_path_factory.mktemp("held-node"), 3600.0)
    yield c
    c.stop()


def api_of(c: Cluster) -> client.ApiClient:
    return config.new_client_from_config(config_file=c.kubeconfig)


@contextlib.contextmanager
def new_namespace(c: Cluster) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(api_of(c))
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    try:
        yield name
    finally:
        with contextlib.suppress(client.ApiException):
            core.delete_namespace(name)


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    with new_namespace(cluster) as name:
        yield name


def create_datavolume(c: Cluster, ns: str, name: str, source: Obj, size: str = "64Mi") -> Obj:
    body = {"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume", "metadata": {"name": name},
            "spec": {"source": source, "storage": {"resources": {"requests": {"storage": size}}}}}
    return client.CustomObjectsApi(api_of(c)).create_namespaced_custom_object(
        "cdi.kubevirt.io", "v1beta1", ns, "datavolumes", body)


def datavolume(c: Cluster, ns: str, name: str) -> Obj:
    return client.CustomObjectsApi(api_of(c)).get_namespaced_custom_object(
        "cdi.kubevirt.io", "v1beta1", ns, "datavolumes", name)


def delete_datavolume(c: Cluster, ns: str, name: str) -> None:
    client.CustomObjectsApi(api_of(c)).delete_namespaced_custom_object(
        "cdi.kubevirt.io", "v1beta1", ns, "datavolumes", name)


def wait_phase(c: Cluster, ns: str, name: str, *phases: str) -> Obj:
    return wait_for(lambda: (dv := datavolume(c, ns, name)).get("status", {}).get("phase") in phases and dv,
                    what=f"DataVolume {name} in {phases}")


def running_message(dv: Obj) -> str:
    return next(c.get("message", "") for c in dv["status"]["conditions"] if c["type"] == "Running")


def files_in(c: Cluster, ns: str) -> list[str]:
    """Every file in the namespace's volume directory (temporary ones too)."""
    directory = c.volumes.root / ns
    return sorted(os.listdir(directory)) if directory.is_dir() else []


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def assert_sparse(path: Path, size: int) -> None:
    st = path.stat()
    assert st.st_size == size
    assert st.st_blocks * 512 < MI, f"{path}: {st.st_blocks} blocks allocated"


def create_claim(c: Cluster, ns: str, name: str, size: str) -> None:
    body = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}}
    client.CoreV1Api(api_of(c)).create_namespaced_persistent_volume_claim(ns, body)


def claim_phase(c: Cluster, ns: str, name: str) -> str | None:
    try:
        claim = client.CoreV1Api(api_of(c)).read_namespaced_persistent_volume_claim(name, ns)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return claim.status.phase if claim.status else None


# ---------------------------------------------------------------- lookups


def test_container_disk_is_the_images_last_path_component_without_tag_or_digest(tmp_path: Path) -> None:
    for name in ("fedora.qcow2", "fedora.iso", "cirros.img", "cirros.qcow2", "alpine.raw"):
        (tmp_path / name).write_bytes(b"x")
    files = VolumeFiles(str(tmp_path / "volumes"), str(tmp_path))

    assert files.container_disk("quay.io/containerdisks/fedora:39") == tmp_path / "fedora.qcow2"
    assert files.container_disk("registry:5000/kubevirt/cirros@sha256:0123abcd") == tmp_path / "cirros.img"
    assert files.container_disk("alpine") == tmp_path / "alpine.raw"
    assert files.container_disk("quay.io/containerdisks/ubuntu:22.04") is None
    assert files.container_disk("quay.io/x/..") is None
    assert VolumeFiles(str(tmp_path / "volumes")).container_disk("fedora") is None


@pytest.mark.parametrize(("quantity", "expected"), [
    ("1Gi", GI), ("500M", 500 * 10**6), ("1.5Gi", 3 * GI // 2), ("1e9", 10**9), ("1073741824", GI),
    ("500m", 1), ("2k", 2000), ("1Ti", 2**40), ("Gi", None), ("-1Gi", None), ("1 Gi", None), ("lots", None),
])
def test_quantities_are_bytes_rounded_up(quantity: str, expected: int | None) -> None:
    assert quantity_bytes(quantity) == expected


def test_a_late_removal_never_takes_the_file_of_a_new_claim_of_the_same_name(tmp_path: Path) -> None:
    files = VolumeFiles(str(tmp_path))
    assert files.ensure_sparse("ns", "disk", MI, owner="old-uid")
    assert files.ensure_sparse("ns", "disk", 2 * MI, owner="new-uid")  # recreated before the removal ran

    assert files.remove("ns", "disk", owner="old-uid") is False
    assert files.claim_file("ns", "disk").stat().st_size == 2 * MI
    assert files.remove("ns", "disk", owner="new-uid") is True
    assert not (tmp_path / "ns").exists()


def test_a_file_for_a_claim_gone_meanwhile_is_never_installed(tmp_path: Path) -> None:
    files = VolumeFiles(str(tmp_path))
    part = files.sparse("ns", "disk", MI)

    assert files.install(part, "ns", "disk", owner="uid", wanted=lambda: False) is False
    assert not part.exists() and not files.exists("ns", "disk") and not (tmp_path / "ns").exists()


# ---------------------------------------------------------------- imports from a loopback server


def test_a_loopback_image_is_downloaded_whole_into_the_claims_file(cluster: Cluster, namespace: str,
                                                                   images: Images) -> None:
    size = 5 * MI + 12345
    digest = images.add_blocks("/disk.img", size)
    create_datavolume(cluster, namespace, "disk", {"http": {"url": images.url("/disk.img")}})

    dv = wait_phase(cluster, namespace, "disk", "Succeeded", "Failed")

    assert dv["status"]["phase"] == "Succeeded", dv["status"]
    path = cluster.volumes.claim_file(namespace, "disk")
    assert path == cluster.volumes.root / namespace / "disk.img"
    assert path.stat().st_size == size
    assert sha256_of(path) == digest
    assert files_in(cluster, namespace) == ["disk.img"]  # no temporary file left


def test_a_redirect_is_followed_to_the_image_and_a_body_without_length_is_complete(
        cluster: Cluster, namespace: str, images: Images) -> None:
    size = 3 * MI + 7
    digest = images.add_blocks("/real.img", size, chunked=True, ranges=False)
    images.add_redirect("/latest.img", images.url("/real.img"))
    create_datavolume(cluster, namespace, "disk", {"http": {"url": images.url("/latest.img")}})

    dv = wait_phase(cluster, namespace, "disk", "Succeeded", "Failed")

    assert dv["status"]["phase"] == "Succeeded", dv["status"]
    assert sha256_of(cluster.volumes.claim_file(namespace, "disk")) == digest
    assert files_in(cluster, namespace) == ["disk.img"]


def test_an_https_image_is_verified_with_the_certconfigmaps_ca(cluster: Cluster, namespace: str) -> None:
    cert = serving_cert(["127.0.0.1"])
    images = Images(tls=cert.server_context())
    try:
        digest = images.add_blocks("/disk.img", 2 * MI + 3)
        client.CoreV1Api(api_of(cluster)).create_namespaced_config_map(namespace, {
            "metadata": {"name": "images-ca"}, "data": {"ca.pem": cert.ca_pem.decode()}})
        create_datavolume(cluster, namespace, "trusted",
                          {"http": {"url": images.url("/disk.img"), "certConfigMap": "images-ca"}})
        create_datavolume(cluster, namespace, "untrusted", {"http": {"url": images.url("/disk.img")}})

        trusted = wait_phase(cluster, namespace, "trusted", "Succeeded", "Failed")
        untrusted = wait_phase(cluster, namespace, "untrusted", "Succeeded", "Failed")
    finally:
        images.close()

    assert trusted["status"]["phase"] == "Succeeded", trusted["status"]
    assert sha256_of(cluster.volumes.claim_file(namespace, "trusted")) == digest
    assert untrusted["status"]["phase"] == "Failed"
    assert "tls: failed to verify certificate" in running_message(untrusted)
    assert files_in(cluster, namespace) == ["trusted.img"]


@pytest.mark.skipif(not (shutil.which("qemu-img") and shutil.which("qemu-io")), reason="qemu-utils not installed")
def test_a_qcow2_image_is_converted_to_raw(cluster: Cluster, namespace: str, images: Images, tmp_path: Path) -> None:
    image = tmp_path / "disk.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(image), "4M"], check=True)
    subprocess.run(["qemu-io", "-f", "qcow2", "-c", "write -P 0xab 0 1M", str(image)], check=True,
                   stdout=subprocess.DEVNULL)
    served = image.read_bytes()
    assert served[:4] == b"QFI\xfb" and len(served) < 4 * MI
    images.add_bytes("/disk.qcow2", served)
    create_datavolume(cluster, namespace, "disk", {"http": {"url": images.url("/disk.qcow2")}})

    dv = wait_phase(cluster, namespace, "disk", "Succeeded", "Failed")

    assert dv["status"]["phase"] == "Succeeded", dv["status"]
    raw = cluster.volumes.claim_file(namespace, "disk").read_bytes()
    assert raw == b"\xab" * MI + b"\0" * (3 * MI)
    assert files_in(cluster, namespace) == ["disk.img"]


@pytest.mark.skipif(not (shutil.which("qemu-img") and shutil.which("qemu-io")), reason="qemu-utils not installed")
def test_without_qemu_img_a_qcow2_image_is_kept_as_it_is(cluster: Cluster, namespace: str, images: Images,
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    image = tmp_path / "disk.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(image), "4M"], check=True)
    subprocess.run(["qemu-io", "-f", "qcow2", "-c", "write -P 0xab 0 1M", str(image)], check=True,
                   stdout=subprocess.DEVNULL)
    monkeypatch.setattr(cdi, "qemu_img_command", lambda: None)
    images.add_bytes("/disk.qcow2", image.read_bytes())
    create_datavolume(cluster, namespace, "disk", {"http": {"url": images.url("/disk.qcow2")}})

    dv = wait_phase(cluster, namespace, "disk", "Succeeded", "Failed")

    assert dv["status"]["phase"] == "Succeeded", dv["status"]
    assert cluster.volumes.claim_file(namespace, "disk").read_bytes() == image.read_bytes()


@pytest.mark.skipif(not shutil.which("qemu-img"), reason="qemu-utils not installed")
def test_a_qcow2_image_with_a_backing_file_is_refused(cluster: Cluster, namespace: str, images: Images,
                                                      tmp_path: Path) -> None:
    secret = tmp_path / "host-file.raw"
    secret.write_bytes(b"host data" * 1000)
    image = tmp_path / "overlay.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(secret), "-F", "raw", str(image)],
                   check=True)
    images.add_bytes("/overlay.qcow2", image.read_bytes())
    create_datavolume(cluster, namespace, "disk", {"http": {"url": images.url("/overlay.qcow2")}})

    dv = wait_phase(cluster, namespace, "disk", "Succeeded", "Failed")

    assert dv["status"]["phase"] == "Failed"
    assert "invalid because it has backing file" in running_message(dv)
    assert files_in(cluster, namespace) == []


@pytest.mark.parametrize("stated", [True, False], ids=["size-stated", "size-unknown-until-the-end"])
def test_an_image_larger_than_its_claim_fails_and_leaves_no_file(cluster: Cluster, namespace: str, images: Images,
                                                                 stated: bool) -> None:
    # A claim of 4Mi holds 4Mi less CDI's 5.5% filesystem overhead.
    images.add_blocks("/big.img", 6 * MI, chunked=not stated, ranges=stated)
    create_datavolume(cluster, namespace, "disk", {"http": {"url": images.url("/big.img")}}, size="4Mi")

    dv = wait_phase(cluster, namespace, "disk", "Succeeded", "Failed")

    assert dv["status"]["phase"] == "Failed"
    message = running_message(dv)
    assert "is larger than the reported available storage" in message and "A larger PVC is required." in message
    assert not cluster.volumes.exists(namespace, "disk")
    assert files_in(cluster, namespace) == []


def test_a_server_closing_mid_body_fails_the_import_and_leaves_no_file(cluster: Cluster, namespace: str,
                                                                       images: Images) -> None:
    images.add_truncated("/cut.img", 8 * MI, 3 * MI)
    create_datavolume(cluster, namespace, "disk", {"http": {"url": images.url("/cut.img")}})

    dv = wait_phase(cluster, namespace, "disk", "Succeeded", "Failed")

    assert dv["status"]["phase"] == "Failed"
    assert "unexpected EOF" in running_message(dv)
    assert files_in(cluster, namespace) == []


def test_a_server_stating_a_size_it_does_not_serve_gets_a_file_of_that_size(cluster: Cluster,
                                                                            namespace: str) -> None:
    # tests/support/images.py's double: every GET is answered 206 "bytes 0-0/<size>" with one byte.
    server = ImageServer(8 * MI)
    try:
        create_datavolume(cluster, namespace, "disk", {"http": {"url": f"{server.base}/installer.iso"}})
        dv = wait_phase(cluster, namespace, "disk", "Succeeded", "Failed")
    finally:
        server.close()

    assert dv["status"]["phase"] == "Succeeded", dv["status"]
    assert_sparse(cluster.volumes.claim_file(namespace, "disk"), 8 * MI)


def test_a_stalled_download_holds_only_its_own_datavolume(cluster: Cluster, namespace: str, images: Images) -> None:
    stalled_url = images.add_stalled("/stalled.img", 16 * MI)
    digest = images.add_blocks("/fine.img", 2 * MI)
    create_datavolume(cluster, namespace, "stalled", {"http": {"url": stalled_url}})
    wait_for(images.sent["/stalled.img"].is_set, what="the stalled download under way")
    create_datavolume(cluster, namespace, "fine", {"http": {"url": images.url("/fine.img")}})

    fine = wait_phase(cluster, namespace, "fine", "Succeeded", "Failed")
    stalled = datavolume(cluster, namespace, "stalled")

    assert fine["status"]["phase"] == "Succeeded"
    assert sha256_of(cluster.volumes.claim_file(namespace, "fine")) == digest
    assert stalled["status"]["phase"] == "ImportInProgress"
    assert not cluster.volumes.exists(namespace, "stalled")
    # Deleting it stops its download (the blocked read is woken) and removes its temporary file.
    delete_datavolume(cluster, namespace, "stalled")
    wait_for(lambda: files_in(cluster, namespace) == ["fine.img"], what="only fine.img left")


def test_a_server_that_stops_sending_fails_the_import_after_the_read_timeout(
        cluster: Cluster, namespace: str, images: Images, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cdi, "DOWNLOAD_READ_TIMEOUT", 0.5)
    images.add_stalled("/stalled.img", 16 * MI)
    create_datavolume(cluster, namespace, "disk", {"http": {"url": images.url("/stalled.img")}})

    dv = wait_phase(cluster, namespace, "disk", "Succeeded", "Failed")

    assert dv["status"]["phase"] == "Failed"
    assert "i/o timeout" in running_message(dv)
    assert files_in(cluster, namespace) == []


def test_a_held_import_has_no_file_before_it_succeeds_and_leaves_nothing_once_deleted(held: Cluster,
                                                                                      images: Images) -> None:
    digest = images.add_blocks("/disk.img", 4 * MI)
    with new_namespace(held) as ns:
        create_datavolume(held, ns, "disk", {"http": {"url": images.url("/disk.img")}})

        wait_for(images.sent["/disk.img"].is_set, what="the whole image sent to the importer")
        wait_for(lambda: (part := [f for f in files_in(held, ns) if f.endswith(TEMPORARY_SUFFIX)])
                 and (held.volumes.root / ns / part[0]).stat().st_size == 4 * MI, what="the download complete")
        dv = datavolume(held, ns, "disk")

        # The image is all there, the import is not done (an hour's import: Pending for its first minutes).
        assert dv["status"]["phase"] in ("Pending", "ImportScheduled", "ImportInProgress")
        assert not held.volumes.exists(ns, "disk"), "the claim's file before the import Succeeded"
        assert "disk.img" not in files_in(held, ns)
        part = next(f for f in files_in(held, ns) if f.endswith(TEMPORARY_SUFFIX))
        assert sha256_of(held.volumes.root / ns / part) == digest

        delete_datavolume(held, ns, "disk")
        wait_for(lambda: claim_phase(held, ns, "disk") is None, what="the claim deleted with its DataVolume")
        wait_for(lambda: not (held.volumes.root / ns).exists(), what="nothing left of the import")


def test_a_large_import_is_copied_in_chunks_with_bounded_memory(cluster: Cluster, namespace: str,
                                                                images: Images) -> None:
    size = 200 * MI
    digest = images.add_blocks("/large.img", size)
    peak = RssPeak()
    with peak:
        create_datavolume(cluster, namespace, "large", {"http": {"url": images.url("/large.img")}}, size="512Mi")
        dv = wait_phase(cluster, namespace, "large", "Succeeded", "Failed")

    assert dv["status"]["phase"] == "Succeeded", dv["status"]
    path = cluster.volumes.claim_file(namespace, "large")
    assert path.stat().st_size == size
    assert sha256_of(path) == digest
    print(f"RSS growth while importing {size // MI} MiB: {peak.growth / MI:.1f} MiB")
    assert peak.growth < 50 * MI, f"RSS grew by {peak.growth / MI:.1f} MiB"
    delete_datavolume(cluster, namespace, "large")
    wait_for(lambda: not path.exists(), what="the large file removed")


class RssPeak:
    """The process's peak resident memory over a block, above what it was at the start (VmHWM after resetting
    it through /proc/self/clear_refs, and a sampler besides, in case the reset is refused)."""

    def __init__(self) -> None:
        self.growth = 0
        self._stop = threading.Event()
        self._sampled = 0

    @staticmethod
    def _status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        return 0

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self._sampled = max(self._sampled, self._status("VmRSS"))

    def __enter__(self) -> RssPeak:
        self._reset = True
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self._reset = False
        self._start = self._status("VmRSS")
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._sampler.join()
        peak = max(self._sampled, self._status("VmHWM") if self._reset else 0)
        self.growth = max(peak - self._start, 0)


# ---------------------------------------------------------------- sparse files


def test_a_blank_datavolume_is_a_sparse_file_of_its_claims_size(cluster: Cluster, namespace: str) -> None:
    create_datavolume(cluster, namespace, "scratch", {"blank": {}}, size="1Gi")

    assert wait_phase(cluster, namespace, "scratch", "Succeeded", "Failed")["status"]["phase"] == "Succeeded"
    assert_sparse(cluster.volumes.claim_file(namespace, "scratch"), GI)
    assert files_in(cluster, namespace) == ["scratch.img"]


def test_a_source_kubesim_does_not_contact_gets_a_sparse_stand_in(cluster: Cluster, namespace: str) -> None:
    # `.invalid` never resolves (RFC 6761): had kubesim resolved or connected, the import would have failed.
    create_datavolume(cluster, namespace, "iso", {"http": {"url": "https://images.kubesim.invalid/boot.iso"}},
                      size="500M")

    assert wait_phase(cluster, namespace, "iso", "Succeeded", "Failed")["status"]["phase"] == "Succeeded"
    assert_sparse(cluster.volumes.claim_file(namespace, "iso"), 500 * 10**6)


def test_a_claim_created_directly_gets_a_sparse_file_of_its_request_once_bound(cluster: Cluster,
                                                                               namespace: str) -> None:
    create_claim(cluster, namespace, "data", "2Gi")

    wait_for(lambda: claim_phase(cluster, namespace, "data") == "Bound", what="the claim bound")

    assert_sparse(cluster.volumes.claim_file(namespace, "data"), 2 * GI)


# ---------------------------------------------------------------- deletion


def test_deleting_a_datavolume_removes_its_file(cluster: Cluster, namespace: str, images: Images) -> None:
    images.add_blocks("/disk.img", MI)
    create_datavolume(cluster, namespace, "disk", {"http": {"url": images.url("/disk.img")}})
    create_datavolume(cluster, namespace, "other", {"blank": {}})
    wait_phase(cluster, namespace, "disk", "Succeeded")
    wait_phase(cluster, namespace, "other", "Succeeded")
    assert files_in(cluster, namespace) == ["disk.img", "other.img"]

    delete_datavolume(cluster, namespace, "disk")

    wait_for(lambda: files_in(cluster, namespace) == ["other.img"], what="disk.img removed")
    assert claim_phase(cluster, namespace, "disk") is None


def test_deleting_a_claim_removes_its_file_and_then_its_namespace_directory(cluster: Cluster,
                                                                          namespace: str) -> None:
    create_claim(cluster, namespace, "data", "1Gi")
    wait_for(lambda: cluster.volumes.exists(namespace, "data"), what="the claim's file")

    # Not deserialised: kubesim answers a claim's DELETE with a Status (kube-apiserver: the deleted claim).
    client.CoreV1Api(api_of(cluster)).delete_namespaced_persistent_volume_claim("data", namespace,
                                                                               _preload_content=False)

    wait_for(lambda: not (cluster.volumes.root / namespace).exists(), what="the file and its directory removed")


def test_deleting_a_namespace_removes_its_volumes(cluster: Cluster) -> None:
    with new_namespace(cluster) as ns:
        create_claim(cluster, ns, "data", "1Gi")
        create_datavolume(cluster, ns, "scratch", {"blank": {}})
        wait_for(lambda: files_in(cluster, ns) == ["data.img", "scratch.img"], what="both files")

    wait_for(lambda: not (cluster.volumes.root / ns).exists(), what="the namespace's volumes removed")


def test_a_datavolume_recreated_under_the_same_name_gets_its_own_file(cluster: Cluster, namespace: str,
                                                                      images: Images) -> None:
    first = images.add_blocks("/first.img", MI)
    second = images.add_blocks("/second.img", 2 * MI + 1)
    create_datavolume(cluster, namespace, "disk", {"http": {"url": images.url("/first.img")}})
    wait_phase(cluster, namespace, "disk", "Succeeded")
    assert sha256_of(cluster.volumes.claim_file(namespace, "disk")) == first

    delete_datavolume(cluster, namespace, "disk")
    wait_for(lambda: claim_phase(cluster, namespace, "disk") is None, what="the old claim gone")
    create_datavolume(cluster, namespace, "disk", {"http": {"url": images.url("/second.img")}})
    wait_phase(cluster, namespace, "disk", "Succeeded")

    assert sha256_of(cluster.volumes.claim_file(namespace, "disk")) == second
    assert files_in(cluster, namespace) == ["disk.img"]


def test_a_password_in_a_source_url_never_reaches_the_log(cluster: Cluster, namespace: str, images: Images,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    images.add_blocks("/disk.img", MI)
    images.add_redirect("/latest.img", with_password(images.url("/disk.img"), "t0ken-2"))
    images.add_truncated("/cut.img", 2 * MI, MI)
    caplog.set_level(logging.DEBUG)
    create_datavolume(cluster, namespace, "fine", {"http": {"url": with_password(images.url("/latest.img"),
                                                                                   "s3cret-1")}})
    create_datavolume(cluster, namespace, "cut", {"http": {"url": with_password(images.url("/cut.img"), "s3cret-3")}})

    assert wait_phase(cluster, namespace, "fine", "Succeeded", "Failed")["status"]["phase"] == "Succeeded"
    assert wait_phase(cluster, namespace, "cut", "Succeeded", "Failed")["status"]["phase"] == "Failed"

    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert images.url("/cut.img") in logged  # the failure is logged, with the URL it came from...
    assert "operator@" not in logged and "s3cret" not in logged and "t0ken" not in logged  # ...but not its password


def with_password(url: str, password: str) -> str:
    return url.replace("://", f"://operator:{password}@", 1)
