"""The agent's targets, each measured next to a peer in the same run.

- IPMI: `power status` repeated inside one ipmitool session (`ipmitool exec`), against pyghmi's fake BMC.
- Redfish: GET of the System with 8 keep-alive connections (wrk), against sushy-tools' fake driver.
- Memory: every process of one agent (one since the Redfish server is hypercorn's event loop in the agent's
  process) serving a VM of a kubesim cluster.
- Pool (issues 14 and 29): one pooled agent (`kubevbmc agent --pool`, its members in a Secret) serving 10, 100,
  300 and 500 (--pool-members) VMs of the same kubesim cluster, IPMI and Redfish on: at each size its descriptors,
  threads and CPU at rest, whether IPMI answers every member, and one member's Redfish p50/p99 next to the
  dedicated agent's, measured alternately; PSS per extra member; and the latency of one member of the full pool
  next to the dedicated agent's, measured again side by side.

Every load is bounded in count and time and sent to 127.0.0.1 only. Needs ipmitool and wrk (Debian packages)
and the `bench` extra (sushy-tools). Usage: python bench/agent.py [--seconds S] [--commands N] [--pool-members N]
[--pool-seconds S] [--idle-seconds S]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
USER, PASSWORD = "admin", "password"  # pyghmi's fake BMC knows only these


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 20, headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{url} did not answer within {timeout}s")


def start_agent(ipmi_port: int, http_port: int, *extra: str,
                env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "vbmc", "agent", "--vm", "vm", "--ipmi-address", f"127.0.0.1:{ipmi_port}",
         "--redfish-address", f"127.0.0.1:{http_port}", "--log-level", "warning", *extra],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "VBMC_USERNAME": USER, "VBMC_PASSWORD": PASSWORD, **(env or {})})
    wait_http(f"http://127.0.0.1:{http_port}/readyz")
    return proc


def stop(proc: subprocess.Popen[Any]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


# ---- IPMI


def ipmi_session(port: int, commands: int, cipher: str) -> float:
    """Seconds per `power status` in one lanplus session of `commands` commands."""
    # ipmitool's exec reads its commands from a file: one per session, removed once the session ends.
    with tempfile.NamedTemporaryFile("w", prefix="bench-agent-", suffix=".ipmi") as script:
        script.write("power status\n" * commands)
        script.flush()
        began = time.perf_counter()
        result = subprocess.run(["ipmitool", "-I", "lanplus", "-C", cipher, "-H", "127.0.0.1", "-p", str(port),
                                 "-U", USER, "-P", PASSWORD, "exec", script.name],
                                capture_output=True, text=True, timeout=120)
        elapsed = time.perf_counter() - began
    answered = result.stdout.count("Chassis Power is")
    if answered != commands:
        raise SystemExit(f"ipmitool answered {answered}/{commands}: {result.stderr[-300:]}")
    return elapsed / commands


def bench_ipmi(servers: dict[str, int], commands: int) -> None:
    print(f"IPMI `power status` in one ipmitool session ({commands} commands, best of 3), per command")
    print(f"{'server':<26}{'suite 3 (ms)':>14}{'suite 17 (ms)':>15}{'vs pyghmi (suite 3)':>22}")
    results: dict[str, dict[str, float]] = {}
    for name, port in servers.items():
        results[name] = {}
        for cipher in ("3", "17"):
            try:
                results[name][cipher] = min(ipmi_session(port, commands, cipher) for _ in range(3))
            except SystemExit:
                results[name][cipher] = float("nan")  # pyghmi's fake BMC does not negotiate suite 17
    peer = results["pyghmi fakebmc"]["3"]
    for name, row in results.items():
        s3, s17 = (f"{row[c] * 1000:.3f}" if row[c] == row[c] else "n/a" for c in ("3", "17"))
        print(f"{name:<26}{s3:>14}{s17:>15}{peer / row['3']:>21.2f}x")
    print()


# ---- Redfish


def wrk(url: str, seconds: float, headers: dict[str, str], connections: int) -> dict[str, float]:
    threads = min(2, connections)
    args = ["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{seconds:.0f}s", "--latency", "--timeout", "5s"]
    for key, value in headers.items():
        args += ["-H", f"{key}: {value}"]
    out = subprocess.run([*args, url], capture_output=True, text=True, timeout=seconds + 30).stdout
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"rate": rate, "p50_ms": _percentile(out, "50%"), "p99_ms": _percentile(out, "99%"),
            "errors": float(non2xx.group(1) if non2xx else 0)}


def _percentile(out: str, label: str) -> float:
    m = re.search(label + r"\s+([\d.]+)(us|ms|s)", out)
    assert m is not None, out
    return float(m.group(1)) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[m.group(2)]


def bench_redfish(servers: dict[str, str], seconds: float) -> None:
    auth = {"Authorization": "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}
    print(f"Redfish GET System with wrk, {seconds:.0f} s per row")
    print(f"{'server':<26}{'connections':>12}{'req/s':>9}{'p50 (ms)':>10}{'p99 (ms)':>10}{'errors':>8}"
          f"{'vs sushy-tools':>16}")
    peer: dict[int, float] = {}
    rows = []
    for name, url in servers.items():
        for conns in (1, 8):
            r = wrk(url, seconds, auth, conns)
            rows.append((name, conns, r))
            if name == "sushy-tools fake":
                peer[conns] = r["rate"]
    for name, conns, r in rows:
        print(f"{name:<26}{conns:>12}{r['rate']:>9.0f}{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}{r['errors']:>8.0f}"
              f"{r['rate'] / peer[conns]:>15.2f}x")
    mine = next(r for n, c, r in rows if n == "kubevbmc (memory)" and c == 8)
    print(f"target at 8 connections: >= 5x sushy-tools and p99 < 20 ms: "
          f"{'met' if mine['rate'] >= 5 * peer[8] and mine['p99_ms'] < 20 else 'NOT met'}")
    print()


# ---- memory


def memory_of(pids: list[int]) -> tuple[float, float]:
    """(RSS, PSS) in MB summed over `pids` (PSS counts shared pages once)."""
    rss = pss = 0.0
    for pid in pids:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss += int(line.split()[1]) / 1024
            elif line.startswith("Pss:"):
                pss += int(line.split()[1]) / 1024
    return rss, pss


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def bench_memory(agent: subprocess.Popen[Any]) -> None:
    pids = [agent.pid, *children(agent.pid)]
    print(f"Memory of one agent (kubevirt backend on kubesim, after the loads above), {len(pids)} processes")
    total_rss = total_pss = 0.0
    roles = ("agent (Machine, Redfish, IPMI)",) if len(pids) == 1 else ("gunicorn master", "worker")
    for role, pid in zip(roles, pids, strict=False):
        rss, pss = memory_of([pid])
        total_rss, total_pss = total_rss + rss, total_pss + pss
        print(f"{role:<34}RSS {rss:6.1f} MB   PSS {pss:6.1f} MB")
    print(f"{'all processes':<34}RSS {total_rss:6.1f} MB   PSS {total_pss:6.1f} MB  "
          "(PSS counts a page shared by several processes once, as the pod's cgroup does)")
    print(f"target: under 60 MB: {'met' if total_pss < 60 else 'NOT met'} by PSS, "
          f"{'met' if total_rss < 60 else 'NOT met'} by summed RSS")
    print()


def kubevirt_agent(workdir: Path) -> tuple[Any, subprocess.Popen[Any], int, int]:
    """A kubesim cluster (its files in `workdir`) with one VM and its VirtualMachineBMC, and an agent for it."""
    sys.path.insert(0, str(REPO))
    import yaml

    from tests.support.cluster import BMC_CRD, call, start_sim, wait_for
    from tests.support.vms import make_bmc, make_vm

    sim = start_sim(workdir / "sim")
    api = sim.api()
    call(api, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", yaml.safe_load(BMC_CRD.read_text()))
    wait_for(lambda: call(api, "GET", "/apis/bmc.kubevirt.io/v1beta1").status == 200, what="the CRD")
    make_vm(api, "default")
    make_bmc(api, "default")
    ipmi_port, http_port = free_port(socket.SOCK_DGRAM), free_port()
    agent = start_agent(ipmi_port, http_port, "--namespace", "default", "--vmbmc", "vm",
                        env={"KUBECONFIG": sim.kubeconfig})
    return sim, agent, ipmi_port, http_port


# ---- pooled agent


POOL_NS, POOL_SECRET = "default", "pool-bench"
POOL_CURVE = (10, 100, 300, 500)  # the pool sizes measured, up to --pool-members


def pool_entries(count: int) -> list[dict[str, Any]]:
    """The bench pool's members: VM and VirtualMachineBMC pvm-NNN, free loopback ports (each used once), the
    bench's credentials for every member."""
    taken: set[tuple[int, int]] = set()

    def port(kind: int) -> int:
        while (kind, number := free_port(kind)) in taken:
            pass
        taken.add((kind, number))
        return number

    return [{"name": f"pvm-{i:03d}", "vm": f"pvm-{i:03d}", "username": USER, "password": PASSWORD,
             "ipmiPort": port(socket.SOCK_DGRAM), "httpPort": port(socket.SOCK_STREAM), "httpsPort": 0,
             "ipmi": True, "redfish": True, "requireTLS": False, "tlsCert": "", "tlsKey": "",
             "subscriptionsSecret": ""} for i in range(count)]


