"""What BMCs cost the API server when nobody talks to them, and when a provisioner reads each once a minute.

N dedicated agents serve N VMs of one kubesim, run as a cluster runs them: each BMC's children as the controller
renders them (controller/desired.py: its Deployment, Secrets, ServiceAccount and RBAC), and kubesim's process
kubelet runs each pod on its Pod IP and sends the probes its Deployment asks for (startup, readiness, liveness), as
the kubelet does. kubesim's apiserver_request_total (kube-apiserver's metric, same labels) counts every request, so
the figures are the API server's own view.

- Idle under probes: nobody but the kubelet talks to any BMC for --idle seconds (target: 0 requests/s; the probes
  are not clients, issue 29). --readiness-period sends the readiness probe at another period (1: the probe schedule
  of earlier releases) to show that the cost does not follow it. Side by side, in the same run and on the same
  kubesim, an informer-style peer watches N x 3 objects of another resource (ConfigMaps, so the counts stay apart)
  the way client-go's reflector does: list, then watch with timeoutSeconds drawn from [5, 10) minutes, renewed when
  it ends. That is the figure KubeVirtBMC-style agents that keep informers would cost (about 0.007 requests/s per
  BMC); an agent that GETs its VM on each read costs nothing idle and one request per read.
- Load: each BMC's System is read over Redfish once a minute (Ironic's power sync), staggered, for --load
  seconds: requests per read (target <= 1.2), and the latency of that read, the first after a minute of silence
  (its cache confirmed first), next to a warm read made right after it (target: within 2x).

The start is bounded (--start-timeout): when some agents are not Ready by then, the bench says which, with their
pods' state and the end of their logs, and exits. Every loop is bounded in count and time; everything listens on
loopback (the Pod IPs are kubesim's, in 127.0.0.0/8). Usage: python bench/idle.py [--bmcs N] [--idle S] [--load S]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime
import http.client
import json
import random
import re
import ssl
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from controller import certificates, desired  # noqa: E402
from controller.settings import Settings  # noqa: E402
from tests.support.cluster import Sim, install_bmc_crd, start_sim  # noqa: E402
from vbmc.machine.kubevirt.client import KubeClient, Unreachable, load_credentials  # noqa: E402
from vbmc.machine.kubevirt.streams import get_json, watch_events  # noqa: E402
from vbmc.machine.kubevirt.watch import STALE_AFTER, WATCH_SECONDS  # noqa: E402

NS = "idle"
USER, PASSWORD = "admin", "password"
HTTP_PORT, HTTPS_PORT = desired.HTTP_PORT, desired.HTTPS_PORT  # on each agent's Pod IP
WATCHES_PER_BMC = 3  # the VM, its VMI, its VirtualMachineBMC
# What the agents ask for (the peer's are ConfigMaps; the kubelet and kubesim's controllers are in its process).
AGENT_RESOURCES = {"virtualmachines", "virtualmachineinstances", "virtualmachinebmcs", "secrets", "events"}


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


def populate(sim: Sim, kube: KubeClient, n: int, readiness_period: int) -> None:
    """N VMs, their VirtualMachineBMCs and each one's children as the controller renders them (the agent
    Deployment with the probes it ships), and the peer's ConfigMaps."""
    install_bmc_crd(sim.api())
    kube.request("POST", "/api/v1/namespaces", {"metadata": {"name": NS}})
    now = datetime.datetime.now(datetime.UTC)
    tls = certificates.issue_leaf(certificates.issue_ca("bench-idle CA", now), ["127.0.0.1"], now)
    settings = Settings(agent_log_level="warning")
    for i in range(n):
        name = f"vm{i:02d}"
        kube.request("POST", f"/apis/kubevirt.io/v1/namespaces/{NS}/virtualmachines", {
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": name},
            "spec": {"runStrategy": "Halted", "template": {"spec": {"domain": {"devices": {}}}}}})
        credentials = kube.request("POST", f"/api/v1/namespaces/{NS}/secrets", {
            "metadata": {"name": f"{name}-auth"}, "stringData": {"username": USER, "password": PASSWORD}})
        bmc = kube.request("POST", f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{NS}/virtualmachinebmcs", {
            "apiVersion": "bmc.kubevirt.io/v1beta1", "kind": "VirtualMachineBMC", "metadata": {"name": name},
            "spec": {"virtualMachineRef": {"name": name}, "authSecretRef": {"name": f"{name}-auth"}}})
        secrets, rbac = f"/api/v1/namespaces/{NS}/secrets", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}"
        tls_secret = kube.request("POST", secrets, desired.desired_tls_secret(bmc, name, tls))
        kube.request("POST", secrets, desired.desired_events_secret(bmc, name))
        kube.request("POST", f"/api/v1/namespaces/{NS}/serviceaccounts", desired.desired_service_account(bmc, name))
        kube.request("POST", f"{rbac}/roles", desired.desired_role(bmc, name, []))
        kube.request("POST", f"{rbac}/rolebindings", desired.desired_role_binding(bmc, name))
        deployment = desired.desired_deployment(bmc, name, settings, credentials, tls_secret)
        if readiness_period:
            container = deployment["spec"]["template"]["spec"]["containers"][0]
            container["readinessProbe"]["periodSeconds"] = readiness_period
        kube.request("POST", f"/apis/apps/v1/namespaces/{NS}/deployments", deployment)
        for k in range(WATCHES_PER_BMC):
            kube.request("POST", f"/api/v1/namespaces/{NS}/configmaps", {"metadata": {"name": f"{name}-{k}"}})


