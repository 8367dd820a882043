"""kubesim's kube-proxy at fleet scale: N Services of three frontends each (an agent's: IPMI over UDP, HTTP and
HTTPS), all with live Endpoints, served within the process's limit of descriptors (20,000 on these machines).

Each Service has no selector and Endpoints written by hand that lead to one local backend (TCP and UDP echo on
three ports), as agent Services lead to agent pods. kubesim keeps a quarter of its limit of listeners itself and
starts proxy shard processes for the rest (kubesim/network.py ProxyController). The benchmark prints the
descriptors and memory of kubesim and of each shard, and checks that a sample of Services answers on each frontend.
The target: every sampled frontend answers and no process passes its limit.
Usage: python bench/services.py [--services N] [--sample K]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.cluster import start_sim  # noqa: E402
from vbmc.machine.kubevirt.client import KubeClient, load_credentials  # noqa: E402

NS = "fleet"
PORTS = (("ipmi", 623, "UDP"), ("http", 80, "TCP"), ("https", 443, "TCP"))


class Backend:
    """Echo servers: TCP on one port per TCP frontend, UDP on one port."""

    def __init__(self) -> None:
        self.ports: dict[str, int] = {}
        self._socks: list[socket.socket] = []
        for name, _, protocol in PORTS:
            if protocol == "TCP":
                sock = socket.create_server(("127.0.0.1", 0), backlog=512)
                threading.Thread(target=self._tcp, args=(sock,), daemon=True).start()
            else:
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                sock.bind(("127.0.0.1", 0))
                threading.Thread(target=self._udp, args=(sock,), daemon=True).start()
            self._socks.append(sock)
            self.ports[name] = sock.getsockname()[1]

    @staticmethod
    def _tcp(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = sock.accept()
                with conn:
                    conn.sendall(b"echo:" + conn.recv(64))

    @staticmethod
    def _udp(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                data, peer = sock.recvfrom(64)
                sock.sendto(b"echo:" + data, peer)


def create(api: KubeClient, index: int, backend: Backend) -> None:
    name = f"bmc-{index:05d}"
    api.request("POST", f"/api/v1/namespaces/{NS}/services", {"metadata": {"name": name}, "spec": {"ports": [
        {"name": n, "port": p, "protocol": proto, "targetPort": backend.ports[n]} for n, p, proto in PORTS]}})
    api.request("POST", f"/api/v1/namespaces/{NS}/endpoints", {"metadata": {"name": name}, "subsets": [{
        "addresses": [{"ip": "127.0.0.1"}],
        "ports": [{"name": n, "port": backend.ports[n], "protocol": proto} for n, _, proto in PORTS]}]})


def answers(ip: str, port: int, protocol: str, deadline: float) -> bool:
    while time.monotonic() < deadline:
        try:
            if protocol == "TCP":
                with socket.create_connection((ip, port), timeout=2) as conn:
                    conn.sendall(b"hi")
                    if conn.recv(64) == b"echo:hi":
                        return True
            else:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                    sock.settimeout(1)
                    sock.sendto(b"hi", (ip, port))
                    if sock.recv(64) == b"echo:hi":
                        return True
        except OSError:
            time.sleep(0.5)
    return False


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--services", type=int, default=10000, help="Services (default %(default)s)")
    parser.add_argument("--sample", type=int, default=200, help="Services checked on every frontend")
    parser.add_argument("--clients", type=int, default=4, help="concurrent creators (default %(default)s)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-services-"))
    sim = start_sim(workdir / "sim", "--kubelet", "fake")
    backend = Backend()
    try:
        api = KubeClient(load_credentials(sim.kubeconfig), timeout=60, maxsize=args.clients)
        api.request("POST", "/api/v1/namespaces", {"metadata": {"name": NS}})
        began = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(lambda i: create(api, i, backend), range(args.services)))
        created = time.monotonic() - began
        items: list[dict[str, Any]] = api.request("GET", f"/api/v1/namespaces/{NS}/services")["items"]
        sample = random.Random(29).sample(items, min(args.sample, len(items)))
        deadline = time.monotonic() + 300
        answered = sum(answers(svc["spec"]["clusterIP"], port, protocol, deadline)
                       for svc in sample for _, port, protocol in PORTS)
        served = time.monotonic() - began
        shards = sim.proxy_shards()
        limit = int(Path(f"/proc/{sim.process.pid}/limits").read_text().split("Max open files")[1].split()[0])
        print(f"{'':44}{'measured':>12}{'target':>12}")
        print(f"{'Services (3 frontends each, live Endpoints)':44}{args.services:>12}")
        print(f"{'  created (s)':44}{created:>12.1f}")
        print(f"{'  sampled frontends answering':44}{f'{answered}/{3 * len(sample)}':>12}"
              f"{f'{3 * len(sample)}':>12}   ({served:.1f} s after the first create)")
        print(f"{'kubesim: descriptors':44}{descriptors(sim.process.pid):>12}{f'< {limit}':>12}")
        print(f"{'kubesim: RSS (MB)':44}{rss_mb(sim.process.pid):>12.1f}")
        print(f"{'proxy shard processes':44}{len(shards):>12}")
        for pid in shards:
            print(f"{f'  shard {pid}: descriptors, RSS (MB)':44}{descriptors(pid):>12}{f'< {limit}':>12}"
                  f"   {rss_mb(pid):.1f} MB")
        ok = answered == 3 * len(sample) and all(descriptors(p) < limit for p in [sim.process.pid, *shards])
        print(f"targets: {'met' if ok else 'NOT met'}")
    finally:
        sim.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
