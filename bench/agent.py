"""The agent's targets, each measured next to a peer in the same run.

- IPMI: `power status` repeated inside one ipmitool session (`ipmitool exec`), against pyghmi's fake BMC.
- Redfish: GET of the System with 8 keep-alive connections (wrk), against sushy-tools' fake driver.
- Memory: every process of one agent (gunicorn master + worker) serving a VM of a kubesim cluster.

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


def bench_ipmi(commands: int) -> None:
    agent_ipmi, agent_http, peer_port = free_port(socket.SOCK_DGRAM), free_port(), free_port(socket.SOCK_DGRAM)
    agent = start_agent(agent_ipmi, agent_http, "--backend", "memory")
    fakebmc = BIN / "fakebmc"
    peer = subprocess.Popen([str(fakebmc), "--port", str(peer_port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)  # fakebmc prints nothing when it is ready; it binds at once
        rows = []
        for cipher in ("3", "17"):
            mine = min(ipmi_session(agent_ipmi, commands, cipher) for _ in range(3))
            try:
                theirs = min(ipmi_session(peer_port, commands, cipher) for _ in range(3))
            except SystemExit:
                theirs = float("nan")  # pyghmi's fake BMC does not negotiate suite 17
            rows.append((cipher, mine, theirs))
    finally:
        stop(agent)
        peer.terminate()
        peer.wait(timeout=5)
    print(f"IPMI `power status` in one ipmitool session ({commands} commands, best of 3)")
    print(f"{'cipher suite':<14}{'kubevbmc (ms)':>16}{'pyghmi fakebmc (ms)':>22}{'speedup':>10}")
    for cipher, mine, theirs in rows:
        speedup = theirs / mine if theirs == theirs else float("nan")
        shown = f"{theirs * 1000:.3f}" if theirs == theirs else "n/a (no suite 17)"
        print(f"{cipher:<14}{mine * 1000:>16.3f}{shown:>22}{speedup:>10.2f}")
    print()


# ---- Redfish


def wrk(url: str, seconds: float, headers: dict[str, str]) -> dict[str, float]:
    args = ["wrk", "-t", "2", "-c", "8", "-d", f"{seconds:.0f}s", "--latency", "--timeout", "5s"]
    for key, value in headers.items():
        args += ["-H", f"{key}: {value}"]
    out = subprocess.run([*args, url], capture_output=True, text=True, timeout=seconds + 30).stdout
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p99 = re.search(r"99%\s+([\d.]+)(us|ms|s)", out)
    assert p99 is not None, out
    factor = {"us": 0.001, "ms": 1.0, "s": 1000.0}[p99.group(2)]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"rate": rate, "p99_ms": float(p99.group(1)) * factor, "errors": float(non2xx.group(1) if non2xx else 0)}


def bench_redfish(seconds: float) -> None:
    ipmi_port, http_port, peer_port = free_port(socket.SOCK_DGRAM), free_port(), free_port()
    agent = start_agent(ipmi_port, http_port, "--backend", "memory")
    peer = subprocess.Popen([str(BIN / "sushy-emulator"), "--fake", "-i", "127.0.0.1", "-p", str(peer_port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{peer_port}/redfish/v1/Systems")
        with urllib.request.urlopen(f"http://127.0.0.1:{peer_port}/redfish/v1/Systems", timeout=5) as resp:
            peer_system = json.loads(resp.read())["Members"][0]["@odata.id"]
        auth = {"Authorization": "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}
        mine = wrk(f"http://127.0.0.1:{http_port}/redfish/v1/Systems/vm", seconds, auth)
        theirs = wrk(f"http://127.0.0.1:{peer_port}{peer_system}", seconds, {})
    finally:
        stop(agent)
        peer.terminate()
        peer.wait(timeout=5)
    print(f"Redfish GET System, 8 keep-alive connections, {seconds:.0f} s each (wrk)")
    print(f"{'':24}{'kubevbmc':>12}{'sushy-tools fake':>18}{'ratio':>8}")
    ratio = mine["rate"] / theirs["rate"]
    print(f"{'requests per second':24}{mine['rate']:>12.0f}{theirs['rate']:>18.0f}{ratio:>8.2f}")
    print(f"{'p99 latency (ms)':24}{mine['p99_ms']:>12.2f}{theirs['p99_ms']:>18.2f}")
    print(f"{'non-2xx answers':24}{mine['errors']:>12.0f}{theirs['errors']:>18.0f}")
    print(f"target: >= 5x the peer and p99 < 20 ms: "
          f"{'met' if mine['rate'] >= 5 * theirs['rate'] and mine['p99_ms'] < 20 else 'NOT met'}")
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


def bench_memory() -> None:
    sys.path.insert(0, str(REPO))
    from tests.conftest import start_sim

    sim = start_sim(Path(tempfile.mkdtemp(prefix="bench-agent-")) / "sim")
    try:
        api = sim.api()
        import yaml

        from tests.conftest import BMC_CRD, call, wait_for
        from tests.vms import make_bmc, make_vm

        crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        call(api, "POST", crds, yaml.safe_load(BMC_CRD.read_text()))
        wait_for(lambda: call(api, "GET", "/apis/bmc.kubevirt.io/v1beta1").status == 200, what="the CRD")
        make_vm(api, "default")
        make_bmc(api, "default")
        ipmi_port, http_port = free_port(socket.SOCK_DGRAM), free_port()
        agent = start_agent(ipmi_port, http_port, "--namespace", "default", "--vmbmc", "vm",
                            env={"KUBECONFIG": sim.kubeconfig})
        try:
            auth = {"Authorization": "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}
            for _ in range(200):  # warm every path once: System, Manager, VirtualMedia, IPMI
                for path in ("/redfish/v1/Systems/vm", "/redfish/v1/Managers/BMC", "/redfish/v1"):
                    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{http_port}{path}",
                                                                  headers=auth), timeout=5).read()
            subprocess.run(["ipmitool", "-I", "lanplus", "-H", "127.0.0.1", "-p", str(ipmi_port), "-U", USER,
                            "-P", PASSWORD, "power", "status"], capture_output=True, timeout=30)
            pids = [agent.pid, *children(agent.pid)]
            rss, pss = memory_of(pids)
        finally:
            stop(agent)
    finally:
        sim.stop()
    print(f"Memory of one agent (kubevirt backend, {len(pids)} processes, after traffic)")
    print(f"{'RSS summed (MB)':24}{rss:>10.1f}   (shared pages counted once per process)")
    print(f"{'PSS summed (MB)':24}{pss:>10.1f}   (shared pages split between processes)")
    print(f"target: under 60 MB: {'met' if pss < 60 else 'NOT met'} by PSS, {'met' if rss < 60 else 'NOT met'} by RSS")
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10, help="wrk duration per server (default %(default)s)")
    parser.add_argument("--commands", type=int, default=500, help="IPMI commands per session (default %(default)s)")
    parser.add_argument("--only", choices=("ipmi", "redfish", "memory"), action="append")
    args = parser.parse_args()
    for tool in ("ipmitool", "wrk"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is needed: apt-get install {tool}")
    parts = args.only or ["ipmi", "redfish", "memory"]
    if "ipmi" in parts:
        bench_ipmi(args.commands)
    if "redfish" in parts:
        bench_redfish(args.seconds)
    if "memory" in parts:
        bench_memory()
    return 0


if __name__ == "__main__":
    sys.exit(main())