def probes_per_second(kube: KubeClient) -> float:
    """What the kubelet sends the fleet once started (readiness and liveness), from the Deployments' own spec."""
    rate = 0.0
    for deployment in kube.request("GET", f"/apis/apps/v1/namespaces/{NS}/deployments").get("items") or []:
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            rate += sum(1 / float(container[kind].get("periodSeconds", 10))
                        for kind in ("readinessProbe", "livenessProbe") if kind in container)
    return rate


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
    """The agent pods, as kubesim's kubelet runs them: (Pod IP, name) of each BMC, once Ready."""

    def __init__(self, kube: KubeClient, n: int, logs: Path) -> None:
        self.kube, self.n, self.logs = kube, n, logs
        self.ips: list[str] = [""] * n

    def _pods(self) -> list[dict[str, Any]]:
        return list(self.kube.request("GET", f"/api/v1/namespaces/{NS}/pods").get("items") or [])

    def wait_ready(self, timeout: float) -> None:
        """Every agent pod Ready (the kubelet's readiness) and serving its System over HTTP and HTTPS, within
        `timeout` seconds; else say which are not and why (their pods' state, the end of their logs) and exit."""
        deadline = time.monotonic() + timeout
        pending = set(range(self.n))
        while pending and time.monotonic() < deadline:
            for pod in self._pods():
                vm = pod["metadata"].get("labels", {}).get(desired.VM_LABEL, "")
                i = int(vm[2:]) if vm.startswith("vm") and vm[2:].isdigit() else -1
                if i not in pending:
                    continue
                conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or []}
                ip = pod.get("status", {}).get("podIP", "")
                if conditions.get("Ready") == "True" and ip:
                    self.ips[i] = ip
                    if read_system(ip, HTTP_PORT, i)[0] == 200 and read_system(ip, HTTPS_PORT, i, tls=True)[0] == 200:
                        pending.discard(i)
            if pending:
                time.sleep(1.0)
        if pending:
            print(f"agents not ready after {timeout:.0f} s: {', '.join(f'vm{i:02d}' for i in sorted(pending))}")
            for pod in self._pods():
                vm = pod["metadata"].get("labels", {}).get(desired.VM_LABEL, "")
                if vm.startswith("vm") and vm[2:].isdigit() and int(vm[2:]) in pending:
                    status = pod.get("status", {})
                    print(f"  pod {pod['metadata']['name']}: phase {status.get('phase')}, IP {status.get('podIP')}, "
                          f"containers {json.dumps(status.get('containerStatuses'))[:400]}")
                    for log in sorted(self.logs.glob(f"**/*{pod['metadata']['name']}*"))[-1:]:
                        if log.is_file():
                            print("    " + "\n    ".join(log.read_text(errors="replace").splitlines()[-15:]))
            raise SystemExit(1)


