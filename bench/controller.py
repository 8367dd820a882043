"""The controller at scale on kubesim: N VirtualMachineBMCs Ready, API writes in a steady cluster, memory.

kubesim runs with its kubelet in fake mode (pods become Running and Ready without processes, as kwok does), so
the figures are the controller's and the API server's, not the agents'. The peer here is the target itself
(1,000 Ready within 30 s and RSS under 150 MB; 5,000 Ready within 150 s and RSS under 400 MB; 0 writes in steady
state; 10,000 Ready within 300 s and RSS under 600 MB, issue 29), printed next to what was measured.

Writes are counted by kubesim's global resourceVersion, which moves once per write of anybody: it counts every
write in the cluster, less the kubelets' heartbeats (their Lease renewals and node status posts, which kubesim's
admin API counts: every cluster has them, whatever runs on it). Leader election renews its Lease every 2 s by
design; the steady-state window is measured with leader election off, once the controller's work queue is empty
after the last Ready (the time that took is printed), and the controller's own counter
(kubevbmc_controller_api_writes_total) is shown too.
kubesim keeps its threads on one CPU (its --cpu, here --sim-cpu) and the controller and this benchmark keep off it
(on a cluster they are other pods, on other nodes): `--sim-cpu all` leaves every process on every CPU.
Day 2: the controller is then restarted over the converged cluster, and kubesim then closes every watch after a
compaction (SIGUSR1: resuming gets 410 Gone, every informer lists again); the writes and Events in the window
after each are printed next to the steady figure (the target: none). Memory is the controller's peak RSS (the
kernel's high-water mark, VmHWM) at three moments: the first controller once all are Ready and steady, a new
controller over the converged cluster, and that one again after its forced re-list; each must stay under the target.
Usage: python bench/controller.py [--bmcs N] [--steady SECONDS] [--after SECONDS] [--sim-cpu auto|all|N]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from tests.support.cluster import BMC_CRD, Sim, start_sim, wait_for  # noqa: E402
from vbmc.machine.kubevirt.client import KubeClient, Unreachable, load_credentials  # noqa: E402
from vbmc.machine.kubevirt.streams import watch_events  # noqa: E402

NS = "bench"


def create_vm(api: KubeClient, name: str, namespace: str = NS) -> None:
    """A halted VM with a cdrom, and its Secret `<name>-auth` (admin/password)."""
    api.request("POST", f"/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachines", {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": name},
        "spec": {"runStrategy": "Halted", "template": {"spec": {"domain": {"devices": {
            "disks": [{"name": "root", "disk": {}}, {"name": "cdrom", "cdrom": {}}]}}}}}})
    api.request("POST", f"/api/v1/namespaces/{namespace}/secrets", {
        "metadata": {"name": f"{name}-auth"}, "stringData": {"username": "admin", "password": "password"}})


def create_many(api: KubeClient, count: int, clients: int) -> None:
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda i: create_vm(api, f"vm-{i:04d}"), range(count)))


def create_bmcs(api: KubeClient, count: int, clients: int) -> None:
    """`clients` concurrent creators (as several users or a GitOps tool would), each on its own connection."""
    def create(i: int) -> None:
        name = f"vm-{i:04d}"
        api.request("POST", f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{NS}/virtualmachinebmcs", {
            "apiVersion": "bmc.kubevirt.io/v1beta1", "kind": "VirtualMachineBMC", "metadata": {"name": name},
            "spec": {"virtualMachineRef": {"name": name}, "authSecretRef": {"name": f"{name}-auth"}}})

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(create, range(count)))


def is_ready(bmc: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (bmc.get("status") or {}).get("conditions") or [])


class ReadyWatch:
    """The names of Ready VirtualMachineBMCs, from one watch (polling a list of 1,000 would load kubesim more
    than the controller does)."""

    def __init__(self, api: KubeClient, deadline: float) -> None:
        self.ready: set[str] = set()
        self.ever_ready: set[str] = set()
        self.first_ready: list[float] = []  # when each BMC was first seen Ready (monotonic)
        self.changed = threading.Condition()
        path = f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{NS}/virtualmachinebmcs"
        rv = api.request("GET", path)["metadata"]["resourceVersion"]
        self._events = watch_events(api, path, {"resourceVersion": rv, "timeoutSeconds": str(int(deadline))},
                                    deadline + 5)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        with contextlib.suppress(Unreachable):  # kubesim stopping at the end of the run
            asyncio.run(self._follow())

    async def _follow(self) -> None:
        async for event in self._events:
            obj = event.get("object") or {}
            name = (obj.get("metadata") or {}).get("name", "")
            with self.changed:
                if event.get("type") != "DELETED" and is_ready(obj):
                    if name not in self.ever_ready:
                        self.ever_ready.add(name)
                        self.first_ready.append(time.monotonic())
                    self.ready.add(name)
                else:
                    self.ready.discard(name)
                self.changed.notify_all()

    def wait(self, count: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        with self.changed:
            while len(self.ready) < count and time.monotonic() < deadline:
                self.changed.wait(deadline - time.monotonic())
            return len(self.ready)


def cluster_rv(api: KubeClient) -> int:
    return int(api.request("GET", "/api/v1/namespaces")["metadata"]["resourceVersion"])


def writes_so_far(api: KubeClient) -> int:
    """The cluster's writes so far but the kubelets' heartbeats (see the module's docstring): the resourceVersion
    read between two equal heartbeat counts, so that no heartbeat fell between the reads."""
    while True:
        before = int(api.request("GET", "/kubesim/v1/nodes")["heartbeatWrites"])
        rv = cluster_rv(api)
        if int(api.request("GET", "/kubesim/v1/nodes")["heartbeatWrites"]) == before:
            return rv - before


def memory(pid: int) -> tuple[float, float]:
    rss = pss = 0.0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            rss = int(line.split()[1]) / 1024
        elif line.startswith("Pss:"):
            pss = int(line.split()[1]) / 1024
    return rss, pss


def peak_rss(pid: int) -> float:
    """The process's highest RSS so far (MB): every moment counts, not only the one sampled. nan: it exited."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return float("nan")
    for line in lines:
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rss_target_of(bmcs: int) -> float:
    """150 MB at 1,000 and 400 MB at 5,000 (issue 14), 600 MB at 10,000 (issue 29); in between by line."""
    points = [(1000, 150.0), (5000, 400.0), (10000, 600.0)]
    if bmcs <= points[0][0]:
        return points[0][1]
    for (n0, m0), (n1, m1) in itertools.pairwise(points):
        if bmcs <= n1:
            return m0 + (bmcs - n0) * (m1 - m0) / (n1 - n0)
    return points[-1][1] + (bmcs - points[-1][0]) * (points[-1][1] - points[-2][1]) / (points[-1][0] - points[-2][0])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def metric(metrics_url: str, name: str) -> float:
    """A metric of the controller summed over its labels; nan when it does not answer (it exited)."""
    try:
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except OSError:
        return float("nan")
    return sum(float(m) for m in re.findall(rf"^{name}(?:\{{[^}}]*\}})? ([\d.e+]+)$", text, re.MULTILINE))


def controller_writes(metrics_url: str) -> float:
    return metric(metrics_url, "kubevbmc_controller_api_writes_total")


def settle(metrics_url: str, bmcs: int, timeout: float) -> float:
    """Seconds until a new controller (or one after its re-list) has reconciled every BMC and drained its queue:
    a quiet window that ended before that would prove nothing. nan: not within `timeout`."""
    began = time.monotonic()
    reconciled = metric(metrics_url, "kubevbmc_controller_reconciles_total")
    while time.monotonic() - began < timeout:
        time.sleep(2)
        done = metric(metrics_url, "kubevbmc_controller_reconciles_total")
        if done - reconciled >= bmcs and metric(metrics_url, "kubevbmc_controller_workqueue_depth") == 0:
            return time.monotonic() - began
    return float("nan")


def drained(metrics_url: str, timeout: float) -> float:
    """Seconds until the controller's work queue has been empty at two samples in a row; nan: not within
    `timeout`."""
    began = time.monotonic()
    empty = 0
    while time.monotonic() - began < timeout:
        empty = empty + 1 if metric(metrics_url, "kubevbmc_controller_workqueue_depth") == 0 else 0
        if empty == 2:
            return time.monotonic() - began
        time.sleep(1)
    return float("nan")


def event_count(api: KubeClient) -> tuple[int, int]:
    """(Events, their counts summed) in the benchmark's namespace."""
    items = api.request("GET", f"/api/v1/namespaces/{NS}/events").get("items") or []
    return len(items), sum(int(e.get("count") or 1) for e in items)


def stop(controller: subprocess.Popen[Any]) -> float:
    """SIGTERM; the seconds it took to exit (nan: killed after 30 s, the default grace period)."""
    controller.terminate()
    began = time.monotonic()
    try:
        controller.wait(timeout=30)
        return time.monotonic() - began
    except subprocess.TimeoutExpired:
        controller.kill()
        controller.wait()
        return float("nan")


def quiet_window(api: KubeClient, act: Callable[[], str], seconds: float, bmcs: int,
                 skip_revisions: int = 0) -> tuple[int, float, tuple[int, int], float]:
    """`act` (which returns the controller's metrics URL), then the writes cluster-wide (less `skip_revisions`
    that are not writes), the controller's writes and the Events until it has reconciled every BMC again and for
    `seconds` more; and how long that reconciling took."""
    rv0 = writes_so_far(api) + skip_revisions
    metrics_url = act()
    settled = settle(metrics_url, bmcs, timeout=max(300.0, bmcs / 20))
    time.sleep(seconds)
    return writes_so_far(api) - rv0, controller_writes(metrics_url), event_count(api), settled


def other_cpus(sim_cpu: str) -> set[int] | None:
    """The CPUs kubesim does not run on (its --cpu), for the controller and this benchmark: on a cluster the API
    server and the controller are different pods, usually on different nodes, and never share a core's turns.
    None: kubesim is not pinned (all), or this machine has one CPU."""
    allowed = set(os.sched_getaffinity(0))
    if sim_cpu == "all" or len(allowed) < 2:
        return None
    return allowed - {max(allowed) if sim_cpu == "auto" else int(sim_cpu)}


def start_controller(sim: Sim, workdir: Path, cpus: set[int] | None = None) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "vbmc", "controller", "--kubeconfig", sim.kubeconfig, "--agent-image", "kubevbmc:dev",
         "--metrics-address", "127.0.0.1:0", "--leader-elect", "false", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=open(workdir / "controller.log", "w"), text=True, cwd=REPO,  # noqa: SIM115
        preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.search(r"metrics: (\S+)", line)
    if not match:
        raise SystemExit(f"the controller did not start: {line!r}")
    return proc, match.group(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bmcs", type=int, default=1000, help="VirtualMachineBMCs (default %(default)s)")
    parser.add_argument("--steady", type=float, default=60, help="seconds of steady state (default %(default)s)")
    parser.add_argument("--after", type=float, default=60,
                        help="seconds watched after a controller restart and after a forced re-list (default "
                             "%(default)s)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="give up waiting for Ready after this (default: the target and 60 s more)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent creators (default %(default)s)")
    parser.add_argument("--sim-cpu", default="auto", metavar="auto|all|N",
                        help="kubesim's --cpu: the CPU its threads share (default %(default)s; all spreads them "
                             "over every CPU, as before kubesim pinned itself)")
    args = parser.parse_args()
    # Ready in 30 s per 1,000 BMCs (issue 14; 300 s at 10,000, issue 29).
    ready_target = 30 * max(1.0, args.bmcs / 1000)
    rss_target = rss_target_of(args.bmcs)
    timeout = args.timeout if args.timeout is not None else ready_target + 60

    workdir = Path(tempfile.mkdtemp(prefix="bench-controller-"))
    sim = start_sim(workdir / "sim", "--kubelet", "fake", "--cpu", args.sim_cpu)
    cpus = other_cpus(args.sim_cpu)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # this benchmark's clients too (threads started from now on inherit it)
    controller: subprocess.Popen[Any] | None = None
    try:
        api = KubeClient(load_credentials(sim.kubeconfig), timeout=30, maxsize=args.clients)
        api.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                    yaml.safe_load(BMC_CRD.read_text()))
        wait_for(lambda: api.request("GET", "/apis/bmc.kubevirt.io/v1beta1"), what="the CRD")
        api.request("POST", "/api/v1/namespaces", {"metadata": {"name": NS}})
        began = time.monotonic()
        create_many(api, args.bmcs, args.clients)
        print(f"created {args.bmcs} VMs and Secrets in {time.monotonic() - began:.1f} s")
        controller, metrics_url = start_controller(sim, workdir, cpus)
        watch = ReadyWatch(api, timeout)
        cpu0 = {"kubesim": cpu_seconds(sim.process.pid), "controller": cpu_seconds(controller.pid),
                "this benchmark": time.process_time()}
        first_create = time.monotonic()
        create_bmcs(api, args.bmcs, args.clients)
        created = time.monotonic() - first_create
        ready = watch.wait(args.bmcs, timeout - created)
        all_ready = time.monotonic() - first_create
        print(f"{ready}/{args.bmcs} Ready {all_ready:.1f} s after the first create (target {ready_target:.0f} s)",
              flush=True)
        cpu = {"kubesim": cpu_seconds(sim.process.pid) - cpu0["kubesim"],
               "controller": cpu_seconds(controller.pid) - cpu0["controller"],
               "this benchmark": time.process_time() - cpu0["this benchmark"]}
        # At rest means converged: the last BMC's Ready is not the controller's last word when thousands of others
        # are still queued for their Deployments' later status (their BMCs' conditions follow). Measured.
        converged = drained(metrics_url, timeout=180)
        print(f"work queue empty {converged:.1f} s after the last Ready", flush=True)
        time.sleep(5)  # let the last status writes and watch events settle
        rv0, writes0 = writes_so_far(api), controller_writes(metrics_url)
        time.sleep(args.steady)
        rv1, writes1 = writes_so_far(api), controller_writes(metrics_url)
        rss, pss = memory(controller.pid)
        peaks = {"first controller, Ready and steady": peak_rss(controller.pid)}
        events0 = event_count(api)
        print(f"steady: {rv1 - rv0} writes in {args.steady:.0f} s; peak RSS {max(peaks.values()):.1f} MB", flush=True)
        stopped = stop(controller)
        # Day 2: a new controller over the converged cluster, then an API server restart after a compaction
        # (kubesim's SIGUSR1: every watch ends, resuming gets 410 Gone, every informer lists again).
        def restart() -> str:
            nonlocal controller, metrics_url
            controller, metrics_url = start_controller(sim, workdir, cpus)
            return metrics_url

        def relist() -> str:
            os.kill(sim.process.pid, signal.SIGUSR1)
            return metrics_url

        after_restart = quiet_window(api, restart, args.after, args.bmcs)
        peaks["after a restart"] = peak_rss(controller.pid)
        print(f"after a restart: {after_restart}; peak RSS {peaks['after a restart']:.1f} MB", flush=True)
        # A re-list enqueues only what changed (nothing here): its window waits for an empty queue only.
        after_relist = quiet_window(api, relist, args.after, 0, skip_revisions=1)
        peaks["after a forced re-list"] = peak_rss(controller.pid)
        print(f"after a re-list: {after_relist}; peak RSS {peaks['after a forced re-list']:.1f} MB", flush=True)
        rss_end, _ = memory(controller.pid)
    finally:
        if controller is not None and controller.poll() is None:
            stop(controller)
        sim.stop()

    print(f"{'':44}{'measured':>12}{'target':>12}")
    print(f"{'VirtualMachineBMCs created (s)':44}{created:>12.1f}")
    print(f"{'all Ready, from the first create (s)':44}{all_ready:>12.1f}{f'<= {ready_target:.0f}':>12}"
          f"   ({ready}/{args.bmcs} Ready)")
    for share in (0.25, 0.5, 0.75):
        index = int(args.bmcs * share) - 1
        if 0 <= index < len(watch.first_ready):
            print(f"{f'  {share:.0%} Ready (s)':44}{watch.first_ready[index] - first_create:>12.1f}")
    for who, seconds in cpu.items():
        print(f"{f'  CPU seconds used by {who}':44}{seconds:>12.1f}")
    print(f"{'  work queue empty after the last Ready (s)':44}{converged:>12.1f}")
    print(f"{f'API writes in {args.steady:.0f} s of steady state, cluster-wide':44}{rv1 - rv0:>12}{'0':>12}")
    print(f"{'  of which by the controller (its counter)':44}{writes1 - writes0:>12.0f}{'0':>12}")
    for what, (rv_writes, own_writes, events, settled) in (("a controller restart", after_restart),
                                                             ("a forced re-list (410)", after_relist)):
        print(f"{f'  every BMC reconciled again after {what} (s)':44}{settled:>12.1f}")
        print(f"{f'API writes then and {args.after:.0f} s more':44}{rv_writes:>12}{'0':>12}")
        print(f"{'  of which by the controller (its counter)':44}{own_writes:>12.0f}{'0':>12}")
        print(f"{'  new Events (and repeats counted)':44}{events[0] - events0[0]:>12}{'0':>12}   "
              f"(+{events[1] - events0[1]} counted)")
    print(f"{'controller RSS, steady (MB)':44}{rss:>12.1f}{f'< {rss_target:.0f}':>12}")
    print(f"{'controller PSS, steady (MB)':44}{pss:>12.1f}")
    for moment, peak in peaks.items():
        print(f"{f'  peak RSS (MB), {moment}':44}{peak:>12.1f}{f'< {rss_target:.0f}':>12}")
    print(f"{'controller RSS at the end (MB)':44}{rss_end:>12.1f}")
    print(f"{'controller stopped after SIGTERM (s)':44}{stopped:>12.1f}{'< 30':>12}   (the default grace period)")
    quiet = all(window[0] == 0 and window[2] == events0 and window[3] == window[3]  # nan: never reconciled
                for window in (after_restart, after_relist))
    met = (ready == args.bmcs and all_ready <= ready_target and rv1 == rv0 and quiet
           and all(peak < rss_target for peak in peaks.values()))
    print(f"targets: {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