def set_pool(api: Any, members: list[dict[str, Any]]) -> None:
    from tests.support.cluster import call

    data = {"pool.json": base64.b64encode(json.dumps({"members": members}).encode()).decode()}
    body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": POOL_SECRET}, "data": data}
    path = f"/api/v1/namespaces/{POOL_NS}/secrets"
    reply = call(api, "PUT", f"{path}/{POOL_SECRET}", body)
    if reply.status == 404:
        reply = call(api, "POST", path, body)
    if reply.status not in (200, 201):
        raise SystemExit(f"pool Secret: {reply.status} {reply.body}")


def metric(url: str, name: str) -> float:
    """A gauge of the pool's /metrics; NaN while the pool is too busy starting members to answer in time."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return float("nan")
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else float("nan")


IPMI_TRIES = 3  # ipmitool runs per member before its IPMI counts as not answering


def touch(entry: dict[str, Any]) -> bool:
    """One Redfish GET of the member's System and one IPMI power status: every part of it has served. False when
    IPMI did not answer IPMI_TRIES runs of ipmitool (counted, not fatal: the curve says how many members answer)."""
    auth = {"Authorization": "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}
    url = f"http://127.0.0.1:{entry['httpPort']}/redfish/v1/Systems/{entry['vm']}"
    for attempt in range(5):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=auth), timeout=10) as resp:
                resp.read()
            break
        except urllib.error.HTTPError as error:  # 503: a cache it could not confirm in time (a busy kubesim)
            if error.code != 503:
                raise
            if attempt == 4:
                print(f"member {entry['name']}: Redfish 503 five times (kubesim too busy to confirm its cache)",
                      flush=True)
            time.sleep(1)
    # ipmitool sends a packet again when its answer is late (4 times, 1 s apart and a second more each time), but
    # takes a refusal as final: 0xC0 (node busy) for a read from a cache the agent could not confirm in time (a
    # busy kubesim, as the Redfish 503 above). Ironic runs ipmitool again on such failures; so does this, saying why.
    for attempt in range(1, IPMI_TRIES + 1):
        result = subprocess.run(["ipmitool", "-I", "lanplus", "-C", "17", "-H", "127.0.0.1", "-p",
                                 str(entry["ipmiPort"]), "-U", USER, "-P", PASSWORD, "power", "status"],
                                capture_output=True, text=True, timeout=60)
        if "Chassis Power is" in result.stdout:
            return True
        why = " / ".join(result.stderr.strip().splitlines()[-2:]) or f"exit {result.returncode}, no output"
        print(f"member {entry['name']}: ipmitool power status failed, try {attempt}/{IPMI_TRIES}: {why}", flush=True)
        time.sleep(1)
    return False


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def fds_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_seconds(pid: int) -> float:
    """User and system CPU time the process has used (/proc/PID/stat utime + stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(pids: list[int], seconds: float) -> list[float]:
    """Each process's CPU use over `seconds` while nothing talks to it, in percent of one core."""
    before = [cpu_seconds(pid) for pid in pids]
    time.sleep(seconds)
    return [(cpu_seconds(pid) - b) / seconds * 100 for pid, b in zip(pids, before, strict=True)]


@dataclass
class Row:
    agent: str
    members: int
    rss: float  # MB
    pss: float  # MB
    threads: int
    fds: int
    ready_s: float  # seconds from the config change to every member serving
    answered: int  # members whose IPMI answered `power status`


@dataclass
class Point:
    """One size of the pool curve: the pool at rest, and one member's Redfish latency next to the dedicated
    agent's, measured alternately in the same minute."""

    members: int
    fds: int
    threads: int
    idle_cpu: float  # % of one core, the pool's process
    dedicated_idle_cpu: float
    answered: int
    member_ms: tuple[float, float]  # p50, p99 (one connection)
    dedicated_ms: tuple[float, float]


def start_pool(flags: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vbmc", "agent", "--pool", "bench", *flags, "--address", "127.0.0.1",
         "--redfish-address", f"127.0.0.1:{port}", "--log-level", "warning"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/readyz", timeout=60)
    except BaseException:
        stop(proc)
        raise
    return proc, url


def grow_pool(name: str, pool: subprocess.Popen[bytes], url: str, entries: list[dict[str, Any]],
              sizes: list[int], set_members: Any, at_size: Any = None) -> list[Row]:
    """For each size: the pool's config set to that many members, every one of them touched, then its memory,
    threads and descriptors; then `at_size(size, row)` (the curve's measures at rest)."""
    from concurrent.futures import ThreadPoolExecutor

    rows = []
    for size in sizes:
        began = time.monotonic()
        set_members(entries[:size])
        deadline = time.monotonic() + 180
        while metric(url, "kubevbmc_agent_pool_members_ready") != size:
            if time.monotonic() > deadline:
                raise SystemExit(f"the pool did not serve {size} members within 180 s")
            time.sleep(0.2)
        ready_s = time.monotonic() - began
        with ThreadPoolExecutor(8) as workers:
            answered = sum(workers.map(touch, entries[:size]))
        time.sleep(2)  # first requests' allocations settle
        rss, pss = memory_of([pool.pid, *children(pool.pid)])
        row = Row(name, size, rss, pss, threads_of(pool.pid), fds_of(pool.pid), ready_s, answered)
        rows.append(row)
        if at_size is not None:
            at_size(size, row)
    return rows


def bench_pool(sim: Any, kv_agent: subprocess.Popen[Any], kv_ipmi: int, kv_http: int, sizes: list[int],
               seconds: float, idle_seconds: float, commands: int) -> None:
    """The pool grown through `sizes` (the Secret updated, as the controller does), PSS after every member
    answered; the memory backend's figures as the floor (no watches, no cached VMs); at each size the curve
    (descriptors, threads, CPU at rest, one member's Redfish latency next to the dedicated agent's); then one member
    of the full pool against the dedicated agent, side by side."""
    from tests.support.vms import make_bmc, make_vm

    members = sizes[-1]
    api = sim.api()
    entries = pool_entries(members)
    for entry in entries:
        make_vm(api, POOL_NS, entry["vm"])
        make_bmc(api, POOL_NS, entry["vm"])
    dedicated_rss, dedicated_pss = memory_of([kv_agent.pid])
    rows = [Row("dedicated agent", 1, dedicated_rss, dedicated_pss, threads_of(kv_agent.pid), fds_of(kv_agent.pid),
                0.0, 1)]

    pool_dir = Path(tempfile.mkdtemp(prefix="bench-pool-"))
    pool_file = pool_dir / "pool.json"
    memory_entries = pool_entries(members)

    def write(members_: list[dict[str, Any]]) -> None:
        pool_file.write_text(json.dumps({"members": members_}))

    write(memory_entries[:1])
    floor, floor_url = start_pool(["--backend", "memory", "--pool-file", str(pool_file)])
    try:
        rows += grow_pool("pool (memory)", floor, floor_url, memory_entries, [1, members], write)
    finally:
        stop(floor)
        shutil.rmtree(pool_dir, ignore_errors=True)

    auth = {"Authorization": "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}
    dedicated_url = f"http://127.0.0.1:{kv_http}/redfish/v1/Systems/vm"
    curve: list[Point] = []
    set_pool(api, entries[:1])
    pool, url = start_pool(["--namespace", POOL_NS, "--pool-secret", POOL_SECRET], {"KUBECONFIG": sim.kubeconfig})

    def at_size(size: int, row: Row) -> None:
        if size == 1:
            return
        # At rest: once what the touches set going (members' first status reports, cache confirmations) is over;
        # the last of at most three windows.
        for _ in range(3):
            pool_cpu, dedicated_cpu = idle_cpu([pool.pid, kv_agent.pid], idle_seconds)
            if pool_cpu < 2:
                break
            print(f"(pool of {size}: {pool_cpu:.1f}% of a core over {idle_seconds:.0f} s after the touches; "
                  "measured again)", flush=True)
        member = entries[size // 2]
        member_url = f"http://127.0.0.1:{member['httpPort']}/redfish/v1/Systems/{member['vm']}"
        latency: dict[str, list[tuple[float, float]]] = {"member": [], "dedicated": []}
        for _ in range(2):  # alternated, so that whatever else the machine does weighs on both alike
            for which, target in (("dedicated", dedicated_url), ("member", member_url)):
                r = wrk(target, max(1.0, seconds / 2), auth, 1)
                latency[which].append((r["p50_ms"], r["p99_ms"]))
        best = {k: (min(p for p, _ in v), min(q for _, q in v)) for k, v in latency.items()}
        curve.append(Point(size, row.fds, row.threads, pool_cpu, dedicated_cpu, row.answered, best["member"],
                           best["dedicated"]))
        p = curve[-1]
        print(f"(pool of {size}: {p.fds} fds, {p.threads} threads, idle CPU {p.idle_cpu:.1f}%, IPMI "
              f"{p.answered}/{size}, member p50/p99 {p.member_ms[0]:.2f}/{p.member_ms[1]:.2f} ms, dedicated "
              f"{p.dedicated_ms[0]:.2f}/{p.dedicated_ms[1]:.2f} ms)", flush=True)

    try:
        rows += grow_pool("pool (kubevirt)", pool, url, entries, sorted({1, *sizes}), lambda m: set_pool(api, m),
                          at_size)
        print("Pooled agent memory (PSS after every member answered IPMI and Redfish; kubevirt: VMs of kubesim, "
              "members added through the pool Secret)")
        print(f"{'agent':<20}{'members':>8}{'RSS (MB)':>10}{'PSS (MB)':>10}{'threads':>9}{'fds':>7}"
              f"{'serving after (s)':>19}")
        for r in rows:
            print(f"{r.agent:<20}{r.members:>8}{r.rss:>10.1f}{r.pss:>10.1f}{r.threads:>9}{r.fds:>7}"
                  f"{(f'{r.ready_s:.1f}' if r.agent.startswith('pool') else '-'):>19}")
        for name in ("pool (memory)", "pool (kubevirt)"):
            mine = [r for r in rows if r.agent == name]
            first, last = mine[0], mine[-1]
            per_member = (last.pss - first.pss) / max(1, last.members - first.members)
            print(f"{name}: {per_member:.2f} MB PSS per extra member ({first.members} -> {last.members}), "
                  f"{last.members} members in {last.pss:.1f} MB")
        kv = [r for r in rows if r.agent == "pool (kubevirt)"]
        per_member = (kv[-1].pss - kv[0].pss) / max(1, kv[-1].members - kv[0].members)
        print(f"targets (kubevirt): <= 2 MB per extra member: {'met' if per_member <= 2 else 'NOT met'}; "
              f"100 members under 250 MB: "
              f"{'met' if any(r.members == 100 and r.pss < 250 for r in kv) else 'NOT met'}; "
              f"as many dedicated agents: {kv[-1].members * dedicated_pss:.0f} MB")
        print()
        print_curve(curve, kv, idle_seconds, seconds, rows[0])
        bench_pool_latency(entries[members // 2], kv_ipmi, kv_http, members, seconds, commands)
    finally:
        stop(pool)


def print_curve(curve: list[Point], kv: list[Row], idle_seconds: float, seconds: float, dedicated: Row) -> None:
    print(f"Pool curve (kubevirt on kubesim, IPMI and Redfish on, every member touched): descriptors, threads, CPU at "
          f"rest over {idle_seconds:.0f} s (utime+stime, % of one core), IPMI answered, and one member's Redfish GET "
          f"System (1 connection, best of 2 x {seconds / 2:.0f} s) next to the dedicated agent's, alternated")
    print(f"{'members':>8}{'fds':>7}{'threads':>9}{'idle CPU':>10}{'ded. CPU':>10}{'IPMI':>11}"
          f"{'p50 (ms)':>10}{'ded. p50':>10}{'p99 (ms)':>10}{'ded. p99':>10}{'p50 x':>7}{'p99 x':>7}")
    print(f"{'dedicated':>8}{dedicated.fds:>7}{dedicated.threads:>9}")
    for p in curve:
        print(f"{p.members:>8}{p.fds:>7}{p.threads:>9}{p.idle_cpu:>9.1f}%{p.dedicated_idle_cpu:>9.1f}%"
              f"{f'{p.answered}/{p.members}':>11}{p.member_ms[0]:>10.2f}{p.dedicated_ms[0]:>10.2f}"
              f"{p.member_ms[1]:>10.2f}{p.dedicated_ms[1]:>10.2f}{p.member_ms[0] / p.dedicated_ms[0]:>7.2f}"
              f"{p.member_ms[1] / p.dedicated_ms[1]:>7.2f}")
    if len(curve) >= 2:
        first, last = curve[0], curve[-1]
        span = max(1, last.members - first.members)
        print(f"per extra member ({first.members} -> {last.members}): {(last.fds - first.fds) / span:.2f} "
              f"descriptors, {(last.threads - first.threads) / span:.2f} threads")
    if curve:
        last = curve[-1]
        ratio = max(last.member_ms[0] / last.dedicated_ms[0], last.member_ms[1] / last.dedicated_ms[1])
        print(f"targets ({last.members} members): idle CPU about 0% (< 2%): "
              f"{'met' if last.idle_cpu < 2 else 'NOT met'}; IPMI answers every member: "
              f"{'met' if all(p.answered == p.members for p in curve) else 'NOT met'}; member p50 and p99 within 1.5x "
              f"the dedicated agent's: {'met' if ratio <= 1.5 else 'NOT met'} ({ratio:.2f}x)")
    print()


def bench_pool_latency(member: dict[str, Any], kv_ipmi: int, kv_http: int, members: int, seconds: float,
                       commands: int) -> None:
    auth = {"Authorization": "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}
    targets = {"dedicated agent": (kv_ipmi, f"http://127.0.0.1:{kv_http}/redfish/v1/Systems/vm"),
               f"pool member ({members})": (member["ipmiPort"], f"http://127.0.0.1:{member['httpPort']}"
                                                                 f"/redfish/v1/Systems/{member['vm']}")}
    print(f"Latency: one member of the {members}-member pool and the dedicated agent (both kubevirt on kubesim), "
          f"alternating; IPMI best of 3 sessions of {commands}, wrk {seconds:.0f} s per row")
    print(f"{'agent':<22}{'IPMI s17 (ms)':>14}{'1c p50':>8}{'1c p99':>8}{'8c p50':>8}{'8c p99':>8}{'8c req/s':>10}")
    results: dict[str, dict[str, float]] = {name: {"ipmi": float("inf")} for name in targets}
    for _ in range(3):
        for name, (ipmi_port, _url) in targets.items():
            results[name]["ipmi"] = min(results[name]["ipmi"], ipmi_session(ipmi_port, commands, "17"))
    for conns in (1, 8):
        for name, (_port, system_url) in targets.items():
            r = wrk(system_url, seconds, auth, conns)
            results[name][f"{conns}c_p50"], results[name][f"{conns}c_p99"] = r["p50_ms"], r["p99_ms"]
            if conns == 8:
                results[name]["rate"] = r["rate"]
    for name, r in results.items():
        print(f"{name:<22}{r['ipmi'] * 1000:>14.3f}{r['1c_p50']:>8.2f}{r['1c_p99']:>8.2f}{r['8c_p50']:>8.2f}"
              f"{r['8c_p99']:>8.2f}{r['rate']:>10.0f}")
    mine, peer = results[f"pool member ({members})"], results["dedicated agent"]
    ratios = {"IPMI": mine["ipmi"] / peer["ipmi"], "Redfish p50 (1c)": mine["1c_p50"] / peer["1c_p50"],
              "Redfish p50 (8c)": mine["8c_p50"] / peer["8c_p50"]}
    tails = {"p99 (1c)": mine["1c_p99"] / peer["1c_p99"], "p99 (8c)": mine["8c_p99"] / peer["8c_p99"]}
    print("pool member / dedicated: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
          + f" (target <= 1.5x: {'met' if max(ratios.values()) <= 1.5 else 'NOT met'}); Redfish "
          + ", ".join(f"{k} {v:.2f}x" for k, v in tails.items()) + " (a few slow requests in a short run)")
    print()


def bench_peers(peers: list[subprocess.Popen[Any]], args: argparse.Namespace, kv_ipmi: int, kv_http: int) -> None:
    """IPMI and Redfish next to pyghmi's fake BMC and sushy-tools (started here, appended to `peers`)."""
    mem_ipmi, mem_http, fake_ipmi, sushy_port = (free_port(socket.SOCK_DGRAM), free_port(),
                                                 free_port(socket.SOCK_DGRAM), free_port())
    peers.append(start_agent(mem_ipmi, mem_http, "--backend", "memory"))
    peers.append(subprocess.Popen([str(BIN / "fakebmc"), "--port", str(fake_ipmi)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL))
    peers.append(subprocess.Popen([str(BIN / "sushy-emulator"), "--fake", "-i", "127.0.0.1", "-p", str(sushy_port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    wait_http(f"http://127.0.0.1:{sushy_port}/redfish/v1/Systems")
    with urllib.request.urlopen(f"http://127.0.0.1:{sushy_port}/redfish/v1/Systems", timeout=5) as resp:
        peer_system = json.loads(resp.read())["Members"][0]["@odata.id"]
    bench_ipmi({"kubevbmc (memory)": mem_ipmi, "kubevbmc (kubevirt)": kv_ipmi, "pyghmi fakebmc": fake_ipmi},
               args.commands)
    bench_redfish({"kubevbmc (memory)": f"http://127.0.0.1:{mem_http}/redfish/v1/Systems/vm",
                   "kubevbmc (kubevirt)": f"http://127.0.0.1:{kv_http}/redfish/v1/Systems/vm",
                   "sushy-tools fake": f"http://127.0.0.1:{sushy_port}{peer_system}"}, args.seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8, help="wrk duration per row (default %(default)s)")
    parser.add_argument("--commands", type=int, default=500, help="IPMI commands per session (default %(default)s)")
    parser.add_argument("--pool-members", type=int, default=500,
                        help="members of the pooled agent's largest size; 0 skips the pool (default %(default)s)")
    parser.add_argument("--pool-seconds", type=float, default=4,
                        help="wrk duration per row of the pool's latency (default %(default)s)")
    parser.add_argument("--idle-seconds", type=float, default=10,
                        help="how long the pool's CPU at rest is measured at each size (default %(default)s)")
    parser.add_argument("--pool-sizes", default="", metavar="N,N,...",
                        help="the pool sizes measured, instead of 10, 100, 300 and --pool-members")
    parser.add_argument("--pool-only", action="store_true",
                        help="only the pool curve and the pool's figures (the dedicated agent as their peer)")
    args = parser.parse_args()
    for tool in ("ipmitool", "wrk"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is needed: apt-get install {tool}")
    workdir = Path(tempfile.mkdtemp(prefix="bench-agent-"))
    peers: list[subprocess.Popen[Any]] = []  # stopped at the end, whatever happens
    sim: Any = None
    try:
        sim, kv_agent, kv_ipmi, kv_http = kubevirt_agent(workdir)
        peers.append(kv_agent)
        if not args.pool_only:
            bench_peers(peers, args, kv_ipmi, kv_http)
            bench_memory(kv_agent)
        if args.pool_members > 0:
            sizes = sorted(int(n) for n in args.pool_sizes.split(",")) if args.pool_sizes else sorted(
                {*(n for n in POOL_CURVE if n < args.pool_members), args.pool_members})
            bench_pool(sim, kv_agent, kv_ipmi, kv_http, sizes, args.pool_seconds, args.idle_seconds, args.commands)
    finally:
        for proc in peers:
            stop(proc)
        if sim is not None:
            sim.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
