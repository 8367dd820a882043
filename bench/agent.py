"""The agent's targets, each measured next to a peer in the same run.

- IPMI: `power status` repeated inside one ipmitool session (`ipmitool exec`), against pyghmi's fake BMC.
- Redfish: GET of the System with 8 keep-alive connections (wrk), against sushy-tools' fake driver.
- Memory: every process of one agent (one since the Redfish server is hypercorn's event loop in the agent's
  process) serving a VM of a kubesim cluster.
- Pool (issue 14): one pooled agent (`kubevbmc agent --pool`, its members in a Secret) serving 1, 10 and
  --pool-members VMs of the same kubesim cluster: PSS per extra member, and the latency of one member of the full
  pool next to the dedicated agent's, measured again side by side.

Every load is bounded in count and time and sent to 127.0.0.1 only. Needs ipmitool and wrk (Debian packages)
and the `bench` extra (sushy-tools). Usage: python bench/agent.py [--seconds S] [--commands N] [--pool-members N]
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
import urllib.request
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
    script = Path(tempfile.mkstemp(suffix=".ipmi")[1])
    script.write_text("power status\n" * commands)
    began = time.perf_counter()
    result = subprocess.run(["ipmitool", "-I", "lanplus", "-C", cipher, "-H", "127.0.0.1", "-p", str(port),
                             "-U", USER, "-P", PASSWORD, "exec", str(script)],
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


def kubevirt_agent() -> tuple[Any, subprocess.Popen[Any], int, int]:
    """A kubesim cluster with one VM and its VirtualMachineBMC, and an agent for it."""
    sys.path.insert(0, str(REPO))
    import yaml

    from tests.support.cluster import BMC_CRD, call, start_sim, wait_for
    from tests.support.vms import make_bmc, make_vm

    sim = start_sim(Path(tempfile.mkdtemp(prefix="bench-agent-")) / "sim")
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
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else float("nan")


def touch(entry: dict[str, Any]) -> None:
    """One Redfish GET of the member's System and one IPMI power status: every part of it has served."""
    auth = {"Authorization": "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}
    url = f"http://127.0.0.1:{entry['httpPort']}/redfish/v1/Systems/{entry['vm']}"
    with urllib.request.urlopen(urllib.request.Request(url, headers=auth), timeout=10) as resp:
        resp.read()
    result = subprocess.run(["ipmitool", "-I", "lanplus", "-C", "17", "-H", "127.0.0.1", "-p",
                             str(entry["ipmiPort"]), "-U", USER, "-P", PASSWORD, "power", "status"],
                            capture_output=True, text=True, timeout=30)
    if "Chassis Power is" not in result.stdout:
        raise SystemExit(f"member {entry['name']}: ipmitool: {result.stderr[-300:]}")


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


Row = tuple[str, int, float, float, int, float]  # agent, members, RSS, PSS, threads, seconds to serve them


def start_pool(flags: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vbmc", "agent", "--pool", "bench", *flags, "--address", "127.0.0.1",
         "--redfish-address", f"127.0.0.1:{port}", "--log-level", "warning"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/readyz", timeout=60)
    return proc, url


def grow_pool(name: str, pool: subprocess.Popen[bytes], url: str, entries: list[dict[str, Any]],
              sizes: list[int], set_members: Any) -> list[Row]:
    """For each size: the pool's config set to that many members, every one of them touched, then its memory."""
    from concurrent.futures import ThreadPoolExecutor

    rows = []
    for size in sizes:
        began = time.monotonic()
        set_members(entries[:size])
        deadline = time.monotonic() + 120
        while metric(url, "kubevbmc_agent_pool_members_ready") != size:
            if time.monotonic() > deadline:
                raise SystemExit(f"the pool did not serve {size} members within 120 s")
            time.sleep(0.2)
        ready_s = time.monotonic() - began
        with ThreadPoolExecutor(8) as workers:
            list(workers.map(touch, entries[:size]))
        time.sleep(2)  # first requests' allocations settle
        rss, pss = memory_of([pool.pid, *children(pool.pid)])
        rows.append((name, size, rss, pss, threads_of(pool.pid), ready_s))
    return rows


def bench_pool(sim: Any, kv_agent: subprocess.Popen[Any], kv_ipmi: int, kv_http: int, members: int,
               seconds: float, commands: int) -> None:
    """The pool grown to 1, 10 and `members` members (the Secret updated, as the controller does), PSS after
    every member answered; the memory backend's figures as the floor (no watches, no cached VMs); then one member
    of the full pool against the dedicated agent, side by side."""
    from tests.support.vms import make_bmc, make_vm

    api = sim.api()
    entries = pool_entries(members)
    for entry in entries:
        make_vm(api, POOL_NS, entry["vm"])
        make_bmc(api, POOL_NS, entry["vm"])
    sizes = sorted({1, min(10, members), members})
    dedicated_rss, dedicated_pss = memory_of([kv_agent.pid])
    rows: list[Row] = [("dedicated agent", 1, dedicated_rss, dedicated_pss, threads_of(kv_agent.pid), 0.0)]

    pool_file = Path(tempfile.mkdtemp(prefix="bench-pool-")) / "pool.json"
    memory_entries = pool_entries(members)

    def write(members_: list[dict[str, Any]]) -> None:
        pool_file.write_text(json.dumps({"members": members_}))

    write(memory_entries[:1])
    floor, floor_url = start_pool(["--backend", "memory", "--pool-file", str(pool_file)])
    try:
        rows += grow_pool("pool (memory)", floor, floor_url, memory_entries, [1, members], write)
    finally:
        stop(floor)

    set_pool(api, entries[:1])
    pool, url = start_pool(["--namespace", POOL_NS, "--pool-secret", POOL_SECRET], {"KUBECONFIG": sim.kubeconfig})
    try:
        rows += grow_pool("pool (kubevirt)", pool, url, entries, sizes, lambda m: set_pool(api, m))
        print("Pooled agent memory (PSS after every member answered IPMI and Redfish; kubevirt: VMs of kubesim, "
              "members added through the pool Secret)")
        print(f"{'agent':<20}{'members':>8}{'RSS (MB)':>10}{'PSS (MB)':>10}{'threads':>9}{'serving after (s)':>19}")
        for name, size, rss, pss, threads, ready_s in rows:
            print(f"{name:<20}{size:>8}{rss:>10.1f}{pss:>10.1f}{threads:>9}"
                  f"{(f'{ready_s:.1f}' if name.startswith('pool') else '-'):>19}")
        for name in ("pool (memory)", "pool (kubevirt)"):
            mine = [r for r in rows if r[0] == name]
            first, last = mine[0], mine[-1]
            per_member = (last[3] - first[3]) / max(1, last[1] - first[1])
            print(f"{name}: {per_member:.2f} MB PSS per extra member ({first[1]} -> {last[1]}), {last[1]} members "
                  f"in {last[3]:.1f} MB")
        kv = [r for r in rows if r[0] == "pool (kubevirt)"]
        threads_per_member = (kv[-1][4] - kv[0][4]) / max(1, kv[-1][1] - kv[0][1])
        print(f"pool (kubevirt): {threads_per_member:.2f} threads per extra member, every member touched (its IPMI "
              f"server, its first Redfish worker); before issue 21: 8 (3 watches, 3 watch probes, IPMI server and "
              f"its writer); a dedicated agent: {rows[0][4]} in all")
        per_member = (kv[-1][3] - kv[0][3]) / max(1, kv[-1][1] - kv[0][1])
        print(f"targets (kubevirt): <= 2 MB per extra member: {'met' if per_member <= 2 else 'NOT met'}; "
              f"100 members under 250 MB: {'met' if kv[-1][1] >= 100 and kv[-1][3] < 250 else 'NOT met'}; "
              f"as many dedicated agents: {kv[-1][1] * dedicated_pss:.0f} MB")
        print()
        member = entries[members // 2]
        bench_pool_latency(member, kv_ipmi, kv_http, members, seconds, commands)
    finally:
        stop(pool)


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8, help="wrk duration per row (default %(default)s)")
    parser.add_argument("--commands", type=int, default=500, help="IPMI commands per session (default %(default)s)")
    parser.add_argument("--pool-members", type=int, default=100,
                        help="members of the pooled agent's largest size; 0 skips the pool (default %(default)s)")
    parser.add_argument("--pool-seconds", type=float, default=4,
                        help="wrk duration per row of the pool's latency (default %(default)s)")
    args = parser.parse_args()
    for tool in ("ipmitool", "wrk"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is needed: apt-get install {tool}")
    mem_ipmi, mem_http, fake_ipmi, sushy_port = (free_port(socket.SOCK_DGRAM), free_port(),
                                                 free_port(socket.SOCK_DGRAM), free_port())
    memory_agent = start_agent(mem_ipmi, mem_http, "--backend", "memory")
    fakebmc = subprocess.Popen([str(BIN / "fakebmc"), "--port", str(fake_ipmi)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    sushy_tools = subprocess.Popen([str(BIN / "sushy-emulator"), "--fake", "-i", "127.0.0.1", "-p", str(sushy_port)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sim, kv_agent, kv_ipmi, kv_http = kubevirt_agent()
    try:
        wait_http(f"http://127.0.0.1:{sushy_port}/redfish/v1/Systems")
        with urllib.request.urlopen(f"http://127.0.0.1:{sushy_port}/redfish/v1/Systems", timeout=5) as resp:
            peer_system = json.loads(resp.read())["Members"][0]["@odata.id"]
        bench_ipmi({"kubevbmc (memory)": mem_ipmi, "kubevbmc (kubevirt)": kv_ipmi, "pyghmi fakebmc": fake_ipmi},
                   args.commands)
        bench_redfish({"kubevbmc (memory)": f"http://127.0.0.1:{mem_http}/redfish/v1/Systems/vm",
                       "kubevbmc (kubevirt)": f"http://127.0.0.1:{kv_http}/redfish/v1/Systems/vm",
                       "sushy-tools fake": f"http://127.0.0.1:{sushy_port}{peer_system}"}, args.seconds)
        bench_memory(kv_agent)
        if args.pool_members > 0:
            bench_pool(sim, kv_agent, kv_ipmi, kv_http, args.pool_members, args.pool_seconds, args.commands)
    finally:
        for proc in (memory_agent, kv_agent):
            stop(proc)
        for proc in (fakebmc, sushy_tools):
            proc.terminate()
            proc.wait(timeout=5)
        sim.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