_UNVERIFIED = ssl._create_unverified_context()  # the bench's own self-signed certificate


def read_system(ip: str, port: int, i: int, tls: bool = False) -> tuple[int, float]:
    """One Redfish GET of the System on a new connection, as a provisioner's poll once a minute (a kept-alive
    connection does not outlive a minute of silence): (status, seconds)."""
    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    started = time.perf_counter()
    try:
        conn = (http.client.HTTPSConnection(ip, port, timeout=10, context=_UNVERIFIED) if tls
                else http.client.HTTPConnection(ip, port, timeout=10))
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
    parser.add_argument("--readiness-period", type=int, default=0, metavar="S",
                        help="the readiness probe's period instead of the Deployment's own (1: earlier releases')")
    parser.add_argument("--start-timeout", type=float, default=0.0, metavar="S",
                        help="seconds the agents have to be Ready (default 60 + 3 per BMC)")
    args = parser.parse_args()
    n = args.bmcs
    with tempfile.TemporaryDirectory(prefix="bench-idle-") as tmp:
        work = Path(tmp)
        sim: Sim = start_sim(work / "sim", "--bookmark-interval", "60")
        kube = KubeClient(load_credentials(sim.kubeconfig))
        try:
            began = time.monotonic()
            populate(sim, kube, n, args.readiness_period)
            agents = Agents(kube, n, work / "sim" / "pods")
            agents.wait_ready(args.start_timeout or 60 + 3 * n)
            started = time.monotonic() - began
            probe_rate = probes_per_second(kube)
            time.sleep(STALE_AFTER + 2)  # the start-up reads behind us, the caches past the staleness bound
            peer_names = [f"vm{i:02d}-{k}" for i in range(n) for k in range(WATCHES_PER_BMC)]
            before = requests_by(kube)
            peer = InformerPeer(kube, peer_names, args.idle)
            time.sleep(args.idle)  # the kubelet probes every agent meanwhile
            idle = delta(before, requests_by(kube))
            peer.thread.join(15)
            ours = total(idle, AGENT_RESOURCES)
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
                port = HTTP_PORT if plain else HTTPS_PORT
                status, took = read_system(agents.ips[i], port, i, tls=not plain)
                reads += 1
                if status != 200:
                    failed += 1
                    continue
                (plain_cold if plain else cold).append(took)
                (plain_warm if plain else warm).append(read_system(agents.ips[i], port, i, tls=not plain)[1])
            after = requests_by(kube)
            loaded = delta(before, after)
            load_requests = total(loaded, AGENT_RESOURCES)
        finally:
            sim.stop()  # its kubelet stops every pod

    per_bmc = ours / args.idle / n
    print(f"\n{n} BMCs on kubesim, agents run by its kubelet (all Ready {started:.0f} s after the first create); "
          f"idle window {args.idle:.0f} s, load window {args.load:.0f} s\n")
    print(f"{'idle, probed as the Deployments ask':<52}{'requests/s, all':>16}{'per BMC':>12}")
    print(f"{'kubelet probes sent to the agents (their spec)':<52}{probe_rate:>16.2f}{probe_rate / n:>12.3f}")
    print(f"{'kubevbmc agents (measured)':<52}{ours / args.idle:>16.4f}{per_bmc:>12.5f}")
    print(f"{'  target under probes':<52}{0.0:>16.4f}{0.0:>12.5f}")
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
