"""A long IPMI fuzz run against a real agent process (memory backend), and a session-table flood next to it.

1. Fuzz: N seeded datagrams (a quarter random bytes, the rest mutations of well-formed ones: pings, session-less
   requests, Open Session, RAKP 1/3, authenticated session packets of a live session) from 127.0.0.2. Every answer
   must be a well-formed RMCP packet; every 100 datagrams a presence ping must come back (the BMC still reads, and
   has read everything before it: the rate is what the BMC processed, not what the kernel dropped).
   Afterwards the session that was fed to the fuzzer and a fresh ipmitool must both work, the agent must be
   alive, its log free of tracebacks, and its memory about where it started.
2. Flood: Open Session Requests from 64 ports of 127.0.0.2 for S seconds while ipmitool logs in from 127.0.0.1
   again and again; every ipmitool run must succeed.

Loopback only; bounded in count and time. Needs ipmitool. Usage:
    PYTHONPATH=. python bench/ipmi_fuzz.py [--datagrams 100000] [--seed 1] [--flood-seconds 10]
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.ipmi.client import (  # noqa: E402
    OPEN_REQUEST,
    Console,
    fuzz_corpus,
    mutate,
    open_session_request,
    setup_packet,
    sync,
    well_formed,
)

USER, PASSWORD = "admin", "fuzz-Passw0rd"
ATTACKER = "127.0.0.2"


def free_port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kib(pid: int) -> int:
    """Resident memory of a process and its children (gunicorn master + worker)."""
    total = 0
    for task in [pid, *children(pid)]:
        try:
            for line in Path(f"/proc/{task}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def children(pid: int) -> list[int]:
    try:
        found = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return found + [g for c in found for g in children(c)]


def ipmitool(port: int, *args: str) -> tuple[bool, float]:
    started = time.perf_counter()
    result = subprocess.run(["ipmitool", "-I", "lanplus", "-C", "17", "-H", "127.0.0.1", "-p", str(port), "-U", USER,
                             "-P", PASSWORD, "-R", "3", "-N", "1", *args], capture_output=True, text=True, timeout=30)
    return result.returncode == 0, time.perf_counter() - started


def start_agent(log_path: Path) -> tuple[subprocess.Popen[bytes], int, int]:
    ipmi_port, http_port = free_port(socket.SOCK_DGRAM), free_port(socket.SOCK_STREAM)
    log = log_path.open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "vbmc", "agent", "--backend", "memory", "--vm", "fuzz", "--ipmi-address",
         f"127.0.0.1:{ipmi_port}", "--redfish-address", f"127.0.0.1:{http_port}"],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        env={**os.environ, "VBMC_USERNAME": USER, "VBMC_PASSWORD": PASSWORD})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readyz", timeout=1) as resp:
                if resp.status == 200:
                    return process, ipmi_port, http_port
        except OSError:
            pass
        if process.poll() is not None:
            break
        time.sleep(0.1)
    process.kill()
    raise SystemExit(f"the agent did not become ready; see {log_path}")


def fuzz(port: int, pid: int, datagrams: int, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    address = ("127.0.0.1", port)
    rss_before = rss_kib(pid)
    syncs: list[float] = []
    answers = malformed = 0
    with Console(address) as owner, Console(address, ATTACKER) as fuzzer:
        assert owner.login(USER, PASSWORD) == (4, 0), "the owner could not log in before fuzzing"
        corpus = fuzz_corpus(owner)
        fuzzer.sock.setblocking(False)
        started = time.perf_counter()
        for i in range(datagrams):
            packet = rng.randbytes(rng.randint(0, 300)) if i % 4 == 0 else mutate(rng, rng.choice(corpus))
            fuzzer.send(packet)
            if i % 100 == 99:  # the BMC has read all before: nothing lost to a full socket buffer
                synced = time.perf_counter()
                answers += sync(fuzzer)
                syncs.append(time.perf_counter() - synced)
            while True:
                try:
                    answer, _ = fuzzer.sock.recvfrom(4096)
                except BlockingIOError:
                    break
                answers += 1
                malformed += not well_formed(answer)
        elapsed = time.perf_counter() - started
        owner.sock.settimeout(1)
        reply = owner.request(0x06, 0x01, seq=7, attempts=5)
        owner_ok = reply is not None and reply.payload[6] == 0
    return {"datagrams": datagrams, "seconds": round(elapsed, 1), "per_second": round(datagrams / elapsed),
            "answers": answers, "malformed_answers": malformed,
            "ping_sync_ms_median": round(statistics.median(syncs) * 1000, 1),
            "ping_sync_ms_max": round(max(syncs) * 1000, 1), "owner_session_still_serves": owner_ok,
            "rss_kib_before": rss_before, "rss_kib_after": rss_kib(pid)}


def flood(port: int, seconds: float) -> dict[str, object]:
    stop = threading.Event()
    sent = [0]

    def run() -> None:
        sockets = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(64)]
        for sock in sockets:
            sock.bind((ATTACKER, 0))
        try:
            while not stop.is_set():
                for n, sock in enumerate(sockets):
                    sock.sendto(setup_packet(OPEN_REQUEST, open_session_request(n.to_bytes(4, "little"))),
                                ("127.0.0.1", port))
                    sent[0] += 1
                stop.wait(0.01)
        finally:
            for sock in sockets:
                sock.close()

    flooder = threading.Thread(target=run, daemon=True)
    flooder.start()
    runs: list[tuple[bool, float]] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        runs.append(ipmitool(port, "power", "status"))
    stop.set()
    flooder.join()
    times = sorted(t for _, t in runs)
    return {"flood_requests": sent[0], "ipmitool_runs": len(runs), "ipmitool_failures": sum(not ok for ok, _ in runs),
            "ipmitool_s_median": round(statistics.median(times), 3), "ipmitool_s_max": round(times[-1], 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datagrams", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--flood-seconds", type=float, default=10.0)
    args = parser.parse_args()
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"ipmi-fuzz-agent-{os.getpid()}.log"
    process, ipmi_port, _ = start_agent(log_path)
    try:
        results = fuzz(ipmi_port, process.pid, args.datagrams, args.seed)
        ok_after, _ = ipmitool(ipmi_port, "power", "status")
        results["ipmitool_after_fuzz"] = ok_after
        results.update(flood(ipmi_port, args.flood_seconds))
        results["agent_alive"] = process.poll() is None
    finally:
        process.terminate()
        process.wait(timeout=10)
    text = log_path.read_text()
    results["tracebacks_in_log"] = text.count("Traceback")
    for key, value in results.items():
        print(f"{key:28} {value}")
    good = (results["malformed_answers"] == 0 and results["owner_session_still_serves"] and ok_after
            and results["ipmitool_failures"] == 0 and results["agent_alive"] and results["tracebacks_in_log"] == 0)
    print("PASS" if good else f"FAIL (agent log: {log_path})")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
