"""The Redfish fuzz at scale: seeded random and mutated requests (tests/redfish/fuzz.py) against the Flask app in
process and over HTTP to a running agent (memory backend), one request per connection, sequentially.

Checks every answer (no 5xx but 503, a Redfish JSON error body on every 4xx), counts what the server refused
below Flask (requests it could not hand to the app are skipped, as in the tests), that the agent still serves
afterwards, that its log holds no traceback, and its RSS before and after. Everything goes to 127.0.0.1 only.
Usage: python bench/redfish_fuzz.py [--requests N] [--in-process N] [--seed S]
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.agent import children, free_port, memory_of, wait_http  # noqa: E402
from tests.redfish.fuzz import Fuzzer, answer_problem, send_raw, wsgi_path  # noqa: E402
from vbmc.machine.memory import MemoryMachine  # noqa: E402
from vbmc.redfish.app import create_app  # noqa: E402

USER, PASSWORD, VM = "admin", "fuzz-password", "vm"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def report(title: str, statuses: collections.Counter[int], problems: list[str], took: float, count: int,
           latencies: list[float]) -> None:
    print(title)
    print(f"  requests {count}, {took:.1f} s, {count / took:.0f}/s, p50 {percentile(latencies, 0.5) * 1000:.2f} ms, "
          f"p99 {percentile(latencies, 0.99) * 1000:.2f} ms, max {max(latencies, default=0) * 1000:.1f} ms")
    print("  statuses " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items())))
    print(f"  problems {len(problems)}" + "".join(f"\n    {p}" for p in problems[:20]))


def in_process(seed: int, count: int) -> int:
    errors: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR or record.exc_info:
                errors.append(record.getMessage()[:200])

    logging.getLogger().addHandler(Collect())
    http = create_app(MemoryMachine(VM), USER, PASSWORD).test_client()
    fuzzer = Fuzzer(seed, VM, USER, PASSWORD)
    statuses: collections.Counter[int] = collections.Counter()
    problems: list[str] = []
    latencies: list[float] = []
    began = time.perf_counter()
    for _ in range(count):
        req = fuzzer.request()
        start = time.perf_counter()
        resp = http.open("/", method=req.method, headers=req.headers, data=req.body,
                         environ_overrides=wsgi_path(req.path))
        latencies.append(time.perf_counter() - start)
        statuses[resp.status_code] += 1
        problem = answer_problem(req.method, resp.status_code, resp.content_type or "", resp.get_data())
        if problem:
            problems.append(f"{req.method} {req.path[:80]!r}: {problem}")
    report("In process (Flask test client)", statuses, problems + [f"log: {e}" for e in errors],
           time.perf_counter() - began, count, latencies)
    return len(problems) + len(errors)


def over_http(seed: int, count: int) -> int:
    ipmi_port, http_port = free_port(socket.SOCK_DGRAM), free_port()
    log = Path(tempfile.mkstemp(prefix="redfish-fuzz-", suffix=".log")[1])
    with log.open("w") as out:
        agent = subprocess.Popen(
            [sys.executable, "-m", "vbmc", "agent", "--backend", "memory", "--vm", VM, "--ipmi-address",
             f"127.0.0.1:{ipmi_port}", "--redfish-address", f"127.0.0.1:{http_port}"],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "VBMC_USERNAME": USER, "VBMC_PASSWORD": PASSWORD})
    try:
        wait_http(f"http://127.0.0.1:{http_port}/readyz")
        rss_before = memory_of([agent.pid, *children(agent.pid)])[0]
        fuzzer = Fuzzer(seed, VM, USER, PASSWORD)
        statuses: collections.Counter[int] = collections.Counter()
        problems: list[str] = []
        latencies: list[float] = []
        skipped = sent = 0
        began = time.perf_counter()
        while sent < count:
            req = fuzzer.request()
            if not req.sendable_on_the_wire():
                skipped += 1
                continue
            sent += 1
            start = time.perf_counter()
            status, head, payload = send_raw(http_port, req.method, req.path, req.body, headers=req.headers)
            latencies.append(time.perf_counter() - start)
            statuses[status] += 1
            problem = answer_problem(req.method, status, head.get("content-type", ""), payload)
            if problem:
                problems.append(f"{req.method} {req.path[:80]!r}: {problem}")
        took = time.perf_counter() - began
        rss_after = memory_of([agent.pid, *children(agent.pid)])[0]
        status, _, _ = send_raw(http_port, "GET", f"/redfish/v1/Systems/{VM}", headers={
            "Authorization": Fuzzer(0, VM, USER, PASSWORD).auth})
        tracebacks = log.read_text().count("Traceback")
        report(f"Over HTTP (agent, memory backend; {skipped} generated requests not sendable on the wire skipped)",
               statuses, problems, took, count, latencies)
        print(f"  afterwards: GET of the System {status}, tracebacks in the log {tracebacks}, "
              f"agent RSS {rss_before:.1f} MB before, {rss_after:.1f} MB after")
        return len(problems) + tracebacks + (status != 200)
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=10)
        log.unlink()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10000, help="over HTTP (default %(default)s)")
    parser.add_argument("--in-process", type=int, default=10000, help="through the app (default %(default)s)")
    parser.add_argument("--seed", type=int, default=2026)
    args = parser.parse_args()
    failures = in_process(args.seed, args.in_process) + over_http(args.seed + 1, args.requests)
    print("no 5xx but 503, a Redfish body on every error, still serving: " + ("met" if not failures else "NOT met"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
