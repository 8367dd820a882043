"""How long a BMC is dark when its agent's process dies, its pod is deleted, or its node is lost.

kubesim runs --nodes 2 with a shortened --node-monitor-grace-period, and the controller gives its agents a shortened
--agent-node-loss-toleration (both printed); kubesim's kubelet runs every agent as a process. For a dedicated BMC (one
replica) and for a pool of --pool-members BMCs served by one agent pod, each disruption is applied while every BMC
is probed through its Service (ClusterIP) by Redfish (GET of its System, Basic auth) and IPMI (`ipmitool power
status`, lanplus) every --interval seconds; its dark time is from the disruption to its first answer after a probe
failed, for each protocol. The first BMC is probed all along; once it answers, the others (one pod serves them all)
are swept at once (a thread each) until every one answers both ("all answer"), which keeps the probes' own load
from slowing the agent's start. What happened meanwhile is printed from the API server, polled: the node Unknown,
the pod evicted, its replacement created, the replacement Ready. The node turns Unknown the grace period after its
last heartbeat, which came before the loss: sooner than the grace period after it.

On a cluster, a lost node costs the node monitor grace period (kube-controller-manager's --node-monitor-grace-period,
40 s by default; the node lifecycle controller also looks only every 5 s) plus the toleration (the chart's
agent.nodeLossTolerationSeconds, 30) plus the agent's start; the last line projects that from the start measured
here. A killed process is restarted in its pod after the kubelet's back-off (kubesim: 1 s; a kubelet: 10 s).
Needs ipmitool. Usage: python bench/nodeloss.py [--grace S] [--toleration S] [--pool-members N] [--interval S]
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.agents import PASSWORD, USER  # noqa: E402
from tests.support.cluster import Sim, call, install_bmc_crd, start_sim, wait_for  # noqa: E402
from tests.support.controllers import ControllerProcess  # noqa: E402

REAL_GRACE, REAL_TOLERATION = 40.0, 30.0
BMCS = "/apis/bmc.kubevirt.io/v1beta1/namespaces/{ns}/virtualmachinebmcs"


@dataclass
class Target:
    vm: str
    ip: str = ""


@dataclass
class Probe:
    """First answer of one protocol of one BMC after a failure (monotonic), None while dark or never failed."""

    failed: bool = False
    back: float | None = None


@dataclass
class Milestones:
    unknown: float | None = None
    evicted: float | None = None
    created: float | None = None
    ready: float | None = None
    seen: set[str] = field(default_factory=set)


def redfish_answers(target: Target) -> bool:
    insecure = ssl.create_default_context()
    insecure.check_hostname = False
    insecure.verify_mode = ssl.CERT_NONE
    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    request = urllib.request.Request(f"https://{target.ip}/redfish/v1/Systems/{target.vm}",
                                     headers={"Authorization": f"Basic {token}"})
    try:
        with urllib.request.urlopen(request, context=insecure, timeout=1) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


def ipmi_answers(target: Target) -> bool:
    try:
        done = subprocess.run(["ipmitool", "-I", "lanplus", "-C", "17", "-H", target.ip, "-U", USER, "-P", PASSWORD,
                               "-R", "1", "-N", "1", "power", "status"], capture_output=True, timeout=5)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def probe(answers: Callable[[Target], bool], target: Target, result: Probe, stop: threading.Event,
          interval: float) -> None:
    while not stop.is_set():
        if answers(target):
            if result.failed:
                result.back = time.monotonic()
                return
        else:
            result.failed = True
        stop.wait(interval)


def agent_pods(api: Any, ns: str) -> list[dict[str, Any]]:
    return [p for p in call(api, "GET", f"/api/v1/namespaces/{ns}/pods").body["items"]
            if p["metadata"].get("labels", {}).get("app.kubernetes.io/name") == "kubevbmc-agent"]


def is_ready(obj: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions") or [])


def follow(api: Any, ns: str, old: str, node: str, marks: Milestones, stop: threading.Event) -> None:
    """What the API server says meanwhile, polled."""
    while not stop.is_set():
        at = time.monotonic()
        pods = agent_pods(api, ns)
        if node and marks.unknown is None:
            status = call(api, "GET", f"/api/v1/nodes/{node}").body
            if any(c["type"] == "Ready" and c["status"] == "Unknown" for c in status["status"]["conditions"]):
                marks.unknown = at
        for pod in pods:
            name = pod["metadata"]["name"]
            if name == old:
                if pod["metadata"].get("deletionTimestamp") and marks.evicted is None:
                    marks.evicted = at
            else:
                if marks.created is None:
                    marks.created = at
                if is_ready(pod) and marks.ready is None:
                    marks.ready = at
        if old not in {p["metadata"]["name"] for p in pods} and marks.evicted is None:
            marks.evicted = at
        stop.wait(0.1)


def disrupt_and_measure(api: Any, ns: str, targets: list[Target], disrupt: Callable[[dict[str, Any]], str],
                        interval: float) -> tuple[float, float, float, Milestones, float]:
    """Apply `disrupt` to the one agent pod of `ns` (it returns the node it lost, or ""): the Redfish and IPMI dark
    times of the first BMC (probed all along), the time until every BMC answers both (swept once the first is back:
    one pod serves them all), the milestones, and t0 (monotonic)."""
    [pod] = [p for p in agent_pods(api, ns) if not p["metadata"].get("deletionTimestamp")]
    stop = threading.Event()
    redfish, ipmi = Probe(), Probe()
    threads = [threading.Thread(target=probe, args=(answers, targets[0], result, stop, interval), daemon=True)
               for answers, result in ((redfish_answers, redfish), (ipmi_answers, ipmi))]
    marks = Milestones()
    t0 = time.monotonic()
    node = disrupt(pod)
    watcher = threading.Thread(target=follow, args=(api, ns, pod["metadata"]["name"], node, marks, stop), daemon=True)
    for thread in [*threads, watcher]:
        thread.start()
    wait_for(lambda: redfish.back is not None and ipmi.back is not None, timeout=600, interval=0.1,
             what="the first BMC to answer again")
    assert redfish.back is not None and ipmi.back is not None

    def answered(target: Target) -> float:
        while not (redfish_answers(target) and ipmi_answers(target)):
            time.sleep(interval)
        return time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(max(1, len(targets) - 1)) as sweep:
        every = max([redfish.back, ipmi.back, *sweep.map(answered, targets[1:])]) - t0
    stop.set()
    return redfish.back - t0, ipmi.back - t0, every, marks, t0


def create_bmcs(api: Any, ns: str, count: int, pool: str) -> list[Target]:
    targets = []
    for i in range(count):
        vm = f"vm{i:02d}"
        assert call(api, "POST", f"/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachines", {
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": vm},
            "spec": {"runStrategy": "Halted", "template": {"spec": {"domain": {"devices": {
                "disks": [{"name": "root", "disk": {}}]}}}}}}).status == 201
        assert call(api, "POST", f"/api/v1/namespaces/{ns}/secrets", {
            "metadata": {"name": f"{vm}-auth"}, "stringData": {"username": USER, "password": PASSWORD}}).status == 201
        assert call(api, "POST", BMCS.format(ns=ns), {
            "apiVersion": "bmc.kubevirt.io/v1beta1", "kind": "VirtualMachineBMC", "metadata": {"name": vm},
            "spec": {"virtualMachineRef": {"name": vm}, "authSecretRef": {"name": f"{vm}-auth"},
                     **({"agentPool": pool} if pool else {})}}).status == 201
        targets.append(Target(vm))

    def all_ready() -> bool:
        items = call(api, "GET", BMCS.format(ns=ns)).body["items"]
        return len(items) == count and all(is_ready(b) for b in items)

    wait_for(all_ready, timeout=300, interval=0.5, what=f"{count} BMCs Ready")
    for bmc, target in zip(sorted(call(api, "GET", BMCS.format(ns=ns)).body["items"],
                                  key=lambda b: b["metadata"]["name"]), targets, strict=True):
        target.ip = bmc["status"]["clusterIP"]
    wait_for(lambda: all(redfish_answers(t) and ipmi_answers(t) for t in targets), timeout=120,
             what="every BMC to answer")
    return targets


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grace", type=float, default=5.0, help="kubesim's --node-monitor-grace-period (s)")
    parser.add_argument("--toleration", type=int, default=5, help="the controller's --agent-node-loss-toleration (s)")
    parser.add_argument("--pool-members", type=int, default=20, help="BMCs in the pool (0: no pool run)")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between probes of one protocol")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-nodeloss-"))
    sim: Sim = start_sim(work / "sim", "--nodes", "2", "--node-monitor-grace-period", str(args.grace),
                         "--bookmark-interval", "0.5", "--vm-start-delay", "0.3")
    api = sim.api()
    controller: ControllerProcess | None = None
    rows: list[tuple[str, str, float, float, float, Milestones, float]] = []
    try:
        install_bmc_crd(api)
        controller = ControllerProcess(sim.kubeconfig, work / "controller.log", "--leader-elect", "false",
                                       "--agent-node-loss-toleration", str(args.toleration))

        def kill_process(pod: dict[str, Any]) -> str:
            pid = int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("process://"))
            os.kill(pid, signal.SIGKILL)
            return ""

        def delete_pod(pod: dict[str, Any]) -> str:
            reply = call(api, "DELETE", f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods/"
                                        f"{pod['metadata']['name']}")
            assert reply.status == 200, reply.body
            return ""

        def lose_node(pod: dict[str, Any]) -> str:
            sim.power_off_node(pod["spec"]["nodeName"])
            return str(pod["spec"]["nodeName"])

        runs = [("dedicated", "", 1)] + ([("pool", "lab", args.pool_members)] if args.pool_members else [])
        for label, pool, count in runs:
            ns = label
            assert call(api, "POST", "/api/v1/namespaces", {"metadata": {"name": ns}}).status == 201
            targets = create_bmcs(api, ns, count, pool)
            for what, disrupt in (("process killed", kill_process), ("pod deleted", delete_pod),
                                  ("node lost", lose_node)):
                redfish, ipmi, every, marks, t0 = disrupt_and_measure(api, ns, targets, disrupt, args.interval)
                rows.append((f"{label} ({count})", what, redfish, ipmi, every, marks, t0))
                if what == "node lost":
                    for node in ("kubesim-node", "kubesim-node-2"):
                        sim.power_on_node(node)
                    wait_for(lambda: all(not (call(api, "GET", f"/api/v1/nodes/{n}").body.get("spec") or {}).get(
                        "taints") for n in ("kubesim-node", "kubesim-node-2")), what="both nodes back")
    finally:
        if controller is not None:
            controller.stop()
        sim.stop()

    print(f"kubesim: 2 nodes, --node-monitor-grace-period {args.grace:g} s (a cluster: {REAL_GRACE:g} s), kubelet "
          f"back-off 1 s; controller: --agent-node-loss-toleration {args.toleration} s (the chart: "
          f"{REAL_TOLERATION:g} s); probes every {args.interval:g} s")
    print(f"{'BMCs':<14} {'disruption':<15} {'Redfish dark':>12} {'IPMI dark':>10} {'all answer':>11}   "
          f"{'Unknown':>8} {'evicted':>8} {'new pod':>8} {'Ready':>8}")

    def mark(value: float | None, t0: float) -> str:
        return "-" if value is None else f"{value - t0:7.1f}s"

    starts = []
    for label, what, redfish, ipmi, every, marks, t0 in rows:
        print(f"{label:<14} {what:<15} {redfish:11.1f}s {ipmi:9.1f}s {every:10.1f}s   {mark(marks.unknown, t0):>8} "
              f"{mark(marks.evicted, t0):>8} {mark(marks.created, t0):>8} {mark(marks.ready, t0):>8}")
        if what == "node lost" and marks.created is not None:
            starts.append((label, every - (marks.created - t0)))
    for label, start in starts:
        print(f"{label}: on a cluster with the defaults, a lost node leaves it dark for about {REAL_GRACE:g} s "
              f"(up to 5 s more: the node monitor period) + {REAL_TOLERATION:g} s + {start:.1f} s (from the "
              f"replacement pod's creation to answering here) = {REAL_GRACE + REAL_TOLERATION + start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
