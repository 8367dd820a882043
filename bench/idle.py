"""What BMCs cost the API server when nobody talks to them, and when a provisioner reads each once a minute.

N dedicated agents (processes, as on a cluster) serve N VMs of one kubesim; kubesim's apiserver_request_total
(kube-apiserver's metric, same labels) counts every request, so the figures are the API server's own view.

- Idle: nobody talks to any BMC for --idle seconds. Side by side, in the same run and on the same kubesim, an
  informer-style peer watches N x 3 objects of another resource (ConfigMaps, so the counts stay apart) the way
  client-go's reflector does: list, then watch with timeoutSeconds drawn from [5, 10) minutes, renewed when it
  ends. That is the figure KubeVirtBMC-style agents that keep informers would cost (about 0.007 requests/s per
  BMC); an agent that GETs its VM on each read costs nothing idle and one request per read.
- Load: each BMC's System is read over Redfish once a minute (Ironic's power sync), staggered, for --load
  seconds: requests per read (target <= 1.2), and the latency of that read, the first after a minute of silence
  (its cache confirmed first), next to a warm read made right after it (target: within 2x).

Targets: <= 0.01 requests/s per idle BMC, <= 0.2 requests/s for 20 idle agents. Every loop is bounded in count and
time; everything listens on 127.0.0.1. Usage: python bench/idle.py [--bmcs N] [--idle S] [--load S]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import http.client
import json
import os
import random
import re
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.agents import write_serving_certificate  # noqa: E402
from tests.support.cluster import Sim, install_bmc_crd, start_sim  # noqa: E402
from vbmc.machine.kubevirt.client import KubeClient, Unreachable, load_credentials  # noqa: E402
from vbmc.machine.kubevirt.streams import get_json, watch_events  # noqa: E402
from vbmc.machine.kubevirt.watch import STALE_AFTER, WATCH_SECONDS  # noqa: E402

NS = "idle"
USER, PASSWORD = "admin", "password"
WATCHES_PER_BMC = 3  # the VM, its VMI, its VirtualMachineBMC


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def requests_by(kube: KubeClient) -> dict[tuple[str, str], float]:
    """apiserver_request_total by (verb, resource), resource requests only."""
    conn = http.client.HTTPSConnection(kube.creds.server.split("//", 1)[1], context=kube.tls_context(), timeout=10)
    conn.request("GET", "/metrics", headers=kube.auth_headers())
    text = conn.getresponse().read().decode()
    conn.close()
    counts: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("apiserver_request_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            if labels["resource"]:
                key = (labels["verb"], labels["resource"])
                counts[key] = counts.get(key, 0) + float(line.rsplit(" ", 1)[1])
    return counts


def delta(before: dict[Any, float], after: dict[Any, float]) -> dict[Any, float]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def total(counts: dict[tuple[str, str], float], resources: set[str]) -> float:
    return sum(v for (_, resource), v in counts.items() if resource in resources)


def populate(sim: Sim, kube: KubeClient, n: int) -> None:
    install_bmc_crd(sim.api())
    kube.request("POST", "/api/v1/namespaces", {"metadata": {"name": NS}})
    for i in range(n):
        name = f"vm{i:02d}"
        kube.request("POST", f"/apis/kubevirt.io/v1/namespaces/{NS}/virtualmachines", {
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": name},
            "spec": {"runStrategy": "Halted", "template": {"spec": {"domain": {"devices": {}}}}}})
        kube.request("POST", f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{NS}/virtualmachinebmcs", {
            "apiVersion": "bmc.kubevirt.io/v1beta1", "kind": "VirtualMachineBMC", "metadata": {"name": name},
            "spec": {"virtualMachineRef": {"name": name}, "authSecretRef": {"name": f"{name}-auth"}}})
        for k in range(WATCHES_PER_BMC):
            kube.request("POST", f"/api/v1/namespaces/{NS}/configmaps", {"metadata": {"name": f"{name}-{k}"}})


class InformerPeer:
    """client-go reflectors, one per object: list, then watch with timeoutSeconds in [5, 10) minutes (reflector.go:
    minWatchTimeout * (rand + 1)), resumed from the last resourceVersion when the server ends it."""

    def __init__(self, kube: KubeClient, names: list[str], seconds: float) -> None:
        self.kube, self.names, self.deadline = kube, names, time.monotonic() + seconds
        self.thread = threading.Thread(target=lambda: asyncio.run(self._all()), daemon=True)
        self.thread.start()

    async def _all(self) -> None:
        await asyncio.gather(*(self._reflect(n) for n in self.names), return_exceptions=True)

    async def _reflect(self, name: str) -> None:
        path = f"/api/v1/namespaces/{NS}/configmaps"
        selector = {"fieldSelector": f"metadata.name={name}"}
        listing = await get_json(self.kube, path, selector, 10)
        rv = listing["metadata"]["resourceVersion"]
        while time.monotonic() < self.deadline:
            timeout = int(300 * (random.random() + 1))
            query = {**selector, "resourceVersion": rv, "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout)}
            with contextlib.suppress(Unreachable, asyncio.TimeoutError):
                remaining = self.deadline - time.monotonic()
                async with asyncio.timeout(max(0.1, remaining)):
                    async for event in watch_events(self.kube, path, query, timeout + 30):
                        rv = (event.get("object") or {}).get("metadata", {}).get("resourceVersion", rv)


class Agents:
    def __init__(self, kubeconfig: str, n: int, workdir: Path) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ports: list[int] = []
        self.tls_ports: list[int] = []
        cert, key = write_serving_certificate(workdir)
        env = {**os.environ, "KUBECONFIG": kubeconfig, "VBMC_USERNAME": USER, "VBMC_PASSWORD": PASSWORD}
        for i in range(n):
            port, tls_port = free_port(), free_port()
            self.ports.append(port)
            self.tls_ports.append(tls_port)
            log = open(workdir / f"agent-{i:02d}.log", "w")  # noqa: SIM115
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "vbmc", "agent", "--namespace", NS, "--vm", f"vm{i:02d}", "--vmbmc",
                 f"vm{i:02d}", "--ipmi-address", f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}", "--redfish-address",
                 f"127.0.0.1:{port}", "--redfish-tls-address", f"127.0.0.1:{tls_port}", "--tls-cert", str(cert),
                 "--tls-key", str(key), "--log-level", "warning"], cwd=REPO, stdout=log, stderr=log, env=env))

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = set(range(len(self.ports)))
        while pending and time.monotonic() < deadline:
            for i in sorted(pending):
                if read_system(self.ports[i], i)[0] == 200 and read_system(self.tls_ports[i], i, tls=True)[0] == 200:
                    pending.discard(i)
            time.sleep(0.5)
        if pending:
            raise SystemExit(f"agents not serving after {timeout}s: {sorted(pending)}")

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


_UNVERIFIED = ssl._create_unverified_context()  # the bench's own self-signed certificate


def read_system(port: int, i: int, tls: bool = False) -> tuple[int, float]:
    """One Redfish GET of the System on a new connection, as a provisioner's poll once a minute (a kept-alive
    connection does not outlive a minute of silence): (status, seconds)."""
    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    started = time.perf_counter()
    try:
        conn = (http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=_UNVERIFIED) if tls
                else http.client.HTTPConnection("127.0.0.1", port, timeout=10))
        conn.request("GET", f"/redfish/v1/Systems/vm{i:02d}", headers={"Authorization": f"Basic {token}"})
        response = conn.getresponse()
        status = response.status
        json.loads(response.read())
        conn.close()
    except (OSError, ValueError):
        status = 0
    return status, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bmcs", type=int, default=20)
    parser.add_argument("--idle", type=float, default=600.0, help="seconds of silence measured (default 600)")
    parser.add_argument("--load", type=float, default=180.0, help="seconds of one read per BMC a minute")
    args = parser.parse_args()
    n = args.bmcs
    with tempfile.TemporaryDirectory(prefix="bench-idle-") as tmp:
        work = Path(tmp)
        sim: Sim = start_sim(work / "sim", "--bookmark-interval", "60")
        kube = KubeClient(load_credentials(sim.kubeconfig))
        agents: Agents | None = None
        try:
            populate(sim, kube, n)
            agents = Agents(sim.kubeconfig, n, work)
            agents.wait_ready(60 + 3 * n)
            time.sleep(STALE_AFTER)  # the start-up reads behind us
            peer_names = [f"vm{i:02d}-{k}" for i in range(n) for k in range(WATCHES_PER_BMC)]
            before = requests_by(kube)
            peer = InformerPeer(kube, peer_names, args.idle)
            time.sleep(args.idle)
            idle = delta(before, requests_by(kube))
            peer.thread.join(15)
            ours = total(idle, {"virtualmachines", "virtualmachineinstances", "virtualmachinebmcs"})
            theirs = total(idle, {"configmaps"}) - len(peer_names)  # their first LISTs are start-up, not idle

            # Load: one read per BMC a minute over HTTPS, staggered over the minute; a warm read right after each,
            # and the same pair over plain HTTP (the warm cache then costs only the request itself).
            before = requests_by(kube)
            cold: list[float] = []
            warm: list[float] = []
            plain_cold: list[float] = []
            plain_warm: list[float] = []
            reads = failed = 0
            start = time.monotonic()
            end = start + args.load
            schedule = sorted((start + (i * 60.0 / n) + 60.0 * k, i) for i in range(n)
                               for k in range(int(args.load // 60) + 1))
            for due, i in schedule:
                if due >= end:
                    break
                time.sleep(max(0.0, due - time.monotonic()))
                plain = reads % 2 == 1  # every other poll over plain HTTP
                port = agents.ports[i] if plain else agents.tls_ports[i]
                status, took = read_system(port, i, tls=not plain)
                reads += 1
                if status != 200:
                    failed += 1
                    continue
                (plain_cold if plain else cold).append(took)
                (plain_warm if plain else warm).append(read_system(port, i, tls=not plain)[1])
            after = requests_by(kube)
            loaded = delta(before, after)
            load_requests = total(loaded, {"virtualmachines", "virtualmachineinstances", "virtualmachinebmcs"})
        finally:
            if agents is not None:
                agents.stop()
            sim.stop()

    per_bmc = ours / args.idle / n
    print(f"\n{n} BMCs on kubesim; idle window {args.idle:.0f} s, load window {args.load:.0f} s\n")
    print(f"{'idle':<52}{'requests/s, all':>16}{'per BMC':>12}")
    print(f"{'kubevbmc agents (measured)':<52}{ours / args.idle:>16.4f}{per_bmc:>12.5f}")
    print(f"{'  their watch renewals, steady state':<52}{n * WATCHES_PER_BMC / WATCH_SECONDS:>16.4f}"
          f"{WATCHES_PER_BMC / WATCH_SECONDS:>12.5f}")
    print(f"{'informer-style peer (measured, same run)':<52}{theirs / args.idle:>16.4f}"
          f"{theirs / args.idle / n:>12.5f}")
    print(f"{'target':<52}{0.01 * n:>16.4f}{0.01:>12.5f}")
    print(f"  requests while idle: {json.dumps({'/'.join(k): v for k, v in idle.items()})}")
    print(f"\n{'one Redfish read per BMC a minute':<52}{'value':>16}{'target':>12}")
    print(f"{'requests per read':<52}{load_requests / max(1, reads):>16.3f}{1.2:>12.1f}")
    print(f"{'  of which failed reads':<52}{failed:>16d}{0:>12d}")
    for label, first, again, target in (("HTTPS", cold, warm, "2.0"), ("plain HTTP", plain_cold, plain_warm, "")):
        if first and again:
            c, w = statistics.median(first), statistics.median(again)
            print(f"{f'{label}: first read after a minute idle, median (ms)':<52}{c * 1000:>16.2f}")
            print(f"{f'{label}: warm read right after it, median (ms)':<52}{w * 1000:>16.2f}")
            print(f"{f'{label}: ratio':<52}{c / w:>16.2f}{target:>12}")
    print(f"  requests under load: {json.dumps({'/'.join(k): v for k, v in loaded.items()})}")


if __name__ == "__main__":
    main()
