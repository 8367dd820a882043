"""The agent's targets, each measured next to a peer in the same run.

- IPMI: `power status` repeated inside one ipmitool session (`ipmitool exec`), against pyghmi's fake BMC.
- Redfish: GET of the System with 8 keep-alive connections (wrk), against sushy-tools' fake driver.
- Memory: every process of one agent (one since the Redfish server is hypercorn's event loop in the agent's
  process) serving a VM of a kubesim cluster.

Every load is bounded in count and time and sent to 127.0.0.1 only. Needs ipmitool and wrk (Debian packages)
and the `bench` extra (sushy-tools). Usage: python bench/agent.py [--seconds S] [--commands N]
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

    from tests.conftest import BMC_CRD, call, start_sim, wait_for
    from tests.vms import make_bmc, make_vm

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8, help="wrk duration per row (default %(default)s)")
    parser.add_argument("--commands", type=int, default=500, help="IPMI commands per session (default %(default)s)")
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
