"""kubesim's kube-proxy past its own share of descriptors: the next Services are served by shard processes.

An agent's Service has three frontends (IPMI over UDP, Redfish over HTTP and HTTPS), so 10,000 of them need 30,000
listening sockets where one process may hold 20,000. Here kubesim keeps 4 listeners itself and each shard 4
(`--proxy-listeners 4`), so that five Services of two ports each take kubesim and two shards."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from ..support.cluster import Sim, start_sim, wait_for


class Echo:
    """A backend: TCP and UDP on one loopback port, each answering `<tag>:<what it got>`."""

    def __init__(self, tag: bytes) -> None:
        self.tag = tag
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.port = self.tcp.getsockname()[1]
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", self.port))
        threading.Thread(target=self._tcp, daemon=True).start()
        threading.Thread(target=self._udp, daemon=True).start()

    def _tcp(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.tcp.accept()
                with conn:
                    conn.sendall(self.tag + b":" + conn.recv(100))

    def _udp(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                data, peer = self.udp.recvfrom(100)
                self.udp.sendto(self.tag + b":" + data, peer)

    def close(self) -> None:
        self.tcp.close()
        self.udp.close()


@pytest.fixture
def sharded(tmp_path: Path) -> Iterator[Sim]:
    sim = start_sim(tmp_path / "sim", "--proxy-listeners", "4", "--kubelet", "fake")
    yield sim
    sim.stop()


def tcp(ip: str, port: int) -> bytes:
    with socket.create_connection((ip, port), timeout=5) as conn:
        conn.sendall(b"hello")
        return conn.recv(100)


def udp(ip: str, port: int) -> bytes:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(1)
        sock.sendto(b"hello", (ip, port))
        return sock.recv(100)


def answers(call: object, *args: object) -> bytes:
    """What a client gets once the frontend is served (a shard binds a moment after the Service is written)."""
    def attempt() -> bytes:
        with contextlib.suppress(OSError):
            return call(*args)  # type: ignore[operator, no-any-return]
        return b""
    return wait_for(attempt, timeout=15, what=f"an answer from {args}")  # type: ignore[no-any-return]


def service(core: client.CoreV1Api, namespace: str, name: str, backend: Echo) -> str:
    """A Service without a selector and its Endpoints written by hand (as for an external backend)."""
    core.create_namespaced_service(namespace, {"metadata": {"name": name}, "spec": {"ports": [
        {"name": "tcp", "port": 80, "targetPort": backend.port},
        {"name": "udp", "port": 623, "protocol": "UDP", "targetPort": backend.port}]}})
    core.create_namespaced_endpoints(namespace, endpoints(name, backend))
    return str(core.read_namespaced_service(name, namespace).spec.cluster_ip)


def endpoints(name: str, backend: Echo) -> dict[str, object]:
    return {"metadata": {"name": name}, "subsets": [{"addresses": [{"ip": "127.0.0.1"}], "ports": [
        {"name": "tcp", "port": backend.port}, {"name": "udp", "port": backend.port, "protocol": "UDP"}]}]}


def test_services_past_kubesims_share_are_served_by_shards_that_end_with_it(sharded: Sim) -> None:
    core = client.CoreV1Api(sharded.api())
    core.create_namespace({"metadata": {"name": "fleet"}})
    backends = [Echo(f"svc-{i}".encode()) for i in range(5)]
    try:
        ips = [service(core, "fleet", f"svc-{i}", backend) for i, backend in enumerate(backends)]
        for i, ip in enumerate(ips):
            assert answers(tcp, ip, 80) == f"svc-{i}:hello".encode()
            assert answers(udp, ip, 623) == f"svc-{i}:hello".encode()
        shards = sharded.proxy_shards()
        assert len(shards) == 2  # 2 Services in kubesim, 2 in the first shard, 1 in the second

        # The last Service is a shard's: its Endpoints move to another backend, and the shard follows them.
        moved = Echo(b"moved")
        backends.append(moved)
        core.replace_namespaced_endpoints("svc-4", "fleet", endpoints("svc-4", moved))
        wait_for(lambda: answers(tcp, ips[4], 80) == b"moved:hello", what="the shard following the Endpoints")
        assert answers(udp, ips[4], 623) == b"moved:hello"

        # Deleted, its listeners close: the ClusterIP refuses, the others still answer.
        core.delete_namespaced_service("svc-4", "fleet")

        def refused() -> bool:
            try:
                tcp(ips[4], 80)
            except ConnectionRefusedError:
                return True
            except OSError:
                return False
            return False
        wait_for(refused, what="svc-4's listener closed")
        assert answers(tcp, ips[3], 80) == b"svc-3:hello"
    finally:
        for backend in backends:
            backend.close()

    sharded.stop()
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in shards), what="the shards exited")


def test_a_shard_exits_when_kubesim_is_killed(sharded: Sim) -> None:
    core = client.CoreV1Api(sharded.api())
    core.create_namespace({"metadata": {"name": "fleet"}})
    backends = [Echo(f"svc-{i}".encode()) for i in range(3)]
    try:
        ips = [service(core, "fleet", f"svc-{i}", backend) for i, backend in enumerate(backends)]
        assert answers(tcp, ips[2], 80) == b"svc-2:hello"
        shards = sharded.proxy_shards()
        assert len(shards) == 1
        sharded.process.kill()
        sharded.process.wait()
        wait_for(lambda: not Path(f"/proc/{shards[0]}").exists() or
                 Path(f"/proc/{shards[0]}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z",
                 what="the orphaned shard exited")
    finally:
        for backend in backends:
            backend.close()


def test_a_shard_ignores_a_malformed_line_and_serves_the_next() -> None:
    """Only kubesim writes to a shard, but a line it cannot read (a bug, a torn write) must cost that line only: the
    shard says so, keeps serving, and takes the next line."""
    backend = Echo(b"after")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    shard = subprocess.Popen([sys.executable, "-m", "kubesim.proxyshard", "9"], stdin=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        assert shard.stdin is not None and shard.stderr is not None
        valid = {"owner": ["fleet", "svc"], "frontends": [
            ["127.0.0.1", port, "TCP", ["fleet", "svc", "tcp"], [["127.0.0.1", backend.port]]]]}
        for line in ("not json", json.dumps({"owner": "x"}), json.dumps({"owner": ["fleet", "svc"], "frontends": [
                ["127.0.0.1", "eighty", "TCP", ["fleet", "svc", "tcp"], []]]}), json.dumps(valid)):
            shard.stdin.write(line + "\n")
        shard.stdin.flush()
        assert answers(tcp, "127.0.0.1", port) == b"after:hello"
        assert shard.poll() is None
        shard.stdin.close()
        assert shard.wait(timeout=30) == 0  # its input closed: it exits, as when kubesim goes
        logged = shard.stderr.read()
        assert logged.count("ignored a malformed line from kubesim") == 3, logged
    finally:
        if shard.poll() is None:
            shard.kill()
            shard.wait()
        backend.close()
